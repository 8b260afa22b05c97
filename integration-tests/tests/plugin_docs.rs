//! The algorithm reference cannot drift: every shipped algorithm plugin describes exactly the keys
//! of its config (those of its resolved config, no more, no fewer), and `docs/algorithms.md` is
//! what `rlhf plugins --markdown` prints from those descriptions.

use std::path::Path;

use rlhf_integration_tests::rlhf_bin;
use rlhf_plugin_api::PluginKind;
use rlhf_trainer::plugins::{host_context, AlgorithmHandle, PluginRegistry};

const SHIPPED: &[&str] = &["grpo", "gspo", "ppo", "ppo-seq", "reinforce-pp", "rloo"];

#[test]
fn every_shipped_algorithm_describes_exactly_its_keys() {
    let reg = PluginRegistry::scan(&[rlhf_bin().parent().unwrap().to_path_buf()]).unwrap();
    for name in SHIPPED {
        let plugin = reg.get(name, PluginKind::Algorithm).unwrap();
        let h = AlgorithmHandle::new(plugin, "{}", host_context("cpu", 0, 2), "algorithm.config").unwrap();
        let described: Vec<String> = h
            .describe_keys()
            .unwrap_or_else(|| panic!("{name} does not describe its keys"))
            .iter()
            .map(|k| k["key"].as_str().unwrap().to_string())
            .collect();
        let mut configured: Vec<String> = h.resolved_config().as_object().unwrap().keys().cloned().collect();
        let mut sorted = described.clone();
        sorted.sort();
        configured.sort();
        assert_eq!(sorted, configured, "{name}: described keys vs the keys of its config");
        for k in h.describe_keys().unwrap() {
            assert!(!k["help"].as_str().unwrap().is_empty(), "{name}.{}: no help", k["key"]);
        }
    }
}

#[test]
fn docs_algorithms_md_is_what_the_plugins_say() {
    let o = std::process::Command::new(rlhf_bin()).args(["plugins", "--markdown"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/algorithms.md");
    let committed = std::fs::read_to_string(&path).unwrap();
    assert!(
        committed == String::from_utf8_lossy(&o.stdout),
        "docs/algorithms.md is stale: regenerate it with `cargo xtask rlhf -- plugins --markdown > docs/algorithms.md`"
    );
    for name in SHIPPED {
        assert!(committed.contains(&format!("\n## {name}\n")), "{name} missing from docs/algorithms.md");
    }
}
