//! The Hub client against a hostile server on loopback: file names, shard names, revisions and
//! ETags that would lead outside the cache; redirects that would carry the token to another
//! origin (a port that merely starts with the endpoint's, a second loopback address); a Hub
//! answering 5xx for a cached model. After each, nothing exists outside the temporary cache and
//! the token reached the endpoint only.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{etag, tree, within, Reply, Request, Server};
use rlhf_hub::datasets::parse_dataset;
use rlhf_hub::{parse_id, Hub};
use serde_json::json;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_the_users_secret";
const WEIGHTS: &[u8] = b"not really safetensors, but bytes to store";

fn hub(endpoint: &str, cache: &Path) -> Hub {
    Hub {
        endpoint: endpoint.into(),
        token: Some(TOKEN.into()),
        cache: cache.into(),
        offline: false,
        file_timeout: None,
        read_timeout: std::time::Duration::from_secs(30),
    }
}

/// A repository listing `files` at [`COMMIT`].
fn listing(files: &[&str]) -> Reply {
    let siblings: Vec<_> = files.iter().map(|f| json!({ "rfilename": f })).collect();
    Reply::json(json!({ "sha": COMMIT, "siblings": siblings }))
}

/// A file's answer: its bytes with an ETag of them.
fn file(bytes: &[u8]) -> Reply {
    Reply::new(200).header("etag", format!("\"{}\"", etag(bytes))).body(bytes.to_vec())
}

/// The last path segment after `/resolve/<commit>/`, percent-decoding left to the test.
fn resolved(req: &Request) -> Option<String> {
    req.path.split_once(&format!("/resolve/{COMMIT}/")).map(|(_, f)| f.to_string())
}

/// A temporary directory holding the cache as `cache/`; what else it holds afterwards was written
/// outside the cache.
fn workspace() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    (tmp, cache)
}

fn only_the_cache(tmp: &Path) {
    let outside: Vec<String> = tree(tmp).into_iter().filter(|p| !p.starts_with("cache")).collect();
    assert!(outside.is_empty(), "written outside the cache: {outside:?}");
}

/// An index whose `weight_map` names an absolute path, or a `..` path, is refused naming the
/// repository and the name; no link is made there.
#[test]
fn shard_names_from_the_index_never_leave_the_cache() {
    let (tmp, _) = workspace();
    let absolute = tmp.path().join("victim_abs.safetensors").display().to_string();
    let shards = [absolute.as_str(), "../../../../victim.safetensors", "a//b.safetensors", "sub\\x.safetensors"];
    for (n, shard) in shards.into_iter().enumerate() {
        // A cache of its own: a cached index would be read instead of the served one.
        let cache = tmp.path().join(format!("cache{n}"));
        let index = json!({ "weight_map": { "model.embed_tokens.weight": shard } }).to_string();
        let server = Server::start("127.0.0.1", move |req| {
            if req.path.starts_with("/api/") {
                return listing(&["config.json", "model.safetensors.index.json"]);
            }
            match resolved(req).as_deref() {
                Some("config.json") => file(b"{}"),
                Some("model.safetensors.index.json") => file(index.as_bytes()),
                // Whatever else is asked for, the hostile server serves.
                _ => file(WEIGHTS),
            }
        });
        let id = parse_id("org/tiny").unwrap();
        let h = hub(&server.url(), &cache);
        let e = within(60, move || h.model(&id)).unwrap_err().to_string();
        assert!(e.starts_with("model `org/tiny`: ") && e.contains(&format!("`{shard}`")), "{e}");
        assert!(!e.contains('\n'), "{e}");
        only_the_cache(tmp.path());
    }
}

/// A dataset listing with unsafe names is refused as a whole, naming the dataset and the name.
#[test]
fn dataset_file_names_from_the_listing_never_leave_the_cache() {
    let (tmp, cache) = workspace();
    let absolute = format!("{}/train-0.parquet", tmp.path().display());
    for name in [absolute.as_str(), "../../../../../train-0.parquet", "data//train-0.parquet", "data\\train-0.parquet"]
    {
        let listed = name.to_string();
        let server = Server::start("127.0.0.1", move |req| {
            if req.path.starts_with("/api/") {
                return listing(&[listed.as_str(), "README.md"]);
            }
            file(b"PAR1 hostile PAR1")
        });
        let spec = parse_dataset("org/data:train").unwrap();
        let h = hub(&server.url(), &cache);
        let e = within(60, move || h.dataset(&spec)).unwrap_err().to_string();
        assert!(e.starts_with("dataset `org/data`: ") && e.contains(&format!("`{name}`")), "{e}");
        assert!(server.requests().iter().all(|r| r.path.starts_with("/api/")), "a file was requested");
        only_the_cache(tmp.path());
    }
}

