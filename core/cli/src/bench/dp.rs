//! The data-parallel section of `rlhf bench`: the RL section's GRPO step (same model, B, G,
//! lengths) run by `rlhf train` on 1 rank × 1 thread, then on N ranks × 1 thread each (`--nproc
//! N`: Gloo over loopback, the same global batch), side by side in one run. Reported: the median
//! step time of each (first step excluded), the speed-up and its scaling efficiency (speed-up /
//! N), and per step the seconds spent in collectives and the bytes sent into them (the
//! experience gathers, the bucketed gradient all-reduce, the metric merges).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use serde::Serialize;

use super::report::median;
use rlhf_trainer::RlConfig;

/// Medians over the timed steps.
#[derive(Debug, Clone, Serialize)]
pub struct DpResult {
    pub ranks: usize,
    /// Seconds per step on 1 rank × 1 thread.
    pub one_rank_s: f64,
    /// Seconds per step on `ranks` ranks × 1 thread.
    pub n_ranks_s: f64,
    /// Seconds per step inside collectives, and bytes sent into them, per rank.
    pub comm_s: f64,
    pub comm_bytes: f64,
}

impl DpResult {
    /// One rank's step time / N ranks' step time.
    pub fn speedup(&self) -> f64 {
        self.one_rank_s / self.n_ranks_s
    }
}

/// The medians of `keys` over the steps after the first of the run in `run_dir`.
fn medians(run_dir: &Path, keys: &[&str]) -> anyhow::Result<Vec<f64>> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let rows: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    if rows.len() < 2 {
        bail!("{}: fewer than 2 steps", path.display());
    }
    keys.iter()
        .map(|k| {
            let xs: Vec<f64> = rows[1..].iter().filter_map(|r| r[*k].as_f64()).collect();
            median(&xs).with_context(|| format!("{}: no `{k}`", path.display()))
        })
        .collect()
}

/// Runs `cfg` with `rlhf train` on 1 and on `ranks` ranks, one thread each, in `work`.
pub fn run(cfg: &RlConfig, ranks: usize, work: &Path) -> anyhow::Result<DpResult> {
    if ranks < 2 {
        bail!("--ranks {ranks}: the data-parallel section compares 1 rank with 2 or more");
    }
    let config = work.join("dp.toml");
    std::fs::write(&config, toml::to_string(cfg)?).with_context(|| format!("{}", config.display()))?;
    let exe = std::env::current_exe().context("the rlhf executable")?;
    let train = |run_dir: &Path, nproc: usize| -> anyhow::Result<()> {
        let out = Command::new(&exe)
            .args(["train", "--config"])
            .arg(&config)
            .arg("--run-dir")
            .arg(run_dir)
            .args(["--nproc", &nproc.to_string(), "--log-level", "warn"])
            .env("OMP_NUM_THREADS", "1")
            .output()
            .context("starting rlhf train")?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            bail!("rlhf train on {nproc} rank(s) failed: {}", err.lines().last().unwrap_or(""));
        }
        Ok(())
    };
    let (one, many) = (work.join("dp-1"), work.join(format!("dp-{ranks}")));
    train(&one, 1)?;
    train(&many, ranks)?;
    let one_rank_s = medians(&one, &["step_time"])?[0];
    let m = medians(&many, &["step_time", "time/comm", "comm/bytes"])?;
    Ok(DpResult { ranks, one_rank_s, n_ranks_s: m[0], comm_s: m[1], comm_bytes: m[2] })
}

/// The table the data-parallel rows go in.
pub const TABLE: &str = "\
| date | device | model | settings | 1 rank × 1 thread s/step | N ranks × 1 thread s/step | speed-up (efficiency) | collectives s/step | collectives MB/step |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
";

/// The Markdown row of a result.
pub fn markdown_row(date: &str, device: &str, model: &str, settings: &str, r: &DpResult) -> String {
    format!(
        "| {date} | {device} | {model} | {settings}, {} ranks | {:.4} | {:.4} | {:.2}x ({:.0}%) | {:.4} | {:.3} |",
        r.ranks,
        r.one_rank_s,
        r.n_ranks_s,
        r.speedup(),
        100.0 * r.speedup() / r.ranks as f64,
        r.comm_s,
        r.comm_bytes / 1e6
    )
}

/// Inserts `row` at the end of the data-parallel table of `text`, or appends a `## Data-parallel`
/// section with the table when there is none.
pub fn insert_row(text: &str, table: &str, row: &str) -> String {
    let head = table.lines().next().unwrap_or("");
    super::report::insert_into_table(text, head, row).unwrap_or_else(|| {
        let mut out = text.trim_end().to_string();
        out.push_str(
            "\n\n## Data-parallel\n\n`rlhf bench dp`: the RL section's GRPO step on 1 rank and on N ranks (`rlhf train \
             --nproc N`, Gloo over loopback), one thread each, the same global batch; medians over the steps after the \
             first. Collectives: seconds inside them and bytes sent into them per step and rank.\n\n",
        );
        out.push_str(table);
        out.push_str(row);
        out.push('\n');
        out
    })
}

/// Adds `row` to the data-parallel table of `path`.
pub fn record(path: &Path, row: &str) -> anyhow::Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    std::fs::write(path, insert_row(&old, TABLE, row)).with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_into_their_table_or_a_new_section() {
        let base = "# Benchmarks\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n";
        let with = insert_row(base, TABLE, "| dp1 |");
        assert!(with.ends_with(&format!("{TABLE}| dp1 |\n")), "{with}");
        assert!(with.starts_with(base.trim_end()));
        let again = insert_row(&(with.clone() + "\nText after.\n"), TABLE, "| dp2 |");
        assert!(again.contains("| dp1 |\n| dp2 |\n\nText after."), "{again}");
        assert_eq!(again.matches("## Data-parallel").count(), 1);
    }

    #[test]
    fn rows_show_speedup_and_efficiency() {
        let r = DpResult { ranks: 2, one_rank_s: 0.2, n_ranks_s: 0.125, comm_s: 0.01, comm_bytes: 2.5e6 };
        let row = markdown_row("2026-11-23", "cpu", "m", "f32", &r);
        assert!(row.contains("| 0.2000 | 0.1250 | 1.60x (80%) | 0.0100 | 2.500 |"), "{row}");
    }
}
