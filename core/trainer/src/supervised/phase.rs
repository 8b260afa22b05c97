//! What the supervised phases (`rlhf sft`, `rlhf rm`) share: the `run`, `model` and `train` config
//! sections, the data sources (a JSONL file or a `builtin:` dataset, with a held-out eval split),
//! the per-kind report of bad input lines, and the epoch / gradient-accumulation plan.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::checkpoint::Loaded;
pub use crate::config::{lora_error, Overlong, PhaseModelConfig, PhaseRunConfig, PhaseTrainConfig};
use crate::data::SplitMix;
use crate::error::{Result, TrainerError};
use crate::run_lock::RunLock;
use crate::tabular::Columns;

/// Where the supervised data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSpec {
    File(PathBuf),
    /// A `builtin:NAME` dataset of [`crate::builtin::dataset`].
    Builtin(String),
}

impl DataSpec {
    /// `builtin:NAME` or a path.
    pub fn parse(s: &str) -> Self {
        match s.strip_prefix("builtin:") {
            Some(name) => DataSpec::Builtin(name.to_string()),
            None => DataSpec::File(PathBuf::from(s)),
        }
    }
}

/// Non-blank lines of one data source: `(1-based line number, raw text or built-in value)`.
#[derive(Debug, Clone)]
pub struct SourceLines {
    /// The file's path or `builtin:NAME` (what messages name).
    pub label: String,
    pub lines: Vec<(usize, RawLine)>,
}

/// One line before parsing.
#[derive(Debug, Clone)]
pub enum RawLine {
    Text(String),
    Json(Value),
    /// A line of the file that is not UTF-8 (counted, not parsed).
    NotUtf8,
    /// A JSONL line without a nested column the mapping names (counted, with why).
    Unmapped(String),
    /// A Parquet row ([`crate::tabular`]), or why it is not one; reported as rows.
    Row(std::result::Result<Value, String>),
}

impl SourceLines {
    /// Reads a JSONL file (blank lines skipped, numbers kept); a line that is not UTF-8 is kept as
    /// [`RawLine::NotUtf8`], so one bad line is counted rather than failing the file.
    pub fn read_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| TrainerError::io(path, e))?;
        let lines = bytes
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
            .enumerate()
            .filter_map(|(i, l)| match std::str::from_utf8(l) {
                Ok(t) if t.trim().is_empty() => None,
                Ok(t) => Some((i + 1, RawLine::Text(t.to_string()))),
                Err(_) => Some((i + 1, RawLine::NotUtf8)),
            })
            .collect();
        Ok(SourceLines { label: path.display().to_string(), lines })
    }

    fn from_values(label: String, values: Vec<Value>) -> Self {
        SourceLines { label, lines: values.into_iter().enumerate().map(|(i, v)| (i + 1, RawLine::Json(v))).collect() }
    }

    /// Reads the rows of Parquet `spec` (a file, a directory or a `*` glob), renamed by `cols` and
    /// numbered on across shards.
    pub fn read_parquet(spec: &str, cols: &Columns) -> Result<Self> {
        let mut lines = Vec::new();
        crate::tabular::for_each_row(spec, cols, |_, _, row| {
            lines.push((lines.len() + 1, RawLine::Row(row.map(Value::Object))));
            Ok(())
        })?;
        Ok(SourceLines { label: spec.to_string(), lines })
    }

    /// Applies a column mapping to the lines (JSONL fields renamed as Parquet columns are).
    fn rename(&mut self, cols: &Columns) {
        for (_, line) in self.lines.iter_mut().filter(|_| !cols.is_identity()) {
            if let RawLine::Text(t) = line {
                if let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(t) {
                    *line = match cols.rename(&mut o) {
                        Ok(()) => RawLine::Json(Value::Object(o)),
                        Err(reason) => RawLine::Unmapped(reason),
                    };
                }
            }
        }
    }

    /// Parses every line into a JSON object; the others are counted in `report`.
    pub fn objects(&self, report: &mut DataReport) -> Vec<(usize, serde_json::Map<String, Value>)> {
        let mut out = Vec::with_capacity(self.lines.len());
        for (n, line) in &self.lines {
            report.rows |= matches!(line, RawLine::Row(_));
            let value = match line {
                RawLine::Json(v) | RawLine::Row(Ok(v)) => v.clone(),
                RawLine::Row(Err(reason)) | RawLine::Unmapped(reason) => {
                    report.skip(*n, reason);
                    continue;
                }
                RawLine::Text(t) => match serde_json::from_str::<Value>(t) {
                    Ok(v) => v,
                    Err(_) if t.starts_with('\u{feff}') => {
                        report.skip(*n, crate::data::BOM);
                        continue;
                    }
                    Err(_) => {
                        report.skip(*n, "not valid JSON");
                        continue;
                    }
                },
                RawLine::NotUtf8 => {
                    report.skip(*n, "not valid UTF-8");
                    continue;
                }
            };
            match value {
                Value::Object(o) => out.push((*n, o)),
                _ => report.skip(*n, "not a JSON object"),
            }
        }
        out
    }
}

