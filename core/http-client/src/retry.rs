//! When a failed attempt is repeated, and how long the client waits first: [`RetryPolicy`].

use std::time::Duration;

use crate::Error;

/// Which failed attempts are worth another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOn {
    /// Every failure: a refused connection, a timeout, any non-2xx status (4xx included), a body
    /// that is too large or that the parser rejects. For requests that may safely be applied
    /// twice, such as scoring samples.
    AnyFailure,
    /// Only failures after which the server cannot have applied the request: a connection that
    /// could not be established (nothing reached the server), HTTP 5xx and HTTP 429 (the server
    /// refused it; a server answering 5xx must therefore not have applied it). A timeout, a
    /// failure after the connection was made, another status or an invalid body fails at once:
    /// the server may already have applied the request, and sending it again would apply it twice
    /// (an environment's step, which advances its episodes).
    Unapplied,
}

/// How often, on what, and after which waits a request is retried.
///
/// Retry `k` (1-based, i.e. attempt `k + 1`) waits `min(backoff · 2^(k−1), max_backoff)`, or an
/// honoured `Retry-After` when that is longer, but never more than `max_backoff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt: at most `retries + 1` attempts.
    pub retries: u32,
    /// Wait before the first retry; doubled for each further retry.
    pub backoff: Duration,
    /// Upper bound of every wait between attempts.
    pub max_backoff: Duration,
    /// Which failures are retried.
    pub retry_on: RetryOn,
    /// Wait at least a retried status's `Retry-After` (whole seconds), still at most
    /// `max_backoff`.
    pub honour_retry_after: bool,
}

impl RetryPolicy {
    /// The most attempts a request gets: `retries + 1` (saturating).
    pub fn attempts(&self) -> u32 {
        self.retries.saturating_add(1)
    }

    /// Whether a request whose attempt failed with `error` is sent again (attempts left aside).
    pub fn retries_after(&self, error: &Error) -> bool {
        match self.retry_on {
            RetryOn::AnyFailure => true,
            RetryOn::Unapplied => match error {
                Error::Connect(_) => true,
                Error::Status { status, .. } => (500..600).contains(status) || *status == 429,
                Error::Timeout(_)
                | Error::Send(_)
                | Error::Read(_)
                | Error::TooLarge { .. }
                | Error::InvalidJson { .. }
                | Error::InvalidShape(_) => false,
            },
        }
    }

    /// The exponential backoff before retry number `retry` (1-based): `backoff · 2^(retry−1)`,
    /// at most `max_backoff`.
    pub fn backoff_before(&self, retry: u32) -> Duration {
        let secs = self.backoff.as_secs_f64() * 2f64.powi(retry.saturating_sub(1).min(64) as i32);
        Duration::from_secs_f64(secs.min(self.max_backoff.as_secs_f64()))
    }

    /// The wait before retry number `retry` (1-based) after an attempt failed with `error`: the
    /// backoff, or the server's `Retry-After` when honoured and longer; at most `max_backoff`.
    pub fn wait_before(&self, retry: u32, error: &Error) -> Duration {
        let retry_after = match error {
            Error::Status { retry_after: Some(d), .. } if self.honour_retry_after => *d,
            _ => Duration::ZERO,
        };
        self.backoff_before(retry).max(retry_after).min(self.max_backoff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(retry_on: RetryOn) -> RetryPolicy {
        RetryPolicy {
            retries: 3,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            retry_on,
            honour_retry_after: false,
        }
    }

    fn status(status: u16) -> Error {
        Error::Status { status, body: String::new(), retry_after: None }
    }

    fn every_kind() -> Vec<Error> {
        vec![
            Error::Timeout(Duration::from_secs(1)),
            Error::Connect("connection refused".into()),
            Error::Send("connection closed before message completed".into()),
            Error::Read("body error".into()),
            Error::TooLarge { limit: 1 },
            status(500),
            status(503),
            status(429),
            status(404),
            status(401),
            Error::InvalidJson { message: "expected value".into(), body: String::new() },
            Error::InvalidShape("missing field".into()),
        ]
    }

    #[test]
    fn any_failure_retries_everything() {
        let p = policy(RetryOn::AnyFailure);
        for e in every_kind() {
            assert!(p.retries_after(&e), "{e}");
        }
    }

    #[test]
    fn unapplied_retries_only_what_cannot_have_been_applied() {
        let p = policy(RetryOn::Unapplied);
        let retried: Vec<String> = every_kind().iter().filter(|e| p.retries_after(e)).map(|e| e.to_string()).collect();
        assert_eq!(retried, ["cannot connect: connection refused", "HTTP 500", "HTTP 503", "HTTP 429"]);
        // Above all, a timed-out attempt is final: the server may have applied it.
        assert!(!p.retries_after(&Error::Timeout(Duration::from_secs(60))));
        assert!(!p.retries_after(&status(600)) && p.retries_after(&status(599)));
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = policy(RetryOn::AnyFailure);
        let waits: Vec<f64> = (1..=6).map(|k| p.backoff_before(k).as_secs_f64()).collect();
        assert_eq!(waits, vec![0.5, 1.0, 2.0, 4.0, 8.0, 8.0]);
        assert_eq!(p.backoff_before(u32::MAX), Duration::from_secs(8));
        assert_eq!(p.backoff_before(0), Duration::from_millis(500));
        let p = RetryPolicy { backoff: Duration::ZERO, ..p };
        assert_eq!(p.backoff_before(3), Duration::ZERO);
        let p = RetryPolicy { backoff: Duration::from_secs(20), ..p };
        assert_eq!(p.backoff_before(1), Duration::from_secs(8));
    }

    #[test]
    fn retry_after_is_honoured_up_to_the_cap() {
        let busy =
            |s: u64| Error::Status { status: 503, body: String::new(), retry_after: Some(Duration::from_secs(s)) };
        let p = RetryPolicy { honour_retry_after: true, ..policy(RetryOn::Unapplied) };
        assert_eq!(p.wait_before(1, &busy(3)), Duration::from_secs(3));
        assert_eq!(p.wait_before(4, &busy(3)), Duration::from_secs(4));
        assert_eq!(p.wait_before(1, &busy(3600)), Duration::from_secs(8));
        assert_eq!(p.wait_before(2, &status(503)), Duration::from_secs(1));
        let p = RetryPolicy { honour_retry_after: false, ..p };
        assert_eq!(p.wait_before(1, &busy(3)), Duration::from_millis(500));
    }
}
