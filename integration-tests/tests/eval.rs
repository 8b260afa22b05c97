//! Held-out evaluation during RL (`[eval]`): it never perturbs training (a run that evaluates is
//! the run that does not, bit for bit), its metrics appear in the step rows (step 0 before training,
//! then every `every_steps`) with pass@k, maj@n, per-source rewards and the per-`data_source`
//! breakdown, every sample is written to `eval/step-<N>.jsonl` and agrees with the metrics, and
//! bad `[eval]` values are one-line errors naming the key that leave no run directory.

use std::path::{Path, PathBuf};
use std::process::Output;

use rlhf_integration_tests::{behaviour_metrics, rlhf};
use serde_json::Value;

/// Six held-out prompts of the built-in task's vocabulary, from two sources.
fn held_out(dir: &Path) -> PathBuf {
    let path = dir.join("held-out.jsonl");
    let lines: Vec<String> =
        [(1, 2, "small"), (2, 2, "small"), (0, 3, "small"), (4, 5, "large"), (6, 3, "large"), (2, 7, "large")]
            .iter()
            .map(|(a, b, src)| format!(r#"{{"prompt": "{a} + {b} =", "label": "{}", "data_source": "{src}"}}"#, a + b))
            .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn grpo(run: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--algo", "grpo", "--run-dir", run.to_str().unwrap(), "--set", "train.steps=4"];
    args.extend_from_slice(extra);
    rlhf(&args)
}

fn eval_sets(data: &Path) -> Vec<String> {
    [
        format!("eval.data={}", data.display()),
        "eval.every_steps=2".into(),
        "eval.samples_per_prompt=4".into(),
        "eval.temperature=1.0".into(),
        "eval.correct_if=accuracy >= 1.0".into(),
    ]
    .iter()
    .flat_map(|s| ["--set".to_string(), s.clone()])
    .collect()
}

#[test]
fn evaluation_never_perturbs_training_and_reports_every_estimator() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let (with, without) = (dir.path().join("with"), dir.path().join("without"));
    let sets = eval_sets(&data);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let o = grpo(&with, &sets);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = grpo(&without, &["--set", "eval.data=\"\""]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // Training: the same rows, without the eval keys, and the same final weights, bit for bit.
    let rows = behaviour_metrics(&with);
    let train_only: Vec<_> = rows
        .iter()
        .filter(|r| r["step"] != 0)
        .map(|r| {
            r.iter()
                .filter(|(k, _)| !k.starts_with("eval/"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<serde_json::Map<_, _>>()
        })
        .collect();
    assert_eq!(train_only, behaviour_metrics(&without));
    let weights = |run: &Path| std::fs::read(run.join("actor").join("model.safetensors")).unwrap();
    assert!(weights(&with) == weights(&without), "evaluation changed the trained weights");

    // Evaluated at steps 0 (before training), 2 and 4 (every 2, and the end); not at 1 or 3.
    let evaluated: Vec<u64> =
        rows.iter().filter(|r| r.contains_key("eval/pass@1")).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(evaluated, [0, 2, 4]);
    for row in rows.iter().filter(|r| r.contains_key("eval/pass@1")) {
        let step = row["step"].as_u64().unwrap();
        for key in
            ["eval/reward/mean", "eval/reward/accuracy", "eval/pass@2", "eval/pass@4", "eval/maj@4", "eval/length/mean"]
        {
            assert!(row[key].is_number(), "step {step}: {key} in {row:?}");
        }
        for source in ["small", "large"] {
            assert_eq!(row[&format!("eval/{source}/prompts")].as_f64(), Some(3.0), "step {step}");
            assert!(row[&format!("eval/{source}/pass@1")].is_number(), "step {step}");
        }
        assert_eq!(row["eval/prompts"].as_f64(), Some(6.0));
        // The samples file holds every answer, and its verdicts give the metrics.
        let path = with.join("eval").join(format!("step-{step}.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let prompts: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(prompts.len(), 6);
        let mut pass1 = 0.0;
        let mut any4 = 0.0;
        for p in &prompts {
            let completions = p["completions"].as_array().unwrap();
            assert_eq!(completions.len(), 4, "{p}");
            let correct = completions.iter().filter(|c| c["correct"] == true).count();
            assert_eq!(p["correct"].as_u64(), Some(correct as u64));
            for c in completions {
                let accuracy = c["rewards"]["accuracy"].as_f64();
                assert_eq!(c["correct"] == true, accuracy == Some(1.0), "{c}");
            }
            pass1 += correct as f64 / 4.0 / 6.0;
            any4 += f64::from(u8::from(correct > 0)) / 6.0;
        }
        assert!((row["eval/pass@1"].as_f64().unwrap() - pass1).abs() < 1e-12, "step {step}");
        assert!((row["eval/pass@4"].as_f64().unwrap() - any4).abs() < 1e-12, "step {step}");
    }
}

/// One sample per prompt is greedy unless `eval.temperature` says otherwise: the evaluation
/// before training does not depend on `rollout.temperature`, which it would if it sampled.
#[test]
fn one_sample_is_greedy() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let set = format!("eval.data={}", data.display());
    let mut answers = Vec::new();
    for (name, temperature) in [("a", "rollout.temperature=1.0"), ("b", "rollout.temperature=3.0")] {
        let run = dir.path().join(name);
        let o = grpo(
            &run,
            &[
                "--set",
                &set,
                "--set",
                "train.steps=1",
                "--set",
                "eval.at_end=false",
                "--set",
                temperature,
                "--set",
                "eval.samples_per_prompt=1",
            ],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(!run.join("eval").join("step-1.jsonl").exists(), "at_end = false still evaluated the end");
        answers.push(std::fs::read_to_string(run.join("eval").join("step-0.jsonl")).unwrap());
    }
    assert_eq!(answers[0], answers[1]);
    let first: Value = serde_json::from_str(answers[0].lines().next().unwrap()).unwrap();
    assert_eq!(first["completions"].as_array().unwrap().len(), 1);
}

#[test]
fn bad_eval_values_are_one_line_errors_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let set = format!("eval.data={}", data.display());
    for (extra, key) in [
        ("eval.samples_per_prompt=0", "eval.samples_per_prompt"),
        ("eval.correct_if=accuracy", "eval.correct_if"),
        ("eval.correct_if=nope >= 1", "eval.correct_if"),
        ("eval.rewards=[\"nope\"]", "eval.rewards[0]"),
        ("eval.temperature=-1", "eval.temperature"),
        ("eval.answer=middle", "eval.answer"),
        ("eval.data=/nonexistent/held-out.jsonl", "eval.data"),
    ] {
        let run = dir.path().join("bad");
        let o = grpo(&run, &["--set", &set, "--set", extra]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra}: accepted");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{extra}: {err}");
        assert!(errors[0].contains(key), "{extra}: {}", errors[0]);
        assert!(!err.contains("panicked"), "{err}");
        assert!(!run.exists(), "{extra}: the failed start left {}", run.display());
    }
}

/// `rlhf eval ARGS` on one intra-op thread per process.
fn eval_cmd(args: &[&str]) -> Output {
    std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .arg("eval")
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

fn summary(path: &Path) -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    v["metrics"].as_object().unwrap().clone()
}

/// `rlhf eval` on a run directory (its exported actor) reproduces the run's own greedy evaluation
/// at its last step, its final checkpoint gives the same numbers, 2 ranks give one process's, and
/// the summary, table and answers file agree.
#[test]
fn rlhf_eval_scores_a_run_its_checkpoint_and_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let run = dir.path().join("run");
    let set = format!("eval.data={}", data.display());
    let o = grpo(
        &run,
        &[
            "--set",
            &set,
            "--set",
            "train.steps=3",
            "--set",
            "eval.before_train=false",
            "--set",
            "eval.samples_per_prompt=1",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = behaviour_metrics(&run);
    let last = rows.last().unwrap();
    assert_eq!(last["step"], 3);

    let d = data.to_str().unwrap();
    let out = dir.path().join("run-eval.json");
    let o =
        eval_cmd(&["--model", run.to_str().unwrap(), "--data", d, "--samples", "1", "--out", out.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got = summary(&out);
    for (k, v) in last.iter().filter(|(k, _)| k.starts_with("eval/")) {
        assert_eq!(got.get(k), Some(v), "{k}: rlhf eval against the run's own evaluation");
    }
    assert!(stdout.lines().any(|l| l.starts_with("all ") && l.contains("6")), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("small ")) && stdout.lines().any(|l| l.starts_with("large ")));
    let answers = std::fs::read_to_string(dir.path().join("run-eval.samples.jsonl")).unwrap();
    assert_eq!(answers.lines().count(), 6);

    let ckpt = run.join("checkpoints").join("step-000003");
    let out_ckpt = dir.path().join("ckpt.json");
    let o = eval_cmd(&[
        "--model",
        ckpt.to_str().unwrap(),
        "--data",
        d,
        "--samples",
        "1",
        "--out",
        out_ckpt.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(summary(&out_ckpt), got, "the final checkpoint against the exported actor");

    // Four samples each, sampled: two ranks answer as one process does.
    let actor = run.join("actor");
    let (one, two) = (dir.path().join("one.json"), dir.path().join("two.json"));
    for (out, nproc) in [(&one, None), (&two, Some("2"))] {
        let mut args =
            vec!["--model", actor.to_str().unwrap(), "--data", d, "--samples", "4", "--out", out.to_str().unwrap()];
        if let Some(n) = nproc {
            args.extend(["--nproc", n]);
        }
        let o = eval_cmd(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (one, two) = (summary(&one), summary(&two));
    assert!(one.contains_key("eval/pass@4") && one.contains_key("eval/maj@4"), "{one:?}");
    assert_eq!(one, two, "2 ranks against one process");
}

#[test]
fn rlhf_eval_bad_input_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let d = data.to_str().unwrap();
    for (args, want) in [
        (vec!["--model", "/nonexistent/model", "--data", d], "/nonexistent/model"),
        (vec!["--model", d, "--data", d], "not a model directory"),
        (vec!["--model", dir.path().to_str().unwrap(), "--data", "/nonexistent/x.jsonl"], "eval.data"),
        (vec!["--model", dir.path().to_str().unwrap(), "--data", d, "--samples", "0"], "eval.samples_per_prompt"),
    ] {
        let o = eval_cmd(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?}: accepted");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {err}");
        assert!(errors[0].contains(want), "{args:?}: {}", errors[0]);
    }
}

/// A run resumed from its step-3 checkpoint (after a kill: rows and answers past step 3 lost)
/// evaluates as the uninterrupted run does: the step-0 evaluation is not repeated, step 4 is
/// evaluated, and every row, eval keys included, equals the uninterrupted run's.
#[test]
fn a_resumed_run_continues_the_evaluation_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let set = format!("eval.data={}", data.display());
    let args = ["--set", &set, "--set", "eval.every_steps=2", "--set", "checkpoint.every=1"];
    for run in [&a, &b] {
        let o = grpo(run, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let text = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    let kept: Vec<&str> = text.lines().take(4).collect();
    std::fs::write(b.join("metrics.jsonl"), kept.join("\n") + "\n").unwrap();
    std::fs::remove_file(b.join("eval").join("step-4.jsonl")).unwrap();
    let step0 = std::fs::metadata(b.join("eval").join("step-0.jsonl")).unwrap().modified().unwrap();
    let ckpt = b.join("checkpoints").join("step-000003");
    let o = rlhf(&["train", "--resume", ckpt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = behaviour_metrics(&b);
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    assert_eq!(rows, behaviour_metrics(&a));
    let evaluated: Vec<u64> =
        rows.iter().filter(|r| r.contains_key("eval/pass@1")).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(evaluated, [0, 2, 4]);
    assert!(b.join("eval").join("step-4.jsonl").exists());
    let again = std::fs::metadata(b.join("eval").join("step-0.jsonl")).unwrap().modified().unwrap();
    assert_eq!(step0, again, "the resumed run evaluated step 0 again");
}

/// Training on 2 ranks evaluates as one process does: each rank answers a share of the held-out
/// prompts with the whole chunk's sampling noise, and the answers are gathered. (Exact while
/// the ranks' weights round as one process's do, as the training rewards are: 2 steps here.)
#[test]
fn two_ranks_evaluate_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let sets = eval_sets(&data);
    let mut rows = Vec::new();
    for (name, nproc) in [("one", None), ("two", Some("2"))] {
        let run = dir.path().join(name);
        let mut args = vec!["train", "--algo", "grpo", "--run-dir", run.to_str().unwrap(), "--set", "train.steps=2"];
        args.extend(sets.iter().map(String::as_str));
        if let Some(n) = nproc {
            args.extend(["--nproc", n]);
        }
        let o = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
            .args(&args)
            .env("OMP_NUM_THREADS", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let eval: Vec<Vec<(String, Value)>> = behaviour_metrics(&run)
            .into_iter()
            .map(|r| r.into_iter().filter(|(k, _)| k.starts_with("eval/") || k == "step").collect())
            .collect();
        rows.push(eval);
    }
    assert!(rows[0].iter().filter(|r| r.len() > 1).count() == 2, "steps 0 and 2 evaluated: {:?}", rows[0]);
    assert_eq!(rows[0], rows[1]);
}

/// A run that failed in its first step after the evaluation before training trained nothing: a
/// new run in its directory starts over (instead of refusing a dead end), and its metrics.jsonl
/// holds one step-0 row, not the failed run's as well.
#[test]
fn a_run_that_stopped_after_only_the_evaluation_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let run = dir.path().join("run");
    let set = format!("eval.data={}", data.display());
    let r = run.to_str().unwrap();
    let common = ["--set", set.as_str(), "--set", "train.steps=2", "--set", "warmup.steps=0", "--run-dir", r];
    let o = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args([&["train", "--algo", "test-bad-info"], &common[..]].concat())
        .env("RLHF_TEST_BAD_INFO", "loss-panic")
        .output()
        .unwrap();
    assert!(!o.status.success(), "the plugin's loss was meant to panic");
    let rows = behaviour_metrics(&run);
    assert_eq!(rows.len(), 1, "only the evaluation before training was logged: {rows:?}");
    assert!(rows[0]["eval/pass@1"].is_number());
    let o = rlhf(&[&["train", "--algo", "grpo"], &common[..]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let steps: Vec<u64> = behaviour_metrics(&run).iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2]);
    // A run that trained a step is still not started over.
    let o = rlhf(&[&["train", "--algo", "grpo"], &common[..]].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("already holds a run"), "{err}");
}

/// `rlhf eval` on committed Hugging Face checkpoints of three families (real byte-level BPE
/// tokenizers): the greedy answers are transformers' greedy continuations token for token (the
/// fixtures' `greedy_ids`, a batch of two left-padded prompts, as the evaluation batches them), and
/// the default rule reward scores them against the labels: the second prompt's label is the
/// decoded transformers answer, the first's is not, so pass@1 and maj@1 are 1/2 overall, 0 and 1
/// per source.
#[test]
fn rlhf_eval_on_fixture_models_answers_as_transformers_greedy() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["llama", "qwen2", "gpt2"] {
        let model = rlhf_integration_tests::model_dir(name);
        let reference = rlhf_integration_tests::read_json(&model.join("reference.json"));
        let prompts: Vec<&str> = reference["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let r: std::collections::HashMap<String, tch::Tensor> =
            tch::Tensor::read_safetensors(model.join("reference.safetensors")).unwrap().into_iter().collect();
        let prompt_len = r["input_ids"].size()[1];
        let tok = rlhf_tokenizer::HfTokenizer::from_dir(&model).unwrap();
        let eos: Vec<u32> = tok.eos_token_ids().to_vec();
        // Transformers' answer of each row: up to and with its EOS, else all 8 tokens.
        let want: Vec<Vec<u32>> = (0..2)
            .map(|row| {
                let ids = Vec::<i64>::try_from(r["greedy_ids"].get(row).narrow(0, prompt_len, 8)).unwrap();
                let ids: Vec<u32> = ids.into_iter().map(|t| t as u32).collect();
                match ids.iter().position(|t| eos.contains(t)) {
                    Some(e) => ids[..=e].to_vec(),
                    None => ids,
                }
            })
            .collect();
        let answer1 = tok.decode(&want[1], true).unwrap();
        assert!(!answer1.trim().is_empty(), "{name}");
        let data = dir.path().join(format!("{name}.jsonl"));
        let lines = [
            serde_json::json!({"prompt": prompts[0], "label": "no such answer", "data_source": "first"}),
            serde_json::json!({"prompt": prompts[1], "label": answer1.trim(), "data_source": "second"}),
        ];
        std::fs::write(&data, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
        let out = dir.path().join(format!("{name}.json"));
        let o = eval_cmd(&[
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--samples",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "eval.max_new_tokens=8",
            "--set",
            "data.max_prompt_len=64",
            "--set",
            "data.apply_chat_template=false",
            // maj@1 votes on the answer the rule scores: the whole text (the default last number
            // finds none in these answers, and an answer without one does not vote).
            "--set",
            "eval.answer=\"full\"",
        ]);
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let answers = std::fs::read_to_string(dir.path().join(format!("{name}.samples.jsonl"))).unwrap();
        let got: Vec<Vec<u32>> = answers
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["completions"][0]["ids"].clone())
            .map(|ids| serde_json::from_value(ids).unwrap())
            .collect();
        assert_eq!(got, want, "{name}: greedy answers against transformers'");
        let m = summary(&out);
        let lengths = (want[0].len() + want[1].len()) as f64 / 2.0;
        for (key, v) in [
            ("eval/pass@1", 0.5),
            ("eval/first/pass@1", 0.0),
            ("eval/second/pass@1", 1.0),
            ("eval/maj@1", 0.5),
            ("eval/prompts", 2.0),
            ("eval/length/mean", lengths),
        ] {
            assert_eq!(m[key].as_f64(), Some(v), "{name}: {key} in {m:?}");
        }
    }
}

/// `rlhf eval` checks `--out` before any work, takes a checkpoint by a relative path or copied out
/// of its run (naming the checkpoint when it cannot), and fails when the environment failed every
/// episode instead of reporting pass@1 = 0.
#[test]
fn rlhf_eval_checks_out_first_takes_checkpoints_by_any_path_and_fails_when_every_episode_failed() {
    let dir = tempfile::tempdir().unwrap();
    let data = held_out(dir.path());
    let d = data.to_str().unwrap();
    let run = dir.path().join("run");
    let o = grpo(&run, &["--set", "train.steps=2", "--set", "warmup.steps=0", "--set", "eval.data=\"\""]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = run.join("checkpoints").join("step-000002");

    // --out a directory, or under a missing directory: refused before the model loads.
    for (out, want) in
        [(dir.path().to_path_buf(), "is a directory"), (dir.path().join("no/such/out.json"), "cannot be written")]
    {
        let t = std::time::Instant::now();
        let o = eval_cmd(&["--model", ckpt.to_str().unwrap(), "--data", d, "--out", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{err}");
        assert!(!err.contains("INFO"), "work began before --out was checked: {err}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
    }
    assert!(!dir.path().join(".samples.jsonl").exists() && !dir.path().join("tmp.samples.jsonl").exists());

    // A relative path, from inside the checkpoints directory.
    let o = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["eval", "--model", "step-000002", "--data", d, "--samples", "1"])
        .current_dir(run.join("checkpoints"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Copied out of its run (a built-in model without warm-up is made again from the run's seed).
    let copy = dir.path().join("copied-ckpt");
    rlhf_integration_tests::copy_dir(&ckpt, &copy);
    let o = eval_cmd(&["--model", copy.to_str().unwrap(), "--data", d, "--samples", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A run with a warm-up: its starting weights are in its run directory only.
    let warm = dir.path().join("warm");
    let o = grpo(&warm, &["--set", "train.steps=2", "--set", "eval.data=\"\""]);
    assert!(o.status.success());
    let copy = dir.path().join("copied-warm");
    rlhf_integration_tests::copy_dir(&warm.join("checkpoints").join("step-000002"), &copy);
    let o = eval_cmd(&["--model", copy.to_str().unwrap(), "--data", d]);
    let err = String::from_utf8_lossy(&o.stderr);
    let last = err.lines().last().unwrap_or("");
    assert!(!o.status.success() && last.contains(copy.to_str().unwrap()) && last.contains("warm-up"), "{err}");

    // An environment that fails every episode: an error, not a table of zeros.
    let o = eval_cmd(&[
        "--model",
        run.join("actor").to_str().unwrap(),
        "--data",
        d,
        "--set",
        "environment.plugin=\"env-script\"",
        "--set",
        "environment.config={ fail = \"error\" }",
        "--set",
        "environment.reward=\"sum\"",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the environment failed every one of the 24 episodes"), "{err}");
}
