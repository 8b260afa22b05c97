//! Contract tests of [`VllmClient`] against a mock vLLM server (axum on a background tokio
//! runtime, 127.0.0.1:0) that replays answers recorded from a real vLLM 0.32 server
//! (`fixtures/vllm/`, see its README): the client must send what was recorded and read what came
//! back — and fail cleanly, naming the server, on 5xx (retried), 4xx (not retried), timeouts,
//! refused connections, bodies that are not JSON or longer than a request can need, and choices
//! that are missing or incomplete.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Method, Uri};
use axum::response::Response;
use axum::Router;
use rlhf_trainer::rl::engine::client::{Completion, Sampling, VllmClient, VllmError};
use serde_json::{json, Value};

/// The model's EOS id (the recordings use the built-in tokenizer: `<eos>` = 1).
const EOS: u32 = 1;

/// One recorded exchange.
struct Fixture {
    method: String,
    path: String,
    request: Value,
    status: u16,
    /// JSON body; a string for a plain-text body; `null` for an empty one.
    response: Value,
}

fn fixture(name: &str) -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vllm").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Fixture {
        method: v["method"].as_str().unwrap().to_string(),
        path: v["path"].as_str().unwrap().to_string(),
        request: v["request"].clone(),
        status: u16::try_from(v["status"].as_u64().unwrap()).unwrap(),
        response: v["response"].clone(),
    }
}

impl Fixture {
    fn reply(&self) -> Reply {
        Reply::body(self.status, self.response.clone())
    }

    /// The recorded completions request as client arguments: prompts, n, sampling.
    fn completions_args(&self) -> (String, Vec<Vec<u32>>, usize, Sampling) {
        let r = &self.request;
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|t| u32::try_from(t.as_u64().unwrap()).unwrap()).collect()
        };
        let prompts = r["prompt"].as_array().unwrap().iter().map(ids).collect();
        let sampling = Sampling {
            max_tokens: r["max_tokens"].as_i64().unwrap(),
            temperature: r["temperature"].as_f64().unwrap(),
            top_p: r.get("top_p").map_or(1.0, |v| v.as_f64().unwrap()),
            top_k: r.get("top_k").map_or(0, |v| v.as_i64().unwrap().max(0)),
            stop_token_ids: r.get("stop_token_ids").map_or_else(Vec::new, ids),
            stop: Vec::new(),
            seed: r.get("seed").map(|v| v.as_u64().unwrap()),
        };
        let model = r["model"].as_str().unwrap().to_string();
        (model, prompts, usize::try_from(r["n"].as_u64().unwrap()).unwrap(), sampling)
    }
}

/// One request as the mock saw it.
#[derive(Debug, Clone)]
struct Req {
    /// 0-based arrival number.
    n: usize,
    method: String,
    path: String,
    /// `Null` if the body was empty or not JSON.
    body: Value,
}

/// What the mock answers.
struct Reply {
    status: u16,
    body: String,
    content_type: &'static str,
    delay: Duration,
}

impl Reply {
    /// A fixture-style body: JSON, a string sent as plain text, or `null` for no body.
    fn body(status: u16, v: Value) -> Reply {
        let (body, content_type) = match v {
            Value::Null => (String::new(), "text/plain"),
            Value::String(s) => (s, "text/plain"),
            v => (v.to_string(), "application/json"),
        };
        Reply { status, body, content_type, delay: Duration::ZERO }
    }

    fn raw(status: u16, body: &str) -> Reply {
        Reply { status, body: body.to_string(), content_type: "application/json", delay: Duration::ZERO }
    }
}

type Handler = dyn Fn(&Req) -> Reply + Send + Sync;

struct Shared {
    handler: Box<Handler>,
    log: Mutex<Vec<Req>>,
    count: AtomicUsize,
}

/// A mock vLLM server on 127.0.0.1:<ephemeral> answering every request with `handler`.
struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    url: String,
    shared: Arc<Shared>,
}

impl Server {
    fn start(handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let shared =
            Arc::new(Shared { handler: Box::new(handler), log: Mutex::new(Vec::new()), count: AtomicUsize::new(0) });
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new().fallback(handle).with_state(Arc::clone(&shared));
        runtime.spawn(async move { axum::serve(listener, app).await });
        Server { runtime: Some(runtime), url, shared }
    }

