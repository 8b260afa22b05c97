//! The RL host end to end with real plugins loaded from the workspace's `.so` files: listing and
//! refusals of the loader, panicking plugins, config errors, a few RL steps of every algorithm on
//! the tiny built-in model, the loss of a fixed batch going down, and the embedded presets learning.

use std::path::{Path, PathBuf};
use std::process::Output;

use rlhf_integration_tests::{metrics, model_dir, rlhf};

fn plugin_dir() -> PathBuf {
    rlhf_integration_tests::rlhf_bin().parent().unwrap().to_path_buf()
}

fn so(name: &str) -> PathBuf {
    let p = plugin_dir().join(format!("lib{}.so", name.replace('-', "_")));
    assert!(p.exists(), "{} not built: run `cargo xtask test`", p.display());
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected failure; stdout: {}", stdout(o));
    let e = stderr(o);
    assert!(!e.contains("thread 'main' panicked"), "host panicked: {e}");
    e.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {e}")).to_string()
}

#[test]
fn plugins_lists_the_workspace_plugins() {
    let o = rlhf(&["plugins", "--all"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for (name, kind) in [
        ("grpo", "algorithm"),
        ("ppo", "algorithm"),
        ("ppo-seq", "algorithm"),
        ("reward-rules", "reward"),
        ("template-reinforce", "algorithm"),
    ] {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing:\n{out}"));
        assert!(line.contains(kind) && line.contains(".so"), "{line}");
    }
    assert!(out.contains("librlhf_test_plugin_bad_layout.so: abi layout mismatch"), "{out}");
    assert!(out.contains("librlhf_test_plugin_not_a_plugin.so: not an rlhf plugin"), "{out}");
}

/// A plugin dir holding copies of the given libraries (copied under new names).
fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for (lib, as_name) in files {
        std::fs::copy(so(lib), d.path().join(as_name)).unwrap();
    }
    d
}

fn plugins_in(dir: &Path, env: Option<&str>) -> String {
    let mut cmd = std::process::Command::new(rlhf_integration_tests::rlhf_bin());
    cmd.args(["plugins", "--all", "--dir", s(dir)]);
    if let Some(v) = env {
        cmd.env("RLHF_TEST_BAD_INFO", v);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

#[test]
fn loader_refuses_bad_plugins_naming_the_file() {
    let d = dir_with(&[("rlhf-test-plugin-bad-info", "libbad1.so")]);
    let ok = plugins_in(d.path(), None);
    assert!(ok.lines().any(|l| l.starts_with("test-bad-info")), "{ok}");
    let (major, minor) = (rlhf_plugin_api::API_MAJOR, rlhf_plugin_api::API_MINOR);
    let host = format!("this host has {major}.{minor}");
    let newer = format!("ABI {major}.{}", minor + 1);
    for (mode, needles) in [
        // Another major: refused, whatever the minor.
        ("api", vec!["interface version mismatch: plugin `test-bad-info`", host.as_str(), "another major"]),
        // Same major, a newer minor than the host's: the plugin may call what this host lacks.
        ("api-minor", vec!["interface version mismatch: plugin `test-bad-info`", newer.as_str(), host.as_str()]),
        ("torch", vec!["torch version mismatch: plugin `test-bad-info` was built against libtorch 1.0.0"]),
        ("tch", vec!["tch version mismatch"]),
    ] {
        let out = plugins_in(d.path(), Some(mode));
        let line = out.lines().find(|l| l.starts_with("refused:")).unwrap_or_else(|| panic!("{mode}: {out}"));
        assert!(line.contains("libbad1.so"), "{mode}: {line}");
        for needle in needles {
            assert!(line.contains(needle), "{mode}: `{needle}` missing from {line}");
        }
    }
    let d =
        dir_with(&[("rlhf-test-plugin-bad-layout", "liblayout.so"), ("rlhf-test-plugin-not-a-plugin", "libnot.so")]);
    let out = plugins_in(d.path(), None);
    assert!(out.contains("liblayout.so: abi layout mismatch"), "{out}");
    assert!(out.contains("libnot.so: not an rlhf plugin"), "{out}");
    std::fs::write(d.path().join("libgarbage.so"), b"not an ELF file").unwrap();
    let out = plugins_in(d.path(), None);
    assert!(out.contains("libgarbage.so: not a loadable library"), "{out}");

    let d = dir_with(&[("rlhf-plugin-grpo", "libgrpo_a.so"), ("rlhf-plugin-grpo", "libgrpo_b.so")]);
    let out = plugins_in(d.path(), None);
    assert!(out.contains("two plugins declare the name `grpo`"), "{out}");
    assert!(out.contains("libgrpo_a.so") && out.contains("libgrpo_b.so"), "{out}");
    assert!(!out.lines().any(|l| l.starts_with("grpo ")), "a duplicated name is not accepted: {out}");
}

fn train(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(rlhf_integration_tests::rlhf_bin());
    // The presets' held-out evaluation is off unless a test asks for it (a later --set wins).
    cmd.arg("train").args(["--set", "eval.data=\"\""]).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn panicking_and_unknown_plugins_are_clear_errors() {
    let run = tempfile::tempdir().unwrap();
    let rd = run.path().join("r");
    let common = ["--set", "train.steps=1", "--set", "warmup.steps=0", "--run-dir", s(&rd)];
    let o = train(&[&["--algo", "test-bad-info"], &common[..]].concat(), &[("RLHF_TEST_BAD_INFO", "panic")]);
    let e = error_line(&o);
    assert!(
        e.contains("plugin `test-bad-info`") && e.contains("librlhf_test_plugin_bad_info.so") && e.contains("panicked"),
        "{e}"
    );
    let o = train(&[&["--algo", "test-bad-info"], &common[..]].concat(), &[("RLHF_TEST_BAD_INFO", "loss-panic")]);
    let e = error_line(&o);
    assert!(e.contains("plugin `test-bad-info`") && e.contains("panicked"), "{e}");

    // A NaN loss skips the optimizer step, is logged, and the run goes on.
    let o = train(
        &[
            "--algo",
            "test-bad-info",
            "--set",
            "train.steps=2",
            "--set",
            "warmup.steps=0",
            "--set",
            "train.minibatch_size=32",
            "--run-dir",
            s(&rd),
        ],
        &[("RLHF_TEST_BAD_INFO", "nan-loss")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("non-finite loss"), "{}", stderr(&o));
    let lines = metrics(&rd);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(l["skipped_steps"], 2.0, "4 minibatches per step, every other one NaN: {l}");
    }

    // A reward plugin returning the wrong number of scores is an error naming the plugin.
    let cfg = run.path().join("wrong-count.toml");
    std::fs::write(&cfg, "[algorithm]\nname = \"grpo\"\n[[rewards]]\nplugin = \"test-bad-info\"\n").unwrap();
    let o = train(
        &[
            "--config",
            s(&cfg),
            "--set",
            "train.steps=1",
            "--set",
            "warmup.steps=0",
            "--run-dir",
            s(&run.path().join("r2")),
        ],
        &[("RLHF_TEST_BAD_INFO", "wrong-count")],
    );
    let e = error_line(&o);
    assert!(e.contains("plugin `test-bad-info`") && e.contains("returned 33 scores for 32 samples"), "{e}");

    let o = train(&[&["--algo", "nope"], &common[..]].concat(), &[]);
    let e = error_line(&o);
    assert!(e.contains("unknown --algo `nope`") && e.contains("grpo") && e.contains("ppo-seq"), "{e}");
    // An offline method names its own command.
    let o = train(&[&["--algo", "dpo"], &common[..]].concat(), &[]);
    let e = error_line(&o);
    assert!(e.contains("--algo dpo: `rlhf train` runs online RL; dpo trains on a dataset with `rlhf dpo`"), "{e}");
}

#[test]
fn config_errors_name_the_key() {
    let run = tempfile::tempdir().unwrap();
    let rd = run.path().join("r");
    let o = train(&["--algo", "grpo", "--set", "algorithm.config.betaa=1", "--run-dir", s(&rd)], &[]);
    let e = error_line(&o);
    assert!(e.contains("algorithm.config.betaa") && e.contains("unknown field"), "{e}");
    let o = train(&["--algo", "grpo", "--set", "algorithm.config.beta=\"x\"", "--run-dir", s(&rd)], &[]);
    let e = error_line(&o);
    assert!(e.contains("algorithm.config.beta: invalid type"), "{e}");
    let cfg = run.path().join("bad.toml");
    std::fs::write(
        &cfg,
        "[algorithm]\nname = \"grpo\"\n[train]\nsteps = \"many\"\n[[rewards]]\nplugin = \"reward-rules\"\n",
    )
    .unwrap();
    let o = train(&["--config", s(&cfg), "--run-dir", s(&rd)], &[]);
    let e = error_line(&o);
    assert!(e.contains("bad.toml") && e.contains("train.steps") && e.contains("invalid type"), "{e}");
    std::fs::write(
        &cfg,
        "[algorithm]\nname = \"grpo\"\n[[rewards]]\nplugin = \"reward-rules\"\n[rewards.config]\nexact = 1\n",
    )
    .unwrap();
    let o = train(&["--config", s(&cfg), "--run-dir", s(&rd)], &[]);
    let e = error_line(&o);
    assert!(e.contains("rewards[0].config.exact") && e.contains("unknown field"), "{e}");
}

#[test]
fn every_algorithm_runs_a_few_steps_and_scores_every_sample() {
    for algo in ["grpo", "ppo", "ppo-seq", "template-reinforce"] {
        let run = tempfile::tempdir().unwrap();
        let rd = run.path().join("r");
        let ptx =
            format!("train.ptx_data={:?}", rlhf_integration_tests::fixtures().join("ppl.jsonl").display().to_string());
        let mut args =
            vec!["--algo", algo, "--set", "train.steps=3", "--set", "warmup.steps=5", "--set", "data.max_prompt_len=3"];
        if algo == "ppo" {
            // The EMA actor and the ptx (unsupervised LM) loss ride along on one algorithm.
            args.extend(["--set", "train.ema_decay=0.9", "--set", "train.ptx_coef=0.1", "--set", &ptx]);
        }
        args.extend(["--run-dir", s(&rd)]);
        let o = train(&args, &[]);
        assert!(o.status.success(), "{algo}: {}", stderr(&o));
        assert!(stderr(&o).contains("truncated from the left"), "{algo}: long prompts are truncated with a warning");
        assert!(stdout(&o).contains(&format!("metrics: {}", rd.join("metrics.jsonl").display())), "{}", stdout(&o));
        let lines = metrics(&rd);
        assert_eq!(lines.len(), 3, "{algo}: one line per step");
        for (i, l) in lines.iter().enumerate() {
            assert_eq!(l["step"], i + 1);
            let r = l["reward"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&r), "{algo}: reward {r}");
            let (count, dropped, scored) = (
                l["completions/count"].as_f64().unwrap(),
                l["completions/dropped"].as_f64().unwrap(),
                l["completions/scored"].as_f64().unwrap(),
            );
            assert_eq!(count + dropped, 16.0 * 8.0, "{algo}: prompts × samples");
            assert_eq!(scored, count, "{algo}: every sample was scored");
            let with_reference = algo != "template-reinforce";
            for key in [
                "kl",
                "entropy",
                "loss/policy",
                "lr",
                "tokens_per_s",
                "step_time",
                "completions/mean_length",
                "reward_std",
            ] {
                if key == "kl" && !with_reference {
                    assert!(l.get("kl").is_none(), "{algo}: no reference, no kl");
                    continue;
                }
                assert!(l.get(key).is_some_and(|v| v.is_number()), "{algo}: metric {key} missing in {l}");
            }
        }
        assert!(rd.join("actor").join("model.safetensors").exists(), "{algo}: final actor exported");
        if algo == "ppo" {
            assert!(rd.join("actor-ema").join("model.safetensors").exists(), "EMA actor exported");
            assert!(lines.iter().all(|l| l["loss/ptx"].as_f64().is_some_and(f64::is_finite)), "ptx loss logged");
        }
        assert!(rd.join("config.toml").exists());
    }
}

/// PPO with LoRA on the actor (q/v projections) and on the critic (every linear layer): the run
/// trains both through their adapters, and the exported actor is a plain Hugging Face checkpoint
/// of the base model's layout (adapters merged, no `lora_` names) in which only the adapted
/// projections moved.
#[test]
fn ppo_with_lora_on_actor_and_critic_exports_a_merged_plain_actor() {
    let base = model_dir("llama");
    let run = tempfile::tempdir().unwrap();
    let rd = run.path().join("r");
    let actor = format!("model.actor={:?}", s(&base));
    let o = train(
        &[
            "--algo",
            "ppo",
            "--set",
            &actor,
            "--set",
            "warmup.steps=0",
            "--set",
            "train.steps=2",
            "--set",
            "rollout.prompts_per_batch=4",
            "--set",
            "rollout.samples_per_prompt=4",
            "--set",
            "train.minibatch_size=8",
            "--set",
            "model.lora.rank=4",
            "--set",
            "model.lora.target_modules=[\"q_proj\", \"v_proj\"]",
            "--set",
            "model.critic_lora.rank=4",
            "--set",
            "model.critic_lora.target_modules=[\"all-linear\"]",
            "--run-dir",
            s(&rd),
        ],
        &[],
    );
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("actor LoRA:") && log.contains("critic LoRA:"), "both adapters applied: {log}");
    let lines = metrics(&rd);
    assert_eq!(lines.len(), 2, "one line per step");
    for l in &lines {
        for key in ["loss/policy", "loss/value", "grad_norm/critic"] {
            let v = l.get(key).and_then(serde_json::Value::as_f64);
            assert!(v.is_some_and(f64::is_finite), "{key} missing or not finite in {l}");
        }
        assert!(l["grad_norm/critic"].as_f64().unwrap() > 0.0, "the critic's adapters and head get gradients: {l}");
    }

    let read = |dir: &Path| -> std::collections::BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().collect()
    };
    let (orig, exported) = (read(&base), read(&rd.join("actor")));
    assert!(exported.keys().all(|n| !n.contains("lora_")), "adapters merged: {:?}", exported.keys());
    assert_eq!(exported.keys().collect::<Vec<_>>(), orig.keys().collect::<Vec<_>>(), "the base model's tensor names");
    let mut moved = Vec::new();
    for (name, w) in &exported {
        let w0 = &orig[name];
        assert_eq!(w.size(), w0.size(), "{name}: shape");
        assert_eq!(w.kind(), w0.kind(), "{name}: dtype");
        let diff = (w - w0).abs().max().double_value(&[]);
        if name.ends_with("q_proj.weight") || name.ends_with("v_proj.weight") {
            moved.push((name.clone(), diff));
        } else {
            assert_eq!(diff, 0.0, "{name} is not adapted and must keep the base weights");
        }
    }
    println!("merged LoRA deltas (max |Δw|): {moved:?}");
    assert_eq!(moved.len(), 4, "q_proj and v_proj of both layers: {moved:?}");
    assert!(moved.iter().all(|(_, d)| *d > 1e-6 && d.is_finite()), "training moved every adapted weight: {moved:?}");
    // The exported actor loads as a causal LM again.
    rlhf_models::CausalLm::from_dir(&rd.join("actor"), tch::Device::Cpu, tch::Kind::Float).unwrap();
}

/// Loads the plugins in-process and checks that repeated optimisation of one fixed batch lowers the
/// algorithm's loss, through the plugin boundary in both directions (tensors in, loss and gradients
/// back).
#[test]
fn loss_on_a_fixed_batch_decreases() {
    use rlhf_generation::{left_pad, token_logprobs, LogProbOptions};
    use rlhf_models::{CausalLm, ScalarHeadModel};
    use rlhf_plugin_api::{Experience, Minibatch, PluginKind};
    use rlhf_trainer::optim::{Optim, OptimConfig, Schedule};
    use rlhf_trainer::plugins::{host_context, AlgorithmHandle, PluginRegistry};
    use tch::{Device, Kind, Tensor};

    let reg = PluginRegistry::scan(&[plugin_dir()]).unwrap();
    for algo in ["grpo", "ppo", "ppo-seq"] {
        tch::manual_seed(0);
        let dir = model_dir("llama");
        let actor = CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap();
        let mut reference = CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap();
        reference.freeze();
        let critic = ScalarHeadModel::from_causal_lm_dir(&dir, Device::Cpu, Kind::Float).unwrap();
        let mut h = AlgorithmHandle::new(
            reg.get(algo, PluginKind::Algorithm).unwrap(),
            "{}",
            host_context("cpu", 0, 2),
            "algorithm.config",
        )
        .unwrap();
        let req = h.requirements();
        // Two prompts × two responses; rewards favour the first response of each prompt.
        let seqs = vec![vec![5, 6, 7, 20, 21, 22], vec![5, 6, 7, 30, 31], vec![8, 9, 40, 41, 42], vec![8, 9, 50, 51]];
        let prompt_lens = [3usize, 3, 2, 2];
        let b = left_pad(&seqs, 0, Device::Cpu).unwrap();
        let t = b.input_ids.size()[1];
        let p_len = 3; // the response slots start after the longest prompt region
        let r_len = t - p_len;
        let mut mask = vec![0f32; 4 * r_len as usize];
        for (i, (s, p)) in seqs.iter().zip(prompt_lens).enumerate() {
            let start = t as usize - s.len() + p; // first response token
            for j in start..t as usize {
                mask[i * r_len as usize + j - p_len as usize] = 1.0;
            }
        }
        let action_mask = Tensor::from_slice(&mask).view([4, r_len]);
        let rewards = Tensor::from_slice(&[1f32, 0., 1., 0.]);
        let group_ids = Tensor::from_slice(&[0i64, 0, 1, 1]);
        let lp = |m: &CausalLm| {
            token_logprobs(m, &b.input_ids, &b.attention_mask, p_len, LogProbOptions::default()).unwrap().logprobs
        };
        let old = tch::no_grad(|| lp(&actor));
        let refl = tch::no_grad(|| lp(&reference));
        let values =
            tch::no_grad(|| critic.values(&b.input_ids, &b.attention_mask).unwrap().narrow(1, p_len - 1, r_len));
        let (ref_o, val_o) = (req.reference.then(|| refl.shallow_clone()), req.critic.then(|| values.shallow_clone()));
        let prepared = h
            .prepare(&Experience {
                rewards: rewards.shallow_clone(),
                logprobs: old.shallow_clone(),
                ref_logprobs: ref_o.as_ref().map(Tensor::shallow_clone),
                values: val_o.as_ref().map(Tensor::shallow_clone),
                action_mask: action_mask.shallow_clone(),
                group_ids: group_ids.shallow_clone(),
                step: 0,
                behavior_logprobs: None,
            })
            .unwrap();
        let (adv, ret) = (prepared.advantages, prepared.returns);
        let settings = OptimConfig {
            lr: 1e-3,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.0,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            max_grad_norm: 1.0,
        };
        let mut opt = Optim::new(&actor.vs, &settings, 100).unwrap();
        let mut copt = Optim::new(&critic.vs, &settings, 100).unwrap();
        let mut losses = Vec::new();
        for _ in 0..8 {
            let cur = lp(&actor);
            let v =
                req.critic.then(|| critic.values(&b.input_ids, &b.attention_mask).unwrap().narrow(1, p_len - 1, r_len));
            let out = h
                .loss(&Minibatch {
                    logprobs: cur,
                    old_logprobs: old.shallow_clone(),
                    ref_logprobs: ref_o.as_ref().map(Tensor::shallow_clone),
                    values: v,
                    old_values: val_o.as_ref().map(Tensor::shallow_clone),
                    advantages: adv.shallow_clone(),
                    returns: ret.as_ref().map(Tensor::shallow_clone),
                    action_mask: action_mask.shallow_clone(),
                    entropy: None,
                    rewards: rewards.shallow_clone(),
                    step: 0,
                    epoch: 0,
                    accumulation_steps: 1,
                    step_tokens: 0.0,
                    step_rows: 0.0,
                    behavior_logprobs: None,
                })
                .unwrap();
            let loss = out.loss;
            losses.push(loss.double_value(&[]));
            loss.backward();
            opt.step().unwrap();
            // ppo-seq recomputes A = R - V.detach() inside `loss`, from the *current* critic, so while
            // the critic learns its total loss is not a fixed objective; hold the critic still for
            // it. ppo's advantages come from `prepare` and its critic trains along.
            if req.critic && algo != "ppo-seq" {
                copt.step().unwrap();
            } else {
                copt.zero_grad().unwrap();
            }
        }
        println!("{algo}: losses {losses:?}");
        assert!(losses.iter().all(|l| l.is_finite()), "{algo}: {losses:?}");
        assert!(losses[7] < losses[0] - 1e-3, "{algo}: loss did not decrease: {losses:?}");
    }
}

/// The embedded defaults (`cargo xtask train --algo X`) visibly learn: mean reward of the last 10 %
/// of steps exceeds the first 10 % by at least 0.25, the doctor's bar. Measured over four seeds
/// (the default and 1–3, release build): PPO gains 0.50–0.60, sequence-level PPO 0.29–0.49
/// (0.33–0.40 with the sampling noise of earlier releases); a run that does not learn stays within
/// ±0.1. GRPO's default is held to the same bar in `data_parallel.rs`, beside its 2-rank run.
#[test]
fn embedded_presets_learn() {
    for algo in ["ppo", "ppo-seq"] {
        let run = tempfile::tempdir().unwrap();
        let rd = run.path().join("r");
        let o = train(&["--algo", algo, "--run-dir", s(&rd)], &[]);
        assert!(o.status.success(), "{algo}: {}", stderr(&o));
        // Training steps only: the preset's held-out evaluation before training is row 0.
        let rewards: Vec<f64> =
            metrics(&rd).iter().filter(|l| l["step"] != 0).map(|l| l["reward"].as_f64().unwrap()).collect();
        let k = (rewards.len() / 10).max(1);
        let first = rewards[..k].iter().sum::<f64>() / k as f64;
        let last = rewards[rewards.len() - k..].iter().sum::<f64>() / k as f64;
        println!("{algo}: reward first 10% {first:.3}, last 10% {last:.3}");
        assert!(last >= first + 0.25, "{algo}: reward {first:.3} -> {last:.3} (needs +0.25)");
    }
}
