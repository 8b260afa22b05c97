//! A GGUF imported, then loaded, computes what transformers computes reading the same file
//! (`fixtures/gguf_models.py` writes tiny random models as llama.cpp's converter does, and
//! transformers reads them with its own GGUF loader): a Qwen3-MoE (`qwen3moe`: stacked experts,
//! the router as `ffn_gate_inp`), a Gemma 3 (`gemma3`: norms stored plus one, every sixth layer
//! global, a SentencePiece vocabulary whose merges are rebuilt from the token order) and a Llama
//! (`llama`: q/k rows permuted by llama.cpp's converter, a Llama 2-style SentencePiece vocabulary
//! whose merges are rebuilt from the scores) and a Phi-3 (`phi3`: fused q/k/v and gate/up, that
//! vocabulary with Phi-3's own normalizer and chat tokens); and an OLMo 2 (`olmo2`), which
//! transformers cannot read from a GGUF, against the model written; and a gpt-oss (`gpt-oss`: MXFP4
//! experts, sinks, biases), whose llama.cpp tensors transformers' GGUF loader does not read, against
//! the model written with transformers' dequantisation of the same MXFP4 blocks; and the hybrid
//! linear-attention Qwens (`qwen35`, `qwen35moe`, `qwen3next`) and a Gemma 4 (`gemma4`), which
//! transformers' GGUF loader does not read either, against the models written.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rlhf_gguf::{import_llama, GgufFile, GgufWriter, ImportSummary, OutDtype, Value, ValueType};
use rlhf_integration_tests::{fixtures, python, read_json};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

/// Writes the `arch` fixture into `dir` and imports it into `dir/imported`.
fn imported(python: &Path, arch: &str, dir: &Path) -> (PathBuf, ImportSummary) {
    let out = std::process::Command::new(python)
        .arg(fixtures().join("gguf_models.py"))
        .args(["--arch", arch, "--out"])
        .arg(dir)
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = GgufFile::open(&dir.join(format!("{arch}.gguf"))).unwrap(); // `phi3-long.gguf` too
    let model_dir = dir.join("imported");
    let summary = import_llama(&file, &model_dir, OutDtype::F32).unwrap();
    (model_dir, summary)
}

/// The imported model's logits of the reference batch against transformers' (for OLMo 2, those
/// of the model written), within 1e-4, or for the Gated DeltaNet models within the families'
/// tolerance (5e-4, or twice transformers' own f32 error where the fixture measured it).
fn check_logits(arch: &str, dir: &Path, model_dir: &Path) {
    let own = dir.join("reference.json");
    let tol = if own.exists() { 5e-4f64.max(2.0 * read_json(&own)["f32_error"].as_f64().unwrap()) } else { 1e-4 };
    let model = CausalLm::from_dir(model_dir, Device::Cpu, Kind::Float).unwrap();
    let r: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect();
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    let logits = tch::no_grad(|| model.forward(ids, mask)).unwrap();
    let real = mask.to_kind(Kind::Bool).unsqueeze(-1);
    let diff = (&logits - &r["logits"]).abs().masked_fill(&real.logical_not(), 0.0).max().double_value(&[]);
    println!("{arch} GGUF: max |Δlogit| vs the reference = {diff:.2e} (tolerance {tol:.1e})");
    assert!(diff < tol, "{arch}: logits differ by {diff}");
}

