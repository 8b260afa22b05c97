//! The JSON-over-HTTP client of the `reward-http` and `env-http` plugins: a `POST` of a JSON body
//! whose JSON response is validated by the caller, with
//!
//! - a hard deadline per attempt ([`Options::timeout`]: connecting through the last byte of the
//!   response) and a separate connect deadline ([`Options::connect_timeout`]);
//! - a limit on the response body ([`Options::max_response_bytes`], checked against
//!   `Content-Length` and while reading);
//! - an optional auth header sent with every request ([`Options::auth`]);
//! - retries with exponential backoff under a [`RetryPolicy`] chosen by the plugin: a scorer
//!   retries every failure ([`RetryOn::AnyFailure`]); an environment, whose steps must not be
//!   applied twice, only failures the server cannot have acted on ([`RetryOn::Unapplied`]).
//!
//! Failures are typed ([`Error`]) so the policy can tell them apart; each plugin words them for
//! its users ([`Options::describe`] turns an [`Error`] into a [`Problem`]), and a request that
//! failed for good is a [`Failure`] reading `<url>: <summary> after <n> attempts[: <detail>]`.
//!
//! Everything is async on the caller's tokio runtime (the plugins run a single-threaded one and
//! block on it). Bounds: an attempt never takes longer than `timeout`, so a request takes at most
//! `(retries + 1) · timeout + Σ waits`, each wait at most [`RetryPolicy::max_backoff`].
//!
//! For the plugins' configs: [`parse_endpoint`] checks an endpoint URL, [`secret_header`] reads a
//! token from the environment into a sensitive header value.
//!
//! TLS: `https://` needs the `tls` feature (rustls), off by default; the plugins turn it on with
//! their own `tls` feature.

mod config;
mod error;
mod retry;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::header::{HeaderName, HeaderValue, ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use reqwest::Url;

pub use crate::config::{parse_endpoint, secret_header, SecretError, UrlError};
pub use crate::error::{prefix, BuildError, Error, Failure, Invalid, Problem, BODY_PREFIX_CHARS};
pub use crate::retry::{RetryOn, RetryPolicy};

/// How a [`Client`] sends, bounds and retries its requests.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `User-Agent` of every request, e.g. `rlhf-env-http/0.1.0`.
    pub user_agent: String,
    /// Deadline for establishing the TCP (and TLS) connection.
    pub connect_timeout: Duration,
    /// Hard deadline of one attempt, from connecting to the last byte of the response.
    pub timeout: Duration,
    /// Largest response body read, bytes (≥ 1); a larger one fails the attempt with
    /// [`Error::TooLarge`].
    pub max_response_bytes: u64,
    /// A header sent with every request, e.g. `Authorization: Bearer …`. Mark the value
    /// sensitive ([`HeaderValue::set_sensitive`]) so it never shows in debug output.
    pub auth: Option<(HeaderName, HeaderValue)>,
    /// Which failures are retried, how often, and the waits in between.
    pub retry: RetryPolicy,
    /// How a failed attempt is worded, in the retry warnings and in the final [`Failure`];
    /// [`Problem::of`] is the default wording.
    pub describe: fn(&Error) -> Problem,
}

/// What became of one request.
#[derive(Debug, Clone)]
pub struct Outcome<T> {
    /// The parsed response, or why the request failed for good.
    pub result: Result<T, Failure>,
    /// Attempts made (1 + retries used); 0 for a request that was never sent.
    pub attempts: u32,
    /// Wall time of each attempt in order, seconds.
    pub latencies: Vec<f64>,
}

/// An HTTP client (a connection pool) with its [`Options`]. Cheap to share behind an `Arc`;
/// requests may run concurrently.
#[derive(Debug)]
pub struct Client {
    options: Options,
    http: reqwest::Client,
}

impl Client {
    /// A client for `options`.
    pub fn new(options: Options) -> Result<Client, BuildError> {
        let http = reqwest::Client::builder()
            .user_agent(options.user_agent.clone())
            // The attempt's deadline covers connecting too; this lets reqwest fail a stuck
            // connect early, as a connection error (which even a cautious policy may retry).
            .connect_timeout(options.connect_timeout)
            .build()?;
        Ok(Client { options, http })
    }

    /// The options in use.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// POSTs `body` (JSON) to `url` and parses the 2xx response with `parse`, retrying as the
    /// policy allows. A retried failure is logged as a warning
    /// (`<url>: <summary>[: <detail>] (attempt k of n; retrying)`). When `abort` is given and
    /// set, no further attempt is made (the last attempt's failure is returned).
    pub async fn post<T>(
        &self,
        url: &Url,
        body: &[u8],
        abort: Option<&AtomicBool>,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Outcome<T> {
        let policy = &self.options.retry;
        let attempts = policy.attempts();
        let mut latencies = Vec::new();
        let mut attempt = 1;
        loop {
            let t = Instant::now();
            let result = self.attempt(url, body.to_vec(), &parse).await;
            let took = t.elapsed().as_secs_f64();
            latencies.push(took);
            let error = match result {
                Ok(value) => return Outcome { result: Ok(value), attempts: attempt, latencies },
                Err(error) => error,
            };
            tracing::trace!("{url}: attempt {attempt} took {took:.3} s");
            let problem = (self.options.describe)(&error);
            let retry = attempt < attempts && policy.retries_after(&error);
            if retry {
                let detail = problem.detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default();
                tracing::warn!("{url}: {}{detail} (attempt {attempt} of {attempts}; retrying)", problem.summary);
            }
            // The abort is checked before the wait, so an aborted request gives up without sleeping.
            if !retry || abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                let failure = Failure { url: url.clone(), problem, attempts: attempt };
                return Outcome { result: Err(failure), attempts: attempt, latencies };
            }
            tokio::time::sleep(policy.wait_before(attempt, &error)).await;
            attempt += 1;
        }
    }

    /// One attempt: POST, read the whole body, parse it. Never takes longer than `timeout`.
    pub async fn attempt<T>(
        &self,
        url: &Url,
        body: Vec<u8>,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Result<T, Error> {
        let timeout = self.options.timeout;
        let body = match tokio::time::timeout(timeout, self.fetch(url, body)).await {
            Ok(result) => result?,
            Err(_) => return Err(Error::Timeout(timeout)),
        };
        parse(&body).map_err(|e| match e {
            Invalid::Json(message) => Error::InvalidJson { message, body: prefix(&body) },
            Invalid::Shape(message) => Error::InvalidShape(message),
        })
    }

    /// POSTs `body` and reads the whole response; a non-2xx status is an error.
    async fn fetch(&self, url: &Url, body: Vec<u8>) -> Result<Vec<u8>, Error> {
        let mut req = self
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "application/json")
            .body(body);
        if let Some((name, value)) = &self.options.auth {
            req = req.header(name.clone(), value.clone());
        }
        let mut resp = req.send().await.map_err(Error::send)?;
        let status = resp.status();
        let limit = self.options.max_response_bytes;
        // An announced oversize body fails before it is read; one that grows past the limit
        // (no or a false `Content-Length`) fails as soon as it does.
        if resp.content_length().is_some_and(|n| n > limit) {
            return Err(Error::TooLarge { limit });
        }
        let mut buf = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| Error::Read(error::chain(e)))? {
            if (buf.len() + chunk.len()) as u64 > limit {
                return Err(Error::TooLarge { limit });
            }
            buf.extend_from_slice(&chunk);
        }
        if status.is_success() {
            return Ok(buf);
        }
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        Err(Error::Status { status: status.as_u16(), body: prefix(&buf), retry_after })
    }
}
