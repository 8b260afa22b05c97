//! Checkpoints and metrics sinks of the supervised phases (`rlhf sft`, `rm`, `dpo`), as `rlhf
//! train` has them: a checkpoint holds the trained weights, the optimizer state (whole, or one
//! shard per rank at ZeRO stages ≥ 1, re-cut on load), the step and the training data's identity,
//! written atomically and checksummed ([`crate::ranked_checkpoint`]); restoring it makes the
//! following steps those of the uninterrupted run. The sinks are `metrics.jsonl` and W&B.

use std::path::{Path, PathBuf};

use rlhf_collective::World;
use serde_json::{json, Value};
use tch::nn;

use crate::checkpoint::{var_store_tensors, CheckpointData, Loaded};
use crate::config::CheckpointConfig;
use crate::error::{Result, TrainerError};
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::shard_files::layout_file;
use crate::train_engine::{CheckpointPart, TrainEngine};

/// What the loop needs to checkpoint and resume a phase, besides the task.
pub struct PhaseRun<'a> {
    /// `sft`, `rm` or `dpo`: a checkpoint of one is refused by the others.
    pub phase: &'static str,
    pub seed: u64,
    /// The run's directory (rank 0's, on every rank).
    pub run_dir: &'a Path,
    pub world: &'a World,
    pub checkpoint: &'a CheckpointConfig,
    /// The resolved config, saved in every checkpoint.
    pub config_toml: String,
    /// The training files with their sizes and checksums ([`crate::data::identity`]).
    pub data_identity: Vec<Value>,
    /// The checkpoint this run continues.
    pub resume: Option<&'a Loaded>,
}

impl PhaseRun<'_> {
    /// Writes the checkpoint of `step` (every rank calls it); returns its directory on the main rank.
    pub fn save(&self, step: usize, vs: &nn::VarStore, opt: &TrainEngine, sinks: &Sinks) -> Result<Option<PathBuf>> {
        let t = std::time::Instant::now();
        let parts = vec![("optimizer", opt.checkpoint_part()?)];
        let dir =
            crate::ranked_checkpoint::save(self.world, self.run_dir, step, self.checkpoint.keep, parts, |parts| {
                let mut tensors = vec![("model", var_store_tensors(vs))];
                let mut json = Vec::new();
                for (what, part) in parts {
                    match part {
                        CheckpointPart::Whole(t) => tensors.push((what, t)),
                        CheckpointPart::Shard { layout, .. } => json.push((layout_file(what), layout.to_json())),
                        CheckpointPart::Rank(_) => {}
                    }
                }
                let state = json!({
                    "phase": self.phase,
                    "step": step,
                    "optimizer_steps": opt.steps(),
                    "seed": self.seed,
                    "world_size": self.world.size(),
                    "data_files": self.data_identity,
                    "wandb_run_id": sinks.wandb_run_id(),
                });
                Ok(CheckpointData { step, config_toml: self.config_toml.clone(), state, tensors, json })
            })?;
        if let Some(d) = &dir {
            tracing::info!("checkpoint: {} ({:.1}s)", d.display(), t.elapsed().as_secs_f64());
        }
        Ok(dir)
    }

    /// Restores [`PhaseRun::resume`] into the trained variables and the optimizer; returns the
    /// step it was written at (0 without one). Refuses another phase's checkpoint and training
    /// data that changed since it was written (the position in the data would point elsewhere).
    pub fn restore(&self, vs: &nn::VarStore, opt: &mut TrainEngine) -> Result<usize> {
        let Some(ckpt) = self.resume else { return Ok(0) };
        let bad = |what: String| TrainerError::Checkpoint(format!("{}: {what}", ckpt.dir.display()));
        let phase = ckpt.state.get("phase").and_then(Value::as_str).unwrap_or("rlhf train");
        if phase != self.phase {
            return Err(bad(format!("a checkpoint of `{phase}`, not of `rlhf {}`", self.phase)));
        }
        if let Some(saved) = ckpt.state.get("data_files").and_then(Value::as_array) {
            if *saved != self.data_identity {
                let path = |v: &Value| v.get("path").and_then(Value::as_str).unwrap_or("").to_string();
                let changed = saved
                    .iter()
                    .find(|s| !self.data_identity.contains(s))
                    .or_else(|| self.data_identity.iter().find(|n| !saved.contains(n)))
                    .map(path)
                    .unwrap_or_default();
                return Err(bad(format!(
                    "{changed}: the training data changed since this checkpoint was written (it keeps only its \
                     position in the data, which would now point at other examples)"
                )));
            }
        }
        let get = |key: &str| ckpt.state.get(key).and_then(Value::as_u64).map(|v| v as usize);
        let step = get("step").ok_or_else(|| bad("state.json: missing step".into()))?;
        let steps = get("optimizer_steps").ok_or_else(|| bad("state.json: missing optimizer_steps".into()))?;
        let ranks = get("world_size").unwrap_or(1);
        if ranks != self.world.size() {
            tracing::info!(
                "resuming a checkpoint of {ranks} rank(s) on {}: the optimizer state is re-sharded",
                self.world.size()
            );
        }
        ckpt.restore_vars("model", vs)?;
        opt.restore(ckpt, "optimizer", steps)?;
        tracing::info!("resumed from {} at step {step}", ckpt.dir.display());
        Ok(step)
    }
}

