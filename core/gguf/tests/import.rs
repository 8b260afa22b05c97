//! Importing a tiny hand-built Llama GGUF: weights come back under their HF names with the
//! q/k row permutation of llama.cpp's converter undone, the configs carry the metadata, and the
//! tokenizer splits like the model's pre-tokenizer says.

use std::collections::HashMap;
use std::path::Path;

use rlhf_gguf::{
    import_llama, permute_rows, unpermute_rows, GgmlType, GgufFile, GgufWriter, OutDtype, Value, ValueType,
};
use safetensors::SafeTensors;
use serde_json::json;

// Every row length a multiple of 32, so any weight can be stored in a 32-element block type.
const HIDDEN: u64 = 32;
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const HEAD_DIM: u64 = 16;
const INTER: u64 = 64;
const LAYERS: u64 = 2;
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";

/// GPT-2's byte → printable character table.
fn bytes_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from('!')..=u32::from('~')).collect();
    printable.extend(u32::from('¡')..=u32::from('¬'));
    printable.extend(u32::from('®')..=u32::from('ÿ'));
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable.contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// 3 control tokens, the 256 byte tokens, then merged tokens.
fn vocab() -> (Vec<String>, Vec<&'static str>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    tokens.extend(bytes_to_unicode().into_iter().map(String::from));
    let merges = vec!["Ġ t", "h e", "Ġt he", "1 2"];
    tokens.extend(["Ġt", "he", "Ġthe", "12"].map(String::from));
    (tokens, merges)
}

/// Deterministic values in [-1, 1) that are exact in bf16 when `coarse`.
fn values(seed: u64, n: usize, coarse: bool) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if coarse {
                (v * 64.0).round() / 64.0
            } else {
                v
            }
        })
        .collect()
}

/// The HF checkpoint (name → (shape, values)) and the GGUF llama.cpp would have made of it.
/// HF tensors by name: shape and values.
type Checkpoint = HashMap<String, (Vec<usize>, Vec<f32>)>;

fn tiny_llama(pre: &str, untied: bool) -> (Checkpoint, Vec<u8>) {
    tiny_model("llama", pre, untied)
}

