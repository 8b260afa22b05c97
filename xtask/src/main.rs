//! Project automation for the RLHF workspace, run as `cargo xtask <command>`.
//!
//! Every command that builds or runs Rust code first makes sure libtorch is
//! installed (see [`setup`]) and then runs its child processes with the
//! environment that points tch at it. This crate never depends on tch.

mod arith_drill;
mod bench;
mod bundle;
mod cmd;
mod fixtures;
mod flags;
mod gen_arith;
mod import_gguf;
mod lint;
mod pipeline;
mod plot;
mod rlhf;
mod setup;
mod splitmix;
mod test;
mod vllm;

use std::{
    env,
    path::{Path, PathBuf},
    process::ExitCode,
};

use flags::Command;

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let command = match flags::parse(&args) {
        Ok(command) => command,
        Err(usage) => {
            eprintln!("error: {usage}\n");
            eprint!("{}", flags::HELP);
            return ExitCode::from(2);
        }
    };
    match run(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Help => {
            print!("{}", flags::HELP);
            Ok(())
        }
        // The path alone on stdout, so `LIBTORCH=$(cargo xtask setup)` works; the rest goes to stderr.
        Command::Setup { python_test_deps } => {
            setup::run(python_test_deps).map(|t| println!("{}", t.libtorch.display()))
        }
        Command::Test { args } => test::run(&args),
        Command::Lint => lint::run(),
        Command::Rlhf { args } => rlhf::run(&args),
        Command::Train { args } => rlhf::train(&args),
        Command::Bench { args } => bench::run(&args),
        Command::Bundle { args } => bundle::run(&args),
        Command::Fixtures { args } => fixtures::run(&args),
        Command::ImportGguf(opts) => import_gguf::run(&opts),
        Command::GenArith { out, check } => gen_arith::run(out.as_deref(), check),
        Command::Plot { run_dir, out } => plot::run(&run_dir, out.as_deref()),
        Command::Pipeline { run_dir, dpo } => pipeline::run(run_dir.as_deref(), dpo),
    }
}

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn project_root() -> PathBuf {
    let dir = env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    Path::new(&dir).parent().expect("xtask lives one level below the workspace root").to_owned()
}
