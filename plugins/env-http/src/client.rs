//! Sending one request through the shared HTTP client (`rlhf-http-client`): attempts under a
//! hard deadline, retried with exponential backoff. Async on the plugin's own single-threaded
//! tokio runtime; the environment's synchronous `reset`/`step` block on it.
//!
//! Only failures that are safe to repeat are retried
//! ([`RetryOn::Unapplied`](rlhf_http_client::RetryOn::Unapplied), see [`Settings::retry_policy`]):
//! a connection that could not be established (nothing reached the server), HTTP 5xx and HTTP 429
//! (honouring a `Retry-After` of up to 8 s). A timeout, another status or an invalid body fails at
//! once: the server may already have applied the step, and sending it again would advance those
//! episodes twice. `/reset` and `/step` share this policy.
//!
//! Bounds: an attempt never takes longer than `timeout`, so a call takes at most
//! `(retries + 1) · timeout + Σ backoff`.

use reqwest::Url;
use rlhf_http_client::{BuildError, Error, Options};
pub use rlhf_http_client::{Failure, Problem};
// The unit tests below check the shared crate's message helpers under the names they had here.
#[cfg(test)]
use rlhf_http_client::{prefix, BODY_PREFIX_CHARS};

use crate::config::Settings;
use crate::wire::Invalid;

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
            user_agent: concat!("rlhf-env-http/", env!("CARGO_PKG_VERSION")).to_string(),
            connect_timeout: settings.connect_timeout,
            timeout: settings.timeout,
            max_response_bytes: settings.max_response_bytes,
            auth: settings.auth.clone(),
            retry: settings.retry_policy(),
            describe,
        })?;
        Ok(Client { settings, http })
    }

    /// POSTs `body` to `url` with retries and validates the 2xx body with `parse`.
    pub async fn request<T>(
        &self,
        url: &Url,
        body: Vec<u8>,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Result<T, Failure> {
        self.http.post(url, &body, None, parse).await.result
    }
}

/// How env-http words a failed attempt: the shared wording, with the size limit named by its
/// config key.
fn describe(error: &Error) -> Problem {
    match error {
        Error::TooLarge { limit } => {
            Problem::new("response too large", Some(format!("over max_response_bytes = {limit}")))
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
