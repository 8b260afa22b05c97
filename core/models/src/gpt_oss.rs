//! gpt-oss (OpenAI 2025; gpt-oss-20b and -120b) — transformers' `modeling_gpt_oss.py`. Llama's
//! pre-norm blocks with:
//!
//! - **attention sinks**: per head a learned logit `sinks[h]` joins every query's softmax and
//!   attends to nothing (computed eagerly, not through SDPA);
//! - sliding-window (`sliding_window`, 128) and full layers alternating by `layer_types` (by
//!   default even layers slide), biases on q, k, v and o, YaRN;
//! - a mixture of experts on every layer (`num_local_experts`, top `num_experts_per_tok`): a
//!   router with a bias whose top-k **logits** are softmaxed, and biased experts stored stacked
//!   (`mlp.experts.gate_up_proj: [experts, hidden, 2·inter]`, gate and up interleaved;
//!   `mlp.experts.down_proj: [experts, inter, hidden]`) computing the clamped SwiGLU
//!   `(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`, `g = min(gate, limit)`;
//! - RMSNorm scaled in f32 (OLMo 2's kind);
//! - the released checkpoints' experts in MXFP4 (`*_blocks` and `*_scales`,
//!   `quantization_config.quant_method = "mxfp4"`), dequantised at load
//!   ([`crate::weights::dequantize_mxfp4`]) and saved back unquantised.

use std::path::Path;

use serde_json::Value;

use crate::config::{self, ArchConfig, AttnKind, Defaults, Family, GptOssMoe, HfConfig, MoeConfig, NormKind};
use crate::error::{ModelError, Result};

/// The keys gpt-oss implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "sliding_window",
    "layer_types",
    "num_local_experts",
    "num_experts_per_tok",
    "swiglu_alpha",
    "swiglu_limit",
    "output_router_logits",
    "router_aux_loss_coef",
    "quantization_config",
];

/// Resolves a `gpt_oss` `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults =
        Defaults { norm_eps: 1e-5, max_position_embeddings: 131_072, rope_theta: 150_000.0, ..Defaults::default() };
    let mut hf_arch = hf.clone();
    if hf_arch.rope_parameters.is_none() && hf_arch.rope_scaling.is_none() {
        // transformers' default: YaRN ×32 over 4096 positions.
        hf_arch.rope_parameters = Some(serde_json::json!({
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096
        }));
    }
    hf_arch.attention_bias = Some(hf.attention_bias.unwrap_or(true));
    let experts = config::require(path, "num_local_experts", Some(hf.num_local_experts.unwrap_or(128)))?;
    let top_k = config::require(path, "num_experts_per_tok", Some(hf.num_experts_per_tok.unwrap_or(4)))?;
    if top_k > experts {
        return Err(ModelError::config(
            path,
            "num_experts_per_tok",
            format!("{top_k} is more than the {experts} experts"),
        ));
    }
    hf_arch.intermediate_size = Some(hf.intermediate_size.unwrap_or(2880));
    let mut arch = config::rotary_decoder(path, &hf_arch, Family::GptOss, defaults)?;
    arch.norm = NormKind::RmsScaleInF32;
    arch.attn_sinks = true;
    arch.sliding_window = match &hf.sliding_window {
        None => Some(128),
        Some(_) => config::sliding_window_value(path, hf)?,
    };
    let n = arch.num_layers;
    arch.layer_types = match config::layer_types_value(path, hf, n)? {
        Some(t) => t,
        None => (0..n).map(|i| if (i + 1) % 2 != 0 { AttnKind::Sliding } else { AttnKind::Full }).collect(),
    };
    let number = |key: &str, v: Option<f64>, default: f64| -> Result<f64> {
        let v = v.unwrap_or(default);
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(ModelError::config(path, key, format!("must be a positive number, got {v}")))
        }
    };
    arch.moe = Some(MoeConfig {
        num_experts: experts,
        top_k,
        intermediate_size: arch.intermediate_size,
        norm_topk_prob: false,
        sparse_layers: vec![true; n as usize],
        aux_loss_coef: crate::qwen3_moe::aux_loss_coef(path, hf)?,
        shared_expert_intermediate_size: None,
        gpt_oss: Some(GptOssMoe {
            alpha: number("swiglu_alpha", hf.swiglu_alpha, 1.702)?,
            limit: number("swiglu_limit", hf.swiglu_limit, 7.0)?,
        }),
    });
    arch.mxfp4 = mxfp4(path, hf.quantization_config.as_ref())?;
    Ok(arch)
}

/// Whether `quantization_config` says MXFP4 (the only quantisation read); anything else is refused.
fn mxfp4(path: &Path, q: Option<&Value>) -> Result<bool> {
    let Some(q) = q.filter(|v| !v.is_null()) else { return Ok(false) };
    match q.get("quant_method").and_then(Value::as_str) {
        Some("mxfp4") => Ok(true),
        other => Err(ModelError::config(
            path,
            "quantization_config.quant_method",
            format!("{other:?} is not read (MXFP4 is; other quantised checkpoints are refused)"),
        )),
    }
}
