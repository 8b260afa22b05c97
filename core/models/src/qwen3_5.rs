//! Qwen3.5 (Qwen Team 2026), the text model — transformers' `modeling_qwen3_5.py`
//! (`Qwen3_5ForCausalLM`, `model_type` `qwen3_5_text`) — and Qwen3.5-MoE (`qwen3_5_moe_text`,
//! `modeling_qwen3_5_moe.py`), the same layers with a routed mixture of experts and a gated shared
//! expert as every layer's MLP ([`crate::layers::SparseMoe`]) — and Qwen3-Next (`qwen3_next`,
//! `modeling_qwen3_next.py`), Qwen3.5-MoE's layers with the linear attention's input projections
//! grouped by key head and Qwen3-MoE's choice of dense layers. A hybrid: of every
//! `full_attention_interval` layers (4) all but the last are **Gated DeltaNet** linear attention
//! (Yang et al. 2024, [`crate::layers::GatedDeltaNet`]): a causal depthwise convolution over q, k
//! and v, a gated delta-rule recurrence with a fixed-size state per head instead of a KV cache, an
//! output RMSNorm gated by `silu(z)`. The others are Qwen3's attention with per-head q/k norms and
//! an output gate (`o_proj(attn · sigmoid(gate))`, the gate projected with the queries), rotating
//! only `partial_rotary_factor` (¼) of each head. Every RMSNorm but the gated one scales by
//! `1 + w` in f32, as Gemma's. `layer_types` names each layer's kind.
//!
//! The rope block may carry `mrope_section` / `mrope_interleaved`, the multimodal RoPE's split of
//! the frequencies between time, height and width: for text every token has the same position on
//! all three axes, so each frequency rotates by the same angle whichever axis it is assigned to
//! and the split changes nothing; a text checkpoint sets it aside.
//!
//! The Hub's checkpoints are the multimodal `qwen3_5` ([`MULTIMODAL`]): their language model loads
//! from `text_config` and `model.language_model.*`, the vision tower — Qwen3-VL's without the deep
//! stack ([`crate::vision_tower3`]) — from `model.visual.*`, and image tokens take the interleaved
//! multimodal RoPE's 3-D positions.

use std::path::Path;

use serde_json::Value;

use crate::config::rope::{self, RopeContext};
use crate::config::{
    self, vision, ArchConfig, AttnKind, Defaults, Family, HfConfig, LinearAttnConfig, MoeConfig, Multimodal, NormKind,
    QkNorm,
};
use crate::error::{ModelError, Result};

/// The keys Qwen3.5 implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "attn_output_gate",
    // The multi-token-prediction block, which the causal LM does not run (its `mtp.*` tensors
    // are not loaded, see `weights::ignorable`).
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
    "layer_types",
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
];

/// The Hub's Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`): the text model under
/// `text_config` and `model.language_model`, the vision tower under `model.visual`.
pub(crate) const MULTIMODAL: Multimodal = Multimodal {
    model_type: "qwen3_5",
    text_model_type: "qwen3_5_text",
    family: Family::Qwen3_5,
    language_prefix: "model.language_model",
    vision_prefixes: &["model.visual."],
    classifier: "Qwen3_5ForSequenceClassification",
    keys: &["vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"],
    flat: false,
    vision: Some(vision::qwen3_5),
    mrope_section: Some([11, 11, 10]),
    text_hook: None,
    legacy: None,
};

/// The Hub's Qwen3.5-MoE checkpoints (`Qwen3_5MoeForConditionalGeneration`), laid out as
/// [`MULTIMODAL`]; their experts are stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
pub(crate) const MULTIMODAL_MOE: Multimodal = Multimodal {
    model_type: "qwen3_5_moe",
    text_model_type: "qwen3_5_moe_text",
    family: Family::Qwen3_5Moe,
    classifier: "Qwen3_5MoeForSequenceClassification",
    ..MULTIMODAL
};

/// The keys Qwen3.5-MoE implements beyond Qwen3.5's ([`CONFIG_KEYS`]): its experts.
pub(crate) const MOE_KEYS: &[&str] = &[
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "output_router_logits",
    "router_aux_loss_coef",
];

/// The keys Qwen3-Next implements beyond Qwen3.5-MoE's: Qwen3-MoE's choice of dense layers and
/// renormalisation.
pub(crate) const NEXT_KEYS: &[&str] = &["norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"];

/// The multimodal RoPE's keys, inert for text (see the module docs).
const MROPE_KEYS: &[&str] = &["mrope_section", "mrope_interleaved"];

