//! `config.json` of a Hugging Face checkpoint, in two types (after candle): [`HfConfig`] mirrors the
//! file with optional fields, [`ArchConfig`] is the resolved runtime configuration every layer reads.
//!
//! Each family resolves its own keys with transformers' defaults for that family (its file:
//! [`crate::llama`], [`crate::qwen3`], [`crate::gemma`], ...; [`crate::families`] dispatches and
//! loads); [`keys`] lists the keys every family may carry, so a key that would change the
//! computation is never ignored in silence; [`rope`] reads rotary scaling from both spellings
//! transformers has used.

pub mod blocks;
mod flops;
mod hf;
pub mod keys;
pub mod rope;
pub mod vision;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};
pub use blocks::{Gemma4Layers, GptOssMoe, HeadGeometry, LinearAttnConfig, MoeConfig, Multimodal, PerLayerInput};
pub use hf::HfConfig;
pub use rope::{RopeConfig, RopeScaling};
pub use vision::{Mrope, TowerKind, VisionConfig};

/// The model families this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, SmolLM.
    Llama,
    /// Mistral: Llama with a sliding window on every layer.
    Mistral,
    /// Qwen2: Llama with a bias on q/k/v, sliding windows on the top layers when enabled.
    Qwen2,
    /// Qwen3: per-head q/k RMSNorm before RoPE, `head_dim` of its own.
    Qwen3,
    /// Qwen3-MoE: Qwen3 with a routed mixture of experts as MLP.
    Qwen3Moe,
    /// Gemma 2: sandwich norms, (1 + w) RMSNorm, attention and final logit soft-capping.
    Gemma2,
    /// Gemma 3 (text): Gemma 2 with per-head q/k norms and a second RoPE for sliding layers.
    Gemma3,
    /// OLMo 2: norms after attention and MLP, q/k RMSNorm over the whole projection.
    Olmo2,
    /// OLMo 3: OLMo 2 with sliding-window layers and a RoPE per layer type.
    Olmo3,
    /// Phi-3: fused q/k/v and gate/up projections, partial rotary, LongRoPE.
    Phi3,
    /// Qwen3.5 (text): Gated DeltaNet linear-attention layers among gated full-attention ones.
    Qwen3_5,
    /// Qwen3.5-MoE (text): Qwen3.5 with a routed mixture of experts and a shared expert as MLP.
    Qwen3_5Moe,
    /// Qwen3-Next: Qwen3.5-MoE's layers with the linear attention's projections grouped by key
    /// head (`in_proj_qkvz`, `in_proj_ba`) and Qwen3-MoE's choice of dense layers.
    Qwen3Next,
    /// gpt-oss: attention sinks, alternating sliding and full layers, biased experts with a
    /// clamped SwiGLU, YaRN.
    GptOss,
    /// Gemma 4 (text): Gemma 3's layout with per-layer head sizes, normalised values, keys and
    /// values shared by the last layers, per-layer input embeddings, proportional RoPE.
    Gemma4,
    /// GPT-2: learned positions, Conv1D weights, LayerNorm, gelu_new.
    Gpt2,
}

/// Every family with the `model_type` transformers writes for it.
const MODEL_TYPES: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("mistral", Family::Mistral),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("qwen3_moe", Family::Qwen3Moe),
    ("gemma2", Family::Gemma2),
    ("gemma3_text", Family::Gemma3),
    ("olmo2", Family::Olmo2),
    ("olmo3", Family::Olmo3),
    ("phi3", Family::Phi3),
    ("qwen3_5_text", Family::Qwen3_5),
    ("qwen3_5_moe_text", Family::Qwen3_5Moe),
    ("qwen3_next", Family::Qwen3Next),
    ("gpt_oss", Family::GptOss),
    ("gemma4_text", Family::Gemma4),
    ("gpt2", Family::Gpt2),
];