/// [`tiny_llama`] as llama.cpp writes `arch` (`llama`, `qwen2` with q/k/v biases, `qwen3` with
/// per-head q/k norms; only `llama`'s q/k rows permuted).
fn tiny_model(arch: &str, pre: &str, untied: bool) -> (Checkpoint, Vec<u8>) {
    let (tokens, merges) = vocab();
    let vocab_size = tokens.len() as u64;
    let mut types = vec![1i32; tokens.len()];
    types[..3].fill(3);
    let mut w = GgufWriter::new()
        .kv("general.architecture", Value::String(arch.into()))
        .kv("general.name", Value::String("tiny".into()))
        .kv(&format!("{arch}.block_count"), Value::U32(LAYERS as u32))
        .kv(&format!("{arch}.context_length"), Value::U32(256))
        .kv(&format!("{arch}.embedding_length"), Value::U32(HIDDEN as u32))
        .kv(&format!("{arch}.feed_forward_length"), Value::U32(INTER as u32))
        .kv(&format!("{arch}.attention.head_count"), Value::U32(HEADS as u32))
        .kv(&format!("{arch}.attention.head_count_kv"), Value::U32(KV_HEADS as u32))
        .kv(&format!("{arch}.rope.freq_base"), Value::F32(100000.0))
        .kv(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
        .kv(&format!("{arch}.vocab_size"), Value::U32(vocab_size as u32))
        .kv(&format!("{arch}.rope.dimension_count"), Value::U32(HEAD_DIM as u32))
        .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::String(pre.into()))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, tokens.iter().map(|t| Value::String(t.clone())).collect()),
        )
        .kv("tokenizer.ggml.token_type", Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()))
        .kv(
            "tokenizer.ggml.merges",
            Value::Array(ValueType::String, merges.iter().map(|m| Value::String((*m).into())).collect()),
        )
        .kv("tokenizer.ggml.bos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", Value::U32(0))
        .kv("tokenizer.ggml.padding_token_id", Value::U32(2))
        .kv("tokenizer.ggml.add_bos_token", Value::Bool(false))
        .kv("tokenizer.chat_template", Value::String(TEMPLATE.into()));

    let mut hf = HashMap::new();
    let mut seed = 0;
    let mut add = |w: GgufWriter, gguf: &str, hf_name: String, shape: Vec<usize>, heads: Option<u64>| {
        seed += 1;
        let v = values(seed, shape.iter().product(), true);
        let stored = match heads {
            Some(n) if arch == "llama" => permute_rows(&v, shape[0], shape[1], n as usize),
            _ => v.clone(),
        };
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        hf.insert(hf_name, (shape, v));
        w.tensor_f32(gguf, &dims, &stored)
    };
    let (h, i, v, q, kv) = (
        HIDDEN as usize,
        INTER as usize,
        vocab_size as usize,
        (HEADS * HEAD_DIM) as usize,
        (KV_HEADS * HEAD_DIM) as usize,
    );
    w = add(w, "token_embd.weight", "model.embed_tokens.weight".into(), vec![v, h], None);
    for l in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let g = |s: &str| format!("blk.{l}.{s}");
        w = add(w, &g("attn_norm.weight"), p("input_layernorm.weight"), vec![h], None);
        w = add(w, &g("attn_q.weight"), p("self_attn.q_proj.weight"), vec![q, h], Some(HEADS));
        w = add(w, &g("attn_k.weight"), p("self_attn.k_proj.weight"), vec![kv, h], Some(KV_HEADS));
        w = add(w, &g("attn_v.weight"), p("self_attn.v_proj.weight"), vec![kv, h], None);
        w = add(w, &g("attn_output.weight"), p("self_attn.o_proj.weight"), vec![h, q], None);
        if arch == "qwen2" {
            w = add(w, &g("attn_q.bias"), p("self_attn.q_proj.bias"), vec![q], None);
            w = add(w, &g("attn_k.bias"), p("self_attn.k_proj.bias"), vec![kv], None);
            w = add(w, &g("attn_v.bias"), p("self_attn.v_proj.bias"), vec![kv], None);
        }
        if arch == "qwen3" {
            let d = HEAD_DIM as usize;
            w = add(w, &g("attn_q_norm.weight"), p("self_attn.q_norm.weight"), vec![d], None);
            w = add(w, &g("attn_k_norm.weight"), p("self_attn.k_norm.weight"), vec![d], None);
        }
        w = add(w, &g("ffn_norm.weight"), p("post_attention_layernorm.weight"), vec![h], None);
        w = add(w, &g("ffn_gate.weight"), p("mlp.gate_proj.weight"), vec![i, h], None);
        w = add(w, &g("ffn_up.weight"), p("mlp.up_proj.weight"), vec![i, h], None);
        w = add(w, &g("ffn_down.weight"), p("mlp.down_proj.weight"), vec![h, i], None);
    }
    w = add(w, "output_norm.weight", "model.norm.weight".into(), vec![h], None);
    if untied {
        w = add(w, "output.weight", "lm_head.weight".into(), vec![v, h], None);
    }
    (hf, w.to_bytes())
}

fn read_f32(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    let v = match t.dtype() {
        safetensors::Dtype::F32 => {
            t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
        }
        safetensors::Dtype::BF16 => {
            t.data().chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
        }
        other => panic!("{name}: unexpected dtype {other:?}"),
    };
    (t.shape().to_vec(), v)
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn weights_come_back_with_hf_names_shapes_and_row_order() {
    for (dtype, untied) in [(OutDtype::F32, false), (OutDtype::Bf16, true)] {
        let (hf, bytes) = tiny_llama("smollm", untied);
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("tiny.gguf");
        std::fs::write(&src, bytes).unwrap();
        let g = GgufFile::open(&src).unwrap();
        let out = dir.path().join("hf");
        let summary = import_llama(&g, &out, dtype).unwrap();
        assert_eq!(summary.tensors, hf.len());
        assert_eq!(summary.params.tie_word_embeddings, !untied);

        let data = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&data).unwrap();
        let mut names = st.names();
        names.sort();
        let mut want: Vec<&String> = hf.keys().collect();
        want.sort();
        assert_eq!(names, want);
        for (name, (shape, values)) in &hf {
            let (got_shape, got) = read_f32(&st, name);
            assert_eq!(&got_shape, shape, "{name}");
            // The values are multiples of 1/64 in [-1, 1]: exact in bf16 too.
            assert_eq!(&got, values, "{name}");
        }
        let expected_dtype = if dtype == OutDtype::F32 { safetensors::Dtype::F32 } else { safetensors::Dtype::BF16 };
        assert!(st.tensors().iter().all(|(_, t)| t.dtype() == expected_dtype));
        let (_, meta) = SafeTensors::read_metadata(&data).unwrap();
        assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    }
}

