//! RoPE scaling from a GGUF's metadata and tensors, as transformers' `rope_scaling`: Phi-3's
//! LongRoPE factor tensors and YaRN.

use serde_json::{json, Value};

use crate::error::{GgufError, Result};
use crate::linear::ARCHITECTURES as HYBRID;
use crate::reader::GgufFile;

/// Phi-3's LongRoPE factor tensors, which its converter writes for the 128k models (read as
/// [`LlamaParams::rope_scaling`], not imported as weights).
pub(crate) const ROPE_FACTORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

/// Phi-3's LongRoPE as transformers' `rope_scaling` — the per-frequency factors of long and short
/// contexts, `rotary_dim / 2` of each, as `f32` tensors — or `None` where the file has neither.
pub(crate) fn long_rope_factors(g: &GgufFile, rotary_dim: u64) -> Result<Option<Value>> {
    let [long, short] = ROPE_FACTORS.map(|n| g.tensor(n));
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        _ => return Err(GgufError::invalid(g.path(), "the file has only one of the two LongRoPE factor tensors")),
    };
    let mut factors = Vec::with_capacity(2);
    for info in [long, short] {
        if info.dims != [rotary_dim / 2] {
            return Err(GgufError::invalid(
                g.path(),
                format!(
                    "`{}` has dims {:?}, expected [{}] (half the rotary dimensions)",
                    info.name,
                    info.dims,
                    rotary_dim / 2
                ),
            ));
        }
        factors.push(g.dequantize(info)?.into_iter().map(f64::from).collect::<Vec<f64>>());
    }
    Ok(Some(json!({"rope_type": "longrope", "long_factor": factors[0], "short_factor": factors[1]})))
}

/// YaRN as transformers' `rope_scaling`: the factor and the original context the file gives, its
/// `β` bounds where it has them (transformers' 32 and 1 otherwise). The frequency band is rounded
/// to whole dimensions as llama.cpp does (transformers' `truncate`), except for gpt-oss, whose
/// released config does not round it.
pub(crate) fn yarn(g: &GgufFile, arch: &str) -> Result<Value> {
    let k = |name: &str| format!("{arch}.rope.scaling.{name}");
    let factor = g
        .opt_f64(&k("factor"))?
        .filter(|f| f.is_finite() && *f >= 1.0)
        .ok_or_else(|| GgufError::metadata(g.path(), &k("factor"), "missing or below 1 for YaRN"))?;
    let original = g
        .opt_u64(&k("original_context_length"))?
        .filter(|n| *n > 0)
        .ok_or_else(|| GgufError::metadata(g.path(), &k("original_context_length"), "missing for YaRN"))?;
    let mut yarn = json!({
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": g.opt_f64(&k("yarn_beta_fast"))?.unwrap_or(32.0),
        "beta_slow": g.opt_f64(&k("yarn_beta_slow"))?.unwrap_or(1.0),
        "truncate": arch != "gpt-oss",
    });
    // llama.cpp's converter writes `attn_factor` from the config's own `attention_factor` (OLMo 3's
    // 1.2079, say), which transformers' YaRN then uses as is for cos and sin in place of
    // 0.1 · ln(factor) + 1: it goes back under that name. 1 is what llama.cpp reads as neutral and
    // is left out (transformers' default applies).
    if let Some(a) = g.opt_f64(&k("attn_factor"))?.filter(|a| *a != 1.0) {
        if !(a.is_finite() && a > 0.0) {
            return Err(GgufError::metadata(g.path(), &k("attn_factor"), format!("{a} (expected a positive number)")));
        }
        yarn["attention_factor"] = json!(a);
    }
    // llama.cpp multiplies these into its own YaRN magnitude scale, which transformers' keys do not
    // express one for one.
    for key in ["yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor"] {
        if g.opt_f64(&k(key))?.is_some_and(|v| v != 1.0 || key == "yarn_log_multiplier") {
            return Err(GgufError::unsupported(g.path(), format!("YaRN with `{}` is not supported", k(key))));
        }
    }
    Ok(yarn)
}

/// The rotated dimensions of each head of `head_dim` and the config's `rope_scaling` (none,
/// linear, YaRN, or Phi-3's LongRoPE from its factor tensors); refuses what transformers' configs
/// cannot say. A Gemma 4 file (`gemma4`) rotates whole heads and reads `rope_freqs.weight`.
pub(crate) fn rope_of(g: &GgufFile, arch: &str, head_dim: u64, gemma4: bool) -> Result<(u64, Option<Value>)> {
    let path = g.path();
    let k = |name: &str| format!("{arch}.{name}");
    let rotary_dim = if gemma4 { head_dim } else { g.opt_u64(&k("rope.dimension_count"))?.unwrap_or(head_dim) };
    // Phi-3 (Phi-4-mini) and the hybrid Qwens rotate the first dimensions of each head, as
    // transformers' `partial_rotary_factor` does; for the other architectures it is refused.
    let partial = arch == "phi3" || HYBRID.contains(&arch);
    if rotary_dim != head_dim && (!partial || rotary_dim == 0 || rotary_dim > head_dim || rotary_dim % 2 != 0) {
        return Err(GgufError::unsupported(
            path,
            format!("partial rotary embeddings ({rotary_dim} of {head_dim} dimensions) are not supported"),
        ));
    }
    let long_rope = if arch == "phi3" { long_rope_factors(g, rotary_dim)? } else { None };
    let rope_scaling = match g.opt_str(&k("rope.scaling.type"))? {
        _ if long_rope.is_some() => long_rope,
        None | Some("none") => None,
        Some("linear") => {
            let factor = g
                .opt_f64(&k("rope.scaling.factor"))?
                .ok_or_else(|| GgufError::metadata(path, &k("rope.scaling.factor"), "missing for linear scaling"))?;
            (factor != 1.0).then(|| json!({"rope_type": "linear", "factor": factor}))
        }
        Some("yarn") => Some(yarn(g, arch)?),
        Some(other) => {
            return Err(GgufError::unsupported(
                path,
                format!("rope scaling `{other}` is not supported (none, linear, yarn)"),
            ))
        }
    };
    if arch != "phi3" && (g.tensor(ROPE_FACTORS[0]).is_some() || g.tensor(ROPE_FACTORS[1]).is_some()) {
        return Err(GgufError::unsupported(
            path,
            "the file has LongRoPE factor tensors (`rope_factors_long.weight`), which only phi3 files are read with",
        ));
    }
    if g.tensor("rope_freqs.weight").is_some() && !gemma4 {
        return Err(GgufError::unsupported(
            path,
            "the file has `rope_freqs.weight` (Llama 3.1-style rope scaling), which is not supported",
        ));
    }
    Ok((rotary_dim, rope_scaling))
}
