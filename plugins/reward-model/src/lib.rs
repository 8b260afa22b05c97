//! `reward-model`: scores samples in process with a local reward model, a
//! `*ForSequenceClassification` checkpoint with `num_labels = 1` (OpenRLHF / TRL layout), through
//! [`rlhf_reward::RewardModelScorer`].
//!
//! The text judged for a sample is, with `chat_template = "auto"` (the default) and a reward model
//! that has a chat template, the sample's conversation (`messages`, before the policy's template)
//! plus the response as an assistant turn, rendered with the reward model's template; otherwise
//! (`"none"`, or no template) `prompt + response` as the policy saw them. The score is the reward
//! model's output at the last token (texts longer than `max_len` tokens keep their end), then
//! optionally
//!
//! ```text
//! normalize:  s ← (s − mean) / (std + 1e-8)   mean, std: running (Welford) over every score seen,
//!                                              this batch included
//! clip:       s ← clamp(s, −clip, clip)
//! ```
//!
//! Metrics: `reward_model/raw_mean` and `reward_model/raw_std` (this batch, before normalisation),
//! `reward_model/running_mean` and `reward_model/running_std` with `normalize`,
//! `reward_model/clip_frac` with `clip`.
//!
//! # Config
//!
//! ```toml
//! [rewards.config]
//! model = "path/to/rm"     # required; relative to the working directory
//! device = "cuda:0"        # default: the run's device
//! dtype = "f32"            # f32 | bf16
//! batch_size = 16          # texts per forward pass
//! max_len = 1024           # tokens kept per text (the last ones)
//! chat_template = "auto"   # auto | none
//! normalize = false        # running mean/std normalisation
//! # clip = 5.0             # clamp to ±clip after normalisation
//! ```

pub mod config;

use rlhf_plugin_api::prelude::*;
use rlhf_reward::{ChatMessage, RewardError, RewardModelScorer};

use crate::config::{Config, TemplateMode};

/// Running mean and variance (Welford), population variance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Running {
    pub count: u64,
    pub mean: f64,
    m2: f64,
}

impl Running {
    /// Adds one value.
    pub fn push(&mut self, x: f64) {
        self.count += 1;
        let delta = x - self.mean;
        self.mean += delta / self.count as f64;
        self.m2 += delta * (x - self.mean);
    }

    /// Standard deviation of the values seen (0 for fewer than two).
    pub fn std(&self) -> f64 {
        if self.count < 2 {
            0.0
        } else {
            (self.m2 / self.count as f64).sqrt()
        }
    }
}

/// The reward source.
#[derive(Debug)]
pub struct RewardModel {
    config: Config,
    scorer: RewardModelScorer,
    running: Running,
}

fn load_error(config: &Config, e: RewardError) -> PluginError {
    match e {
        RewardError::NoModelDir { dir } => PluginError::config(
            "model",
            format!(
                "{}: model directory not found (a relative path is relative to the working directory)",
                dir.display()
            ),
        ),
        RewardError::Setting { key, message } => PluginError::config(key, message),
        e => PluginError::config("model", format!("loading {}: {e}", config.model.display())),
    }
}

impl RewardModel {
    /// Parses the section and loads the model on `config.device`, else on `default_device`.
    pub fn from_config(json: &str, default_device: &str) -> Result<Self, PluginError> {
        let config = Config::parse(json)?;
        let device_name = config.device.as_deref().unwrap_or(default_device);
        let device =
            rlhf_models::parse_device(device_name).map_err(|e| PluginError::config("device", e.to_string()))?;
        let scorer =
            RewardModelScorer::from_dir(&config.model, device, config.dtype.kind(), config.batch_size, config.max_len)
                .map_err(|e| load_error(&config, e))?;
        tracing::info!(
            model = %config.model.display(),
            device = device_name,
            chat_template = scorer.tokenizer().has_chat_template() && config.chat_template == TemplateMode::Auto,
            "reward model loaded"
        );
        Ok(RewardModel { config, scorer, running: Running::default() })
    }

    /// The scorer (model, tokenizer, batching).
    pub fn scorer(&self) -> &RewardModelScorer {
        &self.scorer
    }

    /// Running statistics of every raw score seen.
    pub fn running(&self) -> Running {
        self.running
    }

    /// The text the reward model judges for `sample`.
    pub fn text(&self, sample: &Sample) -> Result<String, PluginError> {
        match self.config.chat_template {
            TemplateMode::None => Ok(format!("{}{}", sample.prompt, sample.response)),
            TemplateMode::Auto => {
                let messages: Vec<ChatMessage> =
                    sample.messages.iter().map(|m| ChatMessage::new(m.role.as_str(), m.content.as_str())).collect();
                self.scorer
                    .render(&messages, &sample.prompt, &sample.response)
                    .map_err(|e| PluginError::compute(format!("rendering the reward model's chat template: {e}")))
            }
        }
    }
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

impl RewardSource for RewardModel {
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError> {
        RewardModel::from_config(config, &ctx.device)
    }