#[test]
fn a_qwen3moe_gguf_imports_to_the_logits_transformers_reads_from_it() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, summary) = imported(&python, "qwen3moe", dir.path());
    // Per layer: 2 norms, q/k/v/o, q/k norms, the router, 3 × 4 experts; embeddings, norm, head.
    assert_eq!(summary.tensors, 2 * (2 + 4 + 2 + 1 + 12) + 3);
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(config["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!((config["num_experts"].as_u64(), config["moe_intermediate_size"].as_u64()), (Some(4), Some(16)));
    assert_eq!(config["norm_topk_prob"], true);
    check_logits("qwen3moe", dir.path(), &model_dir);
}

#[test]
fn gemma2_and_gemma3_ggufs_import_to_the_logits_and_tokens_transformers_reads_from_them() {
    let Some(python) = python() else { return };
    for (arch, class, model_type, full_layers) in
        [("gemma2", "Gemma2ForCausalLM", "gemma2", 3), ("gemma3", "Gemma3ForCausalLM", "gemma3_text", 1)]
    {
        let dir = tempfile::tempdir().unwrap();
        let (model_dir, _) = imported(&python, arch, dir.path());
        let config = read_json(&model_dir.join("config.json"));
        assert_eq!(
            (config["architectures"][0].as_str(), config["model_type"].as_str()),
            (Some(class), Some(model_type))
        );
        let types: Vec<&str> = config["layer_types"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(types.iter().filter(|t| **t == "full_attention").count(), full_layers, "{arch}: {types:?}");
        check_logits(arch, dir.path(), &model_dir);
        check_tokens(dir.path(), &model_dir);
    }
}

#[test]
fn a_llama_gguf_with_a_sentencepiece_vocabulary_imports_to_what_transformers_reads_from_it() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "llama", dir.path());
    check_logits("llama", dir.path(), &model_dir);
    check_tokens(dir.path(), &model_dir);
}

#[test]
fn an_olmo2_gguf_imports_to_the_logits_of_the_model_written() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "olmo2", dir.path());
    assert_eq!(read_json(&model_dir.join("config.json"))["architectures"][0], "Olmo2ForCausalLM");
    check_logits("olmo2", dir.path(), &model_dir);
}

/// OLMo 3 as llama.cpp's converter writes it (`olmo2` with a window, a flag per layer, the sliding
/// layers' own RoPE base, the full layer's YaRN with its `attention_factor` as `attn_factor`):
/// `Olmo3ForCausalLM` with those layers sliding, the logits of the model written on a row longer
/// than the window and the original context; the pattern given as a period imports the same.
#[test]
fn an_olmo3_gguf_imports_its_sliding_layers_to_the_logits_of_the_model_written() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "olmo3", dir.path());
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(
        (config["architectures"][0].as_str(), config["sliding_window"].as_u64()),
        (Some("Olmo3ForCausalLM"), Some(4))
    );
    let kinds = serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]);
    assert_eq!(config["layer_types"], kinds);
    let rope = &config["rope_parameters"];
    assert_eq!(rope["sliding_attention"]["rope_theta"].as_f64(), Some(10000.0));
    assert_eq!(rope["full_attention"]["rope_type"], "yarn");
    assert!((rope["full_attention"]["attention_factor"].as_f64().unwrap() - 1.2).abs() < 1e-6, "{rope}");
    check_logits("olmo3", dir.path(), &model_dir);

    let g = GgufFile::open(&dir.path().join("olmo3.gguf")).unwrap();
    let period = rewritten(&g, Some(("olmo2.attention.sliding_window_pattern", Value::U32(2))), "", None);
    let by_period = dir.path().join("period");
    import_llama(&period, &by_period, OutDtype::F32).unwrap();
    assert_eq!(read_json(&by_period.join("config.json")), config);
}

#[test]
fn a_phi3_gguf_imports_its_fused_projections_and_vocabulary_as_transformers_reads_them() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "phi3", dir.path());
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(
        (config["architectures"][0].as_str(), config["sliding_window"].as_u64()),
        (Some("Phi3ForCausalLM"), Some(64))
    );
    check_logits("phi3", dir.path(), &model_dir);
    check_tokens(dir.path(), &model_dir);
}

#[test]
fn a_phi3_gguf_with_long_rope_factors_and_partial_rotary_imports_to_the_model_written() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "phi3-long", dir.path());
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(config["rope_scaling"]["long_factor"], serde_json::json!([2.0, 4.0]));
    assert_eq!(config["partial_rotary_factor"], 0.5);
    // A row of 40 tokens, past the original context of 16: the long factors.
    check_logits("phi3-long", dir.path(), &model_dir);
}

