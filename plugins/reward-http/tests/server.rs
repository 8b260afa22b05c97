//! `reward-http` against real HTTP servers on 127.0.0.1 (axum on a background tokio runtime, plus
//! a raw TCP server for a response that trickles in): correct scores for both wire formats, split
//! and spread over several URLs, and each fault — HTTP errors, bad bodies, NaN, timeouts, auth,
//! refused connections — with `on_error = "fail"` and `"skip"`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::Router;
use rlhf_plugin_api::{Context, ErrorKind, PluginError, RewardSource, Sample, Scores};
use rlhf_plugin_reward_http::RewardHttp;
use serde_json::{json, Value};

const TOKEN_VAR: &str = "REWARD_HTTP_TEST_TOKEN";
const WRONG_TOKEN_VAR: &str = "REWARD_HTTP_TEST_WRONG_TOKEN";

/// Sets the token variables once, before any test reads the environment.
fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var(TOKEN_VAR, "s3cret");
        std::env::set_var(WRONG_TOKEN_VAR, "guess");
    });
}

fn ctx() -> Context {
    setup();
    Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
}

/// Sample `i`: prompt `P<i>:`, response `i` times `x`, label `<i>`.
fn sample(i: usize) -> Sample {
    Sample {
        prompt: format!("P{i}:"),
        response: "x".repeat(i),
        prompt_ids: vec![],
        response_ids: vec![],
        label: Some(i.to_string()),
        metadata: Value::Null,
        messages: vec![],
    }
}

fn samples(n: usize) -> Vec<Sample> {
    (0..n).map(sample).collect()
}

/// What the scoring servers return for sample `i`: the length of `prompt + response`.
fn expected(i: usize) -> f64 {
    (format!("P{i}:").len() + i) as f64
}

