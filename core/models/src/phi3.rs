//! Phi-3 (Abdin et al. 2024) and Phi-4-mini — transformers' `modeling_phi3.py`. Llama's pre-norm
//! decoder with q, k and v in one `qkv_proj` and gate and up in one `gate_up_proj`, rotary on the
//! leading `partial_rotary_factor` share of each head, LongRoPE (`longrope`, and the older `su`
//! and `yarn` spellings, which Phi-3 reads as LongRoPE) against a top-level
//! `original_max_position_embeddings`, and a sliding window on every layer when `sliding_window`
//! is set.

use std::path::Path;

use crate::config::rope::{self, RopeContext};
use crate::config::{self, ArchConfig, AttnKind, Defaults, Family, HfConfig};
use crate::error::{ModelError, Result};

/// The keys Phi-3 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] =
    &["original_max_position_embeddings", "partial_rotary_factor", "sliding_window"];

/// Resolves a Phi-3 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults = Defaults { norm_eps: 1e-5, max_position_embeddings: 4096, ..Defaults::default() };
    let mut arch = config::rotary_decoder(path, hf, Family::Phi3, defaults)?;
    // Phi-3 has no biases.
    arch.qkv_bias = false;
    arch.o_bias = false;
    arch.fused_qkv = true;
    arch.fused_gate_up = true;
    arch.rotary_dim = rope::rotary_dim(path, hf, arch.head_dim)?;
    let ctx = RopeContext {
        max_position_embeddings: arch.max_position_embeddings,
        original_max_override: Some(hf.original_max_position_embeddings.unwrap_or(4096)),
        phi3_aliases: true,
    };
    let (key, block) = rope::block(path, hf)?;
    let parsed = rope::parse_block(path, key, block, hf.rope_theta.unwrap_or(10_000.0), ctx)?;
    if !matches!(parsed.scaling, rope::RopeScaling::None | rope::RopeScaling::LongRope { .. }) {
        return Err(ModelError::config(path, &format!("{key}.rope_type"), "Phi-3 supports default and longrope only"));
    }
    if let rope::RopeScaling::LongRope { short_factor, long_factor, .. } = &parsed.scaling {
        let half = (arch.rotary_dim / 2) as usize;
        for (name, f) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if f.len() != half {
                return Err(ModelError::config(
                    path,
                    &format!("{key}.{name}"),
                    format!("has {} entries, expected rotary_dim / 2 = {half}", f.len()),
                ));
            }
        }
    }
    arch.rope = Some(parsed);
    arch.sliding_window = config::sliding_window_value(path, hf)?;
    arch.layer_types = vec![AttnKind::Sliding; arch.num_layers as usize];
    Ok(arch)
}