/// llama.cpp's `qwen2` and `qwen3`: biases and q/k norms under transformers' names, rows as stored
/// (no permutation), the family's config.
#[test]
fn qwen2_and_qwen3_import_with_their_own_tensors_and_config() {
    for (arch, class) in [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")] {
        let (hf, bytes) = tiny_model(arch, "qwen2", false);
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("tiny.gguf");
        std::fs::write(&src, bytes).unwrap();
        let out = dir.path().join("hf");
        let summary = import_llama(&GgufFile::open(&src).unwrap(), &out, OutDtype::F32).unwrap();
        assert_eq!((summary.architecture.as_str(), summary.tensors), (arch, hf.len()), "{arch}");
        let data = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&data).unwrap();
        for (name, (shape, values)) in &hf {
            let (got_shape, got) = read_f32(&st, name);
            assert_eq!((&got_shape, &got), (shape, values), "{arch}: {name}");
        }
        let config = read_json(&out.join("config.json"));
        assert_eq!(config["model_type"], arch);
        assert_eq!(config["architectures"][0], class);
        assert_eq!(config["head_dim"], HEAD_DIM);
    }
    // A tensor of another architecture (Qwen3's q norm in a `qwen2` file) is refused by name.
    let (_, mut bytes) = tiny_model("qwen3", "qwen2", false);
    // The architecture and its metadata keys renamed in place (same length).
    let at: Vec<usize> = bytes.windows(5).enumerate().filter(|(_, w)| *w == b"qwen3").map(|(i, _)| i).collect();
    for i in at {
        bytes[i + 4] = b'2';
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("mixed.gguf");
    std::fs::write(&src, &bytes).unwrap();
    let g = GgufFile::open(&src).unwrap();
    let e = import_llama(&g, &dir.path().join("hf"), OutDtype::F32).unwrap_err().to_string();
    assert!(e.contains("attn_q_norm") && e.contains("no qwen2 counterpart"), "{e}");
}

#[test]
fn configs_carry_the_metadata() {
    let (_, bytes) = tiny_llama("smollm", false);
    let dir = tempfile::tempdir().unwrap();
    let g = GgufFile::from_bytes(&dir.path().join("tiny.gguf"), bytes).unwrap();
    let out = dir.path().join("hf");
    import_llama(&g, &out, OutDtype::Bf16).unwrap();

    let config = read_json(&out.join("config.json"));
    let (tokens, _) = vocab();
    for (key, want) in [
        ("architectures", json!(["LlamaForCausalLM"])),
        ("model_type", json!("llama")),
        ("hidden_size", json!(HIDDEN)),
        ("intermediate_size", json!(INTER)),
        ("num_hidden_layers", json!(LAYERS)),
        ("num_attention_heads", json!(HEADS)),
        ("num_key_value_heads", json!(KV_HEADS)),
        ("head_dim", json!(HEAD_DIM)),
        ("rms_norm_eps", json!(1e-5)),
        ("rope_theta", json!(100000.0)),
        ("max_position_embeddings", json!(256)),
        ("vocab_size", json!(tokens.len())),
        ("tie_word_embeddings", json!(true)),
        ("bos_token_id", json!(1)),
        ("eos_token_id", json!(2)),
        ("pad_token_id", json!(2)),
        ("dtype", json!("bfloat16")),
    ] {
        assert_eq!(config[key], want, "config.json {key}");
    }
    let generation = read_json(&out.join("generation_config.json"));
    assert_eq!(generation, json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}));
    let tc = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tc["chat_template"], json!(TEMPLATE));
    assert_eq!(tc["bos_token"], json!("<|im_start|>"));
    assert_eq!(tc["eos_token"], json!("<|im_end|>"));
    assert_eq!(tc["pad_token"], json!("<|im_end|>"));
    assert_eq!(tc["unk_token"], json!("<|endoftext|>"));
    assert_eq!(tc["add_bos_token"], json!(false));
    assert_eq!(tc["added_tokens_decoder"]["1"]["special"], json!(true));
}

