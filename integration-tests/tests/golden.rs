//! Golden runs: fixed-seed CPU runs of every embedded RL preset, a PPO run through every optional
//! path of the step (critic, several epochs and minibatches, EMA, ptx), an SFT run and an RM run,
//! compared with the files recorded in `integration-tests/golden/`, so a refactor of the host that
//! changes what a run computes fails here, on whatever x86-64 machine the test runs. The RL runs
//! also run with `train.share_prompts = false` (`<name>-unshared.json`), the path every pass took
//! before prompt sharing existed.
//!
//! # What is compared, and how (`rlhf_integration_tests::golden`)
//! - **Exactly**: what is discrete — the token ids sampled at every step, the numbers of steps,
//!   rows and completions, completion lengths, rule rewards and everything the host computes from
//!   them in f64 (`reward`, `reward_std`, `rewards/*`), accuracies, the learning rate.
//! - **Within a tolerance**: every other metric (`|Δ| ≤ 1e-6 + 1e-3·|x|`) and the final weights,
//!   through per-tensor summaries (sum within 1e-4 of the sum of magnitudes, L1 and L2 norms within
//!   1e-4 relative, six elements at fixed positions within 1e-4 of the larger of their magnitude
//!   and the tensor's RMS).
//!
//! # Why not bit for bit
//! libtorch, MKL and oneDNN choose their CPU kernels at run time from the CPU (AVX2 on AMD Zen 3;
//! AVX-512 on Zen 4 and 5; AVX-512 with AMX on Intel Xeon), and kernels of different vector widths
//! sum in different orders, so the same binary with the same seed gives the same run differing in
//! the last bits of its floats. Pinning every library to its AVX2 path was tried and is not enough:
//! an Intel Xeon under that pin still differed from the AMD machines (MKL's reproducibility modes
//! differ between vendors).
//!
//! # Measured spread, and the tolerances chosen
//! Measured on 2026-11-25 on an AMD EPYC Zen 4 (AVX-512, AVX512-BF16) by running every golden job
//! under the kernel settings below and comparing each with `native`; the Intel row is from an
//! Intel Xeon (AVX-512, AMX) against the AMD recording, 12 GRPO steps under the old AVX2 pin. The
//! float column is the largest `(|Δ| − 1e-6) / max(|a|, |b|)` over all rows and metrics; the
//! weight columns are the largest difference of a sum relative to the tensor's sum of magnitudes
//! (or of an L1 or L2 norm relative to it), and of a fixed element relative to the larger of its
//! magnitude and the tensor's RMS. Sampled tokens and discrete metrics never differed.
//!
//! | run (steps)           | float metrics | weight sums, norms | weight elements |
//! |-----------------------|---------------|--------------------|-----------------|
//! | grpo (12)             | 2.2e-5        | 3.9e-7             | 2.9e-5          |
//! | ppo (3)               | 2.8e-5        | 3.2e-7             | 1.6e-5          |
//! | ppo-seq (3)           | 1.4e-5        | 5.5e-7             | 2.2e-5          |
//! | ppo-all-paths (4)     | 2.1e-5        | 7.1e-7             | 1.1e-4          |
//! | sft (12)              | 4.0e-8        | 2.1e-7             | 6.5e-6          |
//! | rm (12)               | 3.1e-6        | 7.8e-8             | 2.8e-6          |
//! | Intel Xeon, grpo (12) | 3.8e-5        | —                  | —               |
//!
//! (`-unshared` runs: the same within 10 %.) The tolerances are 1e-3 for float metrics (26× the
//! largest measured), 1e-4 for weight sums and norms (see below) and 1e-3 for weight elements (9×).
//! Differences grow with the steps where a run amplifies them, which set the run lengths:
//! sequence-level PPO's clipped sequence ratios grow them about 3× per step (1.5e-2 by step 10,
//! so 3 steps), token-level PPO's reached 3e-4 by step 4 (so 3), the reward model's about 1.4×
//! per step (2e-4 by step 18 and 0.24 by step 74, so 12 of its 74). GRPO stays under 3e-5 over its
//! 12 steps.
//!
//! Re-recorded on 2026-11-27 when sampling changed (counter-based noise on the device instead of
//! libtorch's generator: the same distribution, other draws, so other trajectories). The new GRPO
//! trajectory amplified kernel differences more: under `portable` its `approx_kl` at step 10 moved
//! 2.2e-3 relative, past the tolerance, so the GRPO run is now 9 steps (within the tolerance under
//! every setting). SFT and RM were not re-recorded: this release's fused projections and norms
//! keep them within the tolerances above (largest changes 1.7e-7 of a float metric and 3.9e-6 of
//! a weight summary for SFT; 7.9e-5 and 2.6e-6 for RM).
//!
//! On 2026-11-28 the LM head's log-probs moved from `logits − logsumexp(logits)` to libtorch's
//! fused `log_softmax` (the same values to the last bits; nothing re-recorded), and on an Intel
//! Xeon the `aten-avx2` setting's sequence-level PPO run then ended with one tensor,
//! `layers.0.self_attn.k_proj`, 1.5e-5 of its magnitudes from `native`'s (its L1 and L2 norms
//! 1.5e-5 and 1.9e-5 relative) — already after 2 steps, every other tensor within 1e-6. A key
//! projection has directions whose exact gradient is zero (a shift of every key a query sees
//! leaves its softmax unchanged); there the gradient is rounding noise, and Adam, dividing by its
//! own running magnitude, turns noise into steps of the full learning rate whose sign depends on
//! the kernels. The weight summaries' tolerance is therefore 1e-4 (7× that), as for the elements
//! above; a changed learning rate or β still fails on the metrics and tokens.
//!
//! The same run on the Zen 4 under the old AVX2 pin reproduced the Zen 3 recording bit for bit
//! (every weight hash and metric); the pin held between the AMD kinds but not on Intel, where MKL
//! takes other paths. It is no longer used: no test depends on one kernel setting.
//!
//! Caught (`golden_tolerance_catches_…`): the learning rate off by 1e-3 relative flips sampled
//! tokens from step 4 and moves `kl` by 22 %; β off by 1e-3 samples the same tokens and moves
//! `approx_kl` by 2e-2, `loss/total` by 5.8e-3 and the weight norms by 1.1e-5.
//!
//! Each run uses one intra-op thread (`OMP_NUM_THREADS=1`): the reduction order also depends on
//! the thread count.
//!
//! # Kernel settings
//! Every run is made under each setting of `RLHF_GOLDEN_KERNELS` (default `all`; or a
//! comma-separated list), each standing in for a CPU kind this machine is not: `native` (what
//! libtorch, MKL and oneDNN pick here), `portable` (libtorch's `DEFAULT` kernels, `MKL_CBWR=
//! COMPATIBLE`, oneDNN at SSE4.1), `aten-avx2`, `aten-avx512` (where the CPU has AVX-512) and
//! `mkl-compatible`. The golden file is recorded under `native`. On the Zen 4, `aten-avx512` and
//! `MKL_CBWR=AVX512` gave `native`'s bits, and oneDNN's setting changed nothing (no f32 path here
//! goes through it). A whole pass over the settings takes about 25 s.
//!
//! # Re-recording
//! Only for an intended change of behaviour, said in the commit: `cargo xtask test
//! --record-goldens` prints, per metric, the old and new value and the relative change, then
//! writes the files. It leaves the `-unshared` files, the older reference, as they are;
//! `RLHF_GOLDEN_RECORD=all` records them too.
//!
//! Bit-exactness is still promised, and tested, where two runs are made on one machine in one test:
//! resume after a kill (`run_ops.rs`), checkpointing on and off (`checkpointing.rs`), gradient
//! accumulation (`accumulation.rs`), and `run.save_rollouts` on and off (below).