/// gpt-oss with its experts in MXFP4 as llama.cpp's converter writes them (repacked into ggml's
/// blocks, gate and up apart or stacked, `W · x`): imported, transformers' interleaved `x · W`
/// layout with the weights transformers dequantises from the same blocks, so the logits of the
/// model written (sinks, biases, sliding and full layers, YaRN, a row past the original context);
/// GPT-4o's pre-tokenizer; a file without its up experts is refused naming the tensor.
#[test]
fn a_gpt_oss_gguf_with_mxfp4_experts_imports_to_the_logits_of_the_model_written() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, summary) = imported(&python, "gpt-oss", dir.path());
    // Gate, up and down experts of 3 layers.
    assert!(summary.source_types.contains(&("MXFP4".to_owned(), 9)), "{:?}", summary.source_types);
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(config["architectures"][0], "GptOssForCausalLM");
    assert_eq!(config["layer_types"], serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"]));
    let yarn = &config["rope_scaling"];
    assert_eq!((yarn["rope_type"].as_str(), yarn["factor"].as_f64()), (Some("yarn"), Some(4.0)));
    assert_eq!(
        (yarn["original_max_position_embeddings"].as_u64(), &yarn["truncate"]),
        (Some(16), &serde_json::Value::Bool(false))
    );
    check_logits("gpt-oss", dir.path(), &model_dir);
    check_tokens(dir.path(), &model_dir);

    let fused_dir = dir.path().join("fused");
    let fused = GgufFile::open(&dir.path().join("gpt-oss-fused.gguf")).unwrap();
    import_llama(&fused, &fused_dir, OutDtype::F32).unwrap();
    let (apart, stacked) =
        (tensors(&model_dir.join("model.safetensors")), tensors(&fused_dir.join("model.safetensors")));
    assert_eq!(apart.len(), stacked.len());
    for (name, t) in &apart {
        assert!(t.equal(&stacked[name]), "{name}: stacked gate/up experts import differently");
    }

    let no_up = GgufFile::open(&dir.path().join("gpt-oss-no-up.gguf")).unwrap();
    let err = import_llama(&no_up, &dir.path().join("no-up"), OutDtype::F32).unwrap_err().to_string();
    // The first tensor at fault in the file's order, run after run.
    assert!(
        err.contains("gpt-oss-no-up.gguf") && err.contains("`model.layers.0.mlp.experts.gate_up_proj` needs"),
        "{err}"
    );
    assert!(!dir.path().join("no-up").exists(), "nothing is written for a refused file");
}

/// The imported vocabulary tokenizes (BOS added where the file says) and decodes as transformers' tokenizer read from
/// the same file (`tokens.json`).
fn check_tokens(dir: &Path, model_dir: &Path) {
    let tok = rlhf_tokenizer::HfTokenizer::from_dir(model_dir).unwrap();
    let cases = read_json(&dir.join("tokens.json"));
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(tok.decode(&want, true).unwrap(), case["decoded"].as_str().unwrap(), "{text:?}");
    }
}

