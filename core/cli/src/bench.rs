//! `rlhf bench gen`: generation and training throughput of a model, medians over several runs.
//! On CUDA it also reports decode as a fraction of the HBM-bandwidth bound: every decode step must
//! read all parameters plus the KV cache so far, so `bytes_per_step / bandwidth` is its floor.

use std::time::Instant;

use anyhow::Context;
use tch::{Device, Kind, Tensor};

use rlhf_generation::{generate, token_logprobs, GenerateConfig, LogProbOptions};
use rlhf_models::CausalLm;

use crate::common::ModelArgs;

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Generation tokens/s and forward+backward tokens/s.
    Gen(GenArgs),
}

#[derive(clap::Args, Debug)]
pub struct GenArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 8)]
    batch: i64,
    #[arg(long, default_value_t = 64)]
    prompt_len: i64,
    #[arg(long, default_value_t = 64)]
    new_tokens: i64,
    /// Timed runs per measurement (the median is reported); one untimed warm-up run precedes them.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// HBM bandwidth in GB/s for the bound (default: detected from the GPU model name).
    #[arg(long)]
    hbm_gbps: Option<f64>,
    /// Print one JSON line with every figure.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Gen(args) => bench_gen(args),
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Median seconds of `f` over `runs` timed calls after one warm-up.
fn time_it(device: Device, runs: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    sync(device);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        f()?;
        sync(device);
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// Bandwidth of known GPUs, read from the driver's description of device 0.
fn detect_hbm_gbps() -> Option<(String, f64)> {
    // The first GPU listed by the driver is the one we run on by default.
    let entry = std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?.flatten().next()?;
    let info = std::fs::read_to_string(entry.path().join("information")).ok()?;
    let model = info.lines().find_map(|l| l.strip_prefix("Model:"))?.trim().to_string();
    let gbps = [("H200", 4800.0), ("H100", 3350.0), ("A100", 2039.0), ("L40S", 864.0), ("A10", 600.0)]
        .iter()
        .find(|(k, _)| model.contains(k))
        .map(|(_, v)| *v)?;
    Some((model, gbps))
}

fn param_bytes(model: &CausalLm) -> i64 {
    model.vs.variables().values().map(|t| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64).sum()
}

fn bench_gen(args: GenArgs) -> anyhow::Result<()> {
    let model = args.model.load_lm()?;
    let device = model.device();
    let a = model.arch().clone();
    if args.batch < 1 || args.prompt_len < 1 || args.new_tokens < 1 {
        anyhow::bail!("--batch, --prompt-len and --new-tokens must be >= 1");
    }
    tch::manual_seed(0);
    // Random prompts avoid tokenizer effects; no EOS so every run decodes exactly new_tokens.
    let ids = Tensor::f_randint_low(1, a.vocab_size, [args.batch, args.prompt_len], (Kind::Int64, device))?;
    let mask = Tensor::f_ones([args.batch, args.prompt_len], (Kind::Int64, device))?;
    let cfg = GenerateConfig::greedy(args.new_tokens, vec![], 0);

    let prefill_s = time_it(device, args.runs, || {
        tch::no_grad(|| -> anyhow::Result<()> {
            let pos = rlhf_models::position_ids_from_mask(&mask)?;
            let mut cache = model.new_cache(args.batch, args.prompt_len)?;
            let _ = model.hidden_states(&ids, &mask, &pos, Some(&mut cache))?;
            Ok(())
        })
    })?;
    let gen_s = time_it(device, args.runs, || {
        let out = generate(&model, &ids, &mask, &cfg)?;
        anyhow::ensure!(out.response_mask.size()[1] == args.new_tokens, "generation stopped early");
        Ok(())
    })?;

    let seq = args.prompt_len + args.new_tokens;
    let train_ids = Tensor::f_randint_low(1, a.vocab_size, [args.batch, seq], (Kind::Int64, device))?;
    let train_mask = Tensor::f_ones([args.batch, seq], (Kind::Int64, device))?;
    let train_s = time_it(device, args.runs, || {
        let lp = token_logprobs(&model, &train_ids, &train_mask, 1, LogProbOptions::default())?;
        let loss = lp.logprobs.f_mean(Kind::Float)?.f_neg()?;
        loss.f_backward()?;
        for v in model.vs.trainable_variables() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.f_zero_()?;
            }
        }
        Ok(())
    })
    .context("forward+backward")?;

    let gen_tps = (args.batch * args.new_tokens) as f64 / gen_s;
    let train_tps = (args.batch * seq) as f64 / train_s;
    let decode_s = (gen_s - prefill_s).max(1e-9);
    let elt = model.kind().elt_size_in_bytes() as f64;
    let avg_ctx = args.prompt_len as f64 + args.new_tokens as f64 / 2.0;
    let kv_bytes = 2.0 * (a.num_layers * a.num_kv_heads * a.head_dim) as f64 * avg_ctx * args.batch as f64 * elt;
    let bytes_per_step = param_bytes(&model) as f64 + kv_bytes;
    let hbm =
        if device.is_cuda() { args.hbm_gbps.map(|g| ("given".to_string(), g)).or_else(detect_hbm_gbps) } else { None };
    let hbm_fraction = hbm.as_ref().map(|(_, gbps)| {
        let bound_s = bytes_per_step * args.new_tokens as f64 / (gbps * 1e9);
        bound_s / decode_s
    });

    println!(
        "model {} | device {:?} {:?} | batch {} prompt {} new {} | runs {}",
        args.model.model.display(),
        device,
        model.kind(),
        args.batch,
        args.prompt_len,
        args.new_tokens,
        args.runs
    );
    println!("generation: {gen_tps:.1} tokens/s (median {gen_s:.4} s per run, prefill {prefill_s:.4} s)");
    println!("forward+backward: {train_tps:.1} tokens/s (median {train_s:.4} s per step)");
    match (&hbm, hbm_fraction) {
        (Some((name, gbps)), Some(f)) => {
            println!("decode vs HBM bound ({name}, {gbps:.0} GB/s): {:.1} %", 100.0 * f)
        }
        _ if device.is_cuda() => println!("decode vs HBM bound: unknown GPU, pass --hbm-gbps"),
        _ => {}
    }
    if args.json {
        let line = serde_json::json!({
            "gen_tokens_per_s": gen_tps, "train_tokens_per_s": train_tps, "gen_s": gen_s,
            "prefill_s": prefill_s, "train_step_s": train_s, "hbm_fraction": hbm_fraction,
            "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        });
        println!("{line}");
    }
    Ok(())
}
