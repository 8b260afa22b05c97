//! Every `configs/*.toml` loads with the loader of its command — `sft.toml` through `SftConfig`,
//! `rm.toml` through `RmConfig`, `dpo.toml` through `DpoConfig`, the rest (presets and the files
//! that are not compiled in, like `grpo-smollm2.toml`) through `RlConfig` — and the plugin
//! sections of the RL configs are accepted by the plugins they name (the workspace's `.so` files). A config with a key nobody knows, in
//! any of its tables, is refused.

use std::path::{Path, PathBuf};

use rlhf_plugin_api::PluginKind;
use rlhf_trainer::config::ConfigSource;
use rlhf_trainer::dpo::DpoConfig;
use rlhf_trainer::plugins::{host_context, AlgorithmHandle, EnvHandle, PluginRegistry, RewardHandle};
use rlhf_trainer::rm::RmConfig;
use rlhf_trainer::sft::SftConfig;
use rlhf_trainer::RlConfig;

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// `configs/*.toml`, sorted.
fn config_files() -> Vec<PathBuf> {
    let dir = project_root().join("configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

fn registry() -> PluginRegistry {
    let dir = rlhf_integration_tests::rlhf_bin().parent().expect("target dir").to_path_buf();
    PluginRegistry::scan(&[dir]).expect("scan plugins")
}

/// Loads `path` as the command its name says (`sft*.toml`, `rm*.toml`, `dpo*.toml`, else RL) and, for RL,
/// builds its algorithm and reward plugins from their sections. `name` picks the loader, so a
/// changed copy can be checked under another path.
fn check(name: &str, path: &Path, reg: &PluginRegistry) -> Result<(), String> {
    let source = ConfigSource::File(path.to_path_buf());
    if name == "sft.toml" || name.starts_with("sft-") {
        return SftConfig::load(&source, &[]).map(drop).map_err(|e| e.to_string());
    }
    if name == "rm.toml" || name.starts_with("rm-") {
        return RmConfig::load(&source, &[]).map(drop).map_err(|e| e.to_string());
    }
    if name == "dpo.toml" || name.starts_with("dpo-") {
        return DpoConfig::load(&source, &[]).map(drop).map_err(|e| e.to_string());
    }
    let cfg = RlConfig::load(&source, None, &[]).map_err(|e| e.to_string())?;
    let ctx = || host_context("cpu", cfg.run.seed, cfg.rollout.samples_per_prompt as u32);
    let algo = reg.get(&cfg.algorithm.name, PluginKind::Algorithm).map_err(|e| e.to_string())?;
    AlgorithmHandle::new(algo, &cfg.algorithm.config.to_string(), ctx(), "algorithm.config")
        .map_err(|e| e.to_string())?;
    for (i, r) in cfg.rewards.iter().enumerate() {
        let mut section = r.config.clone();
        if r.plugin == "reward-model" {
            // The model is loaded when the plugin starts: a path relative to the project root
            // (where the configs are run from) when it exists, else (`pipeline-ppo.toml`'s, written
            // by the pipeline's RM phase) the fixture reward model.
            let model = section.get("model").and_then(|m| m.as_str()).map(|m| project_root().join(m));
            let model = model.filter(|m| m.is_dir()).unwrap_or_else(|| rlhf_integration_tests::model_dir("llama-rm"));
            section["model"] = serde_json::Value::String(model.to_string_lossy().into_owned());
        }
        if r.plugin == "reward-python" {
            // Relative to the project root, where the configs are run from; the workers start
            // (importing the file) with the project's Python.
            let file = section.get("file").and_then(|f| f.as_str()).map(|f| project_root().join(f));
            section["file"] = serde_json::Value::String(file.unwrap_or_default().to_string_lossy().into_owned());
        }
        let plugin = reg.get(&r.plugin, PluginKind::Reward).map_err(|e| e.to_string())?;
        RewardHandle::new(plugin, &section.to_string(), ctx(), &format!("rewards[{i}].config"))
            .map_err(|e| e.to_string())?;
    }
    if cfg.environment.enabled() {
        let plugin = reg.environment(&cfg.environment.plugin).map_err(|e| e.to_string())?;
        EnvHandle::new(plugin, &cfg.environment.config.to_string(), ctx(), "environment.config")
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[test]
fn every_config_loads() {
    let reg = registry();
    let files = config_files();
    let names: Vec<String> = files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    for expected in [
        "grpo.toml",
        "ppo.toml",
        "ppo-seq.toml",
        "grpo-smollm2.toml",
        "grpo-smollm2-arith.toml",
        "sft.toml",
        "rm.toml",
        "dpo.toml",
    ] {
        assert!(names.iter().any(|n| n == expected), "configs/{expected} missing from {names:?}");
    }
    for (path, name) in files.iter().zip(&names) {
        if let Err(e) = check(name, path, &reg) {
            panic!("configs/{name} does not load: {e}");
        }
    }
}

/// A key nobody knows, put in each table of each config in turn (host sections and plugin
/// sections alike), makes the check fail naming the key: the test above would catch a typo.
#[test]
fn an_unknown_key_in_any_table_is_refused() {
    const KEY: &str = "zz_unknown_key";
    let reg = registry();
    let tmp = tempfile::tempdir().unwrap();
    let (files, mut tables) = (config_files(), 0);
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, header) in lines.iter().enumerate().filter(|(_, l)| l.trim_start().starts_with('[')) {
            let mut changed: Vec<&str> = lines.clone();
            let extra = format!("{KEY} = 1");
            changed.insert(i + 1, &extra);
            let copy = tmp.path().join(&name);
            std::fs::write(&copy, changed.join("\n")).unwrap();
            match check(&name, &copy, &reg) {
                Ok(()) => panic!("configs/{name}: `{KEY}` under {header} was accepted"),
                Err(e) => {
                    assert!(e.contains(KEY), "configs/{name}: `{KEY}` under {header}: error does not name it: {e}")
                }
            }
            tables += 1;
        }
    }
    assert!(tables >= 2 * files.len(), "only {tables} tables in {} files", files.len());
}
