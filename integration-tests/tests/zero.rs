//! ZeRO stages 1 (`[distributed] zero_stage = 1`: f32 masters and Adam moments partitioned over
//! the ranks) and 2 (gradients too, reduce-scattered after every micro-batch) on 2 Gloo ranks:
//! without gradient clipping stage 1 trains bit for bit as the replicated stage 0 does (the same
//! sums, the same element-wise AdamW) — also with bf16 weights, LoRA, gradient checkpointing and
//! accumulation, and in `rlhf rm` and `rlhf dpo`; so does stage 2 with one micro-batch per step,
//! while with accumulation it sums the micro-batches' reduced gradients instead of reducing their
//! sum (within a tolerance); with clipping only the global gradient norm is summed in another
//! order, so metrics and weights agree within a tolerance; each rank holds its share of the
//! optimizer state (`mem/optim_gb`) and at stage 2 of the gradients (`mem/grads_gb`); every rank
//! checkpoints its own shard, and a run resumes bit-exactly at its stage and world size and
//! re-shards to others; bad values are one-line config errors naming the key. Stage 3
//! (parameters sharded too, gathered layer by layer) is tested in `zero3.rs`.

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

/// Bytes of training state per rank at `stage` against stage 0, for an f32 model of `n` trained
/// elements on 2 ranks: the two moments of half of every variable (rounded up, so at most one
/// element more per variable; f32 variables are their own masters) against those of all n; at
/// stage 2 half of the gradients too, at stage 1 all of them.
fn check_state_bytes(zero: &[Value], sharded: &[Value], stage: u8) {
    let gb = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {r}"));
    let n = (gb(&zero[0], "mem/optim_gb") * 1e9 / 8.0).round();
    assert_eq!((gb(&zero[0], "mem/grads_gb") * 1e9).round(), 4.0 * n, "stage 0 keeps whole f32 gradients");
    let grads = if stage == 2 { ("mem/grads_gb", 4.0 * n / 2.0) } else { ("mem/grads_gb", 4.0 * n) };
    for r in sharded {
        let grads_max = ("mem/grads_gb_max", grads.1);
        for (key, want) in [("mem/optim_gb", 8.0 * n / 2.0), ("mem/optim_gb_max", 8.0 * n / 2.0), grads, grads_max] {
            let extra = gb(r, key) * 1e9 - want;
            assert!((0.0..8.0 * 100.0).contains(&extra), "stage {stage} {key}: {extra} bytes over {want}: {r}");
        }
        // Weights are whole on every rank below stage 3.
        assert_eq!(gb(r, "mem/params_gb_max"), gb(r, "mem/params_gb"), "{r}");
    }
}

#[test]
fn stages_one_and_two_train_as_stage_zero_and_hold_a_share_of_the_state() {
    let tmp = tempfile::tempdir().unwrap();
    // SFT without clipping (one micro-batch per step): bit for bit at both stages.
    let args = ["sft", "--set", "train.steps=6", "--set", "train.max_grad_norm=0"];
    let a = tmp.path().join("sft0");
    ok(&run(&args, &a, 0));
    let weights = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    for stage in [1, 2] {
        let b = tmp.path().join(format!("sft{stage}"));
        ok(&run(&args, &b, stage));
        // Everything but the traffic (a reduce-scatter and an all-gather instead of an
        // all-reduce), the gradients' bytes, and the reported gradient norm, whose squares are
        // summed in another order.
        let (mut ma, mut mb) = (behaviour_metrics(&a), behaviour_metrics(&b));
        assert_eq!((ma.len(), mb.len()), (7, 7), "the evaluation before training and 6 steps");
        for (x, y) in ma.iter_mut().zip(&mut mb) {
            if let (Some(u), Some(v)) = (x.remove("grad_norm"), y.remove("grad_norm")) {
                let (u, v) = (u.as_f64().unwrap(), v.as_f64().unwrap());
                assert!((u - v).abs() <= 1e-6 * u, "step {}: grad_norm {u} against {v}", x["step"]);
            }
            for m in [&mut *x, &mut *y] {
                m.retain(|k, _| !k.starts_with("comm/") && k != "mem/grads_gb");
            }
        }
        assert_eq!(ma, mb, "stage {stage} metrics against stage 0's");
        assert!(weights(&a) == weights(&b), "stage {stage} weights differ from stage 0's");
        check_state_bytes(&metrics(&a)[1..], &metrics(&b)[1..], stage);
    }

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
    let a = tmp.path().join("ppo0");
    ok(&run(&args, &a, 0));
    for stage in [1, 2] {
        let b = tmp.path().join(format!("ppo{stage}"));
        ok(&run(&args, &b, stage));
        let (ma, mb) = (metrics(&a), metrics(&b));
        assert_eq!(ma.len(), mb.len());
        for (x, y) in ma.iter().zip(&mb) {
            assert_eq!(x["reward"], y["reward"], "stage {stage} step {}", x["step"]);
            for key in ["grad_norm/actor", "grad_norm/critic", "loss/policy", "loss/value"] {
                let (u, v) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
                assert!(
                    (u - v).abs() <= 1e-4 * u.abs().max(1.0),
                    "stage {stage} step {} {key}: {u} against {v}",
                    x["step"]
                );
            }
        }
        for file in ["actor/model.safetensors", "checkpoints/step-000003/critic.safetensors"] {
            let d = max_weight_diff(&a.join(file), &b.join(file));
            assert!(d < 1e-4, "stage {stage}: {file} differs by {d}");
        }
    }
}

