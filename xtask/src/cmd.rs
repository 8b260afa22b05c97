//! Running child processes: cargo and the `rlhf` binary, with the libtorch environment.

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::project_root;

/// A cargo profile and the `target/` subdirectory it builds into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Profile {
    Debug,
    Release,
}

impl Profile {
    pub(crate) fn dir(self) -> &'static str {
        match self {
            Profile::Debug => "debug",
            Profile::Release => "release",
        }
    }
}

/// The cargo target directory: `$CARGO_TARGET_DIR` (relative to the project
/// root, where we run cargo) or `<root>/target`.
pub(crate) fn target_dir() -> PathBuf {
    target_dir_from(env::var_os("CARGO_TARGET_DIR"), &project_root())
}

fn target_dir_from(cargo_target_dir: Option<OsString>, root: &Path) -> PathBuf {
    match cargo_target_dir.filter(|dir| !dir.is_empty()) {
        Some(dir) => root.join(dir), // `join` keeps an absolute path as it is
        None => root.join("target"),
    }
}

/// Where `cargo build -p rlhf-cli` puts the `rlhf` binary.
pub(crate) fn rlhf_binary(profile: Profile) -> PathBuf {
    target_dir().join(profile.dir()).join("rlhf")
}

/// Runs `cmd` to completion, echoing it first; an error if it fails.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let shown = describe(cmd);
    eprintln!("$ {shown}");
    let status = cmd.status().with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Replaces this process with `cmd`, so its exit code (and signals) are ours.
/// Returns only on error.
pub(crate) fn exec(mut cmd: Command) -> Result<()> {
    let shown = describe(&cmd);
    eprintln!("$ {shown}");
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let err = cmd.exec();
        Err(err).with_context(|| format!("could not run `{shown}`"))
    }
    #[cfg(not(unix))]
    {
        let status = cmd.status().with_context(|| format!("could not run `{shown}`"))?;
        std::process::exit(status.code().unwrap_or(1))
    }
}

/// `program args...` for messages; cargo is shown as `cargo` whatever its path.
fn describe(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program());
    let mut shown = if program.file_stem().is_some_and(|s| s == "cargo") {
        "cargo".to_owned()
    } else {
        program.display().to_string()
    };
    for arg in cmd.get_args() {
        shown.push(' ');
        shown.push_str(&arg.to_string_lossy());
    }
    shown
}

/// `true`/`1` (any case for `true`), as CI systems set `CI`.
pub(crate) fn is_truthy(value: Option<&std::ffi::OsStr>) -> bool {
    value.and_then(|v| v.to_str()).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn target_dir_respects_cargo_target_dir() {
        let root = Path::new("/repo");
        assert_eq!(target_dir_from(None, root), PathBuf::from("/repo/target"));
        assert_eq!(target_dir_from(Some("".into()), root), PathBuf::from("/repo/target"));
        assert_eq!(target_dir_from(Some("out".into()), root), PathBuf::from("/repo/out"));
        assert_eq!(target_dir_from(Some("/tmp/t".into()), root), PathBuf::from("/tmp/t"));
    }

    #[test]
    fn truthy_ci() {
        assert!(is_truthy(Some(OsStr::new("true"))));
        assert!(is_truthy(Some(OsStr::new("TRUE"))));
        assert!(is_truthy(Some(OsStr::new("1"))));
        assert!(!is_truthy(Some(OsStr::new("0"))));
        assert!(!is_truthy(Some(OsStr::new("false"))));
        assert!(!is_truthy(Some(OsStr::new(""))));
        assert!(!is_truthy(None));
    }

    #[test]
    fn describe_shortens_cargo() {
        let mut cmd = Command::new("/home/u/.rustup/toolchains/stable/bin/cargo");
        cmd.args(["build", "-p", "rlhf-cli"]);
        assert_eq!(describe(&cmd), "cargo build -p rlhf-cli");
        let cmd = Command::new("/repo/target/debug/rlhf");
        assert_eq!(describe(&cmd), "/repo/target/debug/rlhf");
    }
}
