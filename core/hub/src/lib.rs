//! Models named by Hugging Face Hub id, as TRL, verl and OpenRLHF take them: `org/name` or
//! `org/name@revision` (a branch, tag or commit). [`resolve_model`] returns a local directory: a
//! path that exists wins; otherwise the id is looked up in the Hugging Face cache (the layout
//! transformers and `huggingface_hub` share, [`cache`]) and what loading needs is downloaded
//! into it when missing ([`download`]): `config.json`, `generation_config.json`, the tokenizer
//! files, and the safetensors weights with their index.
//!
//! Environment, as `huggingface_hub` reads it: `HF_ENDPOINT` (default `https://huggingface.co`),
//! `HF_TOKEN` (else the token file `$HF_HOME/token`), `HF_HUB_OFFLINE=1` (the cache only),
//! `HF_HUB_CACHE` / `HF_HOME` (where the cache is); and `RLHF_HUB_FILE_TIMEOUT`, the seconds one
//! file's download may take, all attempts together (default: 10 minutes plus a second per MB).
//! Downloads resume from a partial blob, and a lock per repository lets several processes (the
//! ranks of one run) resolve the same id at once.
//!
//! Nothing the server sends is trusted as a path: file names, revisions and ETags are checked
//! ([`paths`]) before they are joined to the cache, the token goes to the endpoint's origin only
//! ([`http::same_origin`]), and a Hub that answers 5xx, like one that cannot be reached, falls
//! back to a complete cached snapshot (as `huggingface_hub` does).

pub mod cache;
pub mod datasets;
pub mod download;
pub mod http;
pub mod paths;

use std::path::{Path, PathBuf};

pub use cache::{hub_cache, RepoCache};

/// Errors of resolving a Hub id; each message is one line that names the id.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The repository, revision or a file cannot be had (not found, gated, offline miss...).
    #[error("model `{id}`: {message}")]
    Model { id: String, message: String },
    /// The same for a dataset repository.
    #[error("dataset `{id}`: {message}")]
    Dataset { id: String, message: String },
    /// A cache file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// An environment variable the client reads has a value it cannot use.
    #[error("{var} `{value}`: {message}")]
    Env { var: &'static str, value: String, message: String },
}

impl HubError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        HubError::Io { path: path.into(), source }
    }

    /// An error about `id` (a model or a dataset, as its kind says).
    pub(crate) fn model(id: &HubId, message: impl Into<String>) -> Self {
        match id.kind {
            RepoKind::Model => HubError::Model { id: id.to_string(), message: message.into() },
            RepoKind::Dataset => HubError::Dataset { id: id.to_string(), message: message.into() },
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = HubError> = std::result::Result<T, E>;

/// What a repository holds: its API path (`/api/models/...`), its file URLs (`/datasets/...`)
/// and its cache entry (`models--...`) differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RepoKind {
    #[default]
    Model,
    Dataset,
}

impl RepoKind {
    /// `models` or `datasets`: the API path segment and the cache entry's prefix.
    pub fn plural(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    /// What comes before `{repo}/resolve/...` in a file URL.
    pub fn url_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "",
            RepoKind::Dataset => "datasets/",
        }
    }
}

/// A repository id with the revision to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit; `main` when the id names none.
    pub revision: String,
    pub kind: RepoKind,
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" {
            write!(f, "{}", self.repo)
        } else {
            write!(f, "{}@{}", self.repo, self.revision)
        }
    }
}

/// Parses `org/name` or `org/name@revision` (names of letters, digits, `-`, `_`, `.`, as the Hub
/// allows); `None` for anything else (a path, say).
pub fn parse_id(spec: &str) -> Option<HubId> {
    let (repo, revision) = match spec.split_once('@') {
        Some((r, rev)) if !rev.is_empty() && !rev.chars().any(char::is_whitespace) => (r, rev),
        Some(_) => return None,
        None => (spec, "main"),
    };
    let (org, name) = repo.split_once('/')?;
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && !p.starts_with(['.', '-'])
            && !p.ends_with(['.', '-'])
            && !p.contains("..")
            && !p.contains("--")
    };
    (part_ok(org) && part_ok(name)).then(|| HubId {
        repo: repo.to_string(),
        revision: revision.to_string(),
        kind: RepoKind::Model,
    })
}

/// Where models come from: endpoint, credentials, cache, and whether the network may be used.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    pub cache: PathBuf,
    pub offline: bool,
    /// The most one file's download may take, all attempts together; `None`: 10 minutes plus a
    /// second per MB of the size the Hub declares.
    pub file_timeout: Option<std::time::Duration>,
    /// How long one read (a response's head, or the next bytes of a body) may wait.
    pub read_timeout: std::time::Duration,
}

fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

