//! A mock W&B server (axum on a background tokio runtime, 127.0.0.1:0) that checks the protocol
//! as it goes, and a capture of the sink's `tracing` warnings.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use rlhf_wandb::WandbSettings;
use serde_json::{json, Value};

pub const KEY: &str = "test-key-0123456789";
pub const DEFAULT_ENTITY: &str = "default-entity";

/// How the mock behaves.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// The key it accepts; any other gets 401 everywhere.
    pub api_key: String,
    /// Every GraphQL request gets this status (no body).
    pub graphql_status: Option<u16>,
    /// GraphQL answers 200 with an `errors` list.
    pub graphql_errors: bool,
    pub graphql_delay: Duration,
    /// The first N file-stream requests get 500.
    pub filestream_fail_first: usize,
    /// Every file-stream request gets this status.
    pub filestream_status: Option<u16>,
    pub filestream_delay: Duration,
    /// `historyLineCount` of the run (as if resumed).
    pub history_line_count: u64,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            api_key: KEY.to_string(),
            graphql_status: None,
            graphql_errors: false,
            graphql_delay: Duration::ZERO,
            filestream_fail_first: 0,
            filestream_status: None,
            filestream_delay: Duration::ZERO,
            history_line_count: 0,
        }
    }
}

/// One request as the mock saw it.
#[derive(Debug, Clone)]
pub struct Req {
    pub path: String,
    pub authorization: Option<String>,
    /// `Null` if not JSON.
    pub body: Value,
    /// What the mock answered.
    pub status: u16,
}

impl Req {
    pub fn is_graphql(&self) -> bool {
        self.path == "/graphql"
    }
    pub fn is_file_stream(&self) -> bool {
        self.path.ends_with("/file_stream")
    }
    pub fn history(&self) -> Option<&Value> {
        self.body.pointer("/files/wandb-history.jsonl")
    }
    pub fn summary(&self) -> Option<&Value> {
        self.body.pointer("/files/wandb-summary.json")
    }
}

#[derive(Default)]
struct MockState {
    config: Option<MockConfig>,
    requests: Vec<Req>,
    file_stream_seen: usize,
    /// `/files/{entity}/{project}/{run}/file_stream` of the run created by upsertBucket.
    run_path: Option<String>,
    /// The run's history as stored (lines written at their offsets).
    history: Vec<String>,
    /// Accepted history writes: (offset, lines).
    history_writes: Vec<(u64, usize)>,
    summary: Option<Value>,
    exit_code: Option<i64>,
    heartbeats: usize,
    /// Protocol violations seen.
    errors: Vec<String>,
}

/// A running mock server.
pub struct Mock {
    pub base_url: String,
    state: Arc<Mutex<MockState>>,
}

