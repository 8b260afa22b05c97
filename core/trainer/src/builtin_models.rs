//! The built-in models `rlhf` can train with nothing downloaded: real Hugging Face checkpoints
//! (`config.json`, safetensors, a word-level `tokenizer.json`) written into the run directory,
//! randomly initialised like transformers does (normal(0, 0.02) weights, norms at one), so
//! loading, generation and saving take the same path a real model takes; transformers loads them.
//!
//! - `builtin:tiny`: Llama, hidden 64, 2 layers, 4 heads (2 KV heads), tied embeddings, over the
//!   addition task's 18 words.
//! - `builtin:tiny-calc`: the same Llama over the calculator task's vocabulary.
//! - `builtin:tiny-qwen3`: Qwen3 (per-head q/k norms, `head_dim` 32 ≠ hidden / heads), same
//!   vocabulary as `tiny`.
//! - `builtin:tiny-qwen3-moe`: Qwen3-MoE, 4 experts of intermediate size 64, 2 routed per token,
//!   renormalised, on both layers.
//! - `builtin:tiny-qwen3.5`: Qwen3.5's hybrid text model: a Gated DeltaNet layer (2 key heads of 16
//!   serving 4 value heads of 16) then a gated full-attention layer rotating a quarter of each head;
//!   its `1 + w` norms start at zero as transformers initialises them.
//! - `builtin:tiny-qwen2.5-vl`: Qwen2.5-VL with a vision tower, over the words of the built-in
//!   visual task ([`crate::builtin_vl`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::builtin::{tokenizer_json, WORDS};
use crate::error::{Result, TrainerError};

/// The built-in models, by the name after `builtin:`.
pub const MODELS: &[&str] = &["tiny", "tiny-calc", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3.5", "tiny-qwen2.5-vl"];

/// The families the built-in models come in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen3,
    Qwen3Moe,
    Qwen3_5,
}

