//! What can go wrong: [`Error`] (one failed attempt, typed, so a [`RetryPolicy`] can tell a
//! timeout from a refused connection), [`Problem`] (an attempt's failure as a plugin words it for
//! users) and [`Failure`] (a request that failed for good), plus the helpers that keep every
//! message on one line.
//!
//! [`RetryPolicy`]: crate::RetryPolicy

use std::time::Duration;

use reqwest::Url;

/// How much of a response body goes into an error message, in characters.
pub const BODY_PREFIX_CHARS: usize = 200;

/// Why a 2xx response body was rejected by the caller's parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    /// The body does not parse as JSON.
    Json(String),
    /// The JSON does not have the expected shape or values.
    Shape(String),
}

/// Why one attempt failed. Every string is a message as produced (possibly multi-line);
/// [`Problem::new`] folds it onto one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No complete response (status, headers and the whole body) within the attempt's deadline,
    /// which is the duration held. The server may have received, and acted on, the request.
    #[error("timeout (no complete response within {})", secs(*.0))]
    Timeout(Duration),
    /// The connection could not be established (refused, DNS, connect timeout, TLS handshake):
    /// nothing reached the server. The reqwest error with its sources.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// Sending failed once the connection was up (e.g. the server closed it mid-request). The
    /// reqwest error with its sources.
    #[error("request failed: {0}")]
    Send(String),
    /// The response's body could not be read to its end. The reqwest error with its sources.
    #[error("reading the response failed: {0}")]
    Read(String),
    /// The body, or its announced `Content-Length`, is over the client's limit (bytes).
    #[error("response too large: over {limit} bytes")]
    TooLarge { limit: u64 },
    /// A non-2xx status.
    #[error("HTTP {status}{}", colon(body))]
    Status {
        status: u16,
        /// The first [`BODY_PREFIX_CHARS`] characters of the body, on one line (may be empty).
        body: String,
        /// The response's `Retry-After`, when it is a whole number of seconds.
        retry_after: Option<Duration>,
    },
    /// A 2xx body the parser rejected as JSON.
    #[error("invalid JSON: {message}; body: {body}")]
    InvalidJson {
        /// The parser's message.
        message: String,
        /// The first [`BODY_PREFIX_CHARS`] characters of the body, on one line.
        body: String,
    },
    /// A 2xx JSON body of the wrong shape (the parser's message).
    #[error("invalid response: {0}")]
    InvalidShape(String),
}

impl Error {
    /// The error of a failed reqwest `send`: [`Error::Connect`] when no connection was made,
    /// [`Error::Send`] otherwise.
    pub(crate) fn send(e: reqwest::Error) -> Error {
        if e.is_connect() {
            Error::Connect(chain(e))
        } else {
            Error::Send(chain(e))
        }
    }
}

/// The client could not be built (e.g. no TLS backend could be initialised).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct BuildError(#[from] reqwest::Error);

/// A failed attempt as worded for users: a short summary and an optional detail, both
/// single-line (`HTTP 500` / `Internal Server Error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub summary: String,
    pub detail: Option<String>,
}

impl Problem {
    /// A problem; the detail is folded onto one line (whitespace runs become one space, other
    /// control characters are dropped).
    pub fn new(summary: impl Into<String>, detail: Option<String>) -> Self {
        Problem { summary: summary.into(), detail: detail.map(|d| one_line(&d)) }
    }

    /// The default wording of an attempt's error: the summary is the text before the first `: `
    /// of [`Error`]'s display, the detail what follows. A status's detail is the body prefix even
    /// when empty.
    pub fn of(e: &Error) -> Problem {
        match e {
            Error::Timeout(_) => Problem::new(e.to_string(), None),
            Error::Connect(d) => Problem::new("cannot connect", Some(d.clone())),
            Error::Send(d) => Problem::new("request failed", Some(d.clone())),
            Error::Read(d) => Problem::new("reading the response failed", Some(d.clone())),
            Error::TooLarge { limit } => Problem::new("response too large", Some(format!("over {limit} bytes"))),
            Error::Status { status, body, .. } => Problem::new(format!("HTTP {status}"), Some(body.clone())),
            Error::InvalidJson { message, body } => {
                Problem::new("invalid JSON", Some(format!("{message}; body: {body}")))
            }
            Error::InvalidShape(m) => Problem::new("invalid response", Some(m.clone())),
        }
    }
}