/// The hybrid Qwens as llama.cpp's converter writes them (norms plus one, `A` for `A_log`, Qwen3.5's
/// value heads tiled, Qwen3-Next's `in_proj_qkvz` split, experts split into gate and up): imported,
/// the logits of the models written (Gated DeltaNet layers 0 and 2, gated attention on layer 1);
/// Qwen3.5's multi-token-prediction block left out; Qwen3-Next's older `ssm_in` layout imports to
/// the same weights; Qwen3.5's pre-tokenizer.
#[test]
fn qwen3_5_and_qwen3_next_ggufs_import_to_the_logits_of_the_models_written() {
    let Some(python) = python() else { return };
    for (arch, class) in [
        ("qwen35", "Qwen3_5ForCausalLM"),
        ("qwen35moe", "Qwen3_5MoeForCausalLM"),
        ("qwen3next", "Qwen3NextForCausalLM"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (model_dir, summary) = imported(&python, arch, dir.path());
        let config = read_json(&model_dir.join("config.json"));
        assert_eq!(config["architectures"][0], class);
        let kinds = serde_json::json!(["linear_attention", "full_attention", "linear_attention"]);
        assert_eq!((&config["layer_types"], config["num_hidden_layers"].as_u64()), (&kinds, Some(3)));
        // The multi-token-prediction block's 4 tensors.
        assert_eq!(summary.skipped, if arch == "qwen3next" { 0 } else { 4 }, "{arch}");
        // transformers' tensors by name, up to the last bits of `(1 + w) − 1` and `ln(exp(A_log))`.
        let ours = check_weights(arch, &model_dir, dir.path(), 1e-6);
        check_logits(arch, dir.path(), &model_dir);
        if arch == "qwen35" {
            check_tokens(dir.path(), &model_dir);
        }
        refusals(arch, dir.path());
        if arch == "qwen3next" {
            let legacy_dir = dir.path().join("legacy");
            let legacy = GgufFile::open(&dir.path().join("qwen3next-legacy.gguf")).unwrap();
            import_llama(&legacy, &legacy_dir, OutDtype::F32).unwrap();
            let whole = tensors(&legacy_dir.join("model.safetensors"));
            assert_eq!(ours.len(), whole.len());
            for (name, t) in &ours {
                assert!(t.equal(&whole[name]), "{name}: `ssm_in` imports differently from `attn_qkv` + `attn_gate`");
            }
        }
    }
}

/// What a hybrid Qwen file cannot be, each refused naming the file and what is wrong, with nothing
/// written: Qwen3-Next's `attn_qkv` without its `attn_gate`; an `ssm_a` that is not `−exp(A_log)`;
/// more multi-token-prediction layers than blocks.
fn refusals(arch: &str, dir: &Path) {
    let g = GgufFile::open(&dir.join(format!("{arch}.gguf"))).unwrap();
    let refused = |file: &GgufFile, want: &str| assert_refused(file, arch, dir, want);
    if arch == "qwen3next" {
        let no_gate = rewritten(&g, None, "blk.0.attn_gate.weight", None);
        refused(&no_gate, "model.layers.0.linear_attn.in_proj_qkvz.weight` needs the q/k/v rows");
        return;
    }
    let key = format!("{arch}.nextn_predict_layers");
    refused(&rewritten(&g, Some((key.as_str(), Value::U32(4))), "", None), &key);
    let positive = rewritten(&g, None, "", Some(("blk.0.ssm_a", &[0.5, -1.0, -1.0, -1.0])));
    refused(&positive, "`blk.0.ssm_a` holds 0.5");
}

/// Gemma 4 as llama.cpp's converter writes it (`fixtures/gguf_gemma4.py`: per-layer KV heads and
/// MLP widths, the full layers' head size as `key_length`, proportional RoPE as `rope_freqs`, no
/// values on full layers, no keys and values on the 2 layers that reuse them, per-layer inputs,
/// experts beside the MLPs with the router's scales under llama.cpp's names, a `gemma4` BPE
/// vocabulary): imported, transformers' tensors by name exactly (the converter changes no value),
/// the logits of the model written, the ids its tokenizer gives; what Gemma 4 cannot be is refused
/// naming the file and the key or tensor, with nothing written.
#[test]
fn a_gemma4_gguf_imports_its_layers_and_vocabulary_to_the_model_written() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (model_dir, _) = imported(&python, "gemma4", dir.path());
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(
        (config["architectures"][0].as_str(), config["model_type"].as_str()),
        (Some("Gemma4ForCausalLM"), Some("gemma4_text"))
    );
    let rope = &config["rope_parameters"];
    assert_eq!(rope["full_attention"]["partial_rotary_factor"].as_f64(), Some(0.25), "{rope}");
    assert_eq!(rope["sliding_attention"]["rope_theta"].as_f64(), Some(10000.0), "{rope}");
    let geometry = ["head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads"];
    assert_eq!(geometry.map(|k| config[k].as_u64()), [Some(8), Some(16), Some(2), Some(1)]);
    let flags = ["attention_k_eq_v", "use_double_wide_mlp", "enable_moe_block"];
    assert_eq!(flags.map(|k| config[k].as_bool()), [Some(true); 3]);
    assert_eq!(config["num_kv_shared_layers"].as_u64(), Some(2));
    check_weights("gemma4", &model_dir, dir.path(), 0.0);
    check_logits("gemma4", dir.path(), &model_dir);
    check_tokens(dir.path(), &model_dir);

    let g = GgufFile::open(&dir.path().join("gemma4.gguf")).unwrap();
    let refused = |file: &GgufFile, want: &str| assert_refused(file, "gemma4", dir.path(), want);
    let flags = |f: &[bool]| Value::Array(ValueType::Bool, f.iter().map(|b| Value::Bool(*b)).collect());
    let widths = Value::Array(ValueType::U32, [64u32, 64, 96, 128, 128].map(Value::U32).to_vec());
    let pattern = "gemma4.attention.sliding_window_pattern";
    let last_slides = rewritten(&g, Some((pattern, flags(&[true, false, true, false, true]))), "", None);
    refused(&last_slides, "the last layer slides");
    refused(&rewritten(&g, Some(("gemma4.feed_forward_length", widths)), "", None), "gemma4.feed_forward_length");
    let scaled = [1.0, 0.5, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30];
    refused(&rewritten(&g, None, "", Some(("rope_freqs.weight", &scaled))), "holds the factor 0.5");
    refused(&rewritten(&g, None, "blk.0.attn_v.weight", None), "model.layers.0.self_attn.v_proj.weight");
}

