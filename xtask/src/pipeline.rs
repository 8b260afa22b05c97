//! `cargo xtask pipeline [--run-dir DIR] [--dpo]`: the three RLHF phases end to end on built-in
//! data, on a CPU, as child processes of the debug `rlhf` (built with the plugins, as `cargo xtask
//! train` does):
//!
//! 1. `rlhf sft --run-dir sft` — the embedded `configs/sft.toml`: the tiny built-in Llama
//!    fine-tuned on `builtin:addition-sft`; figure: held-out perplexity before → after.
//! 2. `rlhf rm --run-dir rm --set model.path=sft/model` — `configs/rm.toml`: a reward model on the
//!    SFT backbone trained on `builtin:addition-pairs`; figure: held-out pairwise accuracy before
//!    (step 0, fresh score head) → after.
//! 3. `rlhf train --config ppo.toml` — `configs/pipeline-ppo.toml` (compiled into this binary and
//!    written to the run directory): PPO from the SFT actor, the reward model as reward and critic;
//!    figures: mean reward and mean exact-answer rate (the weight-0 `reward-rules` source
//!    `accuracy`, the ground truth the reward model stands in for) of the first vs the last 10 % of
//!    steps.
//!
//! With `--dpo`, phase 2 is `rlhf dpo --run-dir dpo` from the SFT model on the same pairs
//! (`configs/dpo.toml` with [`DPO_SETTINGS`]) and there is no phase 3; figure: held-out preference
//! accuracy by policy log-prob (`eval_logps_accuracy`: chosen more likely than rejected) before →
//! after.
//!
//! Everything runs in the run directory (default `runs/pipeline-<unix time>` under the workspace),
//! so the relative paths of the presets resolve there. Exit status 0 only when every phase improved
//! its figure: perplexity down, held-out accuracy up from step 0 (`rlhf rm` and `rlhf dpo` evaluate
//! before the first step), reward up, exact-answer rate up (a reward that rises while the exact
//! answers fall is reward hacking, and fails).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, Context, Result};

use crate::{
    cmd::{self, Profile},
    project_root, setup,
};

/// The PPO preset of phase 3.
const PPO_PRESET: &str = include_str!("../../configs/pipeline-ppo.toml");

/// `--set` overrides of `configs/dpo.toml` for `--dpo`: from the SFT model, a lower learning rate
/// and more epochs than the preset (which is tuned for the random-weight tiny Llama); measured in
/// `docs/sft-rm.md`.
const DPO_SETTINGS: &[&str] = &["model.path=\"sft/model\"", "train.lr=1e-3", "train.epochs=12"];

