//! The HTTP side of the client: URLs built from parsed parts (every id, revision and file name
//! percent-encoded as one path segment, the way `huggingface_hub` quotes them), the token sent to
//! the endpoint's own origin only, and bodies read under a deadline and a size limit.

use std::io::Read;
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::AUTHORIZATION;
use reqwest::Url;

use crate::{Hub, HubError, HubId, Result};

/// `endpoint` parsed, or why it is not an http(s) URL the client can append paths to.
pub fn parse_endpoint(endpoint: &str) -> std::result::Result<Url, String> {
    let not = |why: String| format!("not an http(s) URL: {why}");
    let url = Url::parse(endpoint).map_err(|e| not(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(not(format!("the scheme is `{}`", url.scheme())));
    }
    if url.host_str().is_none_or(str::is_empty) || url.cannot_be_a_base() {
        return Err(not("it names no host".into()));
    }
    if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() {
        return Err(not("it has a query, a fragment or a user name".into()));
    }
    Ok(url)
}

/// The parsed endpoint, or an error naming `HF_ENDPOINT` (where a user sets it).
pub(crate) fn endpoint(hub: &Hub, id: &HubId) -> Result<Url> {
    parse_endpoint(&hub.endpoint).map_err(|why| HubError::model(id, format!("HF_ENDPOINT `{}`: {why}", hub.endpoint)))
}

/// `endpoint` with `segments` appended, each percent-encoded as one segment (a `/` inside a
/// revision becomes `%2F`).
pub(crate) fn join(endpoint: &Url, segments: &[&str]) -> Url {
    let mut url = endpoint.clone();
    if let Ok(mut path) = url.path_segments_mut() {
        path.pop_if_empty().extend(segments);
    }
    url
}

/// `{endpoint}/{datasets/}{repo}/resolve/{commit}/{file}`, the file's segments kept as segments.
pub(crate) fn resolve_url(endpoint: &Url, id: &HubId, commit: &str, file: &str) -> Url {
    let mut segments: Vec<&str> = Vec::new();
    if id.kind == crate::RepoKind::Dataset {
        segments.push("datasets");
    }
    segments.extend(id.repo.split('/'));
    segments.extend(["resolve", commit]);
    segments.extend(file.split('/'));
    join(endpoint, &segments)
}

/// Whether `url` has the origin of `endpoint`: the same scheme, host and port (the default port
/// of the scheme when none is written), compared as parsed. A string prefix is not an origin:
/// `http://127.0.0.1:18921` starts with `http://127.0.0.1:1892`, and
/// `https://huggingface.co.evil.net` with `https://huggingface.co`.
pub fn same_origin(endpoint: &Url, url: &Url) -> bool {
    endpoint.scheme() == url.scheme()
        && endpoint.host_str().map(str::to_ascii_lowercase) == url.host_str().map(str::to_ascii_lowercase)
        && endpoint.port_or_known_default() == url.port_or_known_default()
}

/// `req` with the token when `url` is on the endpoint's origin: like `huggingface_hub`, the token
/// never follows a redirect to another host (the CDN, or anyone a redirect names).
pub(crate) fn authorized(hub: &Hub, endpoint: &Url, url: &Url, req: RequestBuilder) -> RequestBuilder {
    match &hub.token {
        Some(t) if same_origin(endpoint, url) && url.username().is_empty() && url.password().is_none() => {
            req.header(AUTHORIZATION, format!("Bearer {t}"))
        }
        _ => req,
    }
}

/// The blocking client: redirects are not followed (each hop is looked at, see [`authorized`]),
/// `read_timeout` bounds the wait for a response's head and for each read of its body, and the
/// caller bounds the whole transfer with a deadline.
pub(crate) fn client(read_timeout: Duration) -> std::result::Result<Client, String> {
    Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(read_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())
}

/// Why a body could not be read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// The connection failed (or a read timed out).
    Io(String),
    /// More than the limit.
    TooLarge(u64),
    /// The deadline passed.
    Deadline,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::Io(e) => write!(f, "{e}"),
            BodyError::TooLarge(limit) => write!(f, "the answer is larger than {limit} bytes"),
            BodyError::Deadline => write!(f, "the answer did not arrive before its deadline"),
        }
    }
}

/// Reads `r`'s body into `out` (through `sink`) until it ends, `limit` bytes are exceeded or
/// `deadline` passes (checked after every read: a server that trickles a byte at a time cannot
/// hold the client beyond the deadline plus one read timeout).
pub(crate) fn read_body(
    r: &mut Response,
    limit: u64,
    deadline: Instant,
    mut sink: impl FnMut(&[u8]) -> std::result::Result<(), String>,
) -> std::result::Result<u64, BodyError> {
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        if Instant::now() >= deadline {
            return Err(BodyError::Deadline);
        }
        let n = r.read(&mut buf).map_err(|e| BodyError::Io(e.to_string()))?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
        if total > limit {
            return Err(BodyError::TooLarge(limit));
        }
        sink(&buf[..n]).map_err(BodyError::Io)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    #[test]
    fn origins_are_compared_as_parsed() {
        let local = url("http://127.0.0.1:1892");
        assert!(same_origin(&local, &url("http://127.0.0.1:1892/cdn/x")));
        assert!(!same_origin(&local, &url("http://127.0.0.1:18921/cdn/x")));
        assert!(!same_origin(&local, &url("http://127.0.0.1:1892@127.0.0.2:1892/x")));
        assert!(!same_origin(&local, &url("https://127.0.0.1:1892/x")));
        let hf = url("https://huggingface.co");
        assert!(same_origin(&hf, &url("https://huggingface.co:443/api")));
        assert!(same_origin(&hf, &url("https://HuggingFace.co/x")));
        assert!(!same_origin(&hf, &url("https://huggingface.co.evil.net/x")));
        assert!(!same_origin(&hf, &url("https://cdn-lfs.huggingface.co/x")));
    }

    #[test]
    fn segments_are_encoded() {
        let e = url("https://hub.example/mirror/");
        let u = join(&e, &["api", "models", "org", "name", "revision", "refs/pr/1"]);
        assert_eq!(u.as_str(), "https://hub.example/mirror/api/models/org/name/revision/refs%2Fpr%2F1");
        let id = HubId { repo: "o/n".into(), revision: "main".into(), kind: crate::RepoKind::Dataset };
        let u = resolve_url(&url("http://h:1"), &id, "abc", "main/train 1#.parquet");
        assert_eq!(u.as_str(), "http://h:1/datasets/o/n/resolve/abc/main/train%201%23.parquet");
    }
}
