//! Held-out evaluation between RL steps (`[eval]`, [`crate::config::EvalConfig`]): the policy
//! answers every held-out prompt `n` times, the evaluation's own instances of the reward sources
//! score the answers, and the step's metrics row gets `eval/*`: the mean reward and one mean per
//! source, pass@k for k = 1 and each power of two up to n, maj@n, the mean length, and the same keys
//! per `data_source` when the prompts have that field ([`estimators`] has the formulas). Every
//! sample is written to `<run_dir>/eval/step-<N>.jsonl`, one line per prompt.
//!
//! The answers come from the trainer's own decode of the policy, or, when the run samples on
//! vLLM servers, from the servers (brought to the current policy first, as a training step
//! does), so the evaluation sees the engine the rollouts see.
//!
//! Evaluation never perturbs training: it reads the prompts of its own dataset in file order,
//! seeds the sampler from (seed, step) for itself (every training step reseeds it before use), and
//! its reward sources are separate instances, so a stateful source (a reward model's running
//! normalisation) learns nothing from held-out answers. With data-parallel ranks each rank answers
//! a contiguous share of each chunk of prompts, as in a training batch, and every rank gathers the
//! answers.

pub mod episodes;
pub mod estimators;
pub mod saved;

use std::path::Path;

use rlhf_collective::World;
use rlhf_generation::left_pad;
use rlhf_models::CausalLm;
use rlhf_tokenizer::HfTokenizer;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{CorrectIf, EvalConfig, RlConfig, RolloutConfig};
use crate::data::PromptDataset;
use crate::data::RawPrompt;
use crate::dist::err;
use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::plugins::PluginRegistry;
use crate::rl::engine::Engine;
use crate::rl::prompts::{ids_i64, PromptBatch};
use crate::rl::score::{self, RewardSource, SourceScores};
use crate::rl::shard;

/// Salt of the evaluation's sampling seed, so it draws a stream of its own.
const EVAL_SEED_SALT: u64 = 0x5EED_E7A1_0000_0001;

/// One answer to a held-out prompt, as every rank sees it after the gather.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Answer {
    /// The completion without EOS, decoded.
    pub text: String,
    /// The sampled token ids (EOS included).
    pub ids: Vec<u32>,
    /// Per evaluation reward source, in order (NaN: could not score, or an empty answer).
    pub scores: Vec<f64>,
}

/// An external rollout engine that answers the held-out prompts instead of the trainer's decode.
pub struct OnEngine<'a> {
    pub engine: &'a mut Engine,
    /// The optimizer steps of the policy being evaluated (the engine's weight version).
    pub version: usize,
    /// The probe prompt of the engine's weight sync.
    pub probe: &'a [u32],
}

/// Generation and scoring of held-out prompts.
pub struct Evaluator {
    cfg: EvalConfig,
    data: PromptDataset,
    rewards: Vec<RewardSource>,
    correct: CorrectIf,
    generation: RolloutConfig,
    seed: u64,
    /// The evaluation's own environment instance, with `[environment]`.
    env: Option<episodes::EvalEnv>,
    /// The held-out prompts' images, when the policy reads images.
    visual: Option<crate::rl::visual::Visual>,
}

impl Evaluator {
    /// `data` are the held-out prompts (in file order), `rewards` the evaluation's own reward
    /// sources, `rollout` the training's generation settings that `[eval]` leaves unset.
    pub fn new(
        cfg: &EvalConfig,
        data: PromptDataset,
        rewards: Vec<RewardSource>,
        rollout: &RolloutConfig,
        seed: u64,
        env: Option<episodes::EvalEnv>,
    ) -> Result<Self> {
        let correct =
            CorrectIf::parse(&cfg.correct_if).map_err(|e| TrainerError::Config(format!("eval.correct_if: {e}")))?;
        let n = cfg.samples_per_prompt;
        let greedy_default = if n == 1 { 0.0 } else { rollout.temperature };
        let generation = RolloutConfig {
            prompts_per_batch: rollout.prompts_per_batch,
            samples_per_prompt: n,
            max_new_tokens: cfg.max_new_tokens.unwrap_or(rollout.max_new_tokens),
            temperature: cfg.temperature.unwrap_or(greedy_default),
            top_p: cfg.top_p.unwrap_or(rollout.top_p),
            ..rollout.clone()
        };
        Ok(Evaluator { cfg: cfg.clone(), data, rewards, correct, generation, seed, env, visual: None })
    }