impl Mock {
    pub fn start(config: MockConfig) -> Mock {
        let history =
            vec![r#"{"_step":-1,"_timestamp":0,"_runtime":0}"#.to_string(); config.history_line_count as usize];
        let state = Arc::new(Mutex::new(MockState { config: Some(config), history, ..Default::default() }));
        let app = Router::new().fallback(handle).with_state(Arc::clone(&state));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        Mock { base_url: format!("http://{addr}"), state }
    }

    fn with<R>(&self, f: impl FnOnce(&MockState) -> R) -> R {
        f(&self.state.lock().unwrap())
    }

    pub fn requests(&self) -> Vec<Req> {
        self.with(|s| s.requests.clone())
    }
    /// The stored history lines, parsed.
    pub fn history(&self) -> Vec<Value> {
        self.with(|s| s.history.iter().map(|l| serde_json::from_str(l).unwrap()).collect())
    }
    pub fn history_writes(&self) -> Vec<(u64, usize)> {
        self.with(|s| s.history_writes.clone())
    }
    pub fn summary(&self) -> Option<Value> {
        self.with(|s| s.summary.clone())
    }
    pub fn exit_code(&self) -> Option<i64> {
        self.with(|s| s.exit_code)
    }
    pub fn heartbeats(&self) -> usize {
        self.with(|s| s.heartbeats)
    }
    pub fn run_path(&self) -> Option<String> {
        self.with(|s| s.run_path.clone())
    }
    /// Protocol violations the mock saw; tests assert this is empty.
    pub fn errors(&self) -> Vec<String> {
        self.with(|s| s.errors.clone())
    }

    /// Settings pointing here, with fast timings for tests.
    pub fn settings(&self, key: &str) -> WandbSettings {
        fast_settings(&self.base_url, key)
    }
}

/// Settings for tests: 20 ms flushes, 3 retries with 10..40 ms backoff, 5 s finish deadline.
pub fn fast_settings(base_url: &str, key: &str) -> WandbSettings {
    let mut s = WandbSettings::new(key, "proj");
    s.base_url = base_url.to_string();
    s.flush_interval = Duration::from_millis(20);
    s.heartbeat_interval = Duration::from_secs(600);
    s.max_retries = 3;
    s.initial_backoff = Duration::from_millis(10);
    s.max_backoff = Duration::from_millis(40);
    s.request_timeout = Duration::from_secs(3);
    s.finish_timeout = Duration::from_secs(5);
    s
}

pub fn basic_auth(user: &str, password: &str) -> String {
    format!("Basic {}", base64(format!("{user}:{password}").as_bytes()))
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn handle(State(state): State<Arc<Mutex<MockState>>>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let authorization = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let config = state.lock().unwrap().config.clone().unwrap();

    let delay = if path == "/graphql" { config.graphql_delay } else { config.filestream_delay };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let (status, reply) = answer(&mut state.lock().unwrap(), &config, &path, authorization.as_deref(), &body);
    state.lock().unwrap().requests.push(Req { path, authorization, body, status: status.as_u16() });
    (status, Json(reply)).into_response()
}

fn answer(s: &mut MockState, config: &MockConfig, path: &str, auth: Option<&str>, body: &Value) -> (StatusCode, Value) {
    if auth != Some(basic_auth("api", &config.api_key).as_str()) {
        return (StatusCode::UNAUTHORIZED, json!({"error": "invalid api key"}));
    }
    if path == "/graphql" {
        if let Some(status) = config.graphql_status {
            return (StatusCode::from_u16(status).unwrap(), json!({"error": "forced"}));
        }
        let query = body["query"].as_str().unwrap_or("");
        if !(query.contains("mutation") && query.contains("upsertBucket(")) {
            s.errors.push(format!("graphql request is not an upsertBucket mutation: {body}"));
            return (StatusCode::BAD_REQUEST, json!({"errors": [{"message": "unknown operation"}]}));
        }
        if config.graphql_errors {
            return (
                StatusCode::OK,
                json!({"errors": [{"message": "permission denied"}], "data": {"upsertBucket": null}}),
            );
        }
        let vars = &body["variables"];
        let name = vars["name"].as_str().unwrap_or("generated").to_string();
        let project = vars["project"].as_str().unwrap_or("uncategorized").to_string();
        let entity = vars["entity"].as_str().unwrap_or(DEFAULT_ENTITY).to_string();
        s.run_path = Some(format!("/files/{entity}/{project}/{name}/file_stream"));
        let display = vars["displayName"].as_str().unwrap_or("mock-run-7").to_string();
        return (
            StatusCode::OK,
            json!({"data": {"upsertBucket": {"bucket": {
                "id": "UnVuOnYxOnN0b3JhZ2U=", "name": name, "displayName": display,
                "historyLineCount": config.history_line_count,
                "project": {"name": project, "entity": {"name": entity}}
            }, "inserted": true}}}),
        );
    }
    if !path.ends_with("/file_stream") {
        s.errors.push(format!("request to unknown path {path}"));
        return (StatusCode::NOT_FOUND, json!({"error": "not found"}));
    }
    if s.run_path.as_deref() != Some(path) {
        s.errors.push(format!("file_stream to {path}, but the run created is {:?}", s.run_path));
        return (StatusCode::NOT_FOUND, json!({"error": "run not found"}));
    }
    s.file_stream_seen += 1;
    if let Some(status) = config.filestream_status {
        return (StatusCode::from_u16(status).unwrap(), json!({"error": "forced"}));
    }
    if s.file_stream_seen <= config.filestream_fail_first {
        return (StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "transient"}));
    }
    if s.exit_code.is_some() {
        s.errors.push(format!("request after complete: {body}"));
    }
    if let Some(history) = body.pointer("/files/wandb-history.jsonl") {
        if s.summary.is_some() {
            s.errors.push("history after the summary".into());
        }
        let offset = history["offset"].as_u64().unwrap_or(u64::MAX);
        let content = history["content"].as_array().cloned().unwrap_or_default();
        if offset != s.history.len() as u64 {
            s.errors.push(format!("history offset {offset}, but {} lines are stored", s.history.len()));
        }
        for (i, line) in content.iter().enumerate() {
            let Some(text) = line.as_str() else {
                s.errors.push(format!("history content item is not a string: {line}"));
                continue;
            };
            match serde_json::from_str::<Value>(text) {
                Ok(v) if v["_step"].is_u64() && v["_timestamp"].is_number() && v["_runtime"].is_number() => {}
                _ => s.errors.push(format!("history line without _step/_timestamp/_runtime: {text}")),
            }
            let at = offset as usize + i;
            if at < s.history.len() {
                s.history[at] = text.to_string();
            } else {
                s.history.push(text.to_string());
            }
        }
        s.history_writes.push((offset, content.len()));
    }
    if let Some(summary) = body.pointer("/files/wandb-summary.json") {
        let content = summary["content"].as_array().cloned().unwrap_or_default();
        if summary["offset"] != 0 || content.len() != 1 {
            s.errors.push(format!("summary must be one line at offset 0: {summary}"));
        }
        match content.first().and_then(Value::as_str).and_then(|t| serde_json::from_str::<Value>(t).ok()) {
            Some(v) if v.is_object() => s.summary = Some(v),
            _ => s.errors.push(format!("summary line is not a JSON object: {summary}")),
        }
    }
    match body.get("complete") {
        Some(Value::Bool(true)) => match body["exitcode"].as_i64() {
            Some(code) => s.exit_code = Some(code),
            None => s.errors.push(format!("complete without exitcode: {body}")),
        },
        Some(Value::Bool(false)) => s.heartbeats += 1,
        _ => {}
    }
    (StatusCode::OK, json!({"exitcode": null, "limits": {}}))
}

/// Runs `f` with a scoped subscriber (inherited by sinks started inside) and returns the
/// warnings `rlhf_wandb` emitted.
pub fn capture_warnings<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    use tracing_subscriber::layer::SubscriberExt;
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(WarnLayer(Arc::clone(&warnings)));
    let result = tracing::subscriber::with_default(subscriber, f);
    let warnings = warnings.lock().unwrap().clone();
    (result, warnings)
}

struct WarnLayer(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for WarnLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() == tracing::Level::WARN && meta.target().starts_with("rlhf_wandb") {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }
}

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}
