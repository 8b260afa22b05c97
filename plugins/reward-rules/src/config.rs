//! The `reward-rules` config section: one optional table per reward component. The default
//! enables `exact_match` alone with weight 1, so the score is 1 for a correct answer and 0
//! otherwise.

use regex::{Regex, RegexBuilder};
use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

use crate::extract::Extract;

/// The whole section. Every table is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// 1 if the extracted answer equals the sample's label, else 0.
    pub exact_match: ExactMatch,
    /// Closeness of the extracted answer to the label, in [0, 1].
    pub partial_credit: PartialCredit,
    /// 1 if the response matches a regex, else 0.
    pub format: Format,
    /// A penalty for responses longer than a target number of tokens.
    pub length_penalty: LengthPenalty,
}

/// `[exact_match]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExactMatch {
    /// Weight of the component in the score (0 disables it).
    pub weight: f64,
    /// Where the answer is taken from: auto | hash | boxed | last_number | first_number | full.
    pub extract: Extract,
    /// Trim, strip trailing `.`, compare numbers numerically (`42.0` == `42`, `1,000` == `1000`).
    pub normalize: bool,
}

impl Default for ExactMatch {
    fn default() -> Self {
        ExactMatch { weight: 1.0, extract: Extract::Auto, normalize: true }
    }
}

/// `[partial_credit]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PartialCredit {
    /// Weight of the component in the score (0 disables it).
    pub weight: f64,
    /// Where the answer is taken from, as in `exact_match.extract`.
    pub extract: Extract,
    /// Normalise as in `exact_match.normalize`; numbers then get numeric closeness.
    pub normalize: bool,
}

impl Default for PartialCredit {
    fn default() -> Self {
        PartialCredit { weight: 0.0, extract: Extract::Auto, normalize: true }
    }
}

/// `[format]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Format {
    /// Weight of the component in the score (0 disables it).
    pub weight: f64,
    /// Regex searched in the whole response (anchor with `^`/`$`); `.` also matches newlines.
    pub pattern: String,
}

/// The default `format.pattern`: the response ends with a GSM8K-style `#### <integer>`.
pub const DEFAULT_PATTERN: &str = r"^.*####\s*-?[0-9]+\s*$";

impl Default for Format {
    fn default() -> Self {
        Format { weight: 0.0, pattern: DEFAULT_PATTERN.to_string() }
    }
}

/// `[length_penalty]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LengthPenalty {
    /// Weight of the penalty `max(0, response_tokens − target) / target` subtracted from the score.
    pub weight: f64,
    /// Response length in tokens from which the penalty starts (> 0).
    pub target: u32,
}

impl Default for LengthPenalty {
    fn default() -> Self {
        LengthPenalty { weight: 0.0, target: 64 }
    }
}

/// A validated config with the format regex compiled.
#[derive(Debug, Clone)]
pub struct Rules {
    pub config: Config,
    /// Compiled `format.pattern`.
    pub format: Regex,
}

impl Rules {
    /// Parses and validates the section (JSON text); errors name the key path.
    pub fn parse(json: &str) -> Result<Rules, PluginError> {
        let config: Config = parse_config(json)?;
        for (key, weight) in [
            ("exact_match.weight", config.exact_match.weight),
            ("partial_credit.weight", config.partial_credit.weight),
            ("format.weight", config.format.weight),
            ("length_penalty.weight", config.length_penalty.weight),
        ] {
            if !weight.is_finite() {
                return Err(PluginError::config(key, format!("must be a finite number, got {weight}")));
            }
        }
        if config.length_penalty.target == 0 {
            return Err(PluginError::config("length_penalty.target", "must be at least 1"));
        }
        let format = RegexBuilder::new(&config.format.pattern)
            .dot_matches_new_line(true)
            .build()
            .map_err(|e| PluginError::config("format.pattern", format!("invalid regex: {e}")))?;
        Ok(Rules { config, format })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        Rules::parse(json).expect_err(json).to_string()
    }

    #[test]
    fn defaults_are_exact_match_only() {
        for json in ["", "{}"] {
            let c = Rules::parse(json).unwrap().config;
            assert_eq!(c.exact_match.weight, 1.0);
            assert_eq!(c.exact_match.extract, Extract::Auto);
            assert!(c.exact_match.normalize);
            assert_eq!(c.partial_credit.weight, 0.0);
            assert_eq!(c.format.weight, 0.0);
            assert_eq!(c.format.pattern, DEFAULT_PATTERN);
            assert_eq!(c.length_penalty.weight, 0.0);
            assert_eq!(c.length_penalty.target, 64);
        }
    }

    #[test]
    fn sections_are_partial() {
        let c = Rules::parse(r#"{"exact_match": {"extract": "boxed"}, "format": {"weight": 0.5}}"#).unwrap().config;
        assert_eq!(c.exact_match.weight, 1.0);
        assert_eq!(c.exact_match.extract, Extract::Boxed);
        assert_eq!(c.format.weight, 0.5);
        assert_eq!(c.format.pattern, DEFAULT_PATTERN);
    }

    #[test]
    fn errors_start_with_the_key_path() {
        let e = err(r#"{"exact_match": {"wieght": 1}}"#);
        assert!(e.starts_with("exact_match.wieght: unknown field `wieght`"), "{e}");
        let e = err(r#"{"bonus": {}}"#);
        assert!(e.starts_with("bonus: unknown field `bonus`"), "{e}");
        let e = err(r#"{"format": {"weight": "high"}}"#);
        assert!(e.starts_with("format.weight: invalid type: string \"high\""), "{e}");
        let e = err(r#"{"exact_match": {"extract": "middle"}}"#);
        assert!(e.starts_with("exact_match.extract: unknown variant `middle`"), "{e}");
        let e = err(r#"{"length_penalty": {"target": -3}}"#);
        assert!(e.starts_with("length_penalty.target: invalid value"), "{e}");
        let e = err(r#"{"length_penalty": {"target": 0}}"#);
        assert_eq!(e, "length_penalty.target: must be at least 1");
        let e = err(r#"{"format": {"pattern": "(unclosed"}}"#);
        assert!(e.starts_with("format.pattern: invalid regex"), "{e}");
    }
}
