//! The Qwen presets learn: `configs/grpo-qwen3.toml` (a tiny random Qwen3),
//! `configs/grpo-qwen3-moe.toml` (a tiny random Qwen3-MoE) and `configs/grpo-qwen3.5.toml` (a tiny
//! random Qwen3.5: Gated DeltaNet and gated attention) raise the reward of the built-in addition
//! task on one process, and 2 ranks sample the tokens one process samples over the first optimizer
//! steps (Qwen3 at ZeRO stage 0; Qwen3.5 and Qwen3-MoE at stage 3). That 2 ranks learn as one
//! process does is `data_parallel.rs`'s embedded GRPO test. Shortened to
//! 150 steps without evaluation; the full presets go from 0.14 to 0.71 (Qwen3) and 0.18 to 0.85
//! (MoE) over 300 steps; Qwen3.5 goes from 0.39 to 0.95 in the 150.

use std::path::Path;
use std::process::Output;

use rlhf_integration_tests::{metrics, rlhf_bin};

const STEPS: &str = "train.steps=150";

/// One run at a time: each run keeps both cores busy (one process's two threads, or two ranks),
/// and two at once oversubscribe them — libtorch's OpenMP threads spin while they wait, and the
/// Gated DeltaNet's many small kernels ran several times slower that way.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(preset: &str, run_dir: &Path, extra: &[&str]) -> Output {
    let _one = one_at_a_time();
    let mut c = std::process::Command::new(rlhf_bin());
    c.args(["train", "--config", &format!("{}/../configs/{preset}", env!("CARGO_MANIFEST_DIR")), "--no-progress"])
        .args(["--run-dir", run_dir.to_str().unwrap(), "--set", STEPS, "--set", "eval.data=\"\""])
        .args(extra);
    let o = c.output().expect("spawn rlhf");
    assert!(o.status.success(), "{preset}: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn rewards(run_dir: &Path) -> Vec<f64> {
    metrics(run_dir).iter().filter(|l| l["step"] != 0).map(|l| l["reward"].as_f64().unwrap()).collect()
}

/// Mean reward of the first and the last 10 % of steps.
fn gain(r: &[f64]) -> (f64, f64) {
    let k = r.len() / 10;
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    (mean(&r[..k]), mean(&r[r.len() - k..]))
}

fn learns(what: &str, r: &[f64]) {
    let (first, last) = gain(r);
    println!("{what}: reward first 10% {first:.3}, last 10% {last:.3}");
    assert!(last >= first + 0.2, "{what}: reward {first:.3} -> {last:.3} (needs +0.2)");
}

/// One process learns; 2 ranks (ZeRO stage `stage`) sample what one process samples for the
/// first steps (the same rewards, after 4 optimizer steps; they run 10 steps: a 2-rank step costs
/// twice one process's on 2 cores).
fn one_and_two_ranks(preset: &str, stage: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    run(preset, &one, &[]);
    let zero = format!("distributed.zero_stage={stage}");
    run(preset, &two, &["--nproc", "2", "--set", &zero, "--set", "train.steps=10"]);
    let (r1, r2) = (rewards(&one), rewards(&two));
    assert_eq!(r1.len(), 150);
    assert_eq!(r1[..5], r2[..5], "{preset}: 2 ranks sample other tokens than 1 process in the first steps");
    learns(&format!("{preset} (1 process)"), &r1);
}

#[test]
fn the_qwen3_preset_learns_and_two_ranks_sample_like_one_process() {
    one_and_two_ranks("grpo-qwen3.toml", "0");
}

#[test]
fn the_qwen3_5_preset_learns_and_two_ranks_at_zero_stage_3_sample_like_one_process() {
    one_and_two_ranks("grpo-qwen3.5.toml", "3");
}

#[test]
fn the_qwen3_moe_preset_learns_and_logs_expert_load_and_two_ranks_at_zero_stage_3_sample_like_one_process() {
    one_and_two_ranks("grpo-qwen3-moe.toml", "3");
    let dir = tempfile::tempdir().unwrap();
    run("grpo-qwen3-moe.toml", &dir.path().join("r"), &["--set", "train.steps=2"]);
    let last = metrics(&dir.path().join("r")).pop().unwrap();
    let (max, min) = (last["moe/load_max"].as_f64().unwrap(), last["moe/load_min"].as_f64().unwrap());
    // 4 experts: shares in units of the balanced one lie in [0, 4], the largest at least 1.
    assert!((1.0..=4.0).contains(&max) && (0.0..=1.0).contains(&min), "moe/load_max {max}, moe/load_min {min}");
    assert!(last["moe/experts_idle"].as_f64().is_some());

    // The same model with `output_router_logits: true`: the load-balancing loss joins the loss,
    // and a checkpointed pass computes what a plain one computes.
    let model = dir.path().join("aux-model");
    rlhf_integration_tests::copy_dir(&dir.path().join("r/builtin-model"), &model);
    let mut config = rlhf_integration_tests::read_json(&model.join("config.json"));
    config["output_router_logits"] = serde_json::json!(true);
    config["router_aux_loss_coef"] = serde_json::json!(0.5);
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let actor = format!("model.actor=\"{}\"", model.display());
    let first = |name: &str, extra: &[&str]| {
        let run_dir = dir.path().join(name);
        run("grpo-qwen3-moe.toml", &run_dir, &[&["--set", "train.steps=2", "--set", &actor], extra].concat());
        metrics(&run_dir).into_iter().find(|l| l["step"] == 1).unwrap()
    };
    let (plain, ck) = (first("aux", &[]), first("aux-ck", &["--set", "train.gradient_checkpointing=true"]));
    let aux = plain["loss/aux"].as_f64().unwrap();
    // 2 of 4 experts per token: 2 when balanced, at most 4 (E = 4).
    assert!((1.5..=4.0).contains(&aux), "loss/aux {aux}");
    assert_eq!(plain["reward"], ck["reward"]);
    for key in ["loss/aux", "loss/total"] {
        let (a, b) = (plain[key].as_f64().unwrap(), ck[key].as_f64().unwrap());
        assert!((a - b).abs() < 1e-5 * a.abs().max(1.0), "{key}: {a} plain, {b} checkpointed");
    }
}
