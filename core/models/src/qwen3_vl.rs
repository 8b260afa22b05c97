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
    // `Qwen3VLTextConfig`'s default, where Qwen3's is 10000.
    rope_theta: Some(500_000.0),
    legacy: None,
};
