//! `reward-rules`: verifiable rewards for RL on tasks with known answers, in the spirit of TRL's
//! accuracy / format reward functions and OpenRLHF's rule-based rewards.
//!
//! The score of a sample is the weighted sum of the enabled components (weight ≠ 0):
//!
//! ```text
//! score = w_em · exact_match + w_pc · partial_credit + w_fmt · format
//!       − w_len · max(0, response_tokens − target) / target
//! ```
//!
//! - `exact_match` ∈ {0, 1}: the answer extracted from the response ([`extract::Extract`]) equals
//!   the sample's `label` (after normalisation: trimmed, trailing `.` stripped, numbers compared
//!   numerically).
//! - `partial_credit` ∈ [0, 1]: numeric closeness, or the fraction of character positions that
//!   agree ([`extract::partial_credit`]).
//! - `format` ∈ {0, 1}: the response matches `format.pattern`.
//! - `length_penalty` ≥ 0: how far the response overshoots `length_penalty.target` tokens,
//!   relative to the target.
//!
//! With the default config (exact match alone, weight 1) the score is 1 or 0; in general it is in
//! [0, 1] whenever the weights of the first three components are non-negative and sum to at most
//! 1 and the length penalty is off. Metrics: `reward_rules/<component>` (batch mean of the
//! unweighted component) for each enabled component, and `reward_rules/score`.
//!
//! A sample without a `label` is an error when `exact_match` or `partial_credit` is enabled.
//!
//! # Config
//!
//! Every table and key is optional; these are the defaults.
//!
//! ```toml
//! [rewards.config.exact_match]
//! weight = 1.0
//! extract = "auto"    # auto | hash (#### 42) | boxed (\boxed{42}) | last_number | first_number | full
//!                     # auto: hash if present, else boxed, else the last number, else the whole response
//! normalize = true    # trim, strip trailing '.', compare numbers numerically ("42.0" == "42", "1,000" == "1000")
//!
//! [rewards.config.partial_credit]
//! weight = 0.0
//! extract = "auto"
//! normalize = true
//!
//! [rewards.config.format]
//! weight = 0.0
//! pattern = '^.*####\s*-?[0-9]+\s*$'   # searched in the response; `.` matches newlines
//!
//! [rewards.config.length_penalty]
//! weight = 0.0
//! target = 64         # tokens (response_ids, EOS included); must be ≥ 1
//! ```

pub mod config;
pub mod extract;

use rlhf_plugin_api::prelude::*;

use crate::config::Rules;
use crate::extract::{extract, matches, partial_credit};

/// The reward source; see the crate docs for the formula.
#[derive(Debug)]
pub struct RewardRules {
    rules: Rules,
}

/// Unweighted component values of one sample (`None` for disabled components).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Components {
    pub exact_match: Option<f64>,
    pub partial_credit: Option<f64>,
    pub format: Option<f64>,
    pub length_penalty: Option<f64>,
}

impl RewardRules {
    /// Builds the source from its config section (JSON text).
    pub fn from_config(json: &str) -> Result<Self, PluginError> {
        Ok(RewardRules { rules: Rules::parse(json)? })
    }

    /// The components of sample `index` (the index only names the sample in errors).
    pub fn components(&self, index: usize, sample: &Sample) -> Result<Components, PluginError> {
        let c = &self.rules.config;
        let mut out = Components::default();
        let label = |component: &str| {
            sample
                .label
                .as_deref()
                .ok_or_else(|| PluginError::compute(format!("sample {index} has no `label`; {component} needs one")))
        };
        if c.exact_match.weight != 0.0 {
            let label = label("exact_match")?;
            let hit = extract(&sample.response, c.exact_match.extract)
                .is_some_and(|answer| matches(answer, label, c.exact_match.normalize));
            out.exact_match = Some(if hit { 1.0 } else { 0.0 });
        }
        if c.partial_credit.weight != 0.0 {
            let label = label("partial_credit")?;
            let credit = extract(&sample.response, c.partial_credit.extract)
                .map_or(0.0, |answer| partial_credit(answer, label, c.partial_credit.normalize));
            out.partial_credit = Some(credit);
        }
        if c.format.weight != 0.0 {
            out.format = Some(if self.rules.format.is_match(&sample.response) { 1.0 } else { 0.0 });
        }
        if c.length_penalty.weight != 0.0 {
            let target = f64::from(c.length_penalty.target);
            let over = (sample.response_ids.len() as f64 - target).max(0.0);
            out.length_penalty = Some(over / target);
        }
        Ok(out)
    }

