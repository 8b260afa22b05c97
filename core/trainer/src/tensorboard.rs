//! The TensorBoard sink (`[tensorboard] dir`): every step's metrics as scalars in an event file
//! under `<dir>/<run directory's name>`, so runs sharing a `dir` are separate TensorBoard runs and
//! a resumed run continues its own. Each start writes a session-start marker at its first step:
//! TensorBoard then drops what a killed run logged past its checkpoint, and the resumed steps
//! replace them. Like W&B, the sink never fails a run once it is open: a failed write is one
//! warning, and the run goes on without it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;

/// `[tensorboard]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorboardConfig {
    /// Where event files go (`tensorboard --logdir DIR`); unset: no event files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
}

/// An open event file.
pub struct TensorboardSink {
    writer: Option<rlhf_tensorboard::EventWriter>,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl TensorboardSink {
    /// Opens a new event file for the run in `run_dir` whose first logged step is `first_step`
    /// (0 for a fresh run, the checkpoint's step + 1 for a resumed one); `None` without a `dir`.
    pub fn open(cfg: &TensorboardConfig, run_dir: &Path, first_step: usize) -> Result<Option<TensorboardSink>> {
        let Some(dir) = &cfg.dir else { return Ok(None) };
        let name = std::fs::canonicalize(run_dir)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_os_string()))
            .unwrap_or_else(|| "run".into());
        let mut writer = rlhf_tensorboard::EventWriter::create(&dir.join(name))
            .map_err(|e| TrainerError::Config(format!("tensorboard.dir: {e}")))?;
        writer
            .session_start(first_step as i64, now())
            .map_err(|e| TrainerError::Config(format!("tensorboard.dir: {e}")))?;
        tracing::info!("tensorboard: {}", writer.path().display());
        Ok(Some(TensorboardSink { writer: Some(writer) }))
    }

    /// Writes the finite metrics of `step`.
    pub fn record(&mut self, step: usize, m: &StepMetrics) {
        let Some(w) = &mut self.writer else { return };
        let means = m.means();
        let scalars: Vec<(&str, f64)> =
            means.iter().filter(|(_, v)| v.is_finite()).map(|(k, v)| (k.as_str(), *v)).collect();
        if let Err(e) = w.add_scalars(step as i64, now(), &scalars) {
            tracing::warn!("tensorboard: {e}; no more events are written");
            self.writer = None;
        }
    }
}
