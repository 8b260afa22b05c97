//! The supervised phases end to end through the `rlhf` binary: `rlhf sft` lowers held-out
//! perplexity and writes metrics and checkpoints; `rlhf rm` separates a separable preference set;
//! the checkpoints both write load in transformers with the same logits / score; bad input lines
//! are counted per kind with the first line named, an all-bad file is an error naming it, and a bad
//! config key is a one-line error. (The DSC loss and the label masking have hand-computed unit tests
//! in `rlhf-trainer`: `pairs::tests`, `sft_data::tests`.)

use std::path::Path;
use std::process::Output;

use rlhf_integration_tests::{hf_check, metrics, model_dir, python, read_json, rlhf};
use rlhf_models::{CausalLm, ScalarHeadModel};
use tch::{Device, Kind, Tensor};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "rlhf failed:\n{}\n{}", String::from_utf8_lossy(&o.stdout), stderr(o));
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn error_line(o: &Output) -> String {
    assert!(!o.status.success(), "expected a failure: {}", String::from_utf8_lossy(&o.stdout));
    let e = stderr(o);
    assert!(!e.contains("panicked"), "rlhf panicked: {e}");
    e.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {e}")).to_string()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// `[1, n]` ids and the comma list `hf_check.py logits` takes.
fn ids(v: &[i64]) -> (Tensor, String) {
    (Tensor::from_slice(v).view([1, -1]), v.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
}

#[test]
fn sft_lowers_held_out_perplexity_and_writes_metrics_and_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("sft");
    let o = rlhf(&[
        "sft",
        "--run-dir",
        s(&rd),
        "--set",
        "train.epochs=8",
        "--set",
        "checkpoint.every=10",
        "--set",
        "checkpoint.keep=100",
        "--set",
        "train.eval_every=10",
    ]);
    let out = ok(&o);
    let summary = read_json(&rd.join("summary.json"));
    let (before, after) = (summary["eval_ppl_before"].as_f64().unwrap(), summary["eval_ppl_after"].as_f64().unwrap());
    println!("builtin:addition-sft held-out ppl {before:.3} -> {after:.3}");
    assert!(after < before * 0.5, "perplexity {before} -> {after}");
    assert!(out.contains("eval perplexity: before") && out.contains(s(&rd.join("model"))), "{out}");
    let lines = metrics(&rd);
    assert_eq!(lines[0]["step"], 0);
    assert!(lines[0]["eval/ppl"].is_number());
    let steps = summary["steps"].as_u64().unwrap() as usize;
    assert_eq!(lines.len(), steps + 1, "one line per step after the step-0 eval");
    for l in &lines[1..] {
        for key in ["loss", "lr", "grad_norm", "tokens_per_s", "epoch"] {
            assert!(l[key].is_number(), "{key} missing in {l}");
        }
    }
    assert!(lines[10]["eval/ppl"].is_number() && lines[steps]["eval/ppl"].is_number());
    assert!(lines[5].get("eval/ppl").is_none());
    let ckpt = rd.join("checkpoints/step-000010");
    assert!(ckpt.join("manifest.json").is_file() && ckpt.join("model.safetensors").is_file(), "a resumable checkpoint");
    assert!(rd.join("model/model.safetensors").is_file() && rd.join("model/tokenizer.json").is_file());
    assert!(rd.join("config.toml").is_file());
    for chart in ["loss.png", "eval.png", "throughput.png"] {
        assert!(rd.join("plots").join(chart).is_file(), "a finished SFT run charts its metrics: {chart}");
    }
}

/// A few chat and prompt/response lines for the fixture Llama (ChatML template, byte-level BPE).
fn chat_data(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                serde_json::json!({"messages": [
                    {"role": "user", "content": format!("count to {}", i % 5)},
                    {"role": "assistant", "content": format!("{} and done", "one two three".repeat(1 + i % 3))},
                ]})
            } else {
                serde_json::json!({"prompt": format!("say hello {i}"), "response": "hello hello"})
            }
            .to_string()
        })
        .collect()
}