/// The tensors of a safetensors file by name.
fn tensors(file: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(file).unwrap().into_iter().collect()
}

/// The imported weights (`model_dir`) against transformers' (`dir/weights.safetensors`): the same
/// names, each within `tol` of its largest magnitude (at least 1); returns the imported ones.
fn check_weights(arch: &str, model_dir: &Path, dir: &Path, tol: f64) -> HashMap<String, Tensor> {
    let (ours, theirs) = (tensors(&model_dir.join("model.safetensors")), tensors(&dir.join("weights.safetensors")));
    let mut names: Vec<&String> = ours.keys().collect();
    names.sort();
    let mut want: Vec<&String> = theirs.keys().collect();
    want.sort();
    assert_eq!(names, want, "{arch}: tensor names");
    for (name, t) in &theirs {
        let diff = (&ours[name] - t).abs().max().double_value(&[]);
        assert!(diff <= tol * t.abs().max().double_value(&[]).max(1.0), "{arch}: {name} differs by {diff}");
    }
    ours
}

/// `file` (the `arch` fixture, rewritten) is refused naming the file and `want`, and nothing is
/// written.
fn assert_refused(file: &GgufFile, arch: &str, dir: &Path, want: &str) {
    let out = dir.join("refused");
    let err = import_llama(file, &out, OutDtype::F32).unwrap_err().to_string();
    assert!(err.contains(&format!("{arch}.gguf")) && err.contains(want), "{arch}: {err}");
    assert!(!out.exists(), "{arch}: nothing is written for a refused file");
}

/// `g` written again (under its own path) with one metadata value set, the tensor `drop` left out,
/// and one tensor's values replaced.
fn rewritten(g: &GgufFile, key: Option<(&str, Value)>, drop: &str, replace: Option<(&str, &[f32])>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in &g.metadata {
        w = match &key {
            Some((name, value)) if name == k => w.kv(k, value.clone()),
            _ => w.kv(k, v.clone()),
        };
    }
    for t in g.tensors.iter().filter(|t| t.name != drop) {
        w = match replace {
            Some((name, values)) if name == t.name => w.tensor_f32(&t.name, &t.dims, values),
            _ => w.tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec()),
        };
    }
    GgufFile::from_bytes(g.path(), w.to_bytes()).unwrap()
}
