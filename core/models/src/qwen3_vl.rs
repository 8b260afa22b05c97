//! Qwen3-VL (Qwen Team 2025) — transformers' `modeling_qwen3_vl.py`
//! (`Qwen3VLForConditionalGeneration`, `model_type` `qwen3_vl`). The language model is Qwen3
//! ([`crate::qwen3`]: per-head q/k norms) with the interleaved multimodal RoPE
//! ([`crate::config::Mrope`], `[24, 20, 20]` on the released sizes) and DeepStack: the vision
//! tower ([`crate::vision_tower3`]) also hands over the features of some of its blocks, which the
//! first decoder layers add to their outputs at the image's tokens. An image's features replace its
//! `<|image_pad|>` placeholders, and its tokens take the same 3-D positions as Qwen2.5-VL's
//! ([`crate::qwen2_5_vl::mrope_positions`]; transformers' `get_rope_index` for still images).
//!
//! The Hub's checkpoints nest the text model under `text_config` and store the tensors under
//! `model.language_model.*` and `model.visual.*`, the LM head as `lm_head.weight`.

use serde_json::{Map, Value};

use crate::config::{vision, Family, Multimodal};

/// Qwen3-VL as the Hub stores it.
pub(crate) const MULTIMODAL: Multimodal = Multimodal {
    model_type: "qwen3_vl",
    text_model_type: "qwen3_vl_text",
    family: Family::Qwen3,
    language_prefix: "model.language_model",
    vision_prefixes: &["model.visual."],
    classifier: "Qwen3VLForSequenceClassification",
    keys: &["vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"],
    flat: false,
    vision: Some(vision::qwen3_vl),
    mrope_section: Some([24, 20, 20]),
    text_hook: Some(text_defaults),
    legacy: None,
};

/// Qwen3-VL-MoE as the Hub stores it: the language model is Qwen3-MoE's ([`crate::qwen3_moe`]),
/// its routing always renormalised over the chosen experts, its experts stacked — `[experts,
/// hidden, 2 · inter]` and `[experts, inter, hidden]` on the Hub, the other way round as
/// transformers 5 saves them (both load, and a save keeps the layout).
pub(crate) const MULTIMODAL_MOE: Multimodal = Multimodal {
    model_type: "qwen3_vl_moe",
    text_model_type: "qwen3_vl_moe_text",
    family: Family::Qwen3Moe,
    classifier: "Qwen3VLMoeForSequenceClassification",
    text_hook: Some(moe_text_defaults),
    ..MULTIMODAL
};

/// `Qwen3VLTextConfig`'s `rope_theta` (500000, where Qwen3's is 10000) when the config gives none.
fn text_defaults(text: &mut Map<String, Value>) {
    let in_block = ["rope_parameters", "rope_scaling"]
        .iter()
        .any(|k| text.get(*k).and_then(Value::as_object).is_some_and(|b| b.contains_key("rope_theta")));
    if !in_block && !text.contains_key("rope_theta") {
        text.insert("rope_theta".into(), Value::from(500_000.0));
    }
}

/// [`text_defaults`], and the router's renormalisation, which `Qwen3VLMoeTextTopKRouter` always
/// applies (the config has no `norm_topk_prob`).
fn moe_text_defaults(text: &mut Map<String, Value>) {
    text_defaults(text);
    text.insert("norm_topk_prob".into(), Value::Bool(true));
}
