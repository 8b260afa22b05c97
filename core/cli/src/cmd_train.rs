//! `rlhf train` (the RL loop) and `rlhf plugins` (what the loader found).

use std::path::PathBuf;

use rlhf_plugin_api::PluginKind;
use rlhf_trainer::checkpoint;
use rlhf_trainer::config::{ConfigSource, PRESETS};
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
            let ckpt_run_dir = resumed_run_dir(&dir, args.run_dir.as_deref())?;
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
            check_same_config(&dir, &ckpt.config_toml, &cfg)?;
            cfg.run.run_dir = Some(ckpt_run_dir);
            (cfg, Some(ckpt))
        }
    };
    let reg = registry(&cfg.plugin_dirs)?;
    // The plugin `--algo` selects: the config's (a preset named by `--algo` names its own plugin).
    if let Some(algo) = args.algo.as_ref().map(|_| &cfg.algorithm.name) {
        if let Err(e) = reg.get(algo, PluginKind::Algorithm) {
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

/// Where a resumed run writes: `--run-dir` when given, else the run that holds the checkpoint
/// (`RUN/checkpoints/step-N`). A checkpoint moved elsewhere needs `--run-dir`, so a resume never
/// writes metrics, models and checkpoints into whatever directory happens to be its grandparent.
fn resumed_run_dir(ckpt: &std::path::Path, run_dir: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = run_dir {
        return Ok(dir.to_path_buf());
    }
    let parent = ckpt.parent().filter(|p| p.file_name().is_some_and(|n| n == "checkpoints"));
    match parent.and_then(|p| p.parent()) {
        Some(run) => Ok(if run.as_os_str().is_empty() { PathBuf::from(".") } else { run.to_path_buf() }),
        None => anyhow::bail!(
            "{}: not inside a run's checkpoints/ directory; pass --run-dir DIR to say where the resumed run writes",
            ckpt.display()
        ),
    }
}

/// Keys that may differ between a checkpoint's config and the resuming one.
const MAY_DIFFER: &[&str] = &[
    "train.steps",
    "checkpoint.",
    "wandb.",
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

/// Whether `key` (`a.b.c`) is one of [`MAY_DIFFER`]: equal, under a prefix ending in `.`, or
/// matching a pattern whose `*` stands for one key part (an array index).
fn may_differ(key: &str) -> bool {
    MAY_DIFFER.iter().any(|p| {
        if let Some(prefix) = p.strip_suffix('.') {
            return key == prefix || key.starts_with(p);
        }
        let (pk, kk): (Vec<&str>, Vec<&str>) = (p.split('.').collect(), key.split('.').collect());
        pk.len() == kk.len() && pk.iter().zip(&kk).all(|(a, b)| *a == "*" || a == b)
    })
}

/// Refuses to resume a checkpoint written under a different configuration, naming the keys.
fn check_same_config(dir: &std::path::Path, saved: &str, cfg: &RlConfig) -> anyhow::Result<()> {
    let saved: toml::Value =
        toml::from_str(saved).map_err(|e| anyhow::anyhow!("{}: corrupt checkpoint config.toml: {e}", dir.display()))?;
    let now = toml::Value::try_from(cfg)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    flatten(&saved, "", &mut a);
    flatten(&now, "", &mut b);
    let a: std::collections::BTreeMap<_, _> = a.into_iter().collect();
    let b: std::collections::BTreeMap<_, _> = b.into_iter().collect();
    let stage = |m: &std::collections::BTreeMap<String, String>| {
        m.get("distributed.zero_stage").cloned().unwrap_or_else(|| "0".into())
    };
    if stage(&a) != stage(&b) {
        tracing::info!(
            "resuming a ZeRO stage {} checkpoint at stage {}: the optimizer state is re-laid out",
            stage(&a),
            stage(&b)
        );
    }
    let mut diffs = Vec::new();
    for key in a.keys().chain(b.keys()).collect::<std::collections::BTreeSet<_>>() {
        let (x, y) = (a.get(key), b.get(key));
        if may_differ(key) {
            if x != y && !key.starts_with("run.run_dir") {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
                tracing::info!("resume: {key} changed ({} in the checkpoint, {} now)", show(x), show(y));
            }
            continue;
        }
        if x != y {
            let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".into());
            diffs.push(format!("{key} ({} there, {} here)", show(x), show(y)));
        }
    }
    if !diffs.is_empty() {
        let n = diffs.len();
        diffs.truncate(3);
        anyhow::bail!(
            "{}: checkpoint written by another config: {}{}",
            dir.display(),
            diffs.join(", "),
            if n > 3 { format!(" and {} more", n - 3) } else { String::new() }
        );
    }
    Ok(())
}

/// Every leaf of `v` as `(dotted key, value)`; an array of tables (`[[rewards]]`) by index
/// (`rewards.0.config.url`).
fn flatten(v: &toml::Value, prefix: &str, out: &mut Vec<(String, String)>) {
    let key = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    match v {
        toml::Value::Table(t) => {
            for (k, x) in t {
                flatten(x, &key(k), out);
            }
        }
        toml::Value::Array(items) if !items.is_empty() && items.iter().all(toml::Value::is_table) => {
            for (i, x) in items.iter().enumerate() {
                flatten(x, &key(&i.to_string()), out);
            }
        }
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

pub(crate) fn toml_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

pub fn plugins(args: PluginsArgs) -> anyhow::Result<()> {
    let reg = registry(&args.dirs)?;
    println!("{:<24} {:<12} {:<10} path", "name", "kind", "version");
    for p in reg.plugins() {
        println!("{:<24} {:<12} {:<10} {}", p.name, p.kind.to_string(), p.version, p.path.display());
    }
    for e in reg.environments() {
        println!("{:<24} {:<12} {:<10} {}", e.name, "environment", e.version, e.path.display());
    }
    if args.all || reg.plugins().next().is_none() {
        for (path, why) in &reg.refused {
            println!("refused: {}: {why}", path.display());
        }
    }
    Ok(())
}
