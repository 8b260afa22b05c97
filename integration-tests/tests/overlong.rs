//! DAPO's overlong handling on the built-in GRPO preset: the soft overlong punishment adds exactly
//! `f · (L_max − L_cache − |y|) / L_cache` to the reward of each response longer than
//! `L_max − L_cache` (checked sample by sample against the same run without it, whose first
//! rollout is the same), and overlong filtering masks out of the loss exactly the responses cut at
//! the limit without an EOS (counted against the rollout log). Bad settings are one-line errors.

use std::path::{Path, PathBuf};

use rlhf_integration_tests::{metrics, rlhf};
use serde_json::Value;

/// The built-in tiny model's EOS id.
const EOS: u64 = 1;

fn train(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let run = dir.join(name);
    let mut args = vec!["train", "--algo", "grpo", "--no-progress", "--run-dir", run.to_str().unwrap()];
    for s in ["train.steps=3", "run.save_rollouts=true", "rollout.max_new_tokens=3"].iter().chain(extra) {
        args.extend(["--set", s]);
    }
    let o = rlhf(&args);
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    run
}

/// The rollout log of `step`: (completion ids, reward) per row.
fn rollouts(run: &Path, step: usize) -> Vec<(Vec<u64>, f64)> {
    let text = std::fs::read_to_string(run.join(format!("rollouts/step-{step}.jsonl"))).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| {
            let ids = v["completion_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            (ids, v["reward"].as_f64().unwrap())
        })
        .collect()
}

#[test]
fn the_soft_punishment_is_dapos_formula_sample_by_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = train(tmp.path(), "plain", &[]);
    let punished = train(tmp.path(), "punished", &["rollout.overlong_buffer=2", "rollout.overlong_penalty=0.5"]);
    let (a, b) = (rollouts(&plain, 1), rollouts(&punished, 1));
    assert_eq!(a.len(), b.len());
    let mut penalised = 0;
    for ((ids_a, r_a), (ids_b, r_b)) in a.iter().zip(&b) {
        assert_eq!(ids_a, ids_b, "the first rollout does not depend on the reward");
        // L_max = 3, L_cache = 2, f = 0.5: 1 token → 0, 2 → −0.25, 3 → −0.5.
        let want = match ids_a.len() {
            1 => 0.0,
            2 => -0.25,
            3 => -0.5,
            n => panic!("{n} tokens under a limit of 3"),
        };
        penalised += usize::from(want < 0.0);
        assert!((r_b - r_a - want).abs() < 1e-12, "{ids_a:?}: {r_a} → {r_b}, want {want}");
    }
    assert!(penalised > 0, "no response reached the buffer: the test checks nothing");
    let m = metrics(&punished);
    assert!(m.iter().skip(1).all(|s| s["rewards/overlong/mean"].as_f64().is_some_and(|x| x <= 0.0)), "{m:?}");
    assert!(metrics(&plain).iter().all(|s| s.get("rewards/overlong/mean").is_none()));
}

#[test]
fn filtering_masks_exactly_the_responses_cut_without_eos() {
    let tmp = tempfile::tempdir().unwrap();
    let run = train(tmp.path(), "filtered", &["rollout.overlong_filter=true"]);
    let m = metrics(&run);
    let mut total = 0;
    for step in 1..=3 {
        let cut = rollouts(&run, step).iter().filter(|(ids, _)| ids.len() == 3 && ids.last() != Some(&EOS)).count();
        let row = m.iter().find(|s| s["step"] == step && s.get("reward").is_some()).unwrap();
        assert_eq!(row["overlong/masked"].as_f64(), Some(cut as f64), "step {step}");
        total += cut;
    }
    assert!(total > 0, "no response was cut: the test checks nothing");
}

#[test]
fn bad_overlong_settings_are_one_line_errors() {
    for (sets, want) in [
        (vec!["rollout.overlong_buffer=5", "rollout.max_new_tokens=4"], "rollout.overlong_buffer"),
        (vec!["rollout.overlong_penalty=-1"], "rollout.overlong_penalty"),
        (
            vec!["rollout.overlong_filter=true", "environment.plugin=\"env-calculator\"", "environment.reward=\"sum\""],
            "rollout.overlong_filter",
        ),
    ] {
        let mut args = vec!["train", "--algo", "grpo", "--no-progress"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let o = rlhf(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err.lines().last().unwrap_or("");
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(last.starts_with("error: ") && last.contains(want), "{sets:?}: {last}");
    }
}
