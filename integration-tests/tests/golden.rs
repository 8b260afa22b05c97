//! Golden runs: the metrics (without timings) and the final weights of fixed-seed CPU runs of every
//! embedded RL preset, a PPO run through every optional path of the step (critic, several epochs
//! and minibatches, EMA, ptx), an SFT run and an RM run must equal the files recorded in
//! `integration-tests/golden/` bit for bit, so any refactor of the host that changes a number
//! fails here. The RL runs also run with `train.share_prompts = false` (`<name>-unshared.json`):
//! the path every pass took before prompt sharing existed, whose numbers the shared passes equal
//! only within float rounding.
//!
//! Re-record (only for an intended change of behaviour, said in the commit):
//! `RLHF_GOLDEN_RECORD=1 cargo xtask test --test golden`. That leaves the `-unshared` files, the
//! older reference, as they are; `RLHF_GOLDEN_RECORD=all` records them too, for a change of the
//! arithmetic itself. All were last recorded on 2026-11-24 under [`PINNED_ISA`], after the
//! `-unshared` runs were checked bit for bit against the commit before prompt sharing, built and
//! run on the same machine under the same pin.
//!
//! Each run uses one intra-op thread (`OMP_NUM_THREADS=1`): the reduction order of libtorch's CPU
//! kernels depends on the thread count. It also depends on the vector width the kernels are built
//! for, which libtorch, MKL and oneDNN each pick from the CPU at run time: the same binary summed
//! differently on an AVX-512 machine (Zen 4) and an AVX2 one (Zen 3), and a CI run on the other
//! kind failed every RL golden by one rounding. So every run is pinned to the AVX2 code paths
//! ([`PINNED_ISA`]), which every x86-64 CPU this project runs on has.

use std::path::{Path, PathBuf};
use std::process::Command;

use rlhf_integration_tests::{is_measurement, rlhf_bin};
use serde_json::{json, Value};

/// The environment that makes a CPU run sum in the same order on every x86-64 machine with AVX2:
/// libtorch's own kernels (`ATEN_CPU_CAPABILITY`, read by its CPU dispatch), MKL's BLAS in its
/// conditional-numerical-reproducibility mode (`MKL_CBWR`; `STRICT` also makes the result
/// independent of the operands' alignment), and oneDNN (`ONEDNN_MAX_CPU_ISA`).
const PINNED_ISA: [(&str, &str); 3] =
    [("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_CBWR", "AVX2,STRICT"), ("ONEDNN_MAX_CPU_ISA", "AVX2")];

/// FNV-1a of a file's bytes (the same hash the checkpoints use).
fn fnv(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Runs `rlhf ARGS --run-dir DIR` on one thread and returns (metrics rows without timings, hash of
/// the saved weights under `DIR/model_sub/model.safetensors`).
fn run(args: &[&str], model_sub: &str) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let o = Command::new(rlhf_bin())
        .args(args)
        .args(["--run-dir", run_dir.to_str().unwrap()])
        .env("OMP_NUM_THREADS", "1")
        .envs(PINNED_ISA)
        .env("RUST_LOG", "warn")
        .output()
        .expect("spawn rlhf");
    assert!(o.status.success(), "rlhf {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let rows: Vec<Value> = text
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().retain(|k, _| !is_measurement(k));
            v
        })
        .collect();
    json!({
        "args": args,
        "metrics": rows,
        "weights_fnv1a": fnv(&run_dir.join(model_sub).join("model.safetensors")),
    })
}

fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden").join(format!("{name}.json"))
}

