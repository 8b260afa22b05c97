//! `env-http` against real HTTP servers on 127.0.0.1 (axum on a background tokio runtime, as in
//! reward-http's tests): a correct episode server, and each fault — stalls, HTTP errors (retried
//! or not), bad bodies, wrong counts, oversized bodies, refused connections, config errors.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::Router;
use rlhf_plugin_api::reward::ChatMessage;
use rlhf_plugin_api::{Action, Context, Environment, Episode, ErrorKind, PluginError, StepOutcome};
use rlhf_plugin_env_http::config::Settings;
use rlhf_plugin_env_http::HttpEnv;
use serde_json::{json, Value};

const TOKEN_VAR: &str = "ENV_HTTP_TEST_TOKEN";

/// Sets the token variable once, before any test reads the environment.
fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var(TOKEN_VAR, "Bearer s3cret"));
}

fn new(config: Value) -> Result<HttpEnv, PluginError> {
    setup();
    HttpEnv::new(&config.to_string(), &Context::default())
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Req {
    /// 0-based arrival number.
    n: usize,
    path: String,
    authorization: Option<String>,
    /// `Null` if the body was not JSON.
    body: Value,
}

/// What the server answers.
struct Reply {
    status: u16,
    body: String,
    delay: Duration,
}

impl Reply {
    fn json(body: Value) -> Reply {
        Reply { status: 200, body: body.to_string(), delay: Duration::ZERO }
    }
    fn raw(status: u16, body: &str) -> Reply {
        Reply { status, body: body.to_string(), delay: Duration::ZERO }
    }
}

type Handler = dyn Fn(&Req) -> Reply + Send + Sync;

struct Shared {
    handler: Box<Handler>,
    log: Mutex<Vec<Req>>,
    count: AtomicUsize,
}

/// An axum server on 127.0.0.1:<ephemeral> answering every path with `handler`.
struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Server {
    fn start(handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let shared = Arc::new(Shared { handler: Box::new(handler), log: Mutex::new(Vec::new()), count: 0.into() });
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(handle).with_state(Arc::clone(&shared));
        runtime.spawn(async move { axum::serve(listener, app).await });
        Server { runtime: Some(runtime), addr, shared }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn requests(&self) -> Vec<Req> {
        let mut log = self.shared.log.lock().unwrap().clone();
        log.sort_by_key(|r| r.n);
        log
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

async fn handle(State(shared): State<Arc<Shared>>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let req = Req {
        n: shared.count.fetch_add(1, Ordering::SeqCst),
        path: uri.path().to_string(),
        authorization: headers.get("authorization").map(|v| v.to_str().unwrap().to_string()),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    shared.log.lock().unwrap().push(req.clone());
    let reply = (shared.handler)(&req);
    tokio::time::sleep(reply.delay).await;
    Response::builder()
        .status(reply.status)
        .header("content-type", "application/json")
        .body(Body::from(reply.body))
        .unwrap()
}

fn episode(id: u64) -> Episode {
    Episode {
        id,
        prompt: format!("P{id}"),
        prompt_ids: vec![1, 2, 3],
        label: (id == 0).then(|| "42".to_string()),
        metadata: json!({"k": id}),
        messages: vec![ChatMessage { role: "user".into(), content: format!("q{id}") }],
    }
}

fn action(id: u64, turn: u32, text: &str) -> Action {
    Action { id, turn, text: text.into(), token_ids: vec![7, 8], ended: false }
}

/// A correct episode server: reset observes `start <prompt>`; episode 0 gets a tool answer at
/// turn 0 and finishes with reward 1 at turn 1; episode 1 fails at turn 0.
fn episodes_server(req: &Req) -> Reply {
    match req.path.as_str() {
        "/env/reset" => {
            let eps = req.body["episodes"].as_array().unwrap();
            let obs: Vec<String> = eps.iter().map(|e| format!("start {}", e["prompt"].as_str().unwrap())).collect();
            Reply::json(json!({ "observations": obs }))
        }
        "/env/step" => {
            let results: Vec<Value> = req.body["actions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| match (a["id"].as_u64().unwrap(), a["turn"].as_u64().unwrap()) {
                    (0, 0) => json!({"observation": "<r>42</r>", "reward": 0.25, "metrics": {"calls": 1}}),
                    (0, _) => json!({"reward": 1.0, "done": true, "metrics": {"correct": 1.0}, "error": null}),
                    _ => json!({"observation": "", "error": "sandbox crashed"}),
                })
                .collect();
            Reply::json(json!({ "results": results }))
        }
        _ => Reply::raw(404, "no such endpoint"),
    }
}

#[test]
fn reset_and_steps_map_through() {
    let server = Server::start(episodes_server);
    let mut env = new(json!({"url": server.url("/env/"), "auth_env": TOKEN_VAR, "stop": ["</calc>"]})).unwrap();
    assert_eq!(env.stop_strings(), vec!["</calc>".to_string()]);

    assert_eq!(env.reset(&[episode(0), episode(1)]).unwrap(), vec!["start P0".to_string(), "start P1".to_string()]);
    let out = env.step(&[action(0, 0, "<calc>6*7</calc>"), action(1, 0, "hmm")]).unwrap();
    assert_eq!(out[0], StepOutcome { reward: 0.25, ..StepOutcome::observe("<r>42</r>").metric("calls", 1.0) });
    assert_eq!(out[1], StepOutcome { done: true, error: Some("sandbox crashed".into()), ..Default::default() });
    let out = env.step(&[action(0, 1, "42")]).unwrap();
    assert_eq!(out, vec![StepOutcome::finish(1.0).metric("correct", 1.0)]);
    // Empty calls send nothing.
    assert!(env.reset(&[]).unwrap().is_empty() && env.step(&[]).unwrap().is_empty());

    let reqs = server.requests();
    assert_eq!(reqs.iter().map(|r| r.path.as_str()).collect::<Vec<_>>(), ["/env/reset", "/env/step", "/env/step"]);
    assert!(reqs.iter().all(|r| r.authorization.as_deref() == Some("Bearer s3cret")));
    assert_eq!(
        reqs[0].body["episodes"][0],
        json!({"id": 0, "prompt": "P0", "label": "42", "metadata": {"k": 0}, "messages": [{"role": "user", "content": "q0"}]})
    );
    assert_eq!(reqs[0].body["episodes"][1]["label"], Value::Null);
    assert_eq!(
        reqs[1].body,
        json!({"actions": [
            {"id": 0, "turn": 0, "text": "<calc>6*7</calc>", "token_ids": [7, 8], "ended": false},
            {"id": 1, "turn": 0, "text": "hmm", "token_ids": [7, 8], "ended": false},
        ]})
    );
}

#[test]
fn a_stalled_server_times_out_without_retrying() {
    let server = Server::start(|req| Reply { delay: Duration::from_secs(10), ..episodes_server(req) });
    let mut env = new(json!({"url": server.url("/env"), "timeout_s": 1, "retries": 2})).unwrap();
    let t = Instant::now();
    let e = env.step(&[action(0, 0, "x")]).unwrap_err();
    let took = t.elapsed();
    assert_eq!(e.kind, ErrorKind::External);
    let url = server.url("/env/step");
    assert_eq!(e.to_string(), format!("{url}: timeout (no complete response within 1 s) after 1 attempt"));
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(4), "{took:?}");
    // A step the server may have applied is not sent again.
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn server_errors_are_retried_then_fail_naming_the_status() {
    let server = Server::start(|_| Reply::raw(500, "Internal Server Error:\n  out of sandboxes"));
    let url = server.url("/env");
    let mut env = new(json!({"url": url, "retries": 2})).unwrap();
    let t = Instant::now();
    let e = env.reset(&[episode(0)]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::External);
    assert_eq!(
        e.to_string(),
        format!("{url}/reset: HTTP 500 after 3 attempts: Internal Server Error: out of sandboxes")
    );
    assert_eq!(server.requests().len(), 3);
    // Default backoff: 0.5 s, then 1 s.
    assert!(t.elapsed() >= Duration::from_millis(1500), "{:?}", t.elapsed());
}

fn fast(settings_json: Value) -> HttpEnv {
    let mut s = Settings::parse(&settings_json.to_string()).unwrap();
    s.backoff = Duration::from_millis(10);
    HttpEnv::from_settings(s).unwrap()
}

#[test]
fn rate_limits_and_transient_errors_recover() {
    let server = Server::start(|req| match req.n {
        0 => Reply::raw(429, "slow down"),
        1 => Reply::raw(503, ""),
        _ => episodes_server(req),
    });
    let mut env = fast(json!({"url": server.url("/env"), "retries": 2}));
    assert_eq!(env.reset(&[episode(3)]).unwrap(), vec!["start P3".to_string()]);
    assert_eq!(server.requests().len(), 3);
}

#[test]
fn client_errors_are_not_retried() {
    let server = Server::start(|_| Reply::raw(404, "not found"));
    let url = server.url("/env");
    let mut env = fast(json!({"url": url, "retries": 3}));
    assert_eq!(
        env.step(&[action(0, 0, "x")]).unwrap_err().to_string(),
        format!("{url}/step: HTTP 404 after 1 attempt: not found")
    );
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn bad_bodies_fail_the_call_with_a_clear_message() {
    type Fault = fn(&Req) -> Reply;
    let faults: [(&str, Fault, &str); 5] = [
        (
            "not json",
            |_| Reply::raw(200, "<html>hello</html>"),
            "invalid JSON after 1 attempt: expected value at line 1 column 1; body: <html>hello</html>",
        ),
        (
            "wrong count",
            |_| Reply::json(json!({"results": [{"reward": 1}]})),
            "invalid response after 1 attempt: `results` has 1 entries for 2 actions",
        ),
        (
            "missing field",
            |_| Reply::json(json!({"result": []})),
            "invalid response after 1 attempt: missing field `results`",
        ),
        (
            "NaN literal",
            |_| Reply::raw(200, r#"{"results": [{"reward": NaN}, {}]}"#),
            "(NaN and Infinity are not JSON numbers)",
        ),
        (
            "non-finite reward",
            |_| Reply::json(json!({"results": [{}, {"reward": "inf"}]})),
            "invalid response after 1 attempt: `results[1].reward` is not a finite number: \"inf\"",
        ),
    ];
    for (name, fault, want) in faults {
        let server = Server::start(fault);
        let url = server.url("/step");
        let mut env = fast(json!({"url": server.url("/"), "retries": 2}));
        let e = env.step(&[action(0, 0, "a"), action(1, 0, "b")]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::External, "{name}");
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{url}: ")), "{name}: {msg}");
        assert!(msg.contains(want), "{name}: {msg}");
        assert!(!msg.contains('\n'), "{name}: {msg}");
        assert_eq!(server.requests().len(), 1, "{name}");
    }
    // Reset checks its count too.
    let server = Server::start(|_| Reply::json(json!({"observations": ["a", "b", "c"]})));
    let msg = new(json!({"url": server.url("")})).unwrap().reset(&[episode(0), episode(1)]).unwrap_err().to_string();
    assert!(msg.ends_with("invalid response after 1 attempt: `observations` has 3 entries for 2 episodes"), "{msg}");
}

#[test]
fn oversized_responses_are_refused() {
    let server = Server::start(|_| Reply::json(json!({"observations": ["x".repeat(5000)]})));
    let mut env = new(json!({"url": server.url(""), "max_response_bytes": 1000})).unwrap();
    let msg = env.reset(&[episode(0)]).unwrap_err().to_string();
    assert!(msg.ends_with("response too large after 1 attempt: over max_response_bytes = 1000"), "{msg}");
}

#[test]
fn refused_connections_are_retried_then_fail() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let mut env = fast(json!({"url": url, "retries": 1}));
    let t = Instant::now();
    let msg = env.step(&[action(0, 0, "x")]).unwrap_err().to_string();
    assert!(msg.starts_with(&format!("{url}/step: cannot connect after 2 attempts: ")), "{msg}");
    assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn config_errors_through_the_constructor() {
    let cases = [
        (json!({}), "url: missing"),
        (json!({"url": "ftp://h/env"}), "url: `ftp://h/env`: scheme must be http or https, not ftp"),
        (json!({"url": "127.0.0.1:8000"}), "url: "),
        (json!({"url": "http://h/", "retry": 2}), "retry: unknown field `retry`"),
        (
            json!({"url": "http://h/", "auth_env": "ENV_HTTP_TEST_UNSET_VAR"}),
            "auth_env: environment variable `ENV_HTTP_TEST_UNSET_VAR` is not set",
        ),
        (json!({"url": "http://h/", "timeout_s": 0}), "timeout_s: must be a positive number of seconds"),
    ];
    for (config, want) in cases {
        let e = new(config.clone()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config, "{config}");
        assert!(e.to_string().starts_with(want), "{config}: {e}");
    }
}

mod abi {
    //! Through the ABI object the host sees: the exported constructor, stop strings, and
    //! per-episode errors as the ABI's error strings.

    use super::*;
    use rlhf_plugin_api::abi::{ActionAbi, EpisodeAbi, HostContext, HostLogger, LogLevel};
    use rlhf_plugin_api::abi_stable::std_types::{RResult, RStr};

    extern "C" fn log(_level: LogLevel, _plugin: RStr<'_>, _message: RStr<'_>) {}

    #[test]
    fn through_the_abi_adapter() {
        let server = Server::start(episodes_server);
        let ctx = HostContext { logger: HostLogger { log }, context_json: "{}".into() };
        let config = json!({"url": server.url("/env"), "stop": ["</calc>"]}).to_string();
        let made = rlhf_plugin_api::export::new_environment::<HttpEnv>(RStr::from_str(&config), ctx, "env-http");
        // The log bridge installs a panic hook; put the default back so failing assertions print.
        drop(std::panic::take_hook());
        let RResult::ROk(mut env) = made else { panic!("construction failed") };
        assert_eq!(env.stop_strings().into_iter().map(|s| s.to_string()).collect::<Vec<_>>(), ["</calc>"]);
        let obs = env.reset(vec![EpisodeAbi::from(&episode(0)), EpisodeAbi::from(&episode(1))].into()).unwrap();
        assert_eq!(obs.into_iter().map(|s| s.to_string()).collect::<Vec<_>>(), ["start P0", "start P1"]);
        let actions = [action(0, 0, "<calc>6*7</calc>"), action(1, 0, "x")];
        let out: Vec<StepOutcome> = env
            .step(actions.iter().map(ActionAbi::from).collect())
            .unwrap()
            .into_iter()
            .map(StepOutcome::from)
            .collect();
        assert_eq!(out[0].observation, "<r>42</r>");
        assert_eq!(out[1].error.as_deref(), Some("sandbox crashed"));
    }
}
