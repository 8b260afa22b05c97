//! The `env-calculator` config section: tool tags, rewards and the evaluator's limits. Every key
//! is optional; unknown keys are refused.

use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

use crate::eval::Limits;

/// Deepest `max_depth` accepted: the evaluator recurses once per level of parentheses.
pub const MAX_DEPTH_LIMIT: usize = 256;

/// The whole section (flat; see the crate docs for the table).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// First observation of every episode, appended to its prompt (may be empty).
    pub instructions: String,
    /// Opening tag of a tool call.
    pub call_open: String,
    /// Closing tag of a tool call; also the stop string that ends a policy turn.
    pub call_close: String,
    /// The answer to a call; `{}` is replaced by the value or by `error: <message>`.
    pub result_format: String,
    /// Calls allowed per episode; later calls are answered `error: too many calls`.
    pub max_calls: u32,
    /// Reward of a final answer equal to the label.
    pub correct_reward: f64,
    /// Reward of any other final answer.
    pub wrong_reward: f64,
    /// Longest expression, in characters.
    pub max_chars: usize,
    /// Deepest nesting of parentheses (at most [`MAX_DEPTH_LIMIT`]).
    pub max_depth: usize,
    /// Largest `|exponent|` of `**` / `^`.
    pub max_exponent: u32,
    /// Largest `|value|` of any literal, intermediate or final value.
    pub max_abs: f64,
}

impl Default for Config {
    fn default() -> Self {
        let limits = Limits::default();
        Config {
            instructions: String::new(),
            call_open: "<calc>".to_string(),
            call_close: "</calc>".to_string(),
            result_format: "<result>{}</result>".to_string(),
            max_calls: 4,
            correct_reward: 1.0,
            wrong_reward: 0.0,
            max_chars: limits.max_chars,
            max_depth: limits.max_depth,
            max_exponent: limits.max_exponent,
            max_abs: limits.max_abs,
        }
    }
}

impl Config {
    /// Parses and validates the section (JSON text); errors name the key.
    pub fn parse(json: &str) -> Result<Config, PluginError> {
        let config: Config = parse_config(json)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), PluginError> {
        if self.max_calls == 0 {
            return Err(PluginError::config("max_calls", "must be at least 1"));
        }
        for (key, tag) in [("call_open", &self.call_open), ("call_close", &self.call_close)] {
            if tag.is_empty() {
                return Err(PluginError::config(key, "must not be empty"));
            }
        }
        if self.call_open == self.call_close {
            return Err(PluginError::config("call_close", "must differ from `call_open`"));
        }
        let holes = self.result_format.matches("{}").count();
        if holes != 1 {
            return Err(PluginError::config(
                "result_format",
                format!("must contain `{{}}` exactly once, found it {holes} times"),
            ));
        }
        for (key, reward) in [("correct_reward", self.correct_reward), ("wrong_reward", self.wrong_reward)] {
            if !reward.is_finite() {
                return Err(PluginError::config(key, format!("must be a finite number, got {reward}")));
            }
        }
        if self.max_chars == 0 {
            return Err(PluginError::config("max_chars", "must be at least 1"));
        }
        if !(1..=MAX_DEPTH_LIMIT).contains(&self.max_depth) {
            return Err(PluginError::config("max_depth", format!("must be between 1 and {MAX_DEPTH_LIMIT}")));
        }
        if !(self.max_abs.is_finite() && self.max_abs > 0.0) {
            return Err(PluginError::config(
                "max_abs",
                format!("must be a positive finite number, got {}", self.max_abs),
            ));
        }
        Ok(())
    }

    /// The evaluator's limits.
    pub fn limits(&self) -> Limits {
        Limits {
            max_chars: self.max_chars,
            max_depth: self.max_depth,
            max_exponent: self.max_exponent,
            max_abs: self.max_abs,
        }
    }

    /// `result_format` with `body` in place of `{}`.
    pub fn result(&self, body: &str) -> String {
        self.result_format.replacen("{}", body, 1)
    }

    /// The text before and after `{}` in `result_format`.
    pub fn result_tags(&self) -> (&str, &str) {
        self.result_format.split_once("{}").unwrap_or((self.result_format.as_str(), ""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> String {
        Config::parse(json).expect_err(json).to_string()
    }

    #[test]
    fn defaults() {
        for json in ["", "{}"] {
            let c = Config::parse(json).unwrap();
            assert_eq!(c, Config::default());
            assert_eq!(c.instructions, "");
            assert_eq!((c.call_open.as_str(), c.call_close.as_str()), ("<calc>", "</calc>"));
            assert_eq!(c.result("1776"), "<result>1776</result>");
            assert_eq!(c.result_tags(), ("<result>", "</result>"));
            assert_eq!((c.max_calls, c.correct_reward, c.wrong_reward), (4, 1.0, 0.0));
            assert_eq!(c.limits(), Limits::default());
        }
    }

    #[test]
    fn keys_override_defaults() {
        let c = Config::parse(r#"{"call_open": "[[", "call_close": "]]", "result_format": "= {}", "max_depth": 4}"#)
            .unwrap();
        assert_eq!(c.result("2"), "= 2");
        assert_eq!(c.result_tags(), ("= ", ""));
        assert_eq!(c.limits().max_depth, 4);
        assert_eq!(c.max_calls, 4);
    }

    #[test]
    fn errors_name_the_key() {
        let e = err(r#"{"max_call": 3}"#);
        assert!(e.starts_with("max_call: unknown field `max_call`"), "{e}");
        let e = err(r#"{"max_calls": "3"}"#);
        assert!(e.starts_with("max_calls: invalid type"), "{e}");
        assert_eq!(err(r#"{"max_calls": 0}"#), "max_calls: must be at least 1");
        assert_eq!(err(r#"{"call_open": ""}"#), "call_open: must not be empty");
        assert_eq!(err(r#"{"call_close": ""}"#), "call_close: must not be empty");
        assert_eq!(err(r#"{"call_open": "|", "call_close": "|"}"#), "call_close: must differ from `call_open`");
        assert_eq!(
            err(r#"{"result_format": "<r></r>"}"#),
            "result_format: must contain `{}` exactly once, found it 0 times"
        );
        assert_eq!(
            err(r#"{"result_format": "{}{}"}"#),
            "result_format: must contain `{}` exactly once, found it 2 times"
        );
        assert_eq!(err(r#"{"max_chars": 0}"#), "max_chars: must be at least 1");
        assert_eq!(err(r#"{"max_depth": 0}"#), "max_depth: must be between 1 and 256");
        assert_eq!(err(r#"{"max_depth": 1000}"#), "max_depth: must be between 1 and 256");
        assert_eq!(err(r#"{"max_abs": -1}"#), "max_abs: must be a positive finite number, got -1");
        let e = err(r#"{"correct_reward": null}"#);
        assert!(e.starts_with("correct_reward: invalid type"), "{e}");
    }
}
