//! Checkpoints and the W&B sink of an RL run: what a checkpoint holds (weights, optimizer
//! moments, data position, plugin states, reward history), restoring it so the following steps
//! equal an uninterrupted run's, and starting/finishing the sink.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::json;

use crate::checkpoint::{var_store_tensors, CheckpointData, Loaded};
use crate::error::{Result, TrainerError};
use crate::rl::Trainer;
use crate::shard_files::layout_file;
use crate::train_engine::CheckpointPart;

impl Trainer {
    /// Everything a checkpoint holds (see [`crate::checkpoint`]) but the optimizer shards the
    /// ranks write themselves: `parts` are the optimizer states' (whole, or the shards' layout).
    fn checkpoint_data(&self, parts: Vec<(&'static str, CheckpointPart)>) -> Result<CheckpointData> {
        let mut tensors = vec![("actor", var_store_tensors(&self.actor.vs))];
        let mut files = Vec::new();
        for (what, part) in parts {
            match part {
                CheckpointPart::Whole(t) => tensors.push((what, t)),
                CheckpointPart::Shard { layout, .. } => files.push((layout_file(what), layout.to_json())),
                CheckpointPart::Rank(_) => {}
            }
        }
        if let Some(c) = &self.critic {
            tensors.push(("critic", var_store_tensors(&c.vs)));
        }
        if let Some(e) = &self.ema {
            tensors.push(("ema", var_store_tensors(&e.vs)));
        }
        let mut rewards = Vec::new();
        for r in &self.rewards {
            rewards.push(json!({"name": r.name, "state": r.handle.state()?}));
        }
        let (epoch, pos) = self.data.position();
        let mut state = json!({
            "step": self.step,
            "prompts_seen": self.prompts_seen,
            "data": {"epoch": epoch, "pos": pos},
            "data_files": self.data_identity,
            "optimizer_steps": {"actor": self.actor_opt.steps(), "critic": self.critic_opt.as_ref().map(|o| o.steps())},
            "algorithm": {"name": self.algo.meta.name, "state": self.algo.state()?},
            "rewards": rewards,
            "reward_history": self.reward_history,
            "seed": self.cfg.run.seed,
            "world_size": self.world.size(),
            "wandb_run_id": self.wandb.as_ref().map(|w| w.run_id().to_string()),
        });
        if let Some(p) = &self.pipeline {
            // Batches sampled ahead (stored by every rank, see `save_checkpoint`).
            let k = self.cfg.rollout.max_staleness;
            state["pipeline"] = json!({"max_staleness": k, "ahead": p.ahead().count()});
        }
        if let Some(e) = &self.env {
            let handle = e.handle.lock().unwrap_or_else(|e| e.into_inner());
            state["environment"] = json!({"name": e.name, "state": handle.state()?});
        }
        let config_toml =
            toml::to_string(&self.cfg).map_err(|e| TrainerError::Config(format!("cannot serialise config: {e}")))?;
        Ok(CheckpointData { step: self.step, config_toml, state, tensors, json: files })
    }

    /// Writes a checkpoint of the current step; every rank calls it ([`crate::ranked_checkpoint`]:
    /// the main rank writes everything but the optimizer shards the ranks write themselves).
    /// Returns its directory on the main rank.
    pub fn save_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        let t = Instant::now();
        let mut parts = vec![("optimizer-actor", self.actor_opt.checkpoint_part()?)];
        if let Some(p) = &mut self.pipeline {
            // The batches in flight are finished and stored with the step they belong to, and the
            // environment's state is read after them.
            p.drain()?;
            parts.push((
                crate::rl::pipeline::saved::WHAT,
                CheckpointPart::Rank(crate::rl::pipeline::saved::to_tensors(p.ahead())?),
            ));
        }
        if let Some(o) = &self.critic_opt {
            parts.push(("optimizer-critic", o.checkpoint_part()?));
        }
        let keep = self.cfg.checkpoint.keep;
        let dir = crate::ranked_checkpoint::save(&self.world, &self.run_dir, self.step, keep, parts, |parts| {
            self.checkpoint_data(parts)
        })?;
        if let Some(dir) = &dir {
            tracing::info!("checkpoint: {} ({:.1}s)", dir.display(), t.elapsed().as_secs_f64());
        }
        Ok(dir)
    }

