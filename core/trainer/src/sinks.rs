//! What `rlhf train` and the supervised phases send to W&B, in one place: a step's finite means as
//! a history row, and the end of the run with its summary.

use serde_json::json;

use crate::metrics::StepMetrics;

/// Logs the finite means of `m` as the history row of `step`.
pub fn log_wandb(sink: &rlhf_wandb::WandbSink, step: usize, m: &StepMetrics) {
    let map = m.means().into_iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k, json!(v))).collect();
    sink.log(step as u64, map);
}

/// Finishes the W&B run with `summary` (exit code 0: finished), warning about undelivered rows.
pub fn finish_wandb(sink: rlhf_wandb::WandbSink, summary: serde_json::Map<String, serde_json::Value>, exit_code: i32) {
    let stats = sink.finish(summary, exit_code);
    if stats.lines_dropped > 0 {
        tracing::warn!("wandb: {} of {} history lines were not delivered", stats.lines_dropped, stats.lines_logged);
    }
}
