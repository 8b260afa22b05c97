//! Rotary position parameters from `config.json`, in both spellings transformers has used:
//! `rope_theta` + `rope_scaling` (`type` or `rope_type`) up to v4, and the `rope_parameters` block
//! of v5 (nested per layer type for Gemma 3). The scaling variants are transformers'
//! `ROPE_INIT_FUNCTIONS`: linear, Llama 3, YaRN, LongRoPE, dynamic NTK and proportional (Gemma 4).

use std::path::Path;

use serde_json::Value;

use super::HfConfig;
use crate::error::{ModelError, Result};

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (inv_freq / factor).
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
    /// Models"): frequencies blended between interpolated (`/ factor`) and original along a
    /// linear ramp over the dimensions whose wavelength is between `beta_fast` and `beta_slow`
    /// rotations of the original context; cos and sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        /// Round the ramp's ends to whole dimensions (transformers' default).
        truncate: bool,
    },
    /// LongRoPE (Ding et al. 2024; Phi-3): per-frequency divisors, `long_factor` when the
    /// sequence is longer than `original_max_position_embeddings`, else `short_factor`; cos and
    /// sin scaled by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
    /// Dynamic NTK scaling: past `max_position_embeddings` the base grows with the sequence
    /// length, `θ · (factor · len / max − (factor − 1))^(d / (d − 2))`.
    Dynamic { factor: f64, max_position_embeddings: f64 },
    /// Gemma 4's proportional RoPE: the first `⌊partial · head_dim / 2⌋` frequencies are the
    /// default ones over the whole head (`θ^(−2i / head_dim)`), the rest zero (those dimensions
    /// pass unrotated, cos 1 and sin 0), all divided by `factor`; the tables span the whole head.
    Proportional { partial: f64, factor: f64 },
}

/// Rotary embedding parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// The multimodal split of the frequencies between time, height and width (vision-language
    /// models), set from the checkpoint's `mrope_section`.
    pub mrope: Option<super::Mrope>,
}

/// What the family adds to a rope block: its context length, and Phi-3's conventions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RopeContext {
    pub max_position_embeddings: i64,
    /// A top-level `original_max_position_embeddings` (Phi-3), which wins over the block's.
    pub original_max_override: Option<i64>,
    /// Phi-3 reads the old `su` and `yarn` types as LongRoPE.
    pub phi3_aliases: bool,
}

/// Keys a rope block may hold.
const BLOCK_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "short_factor",
    "long_factor",
    "partial_rotary_factor",
];

/// The single rope block of a config: `rope_parameters` (v5) or `rope_scaling` (v4), if any, and
/// the key it was read from. A config with both that say different things is refused (reading
/// one would silently drop the other); the same block under both names, as a converted config
/// may hold it (`type` for `rope_type`, `rope_theta` only in `rope_parameters`), is read once.
pub(crate) fn block<'a>(path: &Path, hf: &'a HfConfig) -> Result<(&'static str, Option<&'a Value>)> {
    let set = |v: &'a Option<Value>| v.as_ref().filter(|v| !v.is_null());
    Ok(match (set(&hf.rope_parameters), set(&hf.rope_scaling)) {
        (Some(p), Some(s)) if normalized(p) != normalized(s) => {
            return Err(ModelError::config(
                path,
                "rope_parameters",
                format!("both rope_parameters ({p}) and rope_scaling ({s}) are set and differ: keep one"),
            ))
        }
        (Some(p), _) => ("rope_parameters", Some(p)),
        (_, Some(s)) => ("rope_scaling", Some(s)),
        _ => ("rope_scaling", None),
    })
}

/// A rope block compared by meaning: `type` read as `rope_type`, `rope_theta` left out.
fn normalized(block: &Value) -> Option<serde_json::Map<String, Value>> {
    let mut m = block.as_object()?.clone();
    if let Some(t) = m.remove("type") {
        m.entry("rope_type").or_insert(t);
    }
    m.remove("rope_theta");
    Some(m)
}

