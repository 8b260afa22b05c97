//! The overlap section of `rlhf bench`: the RL section's GRPO run by `rlhf train` synchronously
//! (twice, with two seeds: the run-to-run spread of the reward) and with asynchronous rollouts at
//! `rollout.max_staleness` 1 and 2 (the generation worker on half the intra-op threads, the
//! trainer on the rest), side by side in one run. Reported per run: the median step time over the
//! steady steps (after the first `k + 1`, whose batches were sampled before any overlap, and
//! before the last `k`, which have no later batch to sample beside them), steps
//! per minute and the speed-up over the synchronous run, each side's idle share of a step (the
//! trainer waiting for its batch, the worker waiting for a job), and the mean reward over every
//! step — the same samples per step, so the same number of samples per run.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use serde::Serialize;

use super::report::median;
use rlhf_trainer::RlConfig;

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct OverlapRun {
    /// `rollout.max_staleness`.
    pub k: usize,
    pub seed: u64,
    /// Median seconds per steady step.
    pub step_s: f64,
    /// Median share of a steady step the trainer waited for its batch, and the worker had no job
    /// (asynchronous runs).
    pub trainer_idle: Option<f64>,
    pub generator_idle: Option<f64>,
    /// Mean reward over every step.
    pub reward: f64,
    /// Median seconds the worker spent on a batch (asynchronous), or the generate phase (sync).
    pub gen_s: f64,
}

/// Every run, the synchronous one first.
#[derive(Debug, Clone, Serialize)]
pub struct OverlapResult {
    pub steps: usize,
    pub runs: Vec<OverlapRun>,
}

impl OverlapResult {
    /// The synchronous run of the benchmark's seed.
    pub fn sync(&self) -> &OverlapRun {
        &self.runs[0]
    }

    /// The reward difference of the two synchronous runs (seeds `s` and `s + 1`).
    pub fn spread(&self) -> f64 {
        (self.runs[0].reward - self.runs[1].reward).abs()
    }

    /// The synchronous step time / this run's.
    pub fn speedup(&self, r: &OverlapRun) -> f64 {
        self.sync().step_s / r.step_s
    }
}

/// The figures of the run in `run_dir` at staleness `k`.
fn figures(run_dir: &Path, k: usize, seed: u64) -> anyhow::Result<OverlapRun> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r.get("reward").is_some())
        .collect();
    if rows.len() < 2 * k + 3 {
        bail!("{}: {} steps, fewer than {}", path.display(), rows.len(), 2 * k + 3);
    }
    // The first k + 1 batches were sampled before any overlap, and the last k steps have no
    // later batch to sample beside them.
    let steady = &rows[k + 1..rows.len() - k];
    let med = |key: &str| -> Option<f64> {
        let xs: Vec<f64> = steady.iter().filter_map(|r| r[key].as_f64()).collect();
        median(&xs)
    };
    let reward = rows.iter().filter_map(|r| r["reward"].as_f64()).sum::<f64>() / rows.len() as f64;
    let gen_key = if k == 0 { "time/generate" } else { "time/rollout_worker" };
    Ok(OverlapRun {
        k,
        seed,
        step_s: med("step_time").with_context(|| format!("{}: no step_time", path.display()))?,
        trainer_idle: med("time/idle_trainer"),
        generator_idle: med("time/idle_generator"),
        reward,
        gen_s: med(gen_key).unwrap_or(f64::NAN),
    })
}

/// The `--set` overrides that put a run on the vLLM servers at `urls` (none: the local engine).
fn engine_sets(urls: &[String]) -> Vec<String> {
    if urls.is_empty() {
        return Vec::new();
    }
    let quoted: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    vec!["rollout.engine=\"vllm\"".into(), format!("rollout.vllm.urls=[{}]", quoted.join(", "))]
}

/// Runs `cfg` for `steps` steps with `rlhf train` at staleness 0 (seeds `s`, `s + 1`), 1 and 2,
/// in `work`; with `vllm` server URLs, on the vLLM engine at staleness 0 and 1 (it holds one
/// policy at a time).
pub fn run(cfg: &RlConfig, steps: usize, vllm: &[String], work: &Path) -> anyhow::Result<OverlapResult> {
    if steps < 8 {
        bail!("--overlap-steps {steps}: at least 8 (the first k + 1 and the last k steps are not timed)");
    }
    let config = work.join("overlap.toml");
    std::fs::write(&config, toml::to_string(cfg)?).with_context(|| format!("{}", config.display()))?;
    let exe = std::env::current_exe().context("the rlhf executable")?;
    let seed = cfg.run.seed;
    let mut runs = Vec::new();
    let engine = engine_sets(vllm);
    let last_k = if vllm.is_empty() { 2 } else { 1 };
    for (k, seed) in [(0, seed), (0, seed + 1), (1, seed), (2, seed)] {
        if k > last_k {
            break;
        }
        let run_dir = work.join(format!("overlap-k{k}-seed{seed}"));
        let out = Command::new(&exe)
            .args(["train", "--no-progress", "--log-level", "warn", "--config"])
            .arg(&config)
            .arg("--run-dir")
            .arg(&run_dir)
            .args(["--set", &format!("train.steps={steps}")])
            .args(["--set", &format!("rollout.max_staleness={k}")])
            .args(["--set", &format!("run.seed={seed}")])
            // Held-out evaluation would time the same policy in every run: left out.
            .args(["--set", "eval.data=\"\""])
            .args(engine.iter().flat_map(|e| ["--set", e.as_str()]))
            .output()
            .context("starting rlhf train")?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            bail!("rlhf train with max_staleness {k} failed: {}", err.lines().last().unwrap_or(""));
        }
        let r = figures(&run_dir, k, seed)?;
        println!(
            "       max_staleness {k} (seed {seed}): {:.3} s/step ({:.1} steps/min), reward {:.4}{}",
            r.step_s,
            60.0 / r.step_s,
            r.reward,
            match (r.trainer_idle, r.generator_idle) {
                (Some(t), Some(g)) => format!(", idle: trainer {:.0} %, generator {:.0} %", 100.0 * t, 100.0 * g),
                _ => String::new(),
            }
        );
        runs.push(r);
    }
    Ok(OverlapResult { steps, runs })
}