    /// Replays `fixtures` by method and path; anything else is a 404.
    fn replay(fixtures: Vec<Fixture>) -> Server {
        Server::start(move |req| {
            fixtures
                .iter()
                .find(|f| f.method == req.method && f.path == req.path)
                .map_or_else(|| Reply::raw(404, r#"{"detail":"Not Found"}"#), Fixture::reply)
        })
    }

    fn client(&self, timeout: Duration, retries: u32) -> VllmClient {
        VllmClient::new(&self.url, timeout, retries).unwrap()
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

async fn handle(State(shared): State<Arc<Shared>>, method: Method, uri: Uri, body: Bytes) -> Response {
    let req = Req {
        n: shared.count.fetch_add(1, Ordering::SeqCst),
        method: method.to_string(),
        path: uri.path().to_string(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    shared.log.lock().unwrap().push(req.clone());
    let reply = (shared.handler)(&req);
    tokio::time::sleep(reply.delay).await;
    Response::builder()
        .status(reply.status)
        .header("content-type", reply.content_type)
        .body(Body::from(reply.body))
        .unwrap()
}

fn quick() -> Duration {
    Duration::from_secs(10)
}

fn greedy_probe() -> Sampling {
    Sampling { max_tokens: 1, temperature: 0.0, top_p: 1.0, top_k: 0, stop_token_ids: vec![], stop: vec![], seed: None }
}

/// The recorded choices as the client should return them: `[p][k]` = choice `p * n + k`.
fn expected(f: &Fixture, prompts: usize, n: usize) -> Vec<Vec<Completion>> {
    let choices = f.response["choices"].as_array().unwrap();
    (0..prompts)
        .map(|p| {
            (0..n)
                .map(|k| {
                    let c = choices.iter().find(|c| c["index"].as_u64() == Some((p * n + k) as u64)).unwrap();
                    Completion {
                        token_ids: serde_json::from_value(c["token_ids"].clone()).unwrap(),
                        logprobs: serde_json::from_value(c["logprobs"]["token_logprobs"].clone()).unwrap(),
                        finish_reason: c["finish_reason"].as_str().unwrap().to_string(),
                    }
                })
                .collect()
        })
        .collect()
}

/// The recorded completions fixture with `edit` applied to its response.
fn edited(name: &str, edit: impl FnOnce(&mut Value)) -> Fixture {
    let mut f = fixture(name);
    edit(&mut f.response);
    f
}

#[test]
fn recorded_completions_are_requested_and_read_as_recorded() {
    for name in ["completions_sampled", "completions_stop_token"] {
        let f = fixture(name);
        let (model, prompts, n, sampling) = f.completions_args();
        let want = expected(&f, prompts.len(), n);
        let request = f.request.clone();
        let server = Server::replay(vec![f]);
        let got = server.client(quick(), 0).complete(&model, &prompts, n, &sampling).unwrap();
        assert_eq!(got, want, "{name}");

        // The client sends exactly the request that was recorded against the real server.
        let reqs = server.requests();
        assert_eq!(reqs.len(), 1);
        assert_eq!(reqs[0].body, request, "{name}");

        // What the recordings show: 2 prompts × n = 2, index = p * n + k;
        // a choice that stopped ends with its stop id, one log-prob per id.
        for row in &got {
            assert_eq!(row.len(), n);
            for c in row {
                assert_eq!(c.logprobs.len(), c.token_ids.len());
                assert!(c.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0), "{c:?}");
                match c.finish_reason.as_str() {
                    "stop" => assert!(sampling.stop_token_ids.contains(c.token_ids.last().unwrap()), "{c:?}"),
                    "length" => assert_eq!(c.token_ids.len() as i64, sampling.max_tokens),
                    other => panic!("{name}: finish_reason {other}"),
                }
            }
        }
        let reasons: Vec<&str> = got.iter().flatten().map(|c| c.finish_reason.as_str()).collect();
        assert!(reasons.contains(&"stop") && reasons.contains(&"length"), "{name}: {reasons:?}");
    }
    // The sampled recording stopped on EOS (included), the other on a non-EOS stop id.
    let got = expected(&fixture("completions_sampled"), 2, 2);
    assert_eq!(got[0][1].token_ids.last(), Some(&EOS));
    let got = expected(&fixture("completions_stop_token"), 2, 2);
    assert_eq!(got[0][1].token_ids, vec![15, 11]);
}

#[test]
fn choices_are_placed_by_index_not_by_position() {
    let f = edited("completions_sampled", |r| {
        r["choices"].as_array_mut().unwrap().reverse();
    });
    let (model, prompts, n, sampling) = f.completions_args();
    let want = expected(&f, 2, 2);
    let server = Server::replay(vec![f]);
    let got = server.client(quick(), 0).complete(&model, &prompts, n, &sampling).unwrap();
    assert_eq!(got, want);
    assert_eq!(got[0][0].token_ids, vec![11, 12, 15, 7, 11, 10, 12, 16]);
}

#[test]
fn a_completion_cut_to_fit_the_context_is_length() {
    let f = fixture("completions_context_capped");
    let (model, prompts, n, sampling) = f.completions_args();
    let request = f.request.clone();
    let server = Server::replay(vec![f]);
    let got = server.client(quick(), 0).complete(&model, &prompts, n, &sampling).unwrap();
    assert_eq!(server.requests()[0].body, request);
    // 60 prompt ids + 8 asked > max_model_len 64: vLLM generated 4 and said "length".
    assert_eq!(got[0][0].token_ids, vec![13, 9, 11, 9]);
    assert_eq!(got[0][0].logprobs.len(), 4);
    assert_eq!(got[0][0].finish_reason, "length");
}

#[test]
fn greedy_and_lora_probes() {
    for (name, model) in [("completions_probe_greedy", "policy"), ("completions_lora_probe", "policy-lora")] {
        let f = fixture(name);
        let want = expected(&f, 1, 1);
        let request = f.request.clone();
        let server = Server::replay(vec![f]);
        let got = server.client(quick(), 0).complete(model, &[vec![15, 16, 17, 6]], 1, &greedy_probe()).unwrap();
        assert_eq!(got, want, "{name}");
        assert_eq!(got[0][0].token_ids.len(), 1);
        assert_eq!(got[0][0].finish_reason, "length");
        // Every recorded key is sent with its recorded value (the client also sends the defaults).
        let sent = &server.requests()[0].body;
        for (k, v) in request.as_object().unwrap() {
            assert_eq!(&sent[k], v, "{name}: {k}");
        }
    }
}

#[test]
fn control_endpoints_accept_the_recorded_answers() {
    let reload = fixture("collective_rpc_reload_weights");
    let lora = fixture("load_lora_adapter");
    let (reload_req, lora_req) = (reload.request.clone(), lora.request.clone());
    let server =
        Server::replay(vec![reload, lora, fixture("reset_prefix_cache"), fixture("health"), fixture("models")]);
    let client = server.client(quick(), 0);
    client.reload_weights(Path::new("/tmp/vllm-tiny")).unwrap();
    client.load_lora("policy-lora", Path::new("/tmp/vllm-tiny-lora")).unwrap();
    client.reset_prefix_cache().unwrap();
    client.health().unwrap();

    let reqs = server.requests();
    let seen: Vec<(&str, &str)> = reqs.iter().map(|r| (r.method.as_str(), r.path.as_str())).collect();
    assert_eq!(
        seen,
        [
            ("POST", "/collective_rpc"),
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/reset_prefix_cache"),
            ("GET", "/health")
        ]
    );
    assert_eq!(reqs[0].body, reload_req);
    assert_eq!(reqs[1].body, lora_req);
}

#[test]
fn an_empty_collective_rpc_answer_is_success_and_a_refused_reset_is_not() {
    let server = Server::start(|req| match req.path.as_str() {
        "/collective_rpc" => Reply::body(200, Value::Null),
        _ => Reply::body(200, json!({"success": false})),
    });
    let client = server.client(quick(), 2);
    client.reload_weights(&PathBuf::from("/w")).unwrap();
    let e = client.reset_prefix_cache().unwrap_err();
    assert!(matches!(e, VllmError::Failed { .. }), "{e:?}");
    assert!(e.to_string().starts_with(&server.url), "{e}");
}

#[test]
fn a_500_is_retried_and_the_retry_succeeds() {
    let dead = fixture("error_engine_dead_after_failed_reload");
    assert_eq!(dead.status, 500);
    let ok = fixture("completions_probe_greedy");
    let want = expected(&ok, 1, 1);
    let server = Server::start(move |req| if req.n == 0 { dead.reply() } else { ok.reply() });
    let started = Instant::now();
    let got = server.client(quick(), 2).complete("policy", &[vec![15, 16, 17, 6]], 1, &greedy_probe()).unwrap();
    assert_eq!(got, want);
    assert_eq!(server.requests().len(), 2);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_lasting_500_fails_after_every_retry_with_the_body() {
    let failed = fixture("error_collective_rpc_bad_path");
    let server = Server::replay(vec![failed]);
    let e = server.client(quick(), 2).reload_weights(Path::new("/tmp/does-not-exist")).unwrap_err();
    assert_eq!(server.requests().len(), 3);
    match &e {
        VllmError::Status { code: 500, body, .. } => {
            assert!(body.contains("collective_rpc method failed"), "{body}");
            assert!(body.chars().count() <= 301, "{body}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().starts_with(&server.url), "{e}");
}

#[test]
fn a_4xx_is_not_retried() {
    for name in ["error_wrong_model", "error_prompt_too_long"] {
        let f = fixture(name);
        let code = f.status;
        let (model, prompts, n, sampling) = fixture("completions_sampled").completions_args();
        let server = Server::replay(vec![f]);
        let e = server.client(quick(), 3).complete(&model, &prompts, n, &sampling).unwrap_err();
        assert_eq!(server.requests().len(), 1, "{name}");
        assert!(matches!(e, VllmError::Status { code: c, .. } if c == code), "{name}: {e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with(&server.url) && msg.contains(&code.to_string()), "{msg}");
    }
    let server = Server::replay(vec![fixture("error_load_lora_missing_dir")]);
    let e = server.client(quick(), 3).load_lora("policy-lora2", Path::new("/tmp/does-not-exist")).unwrap_err();
    assert!(matches!(e, VllmError::Status { code: 404, .. }), "{e:?}");
    assert!(e.to_string().contains("No adapter found"), "{e}");
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn a_server_that_never_answers_times_out_in_bounded_time() {
    let server = Server::start(|_| Reply { delay: Duration::from_secs(30), ..Reply::body(200, Value::Null) });
    let client = server.client(Duration::from_millis(300), 1);
    let started = Instant::now();
    let e = client.complete("policy", &[vec![15]], 1, &greedy_probe()).unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(took >= Duration::from_millis(600), "{took:?}");
    assert!(matches!(e, VllmError::Timeout { attempts: 2, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with(&server.url) && msg.contains("timed out"), "{msg}");
    assert_eq!(server.requests().len(), 2);
}

#[test]
fn a_refused_connection_names_the_url() {
    let url = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let client = VllmClient::new(&format!("{url}/"), quick(), 1).unwrap();
    assert_eq!(client.url(), url);
    let started = Instant::now();
    let e = client.health().unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, VllmError::Connect { attempts: 2, .. }), "{e:?}");
    assert!(e.to_string().starts_with(&url), "{e}");
}

/// A body longer than a request can need fails it, once (not retried), naming the server and the
/// bound: announced by its `Content-Length` (a control endpoint's 1 MiB), or growing without end
/// and without one (a sampling request's bound: 1 MiB and 4 KiB a token), before the timeout.
#[test]
fn an_oversize_or_endless_body_is_refused_and_not_retried() {
    let server = Server::start(|_| Reply::raw(200, &" ".repeat(2 << 20)));
    let e = server.client(quick(), 3).health().unwrap_err();
    assert!(matches!(e, VllmError::TooLarge { limit: 1_048_576, .. }), "{e:?}");
    assert!(e.to_string().starts_with(&server.url) && e.to_string().contains("GET /health"), "{e}");
    assert_eq!(server.requests().len(), 1);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let endless = || async {
        let chunk = Bytes::from(vec![b' '; 1 << 16]);
        Body::from_stream(futures_util::stream::repeat_with(move || Ok::<_, std::convert::Infallible>(chunk.clone())))
    };
    let app = Router::new().fallback(endless);
    runtime.spawn(async move { axum::serve(listener, app).await });
    let started = Instant::now();
    let e = VllmClient::new(&url, quick(), 3).unwrap().complete("policy", &[vec![15]], 1, &greedy_probe()).unwrap_err();
    assert!(matches!(e, VllmError::TooLarge { limit, .. } if limit == (1 << 20) + 2 * 4096), "{e:?}");
    assert!(started.elapsed() < quick(), "refused only after {:?}", started.elapsed());
    runtime.shutdown_background();
}

#[test]
fn a_body_that_is_not_json_is_malformed_and_not_retried() {
    let server = Server::start(|_| Reply::raw(200, r#"{"choices": [{"index": 0,"#));
    let e = server.client(quick(), 3).complete("policy", &[vec![15]], 1, &greedy_probe()).unwrap_err();
    assert!(matches!(e, VllmError::Malformed { .. }), "{e:?}");
    assert!(e.to_string().starts_with(&server.url) && e.to_string().contains("not JSON"), "{e}");
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn a_wrong_number_of_choices_is_a_count_error() {
    let f = edited("completions_sampled", |r| {
        r["choices"].as_array_mut().unwrap().pop();
    });
    let (model, prompts, n, sampling) = f.completions_args();
    let server = Server::replay(vec![f]);
    let e = server.client(quick(), 0).complete(&model, &prompts, n, &sampling).unwrap_err();
    assert!(matches!(e, VllmError::Count { expected: 4, got: 3, .. }), "{e:?}");
    assert!(e.to_string().starts_with(&server.url), "{e}");
}

/// An edit of a recorded response and the words the error must contain.
type Edit = Box<dyn Fn(&mut Value)>;

fn case(want: &'static str, edit: impl Fn(&mut Value) + 'static) -> (&'static str, Edit) {
    (want, Box::new(edit))
}

#[test]
fn incomplete_choices_are_malformed_and_named() {
    let cases = [
        case("choices[2]: no logprobs", |r| r["choices"][2]["logprobs"] = Value::Null),
        case("choices[1]: no token_ids", |r| r["choices"][1]["token_ids"] = Value::Null),
        case("choices[3].logprobs.token_logprobs[0]: null", |r| {
            r["choices"][3]["logprobs"]["token_logprobs"][0] = Value::Null;
        }),
        case("choices[0]: 7 log-probs for 8 token ids", |r| {
            r["choices"][0]["logprobs"]["token_logprobs"].as_array_mut().unwrap().pop();
        }),
        case("choices[0].token_ids[0]: -3", |r| r["choices"][0]["token_ids"][0] = json!(-3)),
        case("choices[1]: index 0 appears twice", |r| r["choices"][1]["index"] = json!(0)),
        case("choices[1]: index 9 out of range", |r| r["choices"][1]["index"] = json!(9)),
        case("choices[2]: no finish_reason", |r| r["choices"][2]["finish_reason"] = Value::Null),
        case("no `choices` array", |r| r["choices"] = json!({})),
    ];
    for (want, edit) in cases {
        let f = edited("completions_sampled", |r| edit(r));
        let (model, prompts, n, sampling) = f.completions_args();
        let server = Server::replay(vec![f]);
        let e = server.client(quick(), 2).complete(&model, &prompts, n, &sampling).unwrap_err();
        assert!(matches!(e, VllmError::Malformed { .. }), "{want}: {e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with(&server.url) && msg.contains(want), "{want}: {msg}");
        assert_eq!(server.requests().len(), 1, "{want}: a malformed answer is not retried");
    }
}

#[test]
fn no_prompts_or_no_samples_send_nothing() {
    let server = Server::start(|_| Reply::raw(500, "{}"));
    let client = server.client(quick(), 0);
    assert!(client.complete("policy", &[], 4, &greedy_probe()).unwrap().is_empty());
    let none = client.complete("policy", &[vec![1], vec![2]], 0, &greedy_probe()).unwrap();
    assert_eq!(none.len(), 2);
    assert!(none.iter().all(Vec::is_empty));
    assert!(server.requests().is_empty());
}
