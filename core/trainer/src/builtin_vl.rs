//! `builtin:tiny-qwen2.5-vl`: a tiny random Qwen2.5-VL over the words of the built-in visual task
//! ([`crate::builtin_shapes`]), written as the Hub stores the family — a flat `config.json` with
//! `vision_config` and `rope_scaling: {"type": "mrope"}`, the tensors under `model.layers.*` and
//! `visual.*` — and initialised as transformers does (normal(0, 0.02) weights, zero biases, norms
//! at one). The language model is the tiny models' (hidden 64, 2 layers, 4 heads of 16, 2 KV heads,
//! q/k/v biases, tied embeddings; the multimodal RoPE's sections 2 + 3 + 3); the vision tower has 2
//! blocks of width 32 (the second with full attention, the first windowed over 56 pixels), patches
//! of 14 × 14 × 2 frames, and merges 2 × 2 patches into one token of the language model.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::builtin_shapes::{tokenizer_json, SPECIALS, WORDS};
use crate::error::{Result, TrainerError};

/// The sizes of a random Qwen2.5-VL over the task's words.
#[derive(Debug, Clone, Copy)]
pub struct VlShape {
    pub hidden: i64,
    pub layers: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub inter: i64,
    pub vision_hidden: i64,
    pub vision_depth: i64,
    pub vision_heads: i64,
    pub vision_inter: i64,
    pub max_positions: i64,
}

impl VlShape {
    /// `builtin:tiny-qwen2.5-vl`'s (module docs).
    pub const TINY: VlShape = VlShape {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        inter: 128,
        vision_hidden: 32,
        vision_depth: 2,
        vision_heads: 2,
        vision_inter: 64,
        max_positions: 256,
    };

    /// About 100M parameters (`rlhf bench --model builtin:qwen2.5-vl-100m`): a language model of
    /// 12 layers of width 512 (8 heads of 64, 4 KV heads) and a tower of 12 blocks of width 640 (10
    /// heads), every fourth block with full attention.
    pub const SMALL: VlShape = VlShape {
        hidden: 512,
        layers: 12,
        heads: 8,
        kv_heads: 4,
        inter: 1408,
        vision_hidden: 640,
        vision_depth: 12,
        vision_heads: 10,
        vision_inter: 1712,
        max_positions: 2048,
    };

    fn head_dim(&self) -> i64 {
        self.hidden / self.heads
    }

    /// The tower's full-attention blocks: the last of every four.
    fn full_attention_blocks(&self) -> Vec<i64> {
        (0..self.vision_depth).filter(|b| b % 4 == 3 || *b == self.vision_depth - 1).collect()
    }
}

const PATCH: i64 = 14;
const TEMPORAL: i64 = 2;
const MERGE: i64 = 2;

/// Token ids of the vision specials ([`SPECIALS`]).
const VISION_START: i64 = 3;
const VISION_END: i64 = 4;
const IMAGE_PAD: i64 = 5;
const VIDEO_PAD: i64 = 6;

/// `config.json`, as the Hub writes Qwen2.5-VL's; the multimodal RoPE splits a head's frequencies
/// a quarter to time, the rest between height and width (Qwen2.5-VL's 16 + 24 + 24 of 64).
fn config(vocab: i64, s: &VlShape) -> serde_json::Value {
    let half = s.head_dim() / 2;
    let (t, hw) = (half / 4, half - half / 4);
    json!({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "intermediate_size": s.inter,
        "hidden_act": "silu", "max_position_embeddings": s.max_positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [t, hw / 2, hw - hw / 2]},
        "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": null,
        "bos_token_id": null, "eos_token_id": 1, "pad_token_id": 0, "dtype": "float32", "initializer_range": 0.02,
        "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
        "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD,
        "vision_config": {
            "depth": s.vision_depth, "hidden_size": s.vision_hidden, "num_heads": s.vision_heads,
            "intermediate_size": s.vision_inter, "out_hidden_size": s.hidden, "hidden_act": "silu",
            "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "spatial_merge_size": MERGE,
            "in_chans": 3, "window_size": 56, "fullatt_block_indexes": s.full_attention_blocks(),
            "tokens_per_second": 2, "initializer_range": 0.02
        }
    })
}

/// Writes `builtin:tiny-qwen2.5-vl` with random weights from `seed` into `dir`.
pub fn write_model(dir: &Path, seed: u64) -> Result<()> {
    write_shaped(dir, &VlShape::TINY, seed)
}

