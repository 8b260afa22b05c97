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

/// A reward that is the same for every response never fills a step: each extra generation batch
/// is logged, and SIGTERM between two batches ends the step and the run (nothing trained yet: 143
/// and the line saying so), where it would otherwise sample `max_gen_batches` batches first.
#[test]
fn a_step_that_cannot_fill_logs_each_batch_and_ends_on_sigterm() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let preset = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo.toml")).unwrap();
    let constant =
        preset.replace("[rewards.config.exact_match]\nweight = 1.0", "[rewards.config.exact_match]\nweight = 0.0");
    assert_ne!(constant, preset);
    let config = tmp.path().join("constant.toml");
    std::fs::write(&config, constant).unwrap();
    let mut child = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["train", "--no-progress", "--config", config.to_str().unwrap()])
        .args(["--run-dir", tmp.path().join("run").to_str().unwrap()])
        .args(["--set", "train.steps=2", "--set", "eval.data=\"\"", "--set", "warmup.steps=0"])
        .args(["--set", "rollout.filter_groups.enable=true"])
        .args(["--set", "rollout.filter_groups.max_gen_batches=100000", "--set", "rollout.prompts_per_batch=2"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let stderr = child.stderr.take().unwrap();
    let lines = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("sampling batch 3 of at most 100000") {
                std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
            }
            seen.push(line);
        }
        seen
    });
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > std::time::Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the step still samples after 300 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let lines = lines.join().unwrap();
    let text = lines.join("\n");
    assert_eq!(status.code(), Some(143), "{text}");
    assert!(text.contains("step 1: 0 of 2 groups with differing `reward` after 1 generation batch(es)"), "{text}");
    assert!(lines.last().unwrap().contains("stopped by SIGTERM before the first step"), "{text}");
}
