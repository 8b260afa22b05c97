//! Inputs a careful adversarial user tried: rewards that overflow, plugin metrics that would
//! replace the host's or grow every row without bound, and logs piped to a file.

use std::path::Path;
use std::process::{Command, Output};

use rlhf_integration_tests::{metrics, rlhf_bin};

/// GRPO on the built-in task with `env-script` (config `env`) and `extra` settings.
fn train_env(run: &Path, env: &str, extra: &[&str]) -> Output {
    let env_cfg = format!("environment.config={{ {env} }}");
    let mut c = Command::new(rlhf_bin());
    c.args(["train", "--algo", "grpo", "--no-progress", "--run-dir", run.to_str().unwrap()])
        .args(["--set", "eval.data=\"\"", "--set", "warmup.steps=0", "--set", "train.steps=12"])
        .args(["--set", "environment.plugin=\"env-script\"", "--set", "environment.reward=\"sum\""])
        .args(["--set", &env_cfg]);
    for e in extra {
        c.args(["--set", e]);
    }
    c.output().expect("spawn rlhf")
}

fn last_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string()
}

/// A weight whose product with a score overflows makes that score its source's failure (not an
/// infinite reward), and rewards too large to train on stop the run after `train.max_idle_steps`
/// steps that trained nothing, naming the cause — never a run that trains nothing and exits 0.
#[test]
fn overflowing_rewards_end_the_run_naming_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("weight");
    let o = train_env(&run, "turns = 2, turn_reward = 2.0", &["environment.weight=1e308"]);
    assert!(!o.status.success(), "a run that trains nothing must fail");
    let e = last_line(&o);
    assert!(e.contains("the last 5 steps trained nothing: no sample could be scored"), "{e}");
    let rows = metrics(&run);
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|r| r["rewards/env/skipped"].as_f64().unwrap() > 0.0), "{:?}", rows[0]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("weight 1e308 × score overflows"));

    let run = tmp.path().join("huge");
    let o = train_env(&run, "turns = 2, turn_reward = 2.0", &["environment.weight=1e300"]);
    assert!(!o.status.success());
    let e = last_line(&o);
    assert!(e.contains("non-finite loss; the rewards are too large to train on"), "{e}");
    // The limit is a setting; 0 turns the stop off.
    let run = tmp.path().join("off");
    let o = train_env(&run, "turns = 2, turn_reward = 2.0", &["environment.weight=1e308", "train.max_idle_steps=0"]);
    assert!(o.status.success(), "{}", last_line(&o));
}

/// An environment's metrics named like the host's own go under `env/<plugin>/`; the host's values
/// stay; a plugin reporting ever-new names is cut at 256 names with one warning.
#[test]
fn plugin_metrics_cannot_replace_the_hosts_or_grow_without_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("names");
    let o = train_env(&run, r#"turns = 2, metrics = ["reward", "turns", "errors"]"#, &["train.steps=2"]);
    assert!(o.status.success(), "{}", last_line(&o));
    for row in metrics(&run) {
        assert_eq!(row["env/env-script/reward/mean"], 7.0 * row["env/turns/mean"].as_f64().unwrap());
        assert!(row["env/turns/mean"].as_f64().unwrap() <= 2.0, "the host's turns were replaced: {row}");
        assert!(row["env/reward/mean"].as_f64().unwrap() < 7.0, "the host's reward was replaced: {row}");
        assert!(row.get("env/env-script/turns/mean").is_some() && row.get("env/env-script/errors/mean").is_some());
    }
    let run = tmp.path().join("fresh");
    let o = train_env(&run, "turns = 2, fresh_metrics = 300", &["train.steps=3"]);
    assert!(o.status.success(), "{}", last_line(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("more than 256 distinct metric names").count(), 1, "{err}");
    for row in metrics(&run) {
        let fresh = row.as_object().unwrap().keys().filter(|k| k.starts_with("env/fresh-")).count();
        assert_eq!(fresh, 256, "fresh metric keys in a row");
    }
}

/// Logs written to a pipe or a file carry no colour escape codes.
#[test]
fn piped_logs_have_no_colour() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(rlhf_bin())
        .args(["train", "--algo", "grpo", "--set", "train.steps=1", "--set", "eval.data=\"\"", "--run-dir"])
        .arg(tmp.path().join("r"))
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    assert!(o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("INFO") && !err.contains('\u{1b}'), "escape codes in piped logs: {err:?}");
}