    /// The evaluator, patching its prompts' images with `images` (a policy that reads images; one
    /// chunk of prompts' patches kept at a time).
    pub fn with_images(self, images: Option<crate::prompt_images::PromptImages>) -> Self {
        let chunk = self.generation.prompts_per_batch;
        Evaluator { visual: images.map(|i| crate::rl::visual::Visual::new(i, chunk)), ..self }
    }

    /// Whether to evaluate after step `step` of `total` (0: before training).
    pub fn due(&self, step: usize, total: usize) -> bool {
        let every = self.cfg.every_steps;
        match step {
            0 => self.cfg.before_train,
            s => (every > 0 && s.is_multiple_of(every)) || (self.cfg.at_end && s == total),
        }
    }

    /// Evaluates `actor` as of step `step`: the `eval/*` metrics, and (on the main rank) every
    /// answer written to `samples` (a run's `<run_dir>/eval/step-<step>.jsonl`), one line per
    /// prompt. With `engine` the answers are sampled there, after syncing it to `actor`.
    #[allow(clippy::too_many_arguments)]
    pub fn evaluate(
        &mut self,
        actor: &CausalLm,
        mut engine: Option<OnEngine>,
        tok: &HfTokenizer,
        eos_ids: &[i64],
        pad: i64,
        world: &World,
        samples: Option<&Path>,
        step: usize,
    ) -> Result<StepMetrics> {
        tch::manual_seed(
            (self.seed ^ EVAL_SEED_SALT ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) as i64 & i64::MAX,
        );
        let n = self.cfg.samples_per_prompt;
        let prompts = match self.cfg.max_prompts {
            0 => self.data.records.len(),
            m => m.min(self.data.records.len()),
        };
        let mut sync = StepMetrics::default();
        if let Some(e) = engine.as_mut() {
            e.engine.ensure_synced(actor, e.version, e.probe, world, &mut sync)?;
        }
        if let Some(e) = self.env.as_mut() {
            (e.episodes, e.failed) = (0, 0);
        }
        let chunk = self.generation.prompts_per_batch.max(world.size());
        let mut answers = Vec::with_capacity(prompts * n);
        for start in (0..prompts).step_by(chunk) {
            let ids: Vec<usize> = (start..(start + chunk).min(prompts)).collect();
            answers.extend(self.answer_chunk(actor, engine.as_mut(), tok, &ids, eos_ids, pad, world)?);
        }
        let names = self.score_names();
        let results: Vec<PromptResult> = (0..prompts)
            .map(|p| PromptResult {
                data_source: self.data.records[p]
                    .metadata
                    .get("data_source")
                    .and_then(|v| v.as_str())
                    .map(String::from),
                answers: answers[p * n..(p + 1) * n].to_vec(),
            })
            .collect();
        let mut summary = Summary::new(&results, &names, &self.correct, &self.cfg.answer);
        if let (Some(file), true) = (samples, world.is_main()) {
            self.write_samples(file, step, &results, &summary)?;
        }
        if let Some(s) = sync.get("rollout/sync_s") {
            summary.metrics.set("eval/sync_s", s);
        }
        if let Some(e) = &self.env {
            // Every rank has the environment: one sum over the ranks.
            let counts = crate::dist::sum(world, &[e.episodes as f64, e.failed as f64])?;
            summary.metrics.set("eval/env/episodes", counts[0]);
            summary.metrics.set("eval/env/errors", counts[1]);
        }
        Ok(summary.metrics)
    }

