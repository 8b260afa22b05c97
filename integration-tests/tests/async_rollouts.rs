//! Asynchronous rollouts (`rollout.max_staleness = k`) on the built-in GRPO preset: every batch is
//! sampled by the policy of step `max(0, s − 1 − k)` (recorded per sample in the rollout log and
//! as `rollout/policy_version`), so staleness never exceeds k; k = 0 is the synchronous run bit
//! for bit; k = 1 repeats itself, resumes exactly from a checkpoint taken with a batch in flight,
//! and 2 ranks sample what one process samples; the importance-sampling ratios compare with the
//! generating policy's log-probs; multi-turn episodes run ahead and resume too.

use std::path::{Path, PathBuf};

use rlhf_integration_tests::{behaviour_metrics, copy_dir, metrics, rlhf};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(o: &std::process::Output, what: &str) {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
}

fn train(run: &Path, base: &[&str], extra: &[&str]) {
    let mut args: Vec<&str> = vec!["train", "--no-progress", "--run-dir", s(run)];
    args.extend(base);
    for e in extra {
        args.extend(["--set", e]);
    }
    ok(&rlhf(&args), &run.display().to_string());
}

const GRPO: &[&str] = &["--algo", "grpo", "--set", "run.save_rollouts=true"];

/// The training rows of `metrics.jsonl` (not the step-0 evaluation).
fn steps(run: &Path) -> Vec<Value> {
    metrics(run).into_iter().filter(|m| m.get("reward").is_some()).collect()
}

/// The `policy_version` of every line of step `step`'s rollout log, and its completions sorted.
fn logged(run: &Path, step: usize) -> (Vec<u64>, Vec<String>) {
    let text = std::fs::read_to_string(run.join(format!("rollouts/step-{step}.jsonl"))).unwrap();
    let rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let versions = rows.iter().map(|r| r["policy_version"].as_u64().expect("policy_version")).collect();
    let mut c: Vec<String> = rows.iter().map(|r| format!("{}:{}", r["group"], r["completion_ids"])).collect();
    c.sort();
    (versions, c)
}

fn same_runs(a: &Path, b: &Path) {
    let (ma, mb) = (behaviour_metrics(a), behaviour_metrics(b));
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x, y, "step {} differs", x["step"]);
    }
    let w = |r: &Path| std::fs::read(r.join("actor/model.safetensors")).unwrap();
    assert!(w(a) == w(b), "final actors differ");
}

/// A run killed during step `at + 2` after its checkpoint of step `at`, resumed: a copy of `a`
/// as it was then.
fn resumed_copy(a: &Path, b: &Path, at: usize, last: usize) {
    copy_dir(a, b);
    std::fs::remove_dir_all(b.join(format!("checkpoints/step-{last:06}"))).unwrap();
    std::fs::remove_dir_all(b.join("actor")).unwrap();
    let text = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64() <= Some(at as u64))
        .collect();
    std::fs::write(b.join("metrics.jsonl"), kept.join("\n") + "\n").unwrap();
    let ckpt = b.join(format!("checkpoints/step-{at:06}"));
    ok(&rlhf(&["train", "--no-progress", "--resume", s(&ckpt)]), "resume");
}

#[test]
fn one_step_stale_runs_repeat_resume_exactly_and_bound_staleness() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, a2, b) = (tmp.path().join("a"), tmp.path().join("a2"), tmp.path().join("b"));
    let set = ["train.steps=6", "rollout.max_staleness=1", "checkpoint.every=3", "checkpoint.keep=5"];
    train(&a, GRPO, &set);
    train(&a2, GRPO, &set);
    same_runs(&a, &a2);

    let rows = steps(&a);
    assert_eq!(rows.len(), 6);
    for (i, m) in rows.iter().enumerate() {
        let step = i + 1;
        // Step s trains on the batch sampled at the start of step s − 1 (step 1: before it).
        let version = step.saturating_sub(2) as f64;
        assert_eq!(m["rollout/policy_version"].as_f64(), Some(version), "step {step}");
        assert_eq!(m["rollout/staleness"].as_f64(), Some((step - 1) as f64 - version), "step {step}");
        assert!(m["rollout/staleness"].as_f64().unwrap() <= 1.0);
        let (versions, _) = logged(&a, step);
        assert!(!versions.is_empty() && versions.iter().all(|&v| v as f64 == version), "step {step}: {versions:?}");
        // The behaviour log-probs are the sampling policy's: equal to the trainer's own when the
        // weights are the same (step 1; float noise of another thread count and a cached
        // decode), far from them once the trainer moved on.
        let diff = m["is/logprob_diff_max"].as_f64().unwrap();
        if step == 1 {
            assert!(diff < 1e-3, "step 1: {diff}");
        } else {
            assert!(diff > 0.02, "step {step}: the ratios ignore the generating policy ({diff})");
        }
    }
    // The checkpoint of step 3 holds the batch of step 4, sampled during step 3.
    let ckpt = a.join("checkpoints/step-000003");
    let state: Value = serde_json::from_slice(&std::fs::read(ckpt.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["pipeline"]["ahead"], 1, "{}", state["pipeline"]);
    assert!(ckpt.join("rollouts-ahead.rank-00000-of-00001.safetensors").is_file());

    resumed_copy(&a, &b, 3, 6);
    same_runs(&a, &b);
}

