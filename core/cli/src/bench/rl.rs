//! The RL section of `rlhf bench`: the real [`Trainer`] on an embedded algorithm preset (`grpo`
//! unless `--algo` says otherwise) with the benchmark's model, batch, G and lengths, timed per
//! phase from the `time/*` metrics that [`Trainer::train_step`] returns.

use std::path::{Path, PathBuf};

use rlhf_models::ArchConfig;
use rlhf_plugin_api::PluginKind;
use rlhf_trainer::config::ConfigSource;
use rlhf_trainer::data::{PromptDataset, RawPrompt};
use rlhf_trainer::metrics::StepMetrics;
use rlhf_trainer::prompt_images::PromptImages;
use rlhf_trainer::{PluginRegistry, RlConfig, Trainer};
use tch::Device;

use super::report::{median, RlFigures};

/// What the RL section runs.
pub struct RlSetup<'a> {
    /// The algorithm preset (`grpo`, `ppo`, ...).
    pub algo: &'a str,
    pub model_dir: &'a Path,
    pub device: &'a str,
    pub dtype: &'a str,
    /// Prompts per step (B).
    pub batch: i64,
    /// Samples per prompt (G).
    pub group: i64,
    /// `data.max_prompt_len`: longer prompts are truncated from the left.
    pub prompt_len: i64,
    pub new_tokens: i64,
    pub repeats: usize,
    /// A prompts JSONL; `None`: the built-in addition task.
    pub prompts: Option<&'a Path>,
    pub run_dir: PathBuf,
    /// `train.gradient_checkpointing`.
    pub gradient_checkpointing: bool,
    /// `rollout.decode_dtype = "bf16"`.
    pub bf16_decode: bool,
    /// `train.padding_free`.
    pub padding_free: bool,
    /// `train.micro_batch_tokens`.
    pub micro_batch_tokens: Option<usize>,
    /// Keep the preset's supervised warm-up (which teaches the answer format, so rewards move).
    pub warmup: bool,
}

/// Medians over the timed steps.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RlResult {
    pub figures: RlFigures,
    pub mean_completion_length: f64,
    pub reward: f64,
    /// Every timed step's seconds, in order: an outlier shows here, not in the median.
    pub step_times: Vec<f64>,
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The algorithm's preset with the benchmark's overrides: no supervised warm-up (unless
/// `s.warmup`), one optimizer step per generation batch (`minibatch_size = B·G`, one epoch), the
/// critic (PPO's) on the benchmark's model too, nothing saved, no W&B.
pub fn config(s: &RlSetup<'_>) -> anyhow::Result<RlConfig> {
    let prompts = match s.prompts {
        Some(p) => toml_string(&p.display().to_string()),
        None => toml_string("builtin:addition"),
    };
    let mut sets = vec![
        format!("model.actor={}", toml_string(&s.model_dir.display().to_string())),
        format!("run.device={}", toml_string(s.device)),
        format!("run.dtype={}", toml_string(s.dtype)),
        format!("run.run_dir={}", toml_string(&s.run_dir.display().to_string())),
        "run.save_actor=false".into(),
        format!("data.prompts={prompts}"),
        format!("data.max_prompt_len={}", s.prompt_len),
        format!("rollout.prompts_per_batch={}", s.batch),
        format!("rollout.samples_per_prompt={}", s.group),
        format!("rollout.max_new_tokens={}", s.new_tokens),
        format!("train.steps={}", s.repeats + 1),
        "train.ppo_epochs=1".into(),
        format!("train.minibatch_size={}", s.batch * s.group),
        "checkpoint.every=0".into(),
        "checkpoint.at_end=false".into(),
        "wandb.enabled=false".into(),
        format!("train.gradient_checkpointing={}", s.gradient_checkpointing),
        format!("rollout.decode_dtype={}", if s.bf16_decode { "\"bf16\"" } else { "\"model\"" }),
        format!("train.padding_free={}", s.padding_free),
    ];
    if !s.warmup {
        sets.push("warmup.steps=0".into());
    }
    if let Some(n) = s.micro_batch_tokens {
        sets.push(format!("train.micro_batch_tokens={n}"));
    }
    Ok(RlConfig::load(&ConfigSource::Preset(s.algo.into()), Some(s.algo), &sets)?)
}

/// A prompt as TRL is given it: its text (as the model sees it, or for a prompt with images the
/// row's text with its `<image>` markers), its label, and its images' paths.
#[derive(Debug, Clone)]
pub struct BenchPrompt {
    pub text: String,
    pub label: Option<String>,
    pub images: Vec<String>,
}

/// The RL section's prompts.
pub type LabelledPrompts = Vec<BenchPrompt>;

/// The prompts as the model sees them (template applied, truncated like the trainer does) with
/// their labels, and their mean length in tokens (image placeholders included).
pub fn prompts(cfg: &RlConfig, model_dir: &Path) -> anyhow::Result<(LabelledPrompts, f64)> {
    let tok = rlhf_tokenizer::HfTokenizer::from_dir(model_dir)?;
    let raw = match cfg.data.prompts.strip_prefix("builtin:") {
        Some(task) => rlhf_trainer::builtin::task_prompts(task)?,
        None => rlhf_trainer::data::read_prompt_data(&cfg.data)?,
    };
    let arch = rlhf_models::ModelConfig::from_dir(model_dir)?.arch;
    let images = PromptImages::for_model(model_dir, &arch, &tok)?;
    if let Some(images) = images.as_ref() {
        let rows: LabelledPrompts = raw.iter().map(image_row).collect::<anyhow::Result<_>>()?;
        let data = PromptDataset::new_with_images(raw, &tok, &cfg.data, cfg.run.seed, Some(images))?;
        let mean = data.records.iter().map(|r| r.ids.len() as f64).sum::<f64>() / data.records.len().max(1) as f64;
        return Ok((rows, mean));
    }
    let data = PromptDataset::new(raw, &tok, &cfg.data, cfg.run.seed)?;
    let mut out = Vec::with_capacity(data.records.len());
    for r in &data.records {
        // A truncated prompt is given as the text of the tokens that are left.
        let text = if data.truncated > 0 && r.ids.len() == cfg.data.max_prompt_len {
            tok.decode(&r.ids, false)?
        } else {
            r.text.clone()
        };
        out.push(BenchPrompt { text, label: r.label.clone(), images: Vec::new() });
    }
    let mean = data.records.iter().map(|r| r.ids.len() as f64).sum::<f64>() / data.records.len().max(1) as f64;
    Ok((out, mean))
}

/// A text row with images as TRL is given it: its text with the `<image>` markers and the images'
/// paths (the rows were read from a file: their images are absolute paths).
fn image_row(raw: &RawPrompt) -> anyhow::Result<BenchPrompt> {
    let RawPrompt::Text { prompt, label, metadata } = raw else {
        anyhow::bail!("--vs-trl with images compares text prompts with `<image>` markers, not chat messages");
    };
    let images = match metadata.get("images") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|p| p.as_str().map(String::from)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| anyhow::anyhow!("--vs-trl with images needs image paths, got {v}"))?,
    };
    Ok(BenchPrompt { text: prompt.clone(), label: label.clone(), images })
}

