//! Fetching a model's files over the Hub's HTTP API, as `huggingface_hub` does:
//!
//! 1. `GET {endpoint}/api/models/{repo}/revision/{revision}` gives the commit (`sha`) and the
//!    repository's files (`siblings`);
//! 2. for each file loading needs that the snapshot lacks, `HEAD
//!    {endpoint}/{repo}/resolve/{commit}/{file}` (redirects not followed) gives its blob name
//!    (`X-Linked-Etag`, else `ETag`) and size, then the file is streamed (following the redirect
//!    to the CDN) into `blobs/<etag>.incomplete`, resumed with a `Range` request after a broken
//!    connection, renamed to `blobs/<etag>` when whole, and linked from `snapshots/<commit>/`.
//!
//! A 401 (a private or missing repository, without a token that opens it), 403 (gated), 404
//! (repository, revision or file) is an error naming the id; a 5xx is [`Failure::Unreachable`]
//! (the caller falls back to the cache). Names the server lists, shard names of the index and
//! ETags are checked before they become paths ([`crate::paths`]); the token goes only to the
//! endpoint's origin ([`crate::http::authorized`]); each file has an overall deadline.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, Response};
use reqwest::header::{CONTENT_LENGTH, LOCATION, RANGE};
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use crate::cache::RepoCache;
use crate::http::{self, BodyError};
use crate::paths::{safe_etag, unsafe_file_name};
use crate::{Hub, HubError, HubId, Result};

/// The single-file checkpoint and the index of a sharded one.
pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";

/// Files fetched besides config and weights when the repository has them.
const AUX: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
];

/// Attempts per file, resuming where the last one stopped.
const ATTEMPTS: usize = 5;

/// The largest API answer read (a listing of a repository's files).
const LISTING_LIMIT: u64 = 256 << 20;

/// Why a fetch did not give a snapshot.
#[derive(Debug)]
pub enum Failure {
    /// The Hub could not be reached at all, or answered 5xx (the cache may still serve); the
    /// message says which (`the Hub is unreachable (...)`, `the Hub answered HTTP 503 ...`).
    Unreachable(String),
    Error(HubError),
}

impl From<HubError> for Failure {
    fn from(e: HubError) -> Self {
        Failure::Error(e)
    }
}

#[derive(Deserialize)]
pub(crate) struct RepoInfo {
    pub sha: String,
    #[serde(default)]
    pub siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
pub(crate) struct Sibling {
    pub rfilename: String,
}

#[derive(Deserialize)]
struct Index {
    weight_map: std::collections::BTreeMap<String, String>,
}

/// The distinct shard files an index lists, in order of first appearance; a shard name that is
/// not a plain relative path (`/abs`, `../x`) is an error naming it.
pub fn shards_of(index: &Path) -> std::result::Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| e.to_string())?;
    let index: Index = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let mut out: Vec<String> = Vec::new();
    for f in index.weight_map.values() {
        if let Some(why) = unsafe_file_name(f) {
            return Err(format!("the shard name `{f}` is not a safe relative path ({why})"));
        }
        if !out.contains(f) {
            out.push(f.clone());
        }
    }
    Ok(out)
}

/// What a non-success status means for `id`.
pub(crate) fn status_error(hub: &Hub, id: &HubId, what: &str, r: &Response) -> HubError {
    let code = r.headers().get("x-error-code").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let status = r.status();
    let message = match (status.as_u16(), code.as_str()) {
        (404, "RevisionNotFound") => format!("revision `{}` not found on {}", id.revision, hub.endpoint),
        (404, "EntryNotFound") => format!("{what} not found at revision `{}`", id.revision),
        (401, _) if hub.token.is_none() => format!(
            "repository not found on {} or it needs a token (HTTP 401): set HF_TOKEN for a private or gated model",
            hub.endpoint
        ),
        (401, _) => format!("HF_TOKEN was not accepted for this repository on {} (HTTP 401)", hub.endpoint),
        (403, _) => format!(
            "access denied (HTTP 403): a gated model whose terms the token's account has not accepted on {}",
            hub.endpoint
        ),
        (404, _) => format!("repository not found on {} (HTTP 404)", hub.endpoint),
        _ => format!("{what}: HTTP {status} from {}", hub.endpoint),
    };
    HubError::model(id, message)
}

/// One resolution of `id` against the Hub: the client, the parsed endpoint.
pub(crate) struct Session<'a> {
    pub hub: &'a Hub,
    pub id: &'a HubId,
    client: Client,
    endpoint: Url,
}

impl<'a> Session<'a> {
    pub fn new(hub: &'a Hub, id: &'a HubId) -> std::result::Result<Self, Failure> {
        let endpoint = http::endpoint(hub, id)?;
        let client = http::client(hub.read_timeout)
            .map_err(|e| Failure::Error(HubError::model(id, format!("HTTP client: {e}"))))?;
        Ok(Session { hub, id, client, endpoint })
    }

