//! A blocking HTTP client for one vLLM server: its OpenAI-compatible `/v1/completions` on token-id
//! prompts, and the endpoints an RL trainer drives between steps (`/collective_rpc`
//! `reload_weights`, `/v1/load_lora_adapter`, `/reset_prefix_cache`, `/health`, and for a model
//! with images `/reset_mm_cache` and `/reset_encoder_cache`). Prompts with images go to
//! `/inference/v1/generate` ([`super::generate`]).
//!
//! The server must run with `VLLM_SERVER_DEV_MODE=1` (for `/collective_rpc` and
//! `/reset_prefix_cache`), `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and `--enable-lora` (for
//! `load_lora`), and should run with `--logprobs-mode processed_logprobs` so the returned
//! log-probs are those of the distribution actually sampled from (after temperature/top-p/top-k).
//!
//! What vLLM 0.32 answers (recorded in `integration-tests/fixtures/vllm/`):
//! - completions: one choice per (prompt, sample), `index = prompt * n + k`, each with
//!   `token_ids` (the generated ids; a stop token — EOS or one of `stop_token_ids` — is the last id
//!   when the sequence stopped on it), `logprobs.token_logprobs` (one per generated id, the sampled
//!   token's log-prob; vLLM clamps `-inf` to `-9999.0`, and writes `null` where it has none) and
//!   `finish_reason` (`"stop"` or `"length"`);
//! - `/collective_rpc`: `{"results": [null, ...]}` (one entry per worker) or an empty body;
//!   a failed `reload_weights` is a 500 and leaves the engine unusable;
//! - `/v1/load_lora_adapter`: 200 with a plain-text body;
//! - `/reset_prefix_cache`: `{"success": bool}` (false while blocks are still held);
//! - `/health`: 200 with an empty body;
//! - errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.
//!
//! Connect errors, timeouts and 5xx answers are retried `retries` times with a short linear
//! backoff; 4xx answers never are. A body is read up to a bound ([`body_limit`]: 1 MiB for the
//! control endpoints, and 4 KiB more per token a sampling request may return), so a server or
//! proxy that streams without end fails the request instead of the trainer's memory. Nothing here
//! panics on what a server sends.

use std::path::Path;
use std::time::Duration;

use reqwest::blocking::Client;
use reqwest::Method;
use serde_json::{json, Value};

/// How much of an error body a [`VllmError::Status`] keeps, in characters.
const BODY_CHARS: usize = 300;
/// The backoff before retry `k` (1-based) is `k` times this.
const BACKOFF: Duration = Duration::from_millis(200);
/// The largest body read from a control endpoint, and the base of a sampling request's bound.
const SMALL_BODY: u64 = 1 << 20;
/// What a sampling answer may take per token it can hold (prompt and generated, every sample):
/// vLLM writes about 30–120 bytes per token (id, log-prob, offsets, text).
const BYTES_PER_TOKEN: u64 = 4 << 10;

/// The most bytes read from a sampling answer of `samples` sequences of at most `tokens` tokens
/// each (prompt and generated): [`SMALL_BODY`] plus [`BYTES_PER_TOKEN`] for each.
pub(super) fn body_limit(samples: usize, tokens: i64) -> u64 {
    let tokens = (samples as u64).saturating_mul(tokens.max(0) as u64);
    SMALL_BODY.saturating_add(tokens.saturating_mul(BYTES_PER_TOKEN))
}

