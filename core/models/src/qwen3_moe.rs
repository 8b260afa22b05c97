//! Qwen3-MoE (Qwen Team 2025; Qwen3-30B-A3B) — transformers' `modeling_qwen3_moe.py`. Qwen3's
//! attention with a routed mixture of experts as MLP ([`crate::layers::SparseMoe`]): a router
//! (softmax in f32, top `num_experts_per_tok`, renormalised when `norm_topk_prob`) over
//! `num_experts` gated MLPs of `moe_intermediate_size`, on every `decoder_sparse_step`-th layer
//! except those in `mlp_only_layers`, which keep a dense MLP of `intermediate_size`. Checkpoints
//! keep transformers' per-expert names (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
//! `mlp.gate.weight`). Unlike dense Qwen3, `head_dim` defaults to `hidden_size / heads`.

use std::path::Path;

use crate::config::{self, ArchConfig, Defaults, Family, HfConfig, MoeConfig, QkNorm};
use crate::error::{ModelError, Result};

/// The keys Qwen3-MoE implements beyond the common rotary-decoder ones.
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "output_router_logits",
    "router_aux_loss_coef",
];

/// Resolves a Qwen3-MoE `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let defaults = Defaults { max_position_embeddings: 32768, ..Defaults::default() };
    let mut arch = config::rotary_decoder(path, hf, Family::Qwen3Moe, defaults)?;
    arch.qk_norm = QkNorm::PerHead;
    config::qwen_sliding(path, hf, &mut arch)?;
    let (experts_key, experts) = match (hf.num_experts, hf.num_local_experts) {
        (Some(n), _) => ("num_experts", n),
        (None, Some(n)) => ("num_local_experts", n),
        (None, None) => ("num_experts", 128),
    };
    let num_experts = config::require(path, experts_key, Some(experts))?;
    let top_k = config::require(path, "num_experts_per_tok", Some(hf.num_experts_per_tok.unwrap_or(8)))?;
    if top_k > num_experts {
        return Err(ModelError::config(
            path,
            "num_experts_per_tok",
            format!("{top_k} is more than the {num_experts} experts"),
        ));
    }
    let intermediate_size =
        config::require(path, "moe_intermediate_size", Some(hf.moe_intermediate_size.unwrap_or(768)))?;
    let step = config::require(path, "decoder_sparse_step", Some(hf.decoder_sparse_step.unwrap_or(1)))?;
    let dense = hf.mlp_only_layers.clone().unwrap_or_default();
    if let Some(bad) = dense.iter().find(|&&i| i < 0 || i >= arch.num_layers) {
        return Err(ModelError::config(
            path,
            "mlp_only_layers",
            format!("layer {bad} is not one of the {} layers", arch.num_layers),
        ));
    }
    // transformers: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    let sparse_layers = (0..arch.num_layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect();
    arch.moe = Some(MoeConfig {
        num_experts,
        top_k,
        intermediate_size,
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(false),
        sparse_layers,
        aux_loss_coef: aux_loss_coef(path, hf)?,
        shared_expert_intermediate_size: None,
        gpt_oss: None,
    });
    Ok(arch)
}

/// The load-balancing loss's coefficient: transformers adds it to the training loss when
/// `output_router_logits`.
pub(crate) fn aux_loss_coef(path: &Path, hf: &HfConfig) -> Result<Option<f64>> {
    match hf.output_router_logits {
        Some(true) => {
            let c = hf.router_aux_loss_coef.unwrap_or(0.001);
            if !(c.is_finite() && c >= 0.0) {
                return Err(ModelError::config(path, "router_aux_loss_coef", format!("must be >= 0, got {c}")));
            }
            Ok(Some(c))
        }
        _ => Ok(None),
    }
}
