//! The supervised phases resume as `rlhf train` does: `rlhf sft`, `rm` and `dpo` killed with
//! SIGKILL after a checkpoint continue with `--resume latest` to the metrics and weights of the
//! uninterrupted run, bit for bit; the old key names still load (with a warning); and the
//! TensorBoard event files of a killed-and-resumed run read back through TensorBoard's own reader
//! as the uninterrupted run's curve.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rlhf_integration_tests::{behaviour_metrics, metrics, python, rlhf_bin};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const SETS: &[&str] = &["train.steps=9", "checkpoint.every=3", "checkpoint.keep=5", "train.eval_every=3"];

fn phase(cmd: &str, run_dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(rlhf_bin());
    c.args([cmd, "--no-progress", "--run-dir", s(run_dir)]).env("OMP_NUM_THREADS", "1");
    for set in SETS.iter().chain(extra) {
        c.args(["--set", set]);
    }
    c
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Starts `cmd` slowed down (a pause after every checkpoint file), kills it with SIGKILL once the
/// checkpoint of step 3 is complete, and checks it did not finish.
fn killed_after_step_3(cmd: &str, run_dir: &Path, extra: &[&str]) {
    let mut c = phase(cmd, run_dir, extra);
    c.env("RLHFRS_TEST_CHECKPOINT_DELAY_MS", "150").stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    let manifest = run_dir.join("checkpoints/step-000003/manifest.json");
    let t0 = Instant::now();
    while !manifest.is_file() {
        assert!(t0.elapsed() < Duration::from_secs(120), "{cmd}: no checkpoint of step 3");
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{cmd} ended ({status}) before its step-3 checkpoint");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!run_dir.join("model").exists(), "{cmd} finished before it was killed");
}

#[test]
fn sft_rm_and_dpo_killed_after_a_checkpoint_resume_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["sft", "rm", "dpo"] {
        let (whole, cut) = (dir.path().join(format!("{cmd}-whole")), dir.path().join(format!("{cmd}-cut")));
        ok(&phase(cmd, &whole, &[]).output().unwrap());
        killed_after_step_3(cmd, &cut, &[]);
        let o = Command::new(rlhf_bin())
            .args([cmd, "--no-progress", "--resume", "latest", "--run-dir", s(&cut)])
            .env("OMP_NUM_THREADS", "1")
            .output()
            .unwrap();
        ok(&o);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("resumed from") && err.contains("at step 3"), "{cmd}: {err}");
        assert_eq!(behaviour_metrics(&whole), behaviour_metrics(&cut), "{cmd}: metrics differ after the resume");
        let w = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
        assert!(w(&whole) == w(&cut), "{cmd}: the resumed run's weights differ");
        assert_eq!(metrics(&cut).last().unwrap()["step"], 9);
    }
}

/// A checkpoint of one phase is refused by another, and a resume under a config that changes
/// the numbers is refused naming the key; the old names (`train.max_steps`, `[lora]`) load with
/// a deprecation warning and give the same run as the new ones.
#[test]
fn refusals_and_old_key_names() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    ok(&phase("sft", &run, &[]).output().unwrap());
    let ckpt = run.join("checkpoints/step-000009");
    let o = Command::new(rlhf_bin()).args(["rm", "--resume", s(&ckpt)]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("a checkpoint of `rlhf sft`, not of `rlhf rm`"), "{err}");
    let other = dir.path().join("other");
    let o = Command::new(rlhf_bin())
        .args(["sft", "--resume", s(&ckpt), "--run-dir", s(&other), "--config"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sft.toml"))
        .args(["--set", "train.lr=0.5"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("train.lr (0.003 there, 0.5 here)"), "{err}");

    let (new, old) = (dir.path().join("new"), dir.path().join("old"));
    let base = ["--set", "checkpoint.every=0"];
    let o = Command::new(rlhf_bin())
        .args(["sft", "--no-progress", "--run-dir", s(&new)])
        .args(base)
        .args(["--set", "train.steps=4", "--set", "train.gradient_accumulation_steps=2", "--set", "model.lora.rank=4"])
        .output()
        .unwrap();
    ok(&o);
    let o = Command::new(rlhf_bin())
        .args(["sft", "--no-progress", "--run-dir", s(&old)])
        .args(base)
        .args(["--set", "train.max_steps=4", "--set", "train.grad_accum=2", "--set", "lora.rank=4"])
        .output()
        .unwrap();
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    for (old, new) in [("train.max_steps", "train.steps"), ("train.grad_accum", "train.gradient_accumulation_steps")] {
        assert!(err.contains(&format!("`{old}` is deprecated, read as `{new}`")), "{err}");
    }
    assert_eq!(behaviour_metrics(&new), behaviour_metrics(&old));
    let w = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    assert!(w(&new) == w(&old), "the old key names train other weights than the new ones");
}

/// TensorBoard's Python reader sees each step's loss once, with the uninterrupted run's values,
/// after a kill and a resume.
#[test]
fn tensorboard_curves_of_a_resumed_run_read_back_by_tensorboard() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (tb, run) = (dir.path().join("tb"), dir.path().join("sft-run"));
    let tb_set = format!("tensorboard.dir=\"{}\"", s(&tb));
    killed_after_step_3("sft", &run, &[&tb_set]);
    let o = Command::new(rlhf_bin())
        .args(["sft", "--no-progress", "--resume", "latest", "--run-dir", s(&run)])
        .output()
        .unwrap();
    ok(&o);
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1]); ea.Reload()
print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ["loss", "eval/ppl"]}))
"#;
    let o = Command::new(&python).args(["-c", script, s(&tb.join("sft-run"))]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let curves: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = metrics(&run);
    let want = |key: &str| -> Vec<(i64, f32)> {
        m.iter().filter_map(|l| Some((l["step"].as_i64()?, l.get(key)?.as_f64()? as f32))).collect()
    };
    for key in ["loss", "eval/ppl"] {
        let got: Vec<(i64, f32)> = curves[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(got, want(key), "{key}");
    }
}

/// 2 ranks at ZeRO stage 2 (each rank checkpoints its optimizer shard) resumed on 2 ranks from
/// the checkpoint of step 3: the same metrics and weights as the uninterrupted run.
#[test]
fn two_ranks_at_zero_stage_2_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, cut) = (dir.path().join("whole"), dir.path().join("cut"));
    ok(&phase("sft", &whole, &["distributed.zero_stage=2"]).args(["--nproc", "2"]).output().unwrap());
    let shard = whole.join("checkpoints/step-000003/optimizer.rank-00001-of-00002.safetensors");
    assert!(shard.is_file(), "each rank writes its optimizer shard");
    rlhf_integration_tests::copy_dir(&whole, &cut);
    for gone in ["model", "checkpoints/step-000006", "checkpoints/step-000009"] {
        std::fs::remove_dir_all(cut.join(gone)).unwrap();
    }
    let o = Command::new(rlhf_bin())
        .args(["sft", "--no-progress", "--nproc", "2", "--resume", s(&cut.join("checkpoints/step-000003"))])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    ok(&o);
    assert_eq!(behaviour_metrics(&whole), behaviour_metrics(&cut));
    let w = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    assert!(w(&whole) == w(&cut), "the resumed run's weights differ");
}