/// `rlhf ARGS --run-dir DIR` on `nproc` ranks (1: one process) at ZeRO stage `stage`.
fn run_on(args: &[&str], run_dir: &Path, stage: u8, nproc: usize) -> Output {
    if nproc == 2 {
        return run(args, run_dir, stage);
    }
    Command::new(rlhf_bin())
        .args(args)
        .args(["--run-dir", s(run_dir), "--set", &format!("distributed.zero_stage={stage}")])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("spawn rlhf")
}

/// A copy of `from` as a run killed after its step-2 checkpoint (without the later checkpoint
/// and the final actor), at `to`; returns that checkpoint.
fn killed_after_step_two(from: &Path, to: &Path) -> std::path::PathBuf {
    copy_dir(from, to);
    std::fs::remove_dir_all(to.join("checkpoints/step-000004")).unwrap();
    std::fs::remove_dir_all(to.join("actor")).unwrap();
    to.join("checkpoints/step-000002")
}

/// Rewards and lengths of every step equal (the same tokens sampled), the weights within `tol`.
fn same_run(a: &Path, b: &Path, tol: f64) {
    let (ma, mb) = (metrics(a), metrics(b));
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        for k in ["reward", "completions/mean_length"] {
            assert_eq!(x[k], y[k], "step {}: {k}", x["step"]);
        }
    }
    let w = "actor/model.safetensors";
    let d = max_weight_diff(&a.join(w), &b.join(w));
    println!("{} vs {}: max weight difference {d:e}", a.display(), b.display());
    assert!(d <= tol, "weights differ by {d:e}");
}

/// At stages 1 and 2 every rank writes its shard of the optimizer state and the manifest seals
/// them with the layout; a run killed after a checkpoint resumes from it bit for bit at its
/// stage and world size; at another world size (2 → 1, 1 → 2) or stage (2 → 0, 0 → 1) the state
/// is re-cut from the shards and the run matches an uninterrupted one within the tolerance of
/// 2 ranks against 1 process.
#[test]
fn sharded_checkpoints_resume_exactly_and_re_shard_to_other_stages_and_world_sizes() {
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
    let dir = |n: &str| tmp.path().join(n);
    ok(&run(&args, &dir("two-s2"), 2));
    let ckpt = dir("two-s2").join("checkpoints/step-000002");
    let mut files: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with("optimizer-"))
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "optimizer-actor.layout.json",
            "optimizer-actor.rank-00000-of-00002.safetensors",
            "optimizer-actor.rank-00001-of-00002.safetensors"
        ]
    );
    let manifest = std::fs::read_to_string(ckpt.join("manifest.json")).unwrap();
    assert!(manifest.contains("optimizer-actor.rank-00001-of-00002.safetensors"), "{manifest}");

    // A shard missing or damaged: a one-line error naming it, before anything trains.
    let broken = dir("broken");
    let ckpt = killed_after_step_two(&dir("two-s2"), &broken);
    let shard = ckpt.join("optimizer-actor.rank-00001-of-00002.safetensors");
    let good = std::fs::read(&shard).unwrap();
    // Truncated (caught by its size on every rank), or one byte flipped (caught by its checksum
    // on the rank that reads it: rank 1 at the same world size).
    let mut flipped = good.clone();
    *flipped.last_mut().unwrap() ^= 0xff;
    for bad in [b"not a shard".to_vec(), flipped] {
        std::fs::write(&shard, &bad).unwrap();
        let o = run(&["train", "--resume", s(&ckpt)], &broken, 2);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && !err.contains("panicked"), "{err}");
        assert!(err.contains("corrupt checkpoint: optimizer-actor.rank-00001-of-00002.safetensors has"), "{err}");
    }
    std::fs::remove_file(&shard).unwrap();
    let o = run_on(&["train", "--resume", s(&ckpt)], &broken, 0, 1);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("optimizer-actor.rank-00001-of-00002.safetensors is missing"), "{err}");

    let resume = |from: &str, to: &str, stage: u8, nproc: usize| {
        let ckpt = killed_after_step_two(&dir(from), &dir(to));
        let o = run_on(&["train", "--resume", s(&ckpt)], &dir(to), stage, nproc);
        ok(&o);
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // Same stage and world size: bit for bit.
    resume("two-s2", "two-s2-again", 2, 2);
    assert_eq!(behaviour_metrics(&dir("two-s2")), behaviour_metrics(&dir("two-s2-again")));
    let weights = |d: &str| std::fs::read(dir(d).join("actor/model.safetensors")).unwrap();
    assert!(weights("two-s2") == weights("two-s2-again"), "the resumed run's weights differ");

    // 2 ranks at stage 2 → one process (stage 0): as the 2-rank run went on.
    let err = resume("two-s2", "one-s0", 0, 1);
    assert!(err.contains("resuming a checkpoint of 2 data-parallel rank(s) on 1"), "{err}");
    assert!(err.contains("resuming a ZeRO stage 2 checkpoint at stage 0"), "{err}");
    same_run(&dir("two-s2"), &dir("one-s0"), 1e-5);

    // One process at stage 1 → 2 ranks at stage 2; and a stage-0 checkpoint → 2 ranks at stage 1.
    ok(&run_on(&args, &dir("one-s1"), 1, 1));
    resume("one-s1", "two-s2-from-one", 2, 2);
    same_run(&dir("one-s1"), &dir("two-s2-from-one"), 1e-5);
    ok(&run(&args, &dir("two-s0"), 0));
    let err = resume("two-s0", "two-s1-from-s0", 1, 2);
    assert!(err.contains("resuming a ZeRO stage 0 checkpoint at stage 1"), "{err}");
    same_run(&dir("two-s0"), &dir("two-s1-from-s0"), 1e-5);
}

