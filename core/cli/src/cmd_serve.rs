//! `rlhf serve-reward`: a reward model behind HTTP, speaking the wire formats of OpenRLHF's remote
//! reward model (`POST /get_reward`) and LLaMA-Factory's score API (`POST /v1/score/evaluation`),
//! so the `reward-http` plugin (or those projects' own trainers) can use it.
//!
//! Texts are scored as given, with [`RewardModelScorer::score_texts`] (clients send the full
//! conversation text, templated as the reward model expects). libtorch models are used from one
//! thread at a time: a dedicated worker thread owns the scorer and serves jobs in arrival order;
//! the async side only parses, checks and queues.
//!
//! Safety rails: loopback only unless a bearer token is configured (`--token-env`), a cap on the
//! request body (`--max-body-bytes`, 413) and on texts per request (`--max-batch`, 413), every
//! error a JSON `{"error": "..."}` with a 4xx/5xx status, a panic while scoring answered with 500
//! instead of killing the server, a `Content-Length` over the cap refused (413) before any of the
//! body is read, read timeouts on headers (connection closed) and body (408, `--read-timeout-secs`),
//! and Ctrl-C / SIGTERM stopping it after in-flight requests, which get `--shutdown-grace-secs`.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rlhf_reward::{RewardError, RewardModelScorer};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::common::ModelArgs;

/// `rlhf serve-reward`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on, `HOST:PORT` [default: 127.0.0.1 with a port chosen by the OS]. A
    /// non-loopback address is refused unless --token-env is given.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Environment variable holding a bearer token; every scoring request must then send
    /// `Authorization: Bearer <token>` (GET /health stays open).
    #[arg(long, value_name = "VAR")]
    pub token_env: Option<String>,
    /// Texts per forward pass.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Tokens kept per text (the last ones).
    #[arg(long, default_value_t = 1024)]
    pub max_len: usize,
    /// Most texts accepted in one request (more: 413).
    #[arg(long, default_value_t = 256)]
    pub max_batch: usize,
    /// Largest request body accepted, in bytes (more: 413).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client gets to send a request's headers (then the connection is closed) and,
    /// again, its body (then 408).
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    pub read_timeout_secs: u64,
    /// Seconds in-flight requests get to finish after Ctrl-C / SIGTERM; connections still open
    /// then are closed and the server exits.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub shutdown_grace_secs: u64,
}

/// Resolves `--listen` and decides whether it may be served with the given token.
fn listen_addr(listen: Option<&str>, token: Option<&str>) -> anyhow::Result<SocketAddr> {
    let addr = match listen {
        None => SocketAddr::from(([127, 0, 0, 1], 0)),
        Some(spec) => spec
            .to_socket_addrs()
            .with_context(|| format!("--listen {spec}: expected HOST:PORT"))?
            .next()
            .with_context(|| format!("--listen {spec}: resolves to no address"))?,
    };
    if !addr.ip().is_loopback() && token.is_none() {
        bail!(
            "--listen {}: {} is not a loopback address; serving beyond this machine needs --token-env VAR \
             (an environment variable holding a bearer token)",
            listen.unwrap_or_default(),
            addr.ip()
        );
    }
    Ok(addr)
}

