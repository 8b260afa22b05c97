//! Shared helpers for the end-to-end tests: fixture paths, the built `rlhf` binary, the Python
//! interpreter that has transformers (set by `cargo xtask test` as `RLHF_PYTHON`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub mod golden;

/// `integration-tests/fixtures`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A committed tiny model, e.g. `model_dir("llama")`.
pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

/// The workspace's `rlhf` binary next to this test executable (built by `cargo xtask test`).
pub fn rlhf_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/rlhf
    let bin = exe.parent().and_then(Path::parent).expect("target dir").join("rlhf");
    assert!(bin.exists(), "{} not built: run `cargo xtask test` (it builds every target first)", bin.display());
    bin
}

/// Copies directory `from` into `to`, recursively (a run directory as it was at some point).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Runs `rlhf` with arguments.
pub fn rlhf(args: &[&str]) -> Output {
    Command::new(rlhf_bin()).args(args).output().expect("spawn rlhf")
}

/// The Python with transformers, or `None` outside CI when it is not configured (the test then
/// returns early with a message). Under CI a missing interpreter is a failure, never a skip.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("RLHF_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            panic!("RLHF_PYTHON is not set under CI: run the tests through `cargo xtask test`")
        }
        None => {
            eprintln!("RLHF_PYTHON not set: skipping a transformers cross-check (use `cargo xtask test`)");
            None
        }
    }
}

/// Runs `fixtures/hf_check.py` and parses its one JSON line.
pub fn hf_check(python: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(python)
        .arg(fixtures().join("hf_check.py"))
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("spawn python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "hf_check.py {args:?} failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("hf_check.py prints JSON")
}

/// Checks `model`'s 8 greedy tokens against transformers' references in `r` (`greedy_ids` for
/// the left-padded batch `input_ids`/`attention_mask`, `greedy_single` for its first prompt
/// alone), as `make_fixtures.py` records them. transformers pads finished rows to the common length
/// with the pad id; so do we, but we may stop earlier when every row has finished.
pub fn assert_greedy_matches(
    name: &str,
    model: &rlhf_models::CausalLm,
    tok: &rlhf_tokenizer::HfTokenizer,
    r: &std::collections::HashMap<String, tch::Tensor>,
) {
    use tch::{Device, Kind, Tensor};
    let eos: Vec<i64> = tok.eos_token_ids().iter().map(|&i| i64::from(i)).collect();
    let cfg = rlhf_generation::GenerateConfig::greedy(8, eos, i64::from(tok.pad_token_id()));
    let single_len = r["greedy_single"].size()[1] - 8;
    let cases = [
        (r["input_ids"].shallow_clone(), r["attention_mask"].shallow_clone(), &r["greedy_ids"]),
        (
            r["greedy_single"].narrow(1, 0, single_len),
            Tensor::ones([1, single_len], (Kind::Int64, Device::Cpu)),
            &r["greedy_single"],
        ),
    ];
    for (ids, mask, expected) in cases {
        let out = rlhf_generation::generate(model, &ids, &mask, &cfg).unwrap();
        let (width, have) = (expected.size()[1], out.sequences.size()[1]);
        let ours = if have < width {
            let pad = Tensor::full([ids.size()[0], width - have], cfg.pad_token_id, (Kind::Int64, Device::Cpu));
            Tensor::cat(&[&out.sequences, &pad], 1)
        } else {
            out.sequences.shallow_clone()
        };
        let rows = |t: &Tensor| rlhf_generation::batch::to_rows(t).unwrap();
        assert_eq!(rows(&ours), rows(expected), "{name}: greedy tokens differ");
    }
}

/// Tiny random checkpoints of the newer families with their transformers references
/// (`fixtures/make_families.py`), made once per test process into a temporary directory:
/// `<dir>/<name>` (causal LM) and `<dir>/<name>-rm` (scalar head) for each of [`FAMILIES`].
pub fn family_models(python: &Path) -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::Builder::new().prefix("rlhf-families-").tempdir().expect("temp dir").keep();
        let out = Command::new(python)
            .arg(fixtures().join("make_families.py"))
            .arg("--out")
            .arg(&dir)
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .expect("spawn python");
        assert!(out.status.success(), "make_families.py failed: {}", String::from_utf8_lossy(&out.stderr));
        dir
    })
}

/// The families `fixtures/make_families.py` makes (those transformers has a classifier for with a
/// `-rm` scalar-head model beside).
pub const FAMILIES: &[&str] = &[
    "qwen3",
    "qwen3_moe",
    "qwen3_moe-step",
    "gemma2",
    "gemma3",
    "olmo2",
    "phi3",
    "mistral",
    "qwen2-sliding",
    "olmo3",
    "qwen3_5",
    "qwen3_5-vl",
    "qwen3_5_moe",
    "qwen3_5_moe-vl",
    "gpt_oss",
    "qwen3_next",
    "gemma4",
    "gemma4-vl",
    "gemma4-moe",
];

/// Reads the JSON file at `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json")
}

/// A TCP port nobody listens on right now, below the OS's ephemeral range, as `rlhf train
/// --nproc` picks its rendezvous port ([`rlhf_collective::free_port`]).
pub fn free_port() -> u16 {
    rlhf_collective::free_port().expect("a free port on 127.0.0.1")
}

/// Whether a metric measures the machine (time, memory), not the training: runs that train the
/// same differ only there.
pub fn is_measurement(key: &str) -> bool {
    ["timestamp", "step_time", "tokens_per_s"].contains(&key) || key.starts_with("time/") || key.starts_with("mem/")
}

/// `metrics.jsonl` of a run, one JSON object per step.
pub fn metrics(run: &Path) -> Vec<serde_json::Value> {
    let path = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display()))).collect()
}

