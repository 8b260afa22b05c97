//! The parts of a resolved architecture beyond the rotary decoder's: linear attention, mixtures
//! of experts, and the multimodal checkpoints a text model is read from.

use super::Family;

/// The Gated DeltaNet layers of a hybrid model (Qwen3.5): heads and sizes of its linear attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttnConfig {
    /// Width of the causal depthwise convolution over q, k and v.
    pub conv_kernel: i64,
    pub num_key_heads: i64,
    pub num_value_heads: i64,
    pub key_head_dim: i64,
    pub value_head_dim: i64,
    /// The input projections grouped by key head (`in_proj_qkvz`, `in_proj_ba`: Qwen3-Next)
    /// rather than one per part (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: Qwen3.5).
    pub grouped_projections: bool,
}

impl LinearAttnConfig {
    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> i64 {
        2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
    }
}

/// A routed mixture of experts (Qwen3-MoE).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i64,
    /// Experts each token is routed to.
    pub top_k: i64,
    /// Intermediate size of each expert.
    pub intermediate_size: i64,
    /// Renormalise the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
    /// For each layer, whether its MLP is the sparse block (else a dense MLP).
    pub sparse_layers: Vec<bool>,
    /// The load-balancing loss's coefficient when training adds it (`output_router_logits`).
    pub aux_loss_coef: Option<f64>,
    /// A shared expert every token goes through, gated by `sigmoid(shared_expert_gate(x))`
    /// (Qwen3.5-MoE), of this intermediate size.
    pub shared_expert_intermediate_size: Option<i64>,
    /// gpt-oss's experts and router, where they are its (see [`GptOssMoe`]).
    pub gpt_oss: Option<GptOssMoe>,
}

/// gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed, and
/// biased experts stored stacked `[experts, in, out]` with gate and up interleaved, computing
/// `(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)` for `g = min(gate, limit)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptOssMoe {
    pub alpha: f64,
    pub limit: f64,
}

/// The head geometry of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadGeometry {
    pub head_dim: i64,
    pub kv_heads: i64,
}

/// Gemma 4's layers beyond Gemma 3's (transformers' `Gemma4TextConfig`): per-layer head sizes,
/// values that may be the keys, keys and values reused by the last layers, per-layer input
/// embeddings and a scalar per layer. Every per-layer list has one entry per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layers {
    /// Head size and KV heads of each layer (full-attention layers: `global_head_dim`,
    /// `num_global_key_value_heads`, or `per_layer_config`).
    pub heads: Vec<HeadGeometry>,
    /// Whether the layer's values are its key projection (no `v_proj`: `attention_k_eq_v` on
    /// full-attention layers), normalised like any value.
    pub values_are_keys: Vec<bool>,
    /// The earlier layer whose keys and values the layer attends to instead of its own (the last
    /// `num_kv_shared_layers`, each reading the last non-sharing layer of its own type); such a
    /// layer has no k/v projections and caches nothing.
    pub kv_source: Vec<Option<usize>>,
    /// The MLP's intermediate size per layer (`use_double_wide_mlp`: twice on reusing layers).
    pub intermediate: Vec<i64>,
    /// Per-layer input embeddings (`hidden_size_per_layer_input`), if the model has them.
    pub per_layer_input: Option<PerLayerInput>,
    /// The head size of the sliding layers' rotary tables (the full layers' is `rotary_dim`).
    pub local_rotary_dim: i64,
    /// The experts every layer runs beside its dense MLP (`enable_moe_block`: top-k of
    /// `num_experts`, renormalised, of `moe_intermediate_size`), if the model has them.
    pub moe: Option<MoeConfig>,
}

/// Gemma 4's per-layer input embeddings (PLE): a token embedding of `layers · dim` columns
/// (`embed_tokens_per_layer`, vocabulary `vocab`) plus a projection of the input embeddings, a
/// `dim`-wide input to every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerLayerInput {
    pub dim: i64,
    pub vocab: i64,
}

/// Reads a vision tower's configuration from a checkpoint's top-level `config.json`.
pub type ReadVision =
    fn(&std::path::Path, &serde_json::Map<String, serde_json::Value>) -> crate::error::Result<super::VisionConfig>;

/// A vision-language checkpoint whose language model loads as a text family: the `config.json`
/// nests the text model's keys under `text_config`, its tensors sit under `language_prefix`, the
/// vision tower's under `vision_prefixes` (read where the family's tower is implemented, else kept
/// as loaded and saved back unchanged).
#[derive(Debug)]
pub struct Multimodal {
    /// The checkpoint's `model_type` (`qwen3_5`).
    pub model_type: &'static str,
    /// The `model_type` of its `text_config` (`qwen3_5_text`).
    pub text_model_type: &'static str,
    pub family: Family,
    /// Where the language model's tensors are (`model.language_model`).
    pub language_prefix: &'static str,
    /// Where the other modalities' tensors are (`model.visual.`; Gemma 4's vision and audio
    /// towers and embedders).
    pub vision_prefixes: &'static [&'static str],
    /// The scalar-head architecture transformers writes for the checkpoint.
    pub classifier: &'static str,
    /// The top-level keys besides `text_config` and the inert ones: the vision model's.
    pub keys: &'static [&'static str],
    /// The text model's keys may sit at the top level instead of under `text_config` (the
    /// Hub's Qwen2-VL and Qwen2.5-VL configs).
    pub flat: bool,
    /// Reads the vision tower from the top-level config: its tensors are then loaded and images
    /// read, instead of carried through.
    pub vision: Option<ReadVision>,
    /// transformers' `mrope_section` where the text config gives none (the interleaved families,
    /// whose sections need not add up to the rotary frequencies: each axis takes every third
    /// frequency up to three times its count).
    pub mrope_section: Option<[i64; 3]>,
    /// Adjusts the text model's keys before the text family reads them: the multimodal model's
    /// own defaults where they differ from the family's (Qwen3-VL's `rope_theta`), and what its
    /// language model does whatever the keys say (Qwen3-VL-MoE always renormalises its routing).
    pub text_hook: Option<fn(&mut serde_json::Map<String, serde_json::Value>)>,
    /// The same model in transformers' older tensor names (`model.layers.*`, `visual.*`), read
    /// when a checkpoint stores them so.
    pub legacy: Option<&'static Multimodal>,
}
