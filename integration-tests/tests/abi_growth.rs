//! The ABI grows without breaking old plugins: `frozen-reinforce`, a plugin compiled against a
//! frozen copy of plugin-api 4.0 (`integration-tests/frozen-abi/`, its own cargo workspace, never
//! edited), loads into this host — whose ABI has since appended inputs (the `epoch`, `accumulation_steps` and `step_tokens` scalars) and
//! an optional trait method (`resolved_config`) — and trains. If one of these tests fails after a
//! change to `core/plugin-api`, that change broke the ABI (see `frozen-abi/plugin-api-4.0/README.md`).
//!
//! Likewise `frozen-env`, an environment plugin compiled against a frozen copy of plugin-api at the
//! environment interface 1.0 (`integration-tests/frozen-abi-env/`), runs its episodes in this host,
//! whose environment interface has since appended an optional method (`take_images`).
//!
//! `cargo xtask test` builds the frozen plugins next to the `rlhf` binary; by hand:
//! `cargo build --manifest-path integration-tests/frozen-abi/Cargo.toml --target-dir target`, the
//! same for `frozen-abi-env/Cargo.toml` (plus `cargo build -p rlhf-cli -p rlhf-plugin-reward-rules`).

use std::path::{Path, PathBuf};
use std::process::Output;

use rlhf_integration_tests::{rlhf, rlhf_bin};
use rlhf_plugin_api::abi::{EnvPluginModRef, PluginModRef};
use rlhf_plugin_api::abi_stable::library::lib_header_from_path;
use rlhf_plugin_api::tch::{Kind, Tensor};
use rlhf_plugin_api::{Experience, Minibatch, PluginKind, Requirements, API_MAJOR, API_MINOR, ENV_API_MINOR};
use rlhf_trainer::plugins::{host_context, load_file, AlgorithmHandle, PluginRegistry};

/// The frozen plugin's declared name.
const NAME: &str = "frozen-reinforce";

/// `target/<profile>/`, where the `rlhf` binary and the plugins are.
fn plugin_dir() -> PathBuf {
    rlhf_bin().parent().expect("target dir").to_path_buf()
}

/// The frozen plugin's library, or a panic saying how to build it.
fn frozen_so() -> PathBuf {
    let p = plugin_dir().join("librlhf_test_plugin_frozen_reinforce.so");
    assert!(
        p.is_file(),
        "{} not built: run `cargo xtask test`, or `cargo build --manifest-path integration-tests/frozen-abi/Cargo.toml \
         --target-dir {}`",
        p.display(),
        plugin_dir().parent().unwrap().display()
    );
    p
}

/// The frozen environment plugin's library, or a panic saying how to build it.
fn frozen_env_so() -> PathBuf {
    let p = plugin_dir().join("librlhf_test_plugin_frozen_env.so");
    assert!(
        p.is_file(),
        "{} not built: run `cargo xtask test`, or `cargo build --manifest-path \
         integration-tests/frozen-abi-env/Cargo.toml --target-dir {}`",
        p.display(),
        plugin_dir().parent().unwrap().display()
    );
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
}

/// The host's loader accepts it, and it really is a 4.0 plugin (so the tests below prove
/// something) while this host is newer.
#[test]
fn the_loader_accepts_the_4_0_plugin() {
    let so = frozen_so();
    let loaded = load_file(&so).unwrap_or_else(|reason| {
        panic!(
            "the host refused the 4.0 plugin: {reason}\n(`too many fields` is abi_stable's default check, which assumes \
             plugins at least as new as the host; the loader must check the plugin's layout as the interface, see \
             docs/plugins.md, \"How the ABI evolves\")"
        )
    });
    assert_eq!(loaded.meta.name, NAME);
    assert_eq!(loaded.meta.kind, PluginKind::Algorithm);
    let header = lib_header_from_path(&so).unwrap();
    // SAFETY: `load_file` checked the layout of this library's root module against this host's.
    let module = unsafe { header.unchecked_layout::<PluginModRef>() }.unwrap();
    let info = (module.info())();
    assert_eq!((info.api_major, info.api_minor), (4, 0), "the frozen snapshot is plugin-api 4.0");
}

// This host is newer than the frozen plugin: the same major, a later minor (4.1: the `epoch`
// input, `resolved_config`). A new major refuses 4.x plugins: freeze a new snapshot for it.
const _: () = assert!(API_MAJOR == 4 && API_MINOR >= 1);

