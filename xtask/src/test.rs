//! `cargo xtask test [ARGS...]`: build everything (the workspace, whose members include every
//! plugin, and the frozen-ABI test plugins of `integration-tests/frozen-abi*/`), then
//! `cargo test --workspace ARGS...`.
//! `cargo xtask test --vllm` instead runs the opt-in tests against a real vLLM engine
//! (installed into its own cached venv, [`crate::vllm`]). `cargo xtask test --record-goldens`
//! instead re-records the golden files of `integration-tests/golden/` and prints, per metric, what
//! moved (`integration-tests/tests/golden.rs`).

use std::{env, fs, path::Path};

use anyhow::{Context, Result};

use crate::{
    cmd::{self, is_truthy},
    project_root,
    setup::{self, Torch},
};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let vllm = args.iter().any(|a| a == "--vllm");
    let record = args.iter().any(|a| a == "--record-goldens");
    let args: Vec<String> = args.iter().filter(|a| *a != "--vllm" && *a != "--record-goldens").cloned().collect();
    let vllm_python = if vllm { Some(crate::vllm::ensure()?) } else { None };
    let torch = setup::setup()?;
    if torch.python.is_none() {
        eprintln!("warning: no Python for the fixture tests (LIBTORCH is set, RLHF_PYTHON is not, no venv)");
    } else {
        // CI always lets pip confirm the packages; elsewhere the marker is enough.
        setup::ensure_test_deps(&torch, is_truthy(env::var_os("CI").as_deref()))?;
    }
    // Every plugin is a workspace member: this builds their cdylibs too. (A separate
    // `cargo build -p <plugin>...` would unify features over fewer packages and rebuild
    // dependencies for nothing: minutes of a cold run.)
    cmd::run(torch.cargo().args(["build", "--workspace", "--all-targets"]))?;
    build_frozen_abi_plugins(&torch)?;
    if let Some(python) = vllm_python {
        let mut command = torch.cargo();
        command.args(["test", "-p", "rlhf-integration-tests", "--test", "vllm_engine"]).args(&args);
        command.args(["--", "--ignored", "--test-threads", "1", "--nocapture"]).env("RLHF_VLLM_PYTHON", python);
        return cmd::run(&mut command);
    }
    if record {
        // `all` (set by hand) also re-records the `-unshared` reference files.
        let mode = env::var("RLHF_GOLDEN_RECORD").ok().filter(|v| v == "all").unwrap_or_else(|| "1".into());
        let mut command = torch.cargo();
        command.args(["test", "-p", "rlhf-integration-tests", "--test", "golden"]).args(&args);
        command.args(["--", "--nocapture"]).env("RLHF_GOLDEN_RECORD", mode);
        return cmd::run(&mut command);
    }
    // --no-fail-fast: one run reports the failures of every crate.
    cmd::run(torch.cargo().args(["test", "--workspace", "--no-fail-fast"]).args(args))
}

/// The manifests of the frozen-ABI workspaces (not members of the main one): plugin-api 4.0 with an
/// algorithm plugin, and the environment interface 1.0 with an environment plugin.
const FROZEN_ABI_MANIFESTS: [&str; 2] =
    ["integration-tests/frozen-abi/Cargo.toml", "integration-tests/frozen-abi-env/Cargo.toml"];

/// Builds the test plugins compiled against the frozen plugin-api snapshots into the main target
/// directory, next to `rlhf`, for `integration-tests/tests/abi_growth.rs`. Their workspaces share
/// the main `Cargo.lock` versions and profiles, so they reuse the main build's dependencies.
fn build_frozen_abi_plugins(torch: &Torch) -> Result<()> {
    for manifest in FROZEN_ABI_MANIFESTS.map(|m| project_root().join(m)) {
        if !manifest.is_file() {
            continue;
        }
        let mut command = torch.cargo();
        command.arg("build").arg("--manifest-path").arg(&manifest).arg("--target-dir").arg(cmd::target_dir());
        cmd::run(&mut command)?;
    }
    Ok(())
}

/// Package names of `plugins/*/Cargo.toml`, sorted; none if there is no `plugins/`.
pub(crate) fn plugin_packages(dir: &Path) -> Result<Vec<String>> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut packages = Vec::new();
    for entry in entries {
        let manifest = entry?.path().join("Cargo.toml");
        if !manifest.is_file() {
            continue;
        }
        let text = fs::read_to_string(&manifest).with_context(|| format!("could not read {}", manifest.display()))?;
        let name = package_name(&text).with_context(|| format!("no [package] name in {}", manifest.display()))?;
        packages.push(name);
    }
    packages.sort();
    Ok(packages)
}

/// `name` in the `[package]` table of a Cargo.toml; enough TOML for our manifests.
fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
            continue;
        }
        if !in_package {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if key.trim() == "name" {
            let value = value.trim();
            let value = value.split('#').next().unwrap_or(value).trim();
            return Some(value.trim_matches(|c| c == '"' || c == '\'').to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_package_name() {
        let manifest = r#"
[lib]
name = "not_this"
crate-type = ["cdylib"]

[package]
version.workspace = true
name = "rlhf-plugin-grpo" # the GRPO algorithm

[dependencies]
name = "nor-this"
"#;
        assert_eq!(package_name(manifest).as_deref(), Some("rlhf-plugin-grpo"));
        assert_eq!(package_name("[workspace]\nmembers = []\n"), None);
    }

    #[test]
    fn finds_plugin_packages() {
        let dir = env::temp_dir().join(format!("xtask-test-{}-plugins", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for (sub, name) in [("grpo", "plugin-grpo"), ("ppo", "plugin-ppo")] {
            fs::create_dir_all(dir.join(sub)).unwrap();
            fs::write(dir.join(sub).join("Cargo.toml"), format!("[package]\nname = \"{name}\"\n")).unwrap();
        }
        fs::create_dir_all(dir.join("README-only")).unwrap();
        assert_eq!(plugin_packages(&dir).unwrap(), ["plugin-grpo", "plugin-ppo"]);
        fs::remove_dir_all(&dir).unwrap();
        assert!(plugin_packages(&dir).unwrap().is_empty(), "missing dir is no plugins");
    }
}