    /// The weighted sum of `components`.
    pub fn combine(&self, components: &Components) -> f64 {
        let c = &self.rules.config;
        components.exact_match.unwrap_or(0.0) * c.exact_match.weight
            + components.partial_credit.unwrap_or(0.0) * c.partial_credit.weight
            + components.format.unwrap_or(0.0) * c.format.weight
            - components.length_penalty.unwrap_or(0.0) * c.length_penalty.weight
    }
}

impl RewardSource for RewardRules {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let this = RewardRules::from_config(config)?;
        tracing::debug!(config = ?this.rules.config, "reward-rules ready");
        Ok(this)
    }

    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError> {
        let components =
            samples.iter().enumerate().map(|(i, s)| self.components(i, s)).collect::<Result<Vec<_>, _>>()?;
        let scores: Vec<f64> = components.iter().map(|c| self.combine(c)).collect();
        let mut metrics = Vec::new();
        if !samples.is_empty() {
            let n = samples.len() as f64;
            let mean = |f: fn(&Components) -> Option<f64>| -> Option<f64> {
                let values: Vec<f64> = components.iter().filter_map(f).collect();
                (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
            };
            for (name, value) in [
                ("reward_rules/exact_match", mean(|c| c.exact_match)),
                ("reward_rules/partial_credit", mean(|c| c.partial_credit)),
                ("reward_rules/format", mean(|c| c.format)),
                ("reward_rules/length_penalty", mean(|c| c.length_penalty)),
            ] {
                if let Some(v) = value {
                    metrics.push((name.to_string(), v));
                }
            }
            metrics.push(("reward_rules/score".to_string(), scores.iter().sum::<f64>() / n));
        }
        Ok(Scores { scores, metrics })
    }
}