    /// The running normalisation statistics survive checkpoints.
    fn state(&self) -> Result<serde_json::Value, PluginError> {
        let r = &self.running;
        Ok(serde_json::json!({ "count": r.count, "mean": r.mean, "m2": r.m2 }))
    }

    fn load_state(&mut self, state: serde_json::Value) -> Result<(), PluginError> {
        let bad = || PluginError::config("state", "running statistics missing from the checkpoint");
        self.running = Running {
            count: state.get("count").and_then(serde_json::Value::as_u64).ok_or_else(bad)?,
            mean: state.get("mean").and_then(serde_json::Value::as_f64).ok_or_else(bad)?,
            m2: state.get("m2").and_then(serde_json::Value::as_f64).ok_or_else(bad)?,
        };
        Ok(())
    }

    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError> {
        if samples.is_empty() {
            return Ok(Scores::default());
        }
        let texts = samples.iter().map(|s| self.text(s)).collect::<Result<Vec<_>, _>>()?;
        let raw = self.scorer.score_texts(&texts).map_err(|e| match e {
            RewardError::EmptyText { index } => PluginError::compute(format!("sample {index}: empty text, no score")),
            e => PluginError::compute(format!("reward model: {e}")),
        })?;
        if let Some(i) = raw.iter().position(|s| !s.is_finite()) {
            return Err(PluginError::compute(format!("the reward model returned {} for sample {i}", raw[i])));
        }
        let (raw_mean, raw_std) = mean_std(&raw);
        let mut metrics =
            vec![("reward_model/raw_mean".to_string(), raw_mean), ("reward_model/raw_std".to_string(), raw_std)];
        let mut scores = raw;
        if self.config.normalize {
            for &s in &scores {
                self.running.push(s);
            }
            let (mean, std) = (self.running.mean, self.running.std());
            for s in &mut scores {
                *s = (*s - mean) / (std + 1e-8);
            }
            metrics.push(("reward_model/running_mean".to_string(), mean));
            metrics.push(("reward_model/running_std".to_string(), std));
        }
        if let Some(c) = self.config.clip {
            let clipped = scores.iter().filter(|s| s.abs() > c).count();
            for s in &mut scores {
                *s = s.clamp(-c, c);
            }
            metrics.push(("reward_model/clip_frac".to_string(), clipped as f64 / scores.len() as f64));
        }
        Ok(Scores { scores, metrics })
    }
}

export_reward!(
    RewardModel,
    name: "reward-model",
    description: "a local reward model (*ForSequenceClassification, num_labels = 1) scored in process",
);

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use rlhf_plugin_api::ChatMessage as SampleMessage;

    use super::*;

