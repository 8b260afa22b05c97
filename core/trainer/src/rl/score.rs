//! Stage 3, **score**: every reward source scores every kept sample; the reward of a sample is
//! the weighted sum of its scores. A NaN score means the source could not score that sample (an
//! HTTP reward with `on_error = "skip"`, say): the sample is dropped and counted; ±inf is an error.
//! Sources are called on this rank's samples ([`call_sources`]); their scores are combined, with
//! the metrics, over the whole batch ([`combine`], after the ranks' scores are gathered).

use rlhf_plugin_api::{ChatMessage, Sample};
use rlhf_tokenizer::HfTokenizer;

use crate::config::RlConfig;
use crate::data::PromptDataset;
use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::plugins::{host_context, PluginRegistry, RewardHandle};
use crate::progress::RunProgress;
use crate::rl::rollout::Rollout;
use rlhf_plugin_api::PluginKind;

/// A configured reward source.
pub struct RewardSource {
    /// Metric name: `rewards/<name>/...`.
    pub name: String,
    pub weight: f64,
    pub handle: RewardHandle,
}

/// A new instance of every `[[rewards]]` source, each given its config section.
pub(crate) fn load_rewards(cfg: &RlConfig, registry: &PluginRegistry) -> Result<Vec<RewardSource>> {
    let ctx = || host_context(&cfg.run.device, cfg.run.seed, cfg.rollout.samples_per_prompt as u32);
    let mut rewards = Vec::new();
    for (i, r) in cfg.rewards.iter().enumerate() {
        let p = registry.get(&r.plugin, PluginKind::Reward)?;
        let handle = RewardHandle::new(p, &r.config.to_string(), ctx(), &format!("rewards[{i}].config"))
            .map_err(|e| config_error(cfg, e))?;
        rewards.push(RewardSource {
            name: r.name.clone().unwrap_or_else(|| r.plugin.clone()),
            weight: r.weight,
            handle,
        });
    }
    Ok(rewards)
}

/// A plugin's refusal of its config section (`algorithm.config.beta: must be >= 0`), reported
/// against the layer that set that key: the config file or preset, the `RLHF_` variable or the
/// `--set`.
pub(crate) fn config_error(cfg: &RlConfig, e: TrainerError) -> TrainerError {
    match e {
        TrainerError::PluginCall { name, path, message } if message.contains(".config.") && !cfg.source.is_empty() => {
            let key = message.split(": ").next().unwrap_or("");
            TrainerError::Config(format!("{}: {message} (plugin `{name}`, {})", cfg.source_of(key), path.display()))
        }
        e => e,
    }
}

/// The samples that every source could score.
pub struct Scored {
    /// Rows of the rollout batch, in order.
    pub rows: Vec<usize>,
    /// Weighted reward per row of `rows`.
    pub rewards: Vec<f64>,
}

/// Mean and population std of a slice (0, 0 when empty).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let m = xs.iter().sum::<f64>() / xs.len() as f64;
    let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64;
    (m, v.sqrt())
}

/// The plain samples reward plugins see: prompt text as the model saw it, response text without
/// EOS, ids, label, metadata and the untemplated messages.
pub fn samples(
    rollout: &Rollout,
    group_of_row: &[(usize, i64)],
    data: &PromptDataset,
    tok: &HfTokenizer,
) -> Result<Vec<Sample>> {
    let mut samples = Vec::with_capacity(rollout.kept_rows.len());
    for (&r, (content, tokens)) in rollout.kept_rows.iter().zip(&rollout.responses) {
        let rec = &data.records[group_of_row[r].0];
        samples.push(Sample {
            prompt: rec.text.clone(),
            response: tok.decode(content, true)?,
            prompt_ids: rec.ids.clone(),
            response_ids: tokens.clone(),
            label: rec.label.clone(),
            metadata: rec.metadata.clone(),
            messages: rec
                .messages
                .iter()
                .map(|m| ChatMessage { role: m.role.clone(), content: m.content.clone() })
                .collect(),
        });
    }
    Ok(samples)
}

