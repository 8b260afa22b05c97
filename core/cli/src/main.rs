//! `rlhf`: the command-line host. Each subcommand lives in its own module; errors print as one line
//! (`error: ...`) with a non-zero exit.

mod bench;
mod cmd_generate;
mod cmd_ppl;
mod cmd_serve;
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a continuation of one or more prompts.
    Generate(cmd_generate::Args),
    /// Perplexity of the `text` field of every line of a JSONL file.
    Ppl(cmd_ppl::Args),
    /// Benchmarks (`rlhf bench gen ...`).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// RL training with an algorithm plugin (`--algo grpo`, `ppo`, `ppo-seq`, ...).
    Train(cmd_train::TrainArgs),
    /// List the plugins found in the plugin directories.
    Plugins(cmd_train::PluginsArgs),
    /// Serve a reward model over HTTP (OpenRLHF `/get_reward`, LLaMA-Factory `/v1/score/evaluation`).
    ServeReward(cmd_serve::Args),
}

fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => cmd_generate::run(args),
        Command::Ppl(args) => cmd_ppl::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Train(args) => cmd_train::train(args),
        Command::Plugins(args) => cmd_train::plugins(args),
        Command::ServeReward(args) => cmd_serve::run(args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_level);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
