//! `train.share_prompts` (on by default) computes each prompt once for its G rows: a GRPO run
//! with it trains as the run without it — the first step's rollouts and rewards exactly, its
//! losses, KL, entropy and gradient norm within float rounding — and with LoRA dropout it stays
//! off, so such a run is the unshared run bit for bit. `train.padding_free` (packed rows without
//! their padding) trains as the padded run within float rounding too, with and without gradient
//! checkpointing, with shared prompts laid once in the packed rows, on the hybrid Qwen3.5 and,
//! with PPO, its critic. `train.micro_batch_tokens`
//! (micro-batches by a token budget) trains as one micro-batch per minibatch within rounding:
//! GRPO's per-sequence and per-token means, RLOO's, and PPO's actor and critic.

use std::path::{Path, PathBuf};

use rlhf_integration_tests::{behaviour_metrics, rlhf};
use serde_json::{Map, Value};

fn run(dir: &Path, name: &str, share: bool, extra: &[&str]) -> PathBuf {
    run_algo(dir, "grpo", name, share, extra)
}

fn run_algo(dir: &Path, algo: &str, name: &str, share: bool, extra: &[&str]) -> PathBuf {
    let rd = dir.join(name);
    let flag = format!("train.share_prompts={share}");
    let mut args = vec!["train", "--algo", algo, "--run-dir", rd.to_str().unwrap(), "--set", "train.steps=2"];
    // The preset's held-out evaluation is off: row 0 is then the first step.
    args.extend(["--set", "eval.data=\"\""]);
    args.extend(["--set", &flag]);
    args.extend_from_slice(extra);
    let out = rlhf(&args);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    rd
}

fn num(m: &Map<String, Value>, key: &str) -> f64 {
    m.get(key).and_then(Value::as_f64).unwrap_or_else(|| panic!("no `{key}` in {m:?}"))
}

#[test]
fn sharing_prompts_trains_as_without_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let shared = behaviour_metrics(&run(dir.path(), "shared", true, &[]));
    let plain = behaviour_metrics(&run(dir.path(), "plain", false, &[]));
    // Not bit for bit: the shared pass sums in another order.
    assert_same_within_rounding("shared prompts", &shared[0], &plain[0], &[]);
}

/// Step 1 of two runs: the same rollouts, and the losses, KL, entropy and gradient norm (with
/// `more`) within float rounding, but not bit for bit (the other pass ran).
fn assert_same_within_rounding(what: &str, a: &Map<String, Value>, b: &Map<String, Value>, more: &[&str]) {
    for key in ["reward", "reward_std", "completions/mean_length"] {
        assert_eq!(a[key], b[key], "{what}, step 1: `{key}` (the same rollouts)");
    }
    let keys = ["loss/total", "kl", "entropy", "grad_norm/actor", "rollout/kl", "approx_kl"];
    for &key in keys.iter().chain(more) {
        let (x, y) = (num(a, key), num(b, key));
        let tol = 1e-4 * x.abs().max(y.abs()).max(1e-3);
        assert!((x - y).abs() <= tol, "{what}, step 1: `{key}` {x} against {y}");
    }
    assert_ne!(a["grad_norm/actor"], b["grad_norm/actor"], "{what}: the other pass did not run");
}