/// What one reward source said about the samples: a score per sample (NaN: could not score)
/// and the source's own metrics.
#[derive(Debug, Clone, Default)]
pub struct SourceScores {
    pub scores: Vec<f64>,
    pub metrics: Vec<(String, f64)>,
}

/// Calls every source on `samples` (one per kept row); a source is not called without samples.
/// ±inf is an error naming the source.
pub fn call_sources(
    sources: &mut [RewardSource],
    samples: &[Sample],
    progress: Option<&RunProgress>,
) -> Result<Vec<SourceScores>> {
    let mut all = Vec::with_capacity(sources.len());
    for src in sources.iter_mut() {
        let out = if samples.is_empty() { Default::default() } else { src.handle.score(samples)? };
        if let Some(p) = progress {
            p.advance(1);
        }
        if let Some(bad) = out.scores.iter().position(|s| s.is_infinite()) {
            return Err(TrainerError::PluginCall {
                name: src.handle.meta.name.clone(),
                path: src.handle.meta.path.clone(),
                message: format!("returned a non-finite score ({}) for sample {bad}", out.scores[bad]),
            });
        }
        all.push(SourceScores { scores: out.scores, metrics: out.metrics });
    }
    Ok(all)
}

/// Each source's metric name and weight.
pub fn weights(sources: &[RewardSource]) -> Vec<(String, f64)> {
    sources.iter().map(|s| (s.name.clone(), s.weight)).collect()
}

/// Combines the sources' scores (named and weighted by `sources`) of the samples of `kept_rows` (one per row, in order) into the
/// weighted reward, dropping samples some source could not score, and sets
/// `rewards/<name>/{mean,std,skipped}`, the sources' own metrics (averaged),
/// `completions/scored` and `completions/unscored`.
pub fn combine(
    sources: &[(String, f64)],
    scores: &[SourceScores],
    kept_rows: &[usize],
    m: &mut StepMetrics,
) -> Result<Scored> {
    let n = kept_rows.len();
    let mut total = vec![0f64; n];
    let mut unscored = vec![false; n];
    for ((name, weight), out) in sources.iter().zip(scores) {
        let valid: Vec<f64> = out.scores.iter().copied().filter(|s| s.is_finite()).collect();
        let (mean, std) = mean_std(&valid);
        m.set(&format!("rewards/{name}/mean"), mean);
        m.set(&format!("rewards/{name}/std"), std);
        for (name, value) in &out.metrics {
            m.add(name, *value);
        }
        // A score whose weighted value overflows is its source's failure for that sample: the
        // sample is not trained on (counted in `rewards/<name>/skipped`), never an infinite reward.
        let mut overflow = 0usize;
        for ((t, u), s) in total.iter_mut().zip(unscored.iter_mut()).zip(out.scores.iter()) {
            if s.is_nan() {
                *u = true;
            } else if !(weight * s).is_finite() {
                *u = true;
                overflow += usize::from(s.is_finite());
            } else {
                *t += weight * s;
            }
        }
        if overflow > 0 {
            tracing::warn!(
                "reward source `{name}`: weight {weight:e} × score overflows for {overflow} samples, which are not \
                 trained on"
            );
        }
        m.set(&format!("rewards/{name}/skipped"), (out.scores.len() - valid.len() + overflow) as f64);
    }
    // A sum of finite weighted scores can overflow too.
    for (t, u) in total.iter().zip(unscored.iter_mut()) {
        *u |= !t.is_finite();
    }
    let kept: Vec<usize> = (0..n).filter(|&k| !unscored[k]).collect();
    m.set("completions/scored", kept.len() as f64);
    m.set("completions/unscored", (n - kept.len()) as f64);
    Ok(Scored { rows: kept.iter().map(|&k| kept_rows[k]).collect(), rewards: kept.iter().map(|&k| total[k]).collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_population_std() {
        assert_eq!(mean_std(&[]), (0.0, 0.0));
        assert_eq!(mean_std(&[2.0]), (2.0, 0.0));
        let (m, s) = mean_std(&[1.0, 2.0, 3.0, 6.0]);
        assert_eq!(m, 3.0);
        assert!((s - 3.5f64.sqrt()).abs() < 1e-12, "{s}");
    }
}
