//! Gemma 4's text model (`gemma4_text`, Google DeepMind 2026) — transformers'
//! `modeling_gemma4.py`. Gemma 3's sandwich-norm layers, sliding and full attention as
//! `layer_types` says (by default five sliding layers, then a full one; the last layer always
//! full), scaled embeddings, a gated `gelu_pytorch_tanh` MLP and tied embeddings, with:
//! - RMSNorm as `w · x` in f32 (Gemma 3's stored `w` was `1 + w`), q/k norms per head, and the
//!   values RMS-normalised per head without a weight; the softmax scale is 1;
//! - full-attention layers with heads of their own size (`global_head_dim`, 512 by default) and,
//!   with `attention_k_eq_v`, `num_global_key_value_heads` KV heads whose values are the key
//!   projection (no `v_proj`); or whatever `per_layer_config` (transformers ≥ 5.23) says per layer;
//! - proportional RoPE on full layers (the first quarter of each head's frequency pairs rotate
//!   over the whole head size, `rope_type: proportional`), a plain RoPE on sliding ones;
//! - the last `num_kv_shared_layers` layers attend to the keys and values of the last earlier
//!   layer of their type (no k/v projections, nothing cached), with twice the MLP width under
//!   `use_double_wide_mlp`;
//! - per-layer input embeddings (`hidden_size_per_layer_input`): a token embedding and a
//!   projection of the input embeddings, `((norm(P · e · hidden^-½) + E_ple[ids] · √dim) / √2)`,
//!   whose slice `i` gates a residual branch after layer `i`'s MLP;
//! - `layer_scalar`, a stored constant each layer's output is multiplied by.
//!
//! The Hub's checkpoints are the multimodal `gemma4` ([`MULTIMODAL`]): the language model loads
//! from `text_config` and `model.language_model.*`; the vision and audio towers are kept as
//! loaded and saved back unchanged (prompts with images or audio are refused). With
//! `enable_moe_block` (the 26B-A4B model) every layer also runs a mixture of experts beside its
//! dense MLP ([`crate::layers::ExpertsBeside`]).

use std::path::Path;

use serde_json::Value;

use crate::config::rope::{self, RopeContext};
use crate::config::{
    self, ArchConfig, AttnKind, BlockLayout, Defaults, Family, Gemma4Layers, HeadGeometry, HfConfig, MoeConfig,
    Multimodal, NormKind, PerLayerInput, QkNorm,
};
use crate::error::{ModelError, Result};

/// The keys Gemma 4 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "hidden_activation",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "global_head_dim",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "use_double_wide_mlp",
    "per_layer_config",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
];

/// The Hub's Gemma 4 checkpoints (`Gemma4ForConditionalGeneration`).
pub(crate) const MULTIMODAL: Multimodal = Multimodal {
    model_type: "gemma4",
    text_model_type: "gemma4_text",
    family: Family::Gemma4,
    language_prefix: "model.language_model",
    vision_prefixes: &["model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."],
    classifier: "Gemma4ForSequenceClassification",
    keys: &[
        "vision_config",
        "audio_config",
        "boi_token_id",
        "eoi_token_id",
        "image_token_id",
        "video_token_id",
        "boa_token_id",
        "eoa_token_index",
        "audio_token_id",
    ],
    flat: false,
    vision: None,
    mrope_section: None,
    text_hook: None,
    legacy: None,
};