fn metric(scores: &Scores, name: &str) -> Option<f64> {
    scores.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

fn new(config: Value) -> Result<RewardHttp, PluginError> {
    RewardHttp::new(&config.to_string(), &ctx())
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

impl Req {
    /// The texts to score, in either format.
    fn texts(&self) -> Vec<String> {
        let field = if self.body.get("query").is_some() { "query" } else { "messages" };
        self.body[field].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
    }
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
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// An axum server on 127.0.0.1:<ephemeral> answering every path with `handler`.
struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Server {
    fn start(handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> Server {
        setup();
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let shared = Arc::new(Shared {
            handler: Box::new(handler),
            log: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
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

    fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
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
    let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
    shared.log.lock().unwrap().push(req.clone());
    let reply = (shared.handler)(&req);
    tokio::time::sleep(reply.delay).await;
    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    Response::builder()
        .status(reply.status)
        .header("content-type", "application/json")
        .body(Body::from(reply.body))
        .unwrap()
}

/// A correct server for both formats; OpenRLHF replies also carry `extra_logs`: the per-sample
/// label as a number and the request size as a scalar.
fn score(req: &Req) -> Reply {
    let lengths: Vec<f64> = req.texts().iter().map(|t| t.chars().count() as f64).collect();
    if req.body.get("query").is_some() {
        let labels: Vec<f64> =
            req.body["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().parse().unwrap()).collect();
        Reply::json(json!({
            "rewards": lengths,
            "scores": lengths.iter().map(|l| -l).collect::<Vec<_>>(),
            "extra_logs": {"label": labels, "request_size": lengths.len()},
        }))
    } else {
        Reply::json(
            json!({"id": "scoreval-1", "object": "score.evaluation", "model": req.body["model"], "scores": lengths}),
        )
    }
}

#[test]
fn scores_in_order_over_several_urls_and_requests() {
    let server = Server::start(|req| Reply { delay: Duration::from_millis(50), ..score(req) });
    let urls = [server.url("/a"), server.url("/b"), server.url("/c")];
    let mut r = new(json!({"urls": urls, "max_samples_per_request": 3, "concurrency": 2})).unwrap();
    let out = r.score(&samples(10)).unwrap();
    assert_eq!(out.scores, (0..10).map(expected).collect::<Vec<_>>());

    // Four requests of 3, 3, 3, 1 samples; request k went to urls[k % 3].
    let reqs = server.requests();
    assert_eq!(reqs.len(), 4);
    let mut seen = Vec::new();
    for req in &reqs {
        let first: usize = req.body["labels"][0].as_str().unwrap().parse().unwrap();
        let k = first / 3;
        assert_eq!(req.path, ["/a", "/b", "/c"][k % 3], "{req:?}");
        let n = req.texts().len();
        assert_eq!(n, if k == 3 { 1 } else { 3 });
        let ids: Vec<usize> = (first..first + n).collect();
        assert_eq!(req.body["prompts"], json!(ids.iter().map(|i| format!("P{i}:")).collect::<Vec<_>>()));
        assert_eq!(req.body["query"][0], json!(format!("P{first}:{}", "x".repeat(first))));
        assert!(req.authorization.is_none());
        seen.push(k);
    }
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3]);
    assert!(server.max_in_flight() <= 2, "{}", server.max_in_flight());

    assert_eq!(metric(&out, "reward_http/requests"), Some(4.0));
    assert_eq!(metric(&out, "reward_http/retries"), Some(0.0));
    assert!(metric(&out, "reward_http/latency_s").unwrap() >= 0.05);
    assert_eq!(metric(&out, "reward_http/skipped_samples"), None);
    // extra_logs: per-sample values averaged over the batch; a scalar counts once per sample.
    assert_eq!(metric(&out, "reward_http/label"), Some(4.5));
    assert_eq!(metric(&out, "reward_http/request_size"), Some((9.0 + 9.0 + 9.0 + 1.0) / 10.0));

    // Round-robin goes on where the last batch stopped: the next request goes to /b.
    let out = r.score(&samples(2)).unwrap();
    assert_eq!(out.scores, vec![expected(0), expected(1)]);
    assert_eq!(server.requests().last().unwrap().path, "/b");
}

#[test]
fn concurrency_bounds_requests_in_flight() {
    let server = Server::start(|req| Reply { delay: Duration::from_millis(100), ..score(req) });
    let mut r = new(json!({"url": server.url("/"), "max_samples_per_request": 1, "concurrency": 3})).unwrap();
    let out = r.score(&samples(9)).unwrap();
    assert_eq!(out.scores, (0..9).map(expected).collect::<Vec<_>>());
    assert_eq!(server.requests().len(), 9);
    let max = server.max_in_flight();
    assert!((2..=3).contains(&max), "{max} requests in flight");
}

#[test]
fn llamafactory_format() {
    let server = Server::start(score);
    let mut r =
        new(json!({"url": server.url("/v1/score/evaluation"), "format": "llamafactory", "model": "rm-7b"})).unwrap();
    let out = r.score(&samples(3)).unwrap();
    assert_eq!(out.scores, (0..3).map(expected).collect::<Vec<_>>());
    let reqs = server.requests();
    assert_eq!(reqs[0].path, "/v1/score/evaluation");
    assert_eq!(reqs[0].body, json!({"model": "rm-7b", "messages": ["P0:", "P1:x", "P2:xx"]}));
    assert_eq!(metric(&out, "reward_http/requests"), Some(1.0));
}

#[test]
fn use_scores_reads_scores_instead_of_rewards() {
    let server = Server::start(score);
    let mut r = new(json!({"url": server.url("/"), "use_scores": true})).unwrap();
    assert_eq!(r.score(&samples(3)).unwrap().scores, (0..3).map(|i| -expected(i)).collect::<Vec<_>>());
}

#[test]
fn empty_batch_sends_nothing() {
    let server = Server::start(score);
    let mut r = new(json!({"url": server.url("/")})).unwrap();
    let out = r.score(&[]).unwrap();
    assert!(out.scores.is_empty() && out.metrics.is_empty());
    assert!(server.requests().is_empty());
}

#[test]
fn server_errors_are_retried() {
    let server = Server::start(|req| if req.n < 2 { Reply::raw(500, "warming up") } else { score(req) });
    let mut r = new(json!({"url": server.url("/"), "retries": 3, "backoff_s": 0.01})).unwrap();
    let out = r.score(&samples(4)).unwrap();
    assert_eq!(out.scores, (0..4).map(expected).collect::<Vec<_>>());
    assert_eq!(metric(&out, "reward_http/requests"), Some(1.0));
    assert_eq!(metric(&out, "reward_http/retries"), Some(2.0));
    assert_eq!(server.requests().len(), 3);
}

#[test]
fn each_fault_fails_with_the_url_and_the_problem() {
    type Fault = fn(&Req) -> Reply;
    let faults: [(&str, Fault, &str); 8] = [
        (
            "http 500",
            |_| Reply::raw(500, "Internal Server Error:\n  CUDA out of memory"),
            "HTTP 500 after 2 attempts: Internal Server Error: CUDA out of memory",
        ),
        ("http 404", |_| Reply::raw(404, ""), "HTTP 404 after 2 attempts"),
        (
            "not json",
            |_| Reply::raw(200, "<html>hello</html>"),
            "invalid JSON after 2 attempts: expected value at line 1 column 1; body: <html>hello</html>",
        ),
        (
            "missing field",
            |_| Reply::json(json!({"reward": [1, 2, 3]})),
            "invalid response after 2 attempts: missing field `rewards`",
        ),
        (
            "wrong count",
            |_| Reply::json(json!({"rewards": [1, 2]})),
            "invalid response after 2 attempts: `rewards` has 2 values for 3 samples",
        ),
        (
            "NaN literal",
            |_| Reply::raw(200, r#"{"rewards": [1.0, NaN, 2.0]}"#),
            "(NaN and Infinity are not JSON numbers)",
        ),
        (
            "NaN string",
            |_| Reply::json(json!({"rewards": [1.0, "NaN", 2.0]})),
            "invalid response after 2 attempts: `rewards[1]` is not a finite number: \"NaN\"",
        ),
        ("null", |_| Reply::json(json!({"rewards": [1.0, 2.0, null]})), "`rewards[2]` is not a finite number: null"),
    ];
    for (name, fault, want) in faults {
        let server = Server::start(fault);
        let url = server.url("/get_reward");
        let mut r = new(json!({"url": url, "retries": 1, "backoff_s": 0})).unwrap();
        let e = r.score(&samples(3)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::External, "{name}");
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("{url}: ")), "{name}: {msg}");
        assert!(msg.contains(want), "{name}: {msg}");
        assert!(!msg.contains('\n'), "{name}: {msg}");
        assert_eq!(server.requests().len(), 2, "{name}");
    }
}

#[test]
fn long_error_bodies_are_cut() {
    let server = Server::start(|_| Reply::raw(502, &"y".repeat(5000)));
    let mut r = new(json!({"url": server.url("/"), "retries": 0})).unwrap();
    let msg = r.score(&samples(1)).unwrap_err().to_string();
    assert!(msg.ends_with(&format!("HTTP 502 after 1 attempt: {}…", "y".repeat(200))), "{msg}");
}

#[test]
fn a_slow_server_times_out() {
    let server = Server::start(|req| Reply { delay: Duration::from_secs(5), ..score(req) });
    let url = server.url("/");
    let mut r = new(json!({"url": url, "timeout_s": 0.3, "retries": 2, "backoff_s": 0.05})).unwrap();
    let t = Instant::now();
    let msg = r.score(&samples(2)).unwrap_err().to_string();
    let took = t.elapsed();
    assert_eq!(msg, format!("{url}: timeout (no complete response within 0.3 s) after 3 attempts"));
    // 3 × 0.3 s + 0.05 s + 0.1 s of backoff, loosely.
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
    assert_eq!(server.requests().len(), 3);
}

/// A raw HTTP/1.1 server whose every response announces 100 bytes and then sends one every 100 ms.
fn trickling_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(4) {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n");
                for _ in 0..100 {
                    std::thread::sleep(Duration::from_millis(100));
                    if stream.write_all(b" ").is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn the_deadline_covers_the_whole_body() {
    let addr = trickling_server();
    let url = format!("http://{addr}/get_reward");
    let mut r = new(json!({"url": url, "timeout_s": 0.5, "retries": 1, "backoff_s": 0})).unwrap();
    let t = Instant::now();
    let msg = r.score(&samples(1)).unwrap_err().to_string();
    assert_eq!(msg, format!("{url}: timeout (no complete response within 0.5 s) after 2 attempts"));
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

fn auth_server() -> Server {
    Server::start(|req| match req.authorization.as_deref() {
        Some("Bearer s3cret") => score(req),
        _ => Reply::raw(401, r#"{"detail": "Invalid API key"}"#),
    })
}

#[test]
fn bearer_token_from_the_environment() {
    let server = auth_server();
    let url = server.url("/v1/score/evaluation");
    let mut r = new(json!({"url": url, "format": "llamafactory", "token_env": TOKEN_VAR})).unwrap();
    assert_eq!(r.score(&samples(2)).unwrap().scores, vec![expected(0), expected(1)]);
    assert_eq!(server.requests()[0].authorization.as_deref(), Some("Bearer s3cret"));
    // The token never shows in debug output.
    assert!(!format!("{r:?}").contains("s3cret"));

    for token_env in [Some(WRONG_TOKEN_VAR), None] {
        let mut config = json!({"url": url, "format": "llamafactory", "retries": 1, "backoff_s": 0});
        if let Some(var) = token_env {
            config["token_env"] = json!(var);
        }
        let msg = new(config).unwrap().score(&samples(2)).unwrap_err().to_string();
        assert_eq!(msg, format!("{url}: HTTP 401 after 2 attempts: {{\"detail\": \"Invalid API key\"}}"));
    }
}

#[test]
fn connection_refused() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}/get_reward");
    let mut r = new(json!({"url": url, "retries": 2, "backoff_s": 0.01})).unwrap();
    let t = Instant::now();
    let msg = r.score(&samples(2)).unwrap_err().to_string();
    assert!(msg.starts_with(&format!("{url}: request failed after 3 attempts: ")), "{msg}");
    assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn skip_scores_only_the_failed_request_nan() {
    // Fails every request that contains sample 4, i.e. the second request of 3.
    let server =
        Server::start(
            |req| if req.texts().contains(&"P4:xxxx".to_string()) { Reply::raw(503, "") } else { score(req) },
        );
    let mut r = new(json!({
        "url": server.url("/"), "max_samples_per_request": 3, "retries": 1, "backoff_s": 0, "on_error": "skip",
    }))
    .unwrap();
    let out = r.score(&samples(8)).unwrap();
    for (i, s) in out.scores.iter().enumerate() {
        if (3..6).contains(&i) {
            assert!(s.is_nan(), "sample {i}: {s}");
        } else {
            assert_eq!(*s, expected(i), "sample {i}");
        }
    }
    assert_eq!(metric(&out, "reward_http/requests"), Some(3.0));
    assert_eq!(metric(&out, "reward_http/retries"), Some(1.0));
    assert_eq!(metric(&out, "reward_http/skipped_requests"), Some(1.0));
    assert_eq!(metric(&out, "reward_http/skipped_samples"), Some(3.0));
    // extra_logs only from the answered requests: labels 0, 1, 2, 6, 7.
    assert_eq!(metric(&out, "reward_http/label"), Some(16.0 / 5.0));

    // Nothing answered: every score NaN, still no error.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut r = new(json!({"url": format!("http://127.0.0.1:{port}/"), "retries": 0, "on_error": "skip"})).unwrap();
    let out = r.score(&samples(2)).unwrap();
    assert!(out.scores.iter().all(|s| s.is_nan()));
    assert_eq!(metric(&out, "reward_http/skipped_samples"), Some(2.0));
}

#[test]
fn fail_stops_sending_after_a_failure() {
    let server = Server::start(|_| Reply::raw(500, "down"));
    let url = server.url("/");
    let mut r =
        new(json!({"url": url, "max_samples_per_request": 1, "concurrency": 1, "retries": 1, "backoff_s": 0})).unwrap();
    let msg = r.score(&samples(5)).unwrap_err().to_string();
    assert_eq!(msg, format!("{url}: HTTP 500 after 2 attempts: down"));
    // Only the first request's two attempts; the other four requests were never sent.
    assert_eq!(server.requests().len(), 2);
}

#[test]
fn config_errors_through_the_constructor() {
    let cases = [
        (json!({}), "url: missing"),
        (json!({"url": "http://a/", "urls": ["http://b/"]}), "url: give either"),
        (json!({"url": "127.0.0.1:5000"}), "url: "),
        (json!({"url": "http://a/", "format": "openai"}), "format: unknown variant `openai`"),
        (json!({"url": "http://a/", "concurrency": 0}), "concurrency: must be at least 1"),
        (json!({"url": "http://a/", "max_samples_per_request": 0}), "max_samples_per_request: must be at least 1"),
        (json!({"url": "http://a/", "timeout_s": -2}), "timeout_s: must be a positive number"),
        (
            json!({"url": "http://a/", "token_env": "REWARD_HTTP_TEST_UNSET_VAR"}),
            "token_env: environment variable `REWARD_HTTP_TEST_UNSET_VAR` is not set",
        ),
        (json!({"url": "http://a/", "retry": 2}), "retry: unknown field `retry`"),
    ];
    for (config, want) in cases {
        let e = new(config.clone()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config, "{config}");
        assert!(e.to_string().starts_with(want), "{config}: {e}");
    }
}

mod abi {
    //! Through the ABI object the host sees: `SampleAbi` in, `ScoresAbi` (NaN included) out, and
    //! the plugin's retry warnings reaching the host's logger.

    use super::*;
    use rlhf_plugin_api::abi::{HostContext, HostLogger, LogLevel, SampleAbi};
    use rlhf_plugin_api::abi_stable::std_types::{RResult, RStr, RString, RVec};

    static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    extern "C" fn log(level: LogLevel, plugin: RStr<'_>, message: RStr<'_>) {
        LOGS.lock().unwrap().push(format!("{level:?} {plugin}: {message}"));
    }

    fn sample_abi(i: usize) -> SampleAbi {
        let s = sample(i);
        SampleAbi {
            prompt: s.prompt.into(),
            response: s.response.into(),
            prompt_ids: RVec::new(),
            response_ids: RVec::new(),
            label: Some(RString::from(i.to_string())).into(),
            metadata_json: "{}".into(),
            messages_json: r#"[{"role": "user", "content": "hi"}]"#.into(),
        }
    }

    #[test]
    fn through_the_abi_adapter() {
        setup();
        let server = Server::start(|req| if req.n == 0 { Reply::raw(500, "once") } else { score(req) });
        let ctx = HostContext { logger: HostLogger { log }, context_json: super::ctx().to_json().into() };
        let config = json!({"url": server.url("/"), "max_samples_per_request": 2, "concurrency": 1, "backoff_s": 0});
        let made =
            rlhf_plugin_api::export::new_reward::<RewardHttp>(RStr::from_str(&config.to_string()), ctx, "reward-http");
        // The log bridge installs a panic hook that routes panics to the host's logger; put the
        // default back so failing assertions in this test binary still print.
        drop(std::panic::take_hook());
        let RResult::ROk(mut reward) = made else { panic!("construction failed") };
        let out = reward.score((0..3).map(sample_abi).collect()).unwrap();
        assert_eq!(out.scores.to_vec(), (0..3).map(expected).collect::<Vec<_>>());
        let retries = out.metrics.iter().find(|m| m.name.as_str() == "reward_http/retries").unwrap();
        assert_eq!(retries.value, 1.0);
        let logs = LOGS.lock().unwrap().clone();
        assert!(
            logs.iter().any(|l| l.starts_with("Warn reward-http: ")
                && l.contains("HTTP 500: once (attempt 1 of 4; retrying)")),
            "{logs:?}"
        );
    }
}
