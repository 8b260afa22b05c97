//! The `env-http` config section ([`Config`], as written by the user) and the validated
//! [`Settings`] the client runs with. Every validation error names its key.

use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::Url;
use rlhf_http_client::{RetryOn, RetryPolicy};
use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

/// Wait before the first retry; doubled for each further retry, capped at [`MAX_BACKOFF`].
pub const BACKOFF: Duration = Duration::from_millis(500);
/// Upper bound of the exponential backoff between retries (and of an honoured `Retry-After`).
pub const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// The whole section; every key but `url` is optional.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The server's base URL; requests go to `{url}/reset` and `{url}/step`.
    pub url: Option<String>,
    /// Deadline for establishing the TCP (and TLS) connection, seconds.
    pub connect_timeout_s: f64,
    /// Hard deadline of one HTTP attempt, from connecting to the last byte of the response, seconds.
    pub timeout_s: f64,
    /// How often a retryable failure (connection failure, 5xx, 429) is retried.
    pub retries: u32,
    /// Name of the header carrying the secret of `auth_env`.
    pub auth_header: String,
    /// Name of an environment variable whose value is sent verbatim as `auth_header`.
    pub auth_env: Option<String>,
    /// Stop strings that end a policy turn besides EOS.
    pub stop: Vec<String>,
    /// Largest response body accepted, bytes.
    pub max_response_bytes: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            url: None,
            connect_timeout_s: 5.0,
            timeout_s: 60.0,
            retries: 2,
            auth_header: "Authorization".to_string(),
            auth_env: None,
            stop: Vec::new(),
            max_response_bytes: 16 << 20,
        }
    }
}

/// A validated config.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `http` or `https` with a host; the endpoint paths are appended to its path.
    pub url: Url,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    pub retries: u32,
    /// Wait before the first retry (not a config key: [`BACKOFF`]; tests shorten it).
    pub backoff: Duration,
    /// The header name and its value, marked sensitive so it never shows in debug output.
    pub auth: Option<(HeaderName, HeaderValue)>,
    pub stop: Vec<String>,
    /// ≥ 1.
    pub max_response_bytes: u64,
}

impl Settings {
    /// Parses and validates the section (JSON text), reading `auth_env` from the process
    /// environment.
    pub fn parse(json: &str) -> Result<Settings, PluginError> {
        Settings::parse_with_env(json, |name| std::env::var(name))
    }

    /// [`Settings::parse`] with the environment lookup supplied by the caller.
    pub fn parse_with_env(
        json: &str,
        env: impl Fn(&str) -> Result<String, std::env::VarError>,
    ) -> Result<Settings, PluginError> {
        let c: Config = parse_config(json)?;
        let url = match &c.url {
            None => return Err(PluginError::config("url", "missing: set `url` to the server's base URL")),
            Some(url) => parse_url("url", url)?,
        };
        let connect_timeout = seconds("connect_timeout_s", c.connect_timeout_s)?;
        let timeout = seconds("timeout_s", c.timeout_s)?;
        let header = HeaderName::from_bytes(c.auth_header.as_bytes()).map_err(|_| {
            PluginError::config("auth_header", format!("`{}` is not a valid header name", c.auth_header))
        })?;
        let auth = match &c.auth_env {
            None => None,
            Some(name) => Some((header, secret(name, env(name))?)),
        };
        for (i, s) in c.stop.iter().enumerate() {
            if s.is_empty() {
                return Err(PluginError::config(format!("stop[{i}]"), "must not be empty"));
            }
        }
        if c.max_response_bytes == 0 {
            return Err(PluginError::config("max_response_bytes", "must be at least 1"));
        }
        Ok(Settings {
            url,
            connect_timeout,
            timeout,
            retries: c.retries,
            backoff: BACKOFF,
            auth,
            stop: c.stop,
            max_response_bytes: c.max_response_bytes,
        })
    }

