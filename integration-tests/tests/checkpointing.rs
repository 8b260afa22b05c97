//! `train.gradient_checkpointing` changes memory, not training: PPO with a critic, GRPO reusing
//! the experience pass (one minibatch holding the batch) and GRPO with several minibatches each
//! train bit for bit as without it — the same metrics and the same weights and optimizer state —
//! and so do SFT, reward-model and DPO training; a setting it cannot honour is a one-line error
//! before anything is created. With prompts shared by their samples (`train.share_prompts`) and
//! tied embeddings, the tied matrix's gradient sums the head's, the completions' and the prompts'
//! parts in another order with checkpointing (the prompts are recomputed apart): the same
//! training within f32 rounding.

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
    let apart = ["--set", "train.share_prompts=false"];
    let cases: [(&str, &[&str]); 3] = [
        ("ppo", &["--algo", "ppo", apart[0], apart[1]]),
        ("grpo-reuse", &["--algo", "grpo", apart[0], apart[1]]),
        ("grpo-minibatches", &["--algo", "grpo", "--set", "train.minibatch_size=16", apart[0], apart[1]]),
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

/// With shared prompts the two trainings agree within f32 rounding (see the module docs).
#[test]
fn checkpointing_with_shared_prompts_trains_alike() {
    let dir = tempfile::tempdir().unwrap();
    let plain = run(dir.path(), "plain", &["--algo", "grpo"], false);
    let ck = run(dir.path(), "ck", &["--algo", "grpo"], true);
    let (a, b) = (behaviour_metrics(&plain), behaviour_metrics(&ck));
    assert_eq!(a.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        for (k, v) in x {
            let (p, q) = (v.as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!((p - q).abs() <= 1e-4 * p.abs().max(q.abs()).max(1e-3), "{k}: {p} vs {q}");
        }
    }
    let step = plain.join("checkpoints/step-000003");
    let mut files = 0;
    for entry in std::fs::read_dir(&step).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let other = ck.join("checkpoints/step-000003").join(path.file_name().unwrap());
            let read = |p: &Path| {
                tch::Tensor::read_safetensors(p).unwrap().into_iter().collect::<std::collections::BTreeMap<_, _>>()
            };
            let (p, q) = (read(&path), read(&other));
            assert_eq!(p.len(), q.len());
            for (n, x) in &p {
                let y = &q[n];
                let d = (x - y).abs().max().double_value(&[]);
                assert!(d <= 1e-4 * x.abs().max().double_value(&[]).max(1e-6), "{n}: {d}");
            }
            files += 1;
        }
    }
    assert!(files >= 2, "{files} weight files compared");
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
