//! PNG charts of a run's `metrics.jsonl`.
//!
//! [`plot_run`] reads `<run_dir>/metrics.jsonl` and writes, for whatever metrics the run logged,
//! `reward.png`, `kl.png`, `loss.png`, `eval.png`, `lengths.png`, `throughput.png` and `memory.png` (1000×600) into an output
//! directory, `<run_dir>/plots` by default. [`read_metrics`] and [`plot_metrics`] are the two
//! halves, for callers that want the parse warnings themselves.
//!
//! Text is drawn with an embedded subset of DejaVu Sans (`fonts/`, Bitstream Vera licence), so
//! no system font, fontconfig or freetype is needed. This crate never depends on tch.

mod chart;
mod metrics;

use std::{
    fs,
    path::{Path, PathBuf},
};

pub use chart::CHART_SIZE;
use chart::{Line, Panel};
pub use metrics::{read_metrics, Metrics};

/// The file [`plot_run`] reads in a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The subdirectory of the run directory that [`default_out_dir`] names.
pub const PLOTS_DIR: &str = "plots";

/// Why no chart could be drawn. Every message is one line and names the path concerned.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("run directory {} does not exist or is not a directory", .path.display())]
    RunDirMissing { path: PathBuf },
    #[error("no metrics file: {} does not exist", .path.display())]
    NoMetrics { path: PathBuf },
    #[error("cannot read {}: {source}", .path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: no valid metrics record (one JSON object with a `step` per line)", .path.display())]
    NoValidLines { path: PathBuf },
    #[error("cannot create the output directory {}: {source}", .path.display())]
    CreateOutDir { path: PathBuf, source: std::io::Error },
    #[error("cannot draw {}: {message}", .path.display())]
    Draw { path: PathBuf, message: String },
    #[error("the embedded font could not be loaded")]
    Font,
}

/// `<run_dir>/plots`.
pub fn default_out_dir(run_dir: &Path) -> PathBuf {
    run_dir.join(PLOTS_DIR)
}

/// Reads `<run_dir>/metrics.jsonl` and writes the charts its metrics allow into `out_dir`
/// (created if needed; see [`default_out_dir`]). Returns the paths written, in the order
/// reward, kl, loss, eval, lengths, throughput; a chart none of whose metrics were logged is skipped.
/// Skipped lines (a truncated last line after a crash, say) are logged with `tracing::warn!`.
pub fn plot_run(run_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    if !run_dir.is_dir() {
        return Err(PlotError::RunDirMissing { path: run_dir.to_owned() });
    }
    let metrics = read_metrics(&run_dir.join(METRICS_FILE))?;
    for warning in &metrics.warnings {
        tracing::warn!("{warning}");
    }
    plot_metrics(&metrics, out_dir)
}

/// Writes the charts of `metrics` into `out_dir` (created if needed); see [`plot_run`].
pub fn plot_metrics(metrics: &Metrics, out_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let charts = charts(metrics);
    if !charts.is_empty() {
        fs::create_dir_all(out_dir).map_err(|source| PlotError::CreateOutDir { path: out_dir.to_owned(), source })?;
    }
    let mut written = Vec::with_capacity(charts.len());
    for (file, panels) in charts {
        let path = out_dir.join(file);
        chart::draw(&path, &panels)?;
        written.push(path);
    }
    Ok(written)
}

/// Every chart that has something to show, with its file name.
fn charts(m: &Metrics) -> Vec<(&'static str, Vec<Panel>)> {
    let candidates = [
        ("reward.png", vec![reward(m)]),
        ("kl.png", kl_entropy(m).into()),
        ("loss.png", vec![losses(m)]),
        ("eval.png", vec![evals(m)]),
        ("lengths.png", vec![lengths(m)]),
        ("throughput.png", vec![tokens_per_s(m), step_times(m)]),
        ("memory.png", vec![memory(m)]),
    ];
    candidates
        .into_iter()
        .map(|(file, panels)| (file, panels.into_iter().filter(|p| !p.lines.is_empty()).collect::<Vec<_>>()))
        .filter(|(_, panels)| !panels.is_empty())
        .collect()
}

fn panel(title: &str, y_desc: &str, lines: Vec<Line>) -> Panel {
    Panel { title: title.to_owned(), y_desc: y_desc.to_owned(), y2_desc: String::new(), from_zero: false, lines }
}

/// The series whose names satisfy `keep`, in name order.
fn matching<'m>(m: &'m Metrics, keep: impl Fn(&str) -> bool + 'm) -> impl Iterator<Item = Line> + 'm {
    m.names().filter(move |name| keep(name)).filter_map(|name| m.get(name).map(|points| Line::new(name, points)))
}

