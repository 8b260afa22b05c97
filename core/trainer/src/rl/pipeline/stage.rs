//! The trainer's use of the [`Pipeline`]: starting it (with the batches a checkpoint stored),
//! keeping `k` batches in flight, and taking the step's batch.

use tch::Tensor;

use super::saved::{self, WHAT};
use super::worker::{Finished, Job, WorkerSpec};
use super::Pipeline;
use crate::checkpoint::Loaded;
use crate::config::DecodeDtype;
use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::rl::{episode, prompts, shard, Trainer};
use crate::shard_files::shard_file;

/// The batches sampled ahead that checkpoint `ckpt` stores for this rank (none for a checkpoint
/// of a synchronous run). A checkpoint's batches are cut for its number of ranks.
fn stored_ahead(ckpt: &Loaded, rank: usize, ranks: usize, device: tch::Device) -> Result<Vec<Finished>> {
    let st = &ckpt.state;
    let ahead = st.pointer("/pipeline/ahead").and_then(serde_json::Value::as_u64).unwrap_or(0);
    if ahead == 0 {
        return Ok(Vec::new());
    }
    let saved_ranks = st.get("world_size").and_then(serde_json::Value::as_u64).unwrap_or(1) as usize;
    if saved_ranks != ranks {
        return Err(TrainerError::Checkpoint(format!(
            "{}: {ahead} batch(es) were sampled ahead on {saved_ranks} data-parallel rank(s), each rank holding its \
             part; resume an asynchronous run on {saved_ranks} rank(s) (this run has {ranks})",
            ckpt.dir.display()
        )));
    }
    let file = shard_file(WHAT, rank, ranks);
    let path = ckpt.verified(&file)?;
    let tensors =
        Tensor::read_safetensors(&path).map_err(|e| TrainerError::Checkpoint(format!("{}: {e}", path.display())))?;
    let batches = saved::from_tensors(tensors, &path.display().to_string(), device)?;
    if batches.len() as u64 != ahead {
        return Err(TrainerError::Checkpoint(format!(
            "{}: holds {} batches, state.json says {ahead}",
            path.display(),
            batches.len()
        )));
    }
    Ok(batches)
}

impl Trainer {
    /// Starts the generation worker when `rollout.max_staleness > 0`, with the batches `resume`
    /// sampled ahead put back in line.
    pub(in crate::rl) fn start_pipeline(&mut self, resume: Option<&Loaded>) -> Result<()> {
        let k = self.cfg.rollout.max_staleness;
        if k == 0 {
            return Ok(());
        }
        let ahead = match resume {
            Some(c) => stored_ahead(c, self.world.rank(), self.world.size(), self.device)?,
            None => Vec::new(),
        };
        let total = tch::get_num_threads().max(1);
        let vllm = self.engine.is_external();
        let gen = match self.cfg.rollout.generation_threads {
            // A vLLM worker only waits on HTTP: the trainer keeps every thread.
            _ if vllm => 1,
            0 => (total / 2).max(1),
            // Validated: at most `MAX_THREADS`, so the conversion cannot fail.
            n => i32::try_from(n).unwrap_or(i32::MAX),
        };
        let trainer_threads = if vllm { total } else { total.saturating_sub(gen).max(1) };
        let spec = WorkerSpec {
            source_dir: self.actor.source_dir().to_path_buf(),
            device: self.device,
            kind: self.actor.kind(),
            bf16: self.cfg.rollout.decode_dtype == DecodeDtype::Bf16 && self.actor.kind() != tch::Kind::BFloat16,
            threads: gen,
            rollout: self.cfg.rollout.clone(),
            env_cfg: self.cfg.environment.clone(),
            stops: self.env.as_ref().map(|e| e.stops.clone()).unwrap_or_default(),
            env: self.env.as_ref().map(|e| e.handle.clone()),
            observation_images: self.visual.as_ref().map(|v| v.prompt_images().clone()),
            tok: self.tok.clone(),
            eos_ids: self.eos_ids(),
            pad: i64::from(self.tok.pad_token_id()),
            vllm: vllm.then(|| (self.cfg.rollout.vllm.clone(), self.run_dir.clone())),
        };
        let mut p = Pipeline::start(spec, trainer_threads, self.step + ahead.len())?;
        p.preload(ahead);
        tracing::info!(
            "asynchronous rollouts: batches up to {k} step(s) stale; the generation worker has {gen} of {total} \
             intra-op threads, the trainer {trainer_threads}"
        );
        self.pipeline = Some(p);
        Ok(())
    }

