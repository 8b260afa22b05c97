//! OLMo 3 (OLMo Team 2025) — transformers' `modeling_olmo3.py`: OLMo 2's blocks (norms after
//! attention and MLP, RMSNorm scaled in f32, q/k RMSNorm over the whole projection) with
//! sliding-window attention on the layers `layer_types` names (by default three of every four,
//! every fourth layer full), and a RoPE per layer type: `rope_parameters.full_attention` and
//! `.sliding_attention` as transformers 5 writes them, or the legacy `rope_theta` for both with a
//! `rope_scaling` (YaRN in the long-context checkpoints) on the full-attention layers only.

use std::path::Path;

use crate::config::rope::{self, RopeContext};
use crate::config::{self, ArchConfig, AttnKind, BlockLayout, Defaults, Family, HfConfig, NormKind, QkNorm};
use crate::error::Result;

/// The keys OLMo 3 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &["sliding_window", "layer_types"];

/// transformers' `Olmo3Config.default_theta`.
const DEFAULT_THETA: f64 = 500_000.0;

/// Resolves an OLMo 3 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults = Defaults { norm_eps: 1e-5, rope_theta: DEFAULT_THETA, ..Defaults::default() };
    let nested = crate::gemma::is_nested(hf.rope_parameters.as_ref());
    let mut hf_rope = hf.clone();
    if nested {
        // Parsed below per layer type.
        hf_rope.rope_parameters = None;
    }
    let mut arch = config::rotary_decoder(path, &hf_rope, Family::Olmo3, defaults)?;
    arch.norm = NormKind::RmsScaleInF32;
    arch.qk_norm = QkNorm::Projection;
    arch.layout = BlockLayout::PostNorm;
    arch.sliding_window = match &hf.sliding_window {
        None => Some(4096),
        Some(_) => config::sliding_window_value(path, hf)?,
    };
    let n = arch.num_layers;
    arch.layer_types = match config::layer_types_value(path, hf, n)? {
        Some(t) => t,
        None => (0..n).map(|i| if (i + 1) % 4 != 0 { AttnKind::Sliding } else { AttnKind::Full }).collect(),
    };
    let ctx = RopeContext {
        max_position_embeddings: arch.max_position_embeddings,
        original_max_override: None,
        phi3_aliases: false,
    };
    let theta = hf.rope_theta.unwrap_or(DEFAULT_THETA);
    if nested {
        let block = hf.rope_parameters.as_ref();
        let entry = |name: &str| block.and_then(|b| b.get(name)).filter(|v| !v.is_null());
        let key = |name: &str| format!("rope_parameters.{name}");
        arch.rope = Some(rope::parse_block(path, &key("full_attention"), entry("full_attention"), theta, ctx)?);
        arch.rope_local =
            Some(rope::parse_block(path, &key("sliding_attention"), entry("sliding_attention"), theta, ctx)?);
    } else {
        // `rope_scaling` belongs to the full-attention layers; the sliding ones rotate plainly.
        arch.rope_local = Some(rope::parse_block(path, "rope_theta", None, theta, ctx)?);
    }
    Ok(arch)
}