/// The training lines and the eval lines of a phase.
#[derive(Debug, Clone)]
pub struct Splits {
    pub train: SourceLines,
    /// None when there is no eval data.
    pub eval: Option<SourceLines>,
}

/// Resolves `data.train`, `data.eval` and `data.eval_fraction`: an explicit eval file wins; then
/// `eval_fraction > 0` holds out that fraction of the train lines (a seeded random subset, at least
/// one line); otherwise a built-in train set brings its own held-out split, and a file none.
/// A file is JSONL unless [`crate::tabular::is_tabular`] (Parquet, a `save_to_disk` directory); `cols` maps the fields of both.
pub fn load_splits(train: &str, eval: Option<&str>, eval_fraction: f64, seed: u64, cols: &Columns) -> Result<Splits> {
    if !(0.0..1.0).contains(&eval_fraction) {
        return Err(TrainerError::Config(format!("data.eval_fraction: must be in [0, 1), got {eval_fraction}")));
    }
    let load = |spec: &str, key: &str| -> Result<(SourceLines, Option<SourceLines>)> {
        match DataSpec::parse(spec) {
            DataSpec::File(_) if crate::tabular::is_tabular(spec) => Ok((SourceLines::read_parquet(spec, cols)?, None)),
            DataSpec::File(p) => {
                if p.is_dir() {
                    return Err(TrainerError::Config(format!(
                        "data.{key}: {}: {}",
                        p.display(),
                        crate::data::NOT_A_DATA_DIR
                    )));
                }
                if !p.is_file() {
                    return Err(TrainerError::Config(format!("data.{key}: {}: file not found", p.display())));
                }
                let mut lines = SourceLines::read_file(&p)?;
                lines.rename(cols);
                Ok((lines, None))
            }
            DataSpec::Builtin(name) => {
                let (t, e) =
                    crate::builtin::dataset(&name).map_err(|e| TrainerError::Config(format!("data.{key}: {e}")))?;
                let label = format!("builtin:{name}");
                Ok((
                    SourceLines::from_values(label.clone(), t),
                    Some(SourceLines::from_values(format!("{label} (eval)"), e)),
                ))
            }
        }
    };
    let (mut train, builtin_eval) = load(train, "train")?;
    if let Some(e) = eval.filter(|e| !e.is_empty()) {
        // A built-in named as eval data gives its held-out split.
        let (lines, builtin_held_out) = load(e, "eval")?;
        return Ok(Splits { train, eval: Some(builtin_held_out.unwrap_or(lines)) });
    }
    if eval_fraction > 0.0 && train.lines.len() < 2 {
        tracing::warn!("{}: too few lines to hold out data.eval_fraction; no evaluation", train.label);
    } else if eval_fraction > 0.0 {
        let n = train.lines.len();
        let k = ((n as f64 * eval_fraction).round() as usize).clamp(1, n - 1);
        let mut order: Vec<usize> = (0..n).collect();
        SplitMix(seed ^ 0xE7A1).shuffle(&mut order);
        let mut held = vec![false; n];
        for &i in order.iter().take(k) {
            held[i] = true;
        }
        let (mut t, mut e) = (Vec::new(), Vec::new());
        for (i, l) in train.lines.into_iter().enumerate() {
            if held[i] {
                e.push(l)
            } else {
                t.push(l)
            }
        }
        let label = train.label.clone();
        train.lines = t;
        return Ok(Splits { train, eval: Some(SourceLines { label, lines: e }) });
    }
    Ok(Splits { train, eval: builtin_eval })
}

