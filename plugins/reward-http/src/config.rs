//! The `reward-http` config section ([`Config`], as written by the user) and the validated
//! [`Settings`] the client runs with. Every validation error names its key.

use std::time::Duration;

use reqwest::header::HeaderValue;
use reqwest::Url;
use rlhf_http_client::{RetryOn, RetryPolicy};
use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

/// Upper bound of the exponential backoff between retries.
pub const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// The whole section; every key but `url`/`urls` is optional.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The reward server's endpoint, e.g. `http://127.0.0.1:5000/get_reward` (or `urls` for several).
    pub url: Option<String>,
    /// Several endpoints; the requests of a batch go to them round-robin.
    pub urls: Option<Vec<String>>,
    /// Wire format: `openrlhf` (default) or `llamafactory`.
    pub format: WireFormat,
    /// The `model` field of LLaMA-Factory requests (llamafactory only; default `reward-model`).
    pub model: Option<String>,
    /// Take the response's `scores` instead of its `rewards` (openrlhf only).
    pub use_scores: bool,
    /// Name of an environment variable holding a token sent as `Authorization: Bearer <token>`.
    pub token_env: Option<String>,
    /// Hard deadline of one HTTP request, from connecting to the last byte of the response, seconds.
    pub timeout_s: f64,
    /// How often a failed request is retried (at most `retries + 1` attempts).
    pub retries: u32,
    /// Wait before the first retry, seconds; doubled for each further retry, capped at 8 s.
    pub backoff_s: f64,
    /// Most samples in one request; a larger batch is split into several requests.
    pub max_samples_per_request: usize,
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// After the last retry: `fail` the step, or `skip` the request's samples (scored NaN, dropped by the host).
    pub on_error: OnError,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            url: None,
            urls: None,
            format: WireFormat::OpenRlhf,
            model: None,
            use_scores: false,
            token_env: None,
            timeout_s: 30.0,
            retries: 3,
            backoff_s: 0.5,
            max_samples_per_request: 64,
            concurrency: 4,
            on_error: OnError::Fail,
        }
    }
}

/// `format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireFormat {
    /// OpenRLHF's remote reward model: `{query, prompts, labels}` → `{rewards, scores?, extra_logs?}`.
    #[serde(rename = "openrlhf")]
    OpenRlhf,
    /// LLaMA-Factory's `/v1/score/evaluation`: `{model, messages}` → `{scores}`.
    #[serde(rename = "llamafactory")]
    LlamaFactory,
}

/// `on_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The step fails with an error naming the URL and the problem.
    Fail,
    /// The request's samples get NaN scores; the host drops and counts them.
    Skip,
}

/// The wire format with its format-specific options resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    OpenRlhf {
        /// Read `scores` instead of `rewards`.
        use_scores: bool,
    },
    LlamaFactory {
        /// The request's `model` field.
        model: String,
    },
}

/// A validated config.
#[derive(Debug, Clone)]
pub struct Settings {
    /// At least one, each `http` or `https` with a host.
    pub urls: Vec<Url>,
    pub format: Format,
    /// `Bearer <token>`, marked sensitive so it never shows in debug output.
    pub authorization: Option<HeaderValue>,
    pub timeout: Duration,
    pub retries: u32,
    pub backoff: Duration,
    /// ≥ 1.
    pub max_samples_per_request: usize,
    /// ≥ 1.
    pub concurrency: usize,
    pub on_error: OnError,
}

