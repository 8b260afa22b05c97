//! `cargo xtask rlhf` and `cargo xtask train`: build the `rlhf` binary and run it.

use std::{path::PathBuf, process::Command};

use anyhow::{ensure, Result};

use crate::{
    cmd::{self, Profile},
    setup::{self, Torch},
};

/// `cargo xtask rlhf [--] ARGS...` → `target/debug/rlhf ARGS...`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let torch = setup::setup()?;
    exec_rlhf(&torch, Profile::Debug, args)
}

/// `cargo xtask train ARGS...` → `rlhf train ARGS...`; the CLI validates the arguments.
pub(crate) fn train(args: &[String]) -> Result<()> {
    let torch = setup::setup()?;
    let args: Vec<String> = std::iter::once("train".to_owned()).chain(args.iter().cloned()).collect();
    exec_rlhf(&torch, Profile::Debug, &args)
}

/// Builds `rlhf`, then replaces this process with it (its exit code becomes ours).
/// It runs in the caller's working directory, so relative paths in `args` work.
pub(crate) fn exec_rlhf(torch: &Torch, profile: Profile, args: &[String]) -> Result<()> {
    let binary = build(torch, profile)?;
    let mut command = Command::new(binary);
    command.args(args);
    torch.apply(&mut command);
    cmd::exec(command)
}

/// `cargo build -p rlhf-cli -p <every plugin> [--release]`; returns the binary's path. The
/// plugins land next to the binary, where `rlhf` looks for them by default.
///
/// Quiet when there is a binary already (a rebuild is short and its progress is
/// noise); the first build shows progress, as it compiles libtorch's bindings.
pub(crate) fn build(torch: &Torch, profile: Profile) -> Result<PathBuf> {
    let binary = cmd::rlhf_binary(profile);
    let mut command = torch.cargo();
    command.args(["build", "-p", "rlhf-cli"]);
    for package in crate::test::plugin_packages(&crate::project_root().join("plugins"))? {
        command.args(["-p", &package]);
    }
    if binary.is_file() {
        command.arg("--quiet");
    }
    if profile == Profile::Release {
        command.arg("--release");
    }
    cmd::run(&mut command)?;
    ensure!(binary.is_file(), "built rlhf-cli but found no binary at {}", binary.display());
    Ok(binary)
}