#[test]
fn sft_checkpoint_of_a_chat_model_loads_in_transformers_with_the_same_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("chat.jsonl");
    write_lines(&data, &chat_data(24));
    let rd = tmp.path().join("sft");
    let o = rlhf(&[
        "sft",
        "--run-dir",
        s(&rd),
        "--set",
        &format!("model.path={:?}", s(&model_dir("llama"))),
        "--set",
        &format!("data.train={:?}", s(&data)),
        "--set",
        "data.eval_fraction=0.25",
        "--set",
        "data.max_len=128",
        "--set",
        "data.packing=true",
        "--set",
        "train.epochs=4",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.gradient_accumulation_steps=2",
        "--set",
        "train.lr=1e-2",
    ]);
    ok(&o);
    let summary = read_json(&rd.join("summary.json"));
    let (before, after) = (summary["eval_ppl_before"].as_f64().unwrap(), summary["eval_ppl_after"].as_f64().unwrap());
    println!("fixture llama, chat SFT with packing: held-out ppl {before:.3} -> {after:.3}");
    assert!(after < before, "perplexity {before} -> {after}");
    assert!(stderr(&o).contains("packing: 18 examples into"), "{}", stderr(&o));

    let Some(py) = python() else { return };
    let saved = rd.join("model");
    let model = CausalLm::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
    let (x, ids_s) = ids(&[5, 77, 120, 3, 250, 9, 18, 301, 44, 60]);
    let ours = tch::no_grad(|| model.forward(&x, &x.ones_like())).unwrap().squeeze_dim(0);
    let original = CausalLm::from_dir(&model_dir("llama"), Device::Cpu, Kind::Float).unwrap();
    let orig = tch::no_grad(|| original.forward(&x, &x.ones_like())).unwrap().squeeze_dim(0);
    assert!((&ours - &orig).abs().max().double_value(&[]) > 1e-3, "training changed the weights");
    let theirs = hf_check(&py, &["logits", "--model", s(&saved), "--ids", &ids_s]);
    let rows: Vec<Vec<f32>> = serde_json::from_value(theirs["logits"].clone()).unwrap();
    let theirs = Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1]);
    let diff = (&ours - &theirs).abs().max().double_value(&[]);
    println!("SFT checkpoint in transformers: max |Δlogit| = {diff:.2e}");
    assert!(diff <= 1e-4, "{diff}");
}

/// Separable pairs for the built-in vocabulary: the chosen answer starts with "the answer is", the
/// rejected one is digits and symbols, from as short as the chosen to 12 tokens longer (so that a
/// padding-free pass packs two short rows into one).
fn separable_pairs(n: usize, offset: usize) -> Vec<String> {
    (0..n)
        .map(|k| {
            let i = k + offset;
            let (a, b) = (i % 10, (i / 10) % 10);
            serde_json::json!({
                "prompt": format!("{a} + {b} ="),
                "chosen": format!(" the answer is {}", (a * 3 + b) % 10),
                "rejected": format!(" {} + {} ={}", (a + 7) % 10, (b * 7 + 1) % 10, " =".repeat(i % 13)),
            })
            .to_string()
        })
        .collect()
}

#[test]
fn rm_separates_a_separable_set_and_loads_in_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = (tmp.path().join("train.jsonl"), tmp.path().join("eval.jsonl"));
    write_lines(&train, &separable_pairs(64, 0));
    write_lines(&eval, &separable_pairs(20, 64));
    // One run dir per loss (a run dir that holds a run is refused); the last-token one's model is
    // checked, and its padding-free run trains the same within float rounding.
    let rd_of = |loss: &str| tmp.path().join(format!("rm-{loss}"));
    for loss in ["dsc", "last_token", "last_token-padding-free"] {
        let rd = rd_of(loss);
        let padding_free = format!("train.padding_free={}", loss.ends_with("padding-free"));
        let loss = loss.trim_end_matches("-padding-free");
        let o = rlhf(&[
            "rm",
            "--run-dir",
            s(&rd),
            "--set",
            &format!("data.train={:?}", s(&train)),
            "--set",
            &format!("data.eval={:?}", s(&eval)),
            "--set",
            &format!("train.loss={loss:?}"),
            "--set",
            "train.epochs=3",
            "--set",
            &padding_free,
        ]);
        let out = ok(&o);
        let summary = read_json(&rd.join("summary.json"));
        let acc = summary["eval_accuracy_after"].as_f64().unwrap();
        let (c, r) = (summary["eval_chosen_score"].as_f64().unwrap(), summary["eval_rejected_score"].as_f64().unwrap());
        println!("{loss}: separable set, eval accuracy {acc:.3} (chosen {c:.3}, rejected {r:.3})");
        assert!(acc > 0.9 && c > r, "{loss}: accuracy {acc}, scores {c} vs {r}");
        assert!(out.contains("eval accuracy: before") && out.contains("eval scores: chosen"), "{out}");
        let last = metrics(&rd).pop().unwrap();
        for key in ["loss", "lr", "tokens_per_s", "eval/accuracy", "eval/chosen_score", "eval/rejected_score"] {
            assert!(last[key].is_number(), "{key} missing in {last}");
        }
    }

    let (padded, packed) = (metrics(&rd_of("last_token")), metrics(&rd_of("last_token-padding-free")));
    assert_eq!(padded.len(), packed.len());
    for (a, b) in padded.iter().zip(&packed) {
        for key in ["loss", "train/accuracy", "eval/loss", "eval/accuracy", "eval/chosen_score"] {
            if let (Some(x), Some(y)) = (a[key].as_f64(), b[key].as_f64()) {
                assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{key}: padded {x}, padding-free {y}");
            }
        }
    }

    // The saved reward model: *ForSequenceClassification, the same score in transformers.
    let rd = rd_of("last_token");
    let saved = rd.join("model");
    let config = read_json(&saved.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");
    let Some(py) = python() else { return };
    let rm = ScalarHeadModel::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
    for seq in [vec![6i64, 13, 7, 14, 15, 16, 17, 10], vec![3, 13, 4, 14, 5, 13, 6, 14]] {
        let (x, ids_s) = ids(&seq);
        let ours = tch::no_grad(|| rm.scores(&x, &x.ones_like())).unwrap().double_value(&[0]);
        let theirs = hf_check(&py, &["logits", "--model", s(&saved), "--ids", &ids_s])["score"].as_f64().unwrap();
        println!("RM checkpoint: score ours {ours:.6}, transformers {theirs:.6}");
        assert!((ours - theirs).abs() <= 1e-4, "{ours} vs {theirs}");
    }
}