#[test]
fn no_staleness_is_the_synchronous_run_and_two_steps_stay_within_two() {
    let tmp = tempfile::tempdir().unwrap();
    let (sync, zero, two) = (tmp.path().join("sync"), tmp.path().join("zero"), tmp.path().join("two"));
    train(&sync, GRPO, &["train.steps=4"]);
    train(&zero, GRPO, &["train.steps=4", "rollout.max_staleness=0"]);
    same_runs(&sync, &zero);
    assert!(steps(&zero).iter().all(|m| m.get("rollout/staleness").is_none()));

    train(&two, GRPO, &["train.steps=5", "rollout.max_staleness=2"]);
    let versions: Vec<f64> = steps(&two).iter().map(|m| m["rollout/policy_version"].as_f64().unwrap()).collect();
    assert_eq!(versions, [0.0, 0.0, 0.0, 1.0, 2.0]);
    for (i, m) in steps(&two).iter().enumerate() {
        assert_eq!(m["rollout/staleness"].as_f64(), Some(i as f64 - versions[i]));
        assert!(m["rollout/staleness"].as_f64().unwrap() <= 2.0);
    }
}

#[test]
fn two_ranks_sample_what_one_process_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, ranks) = (tmp.path().join("one"), tmp.path().join("ranks"));
    let set = ["train.steps=3", "rollout.max_staleness=1"];
    train(&one, GRPO, &set);
    train(&ranks, &[GRPO, &["--nproc", "2"]].concat(), &set);
    // Steps 1 and 2 sample with the initial weights (the same on every rank), with noise keyed by
    // the global row: the same completions for the same groups.
    for step in 1..=2 {
        let ((v1, c1), (v2, c2)) = (logged(&one, step), logged(&ranks, step));
        assert_eq!(c1, c2, "step {step}");
        assert_eq!(v1, v2, "step {step}");
    }
    let (m1, m2) = (steps(&one), steps(&ranks));
    for (x, y) in m1.iter().zip(&m2) {
        assert_eq!(x["rollout/staleness"], y["rollout/staleness"]);
        assert_eq!(x["rollout/policy_version"], y["rollout/policy_version"]);
    }
    assert_eq!(m1[0]["reward"], m2[0]["reward"]);
}

#[test]
fn episodes_run_ahead_and_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let preset = rlhf_integration_tests::fixtures().join("../../configs/grpo-calculator.toml");
    let base = ["--config", s(&preset), "--set", "run.save_rollouts=true"];
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let set =
        ["train.steps=4", "rollout.max_staleness=1", "checkpoint.every=2", "checkpoint.keep=5", "eval.every_steps=2"];
    train(&a, &base, &set);
    let rows = steps(&a);
    assert_eq!(rows.len(), 4);
    for (i, m) in rows.iter().enumerate() {
        assert_eq!(m["rollout/policy_version"].as_f64(), Some(i.saturating_sub(1) as f64));
        assert!(m["env/turns/mean"].as_f64().unwrap() >= 1.0, "{m}");
    }
    // Held-out evaluation of the trained policy at steps 0, 2 and 4.
    assert_eq!(metrics(&a).iter().filter(|m| m.get("eval/pass@1").is_some()).count(), 3);
    resumed_copy(&a, &b, 2, 4);
    same_runs(&a, &b);
}

#[test]
fn bad_async_settings_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    for (set, want) in [
        (
            "rollout.engine=\"vllm\"",
            "rollout.max_staleness: asynchronous rollouts on vLLM take max_staleness = 1 only (the servers hold one \
             policy at a time) yet",
        ),
        (
            "model.lora.rank=4",
            "rollout.max_staleness: asynchronous rollouts on the local engine do not support model.lora.rank > 0 yet",
        ),
        ("rollout.filter_groups.enable=true", "do not combine with rollout.filter_groups"),
    ] {
        let run: PathBuf = tmp.path().join("r");
        let args =
            ["train", "--algo", "grpo", "--no-progress", "--run-dir", s(&run), "--set", "rollout.max_staleness=2"];
        let o = rlhf(&[&args[..], &["--set", set]].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err.lines().last().unwrap_or_default();
        assert!(!o.status.success() && last.contains(want), "{set}: {err}");
        assert!(!run.exists(), "{set}: a refused run wrote {}", run.display());
    }
}