    /// Restores a checkpoint: weights, optimizer moments and schedule positions, data position,
    /// plugin states, reward history (the caller truncates `metrics.jsonl` to its step once nothing else can fail).
    /// Refuses a resume over prompt files that changed since the checkpoint (another size or
    /// checksum, another set of shards), unless `--allow-data-change`. Checkpoints written before
    /// files were recorded are not checked.
    fn check_same_data(&self, ckpt: &Loaded) -> Result<()> {
        let Some(saved) = ckpt.state.get("data_files").and_then(|v| v.as_array()) else { return Ok(()) };
        if *saved == self.data_identity {
            return Ok(());
        }
        let key = |v: &serde_json::Value| v.get("path").and_then(|p| p.as_str()).unwrap_or("").to_string();
        let changed = saved
            .iter()
            .find(|s| !self.data_identity.contains(s))
            .or_else(|| self.data_identity.iter().find(|n| !saved.contains(n)))
            .map(key)
            .unwrap_or_default();
        let what = format!(
            "{changed}: the prompt data changed since the checkpoint {} was written (a checkpoint keeps only its \
             position in the data, which would now point at other prompts)",
            ckpt.dir.display()
        );
        if ckpt.allow_data_change {
            tracing::warn!("{what}; resuming anyway (--allow-data-change)");
            return Ok(());
        }
        Err(TrainerError::Checkpoint(format!("{what}; pass --allow-data-change to resume anyway")))
    }