/// Writes the built-in model `name` ([`MODELS`]) with random weights from `seed` into `dir`.
pub fn write_model(name: &str, dir: &Path, seed: u64) -> Result<()> {
    let words = (3 + WORDS.len()) as i64;
    match name {
        "tiny" => write_tiny_model(dir, seed),
        "tiny-calc" => {
            let (tokenizer, vocab) = crate::builtin_calc::tokenizer_json();
            write_decoder(dir, seed, &tokenizer, vocab, Arch::Llama)
        }
        "tiny-qwen3" => write_decoder(dir, seed, &tokenizer_json(), words, Arch::Qwen3),
        "tiny-qwen3-moe" => write_decoder(dir, seed, &tokenizer_json(), words, Arch::Qwen3Moe),
        "tiny-qwen3.5" => write_decoder(dir, seed, &tokenizer_json(), words, Arch::Qwen3_5),
        "tiny-qwen2.5-vl" => crate::builtin_vl::write_model(dir, seed),
        other => Err(TrainerError::Config(format!(
            "unknown built-in model `builtin:{other}` (available: {})",
            MODELS.iter().map(|m| format!("builtin:{m}")).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Writes the tiny built-in Llama (random weights from `seed`) into `dir`.
pub fn write_tiny_model(dir: &Path, seed: u64) -> Result<()> {
    write_decoder(dir, seed, &tokenizer_json(), (3 + WORDS.len()) as i64, Arch::Llama)
}

/// The shape every tiny model shares: hidden size, layers, query and key/value heads, MLP size.
const HIDDEN: i64 = 64;
const LAYERS: i64 = 2;
const HEADS: i64 = 4;
const KV_HEADS: i64 = 2;
const INTER: i64 = 128;

/// The tiny Qwen3.5's Gated DeltaNet: key heads, value heads, each head's size, convolution width.
const LINEAR_KEY_HEADS: i64 = 2;
const LINEAR_VALUE_HEADS: i64 = 4;
const LINEAR_HEAD_DIM: i64 = 16;
const CONV_KERNEL: i64 = 4;

/// Experts of the tiny MoE, routed per token, and each expert's intermediate size.
const EXPERTS: i64 = 4;
const TOP_K: i64 = 2;
const EXPERT_INTER: i64 = 64;

/// `config.json` of the tiny model of `arch`.
fn config(arch: Arch, vocab: i64, head_dim: i64) -> serde_json::Value {
    let (hidden, layers, heads, kv_heads, inter) = (HIDDEN, LAYERS, HEADS, KV_HEADS, INTER);
    let mut c = json!({
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": inter, "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "attention_bias": false,
        "bos_token_id": null, "eos_token_id": 1, "pad_token_id": 0, "dtype": "float32",
        "initializer_range": 0.02
    });
    let extra = match arch {
        Arch::Llama => json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": false}),
        Arch::Qwen3 => {
            json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": false})
        }
        Arch::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "use_sliding_window": false,
            "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_INTER,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": []
        }),
        Arch::Qwen3_5 => json!({
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "tie_word_embeddings": false,
            "layer_types": ["linear_attention", "full_attention"], "attn_output_gate": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "linear_num_key_heads": LINEAR_KEY_HEADS, "linear_num_value_heads": LINEAR_VALUE_HEADS,
            "linear_key_head_dim": LINEAR_HEAD_DIM, "linear_value_head_dim": LINEAR_HEAD_DIM,
            "linear_conv_kernel_dim": CONV_KERNEL
        }),
    };
    if arch == Arch::Qwen3_5 {
        if let Some(c) = c.as_object_mut() {
            c.remove("rope_theta");
        }
    }
    if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    c
}

/// The tiny decoder of `arch` with `tokenizer` (`vocab` entries; `<pad>` 0, `<eos>` 1, `<unk>` 2).
fn write_decoder(dir: &Path, seed: u64, tokenizer: &serde_json::Value, vocab: i64, arch: Arch) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let (hidden, layers, heads, kv_heads, inter) = (HIDDEN, LAYERS, HEADS, KV_HEADS, INTER);
    // Qwen3's head_dim is its own (here twice hidden / heads); Llama's is hidden / heads.
    let head_dim = if arch == Arch::Llama { hidden / heads } else { 2 * hidden / heads };
    let write = |name: &str, v: &serde_json::Value| rlhf_models::weights::write_json(&dir.join(name), v);
    write("config.json", &config(arch, vocab, head_dim))?;
    write("tokenizer.json", tokenizer)?;
    crate::builtin_tokenizer::write_tokenizer_files(dir, 64)?;

    tch::manual_seed(seed as i64);
    let opts = (Kind::Float, Device::Cpu);
    let normal = |shape: &[i64]| Tensor::randn(shape, opts) * 0.02;
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    // Qwen3.5's norms scale by `1 + w`: one is zero there.
    let unit = |n: i64| if arch == Arch::Qwen3_5 { Tensor::zeros([n], opts) } else { Tensor::ones([n], opts) };
    t.insert("model.embed_tokens.weight".into(), normal(&[vocab, hidden]));
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        t.insert(format!("{p}.input_layernorm.weight"), unit(hidden));
        t.insert(format!("{p}.post_attention_layernorm.weight"), unit(hidden));
        if arch == Arch::Qwen3_5 && i == 0 {
            linear_attention(&mut t, &format!("{p}.linear_attn"), &normal);
        } else {
            if arch != Arch::Llama {
                t.insert(format!("{p}.self_attn.q_norm.weight"), unit(head_dim));
                t.insert(format!("{p}.self_attn.k_norm.weight"), unit(head_dim));
            }
            // Qwen3.5 projects each head's output gate with its query.
            let q_rows = if arch == Arch::Qwen3_5 { 2 * heads * head_dim } else { heads * head_dim };
            t.insert(format!("{p}.self_attn.q_proj.weight"), normal(&[q_rows, hidden]));
            t.insert(format!("{p}.self_attn.k_proj.weight"), normal(&[kv_heads * head_dim, hidden]));
            t.insert(format!("{p}.self_attn.v_proj.weight"), normal(&[kv_heads * head_dim, hidden]));
            t.insert(format!("{p}.self_attn.o_proj.weight"), normal(&[hidden, heads * head_dim]));
        }
        if arch == Arch::Qwen3Moe {
            t.insert(format!("{p}.mlp.gate.weight"), normal(&[EXPERTS, hidden]));
        }
        let mut mlp = |prefix: String, inter: i64| {
            t.insert(format!("{prefix}.gate_proj.weight"), normal(&[inter, hidden]));
            t.insert(format!("{prefix}.up_proj.weight"), normal(&[inter, hidden]));
            t.insert(format!("{prefix}.down_proj.weight"), normal(&[hidden, inter]));
        };
        if arch == Arch::Qwen3Moe {
            for e in 0..EXPERTS {
                mlp(format!("{p}.mlp.experts.{e}"), EXPERT_INTER);
            }
        } else {
            mlp(format!("{p}.mlp"), inter);
        }
    }
    t.insert("model.norm.weight".into(), unit(hidden));
    if arch == Arch::Qwen3_5 {
        t.insert("lm_head.weight".into(), normal(&[vocab, hidden]));
    }
    rlhf_models::weights::save_safetensors(dir, &t, rlhf_models::model::DEFAULT_MAX_SHARD_BYTES)?;
    Ok(())
}

/// A Gated DeltaNet layer's tensors under `p`, initialised as transformers does: projections and
/// convolution normal(0, 0.02), `dt_bias` one, `A_log` the log of uniform(0.01, 16) (the decay
/// rates), the gated norm's weight one.
fn linear_attention(t: &mut BTreeMap<String, Tensor>, p: &str, normal: &dyn Fn(&[i64]) -> Tensor) {
    let opts = (Kind::Float, Device::Cpu);
    let (keys, values) = (LINEAR_KEY_HEADS * LINEAR_HEAD_DIM, LINEAR_VALUE_HEADS * LINEAR_HEAD_DIM);
    let conv_dim = 2 * keys + values;
    t.insert(format!("{p}.in_proj_qkv.weight"), normal(&[conv_dim, HIDDEN]));
    t.insert(format!("{p}.in_proj_z.weight"), normal(&[values, HIDDEN]));
    t.insert(format!("{p}.in_proj_b.weight"), normal(&[LINEAR_VALUE_HEADS, HIDDEN]));
    t.insert(format!("{p}.in_proj_a.weight"), normal(&[LINEAR_VALUE_HEADS, HIDDEN]));
    t.insert(format!("{p}.conv1d.weight"), normal(&[conv_dim, 1, CONV_KERNEL]));
    t.insert(format!("{p}.dt_bias"), Tensor::ones([LINEAR_VALUE_HEADS], opts));
    t.insert(format!("{p}.A_log"), (Tensor::rand([LINEAR_VALUE_HEADS], opts) * 15.99 + 0.01).log());
    t.insert(format!("{p}.norm.weight"), Tensor::ones([LINEAR_HEAD_DIM], opts));
    t.insert(format!("{p}.out_proj.weight"), normal(&[HIDDEN, values]));
}