/// The rope of a family with one rope block (every family but Gemma 3).
pub(crate) fn parse(
    path: &Path,
    hf: &HfConfig,
    default_theta: f64,
    max_position_embeddings: i64,
) -> Result<RopeConfig> {
    let ctx = RopeContext { max_position_embeddings, original_max_override: None, phi3_aliases: false };
    let (key, b) = block(path, hf)?;
    parse_block(path, key, b, hf.rope_theta.unwrap_or(default_theta), ctx)
}

/// Reads one rope block (`key` names it in errors); `theta` applies when the block has none.
pub(crate) fn parse_block(
    path: &Path,
    key: &str,
    block: Option<&Value>,
    theta: f64,
    ctx: RopeContext,
) -> Result<RopeConfig> {
    let r = BlockReader { path, key, block, ctx };
    let theta = r.num("rope_theta")?.unwrap_or(theta);
    if !(theta.is_finite() && theta > 0.0) {
        let from_block = block.is_some_and(|b| b.get("rope_theta").is_some());
        let name = if from_block { format!("{key}.rope_theta") } else { "rope_theta".to_string() };
        return Err(ModelError::config(path, &name, format!("must be a positive number, got {theta}")));
    }
    let Some(block) = block else { return Ok(RopeConfig { theta, scaling: RopeScaling::None, mrope: None }) };
    let Some(obj) = block.as_object() else {
        return Err(ModelError::config(path, key, format!("expected an object, got {block}")));
    };
    if let Some(unknown) = obj.keys().find(|k| !BLOCK_KEYS.contains(&k.as_str())) {
        return Err(
            r.err(unknown, "not a rotary parameter this loader implements (refused rather than ignored)".into())
        );
    }
    let mut kind = block.get("rope_type").or_else(|| block.get("type")).and_then(Value::as_str).unwrap_or("default");
    if ctx.phi3_aliases && matches!(kind, "su" | "yarn") {
        kind = "longrope";
    }
    let max_pos = ctx.max_position_embeddings as f64;
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: r.need("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: r.need("factor")?,
            low_freq_factor: r.need("low_freq_factor")?,
            high_freq_factor: r.need("high_freq_factor")?,
            original_max_position_embeddings: r.original()?,
        },
        "yarn" => r.yarn()?,
        "longrope" => r.longrope()?,
        "dynamic" => RopeScaling::Dynamic { factor: r.need("factor")?, max_position_embeddings: max_pos },
        "proportional" => {
            let partial = r.optional("partial_rotary_factor")?.unwrap_or(1.0);
            if partial > 1.0 {
                return Err(r.err("partial_rotary_factor", format!("must be at most 1, got {partial}")));
            }
            RopeScaling::Proportional { partial, factor: r.optional("factor")?.unwrap_or(1.0) }
        }
        other => {
            return Err(ModelError::config(
                path,
                &format!("{key}.rope_type"),
                format!(
                    "unsupported `{other}` (supported: default, linear, llama3, yarn, longrope, dynamic, proportional)"
                ),
            ))
        }
    };
    Ok(RopeConfig { theta, scaling, mrope: None })
}

/// Reads the parameters of one rope block (`key` in the config at `path`), each error naming
/// `key.parameter`.
struct BlockReader<'a> {
    path: &'a Path,
    key: &'a str,
    block: Option<&'a Value>,
    ctx: RopeContext,
}

