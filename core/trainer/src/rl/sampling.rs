//! Stages 1–3 of a step — [`prompts`](super::prompts) → [`rollout`](super::rollout) →
//! [`score`](super::score) — for one generation batch, or for as many as DAPO's dynamic sampling
//! needs to fill the step with groups whose scores differ ([`super::dynamic`],
//! `[rollout.filter_groups]`).

use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::rl::experience::{self, Selected};
use crate::rl::phase::{PhaseClock, PhaseCost};
use crate::rl::rollout::Rollout;
use crate::rl::score::{self, SourceScores};
use crate::rl::shard::{self, Part};
use crate::rl::{dynamic, prompts, Trainer};

/// What a step trains on, once sampled and scored.
pub(super) struct Sampled {
    /// This rank's rows.
    pub selected: Selected,
    /// The reward of every rank's rows.
    pub rewards: Vec<f64>,
    /// Whether `rewards` is in the order of the gathered batch (rank by rank); with several
    /// generation batches on several ranks it is not, and the batch's own rewards say it.
    pub in_batch_order: bool,
    pub t_gen: PhaseCost,
    pub t_score: PhaseCost,
}

/// One generation batch, sampled on this rank and scored on every rank.
struct Generation {
    rollout: Rollout,
    group_of_row: Vec<(usize, i64)>,
    /// Each row's record for its images (its prompt's, or its own when its episode observed
    /// images).
    records: Vec<usize>,
    part: Part,
    /// Rows of the whole batch with a response, and every score of them.
    kept_rows: Vec<usize>,
    scores: Vec<SourceScores>,
    t_gen: PhaseCost,
    t_score_start: PhaseClock,
}

impl Trainer {
    /// Samples and scores the step's batch; `None` when there is nothing to train on (the
    /// metrics and a warning say why).
    pub(super) fn sample_and_score(
        &mut self,
        eos_ids: &[i64],
        pad: i64,
        m: &mut StepMetrics,
    ) -> Result<Option<Sampled>> {
        if let Some(v) = self.visual.as_mut() {
            v.forget_observed();
        }
        if self.cfg.rollout.filter_groups.enable {
            return self.sample_filtered(eos_ids, pad, m);
        }
        let gen = self.generation(eos_ids, pad, m)?;
        m.set("completions/dropped", (gen.part.total - gen.kept_rows.len()) as f64);
        m.set("completions/count", gen.kept_rows.len() as f64);
        if gen.kept_rows.is_empty() {
            tracing::warn!("step {}: every response was empty; nothing to train on", self.step + 1);
            return Ok(None);
        }
        let scored = score::combine(&self.score_weights(), &gen.scores, &gen.kept_rows, m)?;
        if scored.rows.is_empty() {
            tracing::warn!("step {}: no sample could be scored; nothing to train on", self.step + 1);
            return Ok(None);
        }
        let local = shard::local_scored(&scored, gen.part);
        let selected = experience::select(&gen.rollout, &local, &gen.group_of_row, &gen.records, self.device)?;
        let t_score = gen.t_score_start.stop();
        Ok(Some(Sampled { selected, rewards: scored.rewards, in_batch_order: true, t_gen: gen.t_gen, t_score }))
    }

    /// Brings the rollout engine to the actor's current weights ([`crate::rl::engine::Engine::ensure_synced`]: the
    /// local engine's bf16 decode copy, or every vLLM server, the probe confirming it).
    pub(in crate::rl) fn sync_engine(&mut self, m: &mut StepMetrics) -> Result<()> {
        let probe = &self.data.records[0].ids;
        self.engine.ensure_synced(&self.actor, self.actor_opt.steps(), probe, &self.world, m)
    }

    /// Prompts, rollout and scores of one generation batch (stages 1–3 before the rewards are
    /// combined). A failing environment checkpoints the run as it was before the step.
    fn generation(&mut self, eos_ids: &[i64], pad: i64, m: &mut StepMetrics) -> Result<Generation> {
        let clock = PhaseClock::start(self.device);
        if let Some(p) = &self.progress {
            p.phase("rollout", 1);
        }
        // 1–2. Prompts and rollout: every rank draws the whole batch and samples its own groups.
        let (n_prompts, g) = (self.cfg.rollout.prompts_per_batch, self.cfg.rollout.samples_per_prompt);
        let before = (self.data.position(), self.prompts_seen);
        let (rollout, mut env, group_of_row, part) = if self.pipeline.is_some() {
            // Sampled ahead by the generation worker ([`super::pipeline`]).
            let f = self.take_ahead(m)?;
            (f.rollout, f.env, f.group_of_row, f.part)
        } else {
            let global =
                prompts::next_batch(&mut self.data, &self.tok, n_prompts, g, &mut self.prompts_seen, self.device)?;
            let (mut batch, part) = shard::prompts(global, n_prompts, g, &self.world)?;
            self.attach_images(&mut batch)?;
            self.sync_engine(m)?;
            let (rollout, env) = self.sample(&batch, part, eos_ids, pad)?;
            (rollout, env, batch.group_of_row, part)
        };
        let t_gen = clock.stop();
        if let Some(p) = &self.progress {
            p.advance(1);
            p.phase("scoring", self.rewards.len() as u64);
        }

        // 3. Score this rank's samples; gather every rank's scores.
        let t_score_start = PhaseClock::start(self.device);
        let samples = score::samples(&rollout, &group_of_row, &self.data, &self.tok)?;
        let mut scores = score::call_sources(&mut self.rewards, &samples, self.progress.as_ref())?;
        self.env_scores(env.as_ref(), &rollout.kept_rows, &mut scores);
        self.overlong_scores(&rollout, &mut scores);
        let (kept_rows, scores) = shard::gather_scores(&self.world, part, &rollout.kept_rows, scores)?;
        let records = self.observed_records(env.as_mut(), &group_of_row)?;
        if let Err(e) = self.env_metrics(env, m) {
            return Err(self.checkpoint_before_failing(before, e));
        }
        Ok(Generation { rollout, group_of_row, records, part, kept_rows, scores, t_gen, t_score_start })
    }