/// Counts of bad or altered input lines per reason, each with its first line number. Printed as
/// one warning per reason: `data/pairs.jsonl: skipped 3 lines (chosen == rejected), first at line 17`.
#[derive(Debug, Clone, Default)]
pub struct DataReport {
    /// `(skipped?, reason, count, first line)` in order of first appearance.
    kinds: Vec<(bool, String, usize, usize)>,
    /// Parquet rows, not lines.
    rows: bool,
}

impl DataReport {
    fn add(&mut self, skipped: bool, line: usize, reason: &str) {
        match self.kinds.iter_mut().find(|k| k.0 == skipped && k.1 == reason) {
            Some(k) => {
                k.2 += 1;
                k.3 = k.3.min(line);
            }
            None => self.kinds.push((skipped, reason.to_string(), 1, line)),
        }
    }

    /// The line is not used, for `reason`.
    pub fn skip(&mut self, line: usize, reason: &str) {
        self.add(true, line, reason);
    }

    /// The line is used but was truncated (or otherwise altered), for `reason`.
    pub fn truncate(&mut self, line: usize, reason: &str) {
        self.add(false, line, reason);
    }

    fn unit(&self) -> &'static str {
        ["line", "row"][usize::from(self.rows)]
    }

    /// Lines skipped, all reasons together.
    pub fn skipped(&self) -> usize {
        self.kinds.iter().filter(|k| k.0).map(|k| k.2).sum()
    }

    /// Lines skipped for exactly `reason`.
    pub fn count(&self, reason: &str) -> usize {
        self.kinds.iter().filter(|k| k.1 == reason).map(|k| k.2).sum()
    }

    /// One message per reason, naming `label` (the file) and the first offending line.
    pub fn messages(&self, label: &str) -> Vec<String> {
        let mut kinds = self.kinds.clone();
        kinds.sort_by_key(|k| k.3);
        kinds
            .iter()
            .map(|(skipped, reason, n, first)| {
                let what = if *skipped { "skipped" } else { "truncated" };
                let (unit, s) = (self.unit(), if *n == 1 { "" } else { "s" });
                format!("{label}: {what} {n} {unit}{s} ({reason}), first at {unit} {first}")
            })
            .collect()
    }

    /// Logs [`DataReport::messages`] as warnings.
    pub fn warn(&self, label: &str) {
        for m in self.messages(label) {
            tracing::warn!("{m}");
        }
    }

    /// The error for a source without a single usable line.
    pub fn all_bad(&self, label: &str, total: usize) -> TrainerError {
        let why =
            if total == 0 { format!("the file has no {}s", self.unit()) } else { self.messages(label).join("; ") };
        TrainerError::Data { path: PathBuf::from(label), message: format!("no usable examples ({why})") }
    }
}

/// Resolves `model.path` when it names a Hub id (nothing for a path or a `builtin:` model), so a
/// missing or gated model is refused before anything is created.
pub fn check_model_spec(spec: &str) -> Result<()> {
    if !spec.starts_with("builtin:") {
        crate::model_source::resolve(spec, "model.path")?;
    }
    Ok(())
}

/// The starting model directory: a path as is, a Hub id through the Hugging Face cache, or
/// `builtin:tiny` written into `<run_dir>/builtin-model`.
pub fn resolve_model_dir(spec: &str, run_dir: &Path, seed: u64) -> Result<PathBuf> {
    match spec.strip_prefix("builtin:") {
        Some(name) if crate::builtin_models::MODELS.contains(&name) => {
            let dir = run_dir.join("builtin-model");
            crate::builtin_models::write_model(name, &dir, seed)?;
            Ok(dir)
        }
        Some(other) => Err(TrainerError::Config(format!(
            "model.path: unknown built-in model `builtin:{other}` (available: {})",
            crate::builtin_models::MODELS.iter().map(|m| format!("builtin:{m}")).collect::<Vec<_>>().join(", ")
        ))),
        None => {
            let p = crate::model_source::resolve(spec, "model.path")?;
            if !p.is_dir() {
                return Err(TrainerError::Config(format!("model.path: {spec}: model directory not found")));
            }
            Ok(p)
        }
    }
}

