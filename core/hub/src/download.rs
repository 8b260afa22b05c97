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
//! (repository, revision or file) is an error naming the id.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use reqwest::blocking::{Client, Response};
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_LENGTH, LOCATION, RANGE};
use reqwest::StatusCode;
use serde::Deserialize;

use crate::cache::RepoCache;
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

/// Why a fetch did not give a snapshot.
#[derive(Debug)]
pub enum Failure {
    /// The Hub could not be reached at all (the cache may still serve).
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

/// The distinct shard files an index lists, in order of first appearance.
pub fn shards_of(index: &Path) -> std::result::Result<Vec<String>, String> {
    let text = std::fs::read_to_string(index).map_err(|e| e.to_string())?;
    let index: Index = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let mut out: Vec<String> = Vec::new();
    for f in index.weight_map.values() {
        if !out.contains(f) {
            out.push(f.clone());
        }
    }
    Ok(out)
}

pub(crate) fn client() -> std::result::Result<Client, String> {
    Client::builder()
        .connect_timeout(Duration::from_secs(10))
        // The blocking client bounds the wait for a response's head and for each read of its
        // body with this, not the whole transfer: a multi-gigabyte shard may take as long as
        // it needs, while a connection that stalls fails and the download resumes with `Range`.
        .timeout(Duration::from_secs(30))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())
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

pub(crate) fn get(client: &Client, hub: &Hub, url: &str, extra: HeaderMap) -> reqwest::Result<Response> {
    let mut req = client.get(url).headers(extra);
    if let Some(t) = &hub.token {
        req = req.header(AUTHORIZATION, format!("Bearer {t}"));
    }
    req.send()
}

/// Resolves `id` on the Hub and downloads what the snapshot lacks; returns the snapshot.
pub fn fetch(hub: &Hub, repo: &RepoCache, id: &HubId) -> std::result::Result<std::path::PathBuf, Failure> {
    let client = client().map_err(|e| Failure::Error(HubError::model(id, format!("HTTP client: {e}"))))?;
    let url = format!("{}/api/models/{}/revision/{}", hub.endpoint, id.repo, id.revision);
    let r = get(&client, hub, &url, HeaderMap::new()).map_err(|e| Failure::Unreachable(e.to_string()))?;
    if !r.status().is_success() {
        return Err(status_error(hub, id, "repository", &r).into());
    }
    let info: RepoInfo =
        r.json().map_err(|e| Failure::Error(HubError::model(id, format!("unreadable answer from {url}: {e}"))))?;
    if !crate::cache::is_commit(&info.sha) {
        return Err(HubError::model(id, format!("{url} gave no commit hash")).into());
    }
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let has = |f: &str| files.contains(&f);
    if !has("config.json") {
        return Err(HubError::model(id, "the repository has no config.json (not a transformers model)").into());
    }
    let commit = info.sha.as_str();
    let mut wanted: Vec<String> = vec!["config.json".into()];
    wanted.extend(AUX.iter().filter(|f| has(f)).map(|f| f.to_string()));
    for f in &wanted {
        file(&client, hub, repo, id, commit, f)?;
    }
    let snapshot = repo.snapshot(commit);
    if has(INDEX) {
        file(&client, hub, repo, id, commit, INDEX)?;
        let shards = shards_of(&snapshot.join(INDEX)).map_err(|e| HubError::model(id, format!("{INDEX}: {e}")))?;
        for s in shards {
            file(&client, hub, repo, id, commit, &s)?;
        }
    } else if has(SINGLE) {
        file(&client, hub, repo, id, commit, SINGLE)?;
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

/// Downloads `name` of `commit` into the cache unless the snapshot has it.
pub(crate) fn file(
    client: &Client,
    hub: &Hub,
    repo: &RepoCache,
    id: &HubId,
    commit: &str,
    name: &str,
) -> std::result::Result<(), Failure> {
    if repo.has(commit, name) {
        return Ok(());
    }
    let url = format!("{}/{}{}/resolve/{commit}/{name}", hub.endpoint, id.kind.url_prefix(), id.repo);
    let mut head = client.head(&url);
    if let Some(t) = &hub.token {
        head = head.header(AUTHORIZATION, format!("Bearer {t}"));
    }
    let r = head.send().map_err(|e| Failure::Unreachable(e.to_string()))?;
    if !(r.status().is_success() || r.status().is_redirection()) {
        return Err(status_error(hub, id, name, &r).into());
    }
    let header = |k: &str| r.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    let etag = header("x-linked-etag")
        .or_else(|| header("etag"))
        .map(|e| e.trim_start_matches("W/").trim_matches('"').to_string())
        .filter(|e| !e.is_empty() && !e.contains(['/', '\\']))
        .ok_or_else(|| HubError::model(id, format!("{name}: the Hub sent no ETag")))?;
    let size = header("x-linked-size")
        .or_else(|| if r.status().is_success() { header(CONTENT_LENGTH.as_str()) } else { None })
        .and_then(|s| s.parse::<u64>().ok());
    // The CDN location of a large file, else the resolve URL itself.
    let location = match header(LOCATION.as_str()) {
        Some(l) if l.starts_with('/') => format!("{}{l}", hub.endpoint),
        Some(l) => l,
        None => url.clone(),
    };
    let blob = repo.blob(&etag);
    if !blob.is_file() {
        stream(client, hub, id, name, &location, &blob, size)?;
    }
    repo.link(commit, name, &etag)?;
    Ok(())
}

/// Streams `url` into `blob` through `<blob>.incomplete`, resuming after broken connections.
fn stream(client: &Client, hub: &Hub, id: &HubId, name: &str, url: &str, blob: &Path, size: Option<u64>) -> Result<()> {
    let part = blob.with_extension("incomplete");
    if let Some(dir) = blob.parent() {
        std::fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
    }
    let bar = progress(name, size);
    let (mut last, mut complete) = (String::new(), false);
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(200 * (1 << attempt)));
        }
        let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if size.is_some_and(|s| have == s) {
            complete = true;
            break;
        }
        let mut headers = HeaderMap::new();
        if have > 0 {
            headers.insert(RANGE, format!("bytes={have}-").parse().expect("a valid header value"));
        }
        // The CDN is another origin: the token goes to the Hub only.
        let same_origin = url.starts_with(&hub.endpoint);
        let mut req = client.get(url).headers(headers);
        if same_origin {
            if let Some(t) = &hub.token {
                req = req.header(AUTHORIZATION, format!("Bearer {t}"));
            }
        }
        let mut r = match req.send() {
            Ok(r) => r,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        let append = match r.status() {
            StatusCode::PARTIAL_CONTENT => true,
            StatusCode::OK => false,
            _ => return Err(status_error(hub, id, name, &r)),
        };
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(&part)
            .map_err(|e| HubError::io(&part, e))?;
        if let Some(b) = &bar {
            b.set_position(if append { have } else { 0 });
        }
        let mut buf = vec![0u8; 1 << 16];
        let done = loop {
            match r.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => {
                    out.write_all(&buf[..n]).map_err(|e| HubError::io(&part, e))?;
                    if let Some(b) = &bar {
                        b.inc(n as u64);
                    }
                }
                Err(e) => {
                    last = e.to_string();
                    break false;
                }
            }
        };
        out.flush().map_err(|e| HubError::io(&part, e))?;
        let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if done && size.is_none_or(|s| s == have) {
            complete = true;
            break;
        }
        if done {
            last = format!("got {have} of {} bytes", size.unwrap_or(0));
        }
    }
    if !complete {
        let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        return Err(HubError::model(
            id,
            format!("{name}: download stopped at {have} bytes after {ATTEMPTS} attempts ({last}); run again to resume"),
        ));
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    std::fs::rename(&part, blob).map_err(|e| HubError::io(blob, e))
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
