//! Rollout engines — who samples the responses of stage 2 ([`crate::rl::rollout`]):
//!
//! - **local** (the default): the trainer's own batched KV-cache decode of the actor, in
//!   process; its behaviour policy is the actor itself, so there are no behaviour log-probs —
//!   unless it decodes with a bf16 copy of the actor ([`local`], `rollout.decode_dtype`), whose
//!   log-probs of the sampled tokens are then the behaviour log-probs.
//! - **vllm** ([`vllm`]): vLLM servers over HTTP ([`client`]). Before a step samples, the servers
//!   are brought to the policy of the current optimizer step ([`sync`]); the engine's per-token
//!   log-probs travel with the rollout as behaviour log-probs, for the importance-sampling
//!   correction ([`crate::rl::correction`]) and for plugins.

pub mod client;
pub mod generate;
pub mod local;
pub mod sync;
pub mod tied_head;
pub mod vllm;

use rlhf_collective::World;
use rlhf_models::CausalLm;

use crate::config::{DecodeDtype, EngineKind, RolloutConfig};
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::{self, Rollout};
use crate::rl::shard::Part;

/// The configured engine.
pub enum Engine {
    /// The actor itself, or with `rollout.decode_dtype = "bf16"` a bf16 copy of it (made at the
    /// first sync).
    Local {
        bf16: bool,
        copy: Option<Box<local::Bf16Decode>>,
    },
    Vllm(Box<vllm::VllmEngine>),
}

impl Engine {
    /// The engine of `[rollout]`; `run_dir` holds the vLLM weight versions.
    pub fn new(cfg: &RolloutConfig, run_dir: &std::path::Path) -> Result<Engine> {
        Ok(match cfg.engine {
            EngineKind::Local => Engine::Local { bf16: cfg.decode_dtype == DecodeDtype::Bf16, copy: None },
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
            // A policy already in bf16 needs no copy.
            Engine::Local { bf16: true, copy } if actor.kind() != tch::Kind::BFloat16 => {
                let t = std::time::Instant::now();
                let c = match copy {
                    Some(c) => c,
                    None => copy.insert(Box::new(local::Bf16Decode::new(actor)?)),
                };
                c.sync(actor, version)?;
                m.set("rollout/sync_s", t.elapsed().as_secs_f64());
                Ok(())
            }
            Engine::Local { .. } => Ok(()),
            Engine::Vllm(e) => e.ensure_synced(actor, version, probe, world, m),
        }
    }

    /// Whether responses come from outside the trainer (vLLM servers).
    pub fn is_external(&self) -> bool {
        matches!(self, Engine::Vllm(_))
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
            Engine::Local { copy: Some(c), .. } => {
                rollout::sample(c.model(), batch, cfg, eos_ids, pad, part.window(), true)
            }
            Engine::Local { .. } => rollout::sample(actor, batch, cfg, eos_ids, pad, part.window(), false),
            Engine::Vllm(e) => e.sample(batch, cfg, eos_ids, pad),
        }
    }
}