    /// Stages 1–2 of an asynchronous step: queues the batches up to step `step + k` (of those
    /// the run will train), then waits for this step's. Sets `rollout/policy_version`,
    /// `rollout/staleness` (steps) and `time/rollout_worker` (the worker's seconds on the batch).
    pub(in crate::rl) fn take_ahead(&mut self, m: &mut StepMetrics) -> Result<Finished> {
        let last = (self.step + self.cfg.rollout.max_staleness).min(self.cfg.train.steps.saturating_sub(1));
        let f = if self.engine.is_external() {
            self.take_from_servers(last, m)?
        } else {
            while self.pipeline.as_ref().is_some_and(|p| p.next <= last) {
                self.submit_next()?;
            }
            let p = self.pipeline.as_mut().ok_or_else(|| TrainerError::Run("no generation worker".into()))?;
            p.take(self.step)?
        };
        m.set("rollout/policy_version", f.version as f64);
        m.set("rollout/staleness", self.step.saturating_sub(f.version) as f64);
        m.set("time/rollout_worker", f.gen_s);
        Ok(f)
    }

    /// The vLLM schedule (`k = 1`): the servers hold one policy at a time, so the trainer takes
    /// this step's batch first (the servers are then idle), syncs them to its policy, and only
    /// then sends the next step's batch, which they sample while this step trains.
    fn take_from_servers(&mut self, last: usize, m: &mut StepMetrics) -> Result<Finished> {
        if self.pipeline.as_ref().is_some_and(|p| p.next == self.step) {
            // Nothing in flight for this step (the first step, or a resume without a batch ahead).
            self.sync_engine(m)?;
            self.submit_next()?;
        }
        let p = self.pipeline.as_mut().ok_or_else(|| TrainerError::Run("no generation worker".into()))?;
        let f = p.take(self.step)?;
        if self.pipeline.as_ref().is_some_and(|p| p.next <= last) {
            self.sync_engine(m)?;
            self.submit_next()?;
        }
        Ok(f)
    }

    /// Waits for the batches in flight on the vLLM servers (before the held-out evaluation
    /// syncs them to another policy).
    pub(in crate::rl) fn drain_servers(&mut self) -> Result<()> {
        match &mut self.pipeline {
            Some(p) if self.engine.is_external() => p.drain(),
            _ => Ok(()),
        }
    }

    /// Draws the prompts of the pipeline's next step and queues them with the current policy.
    fn submit_next(&mut self) -> Result<()> {
        let (n_prompts, g) = (self.cfg.rollout.prompts_per_batch, self.cfg.rollout.samples_per_prompt);
        let global = prompts::next_batch(&mut self.data, &self.tok, n_prompts, g, &mut self.prompts_seen, self.device)?;
        let (mut batch, part) = shard::prompts(global, n_prompts, g, &self.world)?;
        // The rows' images go with them (a frozen tower's features too: every version's tower).
        self.attach_images(&mut batch)?;
        let episodes = self.env.is_some().then(|| episode::episodes_of(&batch, part.offset, &self.data));
        let Some(p) = self.pipeline.as_mut() else { return Ok(()) };
        let index = p.next;
        let (version, weights) = (self.step, p.weights(&self.actor, self.step)?);
        let noise_key = self.cfg.run.seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
        p.submit(Job { index, version, weights, batch, part, episodes, noise_key })
    }
}
