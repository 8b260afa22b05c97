//! Llama (Touvron et al. 2023), Mistral (Jiang et al. 2023) and Qwen2 — transformers'
//! `modeling_llama.py`, `modeling_mistral.py`, `modeling_qwen2.py`. Pre-norm blocks with RMSNorm,
//! rotary positions, grouped-query attention and a SwiGLU MLP ([`crate::decoder`]). Mistral adds
//! a sliding window on every layer (`sliding_window`, 4096 when the key is absent, none when null);
//! Qwen2 a bias on q/k/v, and with `use_sliding_window` windows on the layers from
//! `max_window_layers` on (or as `layer_types` says).

use std::path::Path;

use crate::config::{self, ArchConfig, AttnKind, Defaults, Family, HfConfig};
use crate::error::Result;

/// The keys these families implement beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] =
    &["mlp_bias", "pretraining_tp", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types"];

/// Resolves a Llama, Mistral or Qwen2 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig, family: Family) -> Result<ArchConfig> {
    let defaults = match family {
        Family::Mistral => Defaults { max_position_embeddings: 4096 * 32, ..Defaults::default() },
        Family::Qwen2 => Defaults { max_position_embeddings: 32768, ..Defaults::default() },
        _ => Defaults::default(),
    };
    let mut arch = config::rotary_decoder(path, hf, family, defaults)?;
    let attention_bias = hf.attention_bias.unwrap_or(false);
    arch.qkv_bias = family == Family::Qwen2 || attention_bias;
    arch.o_bias = family != Family::Qwen2 && attention_bias;
    arch.mlp_bias = hf.mlp_bias.unwrap_or(false);
    match family {
        Family::Mistral => {
            // MistralConfig defaults `sliding_window` to 4096; `null` turns it off. Every layer slides.
            arch.sliding_window = match &hf.sliding_window {
                None => Some(4096),
                Some(_) => config::sliding_window_value(path, hf)?,
            };
            arch.layer_types = vec![AttnKind::Sliding; arch.num_layers as usize];
        }
        Family::Qwen2 => config::qwen_sliding(path, hf, &mut arch)?,
        _ => {
            // Llama has no window: `sliding_window` there would be a key it does not implement.
            if hf.sliding_window.as_ref().is_some_and(|v| !v.is_null()) || hf.use_sliding_window == Some(true) {
                return Err(crate::error::ModelError::config(
                    path,
                    "sliding_window",
                    "model_type `llama` has no sliding window (a Mistral checkpoint says model_type `mistral`)",
                ));
            }
        }
    }
    Ok(arch)
}