impl BlockReader<'_> {
    fn err(&self, name: &str, msg: String) -> ModelError {
        ModelError::config(self.path, &format!("{}.{name}", self.key), msg)
    }

    /// A number, or `None` when absent or null.
    fn num(&self, name: &str) -> Result<Option<f64>> {
        match self.block.and_then(|b| b.get(name)) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.err(name, format!("expected a number, got {v}"))),
        }
    }

    /// Every scaling parameter divides a frequency or a wavelength: zero, negative or non-finite
    /// values would silently make every logit NaN.
    fn positive(&self, name: &str, v: f64) -> Result<f64> {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(self.err(name, format!("must be a positive number, got {v}")))
        }
    }

    fn need(&self, name: &str) -> Result<f64> {
        self.positive(name, self.num(name)?.ok_or_else(|| self.err(name, "missing".into()))?)
    }

    fn optional(&self, name: &str) -> Result<Option<f64>> {
        self.num(name)?.map(|v| self.positive(name, v)).transpose()
    }

    /// The pre-scaling context: the family's override, the block's, or `max_position_embeddings`.
    fn original(&self) -> Result<f64> {
        Ok(match self.ctx.original_max_override {
            Some(o) => self.positive("original_max_position_embeddings", o as f64)?,
            None => {
                self.optional("original_max_position_embeddings")?.unwrap_or(self.ctx.max_position_embeddings as f64)
            }
        })
    }

    /// A list of positive numbers (longrope's factors per frequency).
    fn list(&self, name: &str) -> Result<Vec<f64>> {
        let v = self.block.and_then(|b| b.get(name)).ok_or_else(|| self.err(name, "missing".into()))?;
        let items = v.as_array().ok_or_else(|| self.err(name, format!("expected a list of numbers, got {v}")))?;
        items
            .iter()
            .map(|x| x.as_f64().filter(|f| f.is_finite() && *f > 0.0))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| self.err(name, "expected a list of positive numbers".into()))
    }

    fn yarn(&self) -> Result<RopeScaling> {
        let original = self.original()?;
        let factor = self.optional("factor")?.unwrap_or(self.ctx.max_position_embeddings as f64 / original);
        // transformers' `get_mscale`: 0.1 · m · ln(s) + 1 for s > 1.
        let mscale = |s: f64, m: f64| if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 };
        let attention_factor = match self.optional("attention_factor")? {
            Some(a) => a,
            None => {
                match (self.num("mscale")?.filter(|m| *m != 0.0), self.num("mscale_all_dim")?.filter(|m| *m != 0.0)) {
                    (Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                }
            }
        };
        let truncate = match self.block.and_then(|b| b.get("truncate")) {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(self.err("truncate", format!("expected true or false, got {v}"))),
        };
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: self.optional("beta_fast")?.unwrap_or(32.0),
            beta_slow: self.optional("beta_slow")?.unwrap_or(1.0),
            attention_factor,
            truncate,
        })
    }

    fn longrope(&self) -> Result<RopeScaling> {
        let original = self.original()?;
        let factor = self.optional("factor")?.unwrap_or(self.ctx.max_position_embeddings as f64 / original);
        let attention_factor = match self.optional("attention_factor")? {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / original.ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope {
            short_factor: self.list("short_factor")?,
            long_factor: self.list("long_factor")?,
            original_max_position_embeddings: original,
            attention_factor,
        })
    }
}

/// `partial_rotary_factor` (top level or in the rope block): the rotating share of each head.
pub(crate) fn rotary_dim(path: &Path, hf: &HfConfig, head_dim: i64) -> Result<i64> {
    let (key, b) = block(path, hf)?;
    let in_block = b.and_then(|b| b.get("partial_rotary_factor")).filter(|v| !v.is_null());
    let (name, factor) = match (in_block, hf.partial_rotary_factor) {
        (Some(v), _) => (format!("{key}.partial_rotary_factor"), v.as_f64().unwrap_or(f64::NAN)),
        (None, Some(f)) => ("partial_rotary_factor".to_string(), f),
        (None, None) => return Ok(head_dim),
    };
    let dim = (head_dim as f64 * factor) as i64;
    if !(factor > 0.0 && factor <= 1.0) || dim < 2 || dim % 2 != 0 {
        return Err(ModelError::config(
            path,
            &name,
            format!("{factor} gives {dim} rotary dimensions of head_dim {head_dim} (must be even, at least 2)"),
        ));
    }
    Ok(dim)
}