/// [`metrics`] as maps, without [`is_measurement`] keys.
pub fn behaviour_metrics(run: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    metrics(run)
        .into_iter()
        .map(|v| {
            let mut m = match v {
                serde_json::Value::Object(m) => m,
                other => panic!("{}: a metrics line is not an object: {other}", run.display()),
            };
            m.retain(|k, _| !is_measurement(k));
            m
        })
        .collect()
}

/// A child started as the leader of its own process group (a server that starts workers of its
/// own, such as vLLM's engine core and its multiprocessing helpers): [`ProcessGroup::stop`]
/// and dropping end the whole group — SIGTERM, then SIGKILL to whatever is left after a grace
/// period — on success, failure and panic alike.
pub struct ProcessGroup {
    pub child: std::process::Child,
}

impl ProcessGroup {
    /// Spawns `cmd` in a new process group whose id is the child's pid.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<ProcessGroup> {
        use std::os::unix::process::CommandExt;
        Ok(ProcessGroup { child: cmd.process_group(0).spawn()? })
    }

    /// The group's id (the leader's pid).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Pids of the group's processes still alive.
    pub fn members(&self) -> Vec<u32> {
        group_members(self.id())
    }

    /// Ends every process of the group and reaps the leader, waiting up to 20 s after SIGTERM.
    pub fn stop(&mut self) {
        self.stop_within(std::time::Duration::from_secs(20));
    }

    /// [`ProcessGroup::stop`] with `grace` between SIGTERM and SIGKILL.
    pub fn stop_within(&mut self, grace: std::time::Duration) {
        let group = format!("-{}", self.id());
        let signal = |sig: &str| {
            let _ = Command::new("kill").args([sig, "--", &group]).stderr(std::process::Stdio::null()).status();
        };
        signal("-TERM");
        let deadline = std::time::Instant::now() + grace;
        loop {
            let _ = self.child.try_wait();
            if self.members().is_empty() || std::time::Instant::now() > deadline {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        signal("-KILL");
        let _ = self.child.wait();
        // SIGKILL is delivered asynchronously: wait (briefly) until the kernel has ended every
        // member, so that a caller checking the group right after sees none.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.members().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Pids of the live processes of process group `id` (from `/proc/<pid>/stat`, whose 5th field is
/// the group; zombies do not count).
pub fn group_members(id: u32) -> Vec<u32> {
    let group = id.to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            // `pid (comm) state ppid pgrp ...`; comm may hold spaces, so split after the `)`.
            let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
            fields.first().is_some_and(|s| *s != "Z") && fields.get(2) == Some(&group.as_str())
        })
        .collect()
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The tiny random Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 of `fixtures/make_vl3.py` (`qwen3_vl/`,
/// `qwen3_vl_moe/`, `qwen3_5/`) with transformers' reference outputs, made once per test process
/// (needs [`python`]).
pub fn vl3_fixture() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| made_by("make_vl3.py")).path()
}

/// The tiny random Qwen2.5-VL of `fixtures/make_vl.py` with its images, prompt rows and
/// transformers' reference outputs, made once per test process (needs [`python`]).
pub fn vl_fixture() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| made_by("make_vl.py")).path()
}

/// A mock vLLM server's answer to the probe while the trainer's canary version (a zero output
/// head, for a policy whose head is tied to its embeddings) is loaded from `weights_path`:
/// `-ln V` of that checkpoint, as a server with an untied head gives every token; `None` for
/// any other version.
pub fn canary_logprob(weights_path: &str) -> Option<f64> {
    if !weights_path.ends_with("/canary") {
        return None;
    }
    let text = std::fs::read_to_string(Path::new(weights_path).join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let vocab = config["vocab_size"].as_f64().or(config["text_config"]["vocab_size"].as_f64()).unwrap();
    Some(-vocab.ln())
}

/// Serves `app` on 127.0.0.1 at a free port from a background thread (a mock HTTP server for the
/// rest of the test process); returns its address.
pub fn serve_in_background(app: axum::Router) -> std::net::SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// A temporary directory filled by `fixtures/<script> --out DIR`.
fn made_by(script: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let python = python().expect("python with transformers");
    let out = Command::new(python)
        .arg(fixtures().join(script))
        .args(["--out", dir.path().to_str().unwrap()])
        .output()
        .expect("spawn python");
    assert!(out.status.success(), "{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    dir
}

/// `−Σ log p(target)` over the real tokens (the vision fixtures' loss for their gradients).
///
/// # Shapes
/// - `logits`: `[batch, seq, vocab]`; `targets`, `mask`: `[batch, seq]` → `[]`
pub fn token_loss(logits: &tch::Tensor, targets: &tch::Tensor, mask: &tch::Tensor) -> tch::Tensor {
    use tch::Kind;
    let logp = logits.log_softmax(-1, Kind::Float).gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1);
    -(logp * mask.to_kind(Kind::Float)).sum(Kind::Float)
}

/// The gradients of the parameters `names` of `vs` after `f` has backpropagated, from zero.
pub fn grads_after(vs: &tch::nn::VarStore, names: &[String], f: impl FnOnce()) -> Vec<tch::Tensor> {
    let vars = vs.variables();
    for t in vars.values() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    f();
    names.iter().map(|n| vars.get(n).unwrap_or_else(|| panic!("no parameter {n}")).grad().copy()).collect()
}

/// Largest difference of two `[batch, seq, vocab]` logits over the real (unpadded) tokens of `mask`.
pub fn logit_diff(ours: &tch::Tensor, theirs: &tch::Tensor, mask: &tch::Tensor) -> f64 {
    let real = mask.to_kind(tch::Kind::Bool).unsqueeze(-1);
    (ours - theirs).abs().masked_select(&real).max().double_value(&[])
}
