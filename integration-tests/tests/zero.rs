//! ZeRO stage 1 (`[distributed] zero_stage = 1`: f32 masters and Adam moments partitioned over
//! the ranks) on 2 Gloo ranks: without gradient clipping it trains bit for bit as the replicated
//! stage 0 does (the same sums, the same element-wise AdamW) — also with bf16 weights, LoRA,
//! gradient checkpointing and accumulation, and in `rlhf rm` and `rlhf dpo`; with clipping only the global
//! gradient norm is summed in another order, so metrics and weights agree within a tolerance; each
//! rank holds its share of the optimizer state (`mem/optim_gb`); a checkpoint holds the whole
//! state, so a run resumes bit-exactly at stage 1 and a stage-0 checkpoint resumes at stage 1;
//! stages 2 and 3 and bad values are one-line config errors naming the key.

use std::path::Path;
use std::process::{Command, Output};

use rlhf_integration_tests::{behaviour_metrics, copy_dir, metrics, rlhf_bin};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `rlhf ARGS --run-dir DIR` on 2 ranks (one thread each) at ZeRO stage `stage`.
fn run(args: &[&str], run_dir: &Path, stage: u8) -> Output {
    Command::new(rlhf_bin())
        .args(args)
        .args(["--run-dir", s(run_dir), "--nproc", "2", "--set", &format!("distributed.zero_stage={stage}")])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("spawn rlhf")
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

/// The largest absolute difference between the tensors of two safetensors files.
fn max_weight_diff(a: &Path, b: &Path) -> f64 {
    let ta = tch::Tensor::read_safetensors(a).unwrap();
    let tb: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(b).unwrap().into_iter().collect();
    assert_eq!(ta.len(), tb.len());
    ta.iter().map(|(name, t)| (t - &tb[name]).abs().max().double_value(&[])).fold(0.0, f64::max)
}

/// Optimizer-state bytes per rank at stage 1 against stage 0, for an f32 model of `n` trained
/// elements on 2 ranks: the two moments of half of every variable (rounded up, so at most one
/// element more per variable; f32 variables are their own masters) against those of all n.
fn check_state_bytes(zero: &[Value], one: &[Value]) {
    let gb = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    let n = (gb(&zero[0], "mem/optim_gb") * 1e9 / 8.0).round();
    for r in one {
        for key in ["mem/optim_gb", "mem/optim_gb_max"] {
            let extra = gb(r, key) * 1e9 - 8.0 * n / 2.0;
            assert!((0.0..8.0 * 100.0).contains(&extra), "{key}: {extra} bytes over 8·n/2: {r}");
        }
    }
}

#[test]
fn stage_one_trains_as_stage_zero_and_holds_a_share_of_the_state() {
    let tmp = tempfile::tempdir().unwrap();
    // SFT without clipping: bit for bit.
    let args = ["sft", "--set", "train.max_steps=6", "--set", "train.max_grad_norm=0"];
    let (a, b) = (tmp.path().join("sft0"), tmp.path().join("sft1"));
    ok(&run(&args, &a, 0));
    ok(&run(&args, &b, 1));
    // Everything but the traffic (a reduce-scatter and an all-gather instead of an all-reduce)
    // and the reported gradient norm, whose squares are summed in another order.
    let (mut ma, mut mb) = (behaviour_metrics(&a), behaviour_metrics(&b));
    assert_eq!((ma.len(), mb.len()), (7, 7), "the evaluation before training and 6 steps");
    for (x, y) in ma.iter_mut().zip(&mut mb) {
        if let (Some(u), Some(v)) = (x.remove("grad_norm"), y.remove("grad_norm")) {
            let (u, v) = (u.as_f64().unwrap(), v.as_f64().unwrap());
            assert!((u - v).abs() <= 1e-6 * u, "step {}: grad_norm {u} against {v}", x["step"]);
        }
        x.retain(|k, _| !k.starts_with("comm/"));
        y.retain(|k, _| !k.starts_with("comm/"));
    }
    assert_eq!(ma, mb, "stage 1 metrics against stage 0's");
    let weights = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    assert!(weights(&a) == weights(&b), "stage 1 weights differ from stage 0's");
    check_state_bytes(&metrics(&a)[1..], &metrics(&b)[1..]);

    // PPO with a critic (two sharded engines) and clipping: the global norm's summation order
    // differs, so within a tolerance over a few steps.
    let args = [
        "train",
        "--algo",
        "ppo",
        "--set",
        "eval.data=\"\"",
        "--set",
        "train.steps=3",
        "--set",
        "rollout.prompts_per_batch=4",
        "--set",
        "rollout.samples_per_prompt=2",
    ];
    let (a, b) = (tmp.path().join("ppo0"), tmp.path().join("ppo1"));
    ok(&run(&args, &a, 0));
    ok(&run(&args, &b, 1));
    let (ma, mb) = (metrics(&a), metrics(&b));
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x["reward"], y["reward"], "step {}", x["step"]);
        for key in ["grad_norm/actor", "grad_norm/critic", "loss/policy", "loss/value"] {
            let (u, v) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((u - v).abs() <= 1e-4 * u.abs().max(1.0), "step {} {key}: {u} against {v}", x["step"]);
        }
    }
    let d = max_weight_diff(&a.join("actor/model.safetensors"), &b.join("actor/model.safetensors"));
    assert!(d < 1e-4, "actor weights differ by {d}");
}