#[test]
fn padding_free_passes_train_as_padded_ones_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    // A short warm-up: rewards to learn from, and completions that end anywhere in 16 tokens
    // (about 5 on average), so the rows pack.
    let lengths = ["--set", "warmup.steps=3", "--set", "rollout.max_new_tokens=16"];
    let packed = [&lengths[..], &["--set", "train.padding_free=true"]].concat();
    let plain = behaviour_metrics(&run(dir.path(), "plain", false, &lengths));
    let free = behaviour_metrics(&run(dir.path(), "packed", false, &packed));
    assert_same_within_rounding("padding-free", &free[0], &plain[0], &[]);
    // With shared prompts: each prompt laid once in a packed row, its completions after it.
    let both = behaviour_metrics(&run(dir.path(), "packed-shared", true, &packed));
    assert_same_within_rounding("padding-free with shared prompts", &both[0], &plain[0], &[]);
    assert_ne!(both[0]["grad_norm/actor"], free[0]["grad_norm/actor"], "the packed rows shared no prompt");
    // Checkpointed: the packed layers are recomputed, their output unpacked through a graph.
    let ck = ["--set", "train.gradient_checkpointing=true"];
    let plain = behaviour_metrics(&run(dir.path(), "plain-ck", false, &[&lengths[..], &ck[..]].concat()));
    let free = behaviour_metrics(&run(dir.path(), "packed-ck", false, &[&packed[..], &ck[..]].concat()));
    assert_same_within_rounding("padding-free, checkpointed", &free[0], &plain[0], &[]);
    // Qwen3.5: its Gated DeltaNet layers restart their state where a packed sequence begins.
    let qwen = ["--set", "model.actor=\"builtin:tiny-qwen3.5\""];
    let plain = behaviour_metrics(&run(dir.path(), "qwen-plain", false, &[&lengths[..], &qwen[..]].concat()));
    let free = behaviour_metrics(&run(dir.path(), "qwen-packed", false, &[&packed[..], &qwen[..]].concat()));
    assert_same_within_rounding("padding-free Qwen3.5", &free[0], &plain[0], &[]);
    // PPO: the critic's values padding-free too.
    let plain = behaviour_metrics(&run_algo(dir.path(), "ppo", "ppo-plain", false, &lengths));
    let free = behaviour_metrics(&run_algo(dir.path(), "ppo", "ppo-packed", false, &packed));
    let critic = ["loss/value", "grad_norm/critic", "ppo/values_mean", "ppo/returns_mean"];
    assert_same_within_rounding("padding-free PPO", &free[0], &plain[0], &critic);
    // PPO with four samples a prompt: the actor's and the critic's prompts laid once.
    let four = ["--set", "rollout.samples_per_prompt=4"];
    let plain = behaviour_metrics(&run_algo(dir.path(), "ppo", "ppo4-plain", false, &[&lengths[..], &four].concat()));
    let both = behaviour_metrics(&run_algo(dir.path(), "ppo", "ppo4-packed", true, &[&packed[..], &four].concat()));
    assert_same_within_rounding("padding-free PPO with shared prompts", &both[0], &plain[0], &critic);
}

#[test]
fn with_lora_dropout_prompts_are_not_shared() {
    let dir = tempfile::tempdir().unwrap();
    let lora = ["--set", "model.lora.rank=4", "--set", "model.lora.dropout=0.1"];
    let shared = behaviour_metrics(&run(dir.path(), "shared", true, &lora));
    let plain = behaviour_metrics(&run(dir.path(), "plain", false, &lora));
    assert_eq!(shared, plain);
}

