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
//!
//! `--vs-trl` runs TRL's `GRPOTrainer` on the same weights, prompts, B, G and lengths ([`trl`])
//! and prints TRL step / our step. `--record FILE` appends a row to a Markdown table.

mod dp;
pub(crate) mod machine;
mod measure;
mod overlap;
pub(crate) mod report;
mod rl;
pub(crate) mod trl;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use tch::{Device, Kind};

use rlhf_models::CausalLm;

use measure::{bench_gen, bench_train, TrainResult};
use report::{fmt_count, fmt_rate, fmt_secs, Row};

/// A part of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    Gen,
    Train,
    Rl,
    Dp,
    Overlap,
    All,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Run only this section (`rlhf bench gen` = `--only gen`); default: gen, train and rl (`all`
    /// adds dp).
    #[arg(value_enum)]
    section: Option<Section>,
    /// Hugging Face model directory or Hub id (any supported family) or `builtin:tiny`.
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Prompts per batch (B).
    #[arg(long, default_value_t = 4)]
    batch: i64,
    /// Samples per prompt (G); the gen and train sections run B·G sequences too.
    #[arg(long, short = 'g', default_value_t = 4)]
    group: i64,
    /// Prompt tokens of the gen and train sections (random tokens).
    #[arg(long, default_value_t = 32)]
    prompt_len: i64,
    /// The RL sections' `data.max_prompt_len`: longer prompts are cut from the left. The default
    /// keeps chat prompts whole, system prompt included.
    #[arg(long, default_value_t = 512)]
    rl_prompt_len: i64,
    /// New tokens per sequence (the RL section's max_new_tokens).
    #[arg(long, default_value_t = 32)]
    new_tokens: i64,
    /// Timed runs per figure (the median is reported), after one untimed warm-up run.
    #[arg(long, visible_alias = "runs", default_value_t = 3)]
    repeats: usize,
    /// Ranks of the dp section (each on one thread, against one rank on one thread).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Steps of each run of the overlap section.
    #[arg(long, default_value_t = 12)]
    overlap_steps: usize,
    /// Skip the preset's supervised warm-up in the overlap section (its rewards then compare
    /// an untrained policy).
    #[arg(long)]
    overlap_no_warmup: bool,
    /// Run the overlap section on these vLLM servers (comma-separated URLs, serving the model as
    /// `policy`), synchronously and at max_staleness 1; started by you, e.g. pinned to other cores.
    #[arg(long, value_delimiter = ',')]
    overlap_vllm: Vec<String>,
    /// Sections to run, comma-separated: gen, train, rl, dp, overlap, all.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Prompts JSONL for the RL section (`prompt` or `messages`, and `label`); default: the built-in
    /// addition task.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Peak TFLOP/s of the device for MFU (default: by CUDA device name; on CPU MFU is n/a without it).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// HBM bandwidth in GB/s for the decode bound on CUDA (default: by device name).
    #[arg(long)]
    hbm_gbps: Option<f64>,
    /// Also time TRL's GRPOTrainer on the same model, prompts, B, G and lengths; prints TRL/ours.
    #[arg(long)]
    vs_trl: bool,
    /// Activation checkpointing per decoder layer in the RL section (`train.gradient_checkpointing`),
    /// and in TRL's with --vs-trl (its `gradient_checkpointing`).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Sample the RL section's rollouts with a bf16 copy of the policy (`rollout.decode_dtype = "bf16"`; ours only).
    #[arg(long)]
    bf16_decode: bool,
    /// Python for --vs-trl (default: $RLHF_PYTHON, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// TRL driver (default: the built-in copy of xtask/scripts/trl_grpo_bench.py).
    #[arg(long)]
    trl_script: Option<PathBuf>,
    /// Append the result as a row to this Markdown file (created with a header if missing).
    #[arg(long)]
    record: Option<PathBuf>,
    /// Do not append to the --record file.
    #[arg(long)]
    no_record: bool,
    /// Also print every figure as one JSON line.
    #[arg(long)]
    json: bool,
    /// Seed of the random prompts, the built-in model and the RL run.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

impl BenchArgs {
    /// Which sections run, in order.
    fn sections(&self) -> [bool; 5] {
        let mut picked: Vec<Section> = self.only.clone();
        picked.extend(self.section);
        // `dp` and `overlap` start `rlhf train` processes (dp needs a prompt per rank): asked for
        // by name (or `all`), not run by default.
        if picked.is_empty() {
            return [true, true, true, false, false];
        }
        if picked.contains(&Section::All) {
            return [true; 5];
        }
        [Section::Gen, Section::Train, Section::Rl, Section::Dp, Section::Overlap].map(|s| picked.contains(&s))
    }
}

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

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let [do_gen, do_train, do_rl, do_dp, do_overlap] = args.sections();
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
    let (device, kind) = (rlhf_models::parse_device(&args.device)?, rlhf_models::parse_dtype(&args.dtype)?);
    if device.is_cuda() && !tch::Cuda::is_available() {
        bail!("--device {}: libtorch sees no CUDA device", args.device);
    }
    let work = WorkDir::new()?;
    let (model_dir, model_name) = match args.model.strip_prefix("builtin:") {
        Some("tiny") => {
            let dir = work.0.join("builtin-tiny");
            rlhf_trainer::builtin_models::write_tiny_model(&dir, args.seed)?;
            (dir, "builtin-tiny".to_string())
        }
        Some(other) => bail!("--model builtin:{other}: unknown built-in model (available: builtin:tiny)"),
        None => {
            let dir = rlhf_hub::resolve_model(&args.model)?;
            if !dir.is_dir() {
                bail!("--model {}: model directory not found", dir.display());
            }
            let name = std::fs::canonicalize(&dir)
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
                .unwrap_or_else(|| args.model.clone());
            (dir, name)
        }
    };
    let arch = rlhf_models::ModelConfig::from_dir(&model_dir)?.arch;
    let seq = args.prompt_len + args.new_tokens;
    if (do_gen || do_train) && seq > arch.max_position_embeddings {
        bail!(
            "--prompt-len + --new-tokens = {seq} exceeds the model's max_position_embeddings ({})",
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
    let rows = args.batch * args.group;
    println!(
        "model {model_name} ({} params, {:?}) | {} {} ({dev_name}) | B={} G={} ({rows} sequences), prompt {}, new {} \
         | medians of {} timed runs after 1 warm-up",
        fmt_count(params),
        arch.family,
        args.device,
        args.dtype,
        args.batch,
        args.group,
        args.prompt_len,
        args.new_tokens,
        args.repeats
    );

    println!(
        "machine: {} {} GEMM {:.1} GFLOP/s, memory copy {:.1} GB/s (measured now; MFU and the decode bound are \
         against these unless the GPU is known or --peak-tflops/--hbm-gbps say otherwise)",
        args.device,
        args.dtype,
        machine.gemm_tflops * 1e3,
        machine.copy_gbps
    );

    // The RL config and prompts come first: --vs-trl runs TRL before anything of ours touches the
    // device, so it has the GPU to itself.
    let rl_setup = rl::RlSetup {
        model_dir: &model_dir,
        device: &args.device,
        dtype: &args.dtype,
        batch: args.batch,
        group: args.group,
        prompt_len: args.rl_prompt_len,
        new_tokens: args.new_tokens,
        repeats: args.repeats,
        prompts: args.prompts.as_deref(),
        run_dir: work.0.join("rl-run"),
        gradient_checkpointing: args.gradient_checkpointing,
        bf16_decode: args.bf16_decode,
        warmup: false,
    };
    let rl_cfg = if do_rl { Some(rl::config(&rl_setup)?) } else { None };
    let dp_cfg = if do_dp { Some(rl::config(&rl_setup)?) } else { None };
    // The overlap section compares rewards too: the preset's warm-up makes them move.
    let overlap_setup = rl::RlSetup { warmup: !args.overlap_no_warmup, run_dir: rl_setup.run_dir.clone(), ..rl_setup };
    let overlap_cfg = if do_overlap { Some(rl::config(&overlap_setup)?) } else { None };
    let rl_prompts = match &rl_cfg {
        Some(cfg) => Some(rl::prompts(cfg, &model_dir)?),
        None => None,
    };
    let prompt_source = args.prompts.as_ref().map_or("builtin:addition".to_string(), |p| p.display().to_string());

    let trl = match (&rl_cfg, &rl_prompts) {
        (Some(cfg), Some((prompts, _))) if args.vs_trl => {
            let python = trl::python(args.python.as_deref());
            let versions = trl::check(&python, args.trl_script.as_deref(), &work.0)?;
            let file = work.0.join("trl-prompts.jsonl");
            let lines: Vec<String> =
                prompts.iter().map(|(p, l)| serde_json::json!({"prompt": p, "label": l}).to_string()).collect();
            std::fs::write(&file, lines.join("\n") + "\n")?;
            let algo = &cfg.algorithm.config;
            println!("trl:   running {} steps with {} ({versions}) ...", args.repeats + 1, python.display());
            let r = trl::run(&trl::TrlSetup {
                python: &python,
                script: args.trl_script.as_deref(),
                work_dir: &work.0,
                model_dir: &model_dir,
                prompts: &file,
                device: &args.device,
                dtype: &args.dtype,
                batch: args.batch,
                group: args.group,
                new_tokens: args.new_tokens,
                repeats: args.repeats,
                gradient_checkpointing: args.gradient_checkpointing,
                lr: cfg.train.lr,
                beta: algo.get("beta").and_then(|v| v.as_f64()).unwrap_or(0.04),
                epsilon: algo.get("epsilon").and_then(|v| v.as_f64()).unwrap_or(0.2),
                adam_beta2: cfg.train.adam_betas.1,
                max_grad_norm: cfg.train.max_grad_norm,
                seed: cfg.run.seed,
            })?;
            trl::print(&r);
            Some(r)
        }
        _ => None,
    };

    let (mut gen, mut train) = (None, None);
    if do_gen || do_train {
        let model = CausalLm::from_dir(&model_dir, device, kind)?;
        tch::manual_seed(args.seed as i64);
        if do_gen {
            // The decode bound: the GPU's HBM bandwidth from the table, else the measured copy bandwidth.
            let hbm = args.hbm_gbps.or_else(|| if device.is_cuda() { machine::hbm_gbps(&dev_name) } else { None });
            let hbm = hbm.or(Some(machine.copy_gbps));
            let peak = args.peak_tflops.or_else(|| {
                if device.is_cuda() {
                    report::peak_tflops(&dev_name, kind == Kind::BFloat16)
                } else {
                    Some(machine.gemm_tflops)
                }
            });
            let g = bench_gen(&model, rows, args.prompt_len, args.new_tokens, args.repeats, hbm, peak)?;
            println!(
                "gen:   {} tokens/s (median {} s per run of {rows}×{} new tokens, prefill {} s)",
                fmt_rate(g.tokens_per_s),
                fmt_secs(g.run_s),
                args.new_tokens,
                fmt_secs(g.prefill_s)
            );
            if let Some(f) = g.flops_fraction {
                println!("       decode at {:.1} % of the peak FLOP/s", 100.0 * f);
            }
            match g.hbm_fraction {
                Some(f) => println!("       decode at {:.1} % of the memory-bandwidth bound", 100.0 * f),
                None if device.is_cuda() => println!("       decode vs HBM bound: unknown GPU, pass --hbm-gbps"),
                None => {}
            }
            gen = Some(g);
        }
        if do_train {
            let (tokens_per_s, step_s) = bench_train(&model, rows, seq, args.repeats)?;
            let n = report::matmul_params(&arch);
            let flops_per_token =
                report::train_flops_per_token(n, arch.num_layers, arch.num_heads * arch.head_dim, seq);
            // The datasheet peak of a known GPU, else this run's measured GEMM peak.
            let peak = args.peak_tflops.or_else(|| {
                if device.is_cuda() {
                    report::peak_tflops(&dev_name, kind == Kind::BFloat16)
                } else {
                    None
                }
            });
            let peak = peak.or(Some(machine.gemm_tflops));
            let mfu = peak.map(|p| report::mfu(flops_per_token, tokens_per_s, p));
            println!(
                "train: {} tokens/s (median {} s per forward+backward+AdamW step over {rows}×{seq} tokens)",
                fmt_rate(tokens_per_s),
                fmt_secs(step_s)
            );
            let mfu_text = match (mfu, peak) {
                (Some(m), Some(p)) => format!("{:.2} % of {p:.3} TFLOP/s", 100.0 * m),
                _ if device.is_cuda() => "n/a (unknown GPU: pass --peak-tflops)".into(),
                _ => "n/a (CPU: pass --peak-tflops)".into(),
            };
            println!(
                "       MFU {mfu_text}; model FLOPs/token = 6·N + 12·L·H·T = {:.4e} (N = {} matmul params, L = {}, \
                 H = {}, T = {seq})",
                flops_per_token,
                fmt_count(n as u64),
                arch.num_layers,
                arch.num_heads * arch.head_dim
            );
            train = Some(TrainResult { tokens_per_s, step_s, flops_per_token, mfu, peak_tflops: peak });
        }
    }

    let rl = match rl_cfg {
        Some(cfg) => {
            let r = rl::run(cfg, args.repeats)?;
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
            println!(
                "       mean completion {:.1} tokens, reward {:.3}; prompts {prompt_source} (mean {:.1} tokens)",
                r.mean_completion_length,
                r.reward,
                rl_prompts.as_ref().map_or(0.0, |p| p.1)
            );
            rl::print_spread_and_memory(&r, trl.as_ref().and_then(|t| t.peak_rss_gb));
            Some(r)
        }
        None => None,
    };
    let dp = match &dp_cfg {
        Some(cfg) => {
            let r = dp::run(cfg, args.ranks, &work.0)?;
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
            Some(r)
        }
        None => None,
    };
    let overlap = match &overlap_cfg {
        Some(cfg) => {
            let ks = if args.overlap_vllm.is_empty() { "1, 2" } else { "1, on vLLM" };
            println!("overlap: {} steps each, synchronous (2 seeds) and max_staleness {ks}:", args.overlap_steps);
            Some(overlap::run(cfg, args.overlap_steps, &args.overlap_vllm, &work.0)?)
        }
        None => None,
    };
    let vs_trl = match (&trl, &rl) {
        (Some(t), Some(r)) if r.figures.step_s > 0.0 => Some(t.step_s / r.figures.step_s),
        _ => None,
    };
    if let Some(x) = vs_trl {
        println!("vs TRL: {} (TRL step time / ours; > 1 means ours is faster)", report::fmt_ratio(x));
    }

    let mut settings = format!(
        "{}, B={} G={}, prompt {} new {}",
        args.dtype, args.batch, args.group, args.prompt_len, args.new_tokens
    );
    if let Some((_, mean)) = &rl_prompts {
        settings.push_str(&format!(", RL prompts {prompt_source} ({mean:.1} tok)"));
    }
    for (on, what) in [(args.gradient_checkpointing, ", gradient checkpointing"), (args.bf16_decode, ", bf16 decode")] {
        if on {
            settings.push_str(what);
        }
    }
    settings.push_str(&format!(", {} reps", args.repeats));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let row = Row {
        date: report::utc_date(now),
        device: dev_name.clone(),
        model: format!("{model_name} ({})", fmt_count(params)),
        settings,
        gen_tokens_per_s: gen.as_ref().map(|g| g.tokens_per_s),
        train_tokens_per_s: train.as_ref().map(|t| t.tokens_per_s),
        mfu: train.as_ref().and_then(|t| t.mfu),
        rl: rl.as_ref().map(|r| r.figures.clone()),
        vs_trl,
        trl_peak_rss_gb: trl.as_ref().and_then(|t| t.peak_rss_gb),
    };
    if args.json {
        let line = serde_json::json!({
            "model": model_name, "params": params, "device": dev_name, "dtype": args.dtype,
            "batch": args.batch, "group": args.group, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "repeats": args.repeats,
            "gen": gen, "train": train, "rl": rl,
            "trl": trl,
            "vs_trl": vs_trl,
            "machine": machine,
            "dp": dp,
            "overlap": overlap,
        });
        println!("{line}");
    }
    match &args.record {
        Some(path) if !args.no_record => {
            if do_gen || do_train || do_rl {
                report::append_row(path, &row)?;
            }
            if let Some(r) = &dp {
                let settings = format!("{}, B={} G={}, new {}", args.dtype, args.batch, args.group, args.new_tokens);
                let stages = dp::stage_rows(&row.date, &dev_name, &row.model, &settings, r);
                dp::record(path, &dp::markdown_row(&row.date, &dev_name, &row.model, &settings, r), &stages)?;
            }
            if let Some(r) = &overlap {
                let settings = format!("{}, B={} G={}, new {}", args.dtype, args.batch, args.group, args.new_tokens);
                let settings = overlap::settings(settings, args.overlap_no_warmup, args.overlap_vllm.len());
                overlap::record(path, &overlap::markdown_rows(&row.date, &dev_name, &row.model, &settings, r))?;
            }
            println!("recorded in {}", path.display());
        }
        _ => {}
    }
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
        assert_eq!(all.sections(), [true, true, true, false, false]);
        assert_eq!(parse(&["all"]).sections(), [true; 5]);
        assert_eq!(parse(&["overlap"]).sections(), [false, false, false, false, true]);
        assert_eq!((all.model.as_str(), all.batch, all.group, all.repeats), ("builtin:tiny", 4, 4, 3));
        assert_eq!(parse(&["gen"]).sections(), [true, false, false, false, false]);
        assert_eq!(parse(&["--only", "gen,rl"]).sections(), [true, false, true, false, false]);
        assert_eq!(parse(&["dp"]).sections(), [false, false, false, true, false]);
        assert_eq!(parse(&["--only", "train", "--only", "all"]).sections(), [true; 5]);
        let a = parse(&["rl", "-g", "8", "--batch", "2", "--runs", "5", "--vs-trl", "--dtype", "bf16"]);
        assert_eq!((a.group, a.batch, a.repeats, a.vs_trl, a.dtype.as_str()), (8, 2, 5, true, "bf16"));
        assert!(Cli::try_parse_from(["bench", "--only", "decode"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--dtype", "f16"]).is_err());
    }

    #[test]
    fn rl_config_overrides_the_grpo_preset() {
        let setup = rl::RlSetup {
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
            warmup: false,
        };
        let cfg = rl::config(&setup).unwrap();
        assert!(cfg.train.gradient_checkpointing);
        assert_eq!(cfg.rollout.decode_dtype, rlhf_trainer::config::DecodeDtype::Bf16);
        assert_eq!(cfg.algorithm.name, "grpo");
        assert_eq!(cfg.model.actor, "/m");
        assert_eq!((cfg.rollout.prompts_per_batch, cfg.rollout.samples_per_prompt), (3, 5));
        assert_eq!((cfg.rollout.max_new_tokens, cfg.data.max_prompt_len), (7, 16));
        assert_eq!((cfg.train.minibatch_size, cfg.train.ppo_epochs, cfg.warmup.steps), (15, 1, 0));
        assert_eq!((cfg.run.dtype.as_str(), cfg.data.prompts.as_str()), ("bf16", "builtin:addition"));
        assert_eq!(cfg.rewards[0].plugin, "reward-rules");
    }
}