/// Errors talking to one vLLM server. Every message starts with the server's base URL.
#[derive(Debug, thiserror::Error)]
pub enum VllmError {
    /// The client could not be set up or a request could not be formed (bad URL, non-UTF-8 path).
    #[error("{url}: {what}")]
    Invalid { url: String, what: String },
    /// No connection (or the connection broke) on every attempt.
    #[error("{url}: {endpoint}: connection failed after {attempts} attempt(s): {message}")]
    Connect { url: String, endpoint: String, attempts: u32, message: String },
    /// No complete answer within the timeout on every attempt.
    #[error("{url}: {endpoint}: timed out after {attempts} attempt(s) of {timeout:?} each")]
    Timeout { url: String, endpoint: String, attempts: u32, timeout: Duration },
    /// A non-success HTTP status (5xx after the retries; 4xx at once). `body` is its first 300
    /// characters.
    #[error("{url}: {endpoint}: HTTP {code}: {body}")]
    Status { url: String, endpoint: String, code: u16, body: String },
    /// A success status with a body that is not what the endpoint answers.
    #[error("{url}: {endpoint}: malformed response: {what}")]
    Malformed { url: String, endpoint: String, what: String },
    /// A completions answer with the wrong number of choices.
    #[error("{url}: {endpoint}: expected {expected} choices, got {got}")]
    Count { url: String, endpoint: String, expected: usize, got: usize },
    /// The server answered 200 but reports that the operation did not happen.
    #[error("{url}: {endpoint}: the server reports failure: {what}")]
    Failed { url: String, endpoint: String, what: String },
    /// The answer's body (announced or read) is longer than the request can need.
    #[error("{url}: {endpoint}: the answer is over {limit} bytes, more than this request can need")]
    TooLarge { url: String, endpoint: String, limit: u64 },
}

/// Sampling settings for one completions request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Most tokens generated per completion.
    pub max_tokens: i64,
    pub temperature: f64,
    pub top_p: f64,
    /// 0 (or negative) = off (sent as -1).
    pub top_k: i64,
    /// Ids that end a completion (normally the EOS id); the stop id is the last returned id.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a completion (a multi-turn episode's tool-call end), kept in the output:
    /// the last returned id is the one that completed the string.
    pub stop: Vec<String>,
    /// vLLM gives sample `k` of every prompt the seed `seed + k`, so with a seed the k-th samples
    /// of different prompts share their random draws: leave it `None` for rollouts.
    pub seed: Option<u64>,
}

impl Sampling {
    /// vLLM's sampling parameters for `n` samples of a prompt, the sampled tokens' log-probs
    /// with them (`logprobs: 0`); a completions request carries them at its top level, a
    /// generate request as its `sampling_params`.
    pub(super) fn to_json(&self, n: usize) -> Value {
        let mut v = json!({
            "n": n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": if self.top_k > 0 { self.top_k } else { -1 },
            "logprobs": 0,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": false,
        });
        if let (Some(seed), Some(map)) = (self.seed, v.as_object_mut()) {
            map.insert("seed".into(), json!(seed));
        }
        if let (false, Some(map)) = (self.stop.is_empty(), v.as_object_mut()) {
            map.insert("stop".into(), json!(self.stop));
            map.insert("include_stop_str_in_output".into(), json!(true));
        }
        v
    }
}

/// One sampled completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The generated ids, ending with the stop id when `finish_reason` is `"stop"`.
    pub token_ids: Vec<u32>,
    /// One per token: the log-prob of the sampled token (finite; vLLM writes `-9999.0` for `-inf`).
    pub logprobs: Vec<f64>,
    /// `"stop"` (a stop id or EOS) or `"length"` (`max_tokens` reached).
    pub finish_reason: String,
}

/// One vLLM server.
#[derive(Debug, Clone)]
pub struct VllmClient {
    /// Base URL without a trailing slash, e.g. `http://127.0.0.1:8000`.
    url: String,
    http: Client,
    timeout: Duration,
    retries: u32,
}

/// What went wrong in one attempt, before it is known whether it is the last.
enum Failure {
    Connect(String),
    Timeout,
    Status(u16, String),
    TooLarge,
}

impl Failure {
    fn retryable(&self) -> bool {
        match self {
            Failure::Connect(_) | Failure::Timeout => true,
            Failure::Status(code, _) => *code >= 500,
            Failure::TooLarge => false,
        }
    }
}

