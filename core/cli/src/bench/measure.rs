//! The `gen` and `train` sections of `rlhf bench`: sampling throughput with the KV cache, and a
//! forward + backward + AdamW step over random tokens.

use anyhow::Context;
use tch::{Kind, Tensor};

use rlhf_generation::{generate, token_logprobs, GenerateConfig, LogProbOptions, Sampling};
use rlhf_models::CausalLm;
use rlhf_trainer::optim::{Optim, OptimConfig, Schedule};

use super::report::median;
use super::time_runs;

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
pub(super) fn bench_gen(
    model: &CausalLm,
    rows: i64,
    prompt_len: i64,
    new_tokens: i64,
    repeats: usize,
    hbm: Option<f64>,
    peak_tflops: Option<f64>,
) -> anyhow::Result<GenResult> {
    let device = model.device();
    let a = model.arch().clone();
    // Random prompts avoid tokenizer effects; no EOS, so every run decodes exactly new_tokens.
    let ids = Tensor::f_randint_low(1, a.vocab_size, [rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let mask = Tensor::f_ones([rows, prompt_len], (Kind::Int64, device))?; // [rows, P]
    let cfg = GenerateConfig {
        max_new_tokens: new_tokens,
        sampling: Sampling::Sample { temperature: 1.0, top_k: None, top_p: None },
        eos_token_ids: vec![],
        pad_token_id: 0,
        seed: None,
        sync_every: 0,
        rows: None,
        prefill_group: 1,
        logprobs: false,
        noise_key: None,
    };
    let prefill = time_runs(device, repeats, || {
        tch::no_grad(|| -> anyhow::Result<()> {
            let pos = rlhf_models::position_ids_from_mask(&mask)?;
            let mut cache = model.new_cache(rows, prompt_len + new_tokens)?;
            let _ = model.hidden_states(&ids, &mask, &pos, Some(&mut cache))?;
            Ok(())
        })
    })?;
    let runs = time_runs(device, repeats, || {
        let out = generate(model, &ids, &mask, &cfg)?;
        anyhow::ensure!(out.response_mask.size()[1] == new_tokens, "generation stopped early");
        Ok(())
    })?;
    let (run_s, prefill_s) = (median(&runs).unwrap_or(f64::NAN), median(&prefill).unwrap_or(f64::NAN));
    let hbm_fraction = hbm.map(|gbps| {
        let param_bytes: f64 =
            model.vs.variables().values().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as f64).sum();
        let avg_ctx = prompt_len as f64 + new_tokens as f64 / 2.0;
        let elt = model.kind().elt_size_in_bytes() as f64;
        let kv_bytes = 2.0 * (a.num_layers * a.num_kv_heads * a.head_dim) as f64 * avg_ctx * rows as f64 * elt;
        let bound_s = (param_bytes + kv_bytes) * new_tokens as f64 / (gbps * 1e9);
        bound_s / (run_s - prefill_s).max(1e-9)
    });
    // Per generated token: 2 FLOPs per matmul parameter, and q·k plus p·v over the context.
    let avg_ctx = prompt_len as f64 + new_tokens as f64 / 2.0;
    let per_token = 2.0 * super::report::matmul_params(&a) as f64
        + 4.0 * (a.num_layers * a.num_heads * a.head_dim) as f64 * avg_ctx;
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
pub(super) fn bench_train(model: &CausalLm, rows: i64, seq: i64, repeats: usize) -> anyhow::Result<(f64, f64)> {
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
    let mut opt = Optim::new(&model.vs, &settings, repeats + 1)?;
    model.set_training(true);
    let times = time_runs(device, repeats, || {
        let lp = token_logprobs(model, &ids, &mask, 1, LogProbOptions::default())?; // [rows, T - 1]
        lp.logprobs.f_mean(Kind::Float)?.f_neg()?.f_backward()?;
        opt.step()?;
        Ok(())
    })
    .context("forward+backward")?;
    model.set_training(false);
    let step_s = median(&times).unwrap_or(f64::NAN);
    Ok(((rows * seq) as f64 / step_s, step_s))
}