    /// Dynamic sampling: generation batches until the step holds `prompts_per_batch` groups
    /// whose scores differ, or `max_gen_batches` were sampled (then it trains on what it has).
    /// Every rank holds every batch's scores, so all keep the same groups.
    fn sample_filtered(&mut self, eos_ids: &[i64], pad: i64, m: &mut StepMetrics) -> Result<Option<Sampled>> {
        let f = self.cfg.rollout.filter_groups.clone();
        let (n_prompts, g) = (self.cfg.rollout.prompts_per_batch, self.cfg.rollout.samples_per_prompt);
        let weights = self.score_weights();
        let names: Vec<String> = weights.iter().map(|(n, _)| n.clone()).collect();
        let (mut parts, mut rewards, mut kept_groups, mut batches) = (Vec::new(), Vec::new(), 0usize, 0usize);
        // Every sample of every batch, its rows numbered across the batches, for the metrics.
        let (mut all_rows, mut all_scores): (Vec<usize>, Vec<SourceScores>) = (Vec::new(), Vec::new());
        let (mut t_gen, mut t_score) = (PhaseCost::default(), PhaseCost::default());
        let before = (self.data.position(), self.prompts_seen);
        while kept_groups < n_prompts && batches < f.max_gen_batches {
            if batches > 0 {
                // A signal between generation batches ends the step (a constant reward could
                // otherwise keep sampling up to `max_gen_batches` batches): the prompts drawn
                // for it are put back, so the checkpoint of the last finished step resumes it.
                if let Some(sig) = crate::dist::stop_signal(&self.world)? {
                    let ((epoch, pos), seen) = before;
                    self.data.set_position(epoch, pos).map_err(crate::error::TrainerError::Run)?;
                    self.prompts_seen = seen;
                    return Err(self.stopped_by(sig)?.into());
                }
                tracing::info!(
                    "step {}: {kept_groups} of {n_prompts} groups with differing `{}` after {batches} generation \
                     batch(es); sampling batch {} of at most {} (rollout.filter_groups.max_gen_batches)",
                    self.step + 1,
                    f.metric,
                    batches + 1,
                    f.max_gen_batches
                );
            }
            let gen = self.generation(eos_ids, pad, m)?;
            let offset = batches * n_prompts * g;
            batches += 1;
            all_rows.extend(gen.kept_rows.iter().map(|r| r + offset));
            append_scores(&mut all_scores, &gen.scores);
            let scored = score::combine(&weights, &gen.scores, &gen.kept_rows, &mut StepMetrics::default())?;
            let values = dynamic::values(&f.metric, &names, &gen.scores, &gen.kept_rows, &scored)?;
            let mut take = dynamic::varied_groups(&scored.rows, &values, g);
            take.truncate(n_prompts - kept_groups);
            kept_groups += take.len();
            let kept = dynamic::keep_groups(&scored, &take, g);
            rewards.extend(&kept.rewards);
            let local = shard::local_scored(&kept, gen.part);
            parts.push(experience::select(&gen.rollout, &local, &gen.group_of_row, &gen.records, self.device)?);
            t_gen.add(&gen.t_gen);
            t_score.add(&gen.t_score_start.stop());
        }
        m.set("completions/dropped", (batches * n_prompts * g - all_rows.len()) as f64);
        m.set("completions/count", all_rows.len() as f64);
        m.set("filter/gen_batches", batches as f64);
        m.set("filter/kept_groups", kept_groups as f64);
        m.set("filter/dropped_groups", (batches * n_prompts - kept_groups) as f64);
        m.set("filter/short", f64::from(kept_groups < n_prompts));
        // The sources' metrics over every sample sampled.
        let all = score::combine(&weights, &all_scores, &all_rows, m)?;
        if kept_groups < n_prompts {
            tracing::warn!(
                "step {}: {kept_groups} of {n_prompts} groups with differing `{}` after {batches} generation batches \
                 (rollout.filter_groups.max_gen_batches); training on those",
                self.step + 1,
                f.metric
            );
        }
        if kept_groups == 0 {
            let why = if all.rows.is_empty() { "no sample could be scored" } else { "every group scored alike" };
            tracing::warn!("step {}: {why}; nothing to train on", self.step + 1);
            return Ok(None);
        }
        let selected = dynamic::concat(parts, pad)?;
        let in_batch_order = batches == 1 || !self.world.is_distributed();
        Ok(Some(Sampled { selected, rewards, in_batch_order, t_gen, t_score }))
    }
}

/// `into` with `more`'s scores appended source by source (metrics too).
fn append_scores(into: &mut Vec<SourceScores>, more: &[SourceScores]) {
    if into.is_empty() {
        into.extend(more.iter().map(|_| SourceScores::default()));
    }
    for (a, b) in into.iter_mut().zip(more) {
        a.scores.extend(&b.scores);
        a.metrics.extend(b.metrics.iter().cloned());
    }
}