#[test]
fn stage_one_checkpoints_resume_exactly_and_stage_zero_ones_resume_at_stage_one() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
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
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    ok(&run(&args, &a, 1));
    // A run killed after its step-2 checkpoint: its directory without the later checkpoint and
    // the final actor. Resumed at stage 1, it repeats steps 3-4 bit for bit.
    let resume = |from: &Path, to: &Path| {
        copy_dir(from, to);
        std::fs::remove_dir_all(to.join("checkpoints/step-000004")).unwrap();
        std::fs::remove_dir_all(to.join("actor")).unwrap();
        to.join("checkpoints/step-000002")
    };
    let ckpt = resume(&a, &b);
    let o = run(&["train", "--resume", s(&ckpt)], &b, 1);
    ok(&o);
    let (ma, mb) = (behaviour_metrics(&a), behaviour_metrics(&b));
    assert!(ma.len() == 4 && ma == mb, "resumed at stage 1");
    let weights = |d: &Path| std::fs::read(d.join("actor/model.safetensors")).unwrap();
    assert!(weights(&a) == weights(&b), "the resumed run's weights differ");

    // A stage-0 run's checkpoint resumes at stage 1, saying so.
    let z = tmp.path().join("z");
    ok(&run(&args, &z, 0));
    let ckpt = resume(&z, &c);
    let o = run(&["train", "--resume", s(&ckpt)], &c, 1);
    ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("resuming a ZeRO stage 0 checkpoint at stage 1"), "{err}");
    let (mz, mc) = (metrics(&z), metrics(&c));
    assert_eq!(mz.len(), mc.len());
    for (x, y) in mz.iter().zip(&mc) {
        assert_eq!(x["reward"], y["reward"], "step {}", x["step"]);
    }
}

#[test]
fn unbuilt_and_bad_stages_are_one_line_errors_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    for (cmd, stage, want) in [
        ("train", "2", "stage 2 (sharded gradients) is not built yet"),
        ("sft", "3", "stage 3 (sharded gradients and parameters) is not built yet"),
        ("rm", "7", "7 is not a ZeRO stage"),
        ("dpo", "\"one\"", "distributed.zero_stage"),
    ] {
        let rd = tmp.path().join(cmd);
        let o = Command::new(rlhf_bin())
            .args([cmd, "--run-dir", s(&rd), "--set", &format!("distributed.zero_stage={stage}")])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert!(!o.status.success() && errors.len() == 1, "{cmd} {stage}: {err}");
        assert!(errors[0].contains("distributed.zero_stage") && errors[0].contains(want), "{}", errors[0]);
        assert!(!rd.exists(), "{cmd}: a run directory was created");
    }
}

/// Without clipping, stage 1 is stage 0 bit for bit with the features that touch the trained
/// state: bf16 weights with f32 masters, LoRA (only adapters train), gradient checkpointing and
/// accumulation together in GRPO; and in `rlhf rm` and `rlhf dpo`.
#[test]
fn stage_one_keeps_bf16_lora_checkpointing_accumulation_rm_and_dpo_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let grpo = [
        "train",
        "--algo",
        "grpo",
        "--set",
        "eval.data=\"\"",
        "--set",
        "train.steps=3",
        "--set",
        "train.max_grad_norm=0",
        "--set",
        "run.dtype=\"bf16\"",
        "--set",
        "model.lora.rank=4",
        "--set",
        "train.gradient_checkpointing=true",
        "--set",
        "train.gradient_accumulation_steps=2",
    ];
    let rm = ["rm", "--set", "train.max_steps=4", "--set", "train.max_grad_norm=0"];
    let dpo = ["dpo", "--set", "train.max_steps=4", "--set", "train.max_grad_norm=0"];
    for (label, args, weights) in [
        ("grpo", &grpo[..], "actor/model.safetensors"),
        ("rm", &rm[..], "model/model.safetensors"),
        ("dpo", &dpo[..], "model/model.safetensors"),
    ] {
        let (a, b) = (tmp.path().join(format!("{label}0")), tmp.path().join(format!("{label}1")));
        ok(&run(args, &a, 0));
        ok(&run(args, &b, 1));
        let (wa, wb) = (std::fs::read(a.join(weights)).unwrap(), std::fs::read(b.join(weights)).unwrap());
        assert!(wa == wb, "{label}: stage 1 weights differ from stage 0's");
        let (ma, mb) = (metrics(&a), metrics(&b));
        let last = |m: &[Value]| m.last().unwrap()["mem/optim_gb"].as_f64().unwrap();
        assert!(
            last(&mb) < last(&ma),
            "{label}: stage 1 holds {} GB of optimizer state, stage 0 {}",
            last(&mb),
            last(&ma)
        );
    }
}