impl From<&Error> for Problem {
    /// [`Problem::of`].
    fn from(e: &Error) -> Problem {
        Problem::of(e)
    }
}

/// A request that failed for good: on its last attempt, or on one the retry policy does not
/// repeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub url: Url,
    /// The last attempt's problem.
    pub problem: Problem,
    /// Attempts made (0 when the request was never sent).
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

/// `0.3 s`, `30 s`.
pub(crate) fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// `: <text>`, or nothing for an empty text.
fn colon(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    }
}

/// A reqwest error with its sources, without the URL (messages name it once up front).
pub(crate) fn chain(e: reqwest::Error) -> String {
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

/// The first [`BODY_PREFIX_CHARS`] characters of a body (lossy UTF-8), on one line, with `…`
/// when cut.
pub fn prefix(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = one_line(&text);
    match text.char_indices().nth(BODY_PREFIX_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

/// Collapses whitespace runs (newlines included) to one space and drops other control
/// characters.
pub(crate) fn one_line(text: &str) -> String {
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
    fn a_failure_is_one_line_naming_the_url_and_the_attempts() {
        let url = Url::parse("http://10.0.0.5:5000/score").unwrap();
        let one = Failure { url, problem: Problem::new("HTTP 503", Some("busy\r\n\ttry later".into())), attempts: 1 };
        assert_eq!(one.to_string(), "http://10.0.0.5:5000/score: HTTP 503 after 1 attempt: busy try later");
        // An empty detail (a status with no body) adds nothing; an unsent request made 0 attempts.
        let empty = Failure { problem: Problem::new("HTTP 503", Some(String::new())), attempts: 3, ..one.clone() };
        assert_eq!(empty.to_string(), "http://10.0.0.5:5000/score: HTTP 503 after 3 attempts");
        let unsent = Failure { problem: Problem::new("not sent", None), attempts: 0, ..one };
        assert_eq!(unsent.to_string(), "http://10.0.0.5:5000/score: not sent after 0 attempts");
    }

    #[test]
    fn body_prefixes_are_cut_at_a_character_boundary() {
        let exact = "ü".repeat(BODY_PREFIX_CHARS);
        assert_eq!(prefix(exact.as_bytes()), exact);
        let over = format!("{exact}z");
        assert_eq!(prefix(over.as_bytes()), format!("{exact}…"));
        assert_eq!(one_line(" a \u{7}b\r\n\n c "), "a b c");
        assert_eq!(prefix(b""), "");
    }

    #[test]
    fn default_wording() {
        let p = |e: Error| Problem::from(&e);
        assert_eq!(
            p(Error::Timeout(Duration::from_millis(300))),
            Problem::new("timeout (no complete response within 0.3 s)", None)
        );
        assert_eq!(p(Error::Connect("refused\n".into())), Problem::new("cannot connect", Some("refused".into())));
        assert_eq!(p(Error::Send("reset".into())).summary, "request failed");
        assert_eq!(p(Error::TooLarge { limit: 10 }).detail.as_deref(), Some("over 10 bytes"));
        let status = Error::Status { status: 404, body: String::new(), retry_after: None };
        assert_eq!(status.to_string(), "HTTP 404");
        assert_eq!(p(status), Problem::new("HTTP 404", Some(String::new())));
        let json = Error::InvalidJson { message: "expected value".into(), body: "<html>".into() };
        assert_eq!(json.to_string(), "invalid JSON: expected value; body: <html>");
        assert_eq!(p(json).detail.as_deref(), Some("expected value; body: <html>"));
        assert_eq!(p(Error::InvalidShape("missing field `x`".into())).summary, "invalid response");
    }
}
