//! `rlhf train` (the RL loop) and `rlhf plugins` (what the loader found).

use std::path::PathBuf;

use rlhf_plugin_api::PluginKind;
use rlhf_trainer::config::{ConfigSource, PRESETS};
use rlhf_trainer::{PluginRegistry, RlConfig, Trainer};

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Algorithm plugin (its preset from configs/ is used when --config is not given).
    #[arg(long)]
    algo: Option<String>,
    /// TOML config file (default: the embedded preset of --algo, else grpo).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key: --set train.steps=10 (repeatable; applied after the file).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory (shorthand for --set run.run_dir=DIR).
    #[arg(long)]
    run_dir: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct PluginsArgs {
    /// Directories to scan (default: next to the rlhf executable).
    #[arg(long = "dir")]
    dirs: Vec<PathBuf>,
    /// Also list refused files and why.
    #[arg(long)]
    all: bool,
}

fn registry(cfg_dirs: &[PathBuf]) -> anyhow::Result<PluginRegistry> {
    let dirs = if cfg_dirs.is_empty() { rlhf_trainer::plugins::default_plugin_dirs() } else { cfg_dirs.to_vec() };
    Ok(PluginRegistry::scan(&dirs)?)
}

pub fn train(args: TrainArgs) -> anyhow::Result<()> {
    let source = match (&args.config, &args.algo) {
        (Some(path), _) => ConfigSource::File(path.clone()),
        (None, Some(algo)) => ConfigSource::Preset(algo.clone()),
        (None, None) => ConfigSource::Preset("grpo".into()),
    };
    let mut sets = args.sets.clone();
    if let Some(dir) = &args.run_dir {
        sets.push(format!("run.run_dir={}", toml_string(&dir.display().to_string())));
    }
    let cfg = RlConfig::load(&source, args.algo.as_deref(), &sets)?;
    let reg = registry(&cfg.plugin_dirs)?;
    if let Some(algo) = &args.algo {
        if reg.get(algo, PluginKind::Algorithm).is_err() {
            let presets: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            anyhow::bail!(
                "unknown --algo `{algo}`; available algorithm plugins: {} (presets: {})",
                reg.names(PluginKind::Algorithm).join(", "),
                presets.join(", ")
            );
        }
    }
    let trainer = Trainer::new(cfg, &reg)?;
    tracing::info!("run dir: {}", trainer.run_dir().display());
    let summary = trainer.run()?;
    println!(
        "reward: first 10% of steps {:.3}, last 10% {:.3} ({} steps)",
        summary.reward_first, summary.reward_last, summary.steps
    );
    if let Some(a) = &summary.actor_dir {
        println!("final actor (Hugging Face format): {}", a.display());
    }
    println!("run dir: {}", summary.run_dir.display());
    println!("metrics: {}", summary.metrics_path.display());
    Ok(())
}

fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

pub fn plugins(args: PluginsArgs) -> anyhow::Result<()> {
    let reg = registry(&args.dirs)?;
    println!("{:<24} {:<10} {:<10} path", "name", "kind", "version");
    for p in reg.plugins() {
        println!("{:<24} {:<10} {:<10} {}", p.name, p.kind.to_string(), p.version, p.path.display());
    }
    if args.all || reg.plugins().next().is_none() {
        for (path, why) in &reg.refused {
            println!("refused: {}: {why}", path.display());
        }
    }
    Ok(())
}
