//! The data-parallel section of `rlhf bench`: the RL section's GRPO step (same model, B, G,
//! lengths) run by `rlhf train` on 1 rank × 1 thread, then on N ranks × 1 thread each (`--nproc
//! N`: Gloo over loopback, the same global batch), side by side in one run. Reported: the median
//! step time of each (first step excluded), the speed-up and its scaling efficiency (speed-up /
//! N), and per step the seconds spent in collectives and the bytes sent into them (the
//! experience gathers, the bucketed gradient all-reduce, the metric merges). The N-rank run is
//! repeated at each ZeRO stage (`[distributed] zero_stage` 0–3; stage 3 turns gradient
//! checkpointing on, so its step recomputes every layer once more): its step time, the
//! model-state bytes one rank holds — trained weights (`mem/params_gb`), gradients kept between
//! backward passes (`mem/grads_gb`), optimizer state (`mem/optim_gb_max`, the largest over the
//! ranks) — against stage 0's, and rank 0's peak RSS.

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
    /// The N-rank run at each ZeRO stage (stage 0 is the run above).
    pub stages: Vec<StageResult>,
}

/// The N-rank run at one ZeRO stage.
#[derive(Debug, Clone, Serialize)]
pub struct StageResult {
    pub stage: u8,
    /// Median seconds per step.
    pub step_s: f64,
    /// Optimizer state (f32 masters, Adam moments) on the rank that holds the most, GB.
    pub optim_gb: f64,
    /// Trained weights and the gradients kept between backward passes on rank 0, GB.
    pub params_gb: f64,
    pub grads_gb: f64,
    /// Rank 0's peak resident set over the run, GB.
    pub peak_rss_gb: f64,
    pub comm_s: f64,
    pub comm_bytes: f64,
}

impl StageResult {
    /// Model-state bytes per rank (weights + gradients + optimizer state), GB.
    pub fn model_state_gb(&self) -> f64 {
        self.params_gb + self.grads_gb + self.optim_gb
    }
}

impl DpResult {
    /// A stage's model state per rank / stage 0's.
    pub fn state_ratio(&self, s: &StageResult) -> f64 {
        s.model_state_gb() / self.stages[0].model_state_gb()
    }

    /// One rank's step time / N ranks' step time.
    pub fn speedup(&self) -> f64 {
        self.one_rank_s / self.n_ranks_s
    }
}

/// The medians of `keys` over the steps after the first of the run in `run_dir`.
fn medians(run_dir: &Path, keys: &[&str]) -> anyhow::Result<Vec<f64>> {
    let rows = rows(run_dir)?;
    keys.iter()
        .map(|k| {
            let xs: Vec<f64> = rows[1..].iter().filter_map(|r| r[*k].as_f64()).collect();
            median(&xs).with_context(|| format!("{}: no `{k}`", run_dir.display()))
        })
        .collect()
}

/// The step rows of the run in `run_dir` (at least 2).
fn rows(run_dir: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let rows: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    if rows.len() < 2 {
        bail!("{}: fewer than 2 steps", path.display());
    }
    Ok(rows)
}

/// The N-rank run in `run_dir` at ZeRO stage `stage`.
fn stage_result(run_dir: &Path, stage: u8) -> anyhow::Result<StageResult> {
    let keys = ["step_time", "time/comm", "comm/bytes", "mem/optim_gb_max", "mem/params_gb", "mem/grads_gb"];
    let m = medians(run_dir, &keys)?;
    let peak = rows(run_dir)?.iter().filter_map(|r| r["mem/peak_rss_gb"].as_f64()).fold(f64::NAN, f64::max);
    Ok(StageResult {
        stage,
        step_s: m[0],
        comm_s: m[1],
        comm_bytes: m[2],
        optim_gb: m[3],
        params_gb: m[4],
        grads_gb: m[5],
        peak_rss_gb: peak,
    })
}

