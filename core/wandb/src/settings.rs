//! Where the sink sends to and how hard it tries: [`WandbSettings`], built from the environment
//! (`WANDB_*`, as the wandb SDK reads them) merged under an optional `[wandb]` config section
//! ([`WandbConfig`]).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::WandbError;

/// The hosted W&B API.
pub const DEFAULT_BASE_URL: &str = "https://api.wandb.ai";
/// The project runs go to when none is configured (the wandb SDK's fallback too).
pub const DEFAULT_PROJECT: &str = "uncategorized";

/// The `[wandb]` section of a trainer config. Every field is optional; a set field wins over the
/// matching environment variable. The API key is deliberately not a field: it comes from
/// `WANDB_API_KEY` (or `~/.netrc`, as written by `wandb login`), never from a config file.
///
/// ```toml
/// [wandb]
/// enabled = true            # false: no sink even if WANDB_API_KEY is set
/// project = "rlhf"          # WANDB_PROJECT; default "uncategorized"
/// entity = "my-team"        # WANDB_ENTITY; default: the key's default entity
/// base_url = "https://api.wandb.ai"   # WANDB_BASE_URL
/// run_name = "grpo-lr1e-6"  # WANDB_NAME (display name)
/// run_id = "abc123xy"       # WANDB_RUN_ID; default: 8 random [a-z0-9]
/// group = "sweep-3"         # WANDB_RUN_GROUP
/// tags = ["grpo", "tiny"]   # WANDB_TAGS (comma separated)
/// flush_interval_s = 2.0
/// max_retries = 5
/// finish_timeout_s = 30.0
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WandbConfig {
    /// `false` disables the sink whatever the environment says; `true` or unset: enabled when an
    /// API key is found.
    pub enabled: Option<bool>,
    /// W&B project.
    pub project: Option<String>,
    /// W&B entity (user or team).
    pub entity: Option<String>,
    /// API server, e.g. `http://localhost:8080` for a self-hosted server.
    pub base_url: Option<String>,
    /// Display name of the run.
    pub run_name: Option<String>,
    /// Run id (the last path segment of the run's URL).
    pub run_id: Option<String>,
    /// Run group.
    pub group: Option<String>,
    /// Run tags.
    pub tags: Option<Vec<String>>,
    /// Seconds between history uploads.
    pub flush_interval_s: Option<f64>,
    /// Retries of a failed request before its data is dropped.
    pub max_retries: Option<u32>,
    /// Seconds `finish` (or dropping the sink) waits at most for the last uploads.
    pub finish_timeout_s: Option<f64>,
}

/// Everything the sink needs. Build it with [`WandbSettings::from_env`] (or
/// [`WandbSettings::new`] and set fields).
#[derive(Clone)]
pub struct WandbSettings {
    /// API server without trailing slash; GraphQL at `{base_url}/graphql`, file stream at
    /// `{base_url}/files/{entity}/{project}/{run}/file_stream`.
    pub base_url: String,
    /// API key, sent as HTTP basic auth with user `api`.
    pub api_key: String,
    /// Project.
    pub project: String,
    /// Entity; `None` lets the server pick the key's default entity (read back from the reply).
    pub entity: Option<String>,
    /// Run id; `None`: [`generate_run_id`] at start.
    pub run_id: Option<String>,
    /// Display name; `None`: the server picks one.
    pub run_name: Option<String>,
    /// Run group.
    pub group: Option<String>,
    /// Run tags.
    pub tags: Vec<String>,
    /// History lines are batched for at most this long before an upload.
    pub flush_interval: Duration,
    /// An empty file-stream request is sent after this long without any, so that the server does
    /// not mark a slow run as crashed.
    pub heartbeat_interval: Duration,
    /// Retries of a request (connection errors, timeouts, 408/429/5xx) before giving up on it.
    pub max_retries: u32,
    /// Backoff before the first retry; doubles up to [`Self::max_backoff`] (a 429's
    /// `Retry-After` is honoured up to that bound too).
    pub initial_backoff: Duration,
    /// Upper bound of one backoff.
    pub max_backoff: Duration,
    /// Upper bound of one HTTP attempt, connect to last byte.
    pub request_timeout: Duration,
    /// How long `finish` (or dropping the sink) waits at most for the remaining uploads.
    pub finish_timeout: Duration,
    /// History lines buffered between `log` and the background thread; when full, `log` drops
    /// the line and counts it.
    pub queue_capacity: usize,
    /// History lines per file-stream request at most.
    pub max_lines_per_request: usize,
}

impl std::fmt::Debug for WandbSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WandbSettings")
            .field("base_url", &self.base_url)
            .field("api_key", &"<redacted>")
            .field("project", &self.project)
            .field("entity", &self.entity)
            .field("run_id", &self.run_id)
            .field("run_name", &self.run_name)
            .field("group", &self.group)
            .field("tags", &self.tags)
            .field("flush_interval", &self.flush_interval)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("max_retries", &self.max_retries)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("request_timeout", &self.request_timeout)
            .field("finish_timeout", &self.finish_timeout)
            .field("queue_capacity", &self.queue_capacity)
            .field("max_lines_per_request", &self.max_lines_per_request)
            .finish()
    }
}

