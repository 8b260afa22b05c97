//! Held-out evaluation with an environment (`[environment]`): each held-out answer is an episode
//! of the evaluation's own environment instance (so a stateful environment learns nothing from
//! held-out prompts), on the engine the rollouts use; the environment's reward is the score named
//! `env`, which `eval.correct_if` may name (`env >= 1`).

use rlhf_models::CausalLm;
use rlhf_tokenizer::HfTokenizer;

use super::{Evaluator, OnEngine, EVAL_SEED_SALT};
use crate::config::EnvironmentConfig;
use crate::error::Result;
use crate::rl::engine::Engine;
use crate::rl::episode::{self, Decoder, EnvRuntime, EpisodeSettings};
use crate::rl::observed::ObservationImages;
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::{self, Rollout};
use crate::rl::shard::Part;

/// The evaluation's environment: its own instance and the run's settings.
pub struct EvalEnv {
    pub rt: EnvRuntime,
    pub cfg: EnvironmentConfig,
    /// This evaluation's episodes on this rank, and how many of them the environment failed.
    pub episodes: usize,
    pub failed: usize,
}

impl Evaluator {
    /// The answers to this rank's part of a chunk: single responses, or with an environment one
    /// episode per row and (when the environment's reward is scored) each row's reward.
    ///
    /// # Shapes
    /// `batch.padded`: `[N, P]`; the rollout's `generated.sequences`: `[N, P + R]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sample_chunk(
        &mut self,
        actor: &CausalLm,
        engine: Option<&mut OnEngine>,
        tok: &HfTokenizer,
        batch: &PromptBatch,
        part: Part,
        eos_ids: &[i64],
        pad: i64,
    ) -> Result<(Rollout, Option<Vec<f64>>)> {
        let Some(env) = self.env.as_mut() else {
            let out = match engine {
                Some(e) => e.engine.sample(actor, batch, part, &self.generation, eos_ids, pad)?,
                None => rollout::sample(actor, batch, &self.generation, eos_ids, pad, part.window(), false)?,
            };
            return Ok((out, None));
        };
        // The trainer's decode evaluates the policy itself (not a bf16 decode copy), as without
        // an environment.
        let decoder = match engine.map(|e| &*e.engine) {
            Some(Engine::Vllm(v)) => Decoder::Vllm(v),
            _ => Decoder::Local { model: actor, behavior: false },
        };
        let episodes = episode::episodes_of(batch, part.offset, &self.data);
        let settings = EpisodeSettings {
            rollout: &self.generation,
            env: &env.cfg,
            stops: &env.rt.stops,
            tok,
            eos_ids,
            pad,
            rows: part.window(),
            turn_seed: self.seed ^ EVAL_SEED_SALT,
            keyed: false,
            observation_images: ObservationImages::of(self.visual.as_ref().map(|v| v.prompt_images())),
        };
        let out = {
            let mut handle = env.rt.handle.lock().unwrap_or_else(|e| e.into_inner());
            episode::run(&decoder, &mut handle, batch, &episodes, &settings)?
        };
        env.episodes += out.stats.len();
        env.failed += out.stats.iter().filter(|s| s.error).count();
        if let Some(e) = &out.first_error {
            tracing::warn!("held-out evaluation: environment `{}`: {e}", env.rt.name);
        }
        let rewards = env.cfg.scores_env().then_some(out.rewards);
        Ok((out.rollout, rewards))
    }

    /// The scores of an answer, in order: the evaluation's reward sources, then `env` when the
    /// environment's reward is scored; with their weights.
    pub(super) fn score_names(&self) -> Vec<(String, f64)> {
        let mut names: Vec<(String, f64)> = self.rewards.iter().map(|r| (r.name.clone(), r.weight)).collect();
        if let Some(e) = self.env.as_ref().filter(|e| e.cfg.scores_env()) {
            names.push(("env".into(), e.cfg.weight));
        }
        names
    }
}