/// The settings column: `base` (dtype, batch, lengths), then whether the preset's warm-up was
/// skipped and how many vLLM servers sampled.
pub fn settings(mut base: String, no_warmup: bool, vllm_servers: usize) -> String {
    if no_warmup {
        base.push_str(", no warm-up");
    }
    if vllm_servers > 0 {
        base.push_str(&format!(", vLLM engine ({vllm_servers} server{})", if vllm_servers == 1 { "" } else { "s" }));
    }
    base
}

/// The table the overlap rows go in.
pub const TABLE: &str = "\
| date | device | model | settings | max_staleness | s/step | steps/min | vs synchronous | trainer idle | generator idle | mean reward (sync spread) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
";

/// The Markdown rows of a result: the synchronous run of the benchmark's seed, then k = 1 and 2.
pub fn markdown_rows(date: &str, device: &str, model: &str, settings: &str, r: &OverlapResult) -> Vec<String> {
    let pct = |x: Option<f64>| x.map_or("—".to_string(), |v| format!("{:.0} %", 100.0 * v));
    r.runs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(_, run)| {
            format!(
                "| {date} | {device} | {model} | {settings}, {} steps | {} | {:.3} | {:.1} | {:.2}x | {} | {} | {:.4} (±{:.4}) |",
                r.steps,
                run.k,
                run.step_s,
                60.0 / run.step_s,
                r.speedup(run),
                pct(run.trainer_idle),
                pct(run.generator_idle),
                run.reward,
                r.spread()
            )
        })
        .collect()
}

/// Adds `rows` to the overlap table of `path` (a new `## Asynchronous rollouts` section when
/// there is none).
pub fn record(path: &Path, rows: &[String]) -> anyhow::Result<()> {
    let mut text = std::fs::read_to_string(path).unwrap_or_default();
    let intro = "## Asynchronous rollouts\n\n`rlhf bench overlap`: the RL section's GRPO run by `rlhf train` \
                 synchronously and with `rollout.max_staleness` 1 and 2 (the generation worker on half the intra-op \
                 threads, the trainer on the rest; with `--overlap-vllm`, rows marked \"vLLM engine\", the servers \
                 sample and only k 1 runs), in one run. Median step time over the steps after the first k + \
                 1 and before the last k; idle: the median share of a step the trainer waited for its batch, and the \
                 worker had nothing to sample; mean reward over every step, ± the difference between two \
                 synchronous seeds.";
    for row in rows {
        text = super::report::add_row_or_section(&text, TABLE, row, intro);
    }
    std::fs::write(path, text).with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vllm_overrides_name_the_engine_and_every_server() {
        use rlhf_trainer::config::ConfigSource;
        let urls = ["http://127.0.0.1:8001".to_string(), "http://127.0.0.1:8002".to_string()];
        let sets = engine_sets(&urls);
        let cfg = RlConfig::load(&ConfigSource::Preset("grpo".into()), Some("grpo"), &sets).unwrap();
        assert_eq!(cfg.rollout.engine, rlhf_trainer::config::EngineKind::Vllm);
        assert_eq!(cfg.rollout.vllm.urls, urls);
        assert!(engine_sets(&[]).is_empty());
        assert_eq!(settings("f32, B=2".into(), true, 2), "f32, B=2, no warm-up, vLLM engine (2 servers)");
        assert_eq!(settings("f32, B=2".into(), false, 0), "f32, B=2");
    }

    #[test]
    fn rows_compare_with_the_synchronous_run() {
        let run = |k, seed, step_s, reward, idle: Option<f64>| OverlapRun {
            k,
            seed,
            step_s,
            trainer_idle: idle,
            generator_idle: idle,
            reward,
            gen_s: 0.1,
        };
        let r = OverlapResult {
            steps: 12,
            runs: vec![
                run(0, 42, 2.0, 0.5, None),
                run(0, 43, 2.0, 0.45, None),
                run(1, 42, 1.25, 0.48, Some(0.05)),
                run(2, 42, 1.0, 0.47, Some(0.02)),
            ],
        };
        let rows = markdown_rows("2026-11-27", "cpu", "m", "B=4", &r);
        assert_eq!(rows.len(), 3);
        assert!(rows[0].contains("| 0 | 2.000 | 30.0 | 1.00x | — | — | 0.5000 (±0.0500) |"), "{}", rows[0]);
        assert!(rows[1].contains("| 1 | 1.250 | 48.0 | 1.60x | 5 % | 5 % | 0.4800 (±0.0500) |"), "{}", rows[1]);
        let text = "# Benchmarks\n";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("B.md");
        std::fs::write(&path, text).unwrap();
        record(&path, &rows).unwrap();
        let out = std::fs::read_to_string(&path).unwrap();
        assert_eq!(out.matches("## Asynchronous rollouts").count(), 1);
        assert!(out.ends_with(&format!("{}\n", rows[2])), "{out}");
    }
}
