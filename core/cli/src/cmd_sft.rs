//! `rlhf sft`: supervised fine-tuning (DeepSpeed-Chat phase 1). [`PhaseArgs`] is shared with `rlhf rm`
//! and `rlhf dpo`.

use std::path::PathBuf;

use rlhf_trainer::checkpoint::{self, Loaded};
use rlhf_trainer::config::{aliases, ConfigSource};
use rlhf_trainer::run_lock::RunLock;
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
    /// Continue from a checkpoint: its directory, a run directory (its newest checkpoint), or
    /// `latest` (the newest in the configured run dir). Without --config the checkpoint's own
    /// config is used; with it, it must match except in train.steps, checkpoint.*, wandb.*,
    /// train.eval_every, train.eval_batch_size, data.eval, run.run_dir, run.device,
    /// distributed.* and train.gradient_checkpointing. The training data must be what the
    /// checkpoint read. A checkpoint outside `RUN/checkpoints/` needs --run-dir.
    #[arg(long, value_name = "DIR|latest")]
    resume: Option<PathBuf>,
}

/// Keys of the supervised phases that may differ between a checkpoint's config and the resuming
/// one: none changes the numbers of the steps still to run (a decaying schedule follows
/// `train.steps`, so changing it changes the rest of the learning-rate curve).
const PHASE_MAY_DIFFER: &[&str] = &[
    "train.steps",
    "checkpoint.",
    "wandb.",
    "tensorboard.",
    "train.eval_every",
    "train.eval_batch_size",
    "data.eval",
    "run.run_dir",
    "run.device",
    "distributed.",
    "train.gradient_checkpointing",
];

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

    /// The config to run and, with `--resume`, the verified checkpoint it continues: the
    /// checkpoint's own config unless `--config` is given (then it must match), run in the
    /// checkpoint's run directory (or `--run-dir`).
    pub(crate) fn load<C: serde::Serialize>(
        &self,
        preset: &str,
        load: impl Fn(&ConfigSource, &[String]) -> rlhf_trainer::Result<C>,
        run_dir_of: impl Fn(&C) -> Option<PathBuf>,
        main: bool,
    ) -> anyhow::Result<(C, Option<Loaded>)> {
        let (source, mut sets) = self.source_and_sets(preset);
        let Some(spec) = &self.resume else { return Ok((load(&source, &sets)?, None)) };
        let configured_dir = if spec.as_os_str() == "latest" { run_dir_of(&load(&source, &sets)?) } else { None };
        if main {
            let named = [Some(spec.as_path()).filter(|p| p.as_os_str() != "latest"), configured_dir.as_deref()];
            for d in named.into_iter().chain([self.run_dir.as_deref()]).flatten() {
                RunLock::check_free(d)?;
            }
        }
        let dir = checkpoint::resolve(spec, configured_dir.as_deref())?;
        let run_dir = crate::resume::resumed_run_dir(&dir, self.run_dir.as_deref())?;
        if main {
            RunLock::check_free(&run_dir)?;
        }
        let ckpt = checkpoint::load(&dir)?;
        let phase = ckpt.state.get("phase").and_then(|p| p.as_str()).unwrap_or("train");
        if phase != preset {
            anyhow::bail!("{}: a checkpoint of `rlhf {phase}`, not of `rlhf {preset}`", dir.display());
        }
        sets.push(format!("run.run_dir={}", toml_string(&run_dir.display().to_string())));
        let source = if self.config.is_some() { source } else { ConfigSource::File(dir.join("config.toml")) };
        let cfg = load(&source, &sets)?;
        crate::resume::check_same_config(&dir, &ckpt.config_toml, &cfg, PHASE_MAY_DIFFER, aliases::SUPERVISED)?;
        Ok((cfg, Some(ckpt)))
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
    let world = crate::common::world()?;
    let (cfg, resume) = args.load("sft", SftConfig::load, |c| c.run.run_dir.clone(), world.is_main())?;
    let s = run_sft(cfg, &world, resume.as_ref())?;
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
