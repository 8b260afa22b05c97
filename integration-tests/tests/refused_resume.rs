//! A refused resume leaves the run as it was: every way `rlhf train --resume` can refuse — a
//! damaged optimizer shard of rank 1 or of rank 0 (2 ranks, ZeRO stage 2), a damaged actor file,
//! another config, `train.steps` below the checkpoint (1 process) — exits non-zero with one line
//! and leaves every file of the run directory byte-identical (`metrics.jsonl` keeps its steps,
//! `config.toml` its keys). So does a finished `rlhf sft`, `rm` or `dpo` run resumed with fewer
//! steps or the same: a resume extends a run, never shrinks it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use rlhf_integration_tests::rlhf_bin;

fn run(args: &[&str], nproc: Option<usize>) -> Output {
    let mut c = std::process::Command::new(rlhf_bin());
    c.args(args).arg("--no-progress").env("RLHF_DIST_TIMEOUT", "60");
    if let Some(n) = nproc {
        c.args(["--nproc", &n.to_string()]);
    }
    c.output().expect("spawn rlhf")
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Runs a refused resume and checks the one-line error and the untouched directory.
fn refused(run_dir: &Path, args: &[&str], nproc: Option<usize>, want: &str) {
    let before = snapshot(run_dir);
    let o = run(args, nproc);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?} should be refused: {err}");
    assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    let after = snapshot(run_dir);
    let changed: Vec<_> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| k.display().to_string())
        .collect();
    assert!(changed.is_empty(), "{args:?} changed {changed:?}");
}

fn flip_last_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    *bytes.last_mut().unwrap() ^= 0xff;
    std::fs::write(path, bytes).unwrap();
}

const BASE: &[&str] = &[
    "train",
    "--algo",
    "grpo",
    "--set",
    "eval.data=\"\"",
    "--set",
    "train.steps=4",
    "--set",
    "checkpoint.every=2",
    "--set",
    "checkpoint.keep=5",
];

#[test]
fn refused_resumes_on_two_ranks_leave_the_run_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let mut args = BASE.to_vec();
    args.extend(["--set", "distributed.zero_stage=2", "--run-dir", rd.to_str().unwrap()]);
    let o = run(&args, Some(2));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = rd.join("checkpoints/step-000002");
    let ck = ckpt.to_str().unwrap();
    for rank in ["00001", "00000"] {
        let shard = ckpt.join(format!("optimizer-actor.rank-{rank}-of-00002.safetensors"));
        let good = std::fs::read(&shard).unwrap();
        flip_last_byte(&shard);
        let want = format!("optimizer-actor.rank-{rank}-of-00002.safetensors");
        refused(&rd, &["train", "--resume", ck, "--set", "train.steps=8"], Some(2), &want);
        std::fs::write(&shard, good).unwrap();
    }
}

#[test]
fn refused_resumes_on_one_process_leave_the_run_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let mut args = BASE.to_vec();
    args.extend(["--run-dir", rd.to_str().unwrap()]);
    let o = run(&args, None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = rd.join("checkpoints/step-000002");
    let ck = ckpt.to_str().unwrap();
    refused(&rd, &["train", "--resume", ck, "--algo", "grpo", "--set", "algorithm.config.beta=0.5"], None, "beta");
    refused(&rd, &["train", "--resume", ck, "--set", "train.steps=1"], None, "train.steps = 1 ends the run at step 1");
    // The finished run (checkpointed at its last step) resumed as it is: nothing to train.
    let last = rd.join("checkpoints/step-000004");
    refused(
        &rd,
        &["train", "--resume", last.to_str().unwrap()],
        None,
        "the checkpoint is at step 4 and train.steps = 4",
    );
    let actor = ckpt.join("actor.safetensors");
    flip_last_byte(&actor);
    refused(&rd, &["train", "--resume", ck], None, "actor.safetensors");
}

/// A resume may change what does not change the trained numbers (failure budgets, evaluation,
/// how long an idle run waits), each logged; a prompt file rewritten at the same path is refused
/// unless `--allow-data-change`.
#[test]
fn harmless_changes_resume_and_changed_prompt_data_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let prompts = tmp.path().join("prompts.jsonl");
    let lines: Vec<String> = (0..6).map(|a| format!(r#"{{"prompt": "{a} + 1 =", "label": "{}"}}"#, a + 1)).collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let data = format!("data.prompts=\"{}\"", prompts.display());
    let mut args = BASE.to_vec();
    args.extend(["--set", &data, "--set", "warmup.steps=0", "--run-dir", rd.to_str().unwrap()]);
    let o = run(&args, None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = rd.join("checkpoints/step-000002");
    let ck = ckpt.to_str().unwrap();
    // Harmless changes: accepted, each logged.
    let held_out = format!("eval.data=\"{}\"", prompts.display());
    let o = run(
        &[
            "train",
            "--resume",
            ck,
            "--algo",
            "grpo",
            "--set",
            &data,
            "--set",
            "warmup.steps=0",
            "--set",
            "train.steps=4",
            "--set",
            "checkpoint.every=2",
            "--set",
            "checkpoint.keep=5",
            "--set",
            &held_out,
            "--set",
            "train.max_idle_steps=9",
            "--run-dir",
            rd.to_str().unwrap(),
        ],
        None,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resume: eval.data changed") && err.contains("resume: train.max_idle_steps changed"), "{err}");
    // The same path, relabelled: refused, the run untouched; then accepted when asked for.
    let relabelled = std::fs::read_to_string(&prompts).unwrap().replace("\"1\"", "\"9\"");
    std::fs::write(&prompts, relabelled).unwrap();
    let want = format!("{}: the prompt data changed since the checkpoint", prompts.display());
    refused(&rd, &["train", "--resume", ck], None, &want);
    let o = run(&["train", "--resume", ck, "--allow-data-change"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("resuming anyway (--allow-data-change)"), "{err}");
}

/// `rlhf sft`, `rm` and `dpo` refuse to resume a finished run with fewer steps or as many (nothing
/// to train): `summary.json`, `config.toml` and `model/` stay as the run left them.
#[test]
fn finished_supervised_runs_are_never_shrunk_or_rewritten() {
    let tmp = tempfile::tempdir().unwrap();
    for cmd in ["sft", "rm", "dpo"] {
        let rd = tmp.path().join(cmd);
        let dir = rd.to_str().unwrap();
        let o = run(&[cmd, "--run-dir", dir, "--set", "train.steps=4", "--set", "checkpoint.every=2"], None);
        assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(rd.join("summary.json").is_file() && rd.join("model").is_dir());
        for steps in ["train.steps=3", "train.steps=4"] {
            let want = format!("the checkpoint is at step 4 and {}", steps.replace('=', " = "));
            refused(&rd, &[cmd, "--resume", "latest", "--run-dir", dir, "--set", steps], None, &want);
        }
    }
}
