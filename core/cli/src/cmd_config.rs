//! `rlhf config show`: the merged configuration of `rlhf train` (or `sft`, `rm`, `dpo`) with where each
//! value came from — the file or embedded preset, an `RLHF_SECTION__KEY` variable, a `--set`, or
//! the built-in default.

use std::path::PathBuf;

use rlhf_trainer::config::{load_layered_figment, provenance, ConfigSource};
use rlhf_trainer::dpo::DpoConfig;
use rlhf_trainer::rm::RmConfig;
use rlhf_trainer::sft::{SftConfig, PHASE_PRESETS};
use rlhf_trainer::RlConfig;

#[derive(clap::Subcommand, Debug)]
pub enum ConfigCommand {
    /// Print the merged config, one `key = value  # source` line per key.
    Show(ShowArgs),
}

#[derive(clap::Args, Debug)]
pub struct ShowArgs {
    /// Which command's config: `train`, `sft`, `rm` or `dpo`.
    #[arg(long, default_value = "train", value_parser = ["train", "sft", "rm", "dpo"])]
    command: String,
    /// TOML config file (default: the embedded preset).
    #[arg(long)]
    config: Option<PathBuf>,
    /// For `train`: the algorithm (its preset when --config is not given).
    #[arg(long)]
    algo: Option<String>,
    /// Overrides, as for the command itself.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    let ConfigCommand::Show(args) = cmd;
    let preset = |name: &str| ConfigSource::Preset(name.to_string());
    let rows = match args.command.as_str() {
        "train" => {
            let source = match (&args.config, &args.algo) {
                (Some(p), _) => ConfigSource::File(p.clone()),
                (None, Some(a)) => preset(a),
                (None, None) => preset("grpo"),
            };
            let (cfg, fig) = RlConfig::load_figment(&source, args.algo.as_deref(), &args.sets)?;
            provenance(&cfg, &fig)?
        }
        "sft" => {
            let source = args.config.clone().map(ConfigSource::File).unwrap_or_else(|| preset("sft"));
            let cfg = SftConfig::load(&source, &args.sets)?;
            let (_, fig) = load_layered_figment::<SftConfig>(
                &source,
                PHASE_PRESETS,
                &args.sets,
                rlhf_trainer::config::aliases::SUPERVISED,
            )?;
            provenance(&cfg, &fig)?
        }
        "dpo" => {
            let source = args.config.clone().map(ConfigSource::File).unwrap_or_else(|| preset("dpo"));
            let cfg = DpoConfig::load(&source, &args.sets)?;
            let (_, fig) = load_layered_figment::<DpoConfig>(
                &source,
                PHASE_PRESETS,
                &args.sets,
                rlhf_trainer::config::aliases::SUPERVISED,
            )?;
            provenance(&cfg, &fig)?
        }
        _ => {
            let source = args.config.clone().map(ConfigSource::File).unwrap_or_else(|| preset("rm"));
            let cfg = RmConfig::load(&source, &args.sets)?;
            let (_, fig) = load_layered_figment::<RmConfig>(
                &source,
                PHASE_PRESETS,
                &args.sets,
                rlhf_trainer::config::aliases::SUPERVISED,
            )?;
            provenance(&cfg, &fig)?
        }
    };
    let width = rows.iter().map(|(k, v, _)| k.len() + v.len() + 3).max().unwrap_or(0).min(80);
    for (key, value, source) in rows {
        let kv = format!("{key} = {value}");
        println!("{kv:<width$}  # {source}");
    }
    Ok(())
}