impl Family {
    /// The family of a `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        MODEL_TYPES.iter().find(|(t, _)| *t == model_type).map(|(_, f)| *f)
    }

    /// The `model_type` of this family.
    pub fn model_type(self) -> &'static str {
        MODEL_TYPES.iter().find(|(_, f)| *f == self).map(|(t, _)| *t).unwrap_or("llama")
    }

    /// Every supported `model_type`, comma separated (for messages).
    pub fn supported() -> String {
        MODEL_TYPES.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", ")
    }

    /// Prefix of the backbone tensors inside a checkpoint (`model.` or `transformer.`).
    pub fn backbone_prefix(self) -> &'static str {
        match self {
            Family::Gpt2 => "transformer",
            _ => "model",
        }
    }

    /// The `architectures` entry transformers writes for this family's scalar-head model.
    pub fn sequence_classification_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForSequenceClassification",
            Family::Mistral => "MistralForSequenceClassification",
            Family::Qwen2 => "Qwen2ForSequenceClassification",
            Family::Qwen3 => "Qwen3ForSequenceClassification",
            Family::Qwen3Moe => "Qwen3MoeForSequenceClassification",
            Family::Gemma2 => "Gemma2ForSequenceClassification",
            Family::Gemma3 => "Gemma3TextForSequenceClassification",
            Family::Olmo2 => "Olmo2ForSequenceClassification",
            Family::Olmo3 => "Olmo3ForSequenceClassification",
            Family::Phi3 => "Phi3ForSequenceClassification",
            Family::Qwen3_5 => "Qwen3_5TextForSequenceClassification",
            // transformers has no text-only Qwen3.5-MoE classifier; the generic head's name.
            Family::Qwen3_5Moe => "Qwen3_5MoeForSequenceClassification",
            Family::GptOss => "GptOssForSequenceClassification",
            Family::Qwen3Next => "Qwen3NextForSequenceClassification",
            // transformers has no Gemma 4 classifier; the generic head's name.
            Family::Gemma4 => "Gemma4ForSequenceClassification",
            Family::Gpt2 => "GPT2ForSequenceClassification",
        }
    }
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

/// Which RMSNorm: they differ in where the weight is applied and in what dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Llama, Qwen, Mistral, Phi-3: normalise in f32, cast back, then `w · x`.
    Rms,
    /// OLMo 2: normalise in f32, `w · x` in f32, then cast back.
    RmsScaleInF32,
    /// Gemma: normalise in f32, `(1 + w) · x` in f32, then cast back (weights stored around 0).
    Gemma,
}

/// Normalisation of queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// An RMSNorm over `head_dim`, shared by the heads (Qwen3, Gemma 3).
    PerHead,
    /// An RMSNorm over the whole projection, `heads · head_dim` (OLMo 2).
    Projection,
}

/// Where a decoder layer's norms sit around attention and MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockLayout {
    /// `h + attn(norm(h))`, `h + mlp(norm(h))` (Llama and most).
    PreNorm,
    /// `h + norm(attn(h))`, `h + norm(mlp(h))` (OLMo 2).
    PostNorm,
    /// `h + norm(attn(norm(h)))`, `h + norm(mlp(norm(h)))` (Gemma 2 and 3).
    Sandwich,
}

