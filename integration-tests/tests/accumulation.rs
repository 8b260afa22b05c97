//! Gradient accumulation (`train.gradient_accumulation_steps`): one optimizer step over k
//! minibatches equals one step over a single minibatch of the same rows — for GRPO's `dapo`
//! (token mean over the whole accumulated batch, via `step_tokens`) and `grpo` (mean of sequence
//! means, equal-sized minibatches) — up to the order of floating-point sums.

use std::path::Path;
use std::process::Command;

use rlhf_integration_tests::rlhf_bin;
use tch::Tensor;

/// Runs one GRPO step (the embedded preset: 16 prompts × 8 samples = 128 rows) and returns its
/// metrics row and the final actor's tensors.
fn one_step(
    dir: &Path,
    loss_type: &str,
    minibatch: usize,
    accumulation: usize,
) -> (serde_json::Value, Vec<(String, Tensor)>) {
    let run = dir.join(format!("{loss_type}-{minibatch}-{accumulation}"));
    let o = Command::new(rlhf_bin())
        .args(["train", "--algo", "grpo", "--set", "train.steps=1", "--set", "checkpoint.at_end=false"])
        .args(["--set", &format!("algorithm.config.loss_type=\"{loss_type}\"")])
        .args(["--set", &format!("train.minibatch_size={minibatch}")])
        .args(["--set", &format!("train.gradient_accumulation_steps={accumulation}")])
        .args(["--run-dir", run.to_str().unwrap()])
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let mut weights = Tensor::read_safetensors(run.join("actor/model.safetensors")).unwrap();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (row, weights)
}

fn max_abs_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        worst = worst.max((ta - tb).abs().max().double_value(&[]));
    }
    worst
}

#[test]
fn accumulating_k_minibatches_equals_one_big_minibatch() {
    let dir = tempfile::tempdir().unwrap();
    for loss_type in ["dapo", "grpo"] {
        let (big, w_big) = one_step(dir.path(), loss_type, 128, 1);
        let (acc, w_acc) = one_step(dir.path(), loss_type, 32, 4);
        let (_, w_split) = one_step(dir.path(), loss_type, 32, 1);
        let get =
            |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{loss_type}: no {k} in {r}"));
        // The step's loss (mean of the minibatch losses) and its gradient norm.
        for key in ["loss/total", "grad_norm/actor"] {
            let (b, a) = (get(&big, key), get(&acc, key));
            assert!(
                (b - a).abs() <= 1e-5 * b.abs().max(1e-3),
                "{loss_type}: {key} {b} (one minibatch) vs {a} (4 accumulated)"
            );
        }
        // Without accumulation the same minibatches take four steps: the weights really differ.
        let d_split = max_abs_diff(&w_big, &w_split);
        assert!(d_split > 1e-4, "{loss_type}: four separate steps moved the weights like one ({d_split})");
        // Accumulated and single-minibatch weights agree to rounding (Adam's first step divides by
        // |g|, so a parameter with a near-zero gradient can amplify rounding; 1 % of the gap to
        // four separate steps leaves room for that and none for a wrong normalisation).
        let d = max_abs_diff(&w_big, &w_acc);
        assert!(d < 0.01 * d_split, "{loss_type}: weights differ by {d} after one step (four steps: {d_split})");
        println!("{loss_type}: accumulated vs one minibatch {d:.2e}, vs four steps {d_split:.2e}");
    }
}

/// One epoch of one minibatch over the whole batch: the actor runs once (the old log-probs are
/// that pass detached, `train.reuse_old_logprobs`) instead of twice, and the step is the same as
/// with the separate old pass up to float rounding (the minibatch pass sees the rows shuffled).
#[test]
fn reusing_the_experience_pass_changes_nothing_but_the_work() {
    let dir = tempfile::tempdir().unwrap();
    let run = |reuse: bool| {
        let rd = dir.path().join(format!("reuse-{reuse}"));
        let o = Command::new(rlhf_bin())
            .args(["train", "--algo", "grpo", "--set", "train.steps=3", "--set", "train.minibatch_size=128"])
            .args(["--set", &format!("train.reuse_old_logprobs={reuse}"), "--run-dir", rd.to_str().unwrap()])
            .env("OMP_NUM_THREADS", "1")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(rd.join("metrics.jsonl")).unwrap();
        // Training steps only: row 0 is the preset's held-out evaluation before training.
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|r: &serde_json::Value| r["step"] != 0)
            .collect();
        let mut weights = Tensor::read_safetensors(rd.join("actor/model.safetensors")).unwrap();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        (rows, weights)
    };
    let ((once, w1), (twice, w2)) = (run(true), run(false));
    for (i, (a, b)) in once.iter().zip(&twice).enumerate() {
        assert_eq!(a["reward"], b["reward"], "the same samples");
        for k in ["loss/total", "grad_norm/actor", "kl", "entropy"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            let rel = (x - y).abs() / x.abs().max(1.0);
            println!("step {}: {k} {x} vs {y} ({rel:.1e})", a["step"]);
            // The first step's rounding differs (the minibatch pass sees the rows shuffled), and
            // later steps start from weights that differ by it, which Adam can amplify.
            let tol = if i == 0 { 1e-5 } else { 1e-4 };
            assert!(rel <= tol, "step {}: {k} {x} vs {y}", a["step"]);
        }
        // The reused pass is the old one: the ratio is exactly 1, nothing is clipped.
        assert_eq!(a["clip_ratio"].as_f64(), Some(0.0), "{a}");
    }
    let d = max_abs_diff(&w1, &w2);
    println!("weights after 3 steps differ by {d:.1e}");
    assert!(d < 1e-5, "{d}");
}