    fn error(&self, message: impl Into<String>) -> Failure {
        Failure::Error(HubError::model(self.id, message))
    }

    /// `GET {endpoint}/api/{models|datasets}/{repo}/revision/{revision}`: the commit and the
    /// files. Every listed name must be a plain relative path.
    pub fn repo_info(&self) -> std::result::Result<RepoInfo, Failure> {
        let (org, name) = self.id.repo.split_once('/').unwrap_or(("", self.id.repo.as_str()));
        let segments = ["api", self.id.kind.plural(), org, name, "revision", self.id.revision.as_str()];
        let url = http::join(&self.endpoint, &segments);
        let req = http::authorized(self.hub, &self.endpoint, &url, self.client.get(url.clone()));
        let mut r = req.send().map_err(|e| Failure::Unreachable(format!("the Hub is unreachable ({e})")))?;
        if r.status().is_server_error() {
            return Err(Failure::Unreachable(format!("the Hub answered HTTP {} for {url}", r.status())));
        }
        if !r.status().is_success() {
            return Err(status_error(self.hub, self.id, "repository", &r).into());
        }
        let deadline = Instant::now() + self.hub.file_timeout.unwrap_or(Duration::from_secs(600));
        let mut body = Vec::new();
        http::read_body(&mut r, LISTING_LIMIT, deadline, |b| {
            body.extend_from_slice(b);
            Ok(())
        })
        .map_err(|e| self.error(format!("reading {url}: {e}")))?;
        let info: RepoInfo =
            serde_json::from_slice(&body).map_err(|e| self.error(format!("unreadable answer from {url}: {e}")))?;
        if !crate::cache::is_commit(&info.sha) {
            return Err(self.error(format!("{url} gave no commit hash")));
        }
        for s in &info.siblings {
            if let Some(why) = unsafe_file_name(&s.rfilename) {
                return Err(self.error(format!(
                    "the Hub lists a file named `{}`, which is not a safe relative path ({why}); refusing the listing",
                    s.rfilename
                )));
            }
        }
        Ok(info)
    }

    /// Downloads `name` of `commit` into the cache unless the snapshot has it.
    pub fn file(&self, repo: &RepoCache, commit: &str, name: &str) -> std::result::Result<(), Failure> {
        if let Some(why) = unsafe_file_name(name) {
            return Err(self.error(format!("`{name}` is not a safe relative path ({why})")));
        }
        if repo.has(commit, name) {
            return Ok(());
        }
        let url = http::resolve_url(&self.endpoint, self.id, commit, name);
        let head = http::authorized(self.hub, &self.endpoint, &url, self.client.head(url.clone()));
        let r = head.send().map_err(|e| Failure::Unreachable(format!("the Hub is unreachable ({e})")))?;
        if r.status().is_server_error() {
            return Err(Failure::Unreachable(format!("the Hub answered HTTP {} for {name}", r.status())));
        }
        if !(r.status().is_success() || r.status().is_redirection()) {
            return Err(status_error(self.hub, self.id, name, &r).into());
        }
        let header = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
        let etag = header("x-linked-etag")
            .or_else(|| header("etag"))
            .map(|e| e.trim_start_matches("W/").trim_matches('"').to_string())
            .ok_or_else(|| self.error(format!("{name}: the Hub sent no ETag")))?;
        if !safe_etag(&etag) {
            return Err(self.error(format!("{name}: the Hub sent the ETag `{etag}`, which cannot name a blob")));
        }
        let size = header("x-linked-size")
            .or_else(|| if r.status().is_success() { header(CONTENT_LENGTH.as_str()) } else { None })
            .and_then(|s| s.parse::<u64>().ok());
        // The CDN location of a large file (relative to the resolve URL), else that URL itself.
        let location = match header(LOCATION.as_str()) {
            Some(l) => url
                .join(&l)
                .ok()
                .filter(|u| matches!(u.scheme(), "http" | "https"))
                .ok_or_else(|| self.error(format!("{name}: the Hub redirected to `{l}`, not an http(s) URL")))?,
            None => url,
        };
        if !repo.blob(&etag).is_file() {
            self.stream(repo, name, &location, &etag, size)?;
        }
        repo.link(commit, name, &etag)?;
        Ok(())
    }