    /// Answers of the prompts `ids` (dataset indices), `n` per prompt in order, gathered from
    /// every rank.
    #[allow(clippy::too_many_arguments)]
    fn answer_chunk(
        &mut self,
        actor: &CausalLm,
        engine: Option<&mut OnEngine>,
        tok: &HfTokenizer,
        ids: &[usize],
        eos_ids: &[i64],
        pad: i64,
        world: &World,
    ) -> Result<Vec<Answer>> {
        let n = self.cfg.samples_per_prompt;
        let mut rows = Vec::with_capacity(ids.len() * n);
        let mut group_of_row = Vec::with_capacity(ids.len() * n);
        for &i in ids {
            for _ in 0..n {
                rows.push(ids_i64(&self.data.records[i].ids));
                group_of_row.push((i, i as i64));
            }
        }
        let padded = left_pad(&rows, pad, actor.device())?;
        let global = PromptBatch { padded, group_of_row, images: None, image_files: None };
        let (mut batch, part) = shard::prompts(global, ids.len(), n, world)?;
        if let Some(v) = self.visual.as_mut() {
            let records: Vec<usize> = batch.group_of_row.iter().map(|&(r, _)| r).collect();
            let rows = v.rows_with_images(&self.data, &records, None)?;
            batch.images = rows.map(|rows| rows.cat(None)).transpose()?.flatten();
            if engine.is_some() {
                batch.image_files = Some(v.files(&self.data, &records));
            }
        }
        let mut local = Vec::with_capacity(part.rows);
        if part.rows > 0 {
            let (out, env_rewards) = self.sample_chunk(actor, engine, tok, &batch, part, eos_ids, pad)?;
            let samples = score::samples(&out, &batch.group_of_row, &self.data, tok)?;
            let mut scores = score::call_sources(&mut self.rewards, &samples, None)?;
            if let Some(r) = env_rewards {
                scores.push(SourceScores { scores: out.kept_rows.iter().map(|&k| r[k]).collect(), metrics: vec![] });
            }
            let n_scores = scores.len();
            for r in 0..part.rows {
                let kept = out.kept_rows.iter().position(|&k| k == r);
                local.push(match kept {
                    Some(k) => Answer {
                        text: samples[k].response.clone(),
                        ids: out.responses[k].1.clone(),
                        scores: scores.iter().map(|s| s.scores[k]).collect(),
                    },
                    None => Answer { text: String::new(), ids: Vec::new(), scores: vec![f64::NAN; n_scores] },
                });
            }
        }
        if !world.is_distributed() {
            return Ok(local);
        }
        // NaN does not survive JSON: scores travel as bits.
        let wire: Vec<(String, Vec<u32>, Vec<u64>)> =
            local.into_iter().map(|a| (a.text, a.ids, a.scores.iter().map(|x| x.to_bits()).collect())).collect();
        let bytes = serde_json::to_vec(&wire).map_err(|e| TrainerError::Distributed(format!("eval answers: {e}")))?;
        let mut all = Vec::new();
        for part in world.all_gather_bytes(&bytes).map_err(err)? {
            let got: Vec<(String, Vec<u32>, Vec<u64>)> =
                serde_json::from_slice(&part).map_err(|e| TrainerError::Distributed(format!("eval answers: {e}")))?;
            all.extend(got.into_iter().map(|(text, ids, bits)| Answer {
                text,
                ids,
                scores: bits.into_iter().map(f64::from_bits).collect(),
            }));
        }
        Ok(all)
    }

    /// The answers to `file`, one line per prompt (written atomically).
    fn write_samples(&self, file: &Path, step: usize, results: &[PromptResult], s: &Summary) -> Result<()> {
        let names = self.score_names();
        let mut text = String::new();
        for (p, r) in results.iter().enumerate() {
            let rec = &self.data.records[p];
            let completions: Vec<_> = r
                .answers
                .iter()
                .zip(&s.per_prompt[p].correct)
                .zip(&s.per_prompt[p].rewards)
                .map(|((a, &correct), &reward)| {
                    let by_source: serde_json::Map<_, _> =
                        names.iter().zip(&a.scores).map(|((name, _), &x)| (name.clone(), finite(x))).collect();
                    json!({"text": a.text, "ids": a.ids, "rewards": by_source, "reward": finite(reward), "correct": correct,
                           "answer": estimators::extract_answer(&a.text, &self.cfg.answer)})
                })
                .collect();
            let line = json!({"step": step, "prompt": rec.text, "label": rec.label, "data_source": r.data_source,
                              "correct": s.per_prompt[p].correct.iter().filter(|&&c| c).count(), "completions": completions});
            text.push_str(&line.to_string());
            text.push('\n');
        }
        crate::metrics::write_atomic(file, &text)
    }
}