/// What is wrong with a completions body.
enum BadCompletions {
    Malformed(String),
    Count { expected: usize, got: usize },
}

impl VllmClient {
    /// A client for the server at `base_url` (`http://host:port`, a trailing `/` is dropped).
    /// `timeout` bounds each attempt (connect to last byte); `retries` is the number of extra
    /// attempts after a connect error, a timeout or a 5xx answer.
    pub fn new(base_url: &str, timeout: Duration, retries: u32) -> Result<Self, VllmError> {
        let url = base_url.trim().trim_end_matches('/').to_string();
        let invalid = |what: String| VllmError::Invalid { url: url.clone(), what };
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(invalid("the URL must start with http:// or https://".into()));
        }
        match reqwest::Url::parse(&url) {
            Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => {}
            Ok(_) => return Err(invalid("the URL has no host".into())),
            Err(e) => return Err(invalid(format!("not a valid URL: {e}"))),
        }
        if timeout.is_zero() {
            return Err(invalid("the timeout must be positive".into()));
        }
        let http = Client::builder()
            .user_agent(concat!("rlhf-trainer/", env!("CARGO_PKG_VERSION")))
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| invalid(format!("cannot build the HTTP client: {}", chain(&e))))?;
        Ok(VllmClient { url, http, timeout, retries })
    }

    /// The base URL, without a trailing slash.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `n` completions of every prompt (token ids), in prompt order: `result[p][k]`. Sends one
    /// request; `model` is the served model name or a loaded LoRA adapter's name.
    pub fn complete(
        &self,
        model: &str,
        prompts: &[Vec<u32>],
        n: usize,
        s: &Sampling,
    ) -> Result<Vec<Vec<Completion>>, VllmError> {
        if prompts.is_empty() || n == 0 {
            return Ok(vec![Vec::new(); prompts.len()]);
        }
        let mut body = s.to_json(n);
        if let Some(map) = body.as_object_mut() {
            map.insert("model".into(), json!(model));
            map.insert("prompt".into(), json!(prompts));
            map.insert("return_token_ids".into(), json!(true));
        }
        const PATH: &str = "/v1/completions";
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
        let limit = body_limit(prompts.len() * n, longest + s.max_tokens);
        let text = self.send_bounded(Method::POST, PATH, Some(&body), limit)?;
        let endpoint = endpoint(&Method::POST, PATH);
        let value: Value = serde_json::from_str(&text).map_err(|e| VllmError::Malformed {
            url: self.url.clone(),
            endpoint: endpoint.clone(),
            what: format!("not JSON ({e}): {}", clip(&text)),
        })?;
        parse_completions(&value, prompts.len(), n).map_err(|bad| match bad {
            BadCompletions::Malformed(what) => VllmError::Malformed { url: self.url.clone(), endpoint, what },
            BadCompletions::Count { expected, got } => {
                VllmError::Count { url: self.url.clone(), endpoint, expected, got }
            }
        })
    }

    /// Reloads the policy weights in place from `dir` (a Hugging Face checkpoint directory as the
    /// server sees it: use an absolute path on a file system the server shares).
    pub fn reload_weights(&self, dir: &Path) -> Result<(), VllmError> {
        let path = self.utf8(dir, "weights directory")?;
        let body = json!({"method": "reload_weights", "kwargs": {"weights_path": path}});
        const PATH: &str = "/collective_rpc";
        let text = self.send(Method::POST, PATH, Some(&body))?;
        if text.trim().is_empty() {
            return Ok(());
        }
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.get("results").is_some_and(Value::is_array) => Ok(()),
            _ => Err(self.malformed(PATH, format!("expected {{\"results\": [...]}}, got {}", clip(&text)))),
        }
    }

    /// Loads (or replaces in place) the PEFT LoRA adapter in `dir` under the model name `name`.
    pub fn load_lora(&self, name: &str, dir: &Path) -> Result<(), VllmError> {
        let path = self.utf8(dir, "LoRA adapter directory")?;
        let body = json!({"lora_name": name, "lora_path": path, "load_inplace": true});
        self.send(Method::POST, "/v1/load_lora_adapter", Some(&body)).map(drop)
    }

    /// Drops the server's prefix (KV) cache, so no cached prefix from older weights is reused.
    pub fn reset_prefix_cache(&self) -> Result<(), VllmError> {
        const PATH: &str = "/reset_prefix_cache";
        let text = self.send(Method::POST, PATH, None)?;
        if text.trim().is_empty() {
            return Ok(()); // vLLM before `{"success": ...}` answered an empty 200
        }
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| self.malformed(PATH, format!("not JSON ({e}): {}", clip(&text))))?;
        match value.get("success") {
            Some(Value::Bool(false)) => Err(VllmError::Failed {
                url: self.url.clone(),
                endpoint: endpoint(&Method::POST, PATH),
                what: "success = false (blocks still held by running requests)".into(),
            }),
            Some(Value::Bool(true)) | None => Ok(()),
            Some(other) => Err(self.malformed(PATH, format!("`success` is {other}, not a bool"))),
        }
    }

    /// Drops the server's cached outputs of the vision encoder (`/reset_encoder_cache`, which
    /// vLLM asks for after new weights) and of its multimodal processing (`/reset_mm_cache`): its
    /// `reload_weights` clears the worker's encoder cache but not the scheduler's record of it,
    /// so the next request with a cached image would fail on a miss.
    pub fn reset_image_caches(&self) -> Result<(), VllmError> {
        self.send(Method::POST, "/reset_mm_cache", None)?;
        self.send(Method::POST, "/reset_encoder_cache", None).map(drop)
    }

    /// Succeeds when `GET /health` answers 2xx.
    pub fn health(&self) -> Result<(), VllmError> {
        self.send(Method::GET, "/health", None).map(drop)
    }

    /// One request to a control endpoint with retries; the body of the 2xx answer (at most
    /// [`SMALL_BODY`] bytes).
    pub(super) fn send(&self, method: Method, path: &str, body: Option<&Value>) -> Result<String, VllmError> {
        self.send_bounded(method, path, body, SMALL_BODY)
    }

    /// One request with retries; the body of the 2xx answer, of at most `limit` bytes.
    pub(super) fn send_bounded(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        limit: u64,
    ) -> Result<String, VllmError> {
        let attempts = self.retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            match self.attempt(method.clone(), path, body, limit) {
                Ok(text) => return Ok(text),
                Err(f) if attempt < attempts && f.retryable() => {
                    std::thread::sleep(BACKOFF.saturating_mul(attempt));
                    attempt += 1;
                }
                Err(f) => {
                    let (url, endpoint) = (self.url.clone(), endpoint(&method, path));
                    return Err(match f {
                        Failure::Connect(message) => VllmError::Connect { url, endpoint, attempts: attempt, message },
                        Failure::Timeout => {
                            VllmError::Timeout { url, endpoint, attempts: attempt, timeout: self.timeout }
                        }
                        Failure::Status(code, body) => VllmError::Status { url, endpoint, code, body },
                        Failure::TooLarge => VllmError::TooLarge { url, endpoint, limit },
                    });
                }
            }
        }
    }

    fn attempt(&self, method: Method, path: &str, body: Option<&Value>, limit: u64) -> Result<String, Failure> {
        let mut req = self.http.request(method, format!("{}{path}", self.url));
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().map_err(transport)?;
        let status = resp.status();
        // An announced oversize body fails before it is read; one that grows past the limit (no
        // or a false `Content-Length`) fails once it has.
        if resp.content_length().is_some_and(|n| n > limit) {
            return Err(Failure::TooLarge);
        }
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(resp, limit.saturating_add(1)), &mut buf)
            .map_err(|e| read_failure(&e))?;
        if buf.len() as u64 > limit {
            return Err(Failure::TooLarge);
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        if status.is_success() {
            Ok(text)
        } else {
            Err(Failure::Status(status.as_u16(), clip(&text)))
        }
    }

    fn utf8<'a>(&self, dir: &'a Path, what: &str) -> Result<&'a str, VllmError> {
        dir.to_str().ok_or_else(|| VllmError::Invalid {
            url: self.url.clone(),
            what: format!("the {what} {} is not valid UTF-8", dir.display()),
        })
    }

    pub(super) fn malformed(&self, path: &str, what: String) -> VllmError {
        VllmError::Malformed { url: self.url.clone(), endpoint: endpoint(&Method::POST, path), what }
    }
}