/// Writes a random Qwen2.5-VL of shape `s` over the task's words, from `seed`, into `dir`.
pub fn write_shaped(dir: &Path, s: &VlShape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let vocab = (SPECIALS.len() + WORDS.len()) as i64;
    let write = |name: &str, v: &serde_json::Value| rlhf_models::weights::write_json(&dir.join(name), v);
    write("config.json", &config(vocab, s))?;
    write("tokenizer.json", &tokenizer_json())?;
    crate::builtin_tokenizer::write_tokenizer_files(dir, 256)?;
    write(
        "preprocessor_config.json",
        &json!({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH,
                "temporal_patch_size": TEMPORAL, "merge_size": MERGE, "min_pixels": 3136, "max_pixels": 12845056,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                "do_resize": true, "do_rescale": true, "rescale_factor": 1.0 / 255.0, "do_normalize": true,
                "do_convert_rgb": true}),
    )?;

    tch::manual_seed(seed as i64);
    let opts = (Kind::Float, Device::Cpu);
    let normal = |shape: &[i64]| Tensor::randn(shape, opts) * 0.02;
    let (zeros, ones) = (|n: i64| Tensor::zeros([n], opts), |n: i64| Tensor::ones([n], opts));
    let mut t: BTreeMap<String, Tensor> = BTreeMap::new();
    let (hidden, hd) = (s.hidden, s.head_dim());
    t.insert("model.embed_tokens.weight".into(), normal(&[vocab, hidden]));
    for i in 0..s.layers {
        let p = format!("model.layers.{i}");
        t.insert(format!("{p}.input_layernorm.weight"), ones(hidden));
        t.insert(format!("{p}.post_attention_layernorm.weight"), ones(hidden));
        for (name, rows) in [("q_proj", s.heads * hd), ("k_proj", s.kv_heads * hd), ("v_proj", s.kv_heads * hd)] {
            t.insert(format!("{p}.self_attn.{name}.weight"), normal(&[rows, hidden]));
            t.insert(format!("{p}.self_attn.{name}.bias"), zeros(rows));
        }
        t.insert(format!("{p}.self_attn.o_proj.weight"), normal(&[hidden, s.heads * hd]));
        t.insert(format!("{p}.mlp.gate_proj.weight"), normal(&[s.inter, hidden]));
        t.insert(format!("{p}.mlp.up_proj.weight"), normal(&[s.inter, hidden]));
        t.insert(format!("{p}.mlp.down_proj.weight"), normal(&[hidden, s.inter]));
    }
    t.insert("model.norm.weight".into(), ones(hidden));
    tower(&mut t, s, &normal);
    rlhf_models::weights::save_safetensors(dir, &t, rlhf_models::model::DEFAULT_MAX_SHARD_BYTES)?;
    Ok(())
}

/// The vision tower's tensors (`visual.*`): the patch embedding (a 3-D convolution without bias),
/// the blocks (RMSNorms, fused qkv and output projections, the biased SwiGLU), and the merger
/// (RMSNorm over each patch, then a two-layer MLP over each 2 × 2 group of patches).
fn tower(t: &mut BTreeMap<String, Tensor>, s: &VlShape, normal: &dyn Fn(&[i64]) -> Tensor) {
    let opts = (Kind::Float, Device::Cpu);
    let (zeros, ones) = (|n: i64| Tensor::zeros([n], opts), |n: i64| Tensor::ones([n], opts));
    let (h, inter) = (s.vision_hidden, s.vision_inter);
    t.insert("visual.patch_embed.proj.weight".into(), normal(&[h, 3, TEMPORAL, PATCH, PATCH]));
    for b in 0..s.vision_depth {
        let p = format!("visual.blocks.{b}");
        t.insert(format!("{p}.norm1.weight"), ones(h));
        t.insert(format!("{p}.norm2.weight"), ones(h));
        t.insert(format!("{p}.attn.qkv.weight"), normal(&[3 * h, h]));
        t.insert(format!("{p}.attn.qkv.bias"), zeros(3 * h));
        t.insert(format!("{p}.attn.proj.weight"), normal(&[h, h]));
        t.insert(format!("{p}.attn.proj.bias"), zeros(h));
        for (name, shape) in [("gate_proj", [inter, h]), ("up_proj", [inter, h]), ("down_proj", [h, inter])] {
            t.insert(format!("{p}.mlp.{name}.weight"), normal(&shape));
            t.insert(format!("{p}.mlp.{name}.bias"), zeros(shape[0]));
        }
    }
    let merged = h * MERGE * MERGE;
    t.insert("visual.merger.ln_q.weight".into(), ones(h));
    t.insert("visual.merger.mlp.0.weight".into(), normal(&[merged, merged]));
    t.insert("visual.merger.mlp.0.bias".into(), zeros(merged));
    t.insert("visual.merger.mlp.2.weight".into(), normal(&[s.hidden, merged]));
    t.insert("visual.merger.mlp.2.bias".into(), zeros(s.hidden));
}