/// Micro-batches of at most 100 tokens (a minibatch of 64 rows of about 10 tokens splits into seven
/// or so, of unequal numbers of rows; the old policy's, reference's and critic's passes likewise):
/// step 1 as with one micro-batch per minibatch — the same rollouts, the loss, the gradient norms
/// (each optimizer step's, averaged) and the old policy's entropy within float rounding, but not
/// bit for bit. A mean per micro-batch instead of over the step (GRPO's sequence mean without
/// `step_rows`) fails it: the loss by 15 %, the gradient norm by 3 %. The algorithms' own metrics
/// (KL, clip fractions) are means over unequal micro-batches, not compared.
#[test]
fn micro_batches_by_a_token_budget_train_as_whole_minibatches_within_rounding() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--set", "warmup.steps=3", "--set", "rollout.max_new_tokens=16", "--set", "train.padding_free=true"];
    let budget = [&base[..], &["--set", "train.micro_batch_tokens=100"]].concat();
    let cases: [(&str, &[&str], &[&str]); 4] = [
        ("grpo", &[], &[]),
        ("grpo", &["--set", "algorithm.config.loss_type=\"dapo\""], &[]),
        ("rloo", &[], &[]),
        ("ppo", &[], &["loss/value", "grad_norm/critic"]),
    ];
    for (i, (algo, extra, more)) in cases.into_iter().enumerate() {
        let whole =
            behaviour_metrics(&run_algo(dir.path(), algo, &format!("whole-{i}"), false, &[&base[..], extra].concat()));
        let split = behaviour_metrics(&run_algo(
            dir.path(),
            algo,
            &format!("split-{i}"),
            false,
            &[&budget[..], extra].concat(),
        ));
        let (a, b) = (&split[0], &whole[0]);
        let what = format!("{algo} {extra:?} in micro-batches");
        for key in ["reward", "reward_std", "completions/mean_length"] {
            assert_eq!(a[key], b[key], "{what}, step 1: `{key}` (the same rollouts)");
        }
        // The old policy's entropy over the batch: its pass ran in micro-batches too.
        for &key in ["loss/total", "grad_norm/actor", "rollout/entropy"].iter().chain(more) {
            let (x, y) = (num(a, key), num(b, key));
            let tol = 1e-4 * x.abs().max(y.abs()).max(1e-3);
            assert!((x - y).abs() <= tol, "{what}, step 1: `{key}` {x} against {y}");
        }
        assert_ne!(a["grad_norm/actor"], b["grad_norm/actor"], "{what}: the micro-batches did not run");
    }
    // 2 ranks at ZeRO stage 3, each splitting its half of a minibatch (and of the experience
    // passes): every micro-batch's sharded passes are collectives both ranks join; the step is
    // the one process's.
    let zero3 = ["--nproc", "2", "--set", "distributed.zero_stage=3"];
    let two = behaviour_metrics(&run_algo(dir.path(), "grpo", "two", false, &[&budget[..], &zero3[..]].concat()));
    let one = behaviour_metrics(&dir.path().join("whole-0"));
    for key in ["reward", "loss/total", "grad_norm/actor"] {
        let (x, y) = (num(&two[0], key), num(&one[0], key));
        assert!((x - y).abs() <= 1e-4 * x.abs().max(y.abs()).max(1e-3), "2 ranks, step 1: `{key}` {x} against {y}");
    }
    // Odd minibatches (16 rows in 5, 5, 5 and 1: 3 rows on rank 0 and 2 on rank 1, then 1 and
    // none), after a warm-up long enough for rewards to differ within groups: GRPO's per-sample
    // mean is over each step's samples, so 2 ranks train as one process — with whole shares, and
    // in micro-batches of a row at stage 3, where rank 1's empty ones run on whole weights.
    let odd = ["--set", "warmup.steps=20", "--set", "rollout.prompts_per_batch=2", "--set", "train.minibatch_size=5"];
    let one = behaviour_metrics(&run_algo(dir.path(), "grpo", "odd-one", false, &[&base[..], &odd[..]].concat()));
    assert!(num(&one[0], "reward_std") > 0.0, "no reward signal: {:?}", one[0]);
    let two = behaviour_metrics(&run_algo(
        dir.path(),
        "grpo",
        "odd-two",
        false,
        &[&base[..], &odd[..], &["--nproc", "2"]].concat(),
    ));
    let rows = ["--set", "train.micro_batch_tokens=1"];
    let split =
        run_algo(dir.path(), "grpo", "odd-split", false, &[&base[..], &odd[..], &rows[..], &zero3[..]].concat());
    let split = behaviour_metrics(&split);
    for (what, two) in [("whole shares", &two), ("micro-batches of a row", &split)] {
        for key in ["reward", "loss/total", "grad_norm/actor"] {
            let (x, y) = (num(&two[0], key), num(&one[0], key));
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(y.abs()).max(1e-3),
                "odd, 2 ranks, {what}: `{key}` {x} against {y}"
            );
        }
    }
}

/// The budget needs padding-free passes: refused before the run starts, naming the key.
#[test]
fn a_token_budget_without_padding_free_passes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let out =
        rlhf(&["train", "--algo", "grpo", "--run-dir", rd.to_str().unwrap(), "--set", "train.micro_batch_tokens=128"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("train.micro_batch_tokens") && err.contains("padding_free"), "{err}");
    assert!(!rd.exists(), "the run directory was created: {err}");
}
