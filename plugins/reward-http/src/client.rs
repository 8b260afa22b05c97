//! Sending requests: one attempt under a hard deadline ([`Client::attempt`]), retries with
//! exponential backoff ([`Client::request`]), and a batch of requests with bounded concurrency
//! ([`Client::run`]). Everything is async on the plugin's own single-threaded tokio runtime; the
//! plugin's synchronous `score` blocks on it.
//!
//! Bounds: an attempt never takes longer than `timeout`, so a request takes at most
//! `(retries + 1) · timeout + Σ backoff`, and a batch at most `⌈requests / concurrency⌉` times that.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use reqwest::Url;

use crate::config::Settings;
use crate::wire::{self, Invalid, Reply};

/// Largest response body read; a server sending more is treated as failing.
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// How much of a failing response's body goes into the error message.
const BODY_PREFIX_CHARS: usize = 200;

/// One request of a batch: the samples `start..start + len`, for `urls[url]`.
#[derive(Debug, Clone)]
pub struct Job {
    pub url: usize,
    pub start: usize,
    pub len: usize,
    /// The serialized JSON body.
    pub body: Vec<u8>,
}

/// Why one attempt failed: a short summary and an optional detail, both single-line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub summary: String,
    pub detail: Option<String>,
}

impl Problem {
    fn new(summary: impl Into<String>, detail: Option<String>) -> Self {
        Problem { summary: summary.into(), detail: detail.map(|d| one_line(&d)) }
    }
}

/// A request that failed on every attempt.
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

/// What became of one [`Job`].
#[derive(Debug, Clone)]
pub struct Outcome {
    pub result: Result<Reply, Failure>,
    /// Attempts made (1 + retries used); 0 if the job was never started because the batch
    /// was aborted.
    pub attempts: u32,
    /// Wall time of each attempt, seconds.
    pub latencies: Vec<f64>,
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
            .user_agent(concat!("rlhf-reward-http/", env!("CARGO_PKG_VERSION")))
            // Also enforced around each attempt; this lets reqwest fail a stuck connect early.
            .connect_timeout(settings.timeout)
            .build()?;
        Ok(Client { settings, http })
    }

    /// Runs `jobs` with at most `concurrency` requests in flight; outcomes in job order. With
    /// `abort_on_failure`, jobs not yet started when one fails are not sent (their outcome is the
    /// failure with 0 attempts).
    pub async fn run(self: &Arc<Self>, jobs: Vec<Job>, abort_on_failure: bool) -> Vec<Outcome> {
        let jobs = Arc::new(jobs);
        let next = Arc::new(AtomicUsize::new(0));
        let abort = Arc::new(AtomicBool::new(false));
        let workers = self.settings.concurrency.min(jobs.len());
        let mut handles = Vec::with_capacity(workers);
        for _ in 0..workers {
            let (this, jobs, next, abort) =
                (Arc::clone(self), Arc::clone(&jobs), Arc::clone(&next), Arc::clone(&abort));
            handles.push(tokio::spawn(async move {
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs.len() || abort.load(Ordering::Relaxed) {
                        break;
                    }
                    let outcome = this.request(&jobs[i], &abort).await;
                    if outcome.result.is_err() && abort_on_failure {
                        abort.store(true, Ordering::Relaxed);
                    }
                    done.push((i, outcome));
                }
                done
            }));
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; jobs.len()];
        for handle in handles {
            // A worker only ends by returning; a panic inside it is re-raised here and caught at
            // the plugin boundary.
            let done = match handle.await {
                Ok(done) => done,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => panic!("request worker cancelled: {e}"),
            };
            for (i, outcome) in done {
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .zip(jobs.iter())
            .map(|(o, job)| {
                o.unwrap_or_else(|| Outcome {
                    result: Err(Failure {
                        url: self.settings.urls[job.url].clone(),
                        problem: Problem::new("not sent", Some("another request of the batch failed".into())),
                        attempts: 0,
                    }),
                    attempts: 0,
                    latencies: Vec::new(),
                })
            })
            .collect()
    }

    /// One request with its retries. Stops retrying early when `abort` is set.
    pub async fn request(&self, job: &Job, abort: &AtomicBool) -> Outcome {
        let url = &self.settings.urls[job.url];
        let attempts = self.settings.retries.saturating_add(1);
        let mut latencies = Vec::new();
        let mut last = None;
        for attempt in 1..=attempts {
            if attempt > 1 {
                if abort.load(Ordering::Relaxed) {
                    break;
                }
                tokio::time::sleep(self.settings.backoff_before(attempt - 1)).await;
            }
            let t = Instant::now();
            let result = self.attempt(url, job).await;
            latencies.push(t.elapsed().as_secs_f64());
            match result {
                Ok(reply) => return Outcome { result: Ok(reply), attempts: attempt, latencies },
                Err(problem) => {
                    let detail = problem.detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default();
                    if attempt < attempts {
                        tracing::warn!(
                            "{url}: {}{detail} (attempt {attempt} of {attempts}; retrying)",
                            problem.summary
                        );
                    }
                    last = Some(problem);
                }
            }
        }
        let made = latencies.len() as u32;
        let problem = last.unwrap_or_else(|| Problem::new("not sent", None));
        Outcome { result: Err(Failure { url: url.clone(), problem, attempts: made }), attempts: made, latencies }
    }

    /// One attempt: POST, read the whole body, validate. Never exceeds `timeout`.
    pub async fn attempt(&self, url: &Url, job: &Job) -> Result<Reply, Problem> {
        let timeout = self.settings.timeout;
        let body = match tokio::time::timeout(timeout, self.fetch(url, job.body.clone())).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(Problem::new(format!("timeout (no complete response within {})", secs(timeout)), None))
            }
        };
        wire::parse_reply(&self.settings.format, &body, job.len).map_err(|e| match e {
            Invalid::Json(m) => Problem::new("invalid JSON", Some(format!("{m}; body: {}", prefix(&body)))),
            Invalid::Shape(m) => Problem::new("invalid response", Some(m)),
        })
    }

    /// POST `body` and read the response; a non-2xx status is a problem.
    async fn fetch(&self, url: &Url, body: Vec<u8>) -> Result<Vec<u8>, Problem> {
        let mut req = self
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json")
            .body(body);
        if let Some(auth) = &self.settings.authorization {
            req = req.header(AUTHORIZATION, auth.clone());
        }
        let mut resp = req.send().await.map_err(|e| Problem::new("request failed", Some(chain(e))))?;
        let status = resp.status();
        let mut buf = Vec::new();
        while let Some(chunk) =
            resp.chunk().await.map_err(|e| Problem::new("reading the response failed", Some(chain(e))))?
        {
            if buf.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(Problem::new("response too large", Some(format!("over {} MiB", MAX_BODY_BYTES >> 20))));
            }
            buf.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(Problem::new(format!("HTTP {}", status.as_u16()), Some(prefix(&buf))));
        }
        Ok(buf)
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
            url: Url::parse("http://127.0.0.1:9/get_reward").unwrap(),
            problem: Problem::new("HTTP 500", Some("Internal\n  Server Error\r\n".into())),
            attempts: 4,
        };
        assert_eq!(f.to_string(), "http://127.0.0.1:9/get_reward: HTTP 500 after 4 attempts: Internal Server Error");
        let f = Failure { problem: Problem::new("timeout", None), attempts: 1, ..f };
        assert_eq!(f.to_string(), "http://127.0.0.1:9/get_reward: timeout after 1 attempt");
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
