//! `config.json` of a Hugging Face checkpoint, in two types (after candle): [`HfConfig`] mirrors the
//! file with optional fields, [`ArchConfig`] is the resolved runtime configuration every layer reads.
//!
//! Rope scaling is read from both spellings transformers has used: `rope_theta` + `rope_scaling`
//! (`type` or `rope_type`) up to v4, and the `rope_parameters` block of v5.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The model families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral (without sliding window), SmolLM.
    Llama,
    /// Qwen2: Llama with a bias on q/k/v.
    Qwen2,
    /// GPT-2: learned positions, Conv1D weights, LayerNorm, gelu_new.
    Gpt2,
}

impl Family {
    /// Prefix of the backbone tensors inside a checkpoint (`model.` or `transformer.`).
    pub fn backbone_prefix(self) -> &'static str {
        match self {
            Family::Llama | Family::Qwen2 => "model",
            Family::Gpt2 => "transformer",
        }
    }
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (inv_freq / factor).
    Linear { factor: f64 },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// Rotary embedding parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
}

/// Activation of the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// tanh approximation: gelu_new, gelu_pytorch_tanh, gelu_fast.
    GeluTanh,
    Gelu,
    Relu,
}

/// The resolved architecture: every value a layer needs, no options left.
#[derive(Debug, Clone)]
pub struct ArchConfig {
    pub family: Family,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub intermediate_size: i64,
    pub norm_eps: f64,
    /// `None` for learned absolute positions (GPT-2).
    pub rope: Option<RopeConfig>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    pub activation: Activation,
    /// GPT-2 `scale_attn_by_inverse_layer_idx`.
    pub scale_attn_by_inverse_layer_idx: bool,
    pub pad_token_id: Option<i64>,
    /// Number of labels of a sequence-classification head (1 for reward models and critics).
    pub num_labels: i64,
}

/// Mirror of `config.json` with every field optional; unknown keys are kept in the raw value.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
    pub vocab_size: Option<i64>,
    pub hidden_size: Option<i64>,
    pub num_hidden_layers: Option<i64>,
    pub num_attention_heads: Option<i64>,
    pub num_key_value_heads: Option<i64>,
    pub head_dim: Option<i64>,
    pub intermediate_size: Option<i64>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rope_parameters: Option<Value>,
    pub max_position_embeddings: Option<i64>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub pad_token_id: Option<Value>,
    pub num_labels: Option<i64>,
    pub id2label: Option<serde_json::Map<String, Value>>,
    pub use_sliding_window: Option<bool>,
    pub sliding_window: Option<Value>,
    // GPT-2 names.
    pub n_embd: Option<i64>,
    pub n_layer: Option<i64>,
    pub n_head: Option<i64>,
    pub n_positions: Option<i64>,
    pub n_inner: Option<i64>,
    pub layer_norm_epsilon: Option<f64>,
    pub activation_function: Option<String>,
    pub scale_attn_weights: Option<bool>,
    pub scale_attn_by_inverse_layer_idx: Option<bool>,
    pub reorder_and_upcast_attn: Option<bool>,
}

/// A parsed `config.json`: the raw JSON (written back on save) and the resolved architecture.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub raw: Value,
    pub hf: HfConfig,
    pub arch: ArchConfig,
}

/// Reads and parses a JSON file, naming the file (and key path) in every error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    parse_json(path, &text)
}

/// Parses JSON text that came from `path`; type errors name the key path.
pub fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        let message = if key.is_empty() || key == "." || key == "?" || inner.is_syntax() || inner.is_eof() {
            format!("invalid JSON: {inner}")
        } else {
            format!("{key}: {inner}")
        };
        ModelError::Json { path: path.to_path_buf(), message }
    })
}

impl ModelConfig {
    /// Loads `<dir>/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let raw: Value = read_json(&path)?;
        if !raw.is_object() {
            return Err(ModelError::Json { path, message: "expected a JSON object".into() });
        }
        let hf: HfConfig = parse_json(&path, &raw.to_string())?;
        let arch = resolve(&path, &hf)?;
        Ok(ModelConfig { path, raw, hf, arch })
    }

    /// Whether `architectures` names a `*ForSequenceClassification` model.
    pub fn is_sequence_classification(&self) -> bool {
        self.hf.architectures.as_ref().is_some_and(|a| a.iter().any(|s| s.ends_with("ForSequenceClassification")))
    }
}

fn require(path: &Path, key: &str, v: Option<i64>) -> Result<i64> {
    match v {
        Some(v) if v > 0 => Ok(v),
        Some(v) => Err(ModelError::config(path, key, format!("must be positive, got {v}"))),
        None => Err(ModelError::config(path, key, "missing")),
    }
}

fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let model_type = hf.model_type.as_deref().ok_or_else(|| ModelError::config(path, "model_type", "missing"))?;
    let family = match model_type {
        "llama" | "mistral" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "gpt2" => Family::Gpt2,
        other => {
            return Err(ModelError::config(
                path,
                "model_type",
                format!("unsupported `{other}` (supported: llama, mistral, qwen2, gpt2)"),
            ))
        }
    };
    let pad_token_id = match &hf.pad_token_id {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n.as_i64(),
        Some(Value::Array(a)) => a.first().and_then(Value::as_i64),
        Some(other) => {
            return Err(ModelError::config(path, "pad_token_id", format!("expected an integer, got {other}")))
        }
    };
    let num_labels = hf.num_labels.or(hf.id2label.as_ref().map(|m| m.len() as i64)).unwrap_or(2);
    let vocab_size = require(path, "vocab_size", hf.vocab_size)?;
    match family {
        Family::Gpt2 => {
            let hidden = require(path, "n_embd", hf.n_embd)?;
            let heads = require(path, "n_head", hf.n_head)?;
            if hidden % heads != 0 {
                return Err(ModelError::config(path, "n_head", format!("{heads} does not divide n_embd {hidden}")));
            }
            if hf.reorder_and_upcast_attn == Some(true) {
                return Err(ModelError::config(path, "reorder_and_upcast_attn", "true is not supported"));
            }
            if hf.scale_attn_weights == Some(false) {
                return Err(ModelError::config(path, "scale_attn_weights", "false is not supported"));
            }
            let act = hf.activation_function.as_deref().unwrap_or("gelu_new");
            Ok(ArchConfig {
                family,
                vocab_size,
                hidden_size: hidden,
                num_layers: require(path, "n_layer", hf.n_layer)?,
                num_heads: heads,
                num_kv_heads: heads,
                head_dim: hidden / heads,
                intermediate_size: hf.n_inner.unwrap_or(4 * hidden),
                norm_eps: hf.layer_norm_epsilon.unwrap_or(1e-5),
                rope: None,
                max_position_embeddings: require(path, "n_positions", hf.n_positions)?,
                tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(true),
                qkv_bias: true,
                o_bias: true,
                mlp_bias: true,
                activation: activation(path, "activation_function", act)?,
                scale_attn_by_inverse_layer_idx: hf.scale_attn_by_inverse_layer_idx.unwrap_or(false),
                pad_token_id,
                num_labels,
            })
        }
        Family::Llama | Family::Qwen2 => {
            let hidden = require(path, "hidden_size", hf.hidden_size)?;
            let heads = require(path, "num_attention_heads", hf.num_attention_heads)?;
            let kv_heads = require(path, "num_key_value_heads", hf.num_key_value_heads.or(Some(heads)))?;
            if heads % kv_heads != 0 {
                return Err(ModelError::config(
                    path,
                    "num_key_value_heads",
                    format!("{kv_heads} does not divide num_attention_heads {heads}"),
                ));
            }
            let head_dim = match hf.head_dim {
                Some(d) => require(path, "head_dim", Some(d))?,
                None if hidden % heads == 0 => hidden / heads,
                None => return Err(ModelError::config(path, "num_attention_heads", "does not divide hidden_size")),
            };
            if head_dim % 2 != 0 {
                return Err(ModelError::config(path, "head_dim", format!("must be even for RoPE, got {head_dim}")));
            }
            if hf.use_sliding_window == Some(true) {
                return Err(ModelError::config(
                    path,
                    "use_sliding_window",
                    "sliding-window attention is not supported",
                ));
            }
            let attention_bias = hf.attention_bias.unwrap_or(false);
            let act = hf.hidden_act.as_deref().unwrap_or("silu");
            Ok(ArchConfig {
                family,
                vocab_size,
                hidden_size: hidden,
                num_layers: require(path, "num_hidden_layers", hf.num_hidden_layers)?,
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim,
                intermediate_size: require(path, "intermediate_size", hf.intermediate_size)?,
                norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
                rope: Some(rope_config(path, hf)?),
                max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
                tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
                qkv_bias: family == Family::Qwen2 || attention_bias,
                o_bias: family != Family::Qwen2 && attention_bias,
                mlp_bias: hf.mlp_bias.unwrap_or(false),
                activation: activation(path, "hidden_act", act)?,
                scale_attn_by_inverse_layer_idx: false,
                pad_token_id,
                num_labels,
            })
        }
    }
}

fn activation(path: &Path, key: &str, name: &str) -> Result<Activation> {
    match name {
        "silu" | "swish" => Ok(Activation::Silu),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
        "gelu" => Ok(Activation::Gelu),
        "relu" => Ok(Activation::Relu),
        other => Err(ModelError::config(path, key, format!("unsupported activation `{other}`"))),
    }
}

