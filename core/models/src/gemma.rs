//! Gemma 2 (Gemma Team 2024) and Gemma 3's text model (`gemma3_text`, Gemma Team 2025) —
//! transformers' `modeling_gemma2.py` and `modeling_gemma3.py`. Sandwich norms (before and after
//! both attention and MLP), RMSNorm as `(1 + w) · x` in f32, embeddings scaled by √hidden (in the
//! weights' dtype), a gated `gelu_pytorch_tanh` MLP, softmax scale `query_pre_attn_scalar^-½`,
//! sliding-window and full layers as `layer_types` says (Gemma 2's default: even layers slide;
//! Gemma 3's: all but every `sliding_window_pattern`-th), tied embeddings. Gemma 2 soft-caps the
//! attention scores (computed eagerly, not through SDPA) and the final logits; Gemma 3 adds
//! per-head q/k norms and a second RoPE for sliding layers (`rope_local_base_freq`, or the
//! `sliding_attention` entry of a nested `rope_parameters`).

use std::path::Path;

use serde_json::Value;

use crate::config::rope::{self, RopeContext};
use crate::config::{self, ArchConfig, AttnKind, BlockLayout, Defaults, Family, HfConfig, NormKind, QkNorm};
use crate::error::{ModelError, Result};

/// The keys Gemma 2 and 3 implement beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "sliding_window_pattern",
    // What transformers 5 writes for the legacy pattern (superseded by `layer_types`).
    "_sliding_window_pattern",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
    "rope_local_base_freq",
];

/// Resolves a Gemma 2 or `gemma3_text` `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig, family: Family) -> Result<ArchConfig> {
    let gemma3 = family == Family::Gemma3;
    let defaults = Defaults {
        head_dim: Some(256),
        max_position_embeddings: if gemma3 { 131_072 } else { 8192 },
        tie_word_embeddings: true,
        activation: "gelu_pytorch_tanh",
        activation_key: "hidden_activation",
        rope_theta: if gemma3 { 1_000_000.0 } else { 10_000.0 },
        ..Defaults::default()
    };
    if hf.use_bidirectional_attention == Some(Value::Bool(true)) {
        return Err(ModelError::config(
            path,
            "use_bidirectional_attention",
            "bidirectional attention (an embedding model) is not a causal LM",
        ));
    }
    let mut hf_rope = hf.clone();
    let nested = gemma3 && is_nested(hf.rope_parameters.as_ref());
    if nested {
        // Parsed below per layer type.
        hf_rope.rope_parameters = None;
    }
    let mut arch = config::rotary_decoder(path, &hf_rope, family, defaults)?;
    arch.norm = NormKind::Gemma;
    arch.layout = BlockLayout::Sandwich;
    arch.embed_scale = Some((arch.hidden_size as f64).sqrt());
    let scalar = hf.query_pre_attn_scalar.unwrap_or(256.0);
    if !(scalar.is_finite() && scalar > 0.0) {
        return Err(ModelError::config(path, "query_pre_attn_scalar", format!("must be positive, got {scalar}")));
    }
    arch.attn_scale = Some(scalar.powf(-0.5));
    // Gemma 2 soft-caps by default; Gemma 3 does not. `null` turns a cap off.
    let cap = |key: &str, v: &Option<Value>, default: f64| -> Result<Option<f64>> {
        match v {
            None if gemma3 => Ok(None),
            None => Ok(Some(default)),
            Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(c) if c.is_finite() && c > 0.0 => Ok(Some(c)),
                _ => Err(ModelError::config(path, key, format!("must be a positive number or null, got {v}"))),
            },
        }
    };
    arch.attn_softcap = cap("attn_logit_softcapping", &hf.attn_logit_softcapping, 50.0)?;
    arch.final_softcap = cap("final_logit_softcapping", &hf.final_logit_softcapping, 30.0)?;
    arch.sliding_window = match &hf.sliding_window {
        None => Some(4096),
        Some(_) => config::sliding_window_value(path, hf)?,
    };
    let n = arch.num_layers;
    arch.layer_types = match config::layer_types_value(path, hf, n)? {
        Some(t) => t,
        None if gemma3 => {
            let pattern =
                config::require(path, "sliding_window_pattern", Some(hf.sliding_window_pattern.unwrap_or(6)))?;
            (0..n).map(|i| if (i + 1) % pattern != 0 { AttnKind::Sliding } else { AttnKind::Full }).collect()
        }
        None => (0..n).map(|i| if (i + 1) % 2 != 0 { AttnKind::Sliding } else { AttnKind::Full }).collect(),
    };
    if gemma3 {
        arch.qk_norm = QkNorm::PerHead;
        let ctx = RopeContext {
            max_position_embeddings: arch.max_position_embeddings,
            original_max_override: None,
            phi3_aliases: false,
        };
        let local_theta = hf.rope_local_base_freq.unwrap_or(10_000.0);
        if nested {
            let block = hf.rope_parameters.as_ref();
            let entry = |name: &str| block.and_then(|b| b.get(name)).filter(|v| !v.is_null());
            let key = |name: &str| format!("rope_parameters.{name}");
            arch.rope = Some(rope::parse_block(
                path,
                &key("full_attention"),
                entry("full_attention"),
                hf.rope_theta.unwrap_or(1_000_000.0),
                ctx,
            )?);
            arch.rope_local =
                Some(rope::parse_block(path, &key("sliding_attention"), entry("sliding_attention"), local_theta, ctx)?);
        } else {
            // Legacy keys: `rope_theta` and `rope_scaling` are the global RoPE, `rope_local_base_freq`
            // the local one's base.
            arch.rope_local = Some(rope::parse_block(path, "rope_local_base_freq", None, local_theta, ctx)?);
        }
    }
    Ok(arch)
}

/// Whether a `rope_parameters` block is keyed by layer type (Gemma 3 as transformers 5 writes it).
pub(crate) fn is_nested(block: Option<&Value>) -> bool {
    block
        .and_then(Value::as_object)
        .is_some_and(|o| o.contains_key("full_attention") || o.contains_key("sliding_attention"))
}