fn import_tokenizer(pre: &str) -> tokenizers::Tokenizer {
    let (_, bytes) = tiny_llama(pre, false);
    let dir = tempfile::tempdir().unwrap();
    let g = GgufFile::from_bytes(&dir.path().join("tiny.gguf"), bytes).unwrap();
    let out = dir.path().join("hf");
    import_llama(&g, &out, OutDtype::F32).unwrap();
    tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap()
}

fn pieces(tok: &tokenizers::Tokenizer, text: &str) -> Vec<String> {
    let enc = tok.encode(text, true).unwrap();
    enc.get_ids().iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
}

#[test]
fn tokenizer_follows_the_pre_tokenizer_and_keeps_control_tokens_whole() {
    // smollm splits every digit first, so the "1 2" merge never applies.
    let tok = import_tokenizer("smollm");
    assert_eq!(pieces(&tok, "the 12 the<|im_end|>"), ["t", "he", "Ġ", "1", "2", "Ġthe", "<|im_end|>"]);
    // gpt-2 keeps " 12" together, and the merge applies.
    let gpt2 = import_tokenizer("gpt-2");
    assert_eq!(pieces(&gpt2, "the 12 the<|im_end|>"), ["t", "he", "Ġ", "12", "Ġthe", "<|im_end|>"]);
    // No BOS added (add_bos_token = false); control tokens are special and skipped on decode.
    let ids = tok.encode("<|im_start|>user the", true).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user the");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user the");
    // Bytes outside the merges (é, emoji) round-trip through the byte alphabet.
    let text = "é 🦀\n\tx";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn import_refuses_what_it_cannot_convert_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    let out = dir.path().join("out");
    let check = |bytes: Vec<u8>, needle: &str| {
        let g = GgufFile::from_bytes(&path, bytes).unwrap();
        let err = import_llama(&g, &out, OutDtype::F32).unwrap_err().to_string();
        assert!(err.contains(needle), "{err} should mention {needle:?}");
        assert!(err.contains(&path.display().to_string()), "{err}");
    };
    check(GgufWriter::new().kv("general.architecture", Value::String("gpt2".into())).to_bytes(), "`gpt2`");

    let (_, good) = tiny_llama("smollm", false);
    let g = GgufFile::from_bytes(&path, good).unwrap();
    // Rebuild with one extra unknown tensor, with a Q4_K tensor, with an unknown pre-tokenizer.
    let rebuild = |extra: &dyn Fn(GgufWriter) -> GgufWriter, skip_keys: &[&str]| rebuilt(&g, extra, skip_keys);
    check(rebuild(&|w| w.tensor_f32("blk.0.attn_q.bias", &[32], &[0.0; 32]), &[]), "blk.0.attn_q.bias");
    check(rebuild(&|w| w.tensor_f32("output.weight", &[HIDDEN, 5], &[0.0; 5 * 32]), &[]), "shape");
    check(
        rebuild(&|w| w.kv("tokenizer.ggml.pre", Value::String("mystery".into())), &["tokenizer.ggml.pre"]),
        "mystery",
    );
    check(rebuild(&|w| w, &["llama.embedding_length"]), "llama.embedding_length");
    // The whole tokenizer is missing.
    check(rebuild(&|w| w, &["tokenizer.ggml.model"]), "tokenizer.ggml.model");
    // A SentencePiece vocabulary without its scores, and one with a token too long to rebuild
    // merges from in bounded time.
    let spm = |w: GgufWriter| w.kv("tokenizer.ggml.model", Value::String("llama".into()));
    check(rebuild(&spm, &["tokenizer.ggml.model"]), "tokenizer.ggml.scores");
    let long_token = |w: GgufWriter| {
        let mut tokens: Vec<Value> = g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().to_vec();
        tokens[5] = Value::String("a".repeat(5000));
        spm(w).kv("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens))
    };
    check(rebuild(&long_token, &["tokenizer.ggml.model", "tokenizer.ggml.tokens"]), "token 5 has 5000 characters");
    assert!(!out.exists(), "nothing is written when the import is refused");
}

/// `g` written again without the metadata `skip_keys`, then changed by `extra`.
fn rebuilt(g: &GgufFile, extra: &dyn Fn(GgufWriter) -> GgufWriter, skip_keys: &[&str]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in &g.metadata {
        if !skip_keys.contains(&k.as_str()) {
            w = w.kv(k, v.clone());
        }
    }
    for t in &g.tensors {
        w = w.tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec());
    }
    extra(w).to_bytes()
}