/// The attention of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    /// Every earlier token.
    Full,
    /// The last `sliding_window` tokens (the query's own included).
    Sliding,
    /// Gated DeltaNet linear attention: a fixed-size state per head instead of keys and values.
    Linear,
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
    /// `None` for learned absolute positions (GPT-2); the RoPE of full-attention layers.
    pub rope: Option<RopeConfig>,
    /// The RoPE of sliding-window layers where it differs (Gemma 3's local base frequency).
    pub rope_local: Option<RopeConfig>,
    /// Leading dimensions of each head that rotate (`head_dim · partial_rotary_factor`).
    pub rotary_dim: i64,
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
    pub norm: NormKind,
    pub qk_norm: QkNorm,
    pub layout: BlockLayout,
    /// q, k and v in one `qkv_proj` (Phi-3).
    pub fused_qkv: bool,
    /// gate and up in one `gate_up_proj` (Phi-3).
    pub fused_gate_up: bool,
    /// Embeddings multiplied by this (Gemma: √hidden, rounded to the weights' dtype).
    pub embed_scale: Option<f64>,
    /// Softmax scale of the attention scores; `None` = 1/√head_dim.
    pub attn_scale: Option<f64>,
    /// `cap · tanh(scores / cap)` on the attention scores (Gemma 2).
    pub attn_softcap: Option<f64>,
    /// `cap · tanh(logits / cap)` on the output logits (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Window of the [`AttnKind::Sliding`] layers.
    pub sliding_window: Option<i64>,
    /// Per layer, full or sliding attention.
    pub layer_types: Vec<AttnKind>,
    pub moe: Option<MoeConfig>,
    /// The linear-attention layers' sizes, for a model whose `layer_types` has some.
    pub linear_attn: Option<LinearAttnConfig>,
    /// Attention output multiplied by `sigmoid(gate)`, the gate projected with the queries
    /// (`q_proj` twice as wide, per head `[q; gate]`: Qwen3.5).
    pub attn_output_gate: bool,
    /// The multimodal checkpoint this text model was read from (its `text_config`), if it was.
    pub multimodal: Option<&'static Multimodal>,
    /// A learned logit per head that takes part in the softmax and attends to nothing
    /// (`self_attn.sinks`, gpt-oss).
    pub attn_sinks: bool,
    /// The checkpoint stores its experts in MXFP4 (`quantization_config.quant_method = mxfp4`):
    /// dequantised at load, saved back unquantised.
    pub mxfp4: bool,
    /// Gemma 4's per-layer geometry, shared keys and values, and per-layer inputs.
    pub gemma4: Option<Gemma4Layers>,
    /// The vision tower of a vision-language checkpoint whose images this model reads.
    pub vision: Option<VisionConfig>,
}

impl ArchConfig {
    /// Head size and KV heads of layer `i`.
    pub fn heads(&self, i: usize) -> HeadGeometry {
        self.gemma4
            .as_ref()
            .and_then(|g| g.heads.get(i).copied())
            .unwrap_or(HeadGeometry { head_dim: self.head_dim, kv_heads: self.num_kv_heads })
    }

    /// The dense MLP's intermediate size in layer `i`.
    pub fn intermediate(&self, i: usize) -> i64 {
        self.gemma4.as_ref().and_then(|g| g.intermediate.get(i).copied()).unwrap_or(self.intermediate_size)
    }

    /// The earlier layer whose keys and values layer `i` attends to, if not its own.
    pub fn kv_source(&self, i: usize) -> Option<usize> {
        self.gemma4.as_ref().and_then(|g| g.kv_source.get(i).copied().flatten())
    }

    /// Whether layer `i` attends through the sliding window.
    pub fn is_sliding(&self, i: usize) -> bool {
        self.sliding_window.is_some() && self.layer_types.get(i) == Some(&AttnKind::Sliding)
    }

    /// Prefix of the backbone's tensors: the family's (`model`, `transformer`), or the language
    /// model's inside a multimodal checkpoint.
    pub fn backbone_prefix(&self) -> &'static str {
        self.multimodal.map_or(self.family.backbone_prefix(), |m| m.language_prefix)
    }

    /// The `architectures` entry of this model's scalar-head checkpoint.
    pub fn sequence_classification_architecture(&self) -> &'static str {
        self.multimodal.map_or(self.family.sequence_classification_architecture(), |m| m.classifier)
    }

    /// Whether layer `i` is a linear-attention (Gated DeltaNet) layer.
    pub fn is_linear(&self, i: usize) -> bool {
        self.layer_types.get(i) == Some(&AttnKind::Linear)
    }

    /// Whether the rotary frequencies depend on the longest position of a forward (LongRoPE,
    /// dynamic NTK), as in transformers: a sequence's outputs then depend on the batch around it
    /// and on its padding.
    pub fn rotary_reads_longest_position(&self) -> bool {
        [&self.rope, &self.rope_local]
            .into_iter()
            .flatten()
            .any(|r| matches!(r.scaling, rope::RopeScaling::LongRope { .. } | rope::RopeScaling::Dynamic { .. }))
    }

    /// Whether a later forward may append to a cache this model filled, with masked slots left
    /// between (a multi-turn session): not with a sliding window (slots are what it counts) nor
    /// with linear attention (its state cannot skip a masked slot's convolution window).
    pub fn continues_with_gaps(&self) -> bool {
        self.sliding_window.is_none() && self.linear_attn.is_none()
    }
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
    /// Whether `architectures` names a `*ForSequenceClassification` model.
    pub fn is_sequence_classification(&self) -> bool {
        self.hf.architectures.as_ref().is_some_and(|a| a.iter().any(|s| s.ends_with("ForSequenceClassification")))
    }
}