impl WandbSettings {
    /// Settings with the defaults: base URL [`DEFAULT_BASE_URL`], flush every 2 s, heartbeat every
    /// 30 s, 5 retries with backoff 1 s doubling up to 30 s, 10 s per request, 30 s for `finish`,
    /// a queue of 10 000 lines, 1000 lines per request.
    pub fn new(api_key: impl Into<String>, project: impl Into<String>) -> Self {
        WandbSettings {
            base_url: DEFAULT_BASE_URL.to_string(),
            api_key: api_key.into(),
            project: project.into(),
            entity: None,
            run_id: None,
            run_name: None,
            group: None,
            tags: Vec::new(),
            flush_interval: Duration::from_secs(2),
            heartbeat_interval: Duration::from_secs(30),
            max_retries: 5,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
            finish_timeout: Duration::from_secs(30),
            queue_capacity: 10_000,
            max_lines_per_request: 1000,
        }
    }

    /// Settings from the process environment merged under `config` (a set config field wins).
    ///
    /// `Ok(None)` means "no sink": no API key in `WANDB_API_KEY` nor in the netrc file (`$NETRC`
    /// or `~/.netrc`, entry for the base URL's host), or `config.enabled == Some(false)`, or
    /// `WANDB_MODE` is `disabled`/`offline`/`dryrun`, or `WANDB_DISABLED` is true. `Err` only for
    /// values that are set but unusable (a base URL that is not http(s), a negative interval, a
    /// run id with `/`...).
    ///
    /// Variables: `WANDB_API_KEY`, `WANDB_BASE_URL`, `WANDB_PROJECT`, `WANDB_ENTITY`,
    /// `WANDB_RUN_ID`, `WANDB_NAME`, `WANDB_RUN_GROUP`, `WANDB_TAGS`, `WANDB_MODE`,
    /// `WANDB_DISABLED`. Empty values count as unset.
    pub fn from_env(config: &WandbConfig) -> Result<Option<WandbSettings>, WandbError> {
        Self::from_lookup(config, |name| std::env::var(name).ok())
    }

    /// [`Self::from_env`] with the environment read through `env` (for tests and embedding).
    /// The netrc file is found through `env("NETRC")` or `env("HOME")`.
    pub fn from_lookup(
        config: &WandbConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<WandbSettings>, WandbError> {
        let var = |name: &str| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let text = |field: &Option<String>| field.as_ref().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());

        if config.enabled == Some(false) {
            return Ok(None);
        }
        if let Some(mode) = var("WANDB_MODE") {
            if matches!(mode.to_ascii_lowercase().as_str(), "disabled" | "offline" | "dryrun") {
                return Ok(None);
            }
        }
        if let Some(disabled) = var("WANDB_DISABLED") {
            if matches!(disabled.to_ascii_lowercase().as_str(), "true" | "1" | "yes") {
                return Ok(None);
            }
        }

        let base_url = normalize_base_url(
            &text(&config.base_url).or_else(|| var("WANDB_BASE_URL")).unwrap_or_else(|| DEFAULT_BASE_URL.to_string()),
        )?;
        let api_key = match var("WANDB_API_KEY") {
            Some(key) => key,
            None => {
                let netrc = var("NETRC").or_else(|| var("HOME").map(|home| format!("{home}/.netrc")));
                let host = reqwest::Url::parse(&base_url).ok().and_then(|u| u.host_str().map(str::to_string));
                match (netrc, host) {
                    (Some(path), Some(host)) => match std::fs::read_to_string(&path) {
                        Ok(contents) => match netrc_password(&contents, &host) {
                            Some(key) => key,
                            None => return Ok(None),
                        },
                        Err(_) => return Ok(None),
                    },
                    _ => return Ok(None),
                }
            }
        };

        let mut settings = WandbSettings::new(api_key, DEFAULT_PROJECT);
        settings.base_url = base_url;
        if let Some(project) = text(&config.project).or_else(|| var("WANDB_PROJECT")) {
            settings.project = project;
        }
        settings.entity = text(&config.entity).or_else(|| var("WANDB_ENTITY"));
        settings.run_id = text(&config.run_id).or_else(|| var("WANDB_RUN_ID"));
        settings.run_name = text(&config.run_name).or_else(|| var("WANDB_NAME"));
        settings.group = text(&config.group).or_else(|| var("WANDB_RUN_GROUP"));
        settings.tags = match &config.tags {
            Some(tags) => tags.iter().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect(),
            None => var("WANDB_TAGS")
                .map(|t| t.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect())
                .unwrap_or_default(),
        };
        if let Some(s) = config.flush_interval_s {
            settings.flush_interval = seconds("flush_interval_s", s)?;
        }
        if let Some(n) = config.max_retries {
            settings.max_retries = n;
        }
        if let Some(s) = config.finish_timeout_s {
            settings.finish_timeout = seconds("finish_timeout_s", s)?;
        }
        settings.validate()?;
        Ok(Some(settings))
    }

