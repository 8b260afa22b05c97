//! Project automation for the RLHF workspace, run as `cargo xtask <command>`.
//!
//! Every command that builds or runs Rust code first makes sure libtorch is
//! installed (see [`setup`]) and then runs its child processes with the
//! environment that points tch at it. This crate never depends on tch.

mod bench;
mod cmd;
mod fixtures;
mod flags;
mod lint;
mod rlhf;
mod setup;
mod test;

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
        Command::Setup { python_test_deps } => setup::run(python_test_deps).map(drop),
        Command::Test { args } => test::run(&args),
        Command::Lint => lint::run(),
        Command::Rlhf { args } => rlhf::run(&args),
        Command::Train { args } => rlhf::train(&args),
        Command::Bench { bench, args } => bench::run(bench, &args),
        Command::Fixtures { args } => fixtures::run(&args),
    }
}

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn project_root() -> PathBuf {
    let dir = env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    Path::new(&dir).parent().expect("xtask lives one level below the workspace root").to_owned()
}
