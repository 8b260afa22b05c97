//! The mixture-of-experts load-balancing loss in a training loss, where the model computes it.

use tch::Tensor;

use crate::error::Result;

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