export_reward!(
    RewardRules,
    name: "reward-rules",
    description: "verifiable rewards: exact match / partial credit against `label`, format regex, length penalty",
);

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(response: &str, label: Option<&str>, tokens: usize) -> Sample {
        Sample {
            prompt: "Q".into(),
            response: response.into(),
            prompt_ids: vec![1],
            response_ids: vec![7; tokens],
            label: label.map(String::from),
            metadata: serde_json::Value::Null,
            messages: vec![],
        }
    }

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
    }

    fn metric(scores: &Scores, name: &str) -> Option<f64> {
        scores.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn default_is_exact_match_in_zero_one() {
        let mut r = RewardRules::new("{}", &ctx()).unwrap();
        let out = r
            .score(&[
                sample("so 6*7 = 42.0\n#### 42", Some("42"), 10),
                sample("I think \\boxed{1,000}.", Some("1000"), 10),
                sample("the answer is 41", Some("42"), 10),
                sample("Paris.", Some("Paris"), 10),
            ])
            .unwrap();
        assert_eq!(out.scores, vec![1.0, 1.0, 0.0, 1.0]);
        assert_eq!(metric(&out, "reward_rules/exact_match"), Some(0.75));
        assert_eq!(metric(&out, "reward_rules/score"), Some(0.75));
        assert_eq!(metric(&out, "reward_rules/format"), None);
    }

    #[test]
    fn every_component_by_hand() {
        let config = r#"{
            "exact_match": {"weight": 0.5, "extract": "hash"},
            "partial_credit": {"weight": 0.25, "extract": "last_number"},
            "format": {"weight": 0.25},
            "length_penalty": {"weight": 0.1, "target": 4}
        }"#;
        let mut r = RewardRules::new(config, &ctx()).unwrap();
        let out = r
            .score(&[
                // exact 1, partial 1, format 1, 2 tokens: no penalty → 0.5 + 0.25 + 0.25.
                sample("steps\n#### 100", Some("100"), 2),
                // exact 0, partial 1 − 10/100 = 0.9, format 1, 6 tokens: penalty (6−4)/4 = 0.5
                // → 0.25·0.9 + 0.25 − 0.1·0.5.
                sample("#### 90", Some("100"), 6),
                // No `####`: exact 0, format 0; last number 100 → partial 1; 4 tokens: no penalty.
                sample("it is 100", Some("100"), 4),
            ])
            .unwrap();
        let expected = [1.0, 0.25 * 0.9 + 0.25 - 0.05, 0.25];
        for (got, want) in out.scores.iter().zip(expected) {
            assert!(close(*got, want), "{:?} vs {expected:?}", out.scores);
        }
        assert!(close(metric(&out, "reward_rules/exact_match").unwrap(), 1.0 / 3.0));
        assert!(close(metric(&out, "reward_rules/partial_credit").unwrap(), 2.9 / 3.0));
        assert!(close(metric(&out, "reward_rules/format").unwrap(), 2.0 / 3.0));
        assert!(close(metric(&out, "reward_rules/length_penalty").unwrap(), 0.5 / 3.0));
    }

    #[test]
    fn partial_credit_on_strings() {
        let mut r = RewardRules::new(
            r#"{"exact_match": {"weight": 0}, "partial_credit": {"weight": 1, "extract": "full"}}"#,
            &ctx(),
        )
        .unwrap();
        let out = r.score(&[sample("abcd", Some("abxd"), 1), sample("ab", Some("abcd"), 1)]).unwrap();
        assert_eq!(out.scores, vec![0.75, 0.5]);
        assert_eq!(metric(&out, "reward_rules/exact_match"), None);
    }

    #[test]
    fn format_searches_across_lines() {
        let mut r = RewardRules::new(r#"{"exact_match": {"weight": 0}, "format": {"weight": 1}}"#, &ctx()).unwrap();
        let out = r
            .score(&[
                sample("line one\nline two\n#### -12\n", None, 1),
                sample("#### 12 apples", None, 1),
                sample("12", None, 1),
            ])
            .unwrap();
        assert_eq!(out.scores, vec![1.0, 0.0, 0.0]);
        let mut r = RewardRules::new(
            r#"{"exact_match": {"weight": 0}, "format": {"weight": 2, "pattern": "<answer>"}}"#,
            &ctx(),
        )
        .unwrap();
        assert_eq!(r.score(&[sample("x <answer> y", None, 1)]).unwrap().scores, vec![2.0]);
    }

    #[test]
    fn missing_label_names_the_sample() {
        let mut r = RewardRules::new("{}", &ctx()).unwrap();
        let samples =
            [sample("1", Some("1"), 1), sample("1", Some("1"), 1), sample("1", Some("1"), 1), sample("1", None, 1)];
        let e = r.score(&samples).unwrap_err();
        assert_eq!(e.to_string(), "sample 3 has no `label`; exact_match needs one");
        let mut r =
            RewardRules::new(r#"{"exact_match": {"weight": 0}, "partial_credit": {"weight": 1}}"#, &ctx()).unwrap();
        let e = r.score(&samples).unwrap_err();
        assert_eq!(e.to_string(), "sample 3 has no `label`; partial_credit needs one");
        // Without label-based components a label is not needed.
        let mut r = RewardRules::new(r#"{"exact_match": {"weight": 0}, "format": {"weight": 1}}"#, &ctx()).unwrap();
        assert!(r.score(&samples).is_ok());
    }

    #[test]
    fn empty_batch_has_no_metrics() {
        let mut r = RewardRules::new("{}", &ctx()).unwrap();
        let out = r.score(&[]).unwrap();
        assert!(out.scores.is_empty() && out.metrics.is_empty());
    }

    #[test]
    fn config_errors_through_the_constructor() {
        let e = RewardRules::new(r#"{"format": {"pattern": "[a-"}}"#, &ctx()).unwrap_err();
        assert_eq!(e.kind, rlhf_plugin_api::ErrorKind::Config);
        assert!(e.to_string().starts_with("format.pattern: invalid regex"), "{e}");
    }
}
