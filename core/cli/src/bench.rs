//! `rlhf bench`: throughput of a model in three sections, each the median of `--repeats` timed
//! runs after one untimed warm-up run:
//!
//! - **gen**: batched sampling with the KV cache, B·G sequences of `--prompt-len` random tokens,
//!   `--new-tokens` new tokens each (temperature 1, no EOS, so every run decodes all of them);
//!   tokens/s = B·G·new / seconds, prefill included. On CUDA also the fraction of the HBM-bandwidth
//!   bound: every decode step reads all parameters plus the KV cache so far.
//! - **train**: forward + backward + AdamW step (with grad-norm clipping, the trainer's optimizer)
//!   over B·G × (prompt + new) random tokens; tokens/s and MFU ([`report`] has the formula).
//! - **rl**: the real GRPO `Trainer` ([`rl`]) with a per-phase split.
//! - **dp** (only when asked for, or with `all`): that GRPO step on 1 rank and on `--ranks`
//!   data-parallel ranks, one thread each ([`dp`]): step times, speed-up, and the collectives'
//!   seconds and bytes per step.
//! - **overlap** (only when asked for, or with `all`): that GRPO run synchronously and with
//!   asynchronous rollouts at `rollout.max_staleness` 1 and 2 ([`overlap`]): steps per minute,
//!   each side's idle share, the reward against two synchronous seeds.
//! - **decode** (only when asked for, or with `all`): milliseconds per decode step at each of
//!   `--decode-batches`, with CUDA graphs and eagerly ([`decode`]); `--vs-hf` times transformers'
//!   static-cache `generate` beside it.
//!
//! `--vs-trl` runs TRL's `GRPOTrainer` on the same weights, prompts, B, G and lengths ([`trl`])
//! and prints TRL step / our step. `--record FILE` appends a row to a Markdown table.

mod args;
mod decode;
mod dp;
pub(crate) mod machine;
mod measure;
mod overlap;
mod profile;
pub(crate) mod report;
mod rl;
pub(crate) mod trl;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use tch::{Device, Kind};

use rlhf_models::{ArchConfig, CausalLm};
use rlhf_trainer::builtin_vl::{write_shaped, VlShape};
use rlhf_trainer::config::RlConfig;
use rlhf_trainer::random_qwen2::{write_qwen2, Qwen2Shape};

pub use args::BenchArgs;
use measure::{run_gen, run_train, GenResult, TrainResult};
use report::{fmt_count, fmt_secs, Row};