impl Hub {
    /// From the environment (see the crate docs); an endpoint that is not an http(s) URL or a
    /// timeout that is not a positive number is an error naming its variable.
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let token = var("HF_TOKEN").or_else(|| var("HUGGING_FACE_HUB_TOKEN")).or_else(|| {
            let path = var("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| cache::hf_home().join("token"));
            std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let endpoint: String =
            var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()).trim_end_matches('/').into();
        if let Err(message) = http::parse_endpoint(&endpoint) {
            return Err(HubError::Env { var: "HF_ENDPOINT", value: endpoint, message });
        }
        let file_timeout = match var("RLHF_HUB_FILE_TIMEOUT") {
            None => None,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 => Some(std::time::Duration::from_secs_f64(s)),
                _ => {
                    let message = "expected a number of seconds > 0".into();
                    return Err(HubError::Env { var: "RLHF_HUB_FILE_TIMEOUT", value: v, message });
                }
            },
        };
        Ok(Hub {
            endpoint,
            token,
            cache: hub_cache(),
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v)),
            file_timeout,
            read_timeout: std::time::Duration::from_secs(30),
        })
    }

    /// Checks what [`Hub::model`] and [`Hub::dataset`] take from the user before anything is
    /// created: the id's revision must be one the Hub could have.
    pub(crate) fn check_id(id: &HubId) -> Result<()> {
        match paths::unsafe_revision(&id.revision) {
            Some(why) => {
                Err(HubError::model(id, format!("revision `{}` is not a valid git revision: {why}", id.revision)))
            }
            None => Ok(()),
        }
    }

    /// The local snapshot directory of `id`, downloading what is missing (unless offline).
    pub fn model(&self, id: &HubId) -> Result<PathBuf> {
        Self::check_id(id)?;
        if !self.offline {
            http::endpoint(self, id)?;
        }
        let repo = RepoCache::new(&self.cache, id);
        let _lock = repo.lock()?;
        if self.offline {
            return cached(&repo, id, "HF_HUB_OFFLINE is set");
        }
        match download::fetch(self, &repo, id) {
            Err(download::Failure::Unreachable(why)) => {
                let dir = cached(&repo, id, &why)?;
                tracing::warn!("model `{id}`: {why}; using the cached snapshot {}", dir.display());
                Ok(dir)
            }
            Err(download::Failure::Error(e)) => Err(e),
            Ok(dir) => Ok(dir),
        }
    }
}

/// The cached snapshot of `id` with everything loading needs, or an error saying `why` nothing
/// was downloaded.
fn cached(repo: &RepoCache, id: &HubId, why: &str) -> Result<PathBuf> {
    let miss = |what: String| HubError::model(id, format!("{what} in the cache {} and {why}", repo.dir.display()));
    let commit = repo.commit_of(&id.revision).ok_or_else(|| miss(format!("revision `{}` is not", id.revision)))?;
    let dir = repo.snapshot(&commit);
    for file in needed_weights(&dir).map_err(|f| miss(format!("`{f}` is not")))? {
        if !dir.join(&file).is_file() {
            return Err(miss(format!("`{file}` is not")));
        }
    }
    Ok(dir)
}

/// `config.json` and the weight files a complete snapshot directory must hold (the shards its
/// index lists, or `model.safetensors`); `Err(file)` when the file that says which is missing.
fn needed_weights(dir: &Path) -> std::result::Result<Vec<String>, String> {
    if !dir.join("config.json").is_file() {
        return Err("config.json".into());
    }
    let index = dir.join(download::INDEX);
    if index.is_file() {
        return download::shards_of(&index).map_err(|_| download::INDEX.to_string());
    }
    Ok(vec![download::SINGLE.to_string()])
}

/// A model named by `spec`: an existing path as it is, a Hub id resolved through the cache, or
/// else the path as given (its loader then says it is not found). A process resolves each id
/// once: later calls return the same directory without touching the network.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    static RESOLVED: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let Some(id) = parse_id(spec) else { return Ok(path.to_path_buf()) };
    let mut resolved = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, dir)) = resolved.iter().find(|(s, _)| s == spec) {
        return Ok(dir.clone());
    }
    let dir = Hub::from_env()?.model(&id)?;
    resolved.push((spec.to_string(), dir.clone()));
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids() {
        let id = parse_id("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("Qwen/Qwen3-0.6B", "main"));
        let id = parse_id("org/name@v1.0").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("org/name", "v1.0"));
        assert_eq!(id.to_string(), "org/name@v1.0");
        for bad in ["name", "./dir/x", "/abs/path", "a/b/c", "org/", "/name", "org/na me", "org/name@", "../x", "a/.b"]
        {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_existing_path_wins() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("org").join("name");
        std::fs::create_dir_all(&model).unwrap();
        let here = std::env::current_dir().unwrap();
        std::env::set_current_dir(dir.path()).unwrap();
        let got = resolve_model("org/name");
        std::env::set_current_dir(here).unwrap();
        assert_eq!(got.unwrap(), Path::new("org/name"));
    }
}