#[test]
fn lora_runs_save_merged_plain_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = ["--set", "model.lora.rank=4", "--set", "model.lora.target_modules=[\"all-linear\"]"];
    let sft = tmp.path().join("sft");
    let o = rlhf(&[&["sft", "--run-dir", s(&sft), "--set", "train.epochs=6"], &lora[..]].concat());
    ok(&o);
    assert!(stderr(&o).contains("LoRA:") && stderr(&o).contains("parameters train"), "{}", stderr(&o));
    let summary = read_json(&sft.join("summary.json"));
    let (before, after) = (summary["eval_ppl_before"].as_f64().unwrap(), summary["eval_ppl_after"].as_f64().unwrap());
    println!("LoRA SFT: held-out ppl {before:.3} -> {after:.3}");
    assert!(after < before, "{before} -> {after}");
    let rm = tmp.path().join("rm");
    let model = format!("model.path={:?}", s(&sft.join("model")));
    ok(&rlhf(&[&["rm", "--run-dir", s(&rm), "--set", &model, "--set", "train.steps=3"], &lora[..]].concat()));
    for dir in [sft.join("model"), rm.join("model")] {
        let names: Vec<String> =
            Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
        assert!(names.iter().all(|n| !n.contains("lora")), "{dir:?}: {names:?}");
    }
    ScalarHeadModel::from_dir(&rm.join("model"), Device::Cpu, Kind::Float).unwrap();
}