/// Resolves a `gemma4_text` `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    match &hf.use_bidirectional_attention {
        None | Some(Value::Null) => {}
        // Only image tokens attend both ways; a text prompt has none.
        Some(Value::String(s)) if s == "vision" => {}
        Some(v) => {
            return Err(ModelError::config(
                path,
                "use_bidirectional_attention",
                format!("{v}: bidirectional text attention (an embedding model) is not a causal LM"),
            ))
        }
    }
    let defaults = Defaults {
        head_dim: Some(256),
        max_position_embeddings: 131_072,
        tie_word_embeddings: true,
        activation: "gelu_pytorch_tanh",
        activation_key: "hidden_activation",
        rope_theta: 1_000_000.0,
        ..Defaults::default()
    };
    let mut hf_rope = hf.clone();
    hf_rope.rope_parameters = None; // parsed below per layer type
    hf_rope.rope_scaling = None;
    let mut arch = config::rotary_decoder(path, &hf_rope, Family::Gemma4, defaults)?;
    arch.norm = NormKind::RmsScaleInF32;
    arch.layout = BlockLayout::Sandwich;
    arch.qk_norm = QkNorm::PerHead;
    arch.embed_scale = Some((arch.hidden_size as f64).sqrt());
    arch.attn_scale = Some(1.0);
    arch.final_softcap = match &hf.final_logit_softcapping {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_f64() {
            Some(c) if c.is_finite() && c > 0.0 => Some(c),
            _ => {
                return Err(ModelError::config(
                    path,
                    "final_logit_softcapping",
                    format!("must be a positive number or null, got {v}"),
                ))
            }
        },
    };
    arch.sliding_window = match &hf.sliding_window {
        None => Some(512),
        Some(_) => config::sliding_window_value(path, hf)?,
    };
    let n = arch.num_layers as usize;
    let mut types = match config::layer_types_value(path, hf, n as i64)? {
        Some(t) => t,
        None => (0..n).map(|i| if (i + 1) % 6 != 0 { AttnKind::Sliding } else { AttnKind::Full }).collect(),
    };
    // transformers forces the last layer to full attention.
    if let Some(last) = types.last_mut() {
        *last = AttnKind::Full;
    }
    arch.layer_types = types;
    let heads = head_geometry(path, hf, &arch)?;
    let full_dim = same_dim(path, &arch, &heads, AttnKind::Full)?;
    let local_dim = same_dim(path, &arch, &heads, AttnKind::Sliding)?.unwrap_or(arch.head_dim);
    arch.rotary_dim = full_dim.unwrap_or(arch.head_dim);
    let ctx = RopeContext {
        max_position_embeddings: arch.max_position_embeddings,
        original_max_override: None,
        phi3_aliases: false,
    };
    let block = hf.rope_parameters.as_ref().filter(|v| !v.is_null());
    if block.is_some() && !crate::gemma::is_nested(block) {
        return Err(ModelError::config(
            path,
            "rope_parameters",
            "Gemma 4 keys its rotary parameters by layer type (full_attention, sliding_attention)",
        ));
    }
    let entry = |name: &str| block.and_then(|b| b.get(name)).filter(|v| !v.is_null()).cloned();
    let full_default = serde_json::json!({"rope_type": "proportional", "partial_rotary_factor": 0.25});
    let full = entry("full_attention").unwrap_or(full_default);
    arch.rope = Some(rope::parse_block(path, "rope_parameters.full_attention", Some(&full), 1_000_000.0, ctx)?);
    let local = entry("sliding_attention");
    arch.rope_local =
        Some(rope::parse_block(path, "rope_parameters.sliding_attention", local.as_ref(), 10_000.0, ctx)?);
    arch.gemma4 = Some(layers(path, hf, &arch, heads, local_dim)?);
    Ok(arch)
}

/// Each layer's head size and KV heads: `per_layer_config` where the config has one (as
/// transformers ≥ 5.23 writes it), else `global_head_dim` and (with `attention_k_eq_v`)
/// `num_global_key_value_heads` on the full-attention layers.
fn head_geometry(path: &Path, hf: &HfConfig, arch: &ArchConfig) -> Result<Vec<HeadGeometry>> {
    let base = HeadGeometry { head_dim: arch.head_dim, kv_heads: arch.num_kv_heads };
    let mut heads = vec![base; arch.layer_types.len()];
    match hf.per_layer_config.as_ref().filter(|v| !v.is_null()) {
        Some(v) => {
            let obj = v.as_object().ok_or_else(|| {
                ModelError::config(path, "per_layer_config", format!("expected an object keyed by layer, got {v}"))
            })?;
            for (layer, over) in obj {
                let key = format!("per_layer_config.{layer}");
                let i = layer.parse::<usize>().ok().filter(|i| *i < heads.len()).ok_or_else(|| {
                    ModelError::config(path, &key, format!("not a layer index below {}", heads.len()))
                })?;
                let over = over
                    .as_object()
                    .ok_or_else(|| ModelError::config(path, &key, format!("expected an object, got {over}")))?;
                for (name, value) in over {
                    let at = format!("{key}.{name}");
                    let number = value.as_i64().ok_or_else(|| {
                        ModelError::config(path, &at, format!("expected a positive integer, got {value}"))
                    })?;
                    match name.as_str() {
                        "head_dim" => heads[i].head_dim = config::require(path, &at, Some(number))?,
                        "num_key_value_heads" => heads[i].kv_heads = config::require(path, &at, Some(number))?,
                        _ => {
                            return Err(ModelError::config(
                                path,
                                &at,
                                "not a per-layer key this loader implements (refused rather than ignored)",
                            ))
                        }
                    }
                }
            }
        }
        None => {
            let global = config::require(path, "global_head_dim", Some(hf.global_head_dim.unwrap_or(512)))?;
            let kv = match (hf.attention_k_eq_v.unwrap_or(false), hf.num_global_key_value_heads) {
                (true, Some(kv)) => config::require(path, "num_global_key_value_heads", Some(kv))?,
                _ => arch.num_kv_heads,
            };
            for (h, t) in heads.iter_mut().zip(&arch.layer_types) {
                if *t == AttnKind::Full {
                    *h = HeadGeometry { head_dim: global, kv_heads: kv };
                }
            }
        }
    }
    for (i, h) in heads.iter().enumerate() {
        if h.head_dim % 2 != 0 || arch.num_heads % h.kv_heads != 0 {
            return Err(ModelError::config(
                path,
                "per_layer_config",
                format!(
                    "layer {i}: head_dim {} must be even and {} KV heads must divide {} heads",
                    h.head_dim, h.kv_heads, arch.num_heads
                ),
            ));
        }
    }
    Ok(heads)
}

