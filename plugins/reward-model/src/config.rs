//! The `reward-model` config section. Only `model` is required.

use std::path::PathBuf;

use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

/// Floating dtype the reward model is loaded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Dtype {
    #[default]
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
}

impl Dtype {
    /// The libtorch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            Dtype::F32 => tch::Kind::Float,
            Dtype::Bf16 => tch::Kind::BFloat16,
        }
    }
}

/// What text the reward model judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TemplateMode {
    /// The sample's chat messages plus the response as an assistant turn, rendered with the reward
    /// model's own chat template, when it has one; else `prompt + response`.
    #[default]
    Auto,
    /// `prompt + response` as the policy saw them.
    None,
}

/// The section as written (every key but `model` has a default).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    model: Option<PathBuf>,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    dtype: Dtype,
    #[serde(default = "default_batch_size")]
    batch_size: usize,
    #[serde(default = "default_max_len")]
    max_len: usize,
    #[serde(default)]
    chat_template: TemplateMode,
    #[serde(default)]
    normalize: bool,
    #[serde(default)]
    clip: Option<f64>,
}

fn default_batch_size() -> usize {
    16
}

fn default_max_len() -> usize {
    1024
}

/// A validated section.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Reward model directory (`*ForSequenceClassification`, `num_labels = 1`); a relative path is
    /// relative to the working directory of `rlhf`.
    pub model: PathBuf,
    /// `cpu`, `cuda`, `cuda:N`; `None` = the run's device.
    pub device: Option<String>,
    pub dtype: Dtype,
    /// Texts per forward pass.
    pub batch_size: usize,
    /// Tokens kept per text (the last ones).
    pub max_len: usize,
    pub chat_template: TemplateMode,
    /// Normalise scores with the running mean and std of every score seen so far.
    pub normalize: bool,
    /// Clamp scores to ±clip (after normalisation).
    pub clip: Option<f64>,
}

impl Config {
    /// Parses and validates the section (JSON text); errors name the key.
    pub fn parse(json: &str) -> Result<Config, PluginError> {
        let raw: Raw = parse_config(json)?;
        let model = raw.model.ok_or_else(|| {
            PluginError::config(
                "model",
                "required: the reward model directory (config.json, safetensors, tokenizer.json)",
            )
        })?;
        if raw.batch_size == 0 {
            return Err(PluginError::config("batch_size", "must be at least 1"));
        }
        if raw.max_len == 0 {
            return Err(PluginError::config("max_len", "must be at least 1"));
        }
        if let Some(c) = raw.clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(PluginError::config("clip", format!("must be a finite number > 0, got {c}")));
            }
        }
        Ok(Config {
            model,
            device: raw.device,
            dtype: raw.dtype,
            batch_size: raw.batch_size,
            max_len: raw.max_len,
            chat_template: raw.chat_template,
            normalize: raw.normalize,
            clip: raw.clip,
        })
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
        let c = Config::parse(r#"{"model": "rm"}"#).unwrap();
        assert_eq!(
            c,
            Config {
                model: "rm".into(),
                device: None,
                dtype: Dtype::F32,
                batch_size: 16,
                max_len: 1024,
                chat_template: TemplateMode::Auto,
                normalize: false,
                clip: None,
            }
        );
        let c = Config::parse(r#"{"model": "rm", "dtype": "bf16", "chat_template": "none", "clip": 5}"#).unwrap();
        assert_eq!((c.dtype, c.chat_template, c.clip), (Dtype::Bf16, TemplateMode::None, Some(5.0)));
    }

    #[test]
    fn errors_start_with_the_key() {
        assert!(err("{}").starts_with("model: required"));
        assert!(err("").starts_with("model: required"));
        assert!(err(r#"{"model": "rm", "modle": 1}"#).starts_with("modle: unknown field"));
        assert!(err(r#"{"model": 3}"#).starts_with("model: invalid type"));
        assert!(err(r#"{"model": "rm", "dtype": "f16"}"#).starts_with("dtype: unknown variant `f16`"));
        assert!(err(r#"{"model": "rm", "chat_template": "yes"}"#).starts_with("chat_template: unknown variant"));
        assert_eq!(err(r#"{"model": "rm", "batch_size": 0}"#), "batch_size: must be at least 1");
        assert_eq!(err(r#"{"model": "rm", "max_len": 0}"#), "max_len: must be at least 1");
        assert!(err(r#"{"model": "rm", "batch_size": -1}"#).starts_with("batch_size: invalid value"));
        assert_eq!(err(r#"{"model": "rm", "clip": 0}"#), "clip: must be a finite number > 0, got 0");
    }
}