/// Reads the token from the variable `--token-env` names; it must be set and non-empty.
fn read_token(var: Option<&str>) -> anyhow::Result<Option<String>> {
    let Some(var) = var else { return Ok(None) };
    match std::env::var(var) {
        Ok(t) if !t.trim().is_empty() => Ok(Some(t.trim().to_string())),
        Ok(_) => bail!("--token-env {var}: the environment variable is empty"),
        Err(_) => bail!("--token-env {var}: the environment variable is not set"),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let token = read_token(args.token_env.as_deref())?;
    let addr = listen_addr(args.listen.as_deref(), token.as_deref())?;
    if args.max_batch == 0 {
        bail!("--max-batch: must be at least 1");
    }
    if args.max_body_bytes == 0 {
        bail!("--max-body-bytes: must be at least 1");
    }
    if args.read_timeout_secs == 0 {
        bail!("--read-timeout-secs: must be at least 1");
    }
    let (device, kind) = args.model.device_kind()?;
    let scorer = RewardModelScorer::from_dir(&args.model.model, device, kind, args.batch_size, args.max_len).map_err(
        |e| match e {
            RewardError::Setting { key, message } => anyhow::anyhow!("--{}: {message}", key.replace('_', "-")),
            e @ RewardError::NoModelDir { .. } => anyhow::anyhow!("--model {e}"),
            e => anyhow::anyhow!("loading the reward model {}: {e}", args.model.model.display()),
        },
    )?;
    let model_name = args
        .model
        .model
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| args.model.model.display().to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (jobs, rx) = mpsc::channel::<Job>(64);
    let worker = std::thread::Builder::new()
        .name("reward-model".into())
        .spawn(move || worker(scorer, rx))
        .context("starting the scoring thread")?;
    let state = Arc::new(AppState {
        jobs,
        token,
        max_batch: args.max_batch,
        max_body_bytes: args.max_body_bytes,
        max_len: args.max_len,
        read_timeout: Duration::from_secs(args.read_timeout_secs),
        model_name,
        requests: AtomicU64::new(0),
    });
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    let served = runtime.block_on(serve(addr, state, grace));
    // Connections past the grace period were aborted; dropping the runtime drops what is left of
    // them, and with them every job sender: the worker finishes its job at hand and ends.
    runtime.shutdown_background();
    served?;
    worker.join().map_err(|_| anyhow::anyhow!("the scoring thread panicked"))?;
    tracing::info!("stopped");
    Ok(())
}

/// Accepts connections until Ctrl-C / SIGTERM, then lets open ones finish for at most `grace`.
///
/// Not `axum::serve`: it gives hyper no timer, so a client could hold a connection forever with
/// half-sent headers, and its graceful shutdown waits for every connection without a bound.
async fn serve(addr: SocketAddr, state: Arc<AppState>, grace: Duration) -> anyhow::Result<()> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("--listen {addr}: cannot bind"))?;
    let local = listener.local_addr()?;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(state.read_timeout);
    let app = router(state);
    println!("listening on http://{local}");
    std::io::stdout().flush()?;
    tracing::info!(%local, "serving POST /get_reward, POST /v1/score/evaluation, GET /health");
    let (stop_tx, stop_rx) = watch::channel(());
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown_signal());
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        while connections.try_join_next().is_some() {}
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            let done = tokio::select! {
                result = conn.as_mut() => Some(result),
                _ = stop.changed() => None,
            };
            let result = match done {
                Some(result) => result,
                None => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, "connection: {e}");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(());
    let drained = tokio::time::timeout(grace, async { while connections.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            "{} connection(s) still open after --shutdown-grace-secs {}; closing them",
            connections.len(),
            grace.as_secs()
        );
        connections.abort_all();
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}

/// What the handlers share.
struct AppState {
    jobs: mpsc::Sender<Job>,
    token: Option<String>,
    max_batch: usize,
    max_body_bytes: usize,
    max_len: usize,
    read_timeout: Duration,
    model_name: String,
    requests: AtomicU64,
}

/// One request's texts for the scoring thread.
struct Job {
    texts: Vec<String>,
    max_len: usize,
    reply: oneshot::Sender<Result<Vec<f64>, ApiError>>,
}

/// Owns the model; scores jobs one after another until every sender is dropped.
fn worker(scorer: RewardModelScorer, mut rx: mpsc::Receiver<Job>) {
    while let Some(job) = rx.blocking_recv() {
        let t0 = Instant::now();
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| scorer.score_texts_max_len(&job.texts, job.max_len)));
        let reply = match result {
            Ok(Ok(scores)) => match scores.iter().position(|s| !s.is_finite()) {
                Some(i) => Err(ApiError::internal(format!("the reward model returned {} for text {i}", scores[i]))),
                None => Ok(scores),
            },
            Ok(Err(RewardError::EmptyText { index })) => {
                Err(ApiError::bad_request(format!("text {index} has no tokens; an empty text has no score")))
            }
            Ok(Err(e)) => Err(ApiError::internal(format!("scoring failed: {e}"))),
            Err(_) => Err(ApiError::internal("scoring panicked".to_string())),
        };
        tracing::debug!(texts = job.texts.len(), ms = t0.elapsed().as_millis() as u64, ok = reply.is_ok(), "scored");
        let _ = job.reply.send(reply);
    }
}

fn router(state: Arc<AppState>) -> Router {
    let scoring = Router::new()
        .route("/get_reward", post(get_reward))
        .route("/v1/score/evaluation", post(score_evaluation))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(scoring)
        .route("/health", get(health))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint".to_string()) })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this endpoint".to_string())
        })
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .with_state(state)
}

/// An error answered as `{"error": message}` with `status`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: String) -> Self {
        ApiError { status, message }
    }

    fn bad_request(message: String) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    fn internal(message: String) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), "{}", self.message);
        }
        let mut response = (self.status, Json(json!({ "error": self.message }))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a token matched.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// With a token configured, requires `Authorization: Bearer <token>`.
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        match given {
            None => {
                return ApiError::new(StatusCode::UNAUTHORIZED, "missing `Authorization: Bearer <token>`".into())
                    .into_response()
            }
            Some(g) if !same_secret(g.as_bytes(), token.as_bytes()) => {
                return ApiError::new(StatusCode::UNAUTHORIZED, "invalid bearer token".into()).into_response()
            }
            Some(_) => {}
        }
    }
    next.run(request).await
}

