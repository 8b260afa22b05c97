//! ZeRO stage 3 (`[distributed] zero_stage = 3`): the parameters are sharded too, and the
//! checkpointed layer loop all-gathers each layer just before it runs and reduce-scatters its
//! gradients right after its backward. On 2 Gloo ranks it trains as the replicated stage 0 with
//! gradient checkpointing does: bit for bit in SFT, RM and DPO without clipping (the same sums,
//! the same element-wise AdamW); within a tolerance in PPO with a critic, whose clipped global
//! norm is summed in another order, also when a micro-batch has fewer rows than ranks (it runs
//! on whole weights); as stage 2 with bf16 weights, LoRA (the frozen base is sharded too),
//! accumulation and an EMA actor. Each rank holds half of the trained weights while training
//! (`mem/params_gb`). Checkpoints resume bit for bit at stage 3 and re-shard to and from stage 0
//! and one process.

use std::path::Path;
use std::process::{Command, Output};

use rlhf_integration_tests::{behaviour_metrics, copy_dir, metrics, rlhf_bin};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `rlhf ARGS --run-dir DIR` at ZeRO stage `stage` on `nproc` ranks (1: one process), one thread
/// each.
fn run(args: &[&str], run_dir: &Path, stage: u8, nproc: usize) -> Output {
    let mut cmd = Command::new(rlhf_bin());
    cmd.args(args).args(["--run-dir", s(run_dir), "--set", &format!("distributed.zero_stage={stage}")]);
    if nproc > 1 {
        cmd.args(["--nproc", &nproc.to_string()]);
    }
    cmd.env("OMP_NUM_THREADS", "1").output().expect("spawn rlhf")
}

fn ok(o: &Output) -> String {
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    text
}

