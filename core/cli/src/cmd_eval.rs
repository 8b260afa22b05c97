//! `rlhf eval`: held-out evaluation of a saved policy (a Hugging Face directory, a run directory
//! or a checkpoint) with the metrics of evaluation during training: reward means, pass@k, maj@n,
//! lengths and the per-`data_source` breakdown. Prints a table, writes the JSON summary to `--out`
//! and every answer next to it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rlhf_trainer::config::ConfigSource;
use rlhf_trainer::rl::eval::saved::evaluate_saved;
use rlhf_trainer::{PluginRegistry, RlConfig};

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// The policy: a Hugging Face model directory, a run directory (its exported actor/) or a
    /// checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Held-out prompts (JSONL or Parquet, with `[data]`'s columns; a `label` for the rule reward).
    #[arg(long)]
    data: Option<PathBuf>,
    /// RL config whose `[eval]`, `[[rewards]]`, `[data]` and `[run]` apply (default: the grpo
    /// preset, whose rule reward compares the answer with the `label` column).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Samples per prompt (eval.samples_per_prompt; n of pass@k and maj@n).
    #[arg(long)]
    samples: Option<usize>,
    /// Write the JSON summary here, and every answer to the same name with `.samples.jsonl`.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override a key: --set eval.temperature=0.6 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Start N data-parallel ranks on this machine; each answers a share of the prompts.
    #[arg(long, value_name = "N")]
    nproc: Option<usize>,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    if crate::launcher::launched(args.nproc)? {
        return Ok(());
    }
    let world = crate::common::world()?;
    let mut sets = args.sets.clone();
    if let Some(data) = &args.data {
        sets.push(format!("eval.data={}", crate::cmd_train::toml_string(&data.display().to_string())));
    }
    if let Some(n) = args.samples {
        sets.push(format!("eval.samples_per_prompt={n}"));
    }
    let source = match &args.config {
        Some(path) => ConfigSource::File(path.clone()),
        None => ConfigSource::Preset("grpo".into()),
    };
    let cfg = RlConfig::load(&source, None, &sets)?;
    if let (Some(out), true) = (&args.out, world.is_main()) {
        check_writable(out)?;
        check_writable(&samples_path(out))?;
    }
    let model = rlhf_hub::resolve_model(&args.model.to_string_lossy())?;
    if !model.exists() {
        anyhow::bail!("{}: no such model, run or checkpoint directory", args.model.display());
    }
    let dirs =
        if cfg.plugin_dirs.is_empty() { rlhf_trainer::plugins::default_plugin_dirs() } else { cfg.plugin_dirs.clone() };
    let registry = PluginRegistry::scan(&dirs)?;
    let samples = args.out.as_deref().map(samples_path);
    let result = evaluate_saved(&cfg, &registry, &model, &world, samples.as_deref())?;
    if !world.is_main() {
        return Ok(());
    }
    print_table(&args.model, &result.metrics, cfg.eval.samples_per_prompt);
    if let Some(out) = &args.out {
        let summary = serde_json::json!({
            "model": args.model,
            "data": cfg.eval.data,
            "samples_per_prompt": cfg.eval.samples_per_prompt,
            "correct_if": cfg.eval.correct_if,
            "metrics": result.metrics.iter().map(|(k, v)| (k.clone(), if v.is_finite() { serde_json::json!(v) } else { serde_json::Value::Null })).collect::<serde_json::Map<_, _>>(),
        });
        let text = serde_json::to_string_pretty(&summary)? + "\n";
        std::fs::write(out, text).map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
        println!("summary: {}", out.display());
        if let Some(s) = &samples {
            println!("answers: {}", s.display());
        }
    }
    Ok(())
}

/// Refuses an `--out` that cannot be written — a directory, a missing or read-only parent — before
/// any work: it opens the file for appending (nothing it holds changes) and removes it again when
/// it did not exist.
fn check_writable(path: &Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!("--out {}: is a directory; give a file name (the JSON summary)", path.display());
    }
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("--out {}: cannot be written: {e}", path.display()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// `summary.json` → `summary.samples.jsonl`.
fn samples_path(out: &Path) -> PathBuf {
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "eval".into());
    out.with_file_name(format!("{stem}.samples.jsonl"))
}

/// One row per data source (`all` first): prompts, mean reward, pass@k, maj@n, mean length.
fn print_table(model: &Path, m: &BTreeMap<String, f64>, n: usize) {
    let mut sources = vec![String::new()];
    sources.extend(m.keys().filter_map(|k| k.strip_prefix("eval/")?.strip_suffix("/prompts").map(String::from)));
    let ks = rlhf_trainer::rl::eval::estimators::pass_ks(n);
    let mut columns: Vec<String> = vec!["prompts".into(), "reward/mean".into()];
    columns.extend(ks.iter().map(|k| format!("pass@{k}")));
    columns.extend([format!("maj@{n}"), "length/mean".into()]);
    println!("{}", model.display());
    println!("{:<16}{}", "source", columns.iter().map(|c| format!("{c:>13}")).collect::<String>());
    for source in sources {
        let prefix = if source.is_empty() { "eval/".to_string() } else { format!("eval/{source}/") };
        let cells: String = columns
            .iter()
            .map(|c| match m.get(&format!("{prefix}{c}")) {
                Some(v) if c == "prompts" => format!("{v:>13.0}"),
                Some(v) => format!("{v:>13.4}"),
                None => format!("{:>13}", "-"),
            })
            .collect();
        println!("{:<16}{cells}", if source.is_empty() { "all" } else { &source });
    }
}
