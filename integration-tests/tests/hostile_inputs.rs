//! Inputs from a hostile sweep, through the `rlhf` binary: model directories whose contents do not
//! fit together (tokenizer ids beyond the embedding, a zero rope factor, NaN weights, tensors the
//! config does not use, integer weights, a negative eos id, a truncated tokenizer.json), bad flags
//! and settings, plugin directories, data paths and resumes. Each must give one clear error line
//! naming the file, key or value, a non-zero exit and no panic or libtorch backtrace.

use std::path::{Path, PathBuf};
use std::process::Output;

use rlhf_integration_tests::{model_dir, rlhf, rlhf_bin};
use serde_json::{json, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The single `error: ` line of a failed run that holds every needle.
fn assert_clean_failure(out: &Output, needles: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    for bad in ["panicked", "Exception raised from", "frame #"] {
        assert!(!stderr.contains(bad), "{bad}: {stderr}");
    }
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "one error line: {stderr}");
    for n in needles {
        assert!(errors[0].contains(n), "error line {:?} lacks {n:?}", errors[0]);
    }
    errors[0].to_string()
}

/// A copy of the `llama` fixture in a temp dir, to break.
fn llama_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir("llama")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    rlhf(&[&["generate", "--model", s(model), "--prompt", "hello world", "--max-new-tokens", "4"], extra].concat())
}

/// One small GRPO step with `model` as the actor.
fn train(model: &Path, run_dir: &Path) -> Output {
    #[rustfmt::skip]
    let args = [
        "train", "--algo", "grpo", "--run-dir", s(run_dir),
        "--set", &format!("model.actor={:?}", s(model)),
        "--set", "train.steps=1", "--set", "warmup.steps=0",
        "--set", "rollout.prompts_per_batch=2", "--set", "rollout.samples_per_prompt=2",
        "--set", "train.minibatch_size=4",
    ];
    rlhf(&args)
}

