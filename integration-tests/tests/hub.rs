//! Models by Hugging Face Hub id through the real `rlhf` binary against a loopback mock of the
//! Hub's HTTP API (`/api/models/{repo}/revision/{rev}`, `HEAD`/`GET /{repo}/resolve/{commit}/{file}`
//! with a redirect to a CDN path for weights, `Range` requests), serving the committed fixture
//! models: download into the cache layout transformers reads, a cache hit with the network gone,
//! `HF_HUB_OFFLINE`, 401 / 403 / 404, a revision, an interrupted download resumed, two processes
//! at once, and a local directory that wins over an id.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use axum::Router;
use rlhf_integration_tests::{model_dir, rlhf_bin};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const COMMIT_V1: &str = "89abcdef0123456789abcdef0123456789abcdef";
const TOKEN: &str = "hf_secret_token";

struct Repo {
    files: HashMap<String, Vec<u8>>,
}

struct Shared {
    repos: HashMap<String, Repo>,
    /// Requests per path (GETs of CDN blobs and API calls).
    hits: Mutex<HashMap<String, usize>>,
    ranges: AtomicUsize,
    /// Break the first GET of each blob half way.
    interrupt: bool,
}

struct Hub {
    runtime: Option<tokio::runtime::Runtime>,
    url: String,
    shared: Arc<Shared>,
}

fn etag(bytes: &[u8]) -> String {
    // A content hash stands in for the sha256 the Hub sends for LFS files.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}{:08x}", bytes.len())
}

fn read_dir(dir: &Path) -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && !p.to_string_lossy().contains("reference"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()))
        .collect()
}

impl Hub {
    fn start(interrupt: bool) -> Hub {
        let mut repos = HashMap::new();
        for (id, fixture) in
            [("org/llama", "llama"), ("private/llama", "llama"), ("gated/llama", "llama"), ("org/tied", "llama-tied")]
        {
            repos.insert(id.to_string(), Repo { files: read_dir(&model_dir(fixture)) });
        }
        // A dataset in `datasets`' Parquet layout: a subset per directory, a split per file name.
        let prompts = std::fs::read(rlhf_integration_tests::fixtures().join("prompts.parquet")).unwrap();
        let files = [
            "main/train-00000-of-00001.parquet",
            "main/test-00000-of-00001.parquet",
            "other/train-00000-of-00001.parquet",
        ]
        .iter()
        .map(|f| (f.to_string(), prompts.clone()))
        .chain([("README.md".to_string(), b"# arith".to_vec())])
        .collect();
        repos.insert("datasets:ds-org/arith".into(), Repo { files });
        let shared = Arc::new(Shared { repos, hits: Mutex::default(), ranges: AtomicUsize::new(0), interrupt });
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new().fallback(handle).with_state(Arc::clone(&shared));
        runtime.spawn(async move { axum::serve(listener, app).await });
        Hub { runtime: Some(runtime), url, shared }
    }

    fn hits(&self, prefix: &str) -> usize {
        self.shared.hits.lock().unwrap().iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, v)| v).sum()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn reply(status: u16) -> axum::http::response::Builder {
    Response::builder().status(status)
}

fn error(status: u16, code: &str) -> Response {
    reply(status).header("x-error-code", code).body(Body::from("{}")).unwrap()
}