/// Resolves a `qwen3_5_text` or `qwen3_5_moe_text` `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig, family: Family) -> Result<ArchConfig> {
    let defaults = Defaults { head_dim: Some(256), max_position_embeddings: 32768, ..Defaults::default() };
    let mut hf = hf.clone();
    if let Some(Value::Object(block)) = hf.rope_parameters.as_mut() {
        block.retain(|k, _| !MROPE_KEYS.contains(&k.as_str()));
    }
    let (moe, next) = (family == Family::Qwen3_5Moe, family == Family::Qwen3Next);
    if moe {
        // Every layer's MLP is the sparse block: there is no dense intermediate size.
        hf.intermediate_size = Some(hf.moe_intermediate_size.unwrap_or(512));
    }
    if next {
        hf.intermediate_size = Some(hf.intermediate_size.unwrap_or(5632));
    }
    let mut arch = config::rotary_decoder(path, &hf, family, defaults)?;
    arch.norm = NormKind::Gemma;
    arch.qk_norm = QkNorm::PerHead;
    if hf.attn_output_gate == Some(false) {
        return Err(ModelError::config(path, "attn_output_gate", "Qwen3.5 without its attention output gate"));
    }
    arch.attn_output_gate = true;
    // transformers' default when neither spelling sets it.
    arch.rotary_dim = match (&hf.rope_parameters, hf.partial_rotary_factor) {
        (Some(b), _) if b.get("partial_rotary_factor").is_some() => rope::rotary_dim(path, &hf, arch.head_dim)?,
        (_, Some(_)) => rope::rotary_dim(path, &hf, arch.head_dim)?,
        _ => {
            let mut with = hf.clone();
            with.partial_rotary_factor = Some(0.25);
            rope::rotary_dim(path, &with, arch.head_dim)?
        }
    };
    let ctx = RopeContext {
        max_position_embeddings: arch.max_position_embeddings,
        original_max_override: None,
        phi3_aliases: false,
    };
    let (key, block) = rope::block(path, &hf)?;
    arch.rope = Some(rope::parse_block(path, key, block, hf.rope_theta.unwrap_or(10_000.0), ctx)?);
    arch.layer_types = layer_types(path, &hf, arch.num_layers)?;
    let positive = |key: &str, v: Option<i64>, default: i64| config::require(path, key, Some(v.unwrap_or(default)));
    let linear = LinearAttnConfig {
        conv_kernel: positive("linear_conv_kernel_dim", hf.linear_conv_kernel_dim, 4)?,
        num_key_heads: positive("linear_num_key_heads", hf.linear_num_key_heads, 16)?,
        num_value_heads: positive("linear_num_value_heads", hf.linear_num_value_heads, 32)?,
        key_head_dim: positive("linear_key_head_dim", hf.linear_key_head_dim, 128)?,
        value_head_dim: positive("linear_value_head_dim", hf.linear_value_head_dim, 128)?,
        grouped_projections: next,
    };
    if linear.num_value_heads % linear.num_key_heads != 0 {
        return Err(ModelError::config(
            path,
            "linear_num_value_heads",
            format!("{} is not a multiple of linear_num_key_heads {}", linear.num_value_heads, linear.num_key_heads),
        ));
    }
    arch.linear_attn = Some(linear);
    if moe {
        arch.moe = Some(moe_config(path, &hf, arch.num_layers, false)?);
    }
    if next {
        arch.moe = Some(next_moe_config(path, &hf, arch.num_layers)?);
    }
    Ok(arch)
}

/// Qwen3-Next's experts: Qwen3.5-MoE's with `norm_topk_prob` as the config says (true by default)
/// and, as in Qwen3-MoE, a dense MLP on the layers in `mlp_only_layers` and all but every
/// `decoder_sparse_step`-th.
fn next_moe_config(path: &Path, hf: &HfConfig, layers: i64) -> Result<MoeConfig> {
    let mut moe = moe_config(path, hf, layers, true)?;
    moe.norm_topk_prob = hf.norm_topk_prob.unwrap_or(true);
    let step = config::require(path, "decoder_sparse_step", Some(hf.decoder_sparse_step.unwrap_or(1)))?;
    let dense = hf.mlp_only_layers.clone().unwrap_or_default();
    if let Some(bad) = dense.iter().find(|&&i| i < 0 || i >= layers) {
        return Err(ModelError::config(
            path,
            "mlp_only_layers",
            format!("layer {bad} is not one of the {layers} layers"),
        ));
    }
    moe.sparse_layers = (0..layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect();
    Ok(moe)
}

/// Qwen3.5-MoE's experts: on every layer, `num_experts` of `moe_intermediate_size`, the top
/// `num_experts_per_tok` always renormalised, and a shared expert of
/// `shared_expert_intermediate_size` gated per token.
fn moe_config(path: &Path, hf: &HfConfig, layers: i64, next: bool) -> Result<MoeConfig> {
    let (default_experts, default_k) = if next { (512, 10) } else { (256, 8) };
    let num_experts = config::require(path, "num_experts", Some(hf.num_experts.unwrap_or(default_experts)))?;
    let top_k = config::require(path, "num_experts_per_tok", Some(hf.num_experts_per_tok.unwrap_or(default_k)))?;
    if top_k > num_experts {
        return Err(ModelError::config(
            path,
            "num_experts_per_tok",
            format!("{top_k} is more than the {num_experts} experts"),
        ));
    }
    let shared = hf.shared_expert_intermediate_size.unwrap_or(512);
    Ok(MoeConfig {
        num_experts,
        top_k,
        intermediate_size: config::require(
            path,
            "moe_intermediate_size",
            Some(hf.moe_intermediate_size.unwrap_or(512)),
        )?,
        norm_topk_prob: true,
        sparse_layers: vec![true; layers as usize],
        aux_loss_coef: crate::qwen3_moe::aux_loss_coef(path, hf)?,
        shared_expert_intermediate_size: Some(config::require(path, "shared_expert_intermediate_size", Some(shared))?),
        gpt_oss: None,
    })
}

/// `layer_types` (`linear_attention` / `full_attention`), or transformers' default pattern: every
/// `full_attention_interval`-th layer full, the others linear.
fn layer_types(path: &Path, hf: &HfConfig, n: i64) -> Result<Vec<AttnKind>> {
    let kinds = [("linear_attention", AttnKind::Linear), ("full_attention", AttnKind::Full)];
    if let Some(types) = config::layer_kinds(path, hf, n, &kinds)? {
        return Ok(types);
    }
    let every = config::require(path, "full_attention_interval", Some(hf.full_attention_interval.unwrap_or(4)))?;
    Ok((0..n).map(|i| if (i + 1) % every == 0 { AttnKind::Full } else { AttnKind::Linear }).collect())
}