/// What held-out evaluation needs before the run directory exists: its prompts and its own
/// instances of the reward sources it names (so a stateful source learns nothing from them).
pub(crate) struct EvalInputs {
    pub(crate) raw: Vec<RawPrompt>,
    pub(crate) rewards: Vec<RewardSource>,
    /// The evaluation's own environment instance, with `[environment]`.
    pub(crate) env: Option<episodes::EvalEnv>,
}

/// [`EvalInputs`] when `[eval]` is on.
pub(crate) fn inputs(cfg: &RlConfig, registry: &PluginRegistry) -> Result<Option<EvalInputs>> {
    if !cfg.eval.enabled() {
        return Ok(None);
    }
    let data = crate::config::DataConfig { prompts: cfg.eval.data.clone(), ..cfg.data.clone() };
    let raw = crate::builtin::prompts_of(&data)
        .map_err(|e| TrainerError::Config(format!("{}: eval.data: {e}", cfg.source_of("eval.data"))))?;
    let all = score::load_rewards(cfg, registry)?;
    let wanted = &cfg.eval.rewards;
    let rewards = all.into_iter().filter(|r| wanted.is_empty() || wanted.contains(&r.name)).collect();
    let env = crate::rl::episode::EnvRuntime::load(cfg, registry)?.map(|rt| episodes::EvalEnv {
        rt,
        cfg: cfg.environment.clone(),
        episodes: 0,
        failed: 0,
    });
    Ok(Some(EvalInputs { raw, rewards, env }))
}