async fn handle(State(s): State<Arc<Shared>>, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let path = uri.path().to_string();
    *s.hits.lock().unwrap().entry(format!("{method} {path}")).or_default() += 1;
    let authorized = headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"));
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    // CDN blobs: /cdn/<etag>, no auth.
    if parts.len() == 2 && parts[0] == "cdn" {
        let body = s.repos.values().flat_map(|r| r.files.values()).find(|b| etag(b) == parts[1]).cloned();
        let Some(body) = body else { return error(404, "EntryNotFound") };
        let range = headers.get("range").and_then(|v| v.to_str().ok()).and_then(|r| r.strip_prefix("bytes="));
        if let Some(from) = range.and_then(|r| r.trim_end_matches('-').parse::<usize>().ok()) {
            s.ranges.fetch_add(1, Ordering::SeqCst);
            return reply(206)
                .header("content-length", body.len() - from)
                .body(Body::from(body[from..].to_vec()))
                .unwrap();
        }
        let first = s.hits.lock().unwrap().get(&format!("{method} {path}")) == Some(&1);
        if s.interrupt && first && method == Method::GET {
            // Half the body, a pause (the client reads it), then the connection breaks.
            let half = body[..body.len() / 2].to_vec();
            let stream = futures_util::stream::unfold(0, move |state| {
                let half = half.clone();
                async move {
                    match state {
                        0 => Some((Ok(half), 1)),
                        1 => {
                            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                            Some((Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "cut")), 2))
                        }
                        _ => None,
                    }
                }
            });
            return reply(200).header("content-length", body.len()).body(Body::from_stream(stream)).unwrap();
        }
        return reply(200).header("content-length", body.len()).body(Body::from(body)).unwrap();
    }
    let (repo_id, rest) = if parts.first() == Some(&"api") && parts.len() >= 6 && parts[1] == "models" {
        (format!("{}/{}", parts[2], parts[3]), parts[4..].to_vec())
    } else if parts.first() == Some(&"api") && parts.len() >= 6 && parts[1] == "datasets" {
        (format!("datasets:{}/{}", parts[2], parts[3]), parts[4..].to_vec())
    } else if parts.len() >= 6 && parts[0] == "datasets" && parts[3] == "resolve" {
        (format!("datasets:{}/{}", parts[1], parts[2]), parts[3..].to_vec())
    } else if parts.len() >= 5 && parts[2] == "resolve" {
        (format!("{}/{}", parts[0], parts[1]), parts[2..].to_vec())
    } else {
        return error(404, "RepoNotFound");
    };
    let Some(repo) = s.repos.get(&repo_id) else { return error(401, "RepoNotFound") };
    if repo_id.starts_with("private/") && !authorized {
        return error(401, "RepoNotFound");
    }
    if repo_id.starts_with("gated/") {
        return error(403, "GatedRepo");
    }
    match rest.as_slice() {
        ["revision", rev] => {
            let sha = match *rev {
                "main" | COMMIT => COMMIT,
                "v1" | COMMIT_V1 => COMMIT_V1,
                _ => return error(404, "RevisionNotFound"),
            };
            let siblings: Vec<_> = repo.files.keys().map(|f| serde_json::json!({ "rfilename": f })).collect();
            let body = serde_json::json!({ "id": repo_id, "sha": sha, "siblings": siblings });
            reply(200).header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()
        }
        ["resolve", _commit, file @ ..] => {
            let file = file.join("/");
            let Some(bytes) = repo.files.get(&file) else { return error(404, "EntryNotFound") };
            let tag = etag(bytes);
            if file.ends_with(".safetensors") {
                // Weights live on the CDN: a redirect with the linked etag and size.
                return reply(302)
                    .header("location", format!("/cdn/{tag}"))
                    .header("x-linked-etag", format!("\"{tag}\""))
                    .header("x-linked-size", bytes.len())
                    .body(Body::empty())
                    .unwrap();
            }
            let body = if method == Method::HEAD { Body::empty() } else { Body::from(bytes.clone()) };
            reply(200).header("etag", format!("\"{tag}\"")).header("content-length", bytes.len()).body(body).unwrap()
        }
        _ => error(404, "EntryNotFound"),
    }
}

/// `rlhf generate --model <model>` with the Hub at `endpoint` and the cache at `cache`.
fn generate(model: &str, endpoint: &str, cache: &Path, env: &[(&str, &str)], cwd: Option<&Path>) -> Output {
    let mut c = Command::new(rlhf_bin());
    c.args(["generate", "--model", model, "--prompt", "Tom has", "--max-new-tokens", "2", "--no-progress"])
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HUB_CACHE", cache)
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_HOME", cache.join("home"));
    for (k, v) in env {
        c.env(k, v);
    }
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    c.output().expect("spawn rlhf")
}

