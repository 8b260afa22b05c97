//! `train.gradient_checkpointing` changes memory, not training: PPO with a critic, GRPO reusing
//! the experience pass (one minibatch holding the batch) and GRPO with several minibatches each
//! train bit for bit as without it — the same metrics and the same weights and optimizer state —
//! and so do SFT, reward-model and DPO training; a setting it cannot honour is a one-line error
//! before anything is created.

use std::path::Path;

use rlhf_integration_tests::{behaviour_metrics, rlhf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn run(dir: &Path, name: &str, args: &[&str], checkpointing: bool) -> std::path::PathBuf {
    let rd = dir.join(name);
    let flag = format!("train.gradient_checkpointing={checkpointing}");
    let mut all = vec!["train", "--run-dir", s(&rd), "--set", "train.steps=3", "--set", &flag];
    all.extend_from_slice(args);
    let out = rlhf(&all);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    rd
}

#[test]
fn checkpointing_trains_bit_for_bit_as_without() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 3] = [
        ("ppo", &["--algo", "ppo"]),
        ("grpo-reuse", &["--algo", "grpo"]),
        ("grpo-minibatches", &["--algo", "grpo", "--set", "train.minibatch_size=16"]),
    ];
    for (name, args) in cases {
        let plain = run(dir.path(), &format!("{name}-plain"), args, false);
        let ck = run(dir.path(), &format!("{name}-ck"), args, true);
        let (a, b) = (behaviour_metrics(&plain), behaviour_metrics(&ck));
        // Three steps after the preset's held-out evaluation (step 0), which must agree too.
        assert_eq!(a.len(), 4, "{name}");
        assert_eq!(a, b, "{name}: metrics differ with gradient checkpointing");
        let step = plain.join("checkpoints/step-000003");
        let mut files = 0;
        for entry in std::fs::read_dir(&step).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                let other = ck.join("checkpoints/step-000003").join(path.file_name().unwrap());
                assert!(
                    std::fs::read(&path).unwrap() == std::fs::read(&other).unwrap(),
                    "{name}: {} differs with gradient checkpointing",
                    path.file_name().unwrap().to_string_lossy()
                );
                files += 1;
            }
        }
        // Actor and its optimizer, and for PPO the critic and its optimizer.
        assert!(files >= if name == "ppo" { 4 } else { 2 }, "{name}: {files} weight files compared");
    }
}

#[test]
fn lora_dropout_with_checkpointing_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let out = rlhf(&[
        "train",
        "--algo",
        "grpo",
        "--run-dir",
        s(&rd),
        "--set",
        "train.gradient_checkpointing=true",
        "--set",
        "model.lora.rank=4",
        "--set",
        "model.lora.dropout=0.1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let last = err.lines().last().unwrap_or("");
    assert!(last.contains("train.gradient_checkpointing") && last.contains("model.lora.dropout = 0"), "{err}");
    assert!(!rd.exists(), "nothing is created for a refused config");
}

#[test]
fn supervised_phases_train_bit_for_bit_with_checkpointing() {
    let dir = tempfile::tempdir().unwrap();
    for phase in ["sft", "rm", "dpo"] {
        let mut runs = Vec::new();
        for on in [false, true] {
            let rd = dir.path().join(format!("{phase}-{on}"));
            let flag = format!("train.gradient_checkpointing={on}");
            let out = rlhf(&[phase, "--run-dir", s(&rd), "--set", "train.steps=4", "--set", &flag]);
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{phase}: {log}");
            assert_eq!(log.contains("gradient checkpointing: each decoder layer"), on, "{phase}: {log}");
            runs.push(rd);
        }
        let (a, b) = (behaviour_metrics(&runs[0]), behaviour_metrics(&runs[1]));
        assert!(a.len() >= 4, "{phase}: {} metrics rows", a.len());
        assert_eq!(a, b, "{phase}: metrics differ with gradient checkpointing");
        let weights = |rd: &Path| std::fs::read(rd.join("model/model.safetensors")).unwrap();
        assert!(weights(&runs[0]) == weights(&runs[1]), "{phase}: the trained model differs with checkpointing");
    }
}

#[test]
fn supervised_lora_dropout_with_checkpointing_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    for phase in ["sft", "rm", "dpo"] {
        let rd = dir.path().join(phase);
        let sets = ["train.gradient_checkpointing=true", "model.lora.rank=4", "model.lora.dropout=0.1"];
        let mut args = vec![phase, "--run-dir", s(&rd)];
        for set in &sets {
            args.extend(["--set", set]);
        }
        let out = rlhf(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{phase}");
        let last = err.lines().last().unwrap_or("");
        assert!(last.contains("train.gradient_checkpointing") && last.contains("lora.dropout = 0"), "{phase}: {err}");
        assert!(!rd.exists(), "{phase}: nothing is created for a refused config");
    }
}
