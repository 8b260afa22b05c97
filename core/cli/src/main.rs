//! `rlhf`: the command-line host. Each subcommand lives in its own module; errors print as one line
//! (`error: ...`) with a non-zero exit.

mod bench;
mod cmd_check;
mod cmd_config;
mod cmd_generate;
mod cmd_ppl;
mod cmd_rm;
mod cmd_serve;
mod cmd_sft;
mod cmd_train;
mod common;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A plugin-based RLHF trainer on libtorch.
#[derive(Parser, Debug)]
#[command(name = "rlhf", version, about)]
struct Cli {
    /// Log level when RUST_LOG is not set (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    /// Log line format on stderr: `text` or `json` (one JSON object per event).
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// No progress bars (they are also off when stderr is not a terminal).
    #[arg(long, global = true)]
    no_progress: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a continuation of one or more prompts.
    Generate(cmd_generate::Args),
    /// Perplexity of the `text` field of every line of a JSONL file.
    Ppl(cmd_ppl::Args),
    /// Generation and training throughput, MFU and a GRPO step by phase; `--vs-trl` against TRL.
    Bench(bench::BenchArgs),
    /// Compare a model's logits and greedy tokens on a device/dtype with the CPU in f32.
    CheckDevice(cmd_check::Args),
    /// Supervised fine-tuning (DeepSpeed-Chat phase 1) on prompt/response or chat JSONL.
    Sft(cmd_sft::PhaseArgs),
    /// Reward-model training (DeepSpeed-Chat phase 2) on preference pairs.
    Rm(cmd_sft::PhaseArgs),
    /// Configuration tools (`rlhf config show`).
    #[command(subcommand)]
    Config(cmd_config::ConfigCommand),
    /// RL training with an algorithm plugin (`--algo grpo`, `ppo`, `ppo-seq`, ...).
    Train(cmd_train::TrainArgs),
    /// List the plugins found in the plugin directories.
    Plugins(cmd_train::PluginsArgs),
    /// Serve a reward model over HTTP (OpenRLHF `/get_reward`, LLaMA-Factory `/v1/score/evaluation`).
    ServeReward(cmd_serve::Args),
}

/// `RUST_LOG` wins over `--log-level`; plugin events carry the plugin's name as target, so
/// `RUST_LOG=info,grpo=debug` works per plugin. Lines print above the progress bars.
fn init_logging(level: &str, format: &str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => tracing_subscriber::EnvFilter::try_new(&spec)
            .map_err(|e| anyhow::anyhow!("RUST_LOG={spec}: invalid filter: {e}"))?,
        _ => tracing_subscriber::EnvFilter::try_new(level)
            .map_err(|e| anyhow::anyhow!("--log-level {level}: invalid level or filter: {e}"))?,
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(rlhf_trainer::progress::log_writer);
    let _ = if format == "json" { builder.json().flatten_event(true).try_init() } else { builder.try_init() };
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => cmd_generate::run(args),
        Command::Ppl(args) => cmd_ppl::run(args),
        Command::Bench(args) => bench::run(args),
        Command::CheckDevice(args) => cmd_check::run(args),
        Command::Sft(args) => cmd_sft::sft(args),
        Command::Rm(args) => cmd_rm::rm(args),
        Command::Train(args) => cmd_train::train(args),
        Command::Config(cmd) => cmd_config::run(cmd),
        Command::Plugins(args) => cmd_train::plugins(args),
        Command::ServeReward(args) => cmd_serve::run(args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    rlhf_trainer::progress::set_enabled(!cli.no_progress);
    let result = init_logging(&cli.log_level, &cli.log_format).and_then(|()| run(cli));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