/// YaRN (`rope.scaling.type = yarn`) becomes transformers' `rope_scaling` with the file's factor,
/// original context and β bounds, the band rounded as llama.cpp rounds it, and `attn_factor` (which
/// the converter writes from the config's `attention_factor`) as `attention_factor`; YaRN with
/// llama.cpp's own magnitude keys is refused naming the key.
#[test]
fn yarn_scaling_becomes_rope_scaling_and_llama_cpp_magnitude_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("yarn.gguf");
    let (_, good) = tiny_llama("smollm", false);
    let g = GgufFile::from_bytes(&path, good).unwrap();
    let yarn = |w: GgufWriter| {
        w.kv("llama.rope.scaling.type", Value::String("yarn".into()))
            .kv("llama.rope.scaling.factor", Value::F32(4.0))
            .kv("llama.rope.scaling.original_context_length", Value::U32(64))
            .kv("llama.rope.scaling.yarn_beta_fast", Value::F32(16.0))
    };
    let out = dir.path().join("hf");
    import_llama(&GgufFile::from_bytes(&path, rebuilt(&g, &yarn, &[])).unwrap(), &out, OutDtype::F32).unwrap();
    assert_eq!(
        read_json(&out.join("config.json"))["rope_scaling"],
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
               "beta_slow": 1.0, "truncate": true})
    );
    let with_attn = |w: GgufWriter| yarn(w).kv("llama.rope.scaling.attn_factor", Value::F32(1.25));
    let out = dir.path().join("attn");
    import_llama(&GgufFile::from_bytes(&path, rebuilt(&g, &with_attn, &[])).unwrap(), &out, OutDtype::F32).unwrap();
    assert_eq!(read_json(&out.join("config.json"))["rope_scaling"]["attention_factor"], json!(1.25));
    let with_log = |w: GgufWriter| yarn(w).kv("llama.rope.scaling.yarn_log_multiplier", Value::F32(0.1));
    let refused = GgufFile::from_bytes(&path, rebuilt(&g, &with_log, &[])).unwrap();
    let err = import_llama(&refused, &dir.path().join("no"), OutDtype::F32).unwrap_err().to_string();
    assert!(err.contains("llama.rope.scaling.yarn_log_multiplier") && err.contains("yarn.gguf"), "{err}");
}

/// Sizes from the metadata are checked against the file before anything is built from them: a
/// block count of 1e10 (names for 1e10 layers) and head counts of 2^32 (`heads × head_dim`
/// overflows) are one-line errors naming the key, not an exhausted memory or a panic.
#[test]
fn sizes_in_the_metadata_are_checked_before_anything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.gguf");
    let out = dir.path().join("out");
    let (_, good) = tiny_llama("smollm", false);
    let g = GgufFile::from_bytes(&path, good).unwrap();
    let with = |changes: &[(&str, Option<Value>)]| {
        let mut w = GgufWriter::new();
        for (k, v) in &g.metadata {
            if !changes.iter().any(|(c, _)| c == k) {
                w = w.kv(k, v.clone());
            }
        }
        for (k, v) in changes {
            if let Some(v) = v {
                w = w.kv(k, v.clone());
            }
        }
        for t in &g.tensors {
            w = w.tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec());
        }
        GgufFile::from_bytes(&path, w.to_bytes()).unwrap()
    };
    let refused = |g: GgufFile, key: &str| {
        let err = import_llama(&g, &out, OutDtype::F32).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()) && err.contains(key), "{err} should name {key}");
    };
    refused(with(&[("llama.block_count", Some(Value::U64(10_000_000_000)))]), "llama.block_count");
    refused(with(&[("llama.block_count", Some(Value::U64(0)))]), "llama.block_count");
    let huge = Value::U64(1 << 32);
    refused(
        with(&[
            ("llama.attention.head_count", Some(huge.clone())),
            ("llama.attention.head_count_kv", Some(huge.clone())),
            ("llama.attention.key_length", Some(huge)),
            ("llama.rope.dimension_count", None),
        ]),
        "llama.attention.head_count",
    );
    refused(with(&[("llama.feed_forward_length", Some(Value::U64(1 << 40)))]), "llama.feed_forward_length");
    assert!(!out.exists(), "nothing is written when the import is refused");
}

