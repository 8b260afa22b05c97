//! The `rlhf` binary end to end: `ppl --json` and `generate --json` against transformers'
//! references, every kind of bad input giving one clear line, a non-zero exit and no panic, and a
//! smoke run of `bench`.

use std::path::Path;

use rlhf_integration_tests::{fixtures, model_dir, read_json, rlhf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Asserts a failed run whose stderr error line contains every `needle`.
fn assert_clean_failure(out: &std::process::Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let line = stderr.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line: {stderr}"));
    for n in needles {
        assert!(line.contains(n), "error line {line:?} lacks {n:?}");
    }
}

#[test]
fn ppl_json_matches_transformers() {
    for name in ["llama", "llama-tied", "qwen2", "gpt2"] {
        let dir = model_dir(name);
        let out = rlhf(&["ppl", "--model", s(&dir), "--data", s(&fixtures().join("ppl.jsonl")), "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let got: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let keys: Vec<&String> = got.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["nll", "ppl", "tokens"], "exactly these keys");
        let want = read_json(&dir.join("reference.json"));
        assert_eq!(got["tokens"], want["tokens"], "{name}");
        let (g, w) = (got["ppl"].as_f64().unwrap(), want["ppl"].as_f64().unwrap());
        assert!(((g - w) / w).abs() < 1e-4, "{name}: {g} vs {w}");
    }
}

#[test]
fn generate_greedy_matches_transformers() {
    let dir = model_dir("llama");
    let reference = read_json(&dir.join("reference.json"));
    let prompts: Vec<&str> = reference["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    let r: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect();
    let expected = Vec::<i64>::try_from(r["greedy_single"].get(0)).unwrap();
    let out = rlhf(&["generate", "--model", s(&dir), "--prompt", prompts[0], "--max-new-tokens", "8", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    let ids: Vec<i64> = line["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .chain(line["response_ids"].as_array().unwrap())
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(ids, expected);

    // Sampling is seedable: the same seed gives the same text, in a batch of two prompts.
    let sample = |seed: &str| {
        let out = rlhf(&[
            "generate",
            "--model",
            s(&dir),
            "--prompt",
            prompts[0],
            "--prompt",
            prompts[1],
            "--chat",
            "--temperature",
            "1.0",
            "--top-p",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            seed,
            "--max-new-tokens",
            "12",
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    assert_eq!(sample("7"), sample("7"));
    // One JSON line per prompt (a response may hold newlines of its own).
    assert_eq!(sample("7").lines().count(), 2);
    assert_ne!(sample("7"), sample("8"));
}

/// Copies a fixture model into a temp dir so a test can break it.
fn broken_copy(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn ppl_on(dir: &Path) -> std::process::Output {
    rlhf(&["ppl", "--model", s(dir), "--data", s(&fixtures().join("ppl.jsonl"))])
}

#[test]
fn bad_models_give_one_clear_line() {
    let out = rlhf(&["ppl", "--model", "/nonexistent/model", "--data", s(&fixtures().join("ppl.jsonl"))]);
    assert_clean_failure(&out, &["/nonexistent/model"]);

    let d = broken_copy("llama");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["config.json", "not found"]);

    let d = broken_copy("llama");
    std::fs::write(d.path().join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["config.json", "invalid JSON"]);

    let d = broken_copy("llama");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap().replace("\"llama\"", "\"bert\"");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["config.json", "model_type", "bert"]);

    let d = broken_copy("llama");
    let cfg = std::fs::read_to_string(d.path().join("config.json"))
        .unwrap()
        .replace("\"hidden_size\": 32", "\"hidden_size\": \"32\"");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["config.json", "hidden_size", "invalid type"]);

    // A mis-shaped tensor: claim a larger vocabulary than the embedding has.
    let d = broken_copy("llama");
    let cfg = std::fs::read_to_string(d.path().join("config.json"))
        .unwrap()
        .replace("\"vocab_size\": 400", "\"vocab_size\": 401");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    assert_clean_failure(
        &ppl_on(d.path()),
        &["model.safetensors", "model.embed_tokens.weight", "[400, 32]", "[401, 32]"],
    );

    // A missing tensor: the config says untied, but the checkpoint is a tied one without lm_head.
    let d = broken_copy("qwen2");
    let cfg = std::fs::read_to_string(d.path().join("config.json"))
        .unwrap()
        .replace("\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["missing tensor `lm_head.weight`", "model.safetensors"]);

    let d = broken_copy("llama");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["model.safetensors", "not found"]);

    let d = broken_copy("llama");
    std::fs::write(d.path().join("model.safetensors"), b"garbage").unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["model.safetensors", "invalid safetensors"]);

    let d = broken_copy("llama-tied");
    std::fs::remove_file(d.path().join("model-00002-of-00004.safetensors")).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["model-00002-of-00004.safetensors", "not found"]);

    let d = broken_copy("llama");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    assert_clean_failure(&ppl_on(d.path()), &["tokenizer.json"]);
}

#[test]
fn bad_data_gives_one_clear_line() {
    let model = model_dir("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str, &[&str])] = &[
        ("empty.jsonl", "", &["empty.jsonl", "no data"]),
        ("blank.jsonl", "\n\n", &["blank.jsonl", "no data"]),
        ("notjson.jsonl", "{\"text\": \"a\"}\nnot json\n", &["notjson.jsonl:2", "not valid JSON"]),
        ("nokey.jsonl", "{\"txt\": \"a\"}\n", &["nokey.jsonl:1", "text"]),
        ("badtype.jsonl", "{\"text\": 5}\n", &["badtype.jsonl:1", "text", "string"]),
        ("short.jsonl", "{\"text\": \"a\"}\n", &["short.jsonl", "nothing to predict"]),
    ];
    for (file, content, needles) in cases {
        let path = tmp.path().join(file);
        std::fs::write(&path, content).unwrap();
        let out = rlhf(&["ppl", "--model", s(&model), "--data", s(&path)]);
        assert_clean_failure(&out, needles);
    }
    let out = rlhf(&["ppl", "--model", s(&model), "--data", "/nonexistent.jsonl"]);
    assert_clean_failure(&out, &["/nonexistent.jsonl"]);
    let out = rlhf(&["generate", "--model", s(&model), "--prompt", "hi", "--device", "cuda:zero"]);
    assert_clean_failure(&out, &["device `cuda:zero`"]);
    // Sampling settings are checked before the model loads, greedy or not, under their flags' names.
    for (bad, needle) in [("--top-p=2", "--top-p 2: must be in (0, 1]"), ("--top-k=-1", "--top-k -1: must be >= 0")] {
        for t in ["0", "1"] {
            let out = rlhf(&["generate", "--model", "/nonexistent", "--prompt", "hi", "--temperature", t, bad]);
            assert_clean_failure(&out, &[needle]);
        }
    }
    let out = rlhf(&["generate", "--model", "/nonexistent", "--prompt", "hi", "--max-new-tokens", "0"]);
    assert_clean_failure(&out, &["--max-new-tokens 0: must be >= 1"]);
    let out = rlhf(&["generate", "--model", s(&model_dir("gpt2")), "--prompt", &"word ".repeat(200)]);
    assert_clean_failure(&out, &["n_positions"]);
}

/// `rlhf bench` end to end on the built-in tiny model at the smallest sizes, in f32 and bf16 (the
/// trainer's AdamW on bf16 weights, through its f32 masters): every section reports positive
/// figures, the RL step has its phases, and `--no-record` writes nothing; in f32, `--profile`
/// writes the gen, train and rl sections' traces and prints their longest operators.
#[test]
fn bench_smoke() {
    let traces = tempfile::tempdir().unwrap();
    for dtype in ["f32", "bf16"] {
        let cwd = tempfile::tempdir().unwrap();
        #[rustfmt::skip]
        let mut args = vec![
            "bench", "--model", "builtin:tiny", "--dtype", dtype, "--batch", "1", "--group", "2",
            "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1", "--no-record", "--json",
        ];
        if dtype == "f32" {
            args.extend(["--profile", s(traces.path())]);
        }
        let out = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
            .args(&args)
            .current_dir(cwd.path())
            .output()
            .expect("spawn rlhf");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && !stderr.contains("panicked"), "{dtype}: {stdout}\n{stderr}");
        for section in ["gen:", "train:", "rl:"] {
            assert!(stdout.lines().any(|l| l.starts_with(section)), "{dtype}: no `{section}` line in {stdout}");
        }
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON: {stdout}"));
        let j: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!((j["dtype"].as_str(), j["batch"].as_i64(), j["group"].as_i64()), (Some(dtype), Some(1), Some(2)));
        let positive = |ptr: &str| {
            let x = j.pointer(ptr).and_then(|v| v.as_f64()).unwrap_or_else(|| panic!("{dtype}: no {ptr} in {line}"));
            assert!(x.is_finite() && x > 0.0, "{dtype}: {ptr} = {x}");
            x
        };
        positive("/gen/tokens_per_s");
        positive("/train/tokens_per_s");
        positive("/train/step_s");
        let step = positive("/rl/figures/step_s");
        let phases: f64 = ["generate", "score", "old_logprobs", "reference", "train"]
            .iter()
            .map(|p| positive(&format!("/rl/figures/{p}")))
            .sum();
        assert!(phases <= step * 1.01, "{dtype}: phases {phases} s in a {step} s step");
        positive("/rl/mean_completion_length");
        assert!(std::fs::read_dir(cwd.path()).unwrap().next().is_none(), "{dtype}: --no-record wrote a file");
        if dtype == "f32" {
            for section in ["gen", "train", "rl"] {
                let trace = std::fs::read_to_string(traces.path().join(format!("{section}.json"))).unwrap();
                let trace: serde_json::Value = serde_json::from_str(&trace).expect("a JSON trace");
                assert!(trace["traceEvents"].as_array().is_some_and(|e| e.iter().any(|e| e["name"] == "aten::mm")));
                let head = format!("profile {section}: ");
                let at = stdout.lines().position(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("{stdout}"));
                // A row: share of the wall time, milliseconds, count, name.
                let row = stdout.lines().nth(at + 1).unwrap_or_default();
                assert!(row.contains(" % ") && row.contains(" ms ") && row.contains("× "), "{stdout}");
            }
        }
    }
}

/// `rlhf bench --image-size`: the RL section on the built-in visual task's scenes drawn at that
/// size, every prompt's image tokens counted in its length; a model that reads no images, or a
/// prompts file beside the drawn task, is refused in one line.
#[test]
fn bench_runs_a_grpo_step_with_an_image_per_prompt() {
    let bench = |extra: &[&str]| {
        let cwd = tempfile::tempdir().unwrap();
        #[rustfmt::skip]
        let args = [
            "bench", "--only", "rl", "--batch", "2", "--group", "2", "--new-tokens", "4", "--repeats", "1",
            "--no-record", "--json",
        ];
        std::process::Command::new(rlhf_integration_tests::rlhf_bin())
            .args(args)
            .args(extra)
            .current_dir(cwd.path())
            .output()
            .expect("spawn rlhf")
    };
    let out = bench(&["--model", "builtin:tiny-qwen2.5-vl", "--image-size", "112"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // 112 pixels: 8 × 8 patches of 14, 16 image tokens, the vision start and end, 5 or 6 words.
    let rl = stdout.lines().find(|l| l.contains("prompts builtin:shapes-train at 112 x 112 pixels")).unwrap_or("");
    let mean: f64 = rl.rsplit("(mean ").next().and_then(|m| m.split(' ').next()).and_then(|m| m.parse().ok()).unwrap();
    assert!((23.0..=24.0).contains(&mean), "{rl}");
    for (extra, want) in [
        (vec!["--model", "builtin:tiny", "--image-size", "112"], "--image-size 112: the model reads no images"),
        (
            vec!["--model", "builtin:tiny-qwen2.5-vl", "--image-size", "112", "--prompts", "p.jsonl"],
            "leave out --prompts",
        ),
    ] {
        let out = bench(&extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(want) && !stderr.contains("panicked"), "{stderr}");
    }
}