/// A directory for this run's files, removed at the end.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new() -> anyhow::Result<Self> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("rlhf-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(WorkDir(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Seconds of each of `repeats` timed calls of `f`, after one untimed call.
fn time_runs(device: Device, repeats: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Vec<f64>> {
    f()?;
    sync(device);
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        f()?;
        sync(device);
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// Qwen2.5-0.5B's shape with random weights (the doctor's `step` model).
const QWEN2_HALF_B: &str = "qwen2-0.5b";
/// A decode bound by the host: 6 layers of hidden size 256.
const QWEN2_6X256: &str = "qwen2-6x256";
/// Random Qwen2.5-VL over the built-in visual task's words: tiny, and about 100M parameters.
const VL_TINY: &str = "tiny-qwen2.5-vl";
const VL_SMALL: &str = "qwen2.5-vl-100m";

/// The model directory and its display name: a directory or Hub id, or a random model written
/// into `work`.
fn model_dir(spec: &str, seed: u64, kind: Kind, work: &Path) -> anyhow::Result<(PathBuf, String)> {
    let Some(builtin) = spec.strip_prefix("builtin:") else {
        let dir = rlhf_hub::resolve_model(spec)?;
        if !dir.is_dir() {
            bail!("--model {}: model directory not found", dir.display());
        }
        let name = std::fs::canonicalize(&dir)
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
            .unwrap_or_else(|| spec.to_string());
        return Ok((dir, name));
    };
    let dir = work.join(format!("builtin-{builtin}"));
    match builtin {
        "tiny" => rlhf_trainer::builtin_models::write_tiny_model(&dir, seed)?,
        QWEN2_HALF_B => write_qwen2(&dir, &Qwen2Shape::HALF_B, kind, seed).map(drop)?,
        QWEN2_6X256 => write_qwen2(&dir, &Qwen2Shape { layers: 6, ..Qwen2Shape::SMALL }, kind, seed).map(drop)?,
        // Positions for a 448-pixel image's 256 tokens and more.
        VL_TINY => write_shaped(&dir, &VlShape { max_positions: 2048, ..VlShape::TINY }, seed)?,
        VL_SMALL => write_shaped(&dir, &VlShape::SMALL, seed)?,
        other => bail!(
            "--model builtin:{other}: unknown built-in model (available: builtin:tiny, builtin:{QWEN2_HALF_B}, \
             builtin:{QWEN2_6X256}, builtin:{VL_TINY}, builtin:{VL_SMALL})"
        ),
    }
    Ok((dir, format!("{builtin}-random")))
}

/// What every section shares: the parsed arguments, the model, the machine.
struct Bench<'a> {
    args: &'a BenchArgs,
    device: Device,
    kind: Kind,
    work: WorkDir,
    model_dir: PathBuf,
    model_name: String,
    arch: ArchConfig,
    params: u64,
    machine: machine::Machine,
    /// The device's name with its measured peaks.
    dev_name: String,
    /// B·G sequences.
    rows: i64,
}

impl<'a> Bench<'a> {
    /// Checks the arguments, writes or finds the model, measures the machine, prints the header.
    fn new(args: &'a BenchArgs, sections: [bool; 6]) -> anyhow::Result<Self> {
        let [do_gen, do_train, do_rl, do_dp, do_overlap, do_decode] = sections;
        if args.batch < 1 || args.group < 1 || args.prompt_len < 1 || args.new_tokens < 1 || args.repeats < 1 {
            bail!("--batch, --group, --prompt-len, --new-tokens and --repeats must be >= 1");
        }
        if args.rl_prompt_len < 1 {
            bail!("--rl-prompt-len must be >= 1");
        }
        if do_dp && (args.ranks < 2 || (args.batch as usize) < args.ranks) {
            bail!(
                "the dp section needs --ranks >= 2 and --batch >= --ranks (a prompt per rank): got --ranks {} --batch {}",
                args.ranks,
                args.batch
            );
        }
        if args.vs_trl && !do_rl {
            bail!("--vs-trl compares RL steps: include the rl section (--only ...,rl)");
        }
        if args.algo != "grpo" && (args.vs_trl || do_overlap) {
            bail!("--algo {}: --vs-trl and the overlap section run GRPO only (leave out --algo)", args.algo);
        }
        if args.vs_hf && !do_decode {
            bail!("--vs-hf compares decode steps: include the decode section (--only ...,decode)");
        }
        if do_decode && (args.decode_batches.is_empty() || args.decode_batches.iter().any(|&b| b < 1)) {
            bail!("--decode-batches must list batch sizes >= 1");
        }
        let (device, kind) = (rlhf_models::parse_device(&args.device)?, rlhf_models::parse_dtype(&args.dtype)?);
        if device.is_cuda() && !tch::Cuda::is_available() {
            bail!("--device {}: libtorch sees no CUDA device", args.device);
        }
        let work = WorkDir::new()?;
        let (model_dir, model_name) = model_dir(&args.model, args.seed, kind, &work.0)?;
        let arch = rlhf_models::ModelConfig::from_dir(&model_dir)?.arch;
        let seq = args.prompt_len + args.new_tokens;
        let seq = if do_decode { seq.max(args.prompt_len + args.decode_new_tokens) } else { seq };
        if (do_gen || do_train || do_decode) && seq > arch.max_position_embeddings {
            bail!(
                "--prompt-len + --new-tokens (or --decode-new-tokens) = {seq} exceeds the model's max_position_embeddings ({})",
                arch.max_position_embeddings
            );
        }
        let params = machine::stored_params(&model_dir)?;
        let machine = machine::measure(device, kind);
        let dev_name = format!(
            "{}; GEMM {:.0} GFLOP/s, copy {:.0} GB/s",
            machine::device_name(device),
            machine.gemm_tflops * 1e3,
            machine.copy_gbps
        );
        let b = Bench { args, device, kind, work, model_dir, model_name, arch, params, machine, dev_name, rows: 0 };
        let b = Bench { rows: args.batch * args.group, ..b };
        b.print_header();
        Ok(b)
    }

    fn print_header(&self) {
        let a = self.args;
        println!(
            "model {} ({} params, {:?}) | {} {} ({}) | B={} G={} ({} sequences), prompt {}, new {} \
             | medians of {} timed runs after 1 warm-up",
            self.model_name,
            fmt_count(self.params),
            self.arch.family,
            a.device,
            a.dtype,
            self.dev_name,
            a.batch,
            a.group,
            self.rows,
            a.prompt_len,
            a.new_tokens,
            a.repeats
        );
        println!(
            "machine: {} {} GEMM {:.1} GFLOP/s, memory copy {:.1} GB/s (measured now; MFU and the decode bound are \
             against these unless the GPU is known or --peak-tflops/--hbm-gbps say otherwise)",
            a.device,
            a.dtype,
            self.machine.gemm_tflops * 1e3,
            self.machine.copy_gbps
        );
    }

    /// The peak FLOP/s MFU is against: `--peak-tflops`, the GPU's datasheet, else `measured`.
    fn peak_tflops(&self, measured: Option<f64>) -> Option<f64> {
        let known =
            if self.device.is_cuda() { report::peak_tflops(&self.dev_name, self.kind == Kind::BFloat16) } else { None };
        self.args.peak_tflops.or(known).or(measured)
    }
}

/// The RL-based sections' configs and prompts.
struct RlPlans {
    rl: Option<RlConfig>,
    dp: Option<RlConfig>,
    overlap: Option<RlConfig>,
    /// The RL section's prompts with their labels, and their mean length in tokens.
    prompts: Option<(rl::LabelledPrompts, f64)>,
    /// Where the prompts come from.
    source: String,
}

impl RlPlans {
    fn new(b: &Bench<'_>, sections: [bool; 6]) -> anyhow::Result<Self> {
        let [_, _, do_rl, do_dp, do_overlap, _] = sections;
        let a = b.args;
        let images = match a.image_size {
            0 => None,
            side => Some(rl::write_image_prompts(&b.work.0, side, &b.arch, a.prompts.is_some())?),
        };
        let setup = rl::RlSetup {
            algo: &a.algo,
            model_dir: &b.model_dir,
            device: &a.device,
            dtype: &a.dtype,
            batch: a.batch,
            group: a.group,
            prompt_len: a.rl_prompt_len,
            new_tokens: a.new_tokens,
            repeats: a.repeats,
            prompts: images.as_deref().or(a.prompts.as_deref()),
            run_dir: b.work.0.join("rl-run"),
            gradient_checkpointing: a.gradient_checkpointing,
            bf16_decode: a.bf16_decode,
            padding_free: a.padding_free,
            micro_batch_tokens: a.micro_batch_tokens,
            warmup: false,
        };
        let rl = if do_rl { Some(rl::config(&setup)?) } else { None };
        let dp = if do_dp { Some(rl::config(&setup)?) } else { None };
        // The overlap section compares rewards too: the preset's warm-up makes them move.
        let overlap_setup = rl::RlSetup { warmup: !a.overlap_no_warmup, run_dir: setup.run_dir.clone(), ..setup };
        let overlap = if do_overlap { Some(rl::config(&overlap_setup)?) } else { None };
        let prompts = rl.as_ref().map(|cfg| rl::prompts(cfg, &b.model_dir)).transpose()?;
        let source = match (a.image_size, &a.prompts) {
            (0, None) => "builtin:addition".to_string(),
            (0, Some(p)) => p.display().to_string(),
            (side, _) => format!("builtin:shapes-train at {side} x {side} pixels"),
        };
        Ok(RlPlans { rl, dp, overlap, prompts, source })
    }
}

/// TRL's GRPO step on the same model and prompts (`--vs-trl`); it runs before anything of ours
/// touches the device, so it has the GPU to itself.
fn run_trl(b: &Bench<'_>, plans: &RlPlans) -> anyhow::Result<Option<trl::TrlResult>> {
    let (Some(cfg), Some((prompts, _))) = (&plans.rl, &plans.prompts) else { return Ok(None) };
    let a = b.args;
    if !a.vs_trl {
        return Ok(None);
    }
    let python = trl::python(a.python.as_deref());
    let versions = trl::check(&python, a.trl_script.as_deref(), &b.work.0)?;
    let file = b.work.0.join("trl-prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| match p.images.is_empty() {
            true => serde_json::json!({"prompt": p.text, "label": p.label}),
            false => serde_json::json!({"prompt": p.text, "label": p.label, "images": p.images}),
        })
        .map(|v| v.to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n")?;
    let algo = &cfg.algorithm.config;
    println!("trl:   running {} steps with {} ({versions}) ...", a.repeats + 1, python.display());
    let r = trl::run(&trl::TrlSetup {
        python: &python,
        script: a.trl_script.as_deref(),
        work_dir: &b.work.0,
        model_dir: &b.model_dir,
        prompts: &file,
        device: &a.device,
        dtype: &a.dtype,
        batch: a.batch,
        group: a.group,
        new_tokens: a.new_tokens,
        repeats: a.repeats,
        gradient_checkpointing: a.gradient_checkpointing,
        lr: cfg.train.lr,
        beta: algo.get("beta").and_then(|v| v.as_f64()).unwrap_or(0.04),
        epsilon: algo.get("epsilon").and_then(|v| v.as_f64()).unwrap_or(0.2),
        adam_beta2: cfg.train.adam_betas.1,
        max_grad_norm: cfg.train.max_grad_norm,
        seed: cfg.run.seed,
    })?;
    trl::print(&r);
    Ok(Some(r))
}

/// The decode section on a loaded model, with transformers beside it for `--vs-hf`.
fn run_decode(b: &Bench<'_>, model: &CausalLm) -> anyhow::Result<(Vec<decode::DecodeRow>, Option<decode::HfInfo>)> {
    let a = b.args;
    let new = a.decode_new_tokens;
    let mut rows = decode::run(model, &a.decode_batches, a.prompt_len, new, a.repeats)?;
    let hf = if a.vs_hf {
        let python = trl::python(a.python.as_deref());
        println!("hf:    timing transformers' generate with {} ...", python.display());
        let (dir, device, dtype) = (&b.model_dir, &a.device, &a.dtype);
        Some(decode::run_hf(&python, &b.work.0, dir, device, dtype, &mut rows, a.prompt_len, new, a.repeats)?)
    } else {
        None
    };
    decode::print(&rows, hf.as_ref());
    Ok((rows, hf))
}

/// The rl section: the real trainer's GRPO steps and their phases.
fn run_rl(b: &Bench<'_>, plans: &mut RlPlans, trl: Option<&trl::TrlResult>) -> anyhow::Result<Option<rl::RlResult>> {
    let Some(cfg) = plans.rl.take() else { return Ok(None) };
    let profile = b.args.profile.as_deref().map(|dir| (dir, b.device));
    let r = rl::run(cfg, b.args.repeats, profile)?;
    let f = &r.figures;
    println!(
        "rl:    {} s/step (generate {} | score {} | old_logprobs {} | reference {} | values {} | train {})",
        fmt_secs(f.step_s),
        fmt_secs(f.generate),
        fmt_secs(f.score),
        fmt_secs(f.old_logprobs),
        fmt_secs(f.reference),
        fmt_secs(f.values),
        fmt_secs(f.train)
    );
    println!("       shares of the step: {}", rl::shares(f));
    println!(
        "       mean completion {:.1} tokens, reward {:.3}; prompts {} (mean {:.1} tokens)",
        r.mean_completion_length,
        r.reward,
        plans.source,
        plans.prompts.as_ref().map_or(0.0, |p| p.1)
    );
    rl::print_spread_and_memory(&r, trl.and_then(|t| t.peak_rss_gb));
    Ok(Some(r))
}

/// The dp section.
fn run_dp(b: &Bench<'_>, plans: &RlPlans) -> anyhow::Result<Option<dp::DpResult>> {
    let Some(cfg) = &plans.dp else { return Ok(None) };
    let r = dp::run(cfg, b.args.ranks, &b.work.0)?;
    println!(
        "dp:    1 rank × 1 thread {} s/step | {} ranks × 1 thread {} s/step ({} speed-up, {:.0}% scaling) | \
         collectives {} s and {:.3} MB per step",
        fmt_secs(r.one_rank_s),
        r.ranks,
        fmt_secs(r.n_ranks_s),
        report::fmt_ratio(r.speedup()),
        100.0 * r.speedup() / r.ranks as f64,
        fmt_secs(r.comm_s),
        r.comm_bytes / 1e6
    );
    dp::print_stages(&r);
    Ok(Some(r))
}

/// The overlap section.
fn run_overlap(b: &Bench<'_>, plans: &RlPlans) -> anyhow::Result<Option<overlap::OverlapResult>> {
    let Some(cfg) = &plans.overlap else { return Ok(None) };
    let a = b.args;
    let ks = if a.overlap_vllm.is_empty() { "1, 2" } else { "1, on vLLM" };
    println!("overlap: {} steps each, synchronous (2 seeds) and max_staleness {ks}:", a.overlap_steps);
    Ok(Some(overlap::run(cfg, a.overlap_steps, &a.overlap_vllm, &b.work.0)?))
}

/// Everything a run measured.
struct Results {
    gen: Option<GenResult>,
    train: Option<TrainResult>,
    decode: Option<(Vec<decode::DecodeRow>, Option<decode::HfInfo>)>,
    rl: Option<rl::RlResult>,
    dp: Option<dp::DpResult>,
    overlap: Option<overlap::OverlapResult>,
    trl: Option<trl::TrlResult>,
    vs_trl: Option<f64>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let sections = args.sections();
    let [do_gen, do_train, _, _, _, do_decode] = sections;
    let b = Bench::new(&args, sections)?;
    let mut plans = RlPlans::new(&b, sections)?;
    let trl = run_trl(&b, &plans)?;
    let (mut gen, mut train, mut decode) = (None, None, None);
    if do_gen || do_train || do_decode {
        let model = CausalLm::from_dir(&b.model_dir, b.device, b.kind)?;
        tch::manual_seed(args.seed as i64);
        if do_gen {
            gen = Some(run_gen(&b, &model)?);
        }
        if do_train {
            train = Some(run_train(&b, &model)?);
        }
        if do_decode {
            decode = Some(run_decode(&b, &model)?);
        }
    }
    let rl = run_rl(&b, &mut plans, trl.as_ref())?;
    let dp = run_dp(&b, &plans)?;
    let overlap = run_overlap(&b, &plans)?;
    let vs_trl = match (&trl, &rl) {
        (Some(t), Some(r)) if r.figures.step_s > 0.0 => Some(t.step_s / r.figures.step_s),
        _ => None,
    };
    if let Some(x) = vs_trl {
        println!("vs TRL: {} (TRL step time / ours; > 1 means ours is faster)", report::fmt_ratio(x));
    }
    let results = Results { gen, train, decode, rl, dp, overlap, trl, vs_trl };
    report_results(&b, &plans, sections, &results)
}

/// Prints the JSON line and records the rows (`--json`, `--record`).
fn report_results(b: &Bench<'_>, plans: &RlPlans, sections: [bool; 6], r: &Results) -> anyhow::Result<()> {
    let a = b.args;
    let [do_gen, do_train, do_rl, ..] = sections;
    let mut settings =
        format!("{}, B={} G={}, prompt {} new {}", a.dtype, a.batch, a.group, a.prompt_len, a.new_tokens);
    settings.push_str(&if a.algo == "grpo" { String::new() } else { format!(", {}", a.algo) });
    if let Some((_, mean)) = &plans.prompts {
        settings.push_str(&format!(", RL prompts {} ({mean:.1} tok)", plans.source));
    }
    let flags = [
        (a.gradient_checkpointing, ", gradient checkpointing"),
        (a.bf16_decode, ", bf16 decode"),
        (a.padding_free, ", padding-free"),
    ];
    for (on, what) in flags {
        if on {
            settings.push_str(what);
        }
    }
    if let Some(n) = a.micro_batch_tokens {
        settings.push_str(&format!(", micro-batches of {n} tokens"));
    }
    settings.push_str(&format!(", {} reps", a.repeats));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let row = Row {
        date: report::utc_date(now),
        device: b.dev_name.clone(),
        model: format!("{} ({})", b.model_name, fmt_count(b.params)),
        settings,
        gen_tokens_per_s: r.gen.as_ref().map(|g| g.tokens_per_s),
        train_tokens_per_s: r.train.as_ref().map(|t| t.tokens_per_s),
        mfu: r.train.as_ref().and_then(|t| t.mfu),
        rl: r.rl.as_ref().map(|r| r.figures.clone()),
        vs_trl: r.vs_trl,
        trl_peak_rss_gb: r.trl.as_ref().and_then(|t| t.peak_rss_gb),
    };
    if a.json {
        let line = serde_json::json!({
            "model": b.model_name, "params": b.params, "device": b.dev_name, "dtype": a.dtype,
            "batch": a.batch, "group": a.group, "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens, "repeats": a.repeats,
            "gen": r.gen, "train": r.train, "rl": r.rl,
            "trl": r.trl,
            "vs_trl": r.vs_trl,
            "machine": b.machine,
            "dp": r.dp,
            "overlap": r.overlap,
            "decode": r.decode.as_ref().map(|d| &d.0),
            "hf": r.decode.as_ref().and_then(|d| d.1.as_ref()),
        });
        println!("{line}");
    }
    let Some(path) = a.record.as_ref().filter(|_| !a.no_record) else { return Ok(()) };
    if do_gen || do_train || do_rl {
        report::append_row(path, &row)?;
    }
    let short = format!("{}, B={} G={}, new {}", a.dtype, a.batch, a.group, a.new_tokens);
    if let Some(d) = &r.dp {
        let stages = dp::stage_rows(&row.date, &b.dev_name, &row.model, &short, d);
        dp::record(path, &dp::markdown_row(&row.date, &b.dev_name, &row.model, &short, d), &stages)?;
    }
    if let Some(o) = &r.overlap {
        let settings = overlap::settings(short.clone(), a.overlap_no_warmup, a.overlap_vllm.len());
        overlap::record(path, &overlap::markdown_rows(&row.date, &b.dev_name, &row.model, &settings, o))?;
    }
    if let Some((rows, hf)) = &r.decode {
        let settings = format!("{}, prompt {} new {}, {} reps", a.dtype, a.prompt_len, a.decode_new_tokens, a.repeats);
        decode::record(path, &row.date, &b.dev_name, &row.model, &settings, rows, hf.as_ref())?;
    }
    println!("recorded in {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).unwrap().bench
    }

    #[test]
    fn sections_and_defaults() {
        let all = parse(&[]);
        assert_eq!(all.sections(), [true, true, true, false, false, false]);
        assert_eq!(parse(&["all"]).sections(), [true; 6]);
        assert_eq!(parse(&["overlap"]).sections(), [false, false, false, false, true, false]);
        assert_eq!(parse(&["decode"]).sections(), [false, false, false, false, false, true]);
        assert_eq!(parse(&["decode"]).decode_batches, vec![1, 8, 64]);
        assert_eq!(parse(&["decode", "--decode-batches", "2,256"]).decode_batches, vec![2, 256]);
        assert_eq!((all.model.as_str(), all.batch, all.group, all.repeats), ("builtin:tiny", 4, 4, 3));
        assert_eq!(parse(&["gen"]).sections(), [true, false, false, false, false, false]);
        assert_eq!(parse(&["--only", "gen,rl"]).sections(), [true, false, true, false, false, false]);
        assert_eq!(parse(&["dp"]).sections(), [false, false, false, true, false, false]);
        assert_eq!(parse(&["--only", "train", "--only", "all"]).sections(), [true; 6]);
        let a = parse(&["rl", "-g", "8", "--batch", "2", "--runs", "5", "--vs-trl", "--dtype", "bf16"]);
        assert_eq!((a.group, a.batch, a.repeats, a.vs_trl, a.dtype.as_str()), (8, 2, 5, true, "bf16"));
        assert!(Cli::try_parse_from(["bench", "--only", "prefill"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--dtype", "f16"]).is_err());
    }

    #[test]
    fn rl_config_overrides_the_grpo_preset() {
        let setup = rl::RlSetup {
            algo: "grpo",
            model_dir: std::path::Path::new("/m"),
            device: "cpu",
            dtype: "bf16",
            batch: 3,
            group: 5,
            prompt_len: 16,
            new_tokens: 7,
            repeats: 2,
            prompts: None,
            run_dir: PathBuf::from("/tmp/run"),
            gradient_checkpointing: true,
            bf16_decode: true,
            padding_free: true,
            micro_batch_tokens: Some(64),
            warmup: false,
        };
        let cfg = rl::config(&setup).unwrap();
        assert!(cfg.train.gradient_checkpointing);
        assert!(cfg.train.padding_free);
        assert_eq!(cfg.train.micro_batch_tokens, Some(64));
        assert_eq!(cfg.rollout.decode_dtype, rlhf_trainer::config::DecodeDtype::Bf16);
        assert_eq!(cfg.algorithm.name, "grpo");
        assert_eq!(cfg.model.actor, "/m");
        assert_eq!((cfg.rollout.prompts_per_batch, cfg.rollout.samples_per_prompt), (3, 5));
        assert_eq!((cfg.rollout.max_new_tokens, cfg.data.max_prompt_len), (7, 16));
        assert_eq!((cfg.train.minibatch_size, cfg.train.ppo_epochs, cfg.warmup.steps), (15, 1, 0));
        assert_eq!((cfg.run.dtype.as_str(), cfg.data.prompts.as_str()), ("bf16", "builtin:addition"));
        assert_eq!(cfg.rewards[0].plugin, "reward-rules");
        let cfg = rl::config(&rl::RlSetup { algo: "ppo", ..setup }).unwrap();
        assert_eq!((cfg.algorithm.name.as_str(), cfg.model.critic.as_str()), ("ppo", "actor"));
        assert_eq!((cfg.train.minibatch_size, cfg.rollout.samples_per_prompt), (15, 5));
    }
}