    /// Checks what [`Self::from_env`] checks; [`crate::WandbSink::start`] does not call it (it
    /// never fails), so call it yourself on hand-built settings.
    pub fn validate(&self) -> Result<(), WandbError> {
        normalize_base_url(&self.base_url)?;
        if self.api_key.trim().is_empty() {
            return Err(WandbError::invalid("api_key", "empty"));
        }
        check_name("project", &self.project)?;
        if let Some(entity) = &self.entity {
            check_name("entity", entity)?;
        }
        if let Some(id) = &self.run_id {
            check_name("run_id", id)?;
        }
        if self.queue_capacity == 0 {
            return Err(WandbError::invalid("queue_capacity", "must be at least 1"));
        }
        if self.max_lines_per_request == 0 {
            return Err(WandbError::invalid("max_lines_per_request", "must be at least 1"));
        }
        Ok(())
    }
}

/// Trims, drops trailing slashes and checks the scheme (https needs the `tls` feature).
fn normalize_base_url(raw: &str) -> Result<String, WandbError> {
    let trimmed = raw.trim().trim_end_matches('/').to_string();
    let url =
        reqwest::Url::parse(&trimmed).map_err(|e| WandbError::invalid("base_url", format!("{trimmed:?}: {e}")))?;
    match url.scheme() {
        "http" => {}
        "https" if cfg!(feature = "tls") => {}
        "https" => {
            return Err(WandbError::invalid("base_url", "https needs rlhf-wandb's `tls` feature"));
        }
        other => return Err(WandbError::invalid("base_url", format!("scheme {other:?} is not http(s)"))),
    }
    if url.host_str().is_none() {
        return Err(WandbError::invalid("base_url", format!("{trimmed:?} has no host")));
    }
    Ok(trimmed)
}

/// Entity, project and run id become URL path segments: refuse what wandb refuses.
fn check_name(field: &'static str, value: &str) -> Result<(), WandbError> {
    if value.trim().is_empty() {
        return Err(WandbError::invalid(field, "empty"));
    }
    if value.len() > 128 {
        return Err(WandbError::invalid(field, "longer than 128 characters"));
    }
    if let Some(c) = value.chars().find(|c| matches!(c, '/' | '\\' | '#' | '?' | '%' | ':') || c.is_whitespace()) {
        return Err(WandbError::invalid(field, format!("{value:?} contains {c:?}")));
    }
    Ok(())
}

fn seconds(field: &'static str, s: f64) -> Result<Duration, WandbError> {
    Duration::try_from_secs_f64(s).map_err(|_| WandbError::invalid(field, format!("{s} is not a non-negative number")))
}

/// The `password` of the netrc entry for `host` (or of `default`).
fn netrc_password(contents: &str, host: &str) -> Option<String> {
    let mut tokens = contents.split_whitespace();
    let mut current: Option<bool> = None; // Some(true): inside the entry for `host`
    let mut default_password = None;
    let mut in_default = false;
    while let Some(token) = tokens.next() {
        match token {
            "machine" => {
                in_default = false;
                current = Some(tokens.next() == Some(host));
            }
            "default" => {
                in_default = true;
                current = Some(false);
            }
            "password" => {
                let value = tokens.next()?;
                if current == Some(true) {
                    return Some(value.to_string());
                }
                if in_default {
                    default_password = Some(value.to_string());
                }
            }
            "login" | "account" => {
                tokens.next();
            }
            _ => {}
        }
    }
    default_password
}

/// A fresh run id: 8 characters from `[a-z0-9]`, like the wandb SDK's.
pub fn generate_run_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    hasher.write_u32(std::process::id());
    let mut bits = hasher.finish();
    (0..8)
        .map(|_| {
            let c = ALPHABET[(bits % ALPHABET.len() as u64) as usize];
            bits /= ALPHABET.len() as u64;
            c as char
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netrc_entries() {
        let netrc = "machine example.com login a password x\nmachine api.wandb.ai\n  login user\n  password KEY123\n";
        assert_eq!(netrc_password(netrc, "api.wandb.ai").as_deref(), Some("KEY123"));
        assert_eq!(netrc_password(netrc, "other.host"), None);
        assert_eq!(netrc_password("default login u password D", "h").as_deref(), Some("D"));
    }

    #[test]
    fn run_ids() {
        let a = generate_run_id();
        let b = generate_run_id();
        assert_eq!(a.len(), 8);
        assert!(a.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn base_urls() {
        assert_eq!(normalize_base_url(" http://localhost:8080/ ").unwrap(), "http://localhost:8080");
        assert!(normalize_base_url("ftp://x").is_err());
        assert!(normalize_base_url("not a url").is_err());
    }
}