fn ok(o: &Output) {
    assert!(o.status.success(), "rlhf failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// The last line of stderr of a failed run (its one-line error).
fn failure(o: &Output) -> String {
    assert!(!o.status.success(), "rlhf should fail: {}", String::from_utf8_lossy(&o.stdout));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!err.contains("panicked") && !err.contains("stack backtrace"), "{err}");
    err.lines().last().unwrap_or("").to_string()
}

fn snapshot(cache: &Path, repo: &str, commit: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--"))).join("snapshots").join(commit)
}

#[test]
fn downloads_into_the_cache_and_serves_it_again_without_the_network() {
    let hub = Hub::start(false);
    let cache = tempfile::tempdir().unwrap();
    ok(&generate("org/llama", &hub.url, cache.path(), &[], None));
    let snap = snapshot(cache.path(), "org/llama", COMMIT);
    for f in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"] {
        let link = snap.join(f);
        assert!(link.is_symlink(), "{f} is not a link into blobs/");
        assert_eq!(std::fs::read(&link).unwrap(), std::fs::read(model_dir("llama").join(f)).unwrap(), "{f}");
    }
    assert!(!snap.join("reference.json").exists(), "only what loading needs is fetched");
    let refs = cache.path().join("models--org--llama/refs/main");
    assert_eq!(std::fs::read_to_string(refs).unwrap(), COMMIT);
    // A second run: one API call, no file downloaded again.
    let blobs = hub.hits("GET /cdn/");
    ok(&generate("org/llama", &hub.url, cache.path(), &[], None));
    assert_eq!(hub.hits("GET /cdn/"), blobs);
    // The network gone: the cached snapshot, with a warning.
    let dead = format!("http://127.0.0.1:{}", rlhf_integration_tests::free_port());
    let o = generate("org/llama", &dead, cache.path(), &[], None);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unreachable"));
    // Offline: the cache only, not one request.
    let before = hub.hits("");
    ok(&generate("org/llama", &hub.url, cache.path(), &[("HF_HUB_OFFLINE", "1")], None));
    assert_eq!(hub.hits(""), before);
}

#[test]
fn offline_misses_and_hub_refusals_are_one_line_errors_naming_the_id() {
    let hub = Hub::start(false);
    let cache = tempfile::tempdir().unwrap();
    let e = failure(&generate("org/llama", &hub.url, cache.path(), &[("HF_HUB_OFFLINE", "1")], None));
    assert!(e.contains("model `org/llama`") && e.contains("HF_HUB_OFFLINE"), "{e}");
    let e = failure(&generate("private/llama", &hub.url, cache.path(), &[], None));
    assert!(e.contains("model `private/llama`") && e.contains("HTTP 401") && e.contains("HF_TOKEN"), "{e}");
    ok(&generate("private/llama", &hub.url, cache.path(), &[("HF_TOKEN", TOKEN)], None));
    let e = failure(&generate("gated/llama", &hub.url, cache.path(), &[("HF_TOKEN", TOKEN)], None));
    assert!(e.contains("model `gated/llama`") && e.contains("HTTP 403"), "{e}");
    let e = failure(&generate("org/nothing", &hub.url, cache.path(), &[], None));
    assert!(e.contains("model `org/nothing`") && e.contains("not found"), "{e}");
    let e = failure(&generate("org/llama@nope", &hub.url, cache.path(), &[], None));
    assert!(e.contains("model `org/llama@nope`") && e.contains("revision `nope` not found"), "{e}");
    // A revision: its own snapshot and ref.
    ok(&generate("org/llama@v1", &hub.url, cache.path(), &[], None));
    assert!(snapshot(cache.path(), "org/llama", COMMIT_V1).join("config.json").is_file());
    assert_eq!(std::fs::read_to_string(cache.path().join("models--org--llama/refs/v1")).unwrap(), COMMIT_V1);
}

#[test]
fn an_interrupted_download_resumes_and_two_processes_share_one_download() {
    let hub = Hub::start(true);
    let cache = tempfile::tempdir().unwrap();
    let spawn = || {
        let mut c = Command::new(rlhf_bin());
        c.args(["generate", "--model", "org/tied", "--prompt", "Tom has", "--max-new-tokens", "2", "--no-progress"])
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HUB_CACHE", cache.path())
            .env("HF_HOME", cache.path().join("home"))
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_OFFLINE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c.spawn().unwrap()
    };
    let (a, b) = (spawn(), spawn());
    for child in [a, b] {
        ok(&child.wait_with_output().unwrap());
    }
    // Every shard was cut half way once, then fetched with a Range request; one process
    // downloaded while the other waited on the lock and found the files.
    let shards = std::fs::read_dir(model_dir("llama-tied"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "safetensors"))
        .filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with("reference"))
        .count();
    assert_eq!(hub.shared.ranges.load(Ordering::SeqCst), shards, "one resumed request per shard");
    assert_eq!(hub.hits("GET /cdn/"), 2 * shards, "each shard fetched once, plus its resume");
    let snap = snapshot(cache.path(), "org/tied", COMMIT);
    for e in std::fs::read_dir(&snap).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_owned();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(model_dir("llama-tied").join(&name)).unwrap());
    }
}

