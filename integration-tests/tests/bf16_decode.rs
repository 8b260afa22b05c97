//! `rollout.decode_dtype = "bf16"`: the local engine samples with a bf16 copy of the policy, and
//! the mismatch with the f32 policy is measured (and correctable) like vLLM's: behaviour log-probs
//! close to the policy's but not equal, a copy refreshed every step, and settings it cannot
//! honour refused up front.

use std::path::Path;

use rlhf_integration_tests::{metrics, rlhf};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn bf16_decode_samples_close_to_the_policy_logs_the_mismatch_and_learns() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let out = rlhf(&[
        "train",
        "--algo",
        "grpo",
        "--run-dir",
        s(&rd),
        // The whole task without the preset's held-out split and evaluation: the mismatch bounds
        // below were measured on that trajectory.
        "--set",
        "data.prompts=\"builtin:addition\"",
        "--set",
        "eval.data=\"\"",
        "--set",
        "rollout.decode_dtype=\"bf16\"",
        "--set",
        "rollout.is_correction.mode=\"token_truncate\"",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Training steps only: row 0 is the preset's held-out evaluation before training.
    let rows: Vec<_> = metrics(&rd).into_iter().filter(|r| r["step"] != 0).collect();
    assert_eq!(rows.len(), 300, "the grpo preset's steps");
    for r in &rows {
        let ratio = r["is/ratio_mean"].as_f64().expect("is/ratio_mean with bf16 decode");
        let diff = r["is/logprob_diff_max"].as_f64().unwrap();
        // bf16 hidden states move the log-probs a little, never a lot.
        assert!((0.95..1.05).contains(&ratio), "ratio {ratio}");
        assert!(diff > 0.0 && diff < 0.5, "max |Δ log-prob| {diff}");
        assert!(r["rollout/sync_s"].as_f64().is_some());
    }
    // And the policy learns the embedded task as with f32 sampling (0.15 -> 0.75 in one run).
    let mean = |rs: &[Value]| rs.iter().map(|r| r["reward"].as_f64().unwrap()).sum::<f64>() / rs.len() as f64;
    let (first, last) = (mean(&rows[..20]), mean(&rows[280..]));
    assert!(last > first + 0.3, "reward {first:.3} -> {last:.3}");
}

#[test]
fn bf16_decode_is_refused_where_it_cannot_apply() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    for (extra, needle) in [
        (vec!["rollout.engine=\"vllm\"", "rollout.vllm.urls=[\"http://127.0.0.1:1\"]"], "rollout.decode_dtype"),
        (vec!["model.lora.rank=4"], "model.lora.rank > 0"),
        (vec![], "unknown variant"),
    ] {
        let mut args = vec!["train", "--algo", "grpo", "--run-dir", s(&rd)];
        let dtype = if extra.is_empty() { "rollout.decode_dtype=\"f16\"" } else { "rollout.decode_dtype=\"bf16\"" };
        args.extend(["--set", dtype]);
        for e in &extra {
            args.extend(["--set", e]);
        }
        let out = rlhf(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}");
        let last = err.lines().last().unwrap_or("");
        assert!(last.contains(needle) && last.contains("rollout.decode_dtype"), "{extra:?}: {err}");
        assert!(!rd.exists(), "nothing is created for a refused config");
    }
}
