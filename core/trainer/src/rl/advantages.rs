//! Stage 5, **advantages**: the algorithm plugin's `prepare` turns the batch's rewards (and, per
//! algorithm, log-probs, reference log-probs, values) into per-token advantages and returns.

use rlhf_plugin_api::{Experience, Prepared};

use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::plugins::AlgorithmHandle;
use crate::rl::experience::Batch;

/// Calls the plugin's `prepare` on the whole generation batch and records its metrics.
///
/// # Shapes
/// `batch` as [`Batch`]; returns `advantages`, `returns`: `[B, R]` f32.
pub fn prepare(algo: &mut AlgorithmHandle, batch: &Batch, step: u64, m: &mut StepMetrics) -> Result<Prepared> {
    let exp = Experience {
        rewards: batch.rewards.shallow_clone(),
        logprobs: batch.old_logprobs.shallow_clone(),
        ref_logprobs: batch.ref_logprobs.as_ref().map(|t| t.shallow_clone()),
        values: batch.values.as_ref().map(|t| t.shallow_clone()),
        action_mask: batch.action_mask.shallow_clone(),
        group_ids: batch.group_ids.shallow_clone(),
        step,
        behavior_logprobs: batch.behavior_logprobs.as_ref().map(|t| t.shallow_clone()),
    };
    let prepared = algo.prepare(&exp)?;
    for (name, value) in &prepared.metrics {
        m.set(name, *value);
    }
    Ok(prepared)
}