pub(crate) fn run(run_dir: Option<&Path>, dpo: bool) -> Result<()> {
    let torch = setup::setup()?;
    let binary = crate::rlhf::build(&torch, Profile::Debug)?;
    let dir = match run_dir {
        Some(d) => std::path::absolute(d).with_context(|| format!("{}: not a usable path", d.display()))?,
        None => {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs())?;
            project_root().join("runs").join(format!("pipeline-{t}"))
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if !dpo {
        let ppo_config = dir.join("ppo.toml");
        std::fs::write(&ppo_config, PPO_PRESET).with_context(|| format!("cannot write {}", ppo_config.display()))?;
    }
    eprintln!("pipeline run directory: {}", dir.display());
    let start = Instant::now();

    let phase = |name: &str, args: &[&str]| -> Result<f64> {
        let t = Instant::now();
        eprintln!("\n=== {name} ===");
        let mut command = Command::new(&binary);
        command.args(args).current_dir(&dir);
        torch.apply(&mut command);
        cmd::run(&mut command)?;
        Ok(t.elapsed().as_secs_f64())
    };
    let num = |v: &serde_json::Value, key: &str| v.get(key).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
    let mark = |ok: bool| if ok { "ok" } else { "FAILED" };

    let t_sft = phase("phase 1: supervised fine-tuning", &["sft", "--run-dir", "sft"])?;
    let sft = read_json(&dir.join("sft/summary.json"))?;
    let (ppl_before, ppl_after) = (num(&sft, "eval_ppl_before"), num(&sft, "eval_ppl_after"));
    let sft_ok = improved_down(ppl_before, ppl_after);
    let sft_line =
        format!("  SFT  held-out perplexity    {ppl_before:.3} -> {ppl_after:.3}   {} ({t_sft:.0} s)", mark(sft_ok));

    let checks = if dpo {
        let mut args = vec!["dpo", "--run-dir", "dpo"];
        for s in DPO_SETTINGS {
            args.extend(["--set", s]);
        }
        let t_dpo = phase("phase 2: DPO", &args)?;
        let summary = read_json(&dir.join("dpo/summary.json"))?;
        let (before, after) = (num(&summary, "eval_logps_accuracy_before"), num(&summary, "eval_logps_accuracy_after"));
        let dpo_ok = improved_up(before, after);
        println!("\npipeline summary, SFT -> DPO ({})", dir.display());
        println!("{sft_line}");
        println!(
            "  DPO  held-out preference accuracy (log-prob)   {before:.3} -> {after:.3}   {} ({} pairs; implicit-reward accuracy {:.3} -> {:.3}; {t_dpo:.0} s)",
            mark(dpo_ok),
            num(&summary, "eval_pairs"),
            num(&summary, "eval_accuracy_before"),
            num(&summary, "eval_accuracy_after"),
        );
        vec![sft_ok, dpo_ok]
    } else {
        let t_rm = phase("phase 2: reward model", &["rm", "--run-dir", "rm", "--set", "model.path=\"sft/model\""])?;
        let rm = read_json(&dir.join("rm/summary.json"))?;
        let t_ppo = phase("phase 3: PPO with the reward model", &["train", "--config", "ppo.toml"])?;
        let rl = rl_figures(&dir.join("ppo/metrics.jsonl"))?;
        let (acc_before, acc_after) = (num(&rm, "eval_accuracy_before"), num(&rm, "eval_accuracy_after"));
        let (exact_first, exact_last) = (rl.exact_first.unwrap_or(f64::NAN), rl.exact_last.unwrap_or(f64::NAN));
        let checks = vec![
            sft_ok,
            improved_up(acc_before, acc_after),
            improved_up(rl.reward_first, rl.reward_last),
            improved_up(exact_first, exact_last),
        ];
        println!("\npipeline summary ({})", dir.display());
        println!("{sft_line}");
        println!(
            "  RM   held-out accuracy      {acc_before:.3} -> {acc_after:.3}   {} (step 0 vs last; chosen {:.3}, rejected {:.3}; {t_rm:.0} s)",
            mark(checks[1]),
            num(&rm, "eval_chosen_score"),
            num(&rm, "eval_rejected_score"),
        );
        println!(
            "  PPO  reward, first vs last 10 % of {} steps   {:.3} -> {:.3}   {} ({t_ppo:.0} s)",
            rl.steps,
            rl.reward_first,
            rl.reward_last,
            mark(checks[2])
        );
        println!(
            "       exact-answer rate (logged, not optimised)    {exact_first:.3} -> {exact_last:.3}   {} (KL to the SFT policy, last 10 %: {:.3})",
            mark(checks[3]),
            rl.kl_last
        );
        checks
    };
    println!("  total {:.0} s", start.elapsed().as_secs_f64());
    if checks.iter().any(|ok| !ok) {
        bail!("a phase did not improve its figure (see the summary above)");
    }
    Ok(())
}

/// Whether a figure that should rise did: `after > before`, both finite (a missing figure is NaN and
/// fails).
fn improved_up(before: f64, after: f64) -> bool {
    before.is_finite() && after.is_finite() && after > before
}

/// Whether a figure that should fall did: `after < before`, both finite.
fn improved_down(before: f64, after: f64) -> bool {
    improved_up(-before, -after)
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))
}

/// The RL figures of a `metrics.jsonl`: first and last 10 % means of `reward`, of
/// `rewards/accuracy/mean` (the exact-answer rate, when every step logged it) and the last 10 %
/// mean of `kl`.
#[derive(Debug, PartialEq)]
struct RlFigures {
    reward_first: f64,
    reward_last: f64,
    exact_first: Option<f64>,
    exact_last: Option<f64>,
    kl_last: f64,
    steps: usize,
}