impl Settings {
    /// Parses and validates the section (JSON text), reading `token_env` from the process
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
        let urls = match (c.url, c.urls) {
            (Some(_), Some(_)) => return Err(PluginError::config("url", "give either `url` or `urls`, not both")),
            (None, None) => {
                return Err(PluginError::config("url", "missing: set `url` (or `urls` for several endpoints)"))
            }
            (Some(url), None) => vec![parse_url("url", &url)?],
            (None, Some(urls)) => {
                if urls.is_empty() {
                    return Err(PluginError::config("urls", "must name at least one endpoint"));
                }
                urls.iter().enumerate().map(|(i, u)| parse_url(&format!("urls[{i}]"), u)).collect::<Result<_, _>>()?
            }
        };
        let format = match c.format {
            WireFormat::OpenRlhf => {
                if c.model.is_some() {
                    return Err(PluginError::config("model", "only used with format = \"llamafactory\""));
                }
                Format::OpenRlhf { use_scores: c.use_scores }
            }
            WireFormat::LlamaFactory => {
                if c.use_scores {
                    return Err(PluginError::config("use_scores", "only used with format = \"openrlhf\""));
                }
                Format::LlamaFactory { model: c.model.unwrap_or_else(|| "reward-model".to_string()) }
            }
        };
        let authorization = match c.token_env {
            None => None,
            Some(name) => Some(bearer(&name, env(&name))?),
        };
        if !(c.timeout_s.is_finite() && c.timeout_s > 0.0) {
            return Err(PluginError::config(
                "timeout_s",
                format!("must be a positive number of seconds, got {}", c.timeout_s),
            ));
        }
        let timeout = Duration::try_from_secs_f64(c.timeout_s)
            .map_err(|_| PluginError::config("timeout_s", format!("out of range: {}", c.timeout_s)))?;
        if !(c.backoff_s.is_finite() && c.backoff_s >= 0.0) {
            return Err(PluginError::config(
                "backoff_s",
                format!("must be a number of seconds ≥ 0, got {}", c.backoff_s),
            ));
        }
        let backoff = Duration::from_secs_f64(c.backoff_s.min(MAX_BACKOFF.as_secs_f64()));
        if c.max_samples_per_request == 0 {
            return Err(PluginError::config("max_samples_per_request", "must be at least 1"));
        }
        if c.concurrency == 0 {
            return Err(PluginError::config("concurrency", "must be at least 1"));
        }
        Ok(Settings {
            urls,
            format,
            authorization,
            timeout,
            retries: c.retries,
            backoff,
            max_samples_per_request: c.max_samples_per_request,
            concurrency: c.concurrency,
            on_error: c.on_error,
        })
    }

    /// How requests are retried: `retries` times on any failure (a refused connection, a
    /// timeout, any non-2xx status, an oversized or invalid body), since scoring the same samples
    /// twice is harmless; waits as in [`Settings::backoff_before`]; `Retry-After` is not read.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            retries: self.retries,
            backoff: self.backoff,
            max_backoff: MAX_BACKOFF,
            retry_on: RetryOn::AnyFailure,
            honour_retry_after: false,
        }
    }

    /// The wait before retry number `retry` (1-based): `backoff · 2^(retry−1)`, at most 8 s.
    pub fn backoff_before(&self, retry: u32) -> Duration {
        self.retry_policy().backoff_before(retry)
    }
}

fn parse_url(key: &str, text: &str) -> Result<Url, PluginError> {
    rlhf_http_client::parse_endpoint(text, cfg!(feature = "tls")).map_err(|e| PluginError::config(key, e.to_string()))
}

