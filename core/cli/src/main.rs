//! `rlhf`: the command-line host. Each subcommand lives in its own module; errors print as one line
//! (`error: ...`) with a non-zero exit.

mod bench;
mod cmd_check;
mod cmd_config;
mod cmd_dpo;
mod cmd_eval;
mod cmd_generate;
mod cmd_graphs;
mod cmd_plugins;
mod cmd_ppl;
mod cmd_rm;
mod cmd_serve;
mod cmd_sft;
mod cmd_train;
mod common;
mod deadline;
mod doctor;
mod launcher;
mod machine;
mod resume;

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
    Bench(Box<bench::BenchArgs>),
    /// Compare a model's logits and greedy tokens on a device/dtype with the CPU in f32.
    CheckDevice(cmd_check::Args),
    /// On a CUDA device, check that decoding with CUDA graphs samples exactly what eager decoding samples.
    CheckGraphs(cmd_graphs::Args),
    /// Check this machine end to end, device by device (correctness, learning, speed); writes report.md and report.json.
    Doctor(doctor::Args),
    /// Supervised fine-tuning (DeepSpeed-Chat phase 1) on prompt/response or chat JSONL.
    Sft(cmd_sft::PhaseArgs),
    /// Reward-model training (DeepSpeed-Chat phase 2) on preference pairs.
    Rm(cmd_sft::PhaseArgs),
    /// Direct Preference Optimization (DPO, cDPO, IPO, SimPO) of a causal LM on preference pairs.
    Dpo(cmd_sft::PhaseArgs),
    /// Configuration tools (`rlhf config show`).
    #[command(subcommand)]
    Config(cmd_config::ConfigCommand),
    /// RL training with an algorithm plugin (`--algo grpo`, `ppo`, `ppo-seq`, ...).
    Train(cmd_train::TrainArgs),
    /// Held-out evaluation of a saved policy: pass@k, maj@n, rewards per source and data source.
    Eval(cmd_eval::EvalArgs),
    /// List the plugins found in the plugin directories.
    Plugins(cmd_plugins::PluginsArgs),
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
    // Colour only on a terminal, and never with NO_COLOR (https://no-color.org): a log piped to a
    // file or a CI log gets no escape codes.
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(rlhf_trainer::progress::log_writer);
    let _ = if format == "json" { builder.json().flatten_event(true).try_init() } else { builder.try_init() };
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => cmd_generate::run(args),
        Command::Ppl(args) => cmd_ppl::run(args),
        Command::Bench(args) => bench::run(*args),
        Command::CheckDevice(args) => cmd_check::run(args),
        Command::CheckGraphs(args) => cmd_graphs::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Sft(args) => cmd_sft::sft(args),
        Command::Rm(args) => cmd_rm::rm(args),
        Command::Dpo(args) => cmd_dpo::dpo(args),
        Command::Train(args) => cmd_train::train(args),
        Command::Eval(args) => cmd_eval::run(args),
        Command::Config(cmd) => cmd_config::run(cmd),
        Command::Plugins(args) => cmd_plugins::plugins(args),
        Command::ServeReward(args) => cmd_serve::run(args),
    }
}

/// Keeps large tensors in glibc's heap, as `MALLOC_MMAP_THRESHOLD_=1073741824
/// MALLOC_TRIM_THRESHOLD_=1073741824` would: by default every allocation above 32 MiB is a
/// fresh `mmap`, so each large temporary of a pass (a mixture of experts' gathered rows, a
/// chunk of logits) pays a page fault per 4 KiB page on first touch, every step — on a CPU a
/// MoE training step spent twice the system time, and more wall time than it saved. libtorch's
/// CPU allocator does not cache; PyTorch's tuning guide suggests jemalloc or tcmalloc for the
/// same reason. A user's own `MALLOC_*_THRESHOLD_` settings are left as they are.
fn keep_large_allocations_in_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const GIB: libc::c_int = 1 << 30;
        for (var, param) in
            [("MALLOC_MMAP_THRESHOLD_", libc::M_MMAP_THRESHOLD), ("MALLOC_TRIM_THRESHOLD_", libc::M_TRIM_THRESHOLD)]
        {
            if std::env::var_os(var).is_none() {
                // SAFETY: mallopt only sets a tunable of the allocator; called before any thread starts.
                unsafe { libc::mallopt(param, GIB) };
            }
        }
    }
}