#[test]
fn bad_stages_are_one_line_errors_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = ["--set", "model.lora.rank=4", "--set", "model.lora.dropout=0.1"];
    let phase_lora = ["--set", "model.lora.rank=4", "--set", "model.lora.dropout=0.1"];
    for (cmd, stage, extra, want) in [
        ("train", "3", &lora[..], "stage 3 recomputes each layer in backward"),
        ("sft", "3", &phase_lora[..], "needs lora.dropout = 0"),
        ("rm", "7", &[][..], "7 is not a ZeRO stage: 0, 1, 2 or 3"),
        ("train", "2", &["--set", "distributed.shard_frozen=true"][..], "needs zero_stage = 3"),
        ("dpo", "\"one\"", &[][..], "distributed.zero_stage"),
    ] {
        let rd = tmp.path().join(cmd);
        let o = Command::new(rlhf_bin())
            .args([cmd, "--run-dir", s(&rd), "--set", &format!("distributed.zero_stage={stage}")])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert!(!o.status.success() && errors.len() == 1, "{cmd} {stage}: {err}");
        let key = if want.contains("zero_stage = 3") { "distributed.shard_frozen" } else { "distributed.zero_stage" };
        assert!(errors[0].contains(key) && errors[0].contains(want), "{}", errors[0]);
        assert!(!rd.exists(), "{cmd}: a run directory was created");
    }
}

/// Without clipping, stage 1 is stage 0 bit for bit with the features that touch the trained
/// state: bf16 weights with f32 masters, LoRA (only adapters train), gradient checkpointing and
/// accumulation together in GRPO; and in `rlhf rm` and `rlhf dpo`. Stage 2 is too with one
/// micro-batch per step (rm, dpo); with GRPO's 2 accumulated micro-batches it adds reduced bf16
/// gradients instead of reducing their bf16 sum, so the weights agree to a bf16 rounding.
#[test]
fn stages_one_and_two_keep_bf16_lora_checkpointing_accumulation_rm_and_dpo() {
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
    let rm = ["rm", "--set", "train.steps=4", "--set", "train.max_grad_norm=0"];
    let dpo = ["dpo", "--set", "train.steps=4", "--set", "train.max_grad_norm=0"];
    for (label, args, weights) in [
        ("grpo", &grpo[..], "actor/model.safetensors"),
        ("rm", &rm[..], "model/model.safetensors"),
        ("dpo", &dpo[..], "model/model.safetensors"),
    ] {
        let a = tmp.path().join(format!("{label}0"));
        ok(&run(args, &a, 0));
        for stage in [1, 2] {
            let b = tmp.path().join(format!("{label}{stage}"));
            ok(&run(args, &b, stage));
            if stage == 2 && label == "grpo" {
                let d = max_weight_diff(&a.join(weights), &b.join(weights));
                assert!(d <= 1e-3, "{label}: stage 2 weights differ from stage 0's by {d}");
            } else {
                let (wa, wb) = (std::fs::read(a.join(weights)).unwrap(), std::fs::read(b.join(weights)).unwrap());
                assert!(wa == wb, "{label}: stage {stage} weights differ from stage 0's");
            }
            let (ma, mb) = (metrics(&a), metrics(&b));
            let last = |m: &[Value], k: &str| m.last().unwrap()[k].as_f64().unwrap();
            assert!(
                last(&mb, "mem/optim_gb") < last(&ma, "mem/optim_gb"),
                "{label}: stage {stage} holds {} GB of optimizer state, stage 0 {}",
                last(&mb, "mem/optim_gb"),
                last(&ma, "mem/optim_gb")
            );
            let (g0, g) = (last(&ma, "mem/grads_gb"), last(&mb, "mem/grads_gb"));
            assert!(
                if stage == 2 { g < 0.6 * g0 } else { g == g0 },
                "{label}: stage {stage} grads {g} GB, stage 0 {g0}"
            );
        }
    }
}
