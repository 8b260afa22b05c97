//! `rlhf train` (the RL loop).

use std::path::PathBuf;

use rlhf_plugin_api::PluginKind;
use rlhf_trainer::checkpoint;
use rlhf_trainer::config::{aliases, ConfigSource, PRESETS};
use rlhf_trainer::run_lock::RunLock;
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
    /// Continue from a checkpoint: its directory, a run directory (its newest checkpoint), or
    /// `latest` (the newest in the configured run dir). Without --config/--algo the checkpoint's
    /// own config is used; with them, they must match it except in what does not change the
    /// trained numbers (train.steps, checkpoint.*, wandb.*, eval.*, run.run_dir, run.device,
    /// plugin_dirs, where the vLLM servers, the environment and remote reward sources are and
    /// their timeouts and retries, environment.max_failed_batches; each change is logged). The
    /// prompt files must be those the checkpoint read (see --allow-data-change). A checkpoint
    /// outside `RUN/checkpoints/` needs --run-dir.
    #[arg(long, value_name = "DIR|latest")]
    resume: Option<PathBuf>,
    /// Start N data-parallel ranks on this machine (Gloo on CPU, NCCL on CUDA); for several machines use torchrun.
    #[arg(long, value_name = "N")]
    nproc: Option<usize>,
    /// With --resume: continue even if a prompt file changed since the checkpoint (its position
    /// in the data then points at other prompts).
    #[arg(long)]
    allow_data_change: bool,
}

pub(crate) fn registry(cfg_dirs: &[PathBuf]) -> anyhow::Result<PluginRegistry> {
    let dirs = if cfg_dirs.is_empty() { rlhf_trainer::plugins::default_plugin_dirs() } else { cfg_dirs.to_vec() };
    Ok(PluginRegistry::scan(&dirs)?)
}

/// The config source named by --config / --algo (default: the grpo preset).
fn source_of(config: &Option<PathBuf>, algo: &Option<String>) -> ConfigSource {
    match (config, algo) {
        (Some(path), _) => ConfigSource::File(path.clone()),
        (None, Some(algo)) => ConfigSource::Preset(algo.clone()),
        (None, None) => ConfigSource::Preset("grpo".into()),
    }
}

pub fn train(args: TrainArgs) -> anyhow::Result<()> {
    if crate::launcher::launched(args.nproc)? {
        return Ok(());
    }
    let world = crate::common::world()?;
    let mut sets = args.sets.clone();
    if let Some(dir) = &args.run_dir {
        sets.push(format!("run.run_dir={}", toml_string(&dir.display().to_string())));
    }
    let (cfg, resume) = match &args.resume {
        None => (RlConfig::load(&source_of(&args.config, &args.algo), args.algo.as_deref(), &sets)?, None),
        Some(spec) => {
            let configured = args.config.is_some() || args.algo.is_some();
            // `latest` looks in the configured run dir (from the config, --run-dir or --set).
            let run_dir = if spec.as_os_str() == "latest" {
                RlConfig::load(&source_of(&args.config, &args.algo), args.algo.as_deref(), &sets)?.run.run_dir
            } else {
                None
            };
            // A run still going on owns its directory (and prunes its checkpoints): say so first.
            let named = [Some(spec.as_path()).filter(|p| p.as_os_str() != "latest"), run_dir.as_deref()];
            // (Rank 0 checks: the other ranks would find rank 0 holding it.)
            if world.is_main() {
                for d in named.into_iter().chain([args.run_dir.as_deref()]).flatten() {
                    RunLock::check_free(d)?;
                }
            }
            let dir = checkpoint::resolve(spec, run_dir.as_deref())?;
            let ckpt_run_dir = crate::resume::resumed_run_dir(&dir, args.run_dir.as_deref())?;
            if world.is_main() {
                RunLock::check_free(&ckpt_run_dir)?;
            }
            let mut ckpt = checkpoint::load(&dir)?;
            ckpt.allow_data_change = args.allow_data_change;
            let cfg = if configured {
                RlConfig::load(&source_of(&args.config, &args.algo), args.algo.as_deref(), &sets)?
            } else {
                RlConfig::load(&ConfigSource::File(dir.join("config.toml")), None, &sets)?
            };
            let mut cfg = cfg;
            crate::resume::check_same_config(&dir, &ckpt.config_toml, &cfg, RL_MAY_DIFFER, aliases::RL)?;
            cfg.run.run_dir = Some(ckpt_run_dir);
            (cfg, Some(ckpt))
        }
    };
    let reg = registry(&cfg.plugin_dirs)?;
    // The plugin `--algo` selects: the config's (a preset named by `--algo` names its own plugin).
    if let Some(algo) = args.algo.as_ref().map(|_| &cfg.algorithm.name) {
        if let Err(e) = reg.get(algo, PluginKind::Algorithm) {
            // The offline phases have commands of their own (TRL's DPOTrainer, SFTTrainer, RewardTrainer).
            let offline = match algo.to_ascii_lowercase().as_str() {
                "dpo" | "ipo" | "simpo" | "cdpo" => Some("dpo"),
                "sft" => Some("sft"),
                "rm" | "reward" => Some("rm"),
                _ => None,
            };
            if let Some(cmd) = offline {
                anyhow::bail!(
                    "--algo {algo}: `rlhf train` runs online RL; {algo} trains on a dataset with `rlhf {cmd}`"
                );
            }
            let presets: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            anyhow::bail!("unknown --algo `{algo}`: {e} (presets: {})", presets.join(", "));
        }
    }
    let trainer = Trainer::new(cfg, &reg, resume.as_ref(), world.clone())?;
    tracing::info!("run dir: {}", trainer.run_dir().display());
    let summary = trainer.run()?;
    if !world.is_main() {
        return Ok(());
    }
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

/// Keys of `rlhf train` that may differ between a checkpoint's config and the resuming one.
const RL_MAY_DIFFER: &[&str] = &[
    "train.steps",
    "checkpoint.",
    "wandb.",
    "tensorboard.",
    "run.run_dir",
    "run.device",
    "plugin_dirs",
    // How the ranks hold the optimizer state: a checkpoint holds it whole, re-sharded on load.
    "distributed.",
    // Recomputing layers in backward changes memory and time, not the gradients (and ZeRO
    // stage 3 turns it on).
    "train.gradient_checkpointing",
    // Where the rollout servers are and how long to wait for them.
    "rollout.vllm.urls",
    "rollout.vllm.timeout_s",
    "rollout.vllm.retries",
    // Where an environment or a remote reward source is and how patiently it is called (a failure
    // after a resume's fix is what resuming is for), and how many failures the run tolerates.
    "environment.config.url",
    "environment.config.urls",
    "environment.config.timeout_s",
    "environment.config.retries",
    "environment.config.token_env",
    "environment.max_failed_batches",
    "rewards.*.config.url",
    "rewards.*.config.urls",
    "rewards.*.config.timeout_s",
    "rewards.*.config.retries",
    "rewards.*.config.token_env",
    // Evaluation never perturbs training; what is logged and how long an idle run waits neither.
    "eval.",
    "run.save_rollouts",
    "train.max_idle_steps",
];

pub(crate) fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}
