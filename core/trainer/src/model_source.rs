//! Where a configured model comes from: a directory, or a Hugging Face Hub id (`org/name` or
//! `org/name@revision`) resolved through the Hugging Face cache and downloaded when missing
//! ([`rlhf_hub`]). `builtin:` models are written by their callers. Each id is resolved once per
//! process, so validating a config early (before anything is created) and loading later cost
//! one lookup.

use std::path::PathBuf;

use tch::Tensor;

use crate::error::{Result, TrainerError};

/// The directory of the model `spec` names for config key `key` (named in errors).
pub fn resolve(spec: &str, key: &str) -> Result<PathBuf> {
    rlhf_hub::resolve_model(spec).map_err(|e| TrainerError::Config(format!("{key}: {e}")))
}

/// `loss` plus the mixture-of-experts load-balancing loss `aux` of the pass that made it
/// ([`rlhf_generation::TokenLogProbs::aux_loss`]), weighted by
/// the model's `router_aux_loss_coef` times `share` (the micro-batch's share of the optimizer
/// step, as `loss` is scaled), as transformers and TRL add it where the config sets
/// `output_router_logits`; the unweighted value goes into `metrics` as `loss/aux`. `loss`
/// unchanged where the model does not compute it.
pub fn with_router_aux_loss(
    loss: Tensor,
    aux: Option<&Tensor>,
    model: &rlhf_models::CausalLm,
    share: f64,
    metrics: &mut crate::metrics::StepMetrics,
) -> Result<Tensor> {
    match (aux, model.router_aux_loss_coef()) {
        (Some(aux), Some(coef)) => {
            metrics.add("loss/aux", aux.double_value(&[]));
            Ok(loss.f_add(&aux.f_mul_scalar(coef * share)?)?)
        }
        _ => Ok(loss),
    }
}

/// The tokenizer of `dir` with the configured chat template keyword arguments
/// (`data.chat_template_kwargs`).
pub fn tokenizer(
    dir: &std::path::Path,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<rlhf_tokenizer::HfTokenizer> {
    let mut tok = rlhf_tokenizer::HfTokenizer::from_dir(dir)?;
    tok.set_chat_template_kwargs(kwargs).map_err(|e| TrainerError::Config(format!("data.{e}")))?;
    Ok(tok)
}

/// A LoRA setting the model refused, named by its config key: `section` is `model.lora` or
/// `model.critic_lora` (the model's messages name `lora.<key>`).
pub fn lora_error(section: &str, e: rlhf_models::ModelError) -> TrainerError {
    match e {
        rlhf_models::ModelError::Input(m) => {
            TrainerError::Config(format!("{section}{}", m.strip_prefix("lora").unwrap_or(&format!(": {m}"))))
        }
        other => TrainerError::Config(format!("{section}: {other}")),
    }
}