    fn rm_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models/llama-rm")
    }

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
    }

    fn source(extra: &str) -> RewardModel {
        let json = format!(r#"{{"model": {:?}{extra}}}"#, rm_dir().display().to_string());
        RewardModel::new(&json, &ctx()).unwrap()
    }

    fn sample(question: &str, response: &str, messages: bool) -> Sample {
        Sample {
            prompt: format!("Q: {question}\nA: "),
            response: response.into(),
            prompt_ids: vec![1],
            response_ids: vec![2],
            label: None,
            metadata: serde_json::Value::Null,
            messages: if messages {
                vec![SampleMessage { role: "user".into(), content: question.into() }]
            } else {
                vec![]
            },
        }
    }

    fn metric(s: &Scores, name: &str) -> Option<f64> {
        s.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    fn batch() -> Vec<Sample> {
        vec![
            sample("Tom has 3 apples and buys 5 more. How many apples?", "8", true),
            sample("Once upon a time, the fox", "jumped over the dog.", true),
            sample("2 + 2 =", "4", false),
        ]
    }

    #[test]
    fn auto_scores_the_conversation_rendered_with_the_rms_template() {
        let mut rm = source("");
        let samples = batch();
        let out = rm.score(&samples).unwrap();
        let scorer = rm.scorer();
        let expected_texts = vec![
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nTom has 3 apples and buys \
             5 more. How many apples?<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n"
                .to_string(),
            scorer
                .tokenizer()
                .apply_chat_template(
                    &[
                        ChatMessage::new("user", "Once upon a time, the fox"),
                        ChatMessage::new("assistant", "jumped over the dog."),
                    ],
                    false,
                )
                .unwrap(),
            // No messages: the prompt as the policy saw it, then the response.
            "Q: 2 + 2 =\nA: 4".to_string(),
        ];
        let texts: Vec<String> = samples.iter().map(|s| rm.text(s).unwrap()).collect();
        assert_eq!(texts, expected_texts);
        let expected = scorer.score_texts(&expected_texts).unwrap();
        assert_eq!(out.scores, expected);
        let mean = expected.iter().sum::<f64>() / 3.0;
        assert!((metric(&out, "reward_model/raw_mean").unwrap() - mean).abs() < 1e-12);
        assert!(metric(&out, "reward_model/raw_std").unwrap() > 0.0);
        assert_eq!(metric(&out, "reward_model/running_mean"), None);
    }

    #[test]
    fn none_scores_prompt_plus_response() {
        let mut rm = source(r#", "chat_template": "none", "batch_size": 2"#);
        let samples = batch();
        let out = rm.score(&samples).unwrap();
        let texts: Vec<String> = samples.iter().map(|s| format!("{}{}", s.prompt, s.response)).collect();
        let expected = rm.scorer().score_texts(&texts).unwrap();
        for (a, b) in out.scores.iter().zip(&expected) {
            assert!((a - b).abs() < 1e-5, "{:?} vs {expected:?}", out.scores);
        }
        assert!(rm.score(&[]).unwrap().scores.is_empty());
    }

    #[test]
    fn normalize_uses_every_score_seen_and_clip_bounds() {
        let mut plain = source(r#", "chat_template": "none""#);
        let mut norm = source(r#", "chat_template": "none", "normalize": true"#);
        let mut clipped = source(r#", "chat_template": "none", "normalize": true, "clip": 0.5"#);
        let (first, second) = (batch(), vec![sample("3 + 4 =", "7", false), sample("1 + 1 =", "3", false)]);
        let mut seen = Vec::new();
        for b in [&first, &second] {
            let raw = plain.score(b).unwrap().scores;
            seen.extend(raw.iter().copied());
            let (mean, std) = mean_std(&seen);
            let out = norm.score(b).unwrap();
            for (s, r) in out.scores.iter().zip(&raw) {
                assert!((s - (r - mean) / (std + 1e-8)).abs() < 1e-9, "{s} vs {r}");
            }
            assert!((metric(&out, "reward_model/running_mean").unwrap() - mean).abs() < 1e-12);
            assert!((metric(&out, "reward_model/running_std").unwrap() - std).abs() < 1e-12);
            let c = clipped.score(b).unwrap();
            for (s, n) in c.scores.iter().zip(&out.scores) {
                assert_eq!(*s, n.clamp(-0.5, 0.5));
            }
            let frac = out.scores.iter().filter(|s| s.abs() > 0.5).count() as f64 / out.scores.len() as f64;
            assert_eq!(metric(&c, "reward_model/clip_frac"), Some(frac));
        }
        assert_eq!(norm.running().count, 5);
        // One score alone normalises to 0, not to ±inf.
        let mut one = source(r#", "normalize": true"#);
        assert_eq!(one.score(&batch()[..1]).unwrap().scores, vec![0.0]);
    }

    #[test]
    fn welford_matches_two_pass() {
        let xs = [1.0, 4.0, -2.5, 7.25, 0.0];
        let mut r = Running::default();
        xs.iter().for_each(|&x| r.push(x));
        let (mean, std) = mean_std(&xs);
        assert!((r.mean - mean).abs() < 1e-12 && (r.std() - std).abs() < 1e-12);
        assert_eq!(Running::default().std(), 0.0);
    }

    #[test]
    fn config_errors_name_the_key() {
        let e = RewardModel::new(r#"{"model": "no/such/rm"}"#, &ctx()).unwrap_err();
        assert_eq!(e.kind, rlhf_plugin_api::ErrorKind::Config);
        assert_eq!(
            e.to_string(),
            "model: no/such/rm: model directory not found (a relative path is relative to the working directory)"
        );
        let e = RewardModel::new(r#"{"model": "/"}"#, &ctx()).unwrap_err();
        assert!(e.to_string().starts_with("model: loading /: "), "{e}");
        let json = format!(r#"{{"model": {:?}, "device": "tpu"}}"#, rm_dir().display().to_string());
        let e = RewardModel::new(&json, &ctx()).unwrap_err();
        assert!(e.to_string().starts_with("device: device `tpu`"), "{e}");
        let e = RewardModel::new(&json.replace("\"tpu\"", "\"cpu\", \"batch_size\": 0"), &ctx()).unwrap_err();
        assert_eq!(e.to_string(), "batch_size: must be at least 1");
    }
}