/// Compares a run with its golden file (or records it, see the module docs): every metric
/// of every row bit for bit, no metric missing or new, and the same final weights.
fn compare_or_record(name: &str, got: Value) {
    let path = golden_path(name);
    let record = std::env::var("RLHF_GOLDEN_RECORD").unwrap_or_default();
    if record == "all" || (record == "1" && !name.ends_with("-unshared")) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        eprintln!("recorded {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (record with RLHF_GOLDEN_RECORD=1)", path.display()));
    let want: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(got["args"], want["args"], "{name}: the golden file was recorded with other arguments");
    let (got_rows, want_rows) = (got["metrics"].as_array().unwrap(), want["metrics"].as_array().unwrap());
    assert_eq!(got_rows.len(), want_rows.len(), "{name}: number of metrics rows");
    for (g, w) in got_rows.iter().zip(want_rows) {
        let step = &w["step"];
        let (g, w) = (g.as_object().unwrap(), w.as_object().unwrap());
        for (k, wv) in w {
            let gv = g.get(k).unwrap_or_else(|| panic!("{name}: step {step}: `{k}` is missing"));
            // Bit for bit: serde_json writes the shortest string that reads back to the same f64.
            assert_eq!(gv, wv, "{name}: step {step}: `{k}` changed");
        }
        for k in g.keys() {
            assert!(w.contains_key(k) || is_new_metric(k), "{name}: step {step}: new metric `{k}`");
        }
        // The host's own `kl`, no longer replaced by the plugin's, is its rollout estimate.
        if let (Some(kl), Some(rollout_kl)) = (g.get("kl"), w.get("rollout/kl")) {
            assert_eq!(kl, rollout_kl, "{name}: step {step}: the host's `kl` is not `rollout/kl`");
        }
    }
    assert_eq!(got["weights_fnv1a"], want["weights_fnv1a"], "{name}: the final weights changed");
}

fn check(name: &str, args: &[&str], model_sub: &str) {
    compare_or_record(name, run(args, model_sub));
}

/// Metrics added on purpose after the golden files were recorded.
fn is_new_metric(_key: &str) -> bool {
    false
}

/// The RL goldens run twice: as configured (each prompt's rows share one pass over it,
/// `train.share_prompts`), and with that off (`<name>-unshared`), the path of every pass before
/// prompt sharing existed.
fn check_rl(name: &str, args: &[&str]) {
    check(name, args, "actor");
    let mut unshared = args.to_vec();
    unshared.extend(["--set", "train.share_prompts=false"]);
    check(&format!("{name}-unshared"), &unshared, "actor");
}

#[test]
fn golden_grpo() {
    check_rl("grpo", &["train", "--algo", "grpo", "--set", "train.steps=12"]);
}

#[test]
fn golden_ppo() {
    check_rl("ppo", &["train", "--algo", "ppo", "--set", "train.steps=8"]);
}

#[test]
fn golden_ppo_seq() {
    check_rl("ppo-seq", &["train", "--algo", "ppo-seq", "--set", "train.steps=10"]);
}

/// PPO through every optional path of the step: critic, 2 epochs over 3 minibatches, EMA, ptx.
#[test]
fn golden_ppo_all_paths() {
    let ptx = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden").join("ptx.jsonl");
    let ptx_set = format!("train.ptx_data={}", ptx.display());
    for (name, share) in [("ppo-all-paths", true), ("ppo-all-paths-unshared", false)] {
        let mut args = vec!["train", "--algo", "ppo"];
        for set in ["train.steps=4", "train.ppo_epochs=2", "train.minibatch_size=48", "train.ema_decay=0.9"] {
            args.extend(["--set", set]);
        }
        if !share {
            args.extend(["--set", "train.share_prompts=false"]);
        }
        args.extend(["--set", "train.ptx_coef=0.5", "--set", &ptx_set]);
        let mut got = run(&args, "actor");
        // The ptx path is machine-specific: the golden file records it relative to integration-tests/.
        *got["args"].as_array_mut().unwrap().last_mut().unwrap() = json!("train.ptx_data=golden/ptx.jsonl");
        compare_or_record(name, got);
    }
}

#[test]
fn golden_sft() {
    check("sft", &["sft", "--set", "train.epochs=2"], "model");
}

#[test]
fn golden_rm() {
    check("rm", &["rm", "--set", "train.epochs=1"], "model");
}
