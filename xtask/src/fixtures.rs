//! `cargo xtask fixtures`: regenerate the integration-test fixtures with transformers.

use std::process::Command;

use anyhow::{ensure, Context, Result};

use crate::{cmd, project_root, setup};

const SCRIPT: &str = "integration-tests/fixtures/make_fixtures.py";

pub(crate) fn run(args: &[String]) -> Result<()> {
    let torch = setup::run(true)?;
    let script = project_root().join(SCRIPT);
    ensure!(script.is_file(), "no fixture script at {}", script.display());
    let python = torch.python.as_ref().context("no Python to run the fixture script with")?;
    let mut command = Command::new(python);
    command.arg(&script).args(args).current_dir(project_root());
    torch.apply(&mut command);
    cmd::run(&mut command)
}
