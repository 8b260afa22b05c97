//! `rlhf sft`: supervised fine-tuning (DeepSpeed-Chat phase 1). [`PhaseArgs`] is shared with `rlhf rm`
//! and `rlhf dpo`.

use std::path::PathBuf;

use rlhf_trainer::config::ConfigSource;
use rlhf_trainer::sft::{run_sft, SftConfig};

/// Arguments of `rlhf sft`, `rlhf rm` and `rlhf dpo`.
#[derive(clap::Args, Debug)]
pub struct PhaseArgs {
    /// TOML config file (default: the embedded preset, configs/sft.toml, rm.toml or dpo.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key: --set train.epochs=2 (repeatable; applied after the file and RLHF_* variables).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory (shorthand for --set run.run_dir=DIR).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Start N data-parallel ranks on this machine (Gloo on CPU, NCCL on CUDA); for several machines use torchrun.
    #[arg(long, value_name = "N")]
    pub(crate) nproc: Option<usize>,
}

impl PhaseArgs {
    pub(crate) fn source_and_sets(&self, preset: &str) -> (ConfigSource, Vec<String>) {
        let source = match &self.config {
            Some(p) => ConfigSource::File(p.clone()),
            None => ConfigSource::Preset(preset.into()),
        };
        let mut sets = self.sets.clone();
        if let Some(dir) = &self.run_dir {
            sets.push(format!("run.run_dir={}", toml_string(&dir.display().to_string())));
        }
        (source, sets)
    }
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A metric with 4 decimals, `-` when absent.
pub(crate) fn show(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

/// `rlhf sft`.
pub fn sft(args: PhaseArgs) -> anyhow::Result<()> {
    if crate::launcher::launched(args.nproc)? {
        return Ok(());
    }
    let (source, sets) = args.source_and_sets("sft");
    let cfg = SftConfig::load(&source, &sets)?;
    let world = crate::common::world()?;
    let s = run_sft(cfg, &world)?;
    if !world.is_main() {
        return Ok(());
    }
    println!(
        "eval perplexity: before {}, after {} ({} eval examples; {} train examples, {} steps)",
        show(s.eval_ppl_before),
        show(s.eval_ppl_after),
        s.eval_examples,
        s.train_examples,
        s.steps
    );
    println!("final model (Hugging Face format): {}", s.model_dir.display());
    println!("run dir: {}", s.run_dir.display());
    println!("metrics: {}", s.metrics_path.display());
    Ok(())
}