/// A revision that climbs out of `refs/` is refused before any request; a revision with `/`
/// (`refs/pr/1`) is one URL segment (`%2F`) and its ref lies inside `refs/`.
#[test]
fn revisions_are_validated_and_encoded() {
    let (tmp, cache) = workspace();
    let server = Server::start("127.0.0.1", move |req| {
        if req.path.starts_with("/api/") {
            return listing(&["config.json", "model.safetensors"]);
        }
        match resolved(req).as_deref() {
            Some("config.json") => file(b"{}"),
            _ => file(WEIGHTS),
        }
    });
    for bad in ["../../../victim", "../../../../tmp/victim", "main/../../x", "x.lock", ".hidden", "a:b"] {
        let id = parse_id(&format!("org/tiny@{bad}")).expect("shaped like an id");
        let h = hub(&server.url(), &cache);
        let e = within(60, move || h.model(&id)).unwrap_err().to_string();
        assert!(e.contains(&format!("revision `{bad}` is not a valid git revision")), "{e}");
    }
    assert!(server.requests().is_empty(), "a refused revision reached the server");
    only_the_cache(tmp.path());

    let id = parse_id("org/tiny@refs/pr/1").unwrap();
    let h = hub(&server.url(), &cache);
    let dir = within(60, move || h.model(&id)).unwrap();
    assert!(dir.join("model.safetensors").is_file());
    let api: Vec<String> = server.requests().into_iter().map(|r| r.path).filter(|p| p.starts_with("/api/")).collect();
    assert_eq!(api, ["/api/models/org/tiny/revision/refs%2Fpr%2F1"]);
    let refs = cache.join("models--org--tiny/refs/refs/pr/1");
    assert_eq!(std::fs::read_to_string(refs).unwrap(), COMMIT);
    only_the_cache(tmp.path());
}

/// An ETag of `..` or `.` cannot name a blob.
#[test]
fn etags_that_are_not_one_name_are_refused() {
    let (tmp, cache) = workspace();
    for bad in ["..", ".", "a/../../x"] {
        let tag = bad.to_string();
        let server = Server::start("127.0.0.1", move |req| {
            if req.path.starts_with("/api/") {
                return listing(&["config.json", "model.safetensors"]);
            }
            Reply::new(200).header("etag", format!("\"{tag}\"")).body(WEIGHTS.to_vec())
        });
        let h = hub(&server.url(), &cache);
        let id = parse_id("org/tiny").unwrap();
        let e = within(60, move || h.model(&id)).unwrap_err().to_string();
        assert!(e.starts_with("model `org/tiny`: config.json") && e.contains(&format!("ETag `{bad}`")), "{e}");
        only_the_cache(tmp.path());
    }
}

/// A Hub redirecting the weights to `target(blob)`.
fn redirecting(target: impl Fn(&str) -> String + Send + Sync + 'static) -> impl Fn(&Request) -> Reply {
    move |req: &Request| {
        if req.path.starts_with("/api/") {
            return listing(&["config.json", "model.safetensors"]);
        }
        match resolved(req).as_deref() {
            Some("config.json") => file(b"{}"),
            Some("model.safetensors") => Reply::new(302)
                .header("location", target(&etag(WEIGHTS)))
                .header("x-linked-etag", format!("\"{}\"", etag(WEIGHTS)))
                .header("x-linked-size", WEIGHTS.len()),
            _ => Reply::new(404),
        }
    }
}

/// The CDN: serves the weights by ETag to anyone.
fn cdn(req: &Request) -> Reply {
    if req.path.ends_with(&etag(WEIGHTS)) {
        Reply::new(200).body(WEIGHTS.to_vec())
    } else {
        Reply::new(404)
    }
}