use std::path::{Path, PathBuf};

use rlhf_integration_tests::golden::{self, Kernels, KERNELS};
use serde_json::{json, Value};

fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden").join(format!("{name}.json"))
}

fn read_golden(name: &str) -> Value {
    let path = golden_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (record with `cargo xtask test --record-goldens`)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `native` setting: this machine's own kernels.
const NATIVE: &Kernels = &KERNELS[0];

/// Whether this run records `name` instead of checking it (see the module docs).
fn recording(name: &str) -> bool {
    let record = std::env::var("RLHF_GOLDEN_RECORD").unwrap_or_default();
    record == "all" || (record == "1" && !name.ends_with("-unshared"))
}

/// Checks the run of `args` under every selected kernel setting against the golden file `name`,
/// or records it. `recorded_args` replaces the arguments in the file when they hold a path of
/// this machine.
fn check(name: &str, args: &[&str], model_sub: &str, recorded_args: Option<Value>) {
    let capture = |kernels: &Kernels| {
        let mut got = golden::capture(args, model_sub, kernels);
        if let Some(a) = &recorded_args {
            got["args"] = a.clone();
        }
        got
    };
    if recording(name) {
        let got = capture(NATIVE);
        let path = golden_path(name);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let old: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            for line in golden::changes(&old, &got) {
                eprintln!("{name}: {line}");
            }
        }
        std::fs::write(&path, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        eprintln!("recorded {}", path.display());
        return;
    }
    let want = read_golden(name);
    let mut failures = Vec::new();
    for kernels in golden::selected_kernels() {
        let got = capture(&kernels);
        failures.extend(golden::compare(&got, &want, false).into_iter().map(|l| format!("[{}] {l}", kernels.name)));
    }
    let shown: Vec<&String> = failures.iter().take(30).collect();
    assert!(failures.is_empty(), "{name}: {} difference(s) from the golden file:\n{shown:#?}", failures.len());
}

/// The RL goldens train on the whole built-in task, not the presets' 44-prompt split: the
/// built-in model's random initialisation differs by 5e-7 between kernel settings (libtorch's
/// vectorised `normal_`), and the 20-step warm-up on the split amplifies that to 6e-4 (1e-3 in the
/// first step's KL), while on the whole task the runs stayed within 3e-5 (the table above). The
/// presets' held-out evaluation stays on, so its metrics are compared too.
const FULL_TASK: &[&str] = &["--set", "data.prompts=\"builtin:addition\""];

/// The RL goldens run twice: as configured (each prompt's rows share one pass over it,
/// `train.share_prompts`), and with that off (`<name>-unshared`).
fn check_rl(name: &str, args: &[&str]) {
    let args = [args, FULL_TASK].concat();
    check(name, &args, "actor", None);
    let mut unshared = args.to_vec();
    unshared.extend(["--set", "train.share_prompts=false"]);
    check(&format!("{name}-unshared"), &unshared, "actor", None);
}

#[test]
fn golden_grpo() {
    check_rl("grpo", &["train", "--algo", "grpo", "--set", "train.steps=9"]);
}

#[test]
fn golden_ppo() {
    check_rl("ppo", &["train", "--algo", "ppo", "--set", "train.steps=3"]);
}

#[test]
fn golden_ppo_seq() {
    check_rl("ppo-seq", &["train", "--algo", "ppo-seq", "--set", "train.steps=3"]);
}

/// PPO through every optional path of the step: critic, 2 epochs over 3 minibatches, EMA, ptx.
#[test]
fn golden_ppo_all_paths() {
    let ptx = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden").join("ptx.jsonl");
    let ptx_set = format!("train.ptx_data={}", ptx.display());
    for (name, share) in [("ppo-all-paths", true), ("ppo-all-paths-unshared", false)] {
        let mut args = vec!["train", "--algo", "ppo"];
        for set in ["train.steps=4", "train.ppo_epochs=2", "train.minibatch_size=48", "train.ema_decay=0.9"] {
            args.extend(["--set", set]);
        }
        if !share {
            args.extend(["--set", "train.share_prompts=false"]);
        }
        args.extend(FULL_TASK);
        args.extend(["--set", "train.ptx_coef=0.5", "--set", &ptx_set]);
        // The ptx path is machine-specific: the golden file records it relative to integration-tests/.
        let mut recorded = json!(args);
        *recorded.as_array_mut().unwrap().last_mut().unwrap() = json!("train.ptx_data=golden/ptx.jsonl");
        check(name, &args, "actor", Some(recorded));
    }
}

#[test]
fn golden_sft() {
    check("sft", &["sft", "--set", "train.epochs=2"], "model", None);
}

#[test]
fn golden_rm() {
    check("rm", &["rm", "--set", "train.epochs=1", "--set", "train.max_steps=12"], "model", None);
}

/// The tolerances still catch a change a refactor could make: the GRPO golden run with its
/// learning rate off by one part in a thousand (5e-4 → 5.005e-4), or its KL coefficient β off by
/// one part in a thousand (0.04 → 0.04004), must fail the comparison, and in the float metrics,
/// not only in the sampled tokens (measured: the learning rate moves `kl` by 22 % and flips
/// sampled tokens from step 4; β samples the same tokens and moves `approx_kl` by 2e-2).
#[test]
fn golden_tolerance_catches_a_learning_rate_or_kl_coefficient_off_by_a_thousandth() {
    if recording("grpo") {
        return;
    }
    let want = read_golden("grpo");
    for set in ["train.actor_lr=0.0005005", "algorithm.config.beta=0.04004"] {
        let args = [&["train", "--algo", "grpo", "--set", "train.steps=9", "--set", set], FULL_TASK].concat();
        let got = golden::capture(&args, "actor", NATIVE);
        let bad = golden::compare(&got, &want, true);
        let floats =
            bad.iter().filter(|l| l.starts_with("step ") && l.ends_with("(compared within tolerance)")).count();
        eprintln!("{set}: {} difference(s), {floats} of them float metrics beyond the tolerance", bad.len());
        assert!(floats > 0, "{set} passes the float metrics' tolerance: {bad:#?}");
    }
}