/// Writes the built-in visual task's training scenes drawn `side` pixels a side into `work`
/// (`images/*.png`) with a JSONL of their prompts (`<image> question`, `images`, `label`); returns
/// the JSONL's path. `arch` must read images, and the prompts must not come from elsewhere too.
pub fn write_image_prompts(work: &Path, side: u32, arch: &ArchConfig, other_prompts: bool) -> anyhow::Result<PathBuf> {
    if arch.vision.is_none() {
        anyhow::bail!("--image-size {side}: the model reads no images (try --model builtin:tiny-qwen2.5-vl)");
    }
    if other_prompts {
        anyhow::bail!("--image-size draws the built-in visual task's prompts: leave out --prompts");
    }
    if !(28..=2048).contains(&side) {
        anyhow::bail!("--image-size {side}: expected 28 to 2048 pixels");
    }
    let dir = work.join("images");
    std::fs::create_dir_all(&dir)?;
    let mut lines = Vec::new();
    for (i, row) in rlhf_trainer::builtin_shapes::prompts_sized("-train", side)?.into_iter().enumerate() {
        let RawPrompt::Text { prompt, label, metadata } = row else { continue };
        let b64 = metadata["images"][0]["bytes"]["$binary"].as_str().unwrap_or_default();
        let bytes =
            rlhf_vision::prompt::decode_base64(b64).ok_or_else(|| anyhow::anyhow!("scene {i}: no image bytes"))?;
        let file = dir.join(format!("{i}.png"));
        std::fs::write(&file, bytes)?;
        let row = serde_json::json!({"prompt": prompt, "images": [file.display().to_string()], "label": label});
        lines.push(row.to_string());
    }
    let path = work.join("image-prompts.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n")?;
    Ok(path)
}

fn median_of(steps: &[StepMetrics], key: &str) -> f64 {
    median(&steps.iter().filter_map(|m| m.get(key)).collect::<Vec<_>>()).unwrap_or(0.0)
}

/// The trainer's phases, in [`RlFigures`]' order.
const PHASES: [&str; 6] = ["generate", "score", "old_logprobs", "reference", "values", "train"];

/// The largest value of `key` over the steps (a peak is a maximum, not a median).
fn max_of(steps: &[StepMetrics], key: &str) -> Option<f64> {
    steps.iter().filter_map(|m| m.get(key)).reduce(f64::max)
}