/// JSON has no NaN: a score that could not be had is `null`.
fn finite(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// A held-out prompt's answers.
#[derive(Debug, Clone)]
pub struct PromptResult {
    /// The prompt's `data_source` field, when it has one.
    pub data_source: Option<String>,
    pub answers: Vec<Answer>,
}

/// Per prompt: each answer's weighted reward (NaN when a source could not score it) and whether
/// it is correct.
struct PerPrompt {
    rewards: Vec<f64>,
    correct: Vec<bool>,
}

/// The metrics of an evaluation, and the per-answer verdicts behind them.
struct Summary {
    metrics: StepMetrics,
    per_prompt: Vec<PerPrompt>,
}

impl Summary {
    /// `sources` are the reward sources' (name, weight) in the answers' score order; `answer` the
    /// extractor of the answers that maj@n votes on.
    fn new(results: &[PromptResult], sources: &[(String, f64)], correct_if: &CorrectIf, answer: &str) -> Summary {
        let per_prompt: Vec<PerPrompt> = results
            .iter()
            .map(|r| {
                let rewards: Vec<f64> =
                    r.answers.iter().map(|a| sources.iter().zip(&a.scores).map(|((_, w), s)| w * s).sum()).collect();
                let correct = r
                    .answers
                    .iter()
                    .zip(&rewards)
                    .map(|(a, &reward)| {
                        let score = match sources.iter().position(|(name, _)| *name == correct_if.source) {
                            Some(i) => a.scores[i],
                            None => reward,
                        };
                        !score.is_nan() && correct_if.holds(score)
                    })
                    .collect();
                PerPrompt { rewards, correct }
            })
            .collect();
        let mut metrics = StepMetrics::default();
        let all: Vec<usize> = (0..results.len()).collect();
        summarize(results, &per_prompt, &all, sources, answer, "eval/", &mut metrics);
        let mut data_sources: Vec<&str> = results.iter().filter_map(|r| r.data_source.as_deref()).collect();
        data_sources.sort_unstable();
        data_sources.dedup();
        for ds in data_sources {
            let mine: Vec<usize> =
                (0..results.len()).filter(|&p| results[p].data_source.as_deref() == Some(ds)).collect();
            summarize(results, &per_prompt, &mine, sources, answer, &format!("eval/{ds}/"), &mut metrics);
        }
        Summary { metrics, per_prompt }
    }
}

/// The metrics of the prompts `which`, under `prefix`.
fn summarize(
    results: &[PromptResult],
    per_prompt: &[PerPrompt],
    which: &[usize],
    sources: &[(String, f64)],
    answer: &str,
    prefix: &str,
    m: &mut StepMetrics,
) {
    let Some(&first) = which.first() else { return };
    let n = results[first].answers.len();
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (s, c) = xs.filter(|x| x.is_finite()).fold((0.0, 0usize), |(s, c), x| (s + x, c + 1));
        if c == 0 {
            f64::NAN
        } else {
            s / c as f64
        }
    };
    m.set(
        &format!("{prefix}reward/mean"),
        mean(&mut which.iter().flat_map(|&p| per_prompt[p].rewards.iter().copied())),
    );
    for (i, (name, _)) in sources.iter().enumerate() {
        let scores = &mut which.iter().flat_map(|&p| results[p].answers.iter().map(move |a| a.scores[i]));
        m.set(&format!("{prefix}reward/{name}"), mean(scores));
    }
    let correct_counts: Vec<usize> =
        which.iter().map(|&p| per_prompt[p].correct.iter().filter(|&&c| c).count()).collect();
    for k in estimators::pass_ks(n) {
        let v = mean(&mut correct_counts.iter().map(|&c| estimators::pass_at_k(n, c, k)));
        m.set(&format!("{prefix}pass@{k}"), v);
    }
    let mut maj = which.iter().map(|&p| {
        let answers: Vec<Option<String>> =
            results[p].answers.iter().map(|a| estimators::extract_answer(&a.text, answer)).collect();
        f64::from(u8::from(estimators::majority_correct(&answers, &per_prompt[p].correct)))
    });
    m.set(&format!("{prefix}maj@{n}"), mean(&mut maj));
    m.set(
        &format!("{prefix}length/mean"),
        mean(&mut which.iter().flat_map(|&p| results[p].answers.iter().map(|a| a.ids.len() as f64))),
    );
    m.set(&format!("{prefix}prompts"), which.len() as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str, score: f64) -> Answer {
        Answer { text: text.into(), ids: vec![1; text.len()], scores: vec![score] }
    }

    /// Two prompts of two sources, n = 4: hand-computed pass@k, maj@4, means, and the breakdown.
    #[test]
    fn metrics_per_prompt_and_per_data_source() {
        let results = vec![
            PromptResult {
                data_source: Some("gsm".into()),
                answers: vec![answer("7", 1.0), answer("5", 0.0), answer("5", 0.0), answer("", f64::NAN)],
            },
            PromptResult {
                data_source: Some("math".into()),
                answers: vec![answer("3", 1.0), answer("3", 1.0), answer("4", 0.0), answer("3", 1.0)],
            },
        ];
        let sources = [("accuracy".to_string(), 2.0)];
        let correct = CorrectIf::parse("accuracy >= 1").unwrap();
        let s = Summary::new(&results, &sources, &correct, "last_number");
        let m = s.metrics.means();
        let close = |k: &str, v: f64| assert!((m[k] - v).abs() < 1e-12, "{k}: {} against {v}", m[k]);
        // c = 1 and c = 3 of n = 4.
        close("eval/pass@1", (0.25 + 0.75) / 2.0);
        close("eval/pass@2", (0.5 + 1.0) / 2.0);
        close("eval/pass@4", 1.0);
        // "5" outvotes "7" on the first prompt; "3" wins the second.
        close("eval/maj@4", 0.5);
        // The unscored answer is left out of the means; the weight applies to `reward`.
        close("eval/reward/accuracy", 4.0 / 7.0);
        close("eval/reward/mean", 8.0 / 7.0);
        close("eval/length/mean", 7.0 / 8.0);
        close("eval/prompts", 2.0);
        close("eval/gsm/pass@1", 0.25);
        close("eval/gsm/maj@4", 0.0);
        close("eval/math/pass@2", 1.0);
        close("eval/math/maj@4", 1.0);
        close("eval/math/prompts", 1.0);
        assert_eq!(s.per_prompt[0].correct, [true, false, false, false]);
        assert!(s.per_prompt[0].rewards[3].is_nan());
        // `reward` as the criterion: the weighted sum (2.0) against the threshold.
        let by_sum = Summary::new(&results, &sources, &CorrectIf::parse("reward > 1.5").unwrap(), "full");
        assert_eq!(by_sum.per_prompt[1].correct, [true, true, false, true]);
    }
}