    /// The URL of `endpoint` (`reset` or `step`): the base URL's path with `/{endpoint}` appended
    /// (a trailing `/` of the base is dropped first; the query, if any, is kept).
    pub fn endpoint(&self, endpoint: &str) -> Url {
        let mut url = self.url.clone();
        let path = format!("{}/{endpoint}", self.url.path().trim_end_matches('/'));
        url.set_path(&path);
        url
    }

    /// How `/reset` and `/step` are retried: `retries` times, only after a failure the server
    /// cannot have acted on (no connection made, HTTP 5xx, HTTP 429). Never after a timeout, which
    /// may come after the server applied the step: sending it again would advance the episodes
    /// twice. Waits as in [`Settings::backoff_before`], or a longer `Retry-After`, at most
    /// [`MAX_BACKOFF`].
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            retries: self.retries,
            backoff: self.backoff,
            max_backoff: MAX_BACKOFF,
            retry_on: RetryOn::Unapplied,
            honour_retry_after: true,
        }
    }

    /// The wait before retry number `retry` (1-based): `backoff · 2^(retry−1)`, at most 8 s.
    pub fn backoff_before(&self, retry: u32) -> Duration {
        self.retry_policy().backoff_before(retry)
    }
}

fn seconds(key: &str, value: f64) -> Result<Duration, PluginError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(PluginError::config(key, format!("must be a positive number of seconds, got {value}")));
    }
    Duration::try_from_secs_f64(value).map_err(|_| PluginError::config(key, format!("out of range: {value}")))
}

fn parse_url(key: &str, text: &str) -> Result<Url, PluginError> {
    rlhf_http_client::parse_endpoint(text, cfg!(feature = "tls")).map_err(|e| PluginError::config(key, e.to_string()))
}