#[test]
fn bad_lines_are_counted_per_kind_naming_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let sft = tmp.path().join("sft.jsonl");
    let good = r#"{"prompt": "1 + 2 =", "response": "3"}"#;
    let long = format!(r#"{{"prompt": "1 + 2 =", "response": "{}"}}"#, "3 ".repeat(20));
    write_lines(
        &sft,
        &[
            good.into(),
            "not json".into(),
            r#"{"prompt": "1 + 2 ="}"#.into(),
            good.into(),
            r#"{"prompt": "1 + 2 =", "response": ""}"#.into(),
            long.clone(),
            "[1, 2]".into(),
            r#"{"response": "3"}"#.into(),
            long,
            "{\"prompt\": ".into(),
        ],
    );
    // Each run gets its own run dir (a run dir that holds a run is refused).
    let runs = std::cell::Cell::new(0);
    let base = |data: &Path| -> Vec<String> {
        runs.set(runs.get() + 1);
        let rd = tmp.path().join(format!("r{}", runs.get()));
        ["--run-dir", s(&rd), "--set", &format!("data.train={:?}", s(data)), "--set", "train.steps=1"]
            .iter()
            .map(|x| x.to_string())
            .collect()
    };
    let run = |cmd: &str, data: &Path, extra: &[&str]| {
        let mut args = vec![cmd.to_string()];
        args.extend(base(data));
        args.extend(extra.iter().map(|x| x.to_string()));
        rlhf(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run("sft", &sft, &["--set", "data.max_len=12"]);
    ok(&o);
    let e = stderr(&o);
    let f = s(&sft);
    for want in [
        format!("{f}: skipped 2 lines (not valid JSON), first at line 2"),
        format!("{f}: skipped 1 line (missing field `response`), first at line 3"),
        format!("{f}: skipped 1 line (empty response), first at line 5"),
        format!("{f}: truncated 2 lines (longer than max_len = 12 tokens), first at line 6"),
        format!("{f}: skipped 1 line (not a JSON object), first at line 7"),
        format!("{f}: skipped 1 line (missing field `prompt`), first at line 8"),
    ] {
        assert!(e.contains(&want), "missing `{want}` in:\n{e}");
    }
    let o = run("sft", &sft, &["--set", "data.max_len=12", "--set", "data.overlong=\"drop\""]);
    ok(&o);
    assert!(stderr(&o).contains(&format!("{f}: skipped 2 lines (longer than max_len = 12 tokens), first at line 6")));

    let pairs = tmp.path().join("pairs.jsonl");
    let good = r#"{"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 4"}"#;
    write_lines(
        &pairs,
        &[
            good.into(),
            r#"{"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 3"}"#.into(),
            r#"{"prompt": "1 + 2 =", "chosen": " 3"}"#.into(),
            "nope".into(),
            r#"{"prompt": "1 + 2 =", "chosen": " ", "rejected": " 4"}"#.into(),
            r#"{"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 3"}"#.into(),
            good.into(),
        ],
    );
    let o = run("rm", &pairs, &[]);
    ok(&o);
    let e = stderr(&o);
    let f = s(&pairs);
    for want in [
        format!("{f}: skipped 2 lines (chosen == rejected), first at line 2"),
        format!("{f}: skipped 1 line (missing field `rejected`), first at line 3"),
        format!("{f}: skipped 1 line (not valid JSON), first at line 4"),
        format!("{f}: skipped 1 line (empty response), first at line 5"),
    ] {
        assert!(e.contains(&want), "missing `{want}` in:\n{e}");
    }

    // An all-bad file is an error naming the file; so is an empty one.
    let bad = tmp.path().join("bad.jsonl");
    write_lines(&bad, &[r#"{"prompt": "1 + 2 =", "chosen": " 3", "rejected": " 3"}"#.into(), "x".into()]);
    let e = error_line(&run("rm", &bad, &[]));
    assert!(e.contains(s(&bad)) && e.contains("no usable examples") && e.contains("chosen == rejected"), "{e}");
    let e = error_line(&run("sft", &bad, &[]));
    assert!(e.contains(s(&bad)) && e.contains("no usable examples"), "{e}");
    std::fs::write(&bad, "\n").unwrap();
    let e = error_line(&run("sft", &bad, &[]));
    assert!(e.contains(s(&bad)) && e.contains("the file has no lines"), "{e}");
    let e = error_line(&run("sft", &tmp.path().join("missing.jsonl"), &[]));
    assert!(e.contains("data.train") && e.contains("missing.jsonl: file not found"), "{e}");
}

#[test]
fn config_errors_name_the_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("sft.toml");
    std::fs::write(&cfg, "[train]\nlr = \"fast\"\n").unwrap();
    let rd = tmp.path().join("r");
    let e = error_line(&rlhf(&["sft", "--config", s(&cfg), "--run-dir", s(&rd)]));
    assert!(e.contains("sft.toml") && e.contains("train.lr") && e.contains("invalid type"), "{e}");
    std::fs::write(&cfg, "[data]\npacking = true\nshuffle = false\n").unwrap();
    let e = error_line(&rlhf(&["sft", "--config", s(&cfg), "--run-dir", s(&rd)]));
    assert!(e.contains("sft.toml") && e.contains("shuffle") && e.contains("unknown field"), "{e}");
    let e = error_line(&rlhf(&["rm", "--set", "train.loss=\"hinge\"", "--run-dir", s(&rd)]));
    assert!(e.contains("train.loss") && e.contains("hinge"), "{e}");
    let e = error_line(&rlhf(&["rm", "--set", "train.batch_size=0", "--run-dir", s(&rd)]));
    assert!(e.contains("train.batch_size: must be >= 1"), "{e}");
    let e = error_line(&rlhf(&["sft", "--set", "model.path=\"/nonexistent/model\"", "--run-dir", s(&rd)]));
    assert!(e.contains("model.path") && e.contains("/nonexistent/model"), "{e}");
}
