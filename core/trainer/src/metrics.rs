//! Per-step metrics: one JSON object per line in `<run_dir>/metrics.jsonl`, with `step`,
//! `timestamp` and every metric of the step.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainerError};

/// Metrics the RL host writes itself: a plugin metric with one of these names (or under one of
/// these prefixes) is namespaced with the plugin's name instead of replacing the host's value.
pub const HOST_METRICS: &[&str] = &[
    "reward",
    "reward_std",
    "kl",
    "entropy",
    "lr",
    "skipped_steps",
    "step_time",
    "tokens_per_s",
    "loss/total",
    "loss/ptx",
    "step",
    "timestamp",
];

/// Prefixes of host metric families (`completions/count`, `rewards/<source>/mean`, ...).
pub const HOST_METRIC_PREFIXES: &[&str] = &[
    "completions/",
    "rewards/",
    "rollout/",
    "time/",
    "grad_norm/",
    "lr/",
    "comm/",
    "is/",
    "moe/",
    "env/",
    "eval/",
    "mem/",
];

/// Whether `name` is (or would shadow) a metric of the RL host.
pub fn is_host_metric(name: &str) -> bool {
    HOST_METRICS.contains(&name) || HOST_METRIC_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Accumulates values of one step; repeated names are averaged.
#[derive(Debug, Default, Clone)]
pub struct StepMetrics {
    sums: BTreeMap<String, (f64, usize)>,
}

impl StepMetrics {
    /// Adds an observation of `name`.
    pub fn add(&mut self, name: &str, value: f64) {
        let e = self.sums.entry(name.to_string()).or_insert((0.0, 0));
        e.0 += value;
        e.1 += 1;
    }

    /// Sets `name`, replacing earlier observations.
    pub fn set(&mut self, name: &str, value: f64) {
        self.sums.insert(name.to_string(), (value, 1));
    }

    /// Mean of the observations of `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.sums.get(name).map(|(s, n)| s / *n as f64)
    }

    /// Every name with the sum and the number of its observations.
    pub fn observations(&self) -> impl Iterator<Item = (&str, f64, usize)> {
        self.sums.iter().map(|(k, (s, n))| (k.as_str(), *s, *n))
    }

    /// Sets `name` to `count` observations summing to `sum` (metrics merged over processes).
    pub fn set_observations(&mut self, name: &str, sum: f64, count: usize) {
        self.sums.insert(name.to_string(), (sum, count));
    }

    /// All means.
    pub fn means(&self) -> BTreeMap<String, f64> {
        self.sums.iter().map(|(k, (s, n))| (k.clone(), s / *n as f64)).collect()
    }
}

/// Appends lines to `metrics.jsonl`.
pub struct MetricsWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsWriter {
    /// Opens `<run_dir>/metrics.jsonl` for appending.
    pub fn create(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| TrainerError::io(&path, e))?;
        Ok(MetricsWriter { path, file })
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one line; non-finite values are written as null.
    pub fn write(&mut self, step: usize, metrics: &StepMetrics) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), serde_json::json!(step));
        let ts =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        obj.insert("timestamp".into(), serde_json::json!(ts));
        for (k, v) in metrics.means() {
            obj.insert(k, if v.is_finite() { serde_json::json!(v) } else { serde_json::Value::Null });
        }
        let line = serde_json::Value::Object(obj).to_string();
        writeln!(self.file, "{line}").map_err(|e| TrainerError::io(&self.path, e))
    }
}

/// Whether `<run_dir>/metrics.jsonl` holds a run: `None` when it is missing or empty, else the
/// `step` of its last line (0 when no line says).
pub fn logged_steps(run_dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).ok()?;
    if text.trim().is_empty() {
        return None;
    }
    let step = text.lines().rev().find_map(|l| {
        serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v.get("step").and_then(|s| s.as_u64()))
    });
    Some(step.unwrap_or(0) as usize)
}

/// Keeps the lines of `path` whose `step` is at most `step` (a resumed run rewrites what followed
/// its checkpoint); the file is replaced atomically. A missing file is fine.
pub fn truncate_after(path: &Path, step: usize) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(TrainerError::io(path, e)),
    };
    let mut kept = String::new();
    for line in text.lines() {
        let s =
            serde_json::from_str::<serde_json::Value>(line).ok().and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        if matches!(s, Some(s) if s as usize <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    write_atomic(path, &kept)
}

/// Writes `text` to `path` through a temporary file in the same directory (created if missing)
/// renamed into place, so a reader or a killed run never sees half a file.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| TrainerError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| TrainerError::io(path, e))
}
