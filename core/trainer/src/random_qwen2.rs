//! Randomly initialised Qwen2-shaped checkpoints for benchmarks and `rlhf doctor`, written by
//! `rlhf` itself (no Python, no download): the shapes of Qwen2.5 (`0.5b`: 494M parameters) or a
//! small one for CPUs, weights drawn as transformers initialises Qwen2 (normal(0, 0.02) matrices,
//! zero biases, norms at one), tied embeddings, and a word-level tokenizer covering the whole
//! vocabulary (the ChatML specials, the built-in addition task's words, then filler words `w<i>`)
//! with a ChatML chat template, so every id the model can sample decodes and the built-in prompts
//! encode. transformers loads the result as a `Qwen2ForCausalLM` (the same layout as
//! `xtask/scripts/make_qwen2_random.py` writes).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainerError};

/// A Qwen2 shape: hidden size, layers, query and key/value heads, MLP width, vocabulary, positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qwen2Shape {
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate: i64,
    pub vocab: i64,
    pub max_positions: i64,
}

impl Qwen2Shape {
    /// Qwen2.5-0.5B's shape: 494M parameters with the tied embedding counted once.
    pub const HALF_B: Qwen2Shape = Qwen2Shape {
        hidden: 896,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        intermediate: 4864,
        vocab: 151_936,
        max_positions: 32_768,
    };
    /// A 3.9M-parameter shape whose steps take seconds on a CPU.
    pub const SMALL: Qwen2Shape = Qwen2Shape {
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        intermediate: 704,
        vocab: 4096,
        max_positions: 2048,
    };

    /// Parameters stored (the tied LM head counted once).
    pub fn params(&self) -> i64 {
        let head_dim = self.hidden / self.heads;
        let attn =
            self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads) + head_dim * (self.heads + 2 * self.kv_heads);
        let mlp = 3 * self.hidden * self.intermediate;
        self.vocab * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden
    }
}

/// The ChatML specials: `<|endoftext|>` (pad and unknown, id 0), `<|im_start|>`, `<|im_end|>` (EOS, id 2).
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Words of the built-in addition task and its chat turns.
const WORDS: [&str; 28] = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "+",
    "-",
    "*",
    "=",
    ".",
    ",",
    "?",
    "the",
    "answer",
    "is",
    "what",
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "a",
    "helpful",
];
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A word-level `tokenizer.json` of exactly `vocab` entries.
fn tokenizer_json(vocab: i64) -> serde_json::Value {
    let words = WORDS.iter().map(|w| w.to_string()).chain((0..).map(|i| format!("w{i}")));
    let words = words.take(vocab as usize - SPECIALS.len());
    crate::builtin_tokenizer::word_level_tokenizer(&SPECIALS, words, "<|endoftext|>")
}

/// Writes a random Qwen2 checkpoint of `shape` into `dir` (created), its weights stored in `kind`
/// (f32 or bf16), drawn from `seed`. Returns the number of parameters stored.
pub fn write_qwen2(dir: &Path, shape: &Qwen2Shape, kind: Kind, seed: u64) -> Result<i64> {
    let dtype = match kind {
        Kind::Float => "float32",
        Kind::BFloat16 => "bfloat16",
        other => return Err(TrainerError::Config(format!("random Qwen2: dtype {other:?} (f32 or bf16)"))),
    };
    if shape.vocab < (SPECIALS.len() + WORDS.len()) as i64 || shape.hidden % shape.heads != 0 {
        return Err(TrainerError::Config(format!("random Qwen2: unusable shape {shape:?}")));
    }
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let write = |name: &str, v: &serde_json::Value| rlhf_models::weights::write_json(&dir.join(name), v);
    let s = shape;
    write(
        "config.json",
        &json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": s.vocab,
            "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "intermediate_size": s.intermediate, "hidden_act": "silu",
            "max_position_embeddings": s.max_positions, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": null,
            "max_window_layers": s.layers, "attention_dropout": 0.0, "bos_token_id": null, "eos_token_id": 2,
            "pad_token_id": 0, "initializer_range": 0.02, "dtype": dtype
        }),
    )?;
    write("tokenizer.json", &tokenizer_json(s.vocab))?;
    write(
        "tokenizer_config.json",
        &json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": null, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": s.max_positions,
                "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": false}),
    )?;
    write("generation_config.json", &json!({"bos_token_id": null, "eos_token_id": 2, "pad_token_id": 0}))?;

    tch::manual_seed(seed as i64);
    let normal = |shape: &[i64]| (Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.02).to_kind(kind);
    let ones = |n: i64| Tensor::ones([n], (kind, Device::Cpu));
    let zeros = |n: i64| Tensor::zeros([n], (kind, Device::Cpu));
    let head_dim = s.hidden / s.heads;
    let (q, kv) = (s.heads * head_dim, s.kv_heads * head_dim);
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    t.insert("model.embed_tokens.weight".into(), normal(&[s.vocab, s.hidden]));
    for i in 0..s.layers {
        let p = format!("model.layers.{i}");
        t.insert(format!("{p}.input_layernorm.weight"), ones(s.hidden));
        t.insert(format!("{p}.post_attention_layernorm.weight"), ones(s.hidden));
        for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            t.insert(format!("{p}.self_attn.{name}.weight"), normal(&[rows, s.hidden]));
            t.insert(format!("{p}.self_attn.{name}.bias"), zeros(rows));
        }
        t.insert(format!("{p}.self_attn.o_proj.weight"), normal(&[s.hidden, q]));
        t.insert(format!("{p}.mlp.gate_proj.weight"), normal(&[s.intermediate, s.hidden]));
        t.insert(format!("{p}.mlp.up_proj.weight"), normal(&[s.intermediate, s.hidden]));
        t.insert(format!("{p}.mlp.down_proj.weight"), normal(&[s.hidden, s.intermediate]));
    }
    t.insert("model.norm.weight".into(), ones(s.hidden));
    rlhf_models::weights::save_safetensors(dir, &t, rlhf_models::model::DEFAULT_MAX_SHARD_BYTES)?;
    Ok(t.values().map(|x| x.numel() as i64).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_small_shape_loads_counts_and_tokenizes() {
        let dir = tempfile::tempdir().unwrap();
        let stored = write_qwen2(dir.path(), &Qwen2Shape::SMALL, Kind::BFloat16, 3).unwrap();
        assert_eq!(stored, Qwen2Shape::SMALL.params());
        let m = rlhf_models::CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(m.arch().vocab_size, 4096);
        let tok = rlhf_tokenizer::HfTokenizer::from_dir(dir.path()).unwrap();
        tok.check_fits_vocab(4096).unwrap();
        assert_eq!(tok.eos_token_ids(), &[2]);
        let ids = tok.encode("what is 3 + 4 ?", false).unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(tok.decode(&[4095], true).unwrap(), format!("w{}", 4095 - 31));
        // Qwen2.5-0.5B's published size, and the 3.9M the docs give for the small shape.
        assert_eq!(Qwen2Shape::HALF_B.params(), 494_032_768);
        assert_eq!(Qwen2Shape::SMALL.params(), 3_870_464);
    }
}