/// The largest absolute difference between the tensors of two safetensors files.
fn max_weight_diff(a: &Path, b: &Path) -> f64 {
    let ta = tch::Tensor::read_safetensors(a).unwrap();
    let tb: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(b).unwrap().into_iter().collect();
    assert_eq!(ta.len(), tb.len());
    ta.iter().map(|(name, t)| (t - &tb[name]).abs().max().double_value(&[])).fold(0.0, f64::max)
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn last(rows: &[Value], key: &str) -> f64 {
    rows.last().unwrap()[key].as_f64().unwrap_or_else(|| panic!("{key} missing"))
}

/// Behaviour metrics without traffic and the state bytes (which differ by design), and with the
/// reported gradient norm (its squares summed in another order) compared to 1e-6 apart.
fn same_behaviour(a: &Path, b: &Path, label: &str) {
    let (mut ma, mut mb) = (behaviour_metrics(a), behaviour_metrics(b));
    assert_eq!(ma.len(), mb.len(), "{label}: rows");
    for (x, y) in ma.iter_mut().zip(&mut mb) {
        if let (Some(u), Some(v)) = (x.remove("grad_norm"), y.remove("grad_norm")) {
            let (u, v) = (u.as_f64().unwrap(), v.as_f64().unwrap());
            assert!((u - v).abs() <= 1e-6 * u, "{label} step {}: grad_norm {u} against {v}", x["step"]);
        }
        for m in [&mut *x, &mut *y] {
            m.retain(|k, _| !k.starts_with("comm/") && !k.starts_with("mem/"));
        }
    }
    assert_eq!(ma, mb, "{label}: stage 3 metrics against stage 0's");
}

#[test]
fn stage_three_trains_as_stage_zero_and_holds_half_of_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    // Stage 0 with the gradient checkpointing stage 3 turns on: SFT, RM and DPO bit for bit.
    let ck = ["--set", "train.gradient_checkpointing=true", "--set", "train.max_grad_norm=0"];
    for (cmd, steps) in [("sft", "train.steps=5"), ("rm", "train.steps=4"), ("dpo", "train.steps=4")] {
        let args: Vec<&str> = [cmd, "--set", steps].into_iter().chain(ck).collect();
        let (a, b) = (dir(&format!("{cmd}0")), dir(&format!("{cmd}3")));
        ok(&run(&args, &a, 0, 2));
        // Stage 3 turns checkpointing on by itself.
        let log = ok(&run(&[cmd, "--set", steps, "--set", "train.max_grad_norm=0"], &b, 3, 2));
        assert!(log.contains("gradient checkpointing on"), "{log}");
        let w = "model/model.safetensors";
        assert!(bytes(&a.join(w)) == bytes(&b.join(w)), "{cmd}: stage 3 weights differ from stage 0's");
        same_behaviour(&a, &b, cmd);
        let (m0, m3) = (metrics(&a), metrics(&b));
        // Half of every variable's elements (rounded up) on each rank.
        let (p0, p3) = (last(&m0, "mem/params_gb") * 1e9, last(&m3, "mem/params_gb_max") * 1e9);
        assert!(p3 >= p0 / 2.0 && p3 <= p0 / 2.0 + 4.0 * 200.0, "{cmd}: {p3} bytes of weights per rank, stage 0 {p0}");
        assert!(last(&m3, "mem/grads_gb") <= last(&m0, "mem/grads_gb") / 2.0 + 800e-9, "{cmd}: gradients");
    }

    // PPO with a critic and clipping, 7 rows in minibatches of 3: the last has fewer rows than
    // ranks and runs on whole weights.
    let ppo = [
        "train",
        "--algo",
        "ppo",
        "--set",
        "eval.data=\"\"",
        "--set",
        "train.steps=3",
        "--set",
        "rollout.prompts_per_batch=7",
        "--set",
        "rollout.samples_per_prompt=1",
        "--set",
        "train.minibatch_size=3",
        "--set",
        "train.gradient_checkpointing=true",
    ];
    ok(&run(&ppo, &dir("ppo0"), 0, 2));
    ok(&run(&ppo, &dir("ppo3"), 3, 2));
    let (ma, mb) = (metrics(&dir("ppo0")), metrics(&dir("ppo3")));
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x["reward"], y["reward"], "step {}", x["step"]);
        for key in ["grad_norm/actor", "grad_norm/critic", "loss/policy", "loss/value"] {
            let (u, v) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((u - v).abs() <= 1e-5 * u.abs().max(1.0), "step {} {key}: {u} against {v}", x["step"]);
        }
        assert!(y["mem/params_gb"].as_f64() < x["mem/params_gb"].as_f64().map(|v| 0.55 * v));
    }
    for file in ["actor/model.safetensors", "checkpoints/step-000003/critic.safetensors"] {
        let d = max_weight_diff(&dir("ppo0").join(file), &dir("ppo3").join(file));
        assert!(d < 1e-5, "{file} differs by {d}");
    }

    // GRPO with bf16 weights (f32 masters), LoRA, two accumulated micro-batches and an EMA
    // actor: as stage 2, bit for bit (the same reduce-scatters, per layer instead of per bucket).
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
        "--set",
        "train.ema_decay=0.9",
    ];
    ok(&run(&grpo, &dir("grpo2"), 2, 2));
    ok(&run(&grpo, &dir("grpo3"), 3, 2));
    for w in ["actor/model.safetensors", "actor-ema/model.safetensors"] {
        assert!(bytes(&dir("grpo2").join(w)) == bytes(&dir("grpo3").join(w)), "grpo: {w} differs from stage 2's");
    }
}

/// A copy of `from` as a run killed after its step-2 checkpoint, at `to`; returns that checkpoint.
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
    let d = max_weight_diff(&a.join("actor/model.safetensors"), &b.join("actor/model.safetensors"));
    assert!(d <= tol, "weights differ by {d:e}");
}

