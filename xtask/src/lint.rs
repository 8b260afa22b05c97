//! `cargo xtask lint`: rustfmt and clippy over the whole workspace.

use anyhow::{bail, Result};

use crate::{cmd, setup};

pub(crate) fn run() -> Result<()> {
    let torch = setup::setup()?;
    let mut failed = Vec::new();
    // Run both so one CI run reports every problem.
    for args in [
        &["fmt", "--all", "--", "--check"][..],
        &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"][..],
    ] {
        if let Err(err) = cmd::run(torch.cargo().args(args)) {
            eprintln!("error: {err:#}");
            failed.push(format!("cargo {}", args[0]));
        }
    }
    if !failed.is_empty() {
        bail!("lint failed: {}", failed.join(", "));
    }
    Ok(())
}