/// `reward` with a ± `reward_std` band, and every reward source's `rewards/<name>/mean` (but one
/// identical to `reward`, as with a single source: that one is named in the label instead).
fn reward(m: &Metrics) -> Panel {
    let mut sources: Vec<Line> = matching(m, |name| {
        name.strip_prefix("rewards/")
            .and_then(|rest| rest.strip_suffix("/mean"))
            .is_some_and(|source| !source.is_empty())
    })
    .collect();
    let mut lines = Vec::new();
    if let Some(points) = m.get("reward") {
        let mut label = "reward".to_owned();
        if let Some(same) = sources.iter().position(|line| line.points == points) {
            label = format!("reward = {}", sources.remove(same).label);
        }
        let std = m.get("reward_std").map(<[_]>::to_vec);
        if std.is_some() {
            label.push_str(" (band: ± reward_std)");
        }
        lines.push(Line { std, ..Line::new(label, points) });
    }
    lines.extend(sources);
    panel("Reward", "reward", lines)
}

fn line(m: &Metrics, name: &str, right: bool) -> Option<Line> {
    m.get(name).map(|points| Line { right, ..Line::new(name, points) })
}

/// Two panels, as `kl` (to the reference model) and `approx_kl` (between the policies before and
/// after an update) differ by orders of magnitude: `kl` with `entropy` on the right axis, then
/// `approx_kl` with `clip_ratio` on the right axis. Without `kl`, `approx_kl` takes its place.
fn kl_entropy(m: &Metrics) -> [Panel; 2] {
    let kl = line(m, "kl", false);
    let approx_kl = line(m, "approx_kl", false);
    let (first, second) = if kl.is_some() { (kl, approx_kl) } else { (approx_kl, None) };
    let top = first.into_iter().chain(line(m, "entropy", true)).collect();
    let bottom = second.into_iter().chain(line(m, "clip_ratio", true)).collect();
    [
        Panel { y2_desc: "entropy (nats/token)".to_owned(), ..panel("KL divergence and entropy", "KL", top) },
        Panel {
            y2_desc: "clip ratio".to_owned(),
            ..panel("Policy change per update: approx_kl and clip_ratio", "approx KL", bottom)
        },
    ]
}

/// Every `loss/*` (RL), and `loss` with `eval/loss` (SFT, RM); a loss twenty times smaller than
/// the largest goes to the right axis so that it is not drawn flat.
fn losses(m: &Metrics) -> Panel {
    let mut lines: Vec<Line> =
        matching(m, |name| name.starts_with("loss/") || name == "loss" || name == "eval/loss").collect();
    let scale = |line: &Line| line.points.iter().map(|p| p.1.abs()).fold(0.0, f64::max);
    let largest = lines.iter().map(scale).fold(0.0, f64::max);
    for line in &mut lines {
        line.right = scale(line) * 20.0 < largest;
    }
    Panel { y2_desc: "loss (right axis)".to_owned(), ..panel("Losses", "loss", lines) }
}

/// `completions/*length*`.
fn lengths(m: &Metrics) -> Panel {
    let lines = matching(m, |name| name.strip_prefix("completions/").is_some_and(|rest| rest.contains("length")));
    Panel { from_zero: true, ..panel("Completion length", "tokens", lines.collect()) }
}

/// The held-out scores, logged at step 0, every `eval_every` (`every_steps`) steps and at the
/// end: of SFT and RM runs all but the loss and the token count (`eval/ppl`, `eval/accuracy`,
/// `eval/chosen_score`, ...); of RL runs the rewards, pass@k and maj@n, without the per-`data_source`
/// breakdown, the lengths and the prompt count.
fn evals(m: &Metrics) -> Panel {
    let lines = matching(m, is_held_out_score).collect();
    panel("Held-out evaluation", "value", lines)
}

/// Whether `name` is one of the scores [`evals`] plots.
fn is_held_out_score(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("eval/") else { return false };
    let counted = ["loss", "tokens", "prompts"].contains(&rest) || rest.starts_with("length/");
    !counted && (!rest.contains('/') || rest.starts_with("reward/"))
}

fn tokens_per_s(m: &Metrics) -> Panel {
    let lines = m.get("tokens_per_s").map(|points| Line::new("tokens_per_s", points)).into_iter().collect();
    Panel { from_zero: true, ..panel("Throughput", "tokens/s", lines) }
}

/// `step_time` and its parts `time/*`.
fn step_times(m: &Metrics) -> Panel {
    let lines = m.get("step_time").map(|points| Line::new("step_time", points)).into_iter();
    let lines = lines.chain(matching(m, |name| name.starts_with("time/"))).collect();
    Panel { from_zero: true, ..panel("Time per step", "seconds", lines) }
}

/// The peak resident memory of each phase, `mem/peak_rss_gb/*` (Linux).
fn memory(m: &Metrics) -> Panel {
    let lines = matching(m, |name| name.starts_with("mem/peak_rss_gb/")).collect();
    Panel { from_zero: true, ..panel("Peak resident memory per phase", "GB", lines) }
}

#[cfg(test)]
mod tests {
    use super::is_held_out_score;

    #[test]
    fn held_out_scores_without_counts_lengths_or_breakdowns() {
        for name in
            ["eval/ppl", "eval/accuracy", "eval/pass@1", "eval/maj@8", "eval/reward/mean", "eval/reward/accuracy"]
        {
            assert!(is_held_out_score(name), "{name}");
        }
        for name in ["eval/loss", "eval/tokens", "eval/prompts", "eval/length/mean", "eval/gsm8k/pass@1", "reward"] {
            assert!(!is_held_out_score(name), "{name}");
        }
    }
}