/// Runs `cfg` with `rlhf train` on 1 and on `ranks` ranks, one thread each, in `work`.
pub fn run(cfg: &RlConfig, ranks: usize, work: &Path) -> anyhow::Result<DpResult> {
    if ranks < 2 {
        bail!("--ranks {ranks}: the data-parallel section compares 1 rank with 2 or more");
    }
    let config = work.join("dp.toml");
    std::fs::write(&config, toml::to_string(cfg)?).with_context(|| format!("{}", config.display()))?;
    let exe = std::env::current_exe().context("the rlhf executable")?;
    let train = |run_dir: &Path, nproc: usize, stage: u8| -> anyhow::Result<()> {
        let out = Command::new(&exe)
            .args(["train", "--config"])
            .arg(&config)
            .arg("--run-dir")
            .arg(run_dir)
            .args(["--nproc", &nproc.to_string(), "--log-level", "warn"])
            .args(["--set", &format!("distributed.zero_stage={stage}")])
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
    train(&one, 1, 0)?;
    train(&many, ranks, 0)?;
    let one_rank_s = medians(&one, &["step_time"])?[0];
    let m = medians(&many, &["step_time", "time/comm", "comm/bytes"])?;
    let mut stages = vec![stage_result(&many, 0)?];
    for stage in 1..=3 {
        let sharded = work.join(format!("dp-{ranks}-zero{stage}"));
        train(&sharded, ranks, stage)?;
        stages.push(stage_result(&sharded, stage)?);
    }
    Ok(DpResult { ranks, one_rank_s, n_ranks_s: m[0], comm_s: m[1], comm_bytes: m[2], stages })
}

/// Prints one line per ZeRO stage of `r`.
pub fn print_stages(r: &DpResult) {
    for st in &r.stages {
        println!(
            "       ZeRO stage {}: {} s/step, model state {:.2} MB per rank ({:.3}x stage 0's: weights {:.2}, \
             gradients {:.2}, optimizer {:.2}), peak RSS {:.3} GB (rank 0)",
            st.stage,
            super::report::fmt_secs(st.step_s),
            st.model_state_gb() * 1e3,
            r.state_ratio(st),
            st.params_gb * 1e3,
            st.grads_gb * 1e3,
            st.optim_gb * 1e3,
            st.peak_rss_gb
        );
    }
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

/// The table the ZeRO-stage rows go in.
pub const STAGE_TABLE: &str = "\
| date | device | model | settings | ZeRO stage | s/step | model state MB per rank (vs stage 0) | weights MB | gradients MB | optimizer MB | peak RSS GB (rank 0) | collectives s/step | collectives MB/step |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
";

/// The Markdown rows of the stages of a result.
pub fn stage_rows(date: &str, device: &str, model: &str, settings: &str, r: &DpResult) -> Vec<String> {
    r.stages
        .iter()
        .map(|s| {
            format!(
                "| {date} | {device} | {model} | {settings}, {} ranks | {} | {:.4} | {:.2} ({:.3}x) | {:.2} | {:.2} | {:.2} | {:.3} | {:.4} | {:.3} |",
                r.ranks,
                s.stage,
                s.step_s,
                s.model_state_gb() * 1e3,
                r.state_ratio(s),
                s.params_gb * 1e3,
                s.grads_gb * 1e3,
                s.optim_gb * 1e3,
                s.peak_rss_gb,
                s.comm_s,
                s.comm_bytes / 1e6
            )
        })
        .collect()
}

/// Inserts `row` at the end of the data-parallel table of `text`, or appends a `## Data-parallel`
/// section with the table when there is none.
pub fn insert_row(text: &str, table: &str, row: &str) -> String {
    let intro =
        "## Data-parallel\n\n`rlhf bench dp`: the RL section's GRPO step on 1 rank and on N ranks (`rlhf train \
                 --nproc N`, Gloo over loopback), one thread each, the same global batch; medians over the steps after \
                 the first. Collectives: seconds inside them and bytes sent into them per step and rank.";
    super::report::add_row_or_section(text, table, row, intro)
}

/// Adds `row` to the data-parallel table of `path`, and `stages` to its ZeRO-stage table (made
/// after the data-parallel section's text when missing).
pub fn record(path: &Path, row: &str, stages: &[String]) -> anyhow::Result<()> {
    let mut text = insert_row(&std::fs::read_to_string(path).unwrap_or_default(), TABLE, row);
    let intro = "### ZeRO stages\n\nThe N-rank run at each `[distributed] zero_stage`: median step time; the model \
                 state one rank holds (trained weights, gradients kept between backward passes, optimizer state on \
                 the rank holding the most) and its ratio to stage 0's; rank 0's peak RSS.";
    for r in stages {
        text = super::report::add_row_or_section(&text, STAGE_TABLE, r, intro);
    }
    std::fs::write(path, text).with_context(|| format!("{}", path.display()))
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
        let stage = |stage, optim_gb| StageResult {
            stage,
            step_s: 0.125,
            optim_gb,
            params_gb: 0.1,
            grads_gb: 0.1,
            peak_rss_gb: 1.5,
            comm_s: 0.01,
            comm_bytes: 2.5e6,
        };
        let r = DpResult {
            ranks: 2,
            one_rank_s: 0.2,
            n_ranks_s: 0.125,
            comm_s: 0.01,
            comm_bytes: 2.5e6,
            stages: vec![stage(0, 0.2), stage(1, 0.15)],
        };
        let row = markdown_row("2026-11-23", "cpu", "m", "f32", &r);
        assert!(row.contains("| 0.2000 | 0.1250 | 1.60x (80%) | 0.0100 | 2.500 |"), "{row}");
        let rows = stage_rows("2026-11-23", "cpu", "m", "f32", &r);
        let want =
            "| f32, 2 ranks | 1 | 0.1250 | 350.00 (0.875x) | 100.00 | 100.00 | 150.00 | 1.500 | 0.0100 | 2.500 |";
        assert!(rows[1].contains(want), "{}", rows[1]);
    }
}
