//! Multi-turn KV reuse on the local engine (`environment.kv_reuse`, on by default): a turn
//! appends the observation to the cached keys and values instead of prefilling the whole context
//! again, and samples the very tokens re-prefilling samples — checked on 4-turn episodes of the
//! scripted environment (the built-in tiny model without warm-up rarely samples EOS, so episodes
//! run their turns), trajectory by trajectory over two steps, on one process and on 2 ranks.

use std::path::Path;
use std::process::Command;

use rlhf_integration_tests::{behaviour_metrics, rlhf_bin};
use serde_json::Value;

fn train(run_dir: &Path, reuse: bool, nproc: usize) {
    let o = Command::new(rlhf_bin())
        .args(["train", "--algo", "grpo", "--no-progress", "--run-dir", run_dir.to_str().unwrap()])
        .args(["--nproc", &nproc.to_string()])
        .args(["--set", "eval.data=\"\"", "--set", "warmup.steps=0", "--set", "run.save_rollouts=true"])
        .args(["--set", "environment.plugin=\"env-script\"", "--set", "environment.reward=\"sum\""])
        .args(["--set", "environment.config={ turns = 4, observation = \"the answer is\" }"])
        .args(["--set", "environment.max_turns=4", "--set", "rollout.max_new_tokens=6", "--set", "train.steps=2"])
        .args(["--set", &format!("environment.kv_reuse={reuse}")])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Every row's trajectory ids (sampled and observed tokens) of `step`, in file order.
fn trajectories(run: &Path, step: usize) -> Vec<String> {
    let text = std::fs::read_to_string(run.join(format!("rollouts/step-{step}.jsonl"))).unwrap();
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            format!("{}:{}", v["group"], v.get("trajectory_ids").unwrap_or(&v["completion_ids"]))
        })
        .collect()
}

#[test]
fn kv_reuse_samples_what_re_prefilling_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let (reuse, prefill, ranks) = (tmp.path().join("reuse"), tmp.path().join("prefill"), tmp.path().join("ranks"));
    train(&reuse, true, 1);
    train(&prefill, false, 1);
    train(&ranks, true, 2);
    for step in 1..=2 {
        let (a, b) = (trajectories(&reuse, step), trajectories(&prefill, step));
        assert_eq!(a.len(), 128);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x, y, "step {step}, row {i}");
        }
        let mut c = trajectories(&ranks, step);
        let mut a = a.clone();
        a.sort();
        c.sort();
        assert_eq!(a, c, "step {step}: 2 ranks sampled other trajectories");
    }
    let (ma, mb) = (behaviour_metrics(&reuse), behaviour_metrics(&prefill));
    for (x, y) in ma.iter().zip(&mb) {
        // The same tokens train the same way; only the decode's timings differ.
        assert_eq!(x, y, "step {}", x["step"]);
        assert!(x["env/turns/mean"].as_f64().unwrap() > 2.0, "episodes end early: {x:?}");
    }
}