#[test]
fn quantised_weights_are_dequantised_then_unpermuted() {
    let (_, good) = tiny_llama("smollm", false);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.gguf");
    let g = GgufFile::from_bytes(&path, good).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &g.metadata {
        w = w.kv(k, v.clone());
    }
    // blk.0.attn_q as Q4_1 and blk.0.attn_k as Q8_0 with arbitrary bytes (finite f16 scales),
    // blk.0.ffn_up as F16.
    let pattern =
        |n: usize, seed: u8| -> Vec<u8> { (0..n).map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed)).collect() };
    let mut q41 = Vec::new();
    for (b, chunk) in pattern(32 * 16, 1).chunks(16).enumerate() {
        q41.extend(half::f16::from_f32(0.01 * (b % 7) as f32 + 0.01).to_le_bytes());
        q41.extend(half::f16::from_f32(-0.1 + 0.003 * b as f32).to_le_bytes());
        q41.extend_from_slice(chunk);
    }
    let mut q80 = Vec::new();
    for (b, chunk) in pattern(16 * 32, 5).chunks(32).enumerate() {
        q80.extend(half::f16::from_f32(0.002 * (b + 1) as f32).to_le_bytes());
        q80.extend_from_slice(chunk);
    }
    for t in &g.tensors {
        w = match t.name.as_str() {
            "blk.0.attn_q.weight" => w.tensor(&t.name, &t.dims, GgmlType::Q4_1, q41.clone()),
            "blk.0.attn_k.weight" => w.tensor(&t.name, &t.dims, GgmlType::Q8_0, q80.clone()),
            "blk.0.ffn_up.weight" => {
                let v = g.dequantize(t).unwrap();
                w.tensor(
                    &t.name,
                    &t.dims,
                    GgmlType::F16,
                    v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                )
            }
            _ => w.tensor(&t.name, &t.dims, t.ggml_type, g.tensor_data(t).to_vec()),
        };
    }
    let g2 = GgufFile::from_bytes(&path, w.to_bytes()).unwrap();
    let out = dir.path().join("hf");
    let summary = import_llama(&g2, &out, OutDtype::F32).unwrap();
    assert!(summary.source_types.contains(&("Q4_1".to_owned(), 1)), "{:?}", summary.source_types);
    let data = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();

    let stored_q = rlhf_gguf::dequantize(GgmlType::Q4_1, &q41, 32 * 32).unwrap();
    let (_, got_q) = read_f32(&st, "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(got_q, unpermute_rows(&stored_q, 32, 32, HEADS as usize));
    assert_ne!(got_q, stored_q, "the permutation moved rows");

    let stored_k = rlhf_gguf::dequantize(GgmlType::Q8_0, &q80, 16 * 32).unwrap();
    let (_, got_k) = read_f32(&st, "model.layers.0.self_attn.k_proj.weight");
    assert_eq!(got_k, unpermute_rows(&stored_k, 16, 32, KV_HEADS as usize));

    let (_, got_up) = read_f32(&st, "model.layers.0.mlp.up_proj.weight");
    let want = g.dequantize(g.tensor("blk.0.ffn_up.weight").unwrap()).unwrap();
    assert_eq!(got_up, want, "multiples of 1/64 are exact in f16");
}

#[test]
fn unpermute_inverts_llama_cpp_permutation() {
    // One head of dim 4, one column: HF rows [a0, a1, b0, b1] (the halves rotate_half pairs:
    // a_r with b_r) are stored by llama.cpp as [a0, b0, a1, b1].
    assert_eq!(permute_rows(&[10.0, 11.0, 20.0, 21.0], 4, 1, 1), [10.0, 20.0, 11.0, 21.0]);
    assert_eq!(unpermute_rows(&[10.0, 20.0, 11.0, 21.0], 4, 1, 1), [10.0, 11.0, 20.0, 21.0]);
    // Two heads of dim 4, two columns: per head, independently.
    let hf: Vec<f32> = (0..16).map(|x| x as f32).collect();
    let stored = permute_rows(&hf, 8, 2, 2);
    assert_eq!(stored, [0., 1., 4., 5., 2., 3., 6., 7., 8., 9., 12., 13., 10., 11., 14., 15.]);
    assert_eq!(unpermute_rows(&stored, 8, 2, 2), hf);
}
