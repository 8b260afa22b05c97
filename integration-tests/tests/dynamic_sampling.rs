//! DAPO's dynamic sampling (`[rollout.filter_groups]`) on the built-in GRPO preset: every group a
//! step trains on has differing rewards (read back from the rollout log), the step samples more
//! generation batches until it has `prompts_per_batch` such groups or `max_gen_batches` (then it
//! says so in `filter/short`), and 2 ranks keep the very groups one process keeps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rlhf_integration_tests::{metrics, rlhf};
use serde_json::Value;

fn train(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let run = dir.join(name);
    let mut args = vec!["train", "--algo", "grpo", "--no-progress", "--run-dir", run.to_str().unwrap()];
    for s in ["train.steps=4", "run.save_rollouts=true", "rollout.filter_groups.enable=true"].iter().chain(extra) {
        args.extend(["--set", s]);
    }
    let o = rlhf(&args);
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    run
}

/// The rewards of each group of a step's rollout log, and its completions in file order.
fn groups(run: &Path, step: usize) -> (BTreeMap<i64, Vec<f64>>, Vec<Value>) {
    let text = std::fs::read_to_string(run.join(format!("rollouts/step-{step}.jsonl"))).unwrap();
    let rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut g: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for r in &rows {
        g.entry(r["group"].as_i64().unwrap()).or_default().push(r["reward"].as_f64().unwrap());
    }
    (g, rows.iter().map(|r| r["completion_ids"].clone()).collect())
}

fn step_row(m: &[Value], step: usize) -> &Value {
    m.iter().find(|s| s["step"] == step && s.get("reward").is_some()).unwrap()
}

#[test]
fn every_kept_group_differs_and_the_batch_is_refilled() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "one", &["rollout.filter_groups.max_gen_batches=6"]);
    let m = metrics(&run);
    let mut refilled = 0;
    for step in 1..=4 {
        let (g, _) = groups(&run, step);
        let row = step_row(&m, step);
        let num = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("step {step}: no {k} in {row}"));
        for (id, rewards) in &g {
            assert!(rewards.iter().any(|r| *r != rewards[0]), "step {step}: group {id} scored alike: {rewards:?}");
        }
        assert_eq!(g.len() as f64, num("filter/kept_groups"), "step {step}");
        let batches = num("filter/gen_batches");
        assert!((1.0..=6.0).contains(&batches), "step {step}: {batches}");
        // The preset's 16 prompts per batch: full unless the 6 batches ran out.
        assert_eq!(num("filter/short"), f64::from(g.len() < 16), "step {step}");
        assert_eq!(num("filter/dropped_groups"), batches * 16.0 - num("filter/kept_groups"), "step {step}");
        if g.len() == 16 && batches > 1.0 {
            refilled += 1;
        }
    }
    assert!(refilled > 0, "no step needed a second generation batch: the test checks nothing");
}

#[test]
fn max_gen_batches_is_respected_and_the_step_trains_on_what_it_has() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "short", &["rollout.filter_groups.max_gen_batches=1"]);
    let m = metrics(&run);
    let mut short = 0;
    for step in 1..=4 {
        let row = step_row(&m, step);
        assert_eq!(row["filter/gen_batches"].as_f64(), Some(1.0), "{row}");
        short += usize::from(row["filter/short"].as_f64() == Some(1.0));
        assert_eq!(groups(&run, step).0.len() as f64, row["filter/kept_groups"].as_f64().unwrap());
    }
    assert!(short > 0, "every first batch was full of differing groups: the test checks nothing");
}

#[test]
fn two_ranks_keep_the_groups_one_process_keeps() {
    let tmp = tempfile::tempdir().unwrap();
    let one = train(tmp.path(), "one", &["train.steps=2"]);
    let o = rlhf(&[
        "train",
        "--algo",
        "grpo",
        "--no-progress",
        "--nproc",
        "2",
        "--run-dir",
        tmp.path().join("ranks").to_str().unwrap(),
        "--set",
        "train.steps=2",
        "--set",
        "run.save_rollouts=true",
        "--set",
        "rollout.filter_groups.enable=true",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ranks = tmp.path().join("ranks");
    // Step 1 samples with the same weights and noise: the same groups, the same completions.
    let (g1, c1) = groups(&one, 1);
    let (g2, c2) = groups(&ranks, 1);
    assert_eq!(g1.keys().collect::<Vec<_>>(), g2.keys().collect::<Vec<_>>());
    let mut a: Vec<String> = c1.iter().map(Value::to_string).collect();
    let mut b: Vec<String> = c2.iter().map(Value::to_string).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    let (m1, m2) = (metrics(&one), metrics(&ranks));
    for k in ["filter/gen_batches", "filter/kept_groups", "completions/count"] {
        assert_eq!(step_row(&m1, 1)[k], step_row(&m2, 1)[k], "{k}");
    }
}

#[test]
fn bad_filter_settings_are_one_line_errors() {
    for (set, want) in [
        ("rollout.filter_groups.max_gen_batches=0", "rollout.filter_groups.max_gen_batches: must be >= 1"),
        ("rollout.filter_groups.metric=\"nope\"", "`nope` is neither `reward` nor a score of this run (`accuracy`)"),
    ] {
        let o = rlhf(&[
            "train",
            "--algo",
            "grpo",
            "--no-progress",
            "--set",
            "rollout.filter_groups.enable=true",
            "--set",
            set,
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err.lines().last().unwrap_or("");
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(last.starts_with("error: ") && last.contains(want), "{set}: {last}");
    }
}
