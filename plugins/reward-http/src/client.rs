//! Sending requests: a batch of requests with bounded concurrency ([`Client::run`]), each one
//! sent by the shared HTTP client (`rlhf-http-client`) with its hard deadline per attempt and
//! its retries with exponential backoff. Everything is async on the plugin's own single-threaded
//! tokio runtime; the plugin's synchronous `score` blocks on it.
//!
//! Scoring is idempotent, so every failure is retried
//! ([`RetryOn::AnyFailure`](rlhf_http_client::RetryOn::AnyFailure), see
//! [`Settings::retry_policy`]): a refused connection, a timeout, any non-2xx status, an oversized
//! or invalid body.
//!
//! Bounds: an attempt never takes longer than `timeout`, so a request takes at most
//! `(retries + 1) · timeout + Σ backoff`, and a batch at most `⌈requests / concurrency⌉` times that.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use reqwest::header::AUTHORIZATION;
use rlhf_http_client::{BuildError, Error, Options};
pub use rlhf_http_client::{Failure, Problem};
// The unit tests below check the shared crate's message helpers under the names they had here.
#[cfg(test)]
use {
    reqwest::Url,
    rlhf_http_client::{prefix, BODY_PREFIX_CHARS},
};

use crate::config::Settings;
use crate::wire::{self, Reply};

/// Largest response body read, bytes; a server sending more is treated as failing.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// One request of a batch: the samples `start..start + len`, for `urls[url]`.
#[derive(Debug, Clone)]
pub struct Job {
    pub url: usize,
    pub start: usize,
    pub len: usize,
    /// The serialized JSON body.
    pub body: Vec<u8>,
}

/// What became of one [`Job`]: the reply, or the failure of its last attempt; the attempts made
/// (0 if the job was never started because the batch was aborted) and their wall times, seconds.
pub type Outcome = rlhf_http_client::Outcome<Reply>;

/// The HTTP client and its settings.
#[derive(Debug)]
pub struct Client {
    pub settings: Settings,
    http: rlhf_http_client::Client,
}

impl Client {
    /// A client for `settings`.
    pub fn new(settings: Settings) -> Result<Client, BuildError> {
        let http = rlhf_http_client::Client::new(Options {
            user_agent: concat!("rlhf-reward-http/", env!("CARGO_PKG_VERSION")).to_string(),
            // `timeout_s` bounds the whole attempt; connecting gets the same deadline.
            connect_timeout: settings.timeout,
            timeout: settings.timeout,
            max_response_bytes: MAX_BODY_BYTES as u64,
            auth: settings.authorization.clone().map(|value| (AUTHORIZATION, value)),
            retry: settings.retry_policy(),
            describe,
        })?;
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
        let format = &self.settings.format;
        self.http.post(url, &job.body, Some(abort), |body| wire::parse_reply(format, body, job.len)).await
    }
}

/// How reward-http words a failed attempt: the shared wording, except that every failure to send
/// (a refused connection included) reads `request failed`, and the size limit is given in MiB.
fn describe(error: &Error) -> Problem {
    match error {
        Error::Connect(detail) | Error::Send(detail) => Problem::new("request failed", Some(detail.clone())),
        Error::TooLarge { .. } => {
            Problem::new("response too large", Some(format!("over {} MiB", MAX_BODY_BYTES >> 20)))
        }
        other => Problem::of(other),
    }
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
