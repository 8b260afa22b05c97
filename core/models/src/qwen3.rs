//! Qwen3 (Qwen Team 2025) — transformers' `modeling_qwen3.py`. Llama's pre-norm decoder with an
//! RMSNorm on each query and key head (`q_norm`, `k_norm` over `head_dim`) before RoPE, `head_dim`
//! independent of `hidden_size / num_attention_heads` (128 when the key is absent), a bias on
//! every attention projection when `attention_bias`, and Qwen2's optional sliding windows.

use std::path::Path;

use crate::config::{self, ArchConfig, Defaults, Family, HfConfig, QkNorm};
use crate::error::Result;

/// The keys Qwen3 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &["sliding_window", "use_sliding_window", "max_window_layers", "layer_types"];

/// Resolves a Qwen3 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults = Defaults { head_dim: Some(128), max_position_embeddings: 32768, ..Defaults::default() };
    let mut arch = config::rotary_decoder(path, hf, Family::Qwen3, defaults)?;
    arch.qk_norm = QkNorm::PerHead;
    config::qwen_sliding(path, hf, &mut arch)?;
    Ok(arch)
}
