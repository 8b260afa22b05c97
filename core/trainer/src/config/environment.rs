//! `[environment]`: multi-turn rollouts with an environment plugin (docs/environments.md). Off
//! unless `plugin` is set; then every rollout is an episode loop of at most `max_turns` policy
//! turns and `max_total_tokens` response tokens (sampled and observation tokens together).

use serde::{Deserialize, Serialize};

use super::KeySource;
use crate::error::Result;

/// Where an episode's reward comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvReward {
    /// The environment's (sum of its step rewards) × `weight`; no `[[rewards]]`.
    Env,
    /// The `[[rewards]]` sources over the whole trajectory text; the environment's is ignored.
    Sources,
    /// Both: `weight` × the environment's + the sources' weighted sum.
    Sum,
}

/// The environment of multi-turn rollouts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvironmentConfig {
    /// The environment plugin (`env-calculator`, ...); empty: single-turn rollouts.
    pub plugin: String,
    /// Policy turns per episode at most (a turn ends at EOS, a stop string or
    /// `rollout.max_new_tokens`).
    pub max_turns: usize,
    /// Response tokens per episode at most (sampled + observation); longer episodes are cut and
    /// counted in `env/truncated`.
    pub max_total_tokens: i64,
    /// Strings that end a policy turn besides EOS, added to the plugin's own.
    pub stop: Vec<String>,
    pub reward: EnvReward,
    /// Weight of the environment's reward.
    pub weight: f64,
    /// The environment reward of an episode whose environment call failed (panic, error,
    /// malformed answer).
    pub error_penalty: f64,
    /// Consecutive batches in which every episode failed that end the run with an error.
    pub max_failed_batches: usize,
    /// The plugin's own section, passed as JSON.
    pub config: serde_json::Value,
    /// On the local engine, keep each episode's keys and values across turns and append the
    /// observation to them, instead of prefilling the whole context every turn (models with a
    /// sliding window always re-prefill).
    pub kv_reuse: bool,
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        EnvironmentConfig {
            plugin: String::new(),
            max_turns: 4,
            max_total_tokens: 256,
            stop: Vec::new(),
            reward: EnvReward::Env,
            weight: 1.0,
            error_penalty: 0.0,
            max_failed_batches: 3,
            config: serde_json::json!({}),
            kv_reuse: true,
        }
    }
}

impl EnvironmentConfig {
    /// Whether multi-turn rollouts are on.
    pub fn enabled(&self) -> bool {
        !self.plugin.is_empty()
    }

    /// Whether the environment's reward is one of the scores (named `env`).
    pub fn scores_env(&self) -> bool {
        self.enabled() && self.reward != EnvReward::Sources
    }

    /// Checks the section against `n_rewards` `[[rewards]]` entries.
    pub(crate) fn validate(&self, n_rewards: usize, src: &KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        if !self.enabled() {
            return Ok(());
        }
        if self.max_turns == 0 {
            return bad("environment.max_turns", "must be >= 1");
        }
        if self.max_total_tokens < 1 {
            return bad("environment.max_total_tokens", "must be >= 1");
        }
        if let Some(i) = self.stop.iter().position(String::is_empty) {
            return bad(&format!("environment.stop[{i}]"), "must not be empty");
        }
        if !self.weight.is_finite() {
            return bad("environment.weight", "must be finite");
        }
        if !self.error_penalty.is_finite() {
            return bad("environment.error_penalty", "must be finite");
        }
        if self.max_failed_batches == 0 {
            return bad("environment.max_failed_batches", "must be >= 1");
        }
        match (self.reward, n_rewards) {
            (EnvReward::Env, n) if n > 0 => {
                return bad(
                    "environment.reward",
                    "\"env\" ignores the [[rewards]] sources: remove them, or set \"sum\" (or \"sources\")",
                )
            }
            (EnvReward::Sources | EnvReward::Sum, 0) => {
                return bad("environment.reward", "\"sources\" and \"sum\" need at least one [[rewards]] entry")
            }
            _ => {}
        }
        Ok(())
    }
}