    /// Streams `url` into `blobs/<etag>` through `blobs/<etag>.incomplete`, resuming after broken
    /// connections, within the file's deadline.
    fn stream(&self, repo: &RepoCache, name: &str, url: &Url, etag: &str, size: Option<u64>) -> Result<()> {
        let (blob, part) = (repo.blob(etag), repo.partial(etag));
        if !crate::paths::inside(&repo.dir, &blob) || !crate::paths::inside(&repo.dir, &part) {
            return Err(HubError::model(self.id, format!("{name}: the blob `{etag}` lies outside the cache")));
        }
        if let Some(dir) = blob.parent() {
            std::fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        }
        let allowed = self.hub.file_timeout.unwrap_or_else(|| Duration::from_secs(600 + size.unwrap_or(0) / 1_000_000));
        let deadline = Instant::now() + allowed;
        let bar = progress(name, size);
        let have_now = || std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        let (mut last, mut complete) = (String::new(), false);
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200 * (1 << attempt)));
            }
            let have = have_now();
            if size.is_some_and(|s| have == s) {
                complete = true;
                break;
            }
            let mut req = self.client.get(url.clone());
            if have > 0 {
                req = req.header(RANGE, format!("bytes={have}-"));
            }
            let mut r = match http::authorized(self.hub, &self.endpoint, url, req).send() {
                Ok(r) => r,
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            let append = match r.status() {
                StatusCode::PARTIAL_CONTENT => true,
                StatusCode::OK => false,
                s if s.is_server_error() => {
                    last = format!("HTTP {s}");
                    continue;
                }
                _ => return Err(status_error(self.hub, self.id, name, &r)),
            };
            let mut out = std::fs::OpenOptions::new()
                .create(true)
                .append(append)
                .write(true)
                .truncate(!append)
                .open(&part)
                .map_err(|e| HubError::io(&part, e))?;
            let from = if append { have } else { 0 };
            if let Some(b) = &bar {
                b.set_position(from);
            }
            let limit = size.map_or(u64::MAX, |s| s.saturating_sub(from));
            let read = http::read_body(&mut r, limit, deadline, |bytes| {
                out.write_all(bytes).map_err(|e| format!("{}: {e}", part.display()))?;
                if let Some(b) = &bar {
                    b.inc(bytes.len() as u64);
                }
                Ok(())
            });
            out.flush().map_err(|e| HubError::io(&part, e))?;
            match read {
                Ok(_) => {}
                Err(BodyError::Deadline) => {
                    return Err(HubError::model(
                        self.id,
                        format!(
                        "{name}: the download took longer than its deadline of {} s (RLHF_HUB_FILE_TIMEOUT); {} bytes \
                             kept, run again to resume",
                        allowed.as_secs_f64(),
                        have_now()
                    ),
                    ))
                }
                Err(BodyError::TooLarge(_)) => {
                    let _ = std::fs::remove_file(&part);
                    return Err(HubError::model(
                        self.id,
                        format!("{name}: the Hub sent more than the {size:?} bytes it declared"),
                    ));
                }
                Err(BodyError::Io(e)) => {
                    last = e;
                    continue;
                }
            }
            let have = have_now();
            if size.is_none_or(|s| s == have) {
                complete = true;
                break;
            }
            last = format!("got {have} of {} bytes", size.unwrap_or(0));
        }
        if !complete {
            return Err(HubError::model(
                self.id,
                format!(
                    "{name}: download stopped at {} bytes after {ATTEMPTS} attempts ({last}); run again to resume",
                    have_now()
                ),
            ));
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        std::fs::rename(&part, &blob).map_err(|e| HubError::io(&blob, e))
    }
}

/// Resolves `id` on the Hub and downloads what the snapshot lacks; returns the snapshot.
pub fn fetch(hub: &Hub, repo: &RepoCache, id: &HubId) -> std::result::Result<PathBuf, Failure> {
    let s = Session::new(hub, id)?;
    let info = s.repo_info()?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let has = |f: &str| files.contains(&f);
    if !has("config.json") {
        return Err(HubError::model(id, "the repository has no config.json (not a transformers model)").into());
    }
    let commit = info.sha.as_str();
    let mut wanted: Vec<String> = vec!["config.json".into()];
    wanted.extend(AUX.iter().filter(|f| has(f)).map(|f| f.to_string()));
    for f in &wanted {
        s.file(repo, commit, f)?;
    }
    let snapshot = repo.snapshot(commit);
    if has(INDEX) {
        s.file(repo, commit, INDEX)?;
        let shards = shards_of(&snapshot.join(INDEX)).map_err(|e| HubError::model(id, format!("{INDEX}: {e}")))?;
        for shard in shards {
            s.file(repo, commit, &shard)?;
        }
    } else if has(SINGLE) {
        s.file(repo, commit, SINGLE)?;
    } else {
        return Err(HubError::model(
            id,
            "the repository has no safetensors weights (model.safetensors or its index); only safetensors are read",
        )
        .into());
    }
    repo.write_ref(&id.revision, commit)?;
    Ok(snapshot)
}

/// A progress bar for a download, on a terminal only.
fn progress(name: &str, size: Option<u64>) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(size.unwrap_or(0));
    let style = indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(name.to_string());
    Some(bar)
}