/// Reads the whole body up front, after the token check: a declared `Content-Length` over
/// `--max-body-bytes` is 413 before a byte of the body is read, a body not complete within
/// `--read-timeout-secs` is 408 (both close the connection).
async fn read_body(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {} bytes (--max-body-bytes)", state.max_body_bytes),
        )
    };
    let declared =
        request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.max_body_bytes as u64) {
        return closing(too_large());
    }
    let (parts, body) = request.into_parts();
    let limited = http_body_util::Limited::new(body, state.max_body_bytes);
    let bytes = match tokio::time::timeout(state.read_timeout, http_body_util::BodyExt::collect(limited)).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return closing(too_large()),
        Ok(Err(e)) => return closing(ApiError::bad_request(format!("reading the request body: {e}"))),
        Err(_) => {
            return closing(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("request body not received within {} s (--read-timeout-secs)", state.read_timeout.as_secs()),
            ))
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// `error` with `Connection: close`: the rest of an unread body is not waited for.
fn closing(error: ApiError) -> Response {
    let mut response = error.into_response();
    response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    response
}

/// The body as JSON of type `T`; a body over the limit is 413, anything unparsable 400.
fn parse_body<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over {} bytes (--max-body-bytes)", state.max_body_bytes),
            )
        } else {
            ApiError::new(rejection.status(), rejection.body_text())
        }
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// Checks the batch size and scores `texts` on the worker thread.
async fn score(state: &AppState, field: &str, texts: Vec<String>, max_len: usize) -> Result<Vec<f64>, ApiError> {
    if texts.len() > state.max_batch {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("`{field}` has {} texts, more than --max-batch {}", texts.len(), state.max_batch),
        ));
    }
    if texts.is_empty() {
        return Ok(Vec::new());
    }
    let (reply, answer) = oneshot::channel();
    let unavailable = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the scoring thread has stopped".into());
    state.jobs.send(Job { texts, max_len, reply }).await.map_err(|_| unavailable())?;
    answer.await.map_err(|_| unavailable())?.map_err(|e| match e.status {
        StatusCode::BAD_REQUEST => ApiError::bad_request(format!("`{field}`: {}", e.message)),
        _ => e,
    })
}

/// OpenRLHF's remote reward model request. `prompts` and `labels` are accepted and ignored: the
/// query texts already hold the prompts.
#[derive(Deserialize)]
struct GetReward {
    query: Vec<String>,
    #[serde(default)]
    #[allow(dead_code)]
    prompts: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    labels: Option<Value>,
}

/// `POST /get_reward` → `{"rewards": [...], "scores": [...]}` (the same numbers twice: older
/// OpenRLHF clients read `rewards`, newer ones `scores`).
async fn get_reward(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: GetReward = parse_body(&state, body)?;
    state.requests.fetch_add(1, Ordering::Relaxed);
    let scores = score(&state, "query", req.query, state.max_len).await?;
    Ok(Json(json!({ "rewards": scores, "scores": scores })))
}

/// LLaMA-Factory's score request.
#[derive(Deserialize)]
struct ScoreEvaluation {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<String>,
    #[serde(default)]
    max_length: Option<usize>,
}

/// `POST /v1/score/evaluation` → `{"id", "object": "score.evaluation", "model", "scores": [...]}`.
async fn score_evaluation(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: ScoreEvaluation = parse_body(&state, body)?;
    let n = state.requests.fetch_add(1, Ordering::Relaxed);
    let max_len = req.max_length.unwrap_or(state.max_len).clamp(1, state.max_len);
    let scores = score(&state, "messages", req.messages, max_len).await?;
    Ok(Json(json!({
        "id": format!("scoreval-{n}"),
        "object": "score.evaluation",
        "model": req.model.unwrap_or_else(|| state.model_name.clone()),
        "scores": scores,
    })))
}

/// `GET /health` → `{"status": "ok", "model": NAME}` (never needs the token).
async fn health(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "status": "ok", "model": state.model_name }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_is_loopback_unless_a_token_is_set() {
        assert_eq!(listen_addr(None, None).unwrap(), "127.0.0.1:0".parse().unwrap());
        assert_eq!(listen_addr(Some("127.0.0.1:8000"), None).unwrap().port(), 8000);
        assert!(listen_addr(Some("[::1]:8000"), None).is_ok());
        assert!(listen_addr(Some("localhost:0"), None).unwrap().ip().is_loopback());
        let e = listen_addr(Some("0.0.0.0:8000"), None).unwrap_err().to_string();
        assert!(e.starts_with("--listen 0.0.0.0:8000: 0.0.0.0 is not a loopback address") && e.contains("--token-env"));
        assert!(listen_addr(Some("0.0.0.0:8000"), Some("t")).is_ok());
        let e = format!("{:#}", listen_addr(Some("nonsense"), None).unwrap_err());
        assert!(e.starts_with("--listen nonsense: expected HOST:PORT"), "{e}");
    }

    #[test]
    fn token_must_be_set_and_non_empty() {
        assert_eq!(read_token(None).unwrap(), None);
        let e = read_token(Some("RLHF_TEST_SURELY_UNSET_VAR")).unwrap_err().to_string();
        assert_eq!(e, "--token-env RLHF_TEST_SURELY_UNSET_VAR: the environment variable is not set");
        assert!(same_secret(b"abc", b"abc") && !same_secret(b"abc", b"abd") && !same_secret(b"abc", b"ab"));
    }
}