fn main() -> ExitCode {
    keep_large_allocations_in_the_heap();
    let cli = Cli::parse();
    rlhf_trainer::progress::set_enabled(!cli.no_progress);
    if matches!(cli.command, Command::Train(_) | Command::Sft(_) | Command::Rm(_) | Command::Dpo(_)) {
        // The first SIGTERM / SIGINT ends the run after its step, checkpointed; a second, at once.
        rlhf_trainer::signals::install();
    }
    if matches!(cli.command, Command::Doctor(_)) {
        // The doctor passes a signal on to the check it runs and waits for it to end.
        rlhf_trainer::signals::install();
    }
    let result = init_logging(&cli.log_level, &cli.log_format).and_then(|()| run(cli));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match stopped(&e) {
            Some(stopped) => {
                eprintln!("{}", stopped.message);
                ExitCode::from(rlhf_trainer::signals::exit_code(stopped.signal))
            }
            None => {
                eprintln!("error: {}", one_line(&e));
                ExitCode::FAILURE
            }
        },
    }
}

/// The signal stop behind `e`, if that is what ended the command (raised by the trainer, or by the
/// launcher whose ranks stopped).
fn stopped(e: &anyhow::Error) -> Option<&rlhf_trainer::signals::Stopped> {
    e.chain().find_map(|c| match c.downcast_ref::<rlhf_trainer::TrainerError>() {
        Some(rlhf_trainer::TrainerError::Stopped(s)) => Some(s),
        _ => c.downcast_ref::<rlhf_trainer::signals::Stopped>(),
    })
}

/// The error and its causes on one line, `outer: inner: ...` as `{:#}` prints them, except that a
/// cause is left out when the message so far already ends with it: error types such as
/// `{path}: {source}` show their source in their own message, and `{:#}` would print it twice
/// ("Is a directory (os error 21): Is a directory (os error 21)").
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = without_backtrace(&cause.to_string());
        if !out.is_empty() && out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out.replace('\n', " ")
}

/// A libtorch error's message without the C++ stack trace it carries ("Exception raised from
/// ...", then one frame per line): the user gets the one line that says what failed.
fn without_backtrace(text: &str) -> String {
    let cut = ["Exception raised from", "\nframe #0"].iter().filter_map(|m| text.find(m)).min();
    match cut {
        Some(i) => text[..i].trim_end().to_string(),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_stack_traces_are_cut() {
        let t = "libtorch: a Tensor with 0 elements cannot be converted to Scalar\nException raised from item at \
                 /pytorch/aten/src/ATen/native/Scalar.cpp:23 (most recent call first):\nframe #0: c10::Error::Error";
        assert_eq!(without_backtrace(t), "libtorch: a Tensor with 0 elements cannot be converted to Scalar");
        assert_eq!(without_backtrace("plain"), "plain");
    }

    #[test]
    fn a_source_shown_in_its_error_is_printed_once() {
        #[derive(Debug)]
        struct Io {
            path: String,
            source: std::io::Error,
        }
        impl std::fmt::Display for Io {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}: {}", self.path, self.source)
            }
        }
        impl std::error::Error for Io {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.source)
            }
        }
        let io = std::io::Error::new(std::io::ErrorKind::IsADirectory, "Is a directory (os error 21)");
        let e = anyhow::Error::new(Io { path: "/data".into(), source: io }).context("reading the prompts");
        assert_eq!(one_line(&e), "reading the prompts: /data: Is a directory (os error 21)");
        let e = anyhow::anyhow!("inner\nline").context("outer");
        assert_eq!(one_line(&e), "outer: inner line");
    }
}