/// The run directory every rank of a phase writes its checkpoint shards into: `run.run_dir`, or
/// `runs/<phase>-<unix time>` with rank 0's time (shared over the ranks).
pub fn shared_run_dir(world: &rlhf_collective::World, run_dir: &Option<PathBuf>, phase: &str) -> Result<PathBuf> {
    if let Some(dir) = run_dir {
        return Ok(dir.clone());
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let t = crate::dist::sum(world, &[if world.is_main() { t as f64 } else { 0.0 }])?[0] as u64;
    Ok(PathBuf::from("runs").join(format!("{phase}-{t}")))
}

/// Creates the run directory `dir`, takes its lock ([`RunLock`]:
/// one process per run directory) and writes the resolved config; refuses a directory that
/// already holds a run, unless `resuming` it. A resumed run's config is written later, by
/// [`continue_run`], once the resume is known to train something. The directory is this
/// process's until the returned lock is dropped.
pub fn prepare_run_dir<T: Serialize>(dir: &Path, cfg: &T, resuming: bool) -> Result<RunLock> {
    let dir = dir.to_path_buf();
    let lock = RunLock::acquire(&dir)?;
    // A new run never appends to, or overwrites, another run's metrics, config and model.
    if !resuming && crate::metrics::logged_steps(&dir).is_some() {
        return Err(TrainerError::Config(format!(
            "{}: the run directory already holds a run (metrics.jsonl); choose another --run-dir",
            dir.display()
        )));
    }
    if !resuming {
        if let Err(e) = write_config(&dir, cfg) {
            lock.abandon();
            return Err(e);
        }
    }
    Ok(lock)
}

fn write_config<T: Serialize>(dir: &Path, cfg: &T) -> Result<()> {
    let text = toml::to_string(cfg).map_err(|e| TrainerError::Config(format!("cannot serialise config: {e}")))?;
    let path = dir.join("config.toml");
    std::fs::write(&path, text).map_err(|e| TrainerError::io(&path, e))
}

/// A supervised run about to train `total` steps in `run_dir`: a resume that would train
/// nothing is refused ([`crate::checkpoint::refuse_nothing_to_train`]) before any of the run's files is rewritten,
/// then a resumed run's config is written (a fresh one's was, by [`prepare_run_dir`]).
pub fn continue_run<T: Serialize>(run_dir: &Path, cfg: &T, resume: Option<&Loaded>, total: usize) -> Result<()> {
    if resume.is_none() {
        return Ok(());
    }
    let what = format!("its data and settings ({total} optimizer steps)");
    crate::checkpoint::refuse_nothing_to_train(resume, total, &what)?;
    write_config(run_dir, cfg)
}

/// Runs `f` in the run directory of `lock`, then releases it. A start that fails before its first
/// metrics line (the model or the data did not load) leaves the directory as it found it
/// ([`RunLock::abandon`]), so it can be used again.
pub fn in_run_dir<T>(lock: RunLock, f: impl FnOnce(&Path) -> Result<T>) -> Result<T> {
    let result = f(lock.dir());
    if result.is_err() && crate::metrics::logged_steps(lock.dir()).is_none() {
        lock.abandon();
    }
    result
}

/// Optimizer steps of a run over `n` items: `epochs × ⌈⌈n / batch⌉ / accum⌉`, capped by `max_steps`.
pub fn total_steps(n: usize, t: &PhaseTrainConfig) -> usize {
    let per_epoch = n.div_ceil(t.batch_size).div_ceil(t.gradient_accumulation_steps);
    let all = per_epoch * t.epochs;
    if t.steps > 0 {
        all.min(t.steps)
    } else {
        all
    }
}

/// The item indices of every optimizer step of one epoch: a seeded shuffle of `0..n`, cut into
/// micro-batches of `batch_size`, grouped `gradient_accumulation_steps` at a time (the last group may be shorter).
pub fn epoch_plan(n: usize, t: &PhaseTrainConfig, seed: u64, epoch: usize) -> Vec<Vec<Vec<usize>>> {
    let mut order: Vec<usize> = (0..n).collect();
    SplitMix(seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).shuffle(&mut order);
    let micro: Vec<Vec<usize>> = order.chunks(t.batch_size).map(<[usize]>::to_vec).collect();
    micro.chunks(t.gradient_accumulation_steps).map(<[Vec<usize>]>::to_vec).collect()
}

pub(crate) fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// Writes `<run_dir>/summary.json`.
pub(crate) fn write_summary(run_dir: &Path, v: &serde_json::Value) -> Result<()> {
    let path = run_dir.join("summary.json");
    let text = serde_json::to_string_pretty(v).map_err(|e| TrainerError::Run(format!("summary: {e}")))?;
    std::fs::write(&path, text + "\n").map_err(|e| TrainerError::io(&path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_counts_per_reason_with_first_line() {
        let mut r = DataReport::default();
        r.skip(17, "chosen == rejected");
        r.skip(3, "not valid JSON");
        r.skip(20, "chosen == rejected");
        r.truncate(5, "longer than max_len = 8 tokens");
        assert_eq!(r.skipped(), 3);
        assert_eq!(
            r.messages("data/pairs.jsonl"),
            vec![
                "data/pairs.jsonl: skipped 1 line (not valid JSON), first at line 3",
                "data/pairs.jsonl: truncated 1 line (longer than max_len = 8 tokens), first at line 5",
                "data/pairs.jsonl: skipped 2 lines (chosen == rejected), first at line 17",
            ]
        );
    }

    #[test]
    fn a_line_that_is_not_utf8_is_counted_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        let mut bytes = b"{\"a\": 1}\r\n{\"b\": \"".to_vec();
        bytes.extend_from_slice(&[0xff, 0xfe]);
        bytes.extend_from_slice(b"\"}\n\n[1]\n{\"c\": 3}");
        std::fs::write(&p, bytes).unwrap();
        let lines = SourceLines::read_file(&p).unwrap();
        let mut report = DataReport::default();
        let objects = lines.objects(&mut report);
        assert_eq!(objects.iter().map(|(n, _)| *n).collect::<Vec<_>>(), vec![1, 5], "CRLF and a last line without \\n");
        assert_eq!(
            report.messages("d.jsonl"),
            vec![
                "d.jsonl: skipped 1 line (not valid UTF-8), first at line 2",
                "d.jsonl: skipped 1 line (not a JSON object), first at line 4",
            ]
        );
    }

    #[test]
    fn plan_covers_every_item_once_per_epoch() {
        let t = PhaseTrainConfig { batch_size: 3, gradient_accumulation_steps: 2, epochs: 2, ..Default::default() };
        assert_eq!(total_steps(10, &t), 4);
        let plan = epoch_plan(10, &t, 1, 0);
        assert_eq!(plan.len(), 2);
        let mut all: Vec<usize> = plan.iter().flatten().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_ne!(epoch_plan(10, &t, 1, 1), plan, "reshuffled every epoch");
        assert_eq!(total_steps(10, &PhaseTrainConfig { steps: 3, ..t }), 3);
    }

    #[test]
    fn eval_fraction_holds_out_disjoint_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(&p, (0..10).map(|i| format!("{{\"i\": {i}}}\n")).collect::<String>()).unwrap();
        let s = load_splits(p.to_str().unwrap(), None, 0.2, 7, &Columns::default()).unwrap();
        let e = s.eval.unwrap();
        assert_eq!((s.train.lines.len(), e.lines.len()), (8, 2));
        assert!(e.lines.iter().all(|(n, _)| !s.train.lines.iter().any(|(m, _)| m == n)));
        let s = load_splits("builtin:addition-sft", None, 0.0, 7, &Columns::default()).unwrap();
        assert_eq!(s.eval.unwrap().lines.len(), 11);
        let e = load_splits(dir.path().join("nope.jsonl").to_str().unwrap(), None, 0.0, 0, &Columns::default())
            .unwrap_err();
        assert!(e.to_string().contains("data.train") && e.to_string().contains("nope.jsonl"), "{e}");
    }
}