/// `auth_env`'s value, sent verbatim.
fn secret(name: &str, value: Result<String, std::env::VarError>) -> Result<HeaderValue, PluginError> {
    rlhf_http_client::secret_header(name, value, "").map_err(|e| PluginError::config("auth_env", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::env::VarError;

    fn env(name: &str) -> Result<String, VarError> {
        match name {
            "TOKEN" => Ok("Bearer s3cret".into()),
            "EMPTY" => Ok("  ".into()),
            "NEWLINE" => Ok("a\nb".into()),
            _ => Err(VarError::NotPresent),
        }
    }

    fn parse(json: &str) -> Result<Settings, PluginError> {
        Settings::parse_with_env(json, env)
    }

    fn err(json: &str) -> String {
        let e = parse(json).expect_err(json);
        assert_eq!(e.kind, rlhf_plugin_api::ErrorKind::Config, "{e}");
        e.to_string()
    }

    #[test]
    fn defaults() {
        let s = parse(r#"{"url": "http://127.0.0.1:8000"}"#).unwrap();
        assert_eq!(s.url.as_str(), "http://127.0.0.1:8000/");
        assert_eq!(s.connect_timeout, Duration::from_secs(5));
        assert_eq!(s.timeout, Duration::from_secs(60));
        assert_eq!(s.retries, 2);
        assert_eq!(s.backoff, BACKOFF);
        assert!(s.auth.is_none());
        assert!(s.stop.is_empty());
        assert_eq!(s.max_response_bytes, 16 << 20);
    }

    #[test]
    fn endpoints_append_to_the_path() {
        let url = |u: &str, e: &str| parse(&format!(r#"{{"url": "{u}"}}"#)).unwrap().endpoint(e).to_string();
        assert_eq!(url("http://h:1", "reset"), "http://h:1/reset");
        assert_eq!(url("http://h:1/", "step"), "http://h:1/step");
        assert_eq!(url("http://h/env/v1/", "step"), "http://h/env/v1/step");
        assert_eq!(url("http://h/env?k=1", "reset"), "http://h/env/reset?k=1");
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let s = parse(r#"{"url": "http://h/"}"#).unwrap();
        let waits: Vec<f64> = (1..=6).map(|k| s.backoff_before(k).as_secs_f64()).collect();
        assert_eq!(waits, vec![0.5, 1.0, 2.0, 4.0, 8.0, 8.0]);
        assert_eq!(s.backoff_before(u32::MAX), MAX_BACKOFF);
    }

    #[test]
    fn a_timed_out_call_is_never_retried() {
        let p = parse(r#"{"url": "http://h/", "retries": 5}"#).unwrap().retry_policy();
        assert_eq!((p.retries, p.backoff, p.max_backoff), (5, BACKOFF, MAX_BACKOFF));
        assert_eq!((p.retry_on, p.honour_retry_after), (RetryOn::Unapplied, true));
        // The server may have applied the step already; a second one would advance it twice.
        assert!(!p.retries_after(&rlhf_http_client::Error::Timeout(Duration::from_secs(60))));
        assert!(p.retries_after(&rlhf_http_client::Error::Connect("connection refused".into())));
    }

    #[test]
    fn auth_is_a_sensitive_header_from_the_environment() {
        let s = parse(r#"{"url": "http://h/", "auth_env": "TOKEN"}"#).unwrap();
        let (name, value) = s.auth.unwrap();
        assert_eq!(name.as_str(), "authorization");
        assert_eq!(value.to_str().unwrap(), "Bearer s3cret");
        assert!(value.is_sensitive());
        assert!(!format!("{value:?}").contains("s3cret"));
        let s = parse(r#"{"url": "http://h/", "auth_env": "TOKEN", "auth_header": "X-Api-Key"}"#).unwrap();
        assert_eq!(s.auth.unwrap().0.as_str(), "x-api-key");
        // Without auth_env no header is sent, whatever auth_header says.
        assert!(parse(r#"{"url": "http://h/", "auth_header": "X-Api-Key"}"#).unwrap().auth.is_none());
    }

    #[test]
    fn errors_name_the_key() {
        assert_eq!(err("{}"), "url: missing: set `url` to the server's base URL");
        assert!(err(r#"{"url": "localhost:8000"}"#).starts_with("url: `localhost:8000`: scheme must be http"));
        assert!(err(r#"{"url": "ftp://h/"}"#).starts_with("url: `ftp://h/`: scheme must be http or https, not ftp"));
        assert!(err(r#"{"url": "not a url"}"#).starts_with("url: invalid URL `not a url`"));
        assert!(err(r#"{"url": "http://h/", "timeout": 3}"#).starts_with("timeout: unknown field `timeout`"));
        assert_eq!(
            err(r#"{"url": "http://h/", "timeout_s": 0}"#),
            "timeout_s: must be a positive number of seconds, got 0"
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "connect_timeout_s": -1}"#),
            "connect_timeout_s: must be a positive number of seconds, got -1"
        );
        assert!(err(r#"{"url": "http://h/", "timeout_s": 1e300}"#).starts_with("timeout_s: out of range"));
        assert!(err(r#"{"url": "http://h/", "retries": -1}"#).starts_with("retries: invalid value"));
        assert_eq!(err(r#"{"url": "http://h/", "max_response_bytes": 0}"#), "max_response_bytes: must be at least 1");
        assert_eq!(err(r#"{"url": "http://h/", "stop": ["</a>", ""]}"#), "stop[1]: must not be empty");
        assert!(err(r#"{"url": "http://h/", "stop": "</a>"}"#).starts_with("stop: invalid type"));
        assert_eq!(
            err(r#"{"url": "http://h/", "auth_env": "TOKEN", "auth_header": "bad header"}"#),
            "auth_header: `bad header` is not a valid header name"
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "auth_env": "NOPE"}"#),
            "auth_env: environment variable `NOPE` is not set"
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "auth_env": "EMPTY"}"#),
            "auth_env: environment variable `EMPTY` is empty"
        );
        assert!(err(r#"{"url": "http://h/", "auth_env": "NEWLINE"}"#)
            .starts_with("auth_env: environment variable `NEWLINE` holds"));
    }
}