/// (a) `rlhf plugins --all` accepts it as an algorithm, next to the plugins of the current minor.
#[test]
fn rlhf_plugins_lists_the_frozen_plugin() {
    let so = frozen_so();
    let o = rlhf(&["plugins", "--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(NAME))
        .unwrap_or_else(|| panic!("{NAME} is not listed:\n{out}"));
    assert!(line.contains("algorithm") && line.contains(".so"), "{line}");
    let file = so.file_name().unwrap().to_string_lossy().into_owned();
    assert!(!out.lines().any(|l| l.starts_with("refused:") && l.contains(&file)), "the 4.0 plugin was refused:\n{out}");
}

/// Plugins of both minors load into one host in either order (abi_stable merges what it learns
/// about the layouts of every library it checks; an older plugin checked first must not make the
/// host refuse a newer one). Each run is a fresh process, as in real use.
#[test]
fn plugins_of_both_minors_load_in_either_order() {
    let grpo = plugin_dir().join("librlhf_plugin_grpo.so");
    assert!(grpo.is_file(), "{} not built", grpo.display());
    for (first, second) in [("liba_frozen.so", "libz_grpo.so"), ("libz_frozen.so", "liba_grpo.so")] {
        let d = tempfile::tempdir().unwrap();
        std::fs::copy(frozen_so(), d.path().join(first)).unwrap();
        std::fs::copy(&grpo, d.path().join(second)).unwrap();
        let o = rlhf(&["plugins", "--all", "--dir", s(d.path())]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        for name in [NAME, "grpo"] {
            assert!(out.lines().any(|l| l.split_whitespace().next() == Some(name)), "{name} missing:\n{out}");
        }
        assert!(!out.contains("refused:"), "{out}");
    }
}

/// (b) A short RL run with it (supervised warm-up, then RL steps with two PPO epochs, so the host
/// passes the 4.1 `epoch` input the plugin does not know) exits 0 with finite losses and the
/// plugin's own metrics.
#[test]
fn the_frozen_plugin_trains() {
    frozen_so();
    let run = tempfile::tempdir().unwrap();
    let rd = run.path().join("r");
    let cfg = run.path().join("frozen.toml");
    std::fs::write(
        &cfg,
        r#"# The addition task of configs/grpo.toml, a few steps, with the frozen 4.0 plugin.
[run]
seed = 7
device = "cpu"
dtype = "f32"

[model]
actor = "builtin:tiny"

[data]
prompts = "builtin:addition"
max_prompt_len = 16

[warmup]
steps = 5
lr = 3e-3
batch_size = 32

[rollout]
prompts_per_batch = 8
samples_per_prompt = 4
max_new_tokens = 4
temperature = 1.0

[train]
steps = 3
ppo_epochs = 2
minibatch_size = 16
lr = 5e-4
schedule = "constant"
max_grad_norm = 1.0

[algorithm]
name = "frozen-reinforce"

[algorithm.config]
beta = 0.04

[[rewards]]
plugin = "reward-rules"
name = "accuracy"
weight = 1.0

[rewards.config.exact_match]
weight = 1.0
extract = "full"
"#,
    )
    .unwrap();
    let o = std::process::Command::new(rlhf_bin())
        .args(["train", "--config", s(&cfg), "--run-dir", s(&rd)])
        .output()
        .expect("spawn rlhf");
    assert!(o.status.success(), "rlhf train with the frozen plugin failed:\n{}", stderr(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(rd.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "one line per RL step: {lines:?}");
    let finite =
        |l: &serde_json::Value, key: &str| l.get(key).and_then(serde_json::Value::as_f64).is_some_and(f64::is_finite);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i + 1, "{l}");
        // The host's loss, the plugin's own metrics (from `loss` and `prepare`), and the host's
        // KL against the reference model the plugin required (beta > 0).
        for key in ["loss/total", "frozen/policy_loss", "frozen/kl", "frozen/advantage_abs_mean", "kl"] {
            assert!(finite(l, key), "step {}: `{key}` missing or not finite in {l}", i + 1);
        }
        assert_eq!(l["skipped_steps"].as_f64().unwrap_or(0.0), 0.0, "no step skipped: {l}");
    }
}

/// (c) Through the host API: the 4.1 host calls the appended optional method on the 4.0 object
/// and gets its default; `prepare` and `loss` (with the 4.1 `epoch` input, which the plugin
/// ignores) compute the hand-checked REINFORCE values through the ABI.
#[test]
fn the_host_api_drives_the_frozen_plugin() {
    frozen_so();
    let reg = PluginRegistry::scan(&[plugin_dir()]).unwrap();
    let plugin = reg.get(NAME, PluginKind::Algorithm).unwrap();
    let mut h = AlgorithmHandle::new(plugin, "{}", host_context("cpu", 0, 2), "algorithm.config").unwrap();
    assert_eq!(h.resolved_config(), serde_json::Value::Null, "4.0 has no resolved_config: the host gets the default");
    assert_eq!(h.requirements(), Requirements::default());
    assert_eq!(h.state().unwrap(), serde_json::json!({"batches": 0}));

    // Two prompts (ids 7 and 3), two samples each; rewards [1, 0 | 2, 4] → A = [0.5, −0.5, −1, 1].
    let t2 = |v: &[f32]| Tensor::from_slice(v).view([4, 3]);
    let mask = t2(&[1., 1., 0., 1., 0., 0., 1., 1., 1., 1., 0., 0.]);
    let logprobs = t2(&[-1., -2., 0., -1., 0., 0., -0.5, -0.5, -1., -2., 0., 0.]);
    let rewards = Tensor::from_slice(&[1f32, 0., 2., 4.]);
    let prepared = h
        .prepare(&Experience {
            rewards: rewards.shallow_clone(),
            logprobs: logprobs.shallow_clone(),
            ref_logprobs: None,
            values: None,
            action_mask: mask.shallow_clone(),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 3]),
            step: 0,
            behavior_logprobs: None,
        })
        .unwrap();
    assert_close(&values(&prepared.advantages), &[0.5, 0.5, 0., -0.5, 0., 0., -1., -1., -1., 1., 0., 0.]);
    assert!(prepared.returns.is_none());
    assert!(prepared.metrics.iter().any(|(n, _)| n == "frozen/advantage_abs_mean"), "{:?}", prepared.metrics);

    // Σ A·logp·mask = −1 over 7 tokens → loss 1/7, ∂loss/∂logp = −A·mask/7.
    let current = logprobs.copy().set_requires_grad(true);
    let out = h
        .loss(&Minibatch {
            logprobs: current.shallow_clone(),
            old_logprobs: logprobs.shallow_clone(),
            ref_logprobs: None,
            values: None,
            old_values: None,
            advantages: prepared.advantages.shallow_clone(),
            returns: None,
            action_mask: mask.shallow_clone(),
            entropy: None,
            rewards,
            step: 0,
            epoch: 1,
            accumulation_steps: 1,
            step_tokens: 7.0,
            step_rows: 2.0,
            behavior_logprobs: None,
        })
        .unwrap();
    assert_close(&[out.loss.double_value(&[]) as f32], &[1. / 7.]);
    out.loss.backward();
    let want: Vec<f32> = values(&prepared.advantages).iter().map(|a| -a / 7.).collect();
    assert_close(&values(&current.grad()), &want);
    assert_eq!(current.grad().kind(), Kind::Float);
    assert_eq!(h.state().unwrap(), serde_json::json!({"batches": 1}), "state() and load_state() work across the ABI");
    h.load_state(&serde_json::json!({"batches": 5})).unwrap();
    assert_eq!(h.state().unwrap(), serde_json::json!({"batches": 5}));

    // A plugin of the current minor answers the same call itself (grpo may or may not report
    // its config; either answer is valid JSON the host can log).
    if let Ok(grpo) = reg.get("grpo", PluginKind::Algorithm) {
        let h = AlgorithmHandle::new(grpo, "{}", host_context("cpu", 0, 2), "algorithm.config").unwrap();
        let v = h.resolved_config();
        assert!(v.is_null() || v.is_object(), "grpo's resolved_config: {v}");
    }
}

// This host's environment interface is newer than the frozen environment's 1.0 (1.1: the optional
// `take_images`).
const _: () = assert!(ENV_API_MINOR >= 1);

/// An environment built against the environment interface 1.0 — really 1.0, so this proves
/// something — is listed by `rlhf plugins` and runs its episodes in this host: the method it lacks
/// (`take_images`) answers the default, no images, and every episode takes its turns.
#[test]
fn the_frozen_environment_runs_its_episodes() {
    let so = frozen_env_so();
    let header = lib_header_from_path(&so).unwrap();
    // SAFETY: only its declaration is read; the host's loader checks the layout when it loads it.
    let module = unsafe { header.unchecked_layout::<EnvPluginModRef>() }.unwrap();
    let info = (module.info())();
    assert_eq!((info.api_major, info.api_minor), (1, 0), "the frozen snapshot is the environment interface 1.0");
    let o = rlhf(&["plugins", "--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().any(|l| l.split_whitespace().next() == Some("frozen-env")), "frozen-env is not listed:\n{out}");
    let file = so.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        !out.lines().any(|l| l.starts_with("refused:") && l.contains(&file)),
        "the 1.0 environment was refused:\n{out}"
    );

    let run = tempfile::tempdir().unwrap();
    let rd = run.path().join("r");
    let sets = [
        "eval.data=\"\"",
        "warmup.steps=0",
        "train.steps=1",
        "environment.plugin=\"frozen-env\"",
        "environment.reward=\"sum\"",
        "environment.config={ turns = 2, observation = \" then:\" }",
    ];
    let args: Vec<&str> = sets.iter().flat_map(|x| ["--set", *x]).collect();
    let o = rlhf(&[&["train", "--algo", "grpo", "--run-dir", s(&rd), "--no-progress"][..], &args].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(rd.join("metrics.jsonl")).unwrap().lines().last().unwrap())
            .unwrap();
    assert_eq!(m["env/errors"], 0.0, "{m}");
    assert!(m["env/turns/mean"].as_f64().unwrap() > 1.0, "{m}");
    assert_eq!(m["env/calls/mean"], m["env/turns/mean"], "{m}");
}