fn rope_config(path: &Path, hf: &HfConfig) -> Result<RopeConfig> {
    // v5: everything lives in `rope_parameters`; v4: `rope_theta` + optional `rope_scaling`.
    let (key, block) = match (&hf.rope_parameters, &hf.rope_scaling) {
        (Some(p), _) if !p.is_null() => ("rope_parameters", Some(p)),
        (_, Some(s)) if !s.is_null() => ("rope_scaling", Some(s)),
        _ => ("rope_scaling", None),
    };
    let num = |name: &str| -> Result<Option<f64>> {
        match block.and_then(|b| b.get(name)) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                ModelError::config(path, &format!("{key}.{name}"), format!("expected a number, got {v}"))
            }),
        }
    };
    let theta = num("rope_theta")?.or(hf.rope_theta).unwrap_or(10000.0);
    if !(theta.is_finite() && theta > 0.0) {
        let from_block = block.is_some_and(|b| b.get("rope_theta").is_some());
        let key = if from_block { format!("{key}.rope_theta") } else { "rope_theta".to_string() };
        return Err(ModelError::config(path, &key, format!("must be a positive number, got {theta}")));
    }
    let Some(block) = block else { return Ok(RopeConfig { theta, scaling: RopeScaling::None }) };
    if !block.is_object() {
        return Err(ModelError::config(path, key, format!("expected an object, got {block}")));
    }
    let kind = block.get("rope_type").or_else(|| block.get("type")).and_then(Value::as_str).unwrap_or("default");
    // Every scaling parameter divides a frequency or a wavelength: zero, negative or non-finite
    // values would silently make every logit NaN.
    let need = |name: &str| -> Result<f64> {
        let v = num(name)?.ok_or_else(|| ModelError::config(path, &format!("{key}.{name}"), "missing"))?;
        if !(v.is_finite() && v > 0.0) {
            return Err(ModelError::config(
                path,
                &format!("{key}.{name}"),
                format!("must be a positive number, got {v}"),
            ));
        }
        Ok(v)
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: need("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        },
        other => {
            return Err(ModelError::config(
                path,
                &format!("{key}.rope_type"),
                format!("unsupported `{other}` (supported: default, linear, llama3)"),
            ))
        }
    };
    Ok(RopeConfig { theta, scaling })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_config(json: &str) -> (tempfile::TempDir, Result<ModelConfig>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        let cfg = ModelConfig::from_dir(dir.path());
        (dir, cfg)
    }

    const LLAMA: &str = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
        "num_attention_heads":2,"num_key_value_heads":1,"intermediate_size":16,"rope_theta":500000.0,
        "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
        "original_max_position_embeddings":16}}"#;

    #[test]
    fn resolves_llama_with_v4_rope_scaling() {
        let (_d, cfg) = write_config(LLAMA);
        let a = cfg.unwrap().arch;
        assert_eq!((a.head_dim, a.num_kv_heads), (4, 1));
        let rope = a.rope.unwrap();
        assert_eq!(rope.theta, 500000.0);
        assert!(matches!(rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    #[test]
    fn resolves_v5_rope_parameters() {
        let json = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"intermediate_size":16,
            "rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":1000.0}}"#;
        let (_d, cfg) = write_config(json);
        let a = cfg.unwrap().arch;
        assert_eq!(a.rope.unwrap(), RopeConfig { theta: 1000.0, scaling: RopeScaling::Linear { factor: 2.0 } });
        assert!(a.qkv_bias && !a.o_bias);
    }

    #[test]
    fn errors_name_file_and_key() {
        let (_d, cfg) = write_config(r#"{"model_type":"bert","vocab_size":3}"#);
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("config.json: model_type: unsupported `bert`"), "{e}");

        let (_d, cfg) = write_config(r#"{"model_type":"llama","vocab_size":"many"}"#);
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("config.json: vocab_size: invalid type"), "{e}");

        let (_d, cfg) = write_config("{not json");
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("config.json: invalid JSON"), "{e}");

        let (_d, cfg) = write_config(r#"{"model_type":"llama","vocab_size":3,"hidden_size":8}"#);
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("num_attention_heads: missing"), "{e}");

        let (_d, cfg) = write_config(&LLAMA.replace("llama3", "yarn"));
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("rope_scaling.rope_type: unsupported `yarn`"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let e = ModelConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.ends_with("config.json: not found"), "{e}");
    }

    #[test]
    fn rope_parameters_must_be_positive() {
        let (_d, cfg) = write_config(&LLAMA.replace(r#""factor":8.0"#, r#""factor":0"#));
        let e = cfg.unwrap_err().to_string();
        assert!(e.contains("config.json: rope_scaling.factor: must be a positive number, got 0"), "{e}");
        let (_d, cfg) = write_config(&LLAMA.replace(r#""factor":8.0"#, r#""factor":-2.0"#));
        assert!(cfg.unwrap_err().to_string().contains("rope_scaling.factor"));
        let (_d, cfg) = write_config(&LLAMA.replace(r#""low_freq_factor":1.0"#, r#""low_freq_factor":0.0"#));
        assert!(cfg.unwrap_err().to_string().contains("rope_scaling.low_freq_factor: must be a positive"));
        let json = LLAMA.replace(r#""rope_scaling""#, r#""rope_theta":0,"rope_scaling""#);
        let (_d, cfg) = write_config(&json);
        assert!(cfg.unwrap_err().to_string().contains("config.json: rope_theta: must be a positive number"));
    }
}
