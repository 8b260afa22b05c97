//! `cargo xtask bench [ARGS...]`: the `rlhf` CLI measures; this builds it with `--release`
//! together with the plugins its RL section loads (they land next to the release binary, where
//! `rlhf` looks for them), then runs `rlhf bench ARGS... --record <root>/BENCHMARKS.md`. With
//! `--vs-trl` it first installs the pinned TRL ([`setup::TRL_VERSION`]) into the cache venv.
//! `cargo xtask bench reward-python [--samples N] [--batch B] [--workers 1,2]` instead runs the
//! `reward-python` plugin's throughput example: its worker pool against the same function called
//! in-process from Python.

use std::{path::Path, process::Command};

use anyhow::{ensure, Result};

use crate::{
    cmd::{self, Profile},
    setup,
};

/// The plugins the RL section of `rlhf bench` may load: every algorithm its `--algo` takes, and
/// the presets' reward.
const PLUGINS: &[&str] = &[
    "rlhf-plugin-grpo",
    "rlhf-plugin-ppo",
    "rlhf-plugin-rloo",
    "rlhf-plugin-gspo",
    "rlhf-plugin-ppo-seq",
    "rlhf-plugin-reinforce-pp",
    "rlhf-plugin-reward-rules",
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let torch = setup::setup()?;
    if args.first().is_some_and(|a| a == "reward-python") {
        // The reward plugin's own measurement (its pool against in-process Python).
        let mut command = torch.cargo();
        command.args(["run", "--release", "-p", "rlhf-plugin-reward-python", "--example", "throughput", "--"]);
        command.args(&args[1..]);
        return cmd::run(&mut command);
    }
    if args.iter().any(|a| a == "--vs-trl") {
        setup::ensure_trl(&torch)?;
    }
    let binary = cmd::rlhf_binary(Profile::Release);
    let mut build = torch.cargo();
    build.args(["build", "--release", "-p", "rlhf-cli"]);
    for p in PLUGINS {
        build.args(["-p", p]);
    }
    cmd::run(&mut build)?;
    ensure!(binary.is_file(), "built rlhf-cli but found no binary at {}", binary.display());
    let mut command = Command::new(binary);
    command.args(rlhf_args(args, &crate::project_root()));
    torch.apply(&mut command);
    cmd::exec(command)
}

/// `bench ARGS...`, plus `--record <root>/BENCHMARKS.md` unless the arguments already say where
/// (or whether) to record, or only ask for help.
fn rlhf_args(args: &[String], root: &Path) -> Vec<String> {
    let mut out = vec!["bench".to_owned()];
    out.extend(args.iter().cloned());
    let decided = args
        .iter()
        .any(|a| a == "--no-record" || a == "--record" || a.starts_with("--record=") || a == "--help" || a == "-h");
    if !decided {
        out.push("--record".to_owned());
        out.push(root.join("BENCHMARKS.md").display().to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn records_in_benchmarks_md_by_default() {
        let root = Path::new("/repo");
        assert_eq!(
            rlhf_args(&v(&["--batch", "2"]), root),
            v(&["bench", "--batch", "2", "--record", "/repo/BENCHMARKS.md"])
        );
        assert_eq!(rlhf_args(&v(&["gen", "--no-record"]), root), v(&["bench", "gen", "--no-record"]));
        assert_eq!(rlhf_args(&v(&["--record=x.md"]), root), v(&["bench", "--record=x.md"]));
        assert_eq!(rlhf_args(&v(&["--help"]), root), v(&["bench", "--help"]));
    }
}