/// Stage 3 checkpoints (whole weights from the main rank, each rank's optimizer shard) resume
/// bit for bit at stage 3 on 2 ranks, and re-shard: 3 → 0 on one process, 0 → 3 on 2 ranks.
/// Sharding the frozen reference's layers too changes nothing but memory.
#[test]
fn stage_three_checkpoints_resume_exactly_and_re_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
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
    let resume = |from: &str, to: &str, stage: u8, nproc: usize| {
        let ckpt = killed_after_step_two(&dir(from), &dir(to));
        ok(&run(&["train", "--resume", s(&ckpt)], &dir(to), stage, nproc))
    };
    ok(&run(&args, &dir("s3"), 3, 2));
    // The reference's layers sharded too (`shard_frozen`): the same log-probs, so the same run.
    let frozen: Vec<&str> = args.iter().copied().chain(["--set", "distributed.shard_frozen=true"]).collect();
    ok(&run(&frozen, &dir("s3-frozen"), 3, 2));
    let no_comm = |d: &str| {
        let mut rows = behaviour_metrics(&dir(d));
        rows.iter_mut().for_each(|r| r.retain(|k, _| !k.starts_with("comm/")));
        rows
    };
    assert_eq!(no_comm("s3"), no_comm("s3-frozen"), "sharding the reference changed the run");
    let calls = |d: &str| metrics(&dir(d))[1]["comm/calls"].as_f64().unwrap();
    assert!(calls("s3-frozen") > calls("s3"), "the reference's layers were not gathered");
    resume("s3", "s3-again", 3, 2);
    assert_eq!(behaviour_metrics(&dir("s3")), behaviour_metrics(&dir("s3-again")));
    let w = |d: &str| bytes(&dir(d).join("actor/model.safetensors"));
    assert!(w("s3") == w("s3-again"), "the resumed run's weights differ");
    assert!(w("s3") == w("s3-frozen"), "sharding the reference changed the weights");

    let log = resume("s3", "one-s0", 0, 1);
    assert!(log.contains("resuming a ZeRO stage 3 checkpoint at stage 0"), "{log}");
    same_run(&dir("s3"), &dir("one-s0"), 1e-5);

    ok(&run(&args, &dir("s0"), 0, 2));
    let log = resume("s0", "s3-from-s0", 3, 2);
    assert!(log.contains("resuming a ZeRO stage 0 checkpoint at stage 3"), "{log}");
    same_run(&dir("s0"), &dir("s3-from-s0"), 1e-5);
}

/// One epoch of one minibatch over the batch: the experience pass is kept for the loss, and at
/// stage 3 it runs on sharded weights (gathered layer by layer, as the training passes) — the
/// run matches stage 0's with the same reuse, and stage 3 without it.
#[test]
fn stage_three_keeps_the_experience_pass_for_the_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let args = [
        "train",
        "--algo",
        "grpo",
        "--set",
        "eval.data=\"\"",
        "--set",
        "train.steps=3",
        "--set",
        "rollout.prompts_per_batch=4",
        "--set",
        "rollout.samples_per_prompt=4",
        "--set",
        "train.minibatch_size=16",
        "--set",
        "train.gradient_checkpointing=true",
    ];
    ok(&run(&args, &dir("s0"), 0, 2));
    ok(&run(&args, &dir("s3"), 3, 2));
    let no_reuse: Vec<&str> = args.iter().copied().chain(["--set", "train.reuse_old_logprobs=false"]).collect();
    ok(&run(&no_reuse, &dir("s3-no-reuse"), 3, 2));
    let (m0, m3) = (metrics(&dir("s0")), metrics(&dir("s3")));
    for (x, y) in m0.iter().zip(&m3) {
        assert_eq!(x["reward"], y["reward"], "step {}", x["step"]);
        let (u, v) = (x["grad_norm/actor"].as_f64().unwrap(), y["grad_norm/actor"].as_f64().unwrap());
        assert!((u - v).abs() <= 1e-5 * u, "step {}: grad norm {u} against {v}", x["step"]);
    }
    let w = "actor/model.safetensors";
    let d = max_weight_diff(&dir("s0").join(w), &dir("s3").join(w));
    assert!(d < 1e-5, "weights differ by {d}");
    // Kept or computed again, the old log-probs agree to float rounding.
    let d = max_weight_diff(&dir("s3").join(w), &dir("s3-no-reuse").join(w));
    assert!(d < 1e-5, "reusing the pass moved the stage-3 weights by {d}");
}
