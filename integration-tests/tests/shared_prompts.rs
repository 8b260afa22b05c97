//! `train.share_prompts` (on by default) computes each prompt once for its G rows: a GRPO run
//! with it trains as the run without it — the first step's rollouts and rewards exactly, its
//! losses, KL, entropy and gradient norm within float rounding — and with LoRA dropout it stays
//! off, so such a run is the unshared run bit for bit.

use std::path::{Path, PathBuf};

use rlhf_integration_tests::{behaviour_metrics, rlhf};
use serde_json::{Map, Value};

fn run(dir: &Path, name: &str, share: bool, extra: &[&str]) -> PathBuf {
    let rd = dir.join(name);
    let flag = format!("train.share_prompts={share}");
    let mut args = vec!["train", "--algo", "grpo", "--run-dir", rd.to_str().unwrap(), "--set", "train.steps=2"];
    // The preset's held-out evaluation is off: row 0 is then the first step.
    args.extend(["--set", "eval.data=\"\""]);
    args.extend(["--set", &flag]);
    args.extend_from_slice(extra);
    let out = rlhf(&args);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    rd
}

fn num(m: &Map<String, Value>, key: &str) -> f64 {
    m.get(key).and_then(Value::as_f64).unwrap_or_else(|| panic!("no `{key}` in {m:?}"))
}

#[test]
fn sharing_prompts_trains_as_without_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let shared = behaviour_metrics(&run(dir.path(), "shared", true, &[]));
    let plain = behaviour_metrics(&run(dir.path(), "plain", false, &[]));
    let (s, p) = (&shared[0], &plain[0]);
    for key in ["reward", "reward_std", "completions/mean_length"] {
        assert_eq!(s[key], p[key], "step 1: `{key}` (the same rollouts)");
    }
    let mut compared = 0;
    for key in ["loss/total", "kl", "entropy", "grad_norm/actor", "rollout/kl", "approx_kl"] {
        let (a, b) = (num(s, key), num(p, key));
        let tol = 1e-4 * a.abs().max(b.abs()).max(1e-3);
        assert!((a - b).abs() <= tol, "step 1: `{key}` {a} shared against {b}");
        compared += 1;
    }
    assert_eq!(compared, 6);
    // Not bit for bit: the shared pass sums in another order.
    assert_ne!(s["grad_norm/actor"], p["grad_norm/actor"], "the shared pass did not run");
}

#[test]
fn with_lora_dropout_prompts_are_not_shared() {
    let dir = tempfile::tempdir().unwrap();
    let lora = ["--set", "model.lora.rank=4", "--set", "model.lora.dropout=0.1"];
    let shared = behaviour_metrics(&run(dir.path(), "shared", true, &lora));
    let plain = behaviour_metrics(&run(dir.path(), "plain", false, &lora));
    assert_eq!(shared, plain);
}