#[test]
fn a_local_directory_wins_over_a_hub_id() {
    let hub = Hub::start(false);
    let cache = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    rlhf_integration_tests::copy_dir(&model_dir("llama"), &work.path().join("org").join("llama"));
    ok(&generate("org/llama", &hub.url, cache.path(), &[], Some(work.path())));
    assert_eq!(hub.hits(""), 0, "no request for an existing directory");
}

/// `model.actor` and `model.path` take ids too; a missing one is refused before the run directory
/// exists.
#[test]
fn training_phases_take_hub_ids() {
    let hub = Hub::start(false);
    let cache = tempfile::tempdir().unwrap();
    let runs = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(rlhf_bin())
            .args(args)
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HUB_CACHE", cache.path())
            .env("HF_HOME", cache.path().join("home"))
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_OFFLINE")
            .output()
            .unwrap()
    };
    let rl = runs.path().join("rl");
    let rl_dir = rl.to_str().unwrap();
    let o = run(&["train", "--algo", "grpo", "--no-progress", "--run-dir", rl_dir, "--set", "model.actor=org/missing"]);
    let e = failure(&o);
    assert!(e.contains("model.actor: model `org/missing`"), "{e}");
    assert!(!rl.exists(), "a refused start created its run directory");
    let o = run(&[
        "train",
        "--algo",
        "grpo",
        "--no-progress",
        "--run-dir",
        rl_dir,
        "--set",
        "model.actor=org/llama",
        "--set",
        "train.steps=1",
        "--set",
        "rollout.max_new_tokens=4",
    ]);
    ok(&o);
    let sft = runs.path().join("sft");
    let o = run(&[
        "sft",
        "--no-progress",
        "--run-dir",
        sft.to_str().unwrap(),
        "--set",
        "model.path=org/tied",
        "--set",
        "train.steps=1",
        "--set",
        "data.max_len=64",
    ]);
    ok(&o);
    assert!(sft.join("model").join("config.json").is_file());
}

/// A dataset by Hub id (`org/name:subset:split`): its Parquet files are downloaded into the
/// cache layout `datasets` uses and read like local ones; the cache serves them offline; an
/// unknown split and an ambiguous subset are one-line errors naming the files or subsets.
#[test]
fn datasets_by_hub_id_are_downloaded_and_read_like_parquet() {
    let hub = Hub::start(false);
    let cache = tempfile::tempdir().unwrap();
    let runs = tempfile::tempdir().unwrap();
    let run = |rd: &str, data: &str, offline: bool| {
        let mut c = Command::new(rlhf_bin());
        c.args(["train", "--algo", "grpo", "--no-progress", "--run-dir", rd])
            .args(["--set", &format!("data.prompts=\"{data}\""), "--set", "data.prompt_key=\"question\""])
            .args(["--set", "data.label_key=\"answer\"", "--set", "train.steps=1", "--set", "eval.data=\"\""])
            .env("HF_ENDPOINT", &hub.url)
            .env("HF_HUB_CACHE", cache.path())
            .env("HF_HOME", cache.path().join("home"))
            .env_remove("HF_TOKEN");
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            c.env_remove("HF_HUB_OFFLINE");
        }
        c.output().unwrap()
    };
    let dir = |n: &str| runs.path().join(n).to_str().unwrap().to_string();
    ok(&run(&dir("a"), "ds-org/arith:main:train", false));
    let file =
        cache.path().join(format!("datasets--ds-org--arith/snapshots/{COMMIT}/main/train-00000-of-00001.parquet"));
    assert!(file.is_file(), "not in the cache layout: {}", file.display());
    assert_eq!(hub.hits("GET /datasets/ds-org/arith/resolve"), 1, "only the selected split is downloaded");
    ok(&run(&dir("b"), "ds-org/arith:main:train", true));
    let e = failure(&run(&dir("c"), "ds-org/arith:main:validation", false));
    assert!(e.contains("no Parquet file of split `validation` of subset `main`") && e.contains("main/test-"), "{e}");
    let e = failure(&run(&dir("d"), "ds-org/arith", false));
    assert!(e.contains("several subsets hold split `train` (main, other)"), "{e}");
    let e = failure(&run(&dir("e"), "ds-org/missing:train", false));
    assert!(e.contains("dataset `ds-org/missing`"), "{e}");
    assert!(
        !runs.path().join("c").exists() && !runs.path().join("e").exists(),
        "a refused start made its run directory"
    );
}
