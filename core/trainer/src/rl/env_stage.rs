//! The trainer's side of `[environment]`: stage 2 as episodes ([`crate::rl::episode`]) instead
//! of single responses, the environment's reward as one more score of stage 3 (named `env`,
//! weighted by `environment.weight`), and the `env/*` metrics over all ranks.

use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::rl::engine::Engine;
use crate::rl::episode::{self, Decoder, EpisodeSettings, EpisodeStats};
use crate::rl::observed::{ObservationImages, Observed};
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::Rollout;
use crate::rl::score::{self, SourceScores};
use crate::rl::shard::Part;
use crate::rl::Trainer;

/// What the environment said about this rank's episodes.
pub struct EnvOutcome {
    /// Per row of the rank's batch.
    pub rewards: Vec<f64>,
    pub stats: Vec<EpisodeStats>,
    pub first_error: Option<String>,
    /// Per row: the images its observations added.
    pub observed: Vec<Observed>,
}

impl From<episode::Episodes> for (Rollout, EnvOutcome) {
    fn from(out: episode::Episodes) -> Self {
        let episode::Episodes { rollout, rewards, stats, first_error, observed } = out;
        (rollout, EnvOutcome { rewards, stats, first_error, observed })
    }
}

impl Trainer {
    /// Stage 2: the configured engine's single responses, or with `[environment]` one episode
    /// per row (on the same engine).
    pub(super) fn sample(
        &mut self,
        batch: &PromptBatch,
        part: Part,
        eos_ids: &[i64],
        pad: i64,
    ) -> Result<(Rollout, Option<EnvOutcome>)> {
        let Some(env) = self.env.as_mut() else {
            return Ok((self.engine.sample(&self.actor, batch, part, &self.cfg.rollout, eos_ids, pad)?, None));
        };
        let episodes = episode::episodes_of(batch, part.offset, &self.data);
        let decoder = match &self.engine {
            Engine::Vllm(e) => Decoder::Vllm(e),
            Engine::Local { copy: Some(c), .. } => Decoder::Local { model: c.model(), behavior: true },
            Engine::Local { .. } => Decoder::Local { model: &self.actor, behavior: false },
        };
        let settings = EpisodeSettings {
            rollout: &self.cfg.rollout,
            env: &self.cfg.environment,
            stops: &env.stops,
            tok: &self.tok,
            eos_ids,
            pad,
            rows: part.window(),
            turn_seed: self.cfg.run.seed ^ (self.step as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
            keyed: false,
            observation_images: ObservationImages::of(self.visual.as_ref().map(|v| v.prompt_images())),
        };
        let mut handle = env.handle.lock().unwrap_or_else(|e| e.into_inner());
        let (rollout, outcome) = episode::run(&decoder, &mut handle, batch, &episodes, &settings)?.into();
        Ok((rollout, Some(outcome)))
    }

    /// Appends the environment's rewards of the kept rows to this rank's source scores, unless
    /// `environment.reward = "sources"`.
    pub(super) fn env_scores(&self, env: Option<&EnvOutcome>, kept_rows: &[usize], scores: &mut Vec<SourceScores>) {
        if let Some(e) = env.filter(|_| self.cfg.environment.scores_env()) {
            scores.push(SourceScores { scores: kept_rows.iter().map(|&r| e.rewards[r]).collect(), metrics: vec![] });
        }
    }

    /// DAPO's length penalty as one more source (`rollout.overlong_buffer > 0`), after `env`.
    pub(super) fn overlong_scores(&self, rollout: &super::rollout::Rollout, scores: &mut Vec<SourceScores>) {
        let r = &self.cfg.rollout;
        if r.overlong_buffer > 0 {
            scores.push(super::overlong::scores(rollout, r.max_new_tokens, r.overlong_buffer, r.overlong_penalty));
        }
    }

    /// The names and weights of the step's scores: the reward sources, then `env`, then
    /// `overlong` (DAPO's length penalty, [`super::overlong`]).
    pub(super) fn score_weights(&self) -> Vec<(String, f64)> {
        let mut w = score::weights(&self.rewards);
        if self.env.is_some() && self.cfg.environment.scores_env() {
            w.push(("env".into(), self.cfg.environment.weight));
        }
        if self.cfg.rollout.overlong_buffer > 0 {
            w.push(("overlong".into(), 1.0));
        }
        w
    }

    /// The `env/*` metrics of every rank's episodes; ends the run after
    /// `environment.max_failed_batches` batches whose episodes all failed.
    pub(super) fn env_metrics(&mut self, env: Option<EnvOutcome>, m: &mut StepMetrics) -> Result<()> {
        let (Some(e), Some(rt)) = (env, self.env.as_mut()) else {
            return Ok(());
        };
        if let Some(err) = &e.first_error {
            tracing::warn!("step {}: environment `{}`: {err}", self.step + 1, rt.name);
        }
        let (stats, rewards) = episode::gather(&self.world, e.stats, e.rewards)?;
        episode::metrics(&stats, &rewards, &rt.name, &mut rt.seen_metrics, m);
        let max = self.cfg.environment.max_failed_batches;
        rt.failures.note(&stats, e.first_error.as_deref(), &rt.name, max)
    }

    /// Before the run ends on `err` in the middle of a step (nothing of this step trained yet),
    /// rewinds the prompt position to `before` (data position, prompts seen) and writes a
    /// checkpoint of the last finished step, so nothing trained since the last checkpoint is lost
    /// and a resumed run (the environment mended) replays this step. Every rank calls it (they
    /// fail together: the failure is decided on every rank's episodes).
    pub(super) fn checkpoint_before_failing(
        &mut self,
        before: ((u64, usize), usize),
        err: TrainerError,
    ) -> TrainerError {
        let ((epoch, pos), seen) = before;
        // An asynchronous run drew the prompts of later steps too: its last checkpoint stands.
        if self.step == 0 || self.pipeline.is_some() || self.data.set_position(epoch, pos).is_err() {
            return err;
        }
        self.prompts_seen = seen;
        match self.save_checkpoint() {
            Ok(Some(dir)) => TrainerError::Run(format!("{err}; step {} checkpointed in {}", self.step, dir.display())),
            Ok(None) => err,
            Err(e) => TrainerError::Run(format!("{err} (and the checkpoint of step {} failed: {e})", self.step)),
        }
    }
}

/// One rank's rows whose episodes observed images: (row of the rank's batch, prompt record, what
/// was observed).
type ObservedRows = Vec<(usize, usize, Observed)>;

impl Trainer {
    /// Each of this rank's rows' record for its images (see [`crate::rl::visual`]): its
    /// prompt's, or — for a row whose episode observed images — one of its own, which every rank
    /// registers in rank order (one all-gather when an environment runs for a policy that reads
    /// images). Takes `env`'s observed images.
    pub(super) fn observed_records(
        &mut self,
        env: Option<&mut EnvOutcome>,
        group_of_row: &[(usize, i64)],
    ) -> Result<Vec<usize>> {
        let mut records: Vec<usize> = group_of_row.iter().map(|&(r, _)| r).collect();
        let (Some(env), Some(visual)) = (env, self.visual.as_mut()) else { return Ok(records) };
        let mine: ObservedRows = std::mem::take(&mut env.observed)
            .into_iter()
            .enumerate()
            .filter(|(row, o)| !o.is_empty() && *row < records.len())
            .map(|(row, o)| (row, records[row], o))
            .collect();
        let all = if self.world.is_distributed() {
            let err = |e: String| TrainerError::Distributed(format!("observed images: {e}"));
            let bytes = serde_json::to_vec(&mine).map_err(|e| err(e.to_string()))?;
            let parts = self.world.all_gather_bytes(&bytes).map_err(|e| err(e.to_string()))?;
            parts
                .iter()
                .map(|p| serde_json::from_slice::<ObservedRows>(p).map_err(|e| err(e.to_string())))
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![mine]
        };
        let rank = self.world.rank();
        for (k, part) in all.into_iter().enumerate() {
            let rows: Vec<usize> = part.iter().map(|(row, ..)| *row).collect();
            let ids = visual.observe(self.data.records.len(), part.into_iter().map(|(_, p, o)| (p, o)).collect());
            if k == rank {
                for (row, id) in rows.into_iter().zip(ids) {
                    records[row] = id;
                }
            }
        }
        Ok(records)
    }
}
