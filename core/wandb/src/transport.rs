//! POSTs with HTTP basic auth (`api`:key), retries and backoff, bounded by the finish deadline.
//!
//! Retried: connection errors, timeouts, unreadable bodies and every status except 400, 404,
//! 409 and 410 (given up at once) and 401/403 ([`WandbError::Unauthorized`], which disables the
//! sink), as the wandb SDK's file-stream retry policy does. A 429's `Retry-After` (seconds) is
//! honoured, capped at `max_backoff`.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use reqwest::StatusCode;
use serde_json::Value;

use crate::error::WandbError;
use crate::settings::WandbSettings;

/// What the transport needs from the sink's shared state: the finish deadline, an interruptible
/// sleep, and request counters (implemented by the sink, so the transport does not depend on it).
pub(crate) trait TransportState: Send + Sync {
    /// Time left before the finish deadline; `None` while there is none.
    fn time_left(&self) -> Option<Duration>;
    /// Sleeps up to `d`; `false` when woken to stop.
    fn sleep(&self, d: Duration) -> bool;
    /// Counts a request sent.
    fn count_request(&self);
    /// Counts a request that failed.
    fn count_failure(&self);
}

pub(crate) struct Transport {
    client: Client,
    api_key: String,
    max_retries: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    request_timeout: Duration,
    shared: Arc<dyn TransportState>,
    jitter: u64,
}

impl Transport {
    pub fn new(settings: &WandbSettings, shared: Arc<dyn TransportState>) -> Result<Self, WandbError> {
        let client = Client::builder()
            .user_agent(concat!("rlhf-wandb/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(settings.request_timeout)
            .timeout(settings.request_timeout)
            .build()
            .map_err(WandbError::Client)?;
        Ok(Transport {
            client,
            api_key: settings.api_key.clone(),
            max_retries: settings.max_retries,
            initial_backoff: settings.initial_backoff,
            max_backoff: settings.max_backoff,
            request_timeout: settings.request_timeout,
            shared,
            jitter: RandomState::new().build_hasher().finish() | 1,
        })
    }

    /// POSTs `body` as JSON, retrying; returns the reply's JSON (`Null` for an empty or non-JSON
    /// 2xx body).
    pub fn post(&mut self, url: &reqwest::Url, body: &Value) -> Result<Value, WandbError> {
        let mut backoff = self.initial_backoff;
        let mut attempt = 0u32;
        loop {
            let timeout = match self.shared.time_left() {
                Some(left) if left.is_zero() => return Err(WandbError::DeadlineExceeded),
                Some(left) => left.min(self.request_timeout),
                None => self.request_timeout,
            };
            self.shared.count_request();
            let sent =
                self.client.post(url.clone()).basic_auth("api", Some(&self.api_key)).json(body).timeout(timeout).send();
            let (error, retry_after) = match sent {
                Ok(response) => {
                    let status = response.status();
                    if status.is_success() {
                        match response.text() {
                            Ok(text) => return Ok(serde_json::from_str(&text).unwrap_or(Value::Null)),
                            Err(source) => (WandbError::Transport { url: url.to_string(), source }, None),
                        }
                    } else {
                        let retry_after = response
                            .headers()
                            .get(reqwest::header::RETRY_AFTER)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.trim().parse::<u64>().ok())
                            .map(Duration::from_secs);
                        let code = status.as_u16();
                        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                            self.shared.count_failure();
                            return Err(WandbError::Unauthorized { url: url.to_string(), status: code });
                        }
                        let mut text = response.text().unwrap_or_default();
                        truncate(&mut text, 300);
                        let error = WandbError::Status { url: url.to_string(), status: code, body: text };
                        if matches!(code, 400 | 404 | 409 | 410) {
                            self.shared.count_failure();
                            return Err(error);
                        }
                        (error, retry_after)
                    }
                }
                Err(source) => {
                    let builder = source.is_builder();
                    let error = WandbError::Transport { url: url.to_string(), source };
                    if builder {
                        self.shared.count_failure();
                        return Err(error);
                    }
                    (error, None)
                }
            };
            self.shared.count_failure();
            if attempt >= self.max_retries {
                return Err(error);
            }
            attempt += 1;
            let delay = retry_after.unwrap_or_else(|| self.jittered(backoff)).min(self.max_backoff);
            tracing::debug!(attempt, max_retries = self.max_retries, ?delay, "wandb: retrying after: {error}");
            if !self.shared.sleep(delay) {
                return Err(WandbError::DeadlineExceeded);
            }
            backoff = backoff.saturating_mul(2).min(self.max_backoff);
        }
    }

    /// `d` plus up to 25 % (xorshift; spreads retries of several processes).
    fn jittered(&mut self, d: Duration) -> Duration {
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        let fraction = (self.jitter % 1000) as f64 / 4000.0;
        d + d.mul_f64(fraction)
    }
}

/// Cuts `s` to at most `max` bytes at a character boundary.
fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
}

/// `Instant` arithmetic that cannot panic.
pub(crate) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).unwrap_or(now + Duration::from_secs(86_400 * 365))
}
