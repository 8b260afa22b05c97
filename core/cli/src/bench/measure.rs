//! The `gen` and `train` sections of `rlhf bench`: sampling throughput with the KV cache, and a
//! forward + backward + AdamW step over random tokens.

use std::path::Path;

use anyhow::Context;
use tch::{Kind, Tensor};

use rlhf_generation::{generate, token_logprobs_pass, GenerateConfig, LogProbOptions, Sampling};
use rlhf_models::CausalLm;
use rlhf_trainer::optim::{Optim, OptimConfig, Schedule};

use super::profile::profile_once;
use super::report::{self, fmt_count, fmt_rate, fmt_secs, median};
use super::{machine, time_runs, Bench};

#[derive(Debug, serde::Serialize)]
pub(super) struct GenResult {
    pub(super) tokens_per_s: f64,
    /// Median seconds per run (prefill + decode).
    pub(super) run_s: f64,
    pub(super) prefill_s: f64,
    /// Decode time over its HBM-bandwidth floor (CUDA, known GPU).
    pub(super) hbm_fraction: Option<f64>,
    /// Decode FLOP/s over the peak FLOP/s: with many rows decode is bound by arithmetic, not by
    /// reading the weights.
    pub(super) flops_fraction: Option<f64>,
}

/// Generation: `rows` random prompts `[rows, prompt_len]`, `new_tokens` sampled tokens each.
/// `b` gives the shape (rows, prompt and new tokens), the repeats and `--profile`.
pub(super) fn bench_gen(
    model: &CausalLm,
    b: &Bench<'_>,
    hbm: Option<f64>,
    peak_tflops: Option<f64>,
) -> anyhow::Result<GenResult> {
    let (rows, prompt_len, new_tokens, repeats) = (b.rows, b.args.prompt_len, b.args.new_tokens, b.args.repeats);
    let profile = b.args.profile.as_deref();
    let device = model.device();
    let a = model.arch().clone();
    // Random prompts avoid tokenizer effects; no EOS, so every run decodes exactly new_tokens.
    let ids = Tensor::f_randint_low(1, a.vocab_size, [rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let mask = Tensor::f_ones([rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let cfg = GenerateConfig {
        sampling: Sampling::Sample { temperature: 1.0, top_k: None, top_p: None },
        ..GenerateConfig::greedy(new_tokens, vec![], 0)
    };
    let prefill = time_runs(device, repeats, || {
        tch::no_grad(|| -> anyhow::Result<()> {
            let pos = rlhf_models::position_ids_from_mask(&mask)?;
            let mut cache = model.new_cache(rows, prompt_len + new_tokens)?;
            let _ = model.hidden_states(&ids, &mask, &pos, Some(&mut cache))?;
            Ok(())
        })
    })?;
    let mut run = || {
        let out = generate(model, &ids, &mask, &cfg)?;
        anyhow::ensure!(out.response_mask.size()[1] == new_tokens, "generation stopped early");
        Ok(())
    };
    let runs = time_runs(device, repeats, &mut run)?;
    if let Some(dir) = profile {
        profile_once(dir, "gen", device, run)?;
    }
    let (run_s, prefill_s) = (median(&runs).unwrap_or(f64::NAN), median(&prefill).unwrap_or(f64::NAN));
    let hbm_fraction = hbm.map(|gbps| {
        let param_bytes: f64 =
            model.vs.variables().values().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as f64).sum();
        let avg_ctx = prompt_len as f64 + new_tokens as f64 / 2.0;
        let elt = model.kind().elt_size_in_bytes() as f64;
        let kv_bytes = 2.0 * super::report::cached_kv_width(&a) as f64 * avg_ctx * rows as f64 * elt;
        let bound_s = (param_bytes + kv_bytes) * new_tokens as f64 / (gbps * 1e9);
        bound_s / (run_s - prefill_s).max(1e-9)
    });
    // Per generated token: 2 FLOPs per matmul parameter, and q·k plus p·v over the context.
    let avg_ctx = prompt_len as f64 + new_tokens as f64 / 2.0;
    let per_token = 2.0 * a.matmul_params() as f64
        + 4.0 * a.attention_width() as f64 * avg_ctx
        + super::report::linear_attn_flops(&a, 0);
    let flops_fraction =
        peak_tflops.map(|peak| per_token * (rows * new_tokens) as f64 / (run_s - prefill_s).max(1e-9) / (peak * 1e12));
    Ok(GenResult { tokens_per_s: (rows * new_tokens) as f64 / run_s, run_s, prefill_s, hbm_fraction, flops_fraction })
}

#[derive(Debug, serde::Serialize)]
pub(super) struct TrainResult {
    pub(super) tokens_per_s: f64,
    /// Median seconds per forward + backward + optimizer step.
    pub(super) step_s: f64,
    pub(super) flops_per_token: f64,
    pub(super) mfu: Option<f64>,
    pub(super) peak_tflops: Option<f64>,
}

/// Training: forward + backward + AdamW over `rows` random sequences `[rows, seq]`; the loss is
/// the mean token log-likelihood, as in SFT.
/// With `profile`, one more step runs under the profiler (`profile.rs`).
pub(super) fn bench_train(
    model: &CausalLm,
    rows: i64,
    seq: i64,
    repeats: usize,
    profile: Option<&Path>,
) -> anyhow::Result<(f64, f64)> {
    let device = model.device();
    let vocab = model.arch().vocab_size;
    let ids = Tensor::f_randint_low(1, vocab, [rows, seq], (Kind::Int64, device))?; // [rows, T]
    let mask = Tensor::f_ones([rows, seq], (Kind::Int64, device))?; // [rows, T]
    let settings = OptimConfig {
        lr: 1e-6,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.0,
        schedule: Schedule::Constant,
        warmup_steps: 0,
        max_grad_norm: 1.0,
    };
    let mut opt = Optim::new(&model.vs, &settings, repeats + 2)?;
    model.set_training(true);
    let mut step = || {
        let (lp, pass) = token_logprobs_pass(model, &ids, &mask, 1, LogProbOptions::default(), false)?; // [rows, T - 1]
        lp.logprobs.f_mean(Kind::Float)?.f_neg()?.f_backward()?;
        pass.backward(model)?;
        opt.step()?;
        Ok(())
    };
    let times = time_runs(device, repeats, &mut step).context("forward+backward")?;
    if let Some(dir) = profile {
        profile_once(dir, "train", device, step)?;
    }
    model.set_training(false);
    let step_s = median(&times).unwrap_or(f64::NAN);
    Ok(((rows * seq) as f64 / step_s, step_s))
}

/// The gen section on a loaded model.
pub(super) fn run_gen(b: &Bench<'_>, model: &CausalLm) -> anyhow::Result<GenResult> {
    let a = b.args;
    // The decode bound: the GPU's HBM bandwidth from the table, else the measured copy bandwidth.
    let hbm = a.hbm_gbps.or_else(|| if b.device.is_cuda() { machine::hbm_gbps(&b.dev_name) } else { None });
    let hbm = hbm.or(Some(b.machine.copy_gbps));
    let peak = b.peak_tflops(if b.device.is_cuda() { None } else { Some(b.machine.gemm_tflops) });
    let g = bench_gen(model, b, hbm, peak)?;
    println!(
        "gen:   {} tokens/s (median {} s per run of {}×{} new tokens, prefill {} s)",
        fmt_rate(g.tokens_per_s),
        fmt_secs(g.run_s),
        b.rows,
        a.new_tokens,
        fmt_secs(g.prefill_s)
    );
    if let Some(f) = g.flops_fraction {
        println!("       decode at {:.1} % of the peak FLOP/s", 100.0 * f);
    }
    match g.hbm_fraction {
        Some(f) => println!("       decode at {:.1} % of the memory-bandwidth bound", 100.0 * f),
        None if b.device.is_cuda() => println!("       decode vs HBM bound: unknown GPU, pass --hbm-gbps"),
        None => {}
    }
    Ok(g)
}

/// The train section on a loaded model.
pub(super) fn run_train(b: &Bench<'_>, model: &CausalLm) -> anyhow::Result<TrainResult> {
    let (a, arch) = (b.args, &b.arch);
    let seq = a.prompt_len + a.new_tokens;
    let (tokens_per_s, step_s) = bench_train(model, b.rows, seq, a.repeats, a.profile.as_deref())?;
    let n = arch.matmul_params();
    let flops_per_token = report::train_flops(arch, seq);
    // The datasheet peak of a known GPU, else this run's measured GEMM peak.
    let peak = b.peak_tflops(Some(b.machine.gemm_tflops));
    let mfu = peak.map(|p| report::mfu(flops_per_token, tokens_per_s, p));
    println!(
        "train: {} tokens/s (median {} s per forward+backward+AdamW step over {}×{seq} tokens)",
        fmt_rate(tokens_per_s),
        fmt_secs(step_s),
        b.rows
    );
    let mfu_text = match (mfu, peak) {
        (Some(m), Some(p)) => format!("{:.2} % of {p:.3} TFLOP/s", 100.0 * m),
        _ if b.device.is_cuda() => "n/a (unknown GPU: pass --peak-tflops)".into(),
        _ => "n/a (CPU: pass --peak-tflops)".into(),
    };
    // A hybrid model's linear-attention layers add their recurrence (3× its forward FLOPs).
    let linear = 3.0 * report::linear_attn_flops(arch, 64);
    let linear_text = if linear > 0.0 { format!(" + linear attention {linear:.4e}") } else { String::new() };
    println!(
        "       MFU {mfu_text}; model FLOPs/token = 6·N + 12·L·H·T{} = {:.4e} (N = {} matmul params, L·H = {} \
         over {} attention layers, T = {seq})",
        linear_text,
        flops_per_token,
        fmt_count(n as u64),
        arch.attention_width(),
        report::attention_layers(arch),
    );
    Ok(TrainResult { tokens_per_s, step_s, flops_per_token, mfu, peak_tflops: peak })
}