/// A positive integer key (`default` when absent, an error naming the key when required).
pub(crate) fn require(path: &Path, key: &str, v: Option<i64>) -> Result<i64> {
    match v {
        Some(v) if v > 0 => Ok(v),
        Some(v) => Err(ModelError::config(path, key, format!("must be positive, got {v}"))),
        None => Err(ModelError::config(path, key, "missing")),
    }
}

/// Most layers a configuration may declare. The largest open models have about 130; a count
/// read from a file is checked against it before anything is sized by it (per-layer tables would
/// otherwise be allocated for every layer declared, before the checkpoint is opened).
pub(crate) const MAX_LAYERS: i64 = 1 << 16;

/// [`require`] for a layer count, at most [`MAX_LAYERS`].
pub(crate) fn require_layers(path: &Path, key: &str, v: Option<i64>) -> Result<i64> {
    let n = require(path, key, v)?;
    if n > MAX_LAYERS {
        return Err(ModelError::config(path, key, format!("{n} layers; at most {MAX_LAYERS} are supported")));
    }
    Ok(n)
}

/// The family-independent part of a rotary decoder's configuration, with transformers' defaults
/// for the family where a key is absent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults {
    /// `head_dim` when absent; `None` = `hidden_size / num_attention_heads`.
    pub head_dim: Option<i64>,
    pub norm_eps: f64,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    pub activation: &'static str,
    /// The key naming the activation (`hidden_act`, or Gemma's `hidden_activation`).
    pub activation_key: &'static str,
    pub rope_theta: f64,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            head_dim: None,
            norm_eps: 1e-6,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            activation: "silu",
            activation_key: "hidden_act",
            rope_theta: 10000.0,
        }
    }
}

/// A pre-norm Llama-like decoder from the common keys; families adjust the result.
pub(crate) fn rotary_decoder(path: &Path, hf: &HfConfig, family: Family, d: Defaults) -> Result<ArchConfig> {
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
    let head_dim = match hf.head_dim.or(d.head_dim) {
        Some(dim) => require(path, "head_dim", Some(dim))?,
        None if hidden % heads == 0 => hidden / heads,
        None => return Err(ModelError::config(path, "num_attention_heads", "does not divide hidden_size")),
    };
    if head_dim % 2 != 0 {
        return Err(ModelError::config(path, "head_dim", format!("must be even for RoPE, got {head_dim}")));
    }
    let act_name = match d.activation_key {
        "hidden_activation" => hf.hidden_activation.as_deref(),
        _ => hf.hidden_act.as_deref(),
    };
    let attention_bias = hf.attention_bias.unwrap_or(false);
    let max_position_embeddings = hf.max_position_embeddings.unwrap_or(d.max_position_embeddings);
    let num_layers = require_layers(path, "num_hidden_layers", hf.num_hidden_layers)?;
    let rope = rope::parse(path, hf, d.rope_theta, max_position_embeddings)?;
    Ok(ArchConfig {
        family,
        vocab_size: require(path, "vocab_size", hf.vocab_size)?,
        hidden_size: hidden,
        num_layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        intermediate_size: require(path, "intermediate_size", hf.intermediate_size)?,
        norm_eps: hf.rms_norm_eps.unwrap_or(d.norm_eps),
        rope: Some(rope),
        rope_local: None,
        rotary_dim: head_dim,
        max_position_embeddings,
        tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(d.tie_word_embeddings),
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        mlp_bias: false,
        activation: activation(path, d.activation_key, act_name.unwrap_or(d.activation))?,
        scale_attn_by_inverse_layer_idx: false,
        pad_token_id: None,
        num_labels: 2,
        norm: NormKind::Rms,
        qk_norm: QkNorm::None,
        layout: BlockLayout::PreNorm,
        fused_qkv: false,
        fused_gate_up: false,
        embed_scale: None,
        attn_scale: None,
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        layer_types: vec![AttnKind::Full; num_layers as usize],
        moe: None,
        linear_attn: None,
        attn_output_gate: false,
        multimodal: None,
        attn_sinks: false,
        mxfp4: false,
        gemma4: None,
        vision: None,
    })
}