fn carried_the_token(server: &Server) -> Vec<Request> {
    server.requests().into_iter().filter(|r| r.authorization.as_deref().is_some_and(|a| a.contains(TOKEN))).collect()
}

/// Listeners on 127.0.0.1 whose ports read `P` and `P` followed by a digit: `http://127.0.0.1:P`
/// is a string prefix of `http://127.0.0.1:PD/...`.
fn prefix_ports() -> (std::net::TcpListener, std::net::TcpListener) {
    for _ in 0..50 {
        let long = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let short_port = long.local_addr().unwrap().port() / 10;
        if let Ok(short) = std::net::TcpListener::bind(("127.0.0.1", short_port)) {
            return (short, long);
        }
    }
    panic!("no free pair of ports P, P*10+d on 127.0.0.1");
}

/// The token goes to the endpoint's origin only: not to a port that starts with the endpoint's,
/// not to a second loopback address (named directly or behind the endpoint's text as user
/// info), while the endpoint itself receives it.
#[test]
fn the_token_goes_to_the_endpoints_origin_only() {
    let (short, long) = prefix_ports();
    let other = Server::on(long, cdn);
    let other_url = other.url();
    let endpoint = Server::on(short, redirecting(move |tag| format!("{other_url}/cdn/{tag}")));
    assert!(other.url().starts_with(&endpoint.url()), "{} {}", other.url(), endpoint.url());
    let (tmp, cache) = workspace();
    let h = hub(&endpoint.url(), &cache);
    let id = parse_id("org/tiny").unwrap();
    let dir = within(60, move || h.model(&id)).unwrap();
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), WEIGHTS);
    assert!(carried_the_token(&other).is_empty(), "the token went to {}: {:?}", other.url(), other.requests());
    assert!(!carried_the_token(&endpoint).is_empty(), "the endpoint itself never got the token");
    only_the_cache(tmp.path());

    let far = Server::start("127.0.0.2", cdn);
    for n in 0..2 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let own = format!("http://{}", listener.local_addr().unwrap());
        // Another host, then the same one behind the endpoint's own text as user info.
        let target = if n == 0 { format!("{}/cdn/", far.url()) } else { format!("{own}@{}/cdn/", far.addr) };
        let endpoint = Server::on(listener, redirecting(move |tag| format!("{target}{tag}")));
        assert_eq!(endpoint.url(), own);
        let cache = tmp.path().join(format!("cache{n}"));
        let h = hub(&endpoint.url(), &cache);
        let id = parse_id("org/tiny").unwrap();
        let dir = within(60, move || h.model(&id)).unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), WEIGHTS);
    }
    assert_eq!(far.requests().len(), 2, "{:?}", far.requests());
    assert!(carried_the_token(&far).is_empty(), "the token went to {}: {:?}", far.url(), far.requests());
}

/// A Hub answering 5xx for a model that is cached: the cached snapshot, as huggingface_hub does;
/// one that is not cached: an error naming the status.
#[test]
fn a_hub_answering_5xx_falls_back_to_the_cache() {
    let broken = Arc::new(AtomicBool::new(false));
    let b = broken.clone();
    let server = Server::start("127.0.0.1", move |req| {
        if b.load(Ordering::SeqCst) {
            return Reply::new(503);
        }
        if req.path.starts_with("/api/") {
            return listing(&["config.json", "model.safetensors"]);
        }
        match resolved(req).as_deref() {
            Some("config.json") => file(b"{}"),
            _ => file(WEIGHTS),
        }
    });
    let (_tmp, cache) = workspace();
    let h = hub(&server.url(), &cache);
    let first = within(60, {
        let h = h.clone();
        move || h.model(&parse_id("org/tiny").unwrap())
    })
    .unwrap();
    broken.store(true, Ordering::SeqCst);
    let again = within(60, {
        let h = h.clone();
        move || h.model(&parse_id("org/tiny").unwrap())
    })
    .unwrap();
    assert_eq!(first, again);
    let e = within(60, move || h.model(&parse_id("org/other").unwrap())).unwrap_err().to_string();
    assert!(e.starts_with("model `org/other`: ") && e.contains("HTTP 503"), "{e}");
}