fn rl_figures(path: &PathBuf) -> Result<RlFigures> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    rl_figures_of(&text).with_context(|| path.display().to_string())
}

fn rl_figures_of(text: &str) -> Result<RlFigures> {
    let mut rewards = Vec::new();
    let mut accuracy = Vec::new();
    let mut kl = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("line {}: not JSON", i + 1))?;
        if let Some(r) = v.get("reward").and_then(serde_json::Value::as_f64) {
            rewards.push(r);
            accuracy.push(v.get("rewards/accuracy/mean").and_then(serde_json::Value::as_f64));
            kl.push(v.get("kl").and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN));
        }
    }
    if rewards.is_empty() {
        bail!("no step logged a reward");
    }
    let (reward_first, reward_last) = first_last_tenth(&rewards);
    let (exact_first, exact_last) = match accuracy.into_iter().collect::<Option<Vec<f64>>>() {
        Some(a) => {
            let (f, l) = first_last_tenth(&a);
            (Some(f), Some(l))
        }
        None => (None, None),
    };
    Ok(RlFigures {
        reward_first,
        reward_last,
        exact_first,
        exact_last,
        kl_last: first_last_tenth(&kl).1,
        steps: rewards.len(),
    })
}

/// Means of the first and the last `max(1, n / 10)` values.
fn first_last_tenth(xs: &[f64]) -> (f64, f64) {
    let k = (xs.len() / 10).max(1);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    (mean(&xs[..k]), mean(&xs[xs.len() - k..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenths() {
        let xs: Vec<f64> = (0..20).map(f64::from).collect();
        assert_eq!(first_last_tenth(&xs), (0.5, 18.5));
        assert_eq!(first_last_tenth(&[3.0]), (3.0, 3.0));
    }

    #[test]
    fn improvement_needs_both_figures_and_a_strict_move() {
        assert!(improved_up(0.51, 0.95));
        assert!(!improved_up(0.95, 0.95), "no change is not an improvement");
        assert!(!improved_up(0.7, 0.65), "above chance but worse than before");
        assert!(!improved_up(f64::NAN, 0.9) && !improved_up(0.5, f64::NAN), "a missing figure fails");
        assert!(improved_down(19.2, 2.5));
        assert!(!improved_down(2.5, 19.2) && !improved_down(f64::NAN, 2.5));
    }

    #[test]
    fn rl_figures_read_reward_exact_rate_and_kl() {
        let text = (1..=20)
            .map(|i| format!(r#"{{"step":{i},"reward":{i}.0,"rewards/accuracy/mean":{},"kl":0.5}}"#, 21 - i))
            .collect::<Vec<_>>()
            .join("\n");
        let f = rl_figures_of(&text).unwrap();
        assert_eq!((f.reward_first, f.reward_last, f.steps, f.kl_last), (1.5, 19.5, 20, 0.5));
        // Reward up, exact answers down: the pipeline's fourth check fails (reward hacking).
        assert_eq!((f.exact_first, f.exact_last), (Some(19.5), Some(1.5)));
        assert!(!improved_up(f.exact_first.unwrap(), f.exact_last.unwrap()));
        let no_rules = rl_figures_of(r#"{"step":1,"reward":1.0}"#).unwrap();
        assert_eq!((no_rules.exact_first, no_rules.exact_last), (None, None));
        assert!(rl_figures_of(r#"{"step":1}"#).is_err());
    }

    #[test]
    fn the_dpo_settings_start_from_the_sft_model() {
        assert!(DPO_SETTINGS.contains(&"model.path=\"sft/model\""));
    }

    #[test]
    fn the_embedded_ppo_preset_points_at_the_phase_outputs() {
        assert!(PPO_PRESET.contains("actor = \"sft/model\""));
        assert!(PPO_PRESET.contains("model = \"rm/model\""));
        assert!(PPO_PRESET.contains("name = \"accuracy\""), "the exact-answer rate is a pass condition");
    }
}