/// The one head size of the layers of `kind` (their rotary tables are shared), if any has it.
fn same_dim(path: &Path, arch: &ArchConfig, heads: &[HeadGeometry], kind: AttnKind) -> Result<Option<i64>> {
    let mut dims = heads.iter().zip(&arch.layer_types).filter(|(_, t)| **t == kind).map(|(h, _)| h.head_dim);
    let first = dims.next();
    match (first, dims.find(|d| Some(*d) != first)) {
        (Some(a), Some(b)) => Err(ModelError::config(
            path,
            "per_layer_config",
            format!("{kind:?} layers with head sizes {a} and {b}: one size per layer type is implemented"),
        )),
        _ => Ok(first),
    }
}

/// The layers' Gemma 4 parts: shared keys and values, MLP widths, per-layer inputs.
fn layers(
    path: &Path,
    hf: &HfConfig,
    arch: &ArchConfig,
    heads: Vec<HeadGeometry>,
    local_rotary_dim: i64,
) -> Result<Gemma4Layers> {
    let n = arch.layer_types.len();
    let shared = hf.num_kv_shared_layers.unwrap_or(0);
    if shared < 0 || shared as usize >= n {
        return Err(ModelError::config(
            path,
            "num_kv_shared_layers",
            format!("{shared} of {n} layers: at least one layer must compute its own keys and values"),
        ));
    }
    let first_shared = n - shared as usize;
    let mut kv_source = vec![None; n];
    for (i, source) in kv_source.iter_mut().enumerate().skip(first_shared) {
        let t = arch.layer_types[i];
        let j = (0..first_shared).rev().find(|j| arch.layer_types[*j] == t).ok_or_else(|| {
            ModelError::config(
                path,
                "num_kv_shared_layers",
                format!("layer {i} ({t:?}) reuses keys and values, but no earlier layer of its type computes them"),
            )
        })?;
        if heads[j] != heads[i] {
            return Err(ModelError::config(
                path,
                "per_layer_config",
                format!("layer {i} reuses layer {j}'s keys and values with heads of another size"),
            ));
        }
        *source = Some(j);
    }
    let k_eq_v = hf.attention_k_eq_v.unwrap_or(false);
    let double = hf.use_double_wide_mlp.unwrap_or(false);
    let per_layer_input = match hf.hidden_size_per_layer_input.unwrap_or(256) {
        0 => None,
        dim => {
            let dim = config::require(path, "hidden_size_per_layer_input", Some(dim))?;
            let vocab = config::require(
                path,
                "vocab_size_per_layer_input",
                Some(hf.vocab_size_per_layer_input.unwrap_or(262_144)),
            )?;
            if vocab < arch.vocab_size {
                return Err(ModelError::config(
                    path,
                    "vocab_size_per_layer_input",
                    format!(
                        "{vocab} is below vocab_size {}: some tokens would have no per-layer input",
                        arch.vocab_size
                    ),
                ));
            }
            Some(PerLayerInput { dim, vocab })
        }
    };
    let moe = if hf.enable_moe_block == Some(true) {
        let num_experts = config::require(path, "num_experts", hf.num_experts)?;
        let top_k = config::require(path, "top_k_experts", hf.top_k_experts)?;
        if top_k > num_experts {
            return Err(ModelError::config(
                path,
                "top_k_experts",
                format!("{top_k} exceeds num_experts {num_experts}"),
            ));
        }
        Some(MoeConfig {
            num_experts,
            top_k,
            intermediate_size: config::require(path, "moe_intermediate_size", hf.moe_intermediate_size)?,
            norm_topk_prob: true,
            sparse_layers: vec![true; n],
            aux_loss_coef: None,
            shared_expert_intermediate_size: None,
            gpt_oss: None,
        })
    } else {
        None
    };
    Ok(Gemma4Layers {
        moe,
        values_are_keys: arch.layer_types.iter().map(|t| k_eq_v && *t == AttnKind::Full).collect(),
        intermediate: (0..n)
            .map(|i| if double && i >= first_shared { 2 * arch.intermediate_size } else { arch.intermediate_size })
            .collect(),
        heads,
        kv_source,
        per_layer_input,
        local_rotary_dim,
    })
}
