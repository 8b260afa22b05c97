//! `[warmup]`: an optional supervised warm-up of the actor before RL (the embedded defaults start
//! from a random tiny model).

use serde::{Deserialize, Serialize};

/// Optional supervised warm-up of the actor before RL (used by the embedded defaults, whose tiny
/// model starts from random weights).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmupConfig {
    /// Optimizer steps; 0 = none.
    pub steps: usize,
    pub lr: f64,
    pub batch_size: usize,
    /// What a prompt's response is: `label` (the dataset's label), or `metadata.KEY` (a field of
    /// the line, e.g. a tool-using demonstration for a multi-turn environment).
    pub target: String,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        WarmupConfig { steps: 0, lr: 1e-3, batch_size: 32, target: "label".into() }
    }
}
