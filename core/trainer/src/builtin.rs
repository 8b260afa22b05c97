//! The embedded default: a built-in task and a tiny Llama that `rlhf train --algo NAME` can run on a
//! CPU with nothing downloaded. The model is a real Hugging Face checkpoint written to disk
//! (`config.json`, safetensors, a word-level `tokenizer.json`), randomly initialised like
//! transformers does, so everything downstream — loading, generation, saving — is the same path a
//! real model takes; transformers loads it too.
//!
//! Task `builtin:addition`: prompts `a + b =` over single digits with `a + b <= 9`, label `a + b`;
//! a response is correct when its number equals the label (scored by `reward-rules`).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::data::RawPrompt;
use crate::error::{Result, TrainerError};

/// Words of the built-in vocabulary after the three specials (`<pad>`, `<eos>`, `<unk>`).
const WORDS: &[&str] = &["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", "the", "answer", "is"];

/// Prompts of `builtin:addition`, in a fixed order.
pub fn addition_prompts() -> Vec<RawPrompt> {
    let mut out = Vec::new();
    for a in 0..10u32 {
        for b in 0..10u32 {
            if a + b <= 9 {
                out.push(RawPrompt::Text {
                    prompt: format!("{a} + {b} ="),
                    label: Some((a + b).to_string()),
                    metadata: json!({"a": a, "b": b}),
                });
            }
        }
    }
    out
}

/// Prompts of a named built-in task.
pub fn task_prompts(name: &str) -> Result<Vec<RawPrompt>> {
    match name {
        "addition" => Ok(addition_prompts()),
        other => Err(TrainerError::Config(format!(
            "data.prompts: unknown built-in task `builtin:{other}` (available: builtin:addition)"
        ))),
    }
}

/// (prompt, correct response) pairs for the supervised warm-up of a built-in task.
pub fn task_demonstrations(name: &str) -> Result<Vec<(String, String)>> {
    Ok(task_prompts(name)?
        .into_iter()
        .filter_map(|p| match p {
            RawPrompt::Text { prompt, label: Some(l), .. } => Some((prompt, l)),
            _ => None,
        })
        .collect())
}

fn tokenizer_json() -> serde_json::Value {
    let specials = ["<pad>", "<eos>", "<unk>"];
    let mut vocab = serde_json::Map::new();
    for (i, w) in specials.iter().chain(WORDS).enumerate() {
        vocab.insert(w.to_string(), json!(i));
    }
    let added: Vec<_> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

/// Writes the tiny built-in model (random weights from `seed`) into `dir`.
///
/// Llama, hidden 64, 2 layers, 4 heads (2 KV heads), tied embeddings, vocabulary of 18 words.
pub fn write_tiny_model(dir: &Path, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let vocab = (3 + WORDS.len()) as i64;
    let (hidden, layers, heads, kv_heads, inter) = (64i64, 2i64, 4i64, 2i64, 128i64);
    let head_dim = hidden / heads;
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": inter,
        "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false,
        "bos_token_id": null, "eos_token_id": 1, "pad_token_id": 0, "dtype": "float32",
        "initializer_range": 0.02
    });
    let write = |name: &str, v: &serde_json::Value| rlhf_models::weights::write_json(&dir.join(name), v);
    write("config.json", &config)?;
    write("tokenizer.json", &tokenizer_json())?;
    write(
        "tokenizer_config.json",
        &json!({"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "bos_token": null,
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}),
    )?;
    write("generation_config.json", &json!({"eos_token_id": 1, "pad_token_id": 0}))?;

    tch::manual_seed(seed as i64);
    let opts = (Kind::Float, Device::Cpu);
    let normal = |shape: &[i64]| Tensor::randn(shape, opts) * 0.02;
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    t.insert("model.embed_tokens.weight".into(), normal(&[vocab, hidden]));
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        t.insert(format!("{p}.input_layernorm.weight"), Tensor::ones([hidden], opts));
        t.insert(format!("{p}.post_attention_layernorm.weight"), Tensor::ones([hidden], opts));
        t.insert(format!("{p}.self_attn.q_proj.weight"), normal(&[heads * head_dim, hidden]));
        t.insert(format!("{p}.self_attn.k_proj.weight"), normal(&[kv_heads * head_dim, hidden]));
        t.insert(format!("{p}.self_attn.v_proj.weight"), normal(&[kv_heads * head_dim, hidden]));
        t.insert(format!("{p}.self_attn.o_proj.weight"), normal(&[hidden, heads * head_dim]));
        t.insert(format!("{p}.mlp.gate_proj.weight"), normal(&[inter, hidden]));
        t.insert(format!("{p}.mlp.up_proj.weight"), normal(&[inter, hidden]));
        t.insert(format!("{p}.mlp.down_proj.weight"), normal(&[hidden, inter]));
    }
    t.insert("model.norm.weight".into(), Tensor::ones([hidden], opts));
    rlhf_models::weights::save_safetensors(dir, &t, rlhf_models::model::DEFAULT_MAX_SHARD_BYTES)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_model_loads_and_tokenizes() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), 1).unwrap();
        let tok = rlhf_tokenizer::HfTokenizer::from_dir(dir.path()).unwrap();
        let ids = tok.encode("3 + 4 =", true).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(tok.decode(&[ids[0], 1], true).unwrap(), "3");
        assert_eq!(tok.eos_token_ids(), &[1]);
        let m = rlhf_models::CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(m.arch().vocab_size, 18);
        assert_eq!(addition_prompts().len(), 55);
    }
}