    pub(crate) fn restore(&mut self, ckpt: &Loaded) -> Result<()> {
        let bad = |what: &str| TrainerError::Checkpoint(format!("{}: state.json: {what}", ckpt.dir.display()));
        let st = &ckpt.state;
        let get_usize = |v: Option<&serde_json::Value>, what: &str| {
            v.and_then(serde_json::Value::as_u64).map(|x| x as usize).ok_or_else(|| bad(&format!("missing {what}")))
        };
        // The ranks split each global batch and sample as one process would, so a run resumes
        // with another number of ranks (the optimizer shards re-cut on load); only float sums
        // over a batch split otherwise differ in their last bits.
        let ranks = st.get("world_size").and_then(serde_json::Value::as_u64).unwrap_or(1) as usize;
        if ranks != self.world.size() {
            tracing::info!(
                "resuming a checkpoint of {ranks} data-parallel rank(s) on {}: the optimizer state is re-sharded \
                 and the batches split over the new ranks",
                self.world.size()
            );
        }
        self.check_same_data(ckpt)?;
        let ahead = st.pointer("/pipeline/ahead").and_then(serde_json::Value::as_u64).unwrap_or(0);
        let saved_k = st.pointer("/pipeline/max_staleness").and_then(serde_json::Value::as_u64).unwrap_or(0);
        if ahead > 0 && saved_k as usize != self.cfg.rollout.max_staleness {
            return Err(bad(&format!(
                "{ahead} batch(es) were sampled ahead with rollout.max_staleness = {saved_k} (their prompts are \
                 drawn); resume with rollout.max_staleness = {saved_k}, not {}",
                self.cfg.rollout.max_staleness
            )));
        }
        ckpt.restore_vars("actor", &self.actor.vs)?;
        let steps = get_usize(st.pointer("/optimizer_steps/actor"), "optimizer_steps.actor")?;
        self.actor_opt.restore(ckpt, "optimizer-actor", steps)?;
        if let (Some(c), Some(o)) = (&self.critic, &mut self.critic_opt) {
            ckpt.restore_vars("critic", &c.vs)?;
            o.restore(
                ckpt,
                "optimizer-critic",
                get_usize(st.pointer("/optimizer_steps/critic"), "optimizer_steps.critic")?,
            )?;
        }
        if let Some(e) = &self.ema {
            ckpt.restore_vars("ema", &e.vs)?;
        }
        let algo_name = st.pointer("/algorithm/name").and_then(|v| v.as_str()).unwrap_or("");
        if algo_name != self.algo.meta.name {
            return Err(bad(&format!("written by algorithm `{algo_name}`, this run uses `{}`", self.algo.meta.name)));
        }
        self.algo.load_state(st.pointer("/algorithm/state").unwrap_or(&serde_json::Value::Null))?;
        let saved_rewards = st.get("rewards").and_then(|v| v.as_array()).cloned().unwrap_or_default();
        if saved_rewards.len() != self.rewards.len() {
            return Err(bad(&format!("{} reward sources, this run has {}", saved_rewards.len(), self.rewards.len())));
        }
        for (r, saved) in self.rewards.iter_mut().zip(&saved_rewards) {
            r.handle.load_state(saved.get("state").unwrap_or(&serde_json::Value::Null))?;
        }
        if let Some(e) = &mut self.env {
            let saved = st.pointer("/environment/name").and_then(|v| v.as_str()).unwrap_or("(none)");
            if saved != e.name {
                return Err(bad(&format!("written with environment `{saved}`, this run uses `{}`", e.name)));
            }
            e.handle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .load_state(st.pointer("/environment/state").unwrap_or(&serde_json::Value::Null))?;
        }
        self.step = get_usize(st.get("step"), "step")?;
        self.prompts_seen = get_usize(st.get("prompts_seen"), "prompts_seen")?;
        let epoch = st.pointer("/data/epoch").and_then(|v| v.as_u64()).ok_or_else(|| bad("missing data.epoch"))?;
        let pos = get_usize(st.pointer("/data/pos"), "data.pos")?;
        self.data.set_position(epoch, pos).map_err(|m| bad(&m))?;
        self.reward_history = st
            .get("reward_history")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        tracing::info!("resumed from {} at step {}", ckpt.dir.display(), self.step);
        Ok(())
    }

    /// The W&B settings when the sink is configured (`[wandb]` or `WANDB_API_KEY`); a bad setting
    /// is an error before the run writes anything.
    pub(crate) fn wandb_settings(&self, resume: Option<&Loaded>) -> Result<Option<rlhf_wandb::WandbSettings>> {
        let mut wcfg = self.cfg.wandb.clone();
        if wcfg.run_id.is_none() {
            wcfg.run_id = resume.and_then(|c| c.state.get("wandb_run_id").and_then(|v| v.as_str()).map(String::from));
        }
        if wcfg.run_name.is_none() {
            wcfg.run_name = self.run_dir.file_name().map(|n| n.to_string_lossy().to_string());
        }
        rlhf_wandb::WandbSettings::from_env(&wcfg).map_err(|e| TrainerError::Config(format!("wandb: {e}")))
    }

    /// Starts the W&B sink in the background; from here on it never fails the run.
    pub(crate) fn start_wandb(&mut self, settings: rlhf_wandb::WandbSettings) {
        let config = serde_json::to_value(&self.cfg).unwrap_or_default();
        let sink = rlhf_wandb::WandbSink::start(settings, config);
        tracing::info!("wandb: logging to run {}", sink.run_id());
        self.wandb = Some(sink);
    }

    pub(crate) fn finish_wandb(&mut self, exit_code: i32) {
        if let Some(sink) = self.wandb.take() {
            let mut summary = serde_json::Map::new();
            summary.insert("steps".into(), json!(self.step));
            if let Some(r) = self.reward_history.last() {
                summary.insert("reward".into(), json!(r));
            }
            crate::sinks::finish_wandb(sink, summary, exit_code);
        }
    }
}