/// Each phase's share of the median step (`generate 93 % | ...`), the rest as `other`.
pub fn shares(f: &RlFigures) -> String {
    let phases = [
        ("generate", f.generate),
        ("score", f.score),
        ("old_logprobs", f.old_logprobs),
        ("reference", f.reference),
        ("values", f.values),
        ("train", f.train),
    ];
    if f.step_s.is_nan() || f.step_s <= 0.0 {
        return "n/a".into();
    }
    let known: f64 = phases.iter().map(|(_, s)| if s.is_nan() { 0.0 } else { *s }).sum();
    let mut parts: Vec<String> = phases
        .iter()
        .filter(|(_, s)| !s.is_nan())
        .map(|(name, s)| format!("{name} {:.1} %", 100.0 * s / f.step_s))
        .collect();
    parts.push(format!("other {:.1} %", 100.0 * (f.step_s - known).max(0.0) / f.step_s));
    parts.join(" | ")
}

/// Prints every timed step's time, the peak memory per phase and, when known, TRL's.
pub fn print_spread_and_memory(r: &RlResult, trl_peak_rss_gb: Option<f64>) {
    let times: Vec<String> = r.step_times.iter().map(|t| super::report::fmt_secs(*t)).collect();
    println!("       step times (s): {}", times.join(", "));
    print_memory(&r.figures, trl_peak_rss_gb);
}

/// Prints the peak memory per phase and, when known, TRL's.
fn print_memory(f: &RlFigures, trl_peak_rss_gb: Option<f64>) {
    let Some(peak) = f.peak_rss_gb else {
        println!("       peak memory: not measured (needs Linux /proc)");
        return;
    };
    let phases: Vec<String> =
        PHASES.iter().zip(&f.phase_peak_rss_gb).filter_map(|(p, gb)| gb.map(|gb| format!("{p} {gb:.2}"))).collect();
    let trl = match trl_peak_rss_gb {
        Some(t) if t > 0.0 => format!("; TRL {t:.2} GB, ours/TRL {:.2}x", peak / t),
        _ => String::new(),
    };
    println!("       peak RSS {peak:.2} GB ({} GB){trl}", phases.join(" | "));
}

/// Runs one untimed step and `repeats` timed ones of the real trainer; with `profile` (the
/// directory and the device), one more under the profiler (`profile.rs`, `rl.json`).
pub fn run(cfg: RlConfig, repeats: usize, profile: Option<(&Path, Device)>) -> anyhow::Result<RlResult> {
    let dirs =
        if cfg.plugin_dirs.is_empty() { rlhf_trainer::plugins::default_plugin_dirs() } else { cfg.plugin_dirs.clone() };
    let reg = PluginRegistry::scan(&dirs)?;
    let algo = (cfg.algorithm.name.as_str(), PluginKind::Algorithm);
    for (name, kind) in std::iter::once(algo).chain(cfg.rewards.iter().map(|r| (r.plugin.as_str(), PluginKind::Reward)))
    {
        if reg.get(name, kind).is_err() {
            anyhow::bail!(
                "the RL section needs the `{name}` plugin next to rlhf ({}); build it with `cargo build --release -p \
                 rlhf-plugin-{name}` (`cargo xtask bench` builds every plugin)",
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            );
        }
    }
    let mut trainer = Trainer::new(cfg, &reg, None, std::sync::Arc::new(rlhf_collective::World::single()))?;
    let mut steps = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let m = trainer.train_step()?;
        if i > 0 {
            steps.push(m);
        }
    }
    if let Some((dir, device)) = profile {
        super::profile::profile_once(dir, "rl", device, || trainer.train_step().map(drop).map_err(Into::into))?;
    }
    if steps.iter().any(|m| m.get("time/train").is_none()) {
        tracing::warn!("some RL steps had no response to train on; their phases are missing from the medians");
    }
    let figures = RlFigures {
        step_s: median_of(&steps, "step_time"),
        generate: median_of(&steps, "time/generate"),
        score: median_of(&steps, "time/score"),
        old_logprobs: median_of(&steps, "time/old_logprobs"),
        reference: median_of(&steps, "time/reference"),
        values: median_of(&steps, "time/values"),
        train: median_of(&steps, "time/train"),
        peak_rss_gb: max_of(&steps, "mem/peak_rss_gb"),
        phase_peak_rss_gb: PHASES.map(|p| max_of(&steps, &format!("mem/peak_rss_gb/{p}"))),
    };
    Ok(RlResult {
        figures,
        mean_completion_length: median_of(&steps, "completions/mean_length"),
        reward: median_of(&steps, "reward"),
        step_times: steps.iter().filter_map(|m| m.get("step_time")).collect(),
    })
}