/// `token_env`'s token as `Authorization: Bearer <token>`.
fn bearer(name: &str, value: Result<String, std::env::VarError>) -> Result<HeaderValue, PluginError> {
    rlhf_http_client::secret_header(name, value, "Bearer ").map_err(|e| PluginError::config("token_env", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::env::VarError;

    fn env(name: &str) -> Result<String, VarError> {
        match name {
            "TOKEN" => Ok("s3cret".into()),
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
        let s = parse(r#"{"url": "http://127.0.0.1:5000/get_reward"}"#).unwrap();
        assert_eq!(s.urls.len(), 1);
        assert_eq!(s.urls[0].as_str(), "http://127.0.0.1:5000/get_reward");
        assert_eq!(s.format, Format::OpenRlhf { use_scores: false });
        assert!(s.authorization.is_none());
        assert_eq!(s.timeout, Duration::from_secs(30));
        assert_eq!(s.retries, 3);
        assert_eq!(s.backoff, Duration::from_millis(500));
        assert_eq!(s.max_samples_per_request, 64);
        assert_eq!(s.concurrency, 4);
        assert_eq!(s.on_error, OnError::Fail);
        let s = parse(r#"{"urls": ["http://a:1/x", "http://b/y"], "format": "llamafactory"}"#).unwrap();
        assert_eq!(s.urls.len(), 2);
        assert_eq!(s.format, Format::LlamaFactory { model: "reward-model".into() });
    }

    #[test]
    fn https_needs_the_tls_feature() {
        let r = parse(r#"{"url": "https://rm.example.com/score"}"#);
        if cfg!(feature = "tls") {
            assert_eq!(r.unwrap().urls[0].scheme(), "https");
        } else {
            assert!(r.unwrap_err().to_string().contains("https needs the plugin built with its `tls` feature"));
        }
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let s = parse(r#"{"url": "http://h/", "backoff_s": 0.5}"#).unwrap();
        let waits: Vec<f64> = (1..=6).map(|k| s.backoff_before(k).as_secs_f64()).collect();
        assert_eq!(waits, vec![0.5, 1.0, 2.0, 4.0, 8.0, 8.0]);
        assert_eq!(s.backoff_before(u32::MAX), MAX_BACKOFF);
        let s = parse(r#"{"url": "http://h/", "backoff_s": 0}"#).unwrap();
        assert_eq!(s.backoff_before(3), Duration::ZERO);
    }

    #[test]
    fn every_failure_is_retried() {
        let p = parse(r#"{"url": "http://h/", "retries": 5, "backoff_s": 0.25}"#).unwrap().retry_policy();
        assert_eq!((p.retries, p.backoff, p.max_backoff), (5, Duration::from_millis(250), MAX_BACKOFF));
        assert_eq!((p.retry_on, p.honour_retry_after), (RetryOn::AnyFailure, false));
        // Scoring twice is harmless, so a timeout is retried too.
        assert!(p.retries_after(&rlhf_http_client::Error::Timeout(Duration::from_secs(30))));
    }

    #[test]
    fn token_is_a_sensitive_bearer_header() {
        let s = parse(r#"{"url": "http://h/", "token_env": "TOKEN"}"#).unwrap();
        let h = s.authorization.unwrap();
        assert_eq!(h.to_str().unwrap(), "Bearer s3cret");
        assert!(h.is_sensitive());
        assert!(!format!("{h:?}").contains("s3cret"));
    }

    #[test]
    fn errors_name_the_key() {
        assert_eq!(err("{}"), "url: missing: set `url` (or `urls` for several endpoints)");
        assert_eq!(err(r#"{"url": "http://a/", "urls": ["http://b/"]}"#), "url: give either `url` or `urls`, not both");
        assert_eq!(err(r#"{"urls": []}"#), "urls: must name at least one endpoint");
        assert!(err(r#"{"url": "localhost:5000"}"#).starts_with("url: `localhost:5000`: scheme must be http"));
        assert!(err(r#"{"url": "not a url"}"#).starts_with("url: invalid URL `not a url`"));
        assert!(err(r#"{"urls": ["http://a/", "ftp://b/"]}"#).starts_with("urls[1]: `ftp://b/`: scheme"));
        assert!(err(r#"{"url": "http://h/", "format": "trl"}"#).starts_with("format: unknown variant `trl`"));
        assert!(err(r#"{"url": "http://h/", "on_error": "ignore"}"#).starts_with("on_error: unknown variant"));
        assert!(err(r#"{"url": "http://h/", "timeout": 3}"#).starts_with("timeout: unknown field `timeout`"));
        assert_eq!(err(r#"{"url": "http://h/", "concurrency": 0}"#), "concurrency: must be at least 1");
        assert_eq!(
            err(r#"{"url": "http://h/", "max_samples_per_request": 0}"#),
            "max_samples_per_request: must be at least 1"
        );
        assert!(err(r#"{"url": "http://h/", "concurrency": -1}"#).starts_with("concurrency: invalid value"));
        assert_eq!(
            err(r#"{"url": "http://h/", "timeout_s": -1}"#),
            "timeout_s: must be a positive number of seconds, got -1"
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "timeout_s": 0}"#),
            "timeout_s: must be a positive number of seconds, got 0"
        );
        assert!(err(r#"{"url": "http://h/", "timeout_s": 1e300}"#).starts_with("timeout_s: out of range"));
        assert!(err(r#"{"url": "http://h/", "backoff_s": -0.5}"#).starts_with("backoff_s: must be"));
        assert!(err(r#"{"url": "http://h/", "retries": -1}"#).starts_with("retries: invalid value"));
        assert_eq!(err(r#"{"url": "http://h/", "model": "rm"}"#), "model: only used with format = \"llamafactory\"");
        assert_eq!(
            err(r#"{"url": "http://h/", "format": "llamafactory", "use_scores": true}"#),
            "use_scores: only used with format = \"openrlhf\""
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "token_env": "NOPE"}"#),
            "token_env: environment variable `NOPE` is not set"
        );
        assert_eq!(
            err(r#"{"url": "http://h/", "token_env": "EMPTY"}"#),
            "token_env: environment variable `EMPTY` is empty"
        );
        assert!(err(r#"{"url": "http://h/", "token_env": "NEWLINE"}"#)
            .starts_with("token_env: environment variable `NEWLINE` holds"));
    }
}