#[test]
fn tokenizer_ids_beyond_the_embedding_are_refused_at_load() {
    let d = llama_copy();
    let vocab = 400;
    edit_json(&d.path().join("tokenizer.json"), |t| {
        t["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": vocab, "content": "<|beyond|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    });
    let tok = d.path().join("tokenizer.json");
    let needles = [s(&tok), "token \"<|beyond|>\" has id 4", "vocab_size (config.json) is 400"];
    let out = rlhf(&["generate", "--model", s(d.path()), "--prompt", "hello <|beyond|>", "--max-new-tokens", "2"]);
    assert_clean_failure(&out, &needles);
    let run = tempfile::tempdir().unwrap();
    assert_clean_failure(&train(d.path(), &run.path().join("r")), &needles);
}

#[test]
fn a_zero_rope_factor_is_refused() {
    let d = llama_copy();
    edit_json(&d.path().join("config.json"), |c| c["rope_parameters"]["factor"] = json!(0.0));
    let config = d.path().join("config.json");
    let needles = [s(&config), "rope_parameters.factor", "must be a positive number, got 0"];
    assert_clean_failure(&generate(d.path(), &[]), &needles);
    let run = tempfile::tempdir().unwrap();
    assert_clean_failure(&train(d.path(), &run.path().join("r")), &needles);
}

#[test]
fn nan_weights_are_a_clear_error_in_generation() {
    let d = llama_copy();
    let path = d.path().join("model.safetensors");
    let tensors: Vec<(String, tch::Tensor)> = tch::Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(name, t)| if name == "model.norm.weight" { (name, t.full_like(f64::NAN)) } else { (name, t) })
        .collect();
    tch::Tensor::write_safetensors(&tensors, &path).unwrap();
    for extra in [&[][..], &["--temperature", "1", "--seed", "1"][..]] {
        assert_clean_failure(&generate(d.path(), extra), &[s(d.path()), "non-finite logits"]);
    }
    let run = tempfile::tempdir().unwrap();
    assert_clean_failure(&train(d.path(), &run.path().join("r")), &[s(d.path()), "non-finite logits"]);
}

#[test]
fn bad_temperatures_are_refused_and_zero_stays_greedy() {
    let model = model_dir("llama");
    for t in ["-1", "nan", "inf"] {
        assert_clean_failure(&generate(&model, &[&format!("--temperature={t}")]), &["--temperature", "(0 = greedy)"]);
    }
    let out = generate(&model, &["--temperature", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn files_that_are_directories_or_not_tokenizers_say_so_once() {
    // An OS error is printed once, not once per error in the chain.
    let d = llama_copy();
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    std::fs::create_dir(d.path().join("tokenizer.json")).unwrap();
    let line = assert_clean_failure(&generate(d.path(), &[]), &["tokenizer.json", "Is a directory"]);
    assert_eq!(line.matches("Is a directory").count(), 1, "{line}");

    let d = llama_copy();
    std::fs::write(d.path().join("tokenizer.json"), r#"{"foo": 1}"#).unwrap();
    let line = assert_clean_failure(&generate(d.path(), &[]), &["tokenizer.json: not a tokenizer.json", "`model`"]);
    assert!(!line.contains("invalid JSON"), "{line}");

    // A directory given as data.
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let out = rlhf(&[
        "train",
        "--algo",
        "grpo",
        "--run-dir",
        s(&tmp.path().join("r")),
        "--set",
        &format!("data.prompts={:?}", s(&data)),
    ]);
    assert_clean_failure(&out, &[s(&data), "is a directory with no Parquet files"]);
    let out = rlhf(&["sft", "--run-dir", s(&tmp.path().join("s")), "--set", &format!("data.train={:?}", s(&data))]);
    assert_clean_failure(&out, &["data.train", s(&data), "is a directory with no Parquet files"]);

    // A UTF-8 byte order mark (some Windows editors write one) is named, in RL and SFT data.
    let bom = tmp.path().join("bom.jsonl");
    std::fs::write(&bom, "\u{feff}{\"prompt\": \"1 + 1 =\", \"response\": \"2\", \"label\": \"2\"}\n").unwrap();
    let prompts = format!("data.prompts={:?}", s(&bom));
    let out = rlhf(&["train", "--algo", "grpo", "--run-dir", s(&tmp.path().join("b")), "--set", &prompts]);
    assert_clean_failure(&out, &[s(&bom), "line 1: starts with a UTF-8 byte order mark"]);
    let out = rlhf(&["sft", "--run-dir", s(&tmp.path().join("c")), "--set", &format!("data.train={:?}", s(&bom))]);
    assert_clean_failure(&out, &["bom.jsonl", "byte order mark"]);
}

#[test]
fn an_empty_plugin_dir_names_the_directories_and_the_refused_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("plugins");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("libbogus.so"), b"not a shared library").unwrap();
    let out = rlhf(&[
        "train",
        "--algo",
        "grpo",
        "--run-dir",
        s(&tmp.path().join("r")),
        "--set",
        &format!("plugin_dirs=[{:?}]", s(&dir)),
    ]);
    assert_clean_failure(&out, &["unknown --algo `grpo`", "available: (none)", s(&dir), "libbogus.so:"]);
}

#[test]
fn resuming_with_fewer_steps_than_the_checkpoint_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("r");
    #[rustfmt::skip]
    let out = rlhf(&[
        "train", "--algo", "grpo", "--run-dir", s(&run), "--set", "train.steps=2", "--set", "warmup.steps=0",
        "--set", "rollout.prompts_per_batch=2", "--set", "rollout.samples_per_prompt=2",
        "--set", "train.minibatch_size=4", "--set", "checkpoint.every=2",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ckpt: PathBuf = run.join("checkpoints/step-000002");
    assert!(ckpt.join("manifest.json").is_file());
    let out = rlhf(&["train", "--resume", s(&ckpt), "--set", "train.steps=1"]);
    assert_clean_failure(&out, &["train.steps = 1", "the checkpoint is at step 2", s(&ckpt)]);
    assert!(rlhf_bin().is_file());
}

/// A config of 1 layer on the 2-layer checkpoint loads nothing silently: the tensors it would not
/// use are named. So are an integer weight, two rope blocks that differ, an `eos_token_id` of -1,
/// and an eos id beyond the embedding (blamed on the file that names it).
#[test]
fn weights_and_ids_that_do_not_fit_the_config_are_refused() {
    let d = llama_copy();
    edit_json(&d.path().join("config.json"), |c| c["num_hidden_layers"] = json!(1));
    let weights = d.path().join("model.safetensors");
    assert_clean_failure(&generate(d.path(), &[]), &[s(&weights), "the model does not use", "`model.layers.1."]);

    let d = llama_copy();
    let path = d.path().join("model.safetensors");
    let tensors: Vec<(String, tch::Tensor)> = tch::Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| if n == "model.norm.weight" { (n, t.to_kind(tch::Kind::Int64)) } else { (n, t) })
        .collect();
    tch::Tensor::write_safetensors(&tensors, &path).unwrap();
    assert_clean_failure(&generate(d.path(), &[]), &[s(&path), "`model.norm.weight`", "Int64"]);

    let d = llama_copy();
    edit_json(&d.path().join("config.json"), |c| c["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0}));
    assert_clean_failure(&generate(d.path(), &[]), &["config.json", "rope_parameters", "differ"]);

    for (eos, needle) in [
        (json!(-1), "eos_token_id: expected a token id >= 0"),
        (json!(1_000_000_000), "eos_token_id has id 1000000000"),
    ] {
        let d = llama_copy();
        edit_json(&d.path().join("generation_config.json"), |g| g["eos_token_id"] = eos.clone());
        let line =
            assert_clean_failure(&generate(d.path(), &[]), &[s(&d.path().join("generation_config.json")), needle]);
        assert!(!line.contains("tokenizer.json"), "{line}");
    }
}

/// `tokenizer.json` cut anywhere is an error naming it, never a panic of the tokenizers library.
#[test]
fn a_truncated_tokenizer_json_is_an_error_naming_it() {
    let d = llama_copy();
    let path = d.path().join("tokenizer.json");
    let full = std::fs::read(&path).unwrap();
    // Every cut point, among them those inside the `decoder` object, where the tokenizers
    // library itself panics on the syntax error.
    for cut in 0..full.len() {
        std::fs::write(&path, &full[..cut]).unwrap();
        match rlhf_tokenizer::HfTokenizer::from_dir(d.path()) {
            Ok(_) => panic!("tokenizer.json cut at byte {cut} of {} loaded", full.len()),
            Err(e) => assert!(e.to_string().contains(s(&path)), "cut at {cut}: {e}"),
        }
    }
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    assert_clean_failure(&generate(d.path(), &[]), &[s(&path)]);
}

/// Settings that reach libtorch or a cast are range-checked, and settings that cannot work are
/// refused before anything runs: 2^31 generation threads, dynamic sampling or GRPO with one
/// response per prompt, an empty `data.label_key`, an empty `tensorboard.dir`.
#[test]
fn impossible_settings_are_refused_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("r");
    let refused = |set: &[&str], needles: &[&str]| {
        let mut args = vec!["train", "--algo", "grpo", "--run-dir", s(&run)];
        for x in set {
            args.extend(["--set", x]);
        }
        assert_clean_failure(&rlhf(&args), needles);
        assert!(!run.exists(), "{set:?} made the run directory");
    };
    refused(
        &["rollout.max_staleness=1", "rollout.generation_threads=2147483648"],
        &["rollout.generation_threads", "at most 1024"],
    );
    refused(
        &["rollout.filter_groups.enable=true", "rollout.samples_per_prompt=1"],
        &["rollout.filter_groups.enable", "samples_per_prompt >= 2"],
    );
    refused(&["rollout.samples_per_prompt=1"], &["rollout.samples_per_prompt = 1: GRPO compares the samples"]);
    refused(&["data.label_key=\"\""], &["data.label_key", "is empty"]);
    refused(&["tensorboard.dir=\"\""], &["tensorboard.dir", "is empty"]);
    let out = rlhf(&["sft", "--run-dir", s(&run), "--set", "tensorboard.dir=\"\""]);
    assert_clean_failure(&out, &["tensorboard.dir", "is empty"]);
    assert!(!run.exists());
}