fn endpoint(method: &Method, path: &str) -> String {
    format!("{method} {path}")
}

fn transport(e: reqwest::Error) -> Failure {
    if e.is_timeout() {
        Failure::Timeout
    } else {
        Failure::Connect(chain(&e))
    }
}

/// A body that broke off while read: a timeout where reqwest says so, else a broken connection.
fn read_failure(e: &std::io::Error) -> Failure {
    let timed_out = e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref().and_then(|inner| inner.downcast_ref::<reqwest::Error>()).is_some_and(reqwest::Error::is_timeout);
    if timed_out {
        Failure::Timeout
    } else {
        Failure::Connect(chain(e))
    }
}

/// An error and its sources, `: `-separated (reqwest's own message alone says little).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The first [`BODY_CHARS`] characters of `text`, `…` marking a cut.
pub(super) fn clip(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(BODY_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// Checks a completions body for `prompts × n` choices and sorts them by `index`.
fn parse_completions(v: &Value, prompts: usize, n: usize) -> Result<Vec<Vec<Completion>>, BadCompletions> {
    let bad = BadCompletions::Malformed;
    let choices = v.get("choices").and_then(Value::as_array).ok_or_else(|| bad("no `choices` array".into()))?;
    let expected = prompts.saturating_mul(n);
    if choices.len() != expected {
        return Err(BadCompletions::Count { expected, got: choices.len() });
    }
    let mut slots: Vec<Option<Completion>> = vec![None; expected];
    for (i, c) in choices.iter().enumerate() {
        let index = match c.get("index") {
            Some(x) => {
                x.as_u64().ok_or_else(|| bad(format!("choices[{i}]: index {x} is not a non-negative integer")))?
            }
            None => return Err(bad(format!("choices[{i}]: no index"))),
        };
        let slot = usize::try_from(index)
            .ok()
            .and_then(|k| slots.get_mut(k))
            .ok_or_else(|| bad(format!("choices[{i}]: index {index} out of range 0..{expected}")))?;
        if slot.is_some() {
            return Err(bad(format!("choices[{i}]: index {index} appears twice")));
        }
        *slot = Some(parse_choice(c, i).map_err(bad)?);
    }
    let mut flat = slots.into_iter().flatten();
    Ok((0..prompts).map(|_| flat.by_ref().take(n).collect()).collect())
}

fn parse_choice(c: &Value, i: usize) -> Result<Completion, String> {
    let ids = match c.get("token_ids") {
        Some(Value::Array(ids)) => ids,
        Some(Value::Null) | None => return Err(format!("choices[{i}]: no token_ids (was return_token_ids sent?)")),
        Some(other) => return Err(format!("choices[{i}]: token_ids is {}, not an array", kind(other))),
    };
    let token_ids = ids
        .iter()
        .enumerate()
        .map(|(j, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("choices[{i}].token_ids[{j}]: {t} is not a u32 token id"))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let lps = match c.get("logprobs").and_then(|l| l.get("token_logprobs")) {
        Some(Value::Array(lps)) => lps,
        _ => return Err(format!("choices[{i}]: no logprobs.token_logprobs (was logprobs sent?)")),
    };
    if lps.len() != token_ids.len() {
        return Err(format!("choices[{i}]: {} log-probs for {} token ids", lps.len(), token_ids.len()));
    }
    let logprobs = lps
        .iter()
        .enumerate()
        .map(|(j, lp)| match lp.as_f64() {
            Some(x) if x.is_finite() => Ok(x),
            _ => Err(format!("choices[{i}].logprobs.token_logprobs[{j}]: {lp} is not a finite number")),
        })
        .collect::<Result<Vec<f64>, String>>()?;
    let finish_reason = match c.get("finish_reason") {
        Some(Value::String(r)) => r.clone(),
        _ => return Err(format!("choices[{i}]: no finish_reason")),
    };
    Ok(Completion { token_ids, logprobs, finish_reason })
}

pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(index: u64, ids: &[u32]) -> Value {
        let lps: Vec<f64> = ids.iter().map(|&t| -f64::from(t) - 0.5).collect();
        json!({"index": index, "token_ids": ids, "logprobs": {"token_logprobs": lps}, "finish_reason": "length"})
    }

    fn parse(choices: Vec<Value>, prompts: usize, n: usize) -> Result<Vec<Vec<Completion>>, String> {
        parse_completions(&json!({ "choices": choices }), prompts, n).map_err(|b| match b {
            BadCompletions::Malformed(m) => m,
            BadCompletions::Count { expected, got } => format!("count {expected} {got}"),
        })
    }

    #[test]
    fn choices_are_placed_by_index() {
        let out = parse(vec![choice(3, &[4]), choice(0, &[1]), choice(2, &[3]), choice(1, &[2])], 2, 2).unwrap();
        let ids: Vec<Vec<Vec<u32>>> = out.iter().map(|p| p.iter().map(|c| c.token_ids.clone()).collect()).collect();
        assert_eq!(ids, vec![vec![vec![1], vec![2]], vec![vec![3], vec![4]]]);
        assert_eq!(out[1][0].logprobs, vec![-3.5]);
    }

    #[test]
    fn bad_choices_are_named() {
        let e = parse(vec![choice(0, &[1]), choice(0, &[2])], 1, 2).unwrap_err();
        assert!(e.contains("choices[1]: index 0 appears twice"), "{e}");
        let e = parse(vec![choice(0, &[1]), choice(2, &[2])], 1, 2).unwrap_err();
        assert!(e.contains("out of range"), "{e}");
        let e = parse(vec![choice(0, &[1])], 1, 2).unwrap_err();
        assert_eq!(e, "count 2 1");
        let mut c = choice(0, &[1, 2]);
        c["logprobs"]["token_logprobs"][1] = Value::Null;
        let e = parse(vec![c], 1, 1).unwrap_err();
        assert!(e.contains("token_logprobs[1]: null is not a finite number"), "{e}");
        let mut c = choice(0, &[1]);
        c["token_ids"][0] = json!(1u64 << 40);
        assert!(parse(vec![c], 1, 1).unwrap_err().contains("not a u32"));
        let mut c = choice(0, &[1]);
        c["index"] = json!(-1);
        assert!(parse(vec![c], 1, 1).unwrap_err().contains("not a non-negative integer"));
    }

    #[test]
    fn clip_cuts_on_characters() {
        let long = "é".repeat(400);
        let cut = clip(&long);
        assert_eq!(cut.chars().count(), BODY_CHARS + 1);
        assert_eq!(clip(" short "), "short");
    }

    #[test]
    fn new_checks_the_url() {
        let t = Duration::from_secs(1);
        assert_eq!(VllmClient::new("http://h:1/", t, 0).unwrap().url(), "http://h:1");
        let e = VllmClient::new("h:1", t, 0).unwrap_err().to_string();
        assert!(e.starts_with("h:1: "), "{e}");
        assert!(VllmClient::new("http://h:1", Duration::ZERO, 0).is_err());
    }
}