/// Where a phase's metrics go: `metrics.jsonl` (the main rank's) and, when configured, W&B.
pub struct Sinks {
    jsonl: MetricsWriter,
    wandb: Option<rlhf_wandb::WandbSink>,
    tensorboard: Option<crate::tensorboard::TensorboardSink>,
}

impl Sinks {
    /// Opens `<run_dir>/metrics.jsonl` for appending — cut after `resumed_at` first, so a resumed
    /// run rewrites the steps it repeats — and starts W&B when `[wandb]` (or `WANDB_API_KEY`) asks
    /// for it; the W&B run of a resumed checkpoint is continued. A bad W&B setting fails here,
    /// before any step.
    pub fn open(
        run_dir: &Path,
        resume: Option<&Loaded>,
        (wandb, tensorboard): (&rlhf_wandb::WandbConfig, &crate::tensorboard::TensorboardConfig),
        config: Value,
        main: bool,
    ) -> Result<Sinks> {
        if let Some(ckpt) = resume.filter(|_| main) {
            crate::metrics::truncate_after(&run_dir.join("metrics.jsonl"), ckpt.step)?;
        }
        let jsonl = MetricsWriter::create(run_dir)?;
        let first = resume.map_or(0, |c| c.step + 1);
        let tensorboard =
            if main { crate::tensorboard::TensorboardSink::open(tensorboard, run_dir, first)? } else { None };
        let mut w = wandb.clone();
        if w.run_id.is_none() {
            w.run_id = resume.and_then(|c| c.state.get("wandb_run_id").and_then(Value::as_str).map(String::from));
        }
        if w.run_name.is_none() {
            w.run_name = run_dir.file_name().map(|n| n.to_string_lossy().to_string());
        }
        let settings =
            rlhf_wandb::WandbSettings::from_env(&w).map_err(|e| TrainerError::Config(format!("wandb: {e}")))?;
        let wandb = settings.filter(|_| main).map(|s| {
            let sink = rlhf_wandb::WandbSink::start(s, config);
            tracing::info!("wandb: logging to run {}", sink.run_id());
            sink
        });
        Ok(Sinks { jsonl, wandb, tensorboard })
    }

    pub fn path(&self) -> &Path {
        self.jsonl.path()
    }

    pub fn wandb_run_id(&self) -> Option<String> {
        self.wandb.as_ref().map(|w| w.run_id().to_string())
    }

    /// One step's metrics to every sink.
    pub fn record(&mut self, step: usize, m: &StepMetrics) -> Result<()> {
        self.jsonl.write(step, m)?;
        if let Some(sink) = &self.wandb {
            crate::sinks::log_wandb(sink, step, m);
        }
        if let Some(tb) = &mut self.tensorboard {
            tb.record(step, m);
        }
        Ok(())
    }

    /// Ends the W&B run (exit code 0: finished) with the last step as its summary.
    pub fn finish(&mut self, steps: usize, exit_code: i32) {
        if let Some(sink) = self.wandb.take() {
            let mut summary = serde_json::Map::new();
            summary.insert("steps".into(), json!(steps));
            crate::sinks::finish_wandb(sink, summary, exit_code);
        }
    }
}

impl Drop for Sinks {
    fn drop(&mut self) {
        self.finish(0, 1);
    }
}

/// The evaluation before training (step 0) and the first step's loss of a run resumed after
/// `metrics.jsonl` was cut to its checkpoint: what the summary reports as "before".
pub fn earlier_figures(metrics: &Path) -> (Option<StepMetrics>, f64) {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let before = lines.iter().find(|l| l["step"] == 0).map(|l| {
        let mut m = StepMetrics::default();
        for (k, v) in l.as_object().into_iter().flatten() {
            if let (true, Some(x)) = (k.starts_with("eval/"), v.as_f64()) {
                m.set(k, x);
            }
        }
        m
    });
    let loss_first = lines.iter().find_map(|l| l.get("loss").and_then(Value::as_f64)).unwrap_or(f64::NAN);
    (before, loss_first)
}

/// The [`PhaseRun`] and [`Sinks`] of a phase about to train: `run_dir` is this rank's directory
/// (the run's on rank 0, a scratch one on the others) and `shared` the run's, where every rank
/// writes its checkpoint shards.
#[allow(clippy::too_many_arguments)]
pub fn open<'a, C: serde::Serialize>(
    phase: &'static str,
    cfg: &C,
    seed: u64,
    (run_dir, shared): (&Path, &'a Path),
    world: &'a World,
    checkpoint: &'a CheckpointConfig,
    sinks: (&rlhf_wandb::WandbConfig, &crate::tensorboard::TensorboardConfig),
    train_data: &str,
    resume: Option<&'a Loaded>,
) -> Result<(PhaseRun<'a>, Sinks)> {
    let config_toml =
        toml::to_string(cfg).map_err(|e| TrainerError::Config(format!("cannot serialise config: {e}")))?;
    let config = serde_json::to_value(cfg).unwrap_or_default();
    let run = PhaseRun {
        phase,
        seed,
        run_dir: shared,
        world,
        checkpoint,
        config_toml,
        data_identity: crate::data::identity(train_data)?,
        resume,
    };
    let sinks = Sinks::open(run_dir, resume, sinks, config, world.is_main())?;
    Ok((run, sinks))
}