/// `sliding_window` as an integer window (`None` when null).
pub(crate) fn sliding_window_value(path: &Path, hf: &HfConfig) -> Result<Option<i64>> {
    match &hf.sliding_window {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(w) if w > 0 => Ok(Some(w)),
            _ => {
                Err(ModelError::config(path, "sliding_window", format!("expected a positive integer or null, got {v}")))
            }
        },
    }
}

/// `layer_types` as written (`full_attention` / `sliding_attention`, one per layer), if present.
pub(crate) fn layer_types_value(path: &Path, hf: &HfConfig, num_layers: i64) -> Result<Option<Vec<AttnKind>>> {
    layer_kinds(path, hf, num_layers, &[("full_attention", AttnKind::Full), ("sliding_attention", AttnKind::Sliding)])
}

/// `layer_types` as written, each entry one of `kinds` (name, kind), if present.
pub(crate) fn layer_kinds(
    path: &Path,
    hf: &HfConfig,
    num_layers: i64,
    kinds: &[(&str, AttnKind)],
) -> Result<Option<Vec<AttnKind>>> {
    let Some(types) = &hf.layer_types else { return Ok(None) };
    if types.len() as i64 != num_layers {
        return Err(ModelError::config(
            path,
            "layer_types",
            format!("has {} entries for num_hidden_layers = {num_layers}", types.len()),
        ));
    }
    let names: Vec<&str> = kinds.iter().map(|(n, _)| *n).collect();
    types
        .iter()
        .map(|t| match kinds.iter().find(|(n, _)| n == t) {
            Some((_, kind)) => Ok(*kind),
            None => Err(ModelError::config(
                path,
                "layer_types",
                format!("unsupported `{t}` (supported: {})", names.join(", ")),
            )),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Qwen2/Qwen3's windows: with `use_sliding_window`, layers from `max_window_layers` on slide
/// (or as `layer_types` says), over `sliding_window` tokens (4096 when absent).
pub(crate) fn qwen_sliding(path: &Path, hf: &HfConfig, arch: &mut ArchConfig) -> Result<()> {
    let window = if hf.use_sliding_window == Some(true) {
        match &hf.sliding_window {
            None => Some(4096),
            Some(_) => sliding_window_value(path, hf)?,
        }
    } else {
        None
    };
    let n = arch.num_layers;
    let types = match layer_types_value(path, hf, n)? {
        Some(t) => t,
        None => {
            let from = hf.max_window_layers.unwrap_or(28);
            (0..n).map(|i| if window.is_some() && i >= from { AttnKind::Sliding } else { AttnKind::Full }).collect()
        }
    };
    arch.sliding_window = window;
    arch.layer_types = types;
    Ok(())
}

pub(crate) fn activation(path: &Path, key: &str, name: &str) -> Result<Activation> {
    match name {
        "silu" | "swish" => Ok(Activation::Silu),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
        "gelu" => Ok(Activation::Gelu),
        "relu" => Ok(Activation::Relu),
        other => Err(ModelError::config(path, key, format!("unsupported activation `{other}`"))),
    }
}

#[cfg(test)]
mod tests;
