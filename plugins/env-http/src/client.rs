//! Sending one request: one attempt under a hard deadline ([`Client::attempt`]) and retries with
//! exponential backoff ([`Client::request`]). Async on the plugin's own single-threaded tokio
//! runtime; the environment's synchronous `reset`/`step` block on it.
//!
//! Only failures that are safe to repeat are retried: a connection that could not be established
//! (nothing reached the server), HTTP 5xx and HTTP 429 (honouring a `Retry-After` of up to 8 s).
//! A timeout, another status or an invalid body fails at once: the server may already have
//! applied the step, and sending it again would advance those episodes twice.
//!
//! Bounds: an attempt never takes longer than `timeout`, so a call takes at most
//! `(retries + 1) · timeout + Σ backoff`.

use std::time::{Duration, Instant};

use reqwest::header::{ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{StatusCode, Url};

use crate::config::{Settings, MAX_BACKOFF};
use crate::wire::Invalid;

/// How much of a failing response's body goes into the error message.
const BODY_PREFIX_CHARS: usize = 200;

/// Why one attempt failed: a short summary and an optional detail, both single-line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub summary: String,
    pub detail: Option<String>,
    /// Worth another attempt (see the module docs).
    pub retryable: bool,
    /// The server's `Retry-After`, if it sent one.
    pub retry_after: Option<Duration>,
}

impl Problem {
    fn new(summary: impl Into<String>, detail: Option<String>) -> Self {
        Problem { summary: summary.into(), detail: detail.map(|d| one_line(&d)), retryable: false, retry_after: None }
    }

    fn retryable(self) -> Self {
        Problem { retryable: true, ..self }
    }
}

/// A request that failed for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub url: Url,
    /// The last attempt's problem.
    pub problem: Problem,
    pub attempts: u32,
}

impl std::fmt::Display for Failure {
    /// `<url>: <summary> after <n> attempts[: <detail>]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = if self.attempts == 1 { "" } else { "s" };
        write!(f, "{}: {} after {} attempt{plural}", self.url, self.problem.summary, self.attempts)?;
        match &self.problem.detail {
            Some(d) if !d.is_empty() => write!(f, ": {d}"),
            _ => Ok(()),
        }
    }
}

/// The HTTP client and its settings.
#[derive(Debug)]
pub struct Client {
    pub settings: Settings,
    http: reqwest::Client,
}

impl Client {
    /// A client for `settings`.
    pub fn new(settings: Settings) -> Result<Client, reqwest::Error> {
        let http = reqwest::Client::builder()
            .user_agent(concat!("rlhf-env-http/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(settings.connect_timeout)
            .build()?;
        Ok(Client { settings, http })
    }

    /// POSTs `body` to `url` with retries and validates the 2xx body with `parse`.
    pub async fn request<T>(
        &self,
        url: &Url,
        body: Vec<u8>,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Result<T, Failure> {
        let attempts = self.settings.retries.saturating_add(1);
        let mut attempt = 1;
        loop {
            let t = Instant::now();
            let problem = match self.attempt(url, body.clone(), &parse).await {
                Ok(value) => return Ok(value),
                Err(problem) => problem,
            };
            tracing::trace!("{url}: attempt {attempt} took {:.3} s", t.elapsed().as_secs_f64());
            if !problem.retryable || attempt >= attempts {
                return Err(Failure { url: url.clone(), problem, attempts: attempt });
            }
            let detail = problem.detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default();
            tracing::warn!("{url}: {}{detail} (attempt {attempt} of {attempts}; retrying)", problem.summary);
            let wait = self.settings.backoff_before(attempt).max(problem.retry_after.unwrap_or_default());
            tokio::time::sleep(wait.min(MAX_BACKOFF)).await;
            attempt += 1;
        }
    }

    /// One attempt: POST, read the whole body, validate. Never exceeds `timeout`.
    pub async fn attempt<T>(
        &self,
        url: &Url,
        body: Vec<u8>,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Result<T, Problem> {
        let timeout = self.settings.timeout;
        let body = match tokio::time::timeout(timeout, self.fetch(url, body)).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(Problem::new(format!("timeout (no complete response within {})", secs(timeout)), None))
            }
        };
        parse(&body).map_err(|e| match e {
            Invalid::Json(m) => Problem::new("invalid JSON", Some(format!("{m}; body: {}", prefix(&body)))),
            Invalid::Shape(m) => Problem::new("invalid response", Some(m)),
        })
    }

    /// POSTs `body` and reads the response; a non-2xx status is a problem.
    async fn fetch(&self, url: &Url, body: Vec<u8>) -> Result<Vec<u8>, Problem> {
        let mut req = self
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json")
            .body(body);
        if let Some((name, value)) = &self.settings.auth {
            req = req.header(name.clone(), value.clone());
        }
        let mut resp = req.send().await.map_err(|e| {
            let connect = e.is_connect();
            let problem = Problem::new(if connect { "cannot connect" } else { "request failed" }, Some(chain(e)));
            if connect {
                problem.retryable()
            } else {
                problem
            }
        })?;
        let status = resp.status();
        let limit = self.settings.max_response_bytes;
        let too_large = || Problem::new("response too large", Some(format!("over max_response_bytes = {limit}")));
        if resp.content_length().is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let mut buf = Vec::new();
        while let Some(chunk) =
            resp.chunk().await.map_err(|e| Problem::new("reading the response failed", Some(chain(e))))?
        {
            if (buf.len() + chunk.len()) as u64 > limit {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        if status.is_success() {
            return Ok(buf);
        }
        let problem = Problem::new(format!("HTTP {}", status.as_u16()), Some(prefix(&buf)));
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            let retry_after = resp
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            return Err(Problem { retry_after, ..problem.retryable() });
        }
        Err(problem)
    }
}

/// `0.3 s`, `30 s`.
fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// A reqwest error with its sources, without the URL (the message names it once up front).
fn chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut parts = vec![e.to_string()];
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// The first [`BODY_PREFIX_CHARS`] characters of a body, on one line.
fn prefix(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = one_line(&text);
    match text.char_indices().nth(BODY_PREFIX_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

/// Collapses whitespace runs (newlines included) and drops other control characters.
fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().filter(|c| !c.is_control()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_read_as_one_line() {
        let f = Failure {
            url: Url::parse("http://127.0.0.1:9/step").unwrap(),
            problem: Problem::new("HTTP 500", Some("Internal\n  Server Error\r\n".into())),
            attempts: 3,
        };
        assert_eq!(f.to_string(), "http://127.0.0.1:9/step: HTTP 500 after 3 attempts: Internal Server Error");
        let f = Failure { problem: Problem::new("timeout", None), attempts: 1, ..f };
        assert_eq!(f.to_string(), "http://127.0.0.1:9/step: timeout after 1 attempt");
    }

    #[test]
    fn body_prefix_is_bounded() {
        let long = "é".repeat(300);
        let p = prefix(long.as_bytes());
        assert_eq!(p.chars().count(), BODY_PREFIX_CHARS + 1);
        assert!(p.ends_with('…'));
        assert_eq!(prefix(b"a\tb\n\nc"), "a b c");
        assert_eq!(prefix(&[0xff, b'x']), "\u{fffd}x");
    }
}