/// `rlhf train ARGS` for bad input: non-zero, one `error:` line containing `want`, no panic or
/// libtorch stack trace, and (for a fresh start) no run directory left behind.
fn refused(args: &[&str], run: &Path, want: &str) {
    let o = Command::new(rlhf_bin()).args(args).arg("--no-progress").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?}: accepted");
    assert!(!err.contains("panicked") && !err.contains("Exception raised from"), "{args:?}: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{args:?}: {err}");
    assert!(errors[0].contains(want), "{args:?}: {}", errors[0]);
    assert!(!run.exists() || run.join("checkpoints").exists(), "{args:?} left {}", run.display());
}

/// 64-bit FNV-1a, as checkpoint manifests seal files.
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[test]
fn bad_values_are_one_line_errors_naming_the_key_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let rd = run.to_str().unwrap();
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "{\"prompt\": \"2 + 2 =\"}\n{\"prompt\": \"\"}\n").unwrap();
    let empty_set = format!("data.prompts=\"{}\"", empty.display());
    let env = ["--set", "environment.plugin=\"env-script\"", "--set", "environment.reward=\"sum\""];
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["--set", "data.max_prompt_len=0"], "data.max_prompt_len: must be >= 1".into()),
        (
            [&env[..], &["--set", "environment.config=\"hello\""]].concat(),
            "environment.config: expected a table".into(),
        ),
        (vec!["--set", "algorithm.config.beta=nan"], "algorithm.config.beta: NaN is not a finite number".into()),
        (
            vec!["--set", "train.steps=99999999999999999999999"],
            "train.steps: 99999999999999999999999 is out of range".into(),
        ),
        (vec!["--set", &empty_set], format!("{}: line 2: prompt: empty", empty.display())),
        (vec!["--set", "eval.data=\"builtin:nope\""], "eval.data: unknown built-in task `builtin:nope`".into()),
    ];
    for (extra, want) in cases {
        let args = [&["train", "--algo", "grpo", "--run-dir", rd][..], &extra].concat();
        refused(&args, &run, &want);
    }
    let args = ["train", "--algo", "ppo", "--run-dir", rd, "--set", "model.critic_lora.rank=4", "--set"];
    refused(
        &[&args[..], &["model.critic_lora.target_modules=[\"nope\"]"]].concat(),
        &run,
        "model.critic_lora.target_modules:",
    );
}

/// A checkpoint edited by hand — an empty AdamW `step` tensor (its manifest entry mended), a
/// manifest step that disagrees with the state — is refused naming the file, never with
/// libtorch's stack trace or at another step than the state's.
#[test]
fn hand_edited_checkpoints_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let rd = run.to_str().unwrap();
    let o = Command::new(rlhf_bin())
        .args(["train", "--algo", "grpo", "--no-progress", "--run-dir", rd, "--set", "train.steps=4"])
        .args(["--set", "checkpoint.every=2", "--set", "checkpoint.keep=5", "--set", "eval.data=\"\""])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = run.join("checkpoints/step-000002");
    let manifest_path = ckpt.join("manifest.json");
    let manifest = std::fs::read_to_string(&manifest_path).unwrap();
    // The manifest's step against the state's.
    let mut m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    m["step"] = serde_json::json!(3);
    std::fs::write(&manifest_path, m.to_string()).unwrap();
    refused(&["train", "--resume", ckpt.to_str().unwrap()], &run, "manifest.json says step 3, state.json 2");
    // An empty step counter in the optimizer state, the manifest mended to match.
    let opt = ckpt.join("optimizer-actor.safetensors");
    let mut tensors = tch::Tensor::read_safetensors(&opt).unwrap();
    let name = tensors.iter().map(|(n, _)| n.clone()).find(|n| n.ends_with(".step")).unwrap();
    for (n, t) in tensors.iter_mut() {
        if *n == name {
            *t = tch::Tensor::zeros([0], (tch::Kind::Int64, tch::Device::Cpu));
        }
    }
    tch::Tensor::write_safetensors(&tensors, &opt).unwrap();
    let bytes = std::fs::read(&opt).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    m["files"]["optimizer-actor.safetensors"] = serde_json::json!({"bytes": bytes.len(), "fnv1a64": fnv1a(&bytes)});
    std::fs::write(&manifest_path, m.to_string()).unwrap();
    refused(&["train", "--resume", ckpt.to_str().unwrap()], &run, &format!("optimizer state `{name}`"));
}
