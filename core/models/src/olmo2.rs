//! OLMo 2 (OLMo Team 2024) — transformers' `modeling_olmo2.py`. Norms after attention and MLP
//! (`h + norm(attn(h))`, `h + norm(mlp(h))`, no input norm), RMSNorm scaled in f32 before the cast
//! back, and q/k RMSNorm over the whole projection (`heads · head_dim`) before the heads are split.

use std::path::Path;

use crate::config::{self, ArchConfig, BlockLayout, Defaults, Family, HfConfig, NormKind, QkNorm};
use crate::error::Result;

/// The keys OLMo 2 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[];

/// Resolves an OLMo 2 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults = Defaults { norm_eps: 1e-5, ..Defaults::default() };
    let mut arch = config::rotary_decoder(path, hf, Family::Olmo2, defaults)?;
    arch.norm = NormKind::RmsScaleInF32;
    arch.qk_norm = QkNorm::Projection;
    arch.layout = BlockLayout::PostNorm;
    Ok(arch)
}
