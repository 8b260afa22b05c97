//! `rlhf check-graphs`: does a decode replayed as CUDA graphs sample exactly what the same decode
//! samples eagerly, on this device? For each model, the same left-padded prompts are decoded
//! three ways, each with and without graphs: greedily, sampled with one noise key, and sampled
//! with EOS ids chosen so that most rows stop early (the batch is compacted into smaller graphs
//! as they do). Every token must be equal, and the graph decodes must have replayed graphs with
//! no capture failing — unless the model says why its step cannot be captured (then both decodes
//! are eager, which is reported, and passes). Exit status 1 otherwise.

use anyhow::{bail, Context};
use rlhf_generation::{generate, graph_failures, graph_replays, left_pad, GenerateConfig, Sampling};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

use crate::cmd_check::batch_ids;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directories or Hub ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    models: Vec<String>,
    /// cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Sequences in the batch (left-padded to different lengths).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens of the longest prompt.
    #[arg(long, default_value_t = 24)]
    len: usize,
    /// Tokens decoded per sequence.
    #[arg(long, default_value_t = 40)]
    new_tokens: i64,
    /// Print each model's figures as one JSON line too.
    #[arg(long)]
    json: bool,
}

/// Decodes `seqs` with `cfg`, with or without graphs: the responses on the CPU and how many
/// steps replayed a graph.
fn decode(model: &CausalLm, seqs: &[Vec<i64>], cfg: &GenerateConfig, graphs: bool) -> anyhow::Result<(Tensor, u64)> {
    let b = left_pad(seqs, cfg.pad_token_id, model.device())?;
    let cfg = GenerateConfig { cuda_graphs: graphs, ..cfg.clone() };
    let before = graph_replays();
    let g = generate(model, &b.input_ids, &b.attention_mask, &cfg)?;
    let tokens = g.responses()?.f_to_device(Device::Cpu)?;
    Ok((tokens, graph_replays() - before))
}

/// One comparison: (equal tokens, total tokens, replays of the graph decode).
fn compare(model: &CausalLm, seqs: &[Vec<i64>], cfg: &GenerateConfig) -> anyhow::Result<(i64, i64, u64)> {
    let (eager, _) = decode(model, seqs, cfg, false)?;
    let (graphs, replays) = decode(model, seqs, cfg, true)?;
    if eager.size() != graphs.size() {
        return Ok((0, eager.numel().max(graphs.numel()) as i64, replays));
    }
    let same = eager.f_eq_tensor(&graphs)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    Ok((same, eager.numel() as i64, replays))
}

/// The EOS ids that end most rows early: the greedy tokens of the first three quarters of the
/// rows at their third step.
fn early_eos(model: &CausalLm, seqs: &[Vec<i64>], new: i64) -> anyhow::Result<Vec<i64>> {
    let cfg = GenerateConfig { cuda_graphs: false, ..GenerateConfig::greedy(3.min(new), vec![], 0) };
    let (tokens, _) = decode(model, seqs, &cfg, false)?;
    let rows = (seqs.len() * 3 / 4).max(1) as i64;
    let last = tokens.size()[1] - 1;
    let mut ids = Vec::<i64>::try_from(tokens.f_narrow(0, 0, rows)?.f_select(1, last)?)?;
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (device, kind) = (rlhf_models::parse_device(&args.device)?, rlhf_models::parse_dtype(&args.dtype)?);
    if !device.is_cuda() {
        bail!("--device {}: CUDA graphs need a CUDA device", args.device);
    }
    if !tch::Cuda::is_available() {
        bail!("--device {}: libtorch sees no CUDA device", args.device);
    }
    if args.batch == 0 || args.len == 0 || args.new_tokens < 4 {
        bail!("--batch and --len must be >= 1 and --new-tokens >= 4");
    }
    let mut failed = Vec::new();
    for spec in &args.models {
        let dir = rlhf_hub::resolve_model(spec)?;
        let model =
            CausalLm::from_dir(&dir, device, kind).with_context(|| format!("{} on {}", dir.display(), args.device))?;
        let name = dir.file_name().map_or_else(|| spec.clone(), |n| n.to_string_lossy().to_string());
        let seqs = batch_ids(args.batch, args.len, model.arch().vocab_size);
        let greedy = GenerateConfig { sync_every: 4, ..GenerateConfig::greedy(args.new_tokens, vec![], 0) };
        let sampled = GenerateConfig {
            sampling: Sampling::Sample { temperature: 1.0, top_k: Some(50), top_p: Some(0.95) },
            noise_key: Some(0x5eed),
            ..greedy.clone()
        };
        let stopping = GenerateConfig { eos_token_ids: early_eos(&model, &seqs, args.new_tokens)?, ..sampled.clone() };
        let failures = graph_failures();
        let mut figures = Vec::new();
        for (what, cfg) in [("greedy", &greedy), ("sampled", &sampled), ("sampled, rows stopping", &stopping)] {
            figures.push((what, compare(&model, &seqs, cfg)?));
        }
        let blocker = model.capture_blocker();
        let replays: u64 = figures.iter().map(|(_, f)| f.2).sum();
        let equal = figures.iter().all(|(_, (same, total, _))| same == total);
        let parts: Vec<String> = figures.iter().map(|(w, (s, t, _))| format!("{w} {s}/{t}")).collect();
        let how = match blocker {
            Some(why) => format!("eager both ways ({why})"),
            None => format!("{replays} graph replays"),
        };
        println!("{name} {} on {}: tokens equal: {}; {how}", args.dtype, args.device, parts.join(", "));
        if args.json {
            let per: serde_json::Map<String, serde_json::Value> = figures
                .iter()
                .map(|(w, (s, t, r))| ((*w).to_string(), serde_json::json!({"equal": s, "total": t, "replays": r})))
                .collect();
            println!(
                "{}",
                serde_json::json!({"model": name, "dtype": args.dtype, "eager_because": blocker, "checks": per})
            );
        }
        let failed_captures = graph_failures() - failures;
        if failed_captures > 0 {
            println!("{name}: {failed_captures} captures failed (those decodes ran eagerly; the log says why)");
        }
        if !equal || (blocker.is_none() && (replays == 0 || failed_captures > 0)) {
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        bail!("graph decode differs from eager decode (or replayed no graph) for {}", failed.join(", "));
    }
    Ok(())
}
