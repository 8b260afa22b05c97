//! Rollout engines — who samples the responses of stage 2 ([`crate::rl::rollout`]):
//!
//! - **local** (the default): the trainer's own batched KV-cache decode of the actor, in
//!   process; its behaviour policy is the actor itself, so there are no behaviour log-probs.
//! - **vllm** ([`vllm`]): vLLM servers over HTTP ([`client`]). Before a step samples, the servers
//!   are brought to the policy of the current optimizer step ([`sync`]); the engine's per-token
//!   log-probs travel with the rollout as behaviour log-probs, for the importance-sampling
//!   correction ([`crate::rl::correction`]) and for plugins.

pub mod client;
pub mod sync;
pub mod vllm;

use rlhf_collective::World;
use rlhf_models::CausalLm;

use crate::config::{EngineKind, RolloutConfig};
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::{self, Rollout};
use crate::rl::shard::Part;

/// The configured engine.
pub enum Engine {
    Local,
    Vllm(Box<vllm::VllmEngine>),
}

impl Engine {
    /// The engine of `[rollout]`; `run_dir` holds the vLLM weight versions.
    pub fn new(cfg: &RolloutConfig, run_dir: &std::path::Path) -> Result<Engine> {
        Ok(match cfg.engine {
            EngineKind::Local => Engine::Local,
            EngineKind::Vllm => Engine::Vllm(Box::new(vllm::VllmEngine::new(&cfg.vllm, run_dir)?)),
        })
    }

    /// Makes the engine serve the policy after `version` optimizer steps, if it does not already
    /// (rank 0 writes and reloads; every rank waits for it). Sets `rollout/sync_s`.
    pub fn ensure_synced(
        &mut self,
        actor: &CausalLm,
        version: usize,
        probe: &[u32],
        world: &World,
        m: &mut StepMetrics,
    ) -> Result<()> {
        match self {
            Engine::Local => Ok(()),
            Engine::Vllm(e) => e.ensure_synced(actor, version, probe, world, m),
        }
    }

    /// Samples responses for this rank's prompts (see [`rollout::sample`]).
    ///
    /// # Shapes
    /// As [`rollout::sample`]; an external engine also returns `behavior_logprobs [N, R]`.
    pub fn sample(
        &mut self,
        actor: &CausalLm,
        batch: &PromptBatch,
        part: Part,
        cfg: &RolloutConfig,
        eos_ids: &[i64],
        pad: i64,
    ) -> Result<Rollout> {
        match self {
            Engine::Local => rollout::sample(actor, batch, cfg, eos_ids, pad, part.window()),
            Engine::Vllm(e) => e.sample(batch, cfg, eos_ids, pad),
        }
    }
}
