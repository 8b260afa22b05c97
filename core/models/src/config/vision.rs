//! What a vision-language checkpoint adds to its language model's configuration: the multimodal
//! rotary split of the language model's frequencies (`mrope_section`), the vision tower's
//! `vision_config`, and the placeholder token the image features replace.

use std::path::Path;

use serde_json::{Map, Value};

use super::{activation, keys, Activation};
use crate::error::{ModelError, Result};

/// The multimodal RoPE (Qwen2-VL, Bai et al. 2024): each rotary frequency turns with one of three
/// position axes — time, height, width. `section` counts the frequencies of each axis; in the
/// contiguous layout (Qwen2-VL, Qwen2.5-VL) the first `section[0]` frequencies follow time, the
/// next `section[1]` height, the rest width; interleaved (Qwen3-VL, Qwen3.5) frequency `j` follows
/// height when `j % 3 == 1` and `j < 3·section[1]`, width when `j % 3 == 2` and `j < 3·section[2]`,
/// time otherwise. A text token has the same position on all three axes, so for text this is
/// plain RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mrope {
    pub section: [i64; 3],
    pub interleaved: bool,
}

impl Mrope {
    /// The axis (0 time, 1 height, 2 width) of each of the `half` frequencies.
    pub fn axes(&self, half: i64) -> Vec<i64> {
        let s = self.section;
        (0..half)
            .map(|j| {
                if self.interleaved {
                    match j % 3 {
                        1 if j < 3 * s[1] => 1,
                        2 if j < 3 * s[2] => 2,
                        _ => 0,
                    }
                } else if j < s[0] {
                    0
                } else if j < s[0] + s[1] {
                    1
                } else {
                    2
                }
            })
            .collect()
    }
}

/// Takes `mrope_section` (and `mrope_interleaved`) out of the rope block of `text` (under
/// `rope_parameters` or `rope_scaling`), turning the old `type: mrope` into `default`; `scope`
/// prefixes the keys in errors. `None` when the block has no section.
pub(crate) fn take_mrope(path: &Path, text: &mut Map<String, Value>, scope: &str) -> Result<Option<Mrope>> {
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(Value::Object(block)) = text.get_mut(key) else { continue };
        let name = |k: &str| format!("{scope}{key}.{k}");
        for t in ["type", "rope_type"] {
            if block.get(t).and_then(Value::as_str) == Some("mrope") {
                block.insert(t.into(), Value::from("default"));
            }
        }
        let interleaved = match block.remove("mrope_interleaved") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(v) => {
                return Err(ModelError::config(path, &name("mrope_interleaved"), format!("expected a bool, got {v}")))
            }
        };
        let Some(section) = block.remove("mrope_section") else { continue };
        let parts: Option<Vec<i64>> = section.as_array().map(|a| a.iter().filter_map(Value::as_i64).collect());
        return match parts.as_deref() {
            Some(&[t, h, w]) if t >= 0 && h >= 0 && w >= 0 => Ok(Some(Mrope { section: [t, h, w], interleaved })),
            _ => Err(ModelError::config(
                path,
                &name("mrope_section"),
                format!("expected three non-negative frequency counts, got {section}"),
            )),
        };
    }
    Ok(None)
}

/// The Qwen2.5-VL vision tower (`vision_config`, transformers' `Qwen2_5_VLVisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub in_channels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub spatial_merge_size: i64,
    /// Window of the windowed-attention blocks, in pixels (112: 8 patches of 14, 4 merged tokens).
    pub window_size: i64,
    /// The blocks that attend over the whole image instead of windows.
    pub fullatt_blocks: Vec<i64>,
    /// Width of the merged features: the language model's hidden size.
    pub out_hidden_size: i64,
    pub activation: Activation,
    /// Base of the tower's 2-D rotary frequencies.
    pub rope_theta: f64,
    /// The placeholder token of an image's features in the text (`<|image_pad|>`).
    pub image_token_id: i64,
    /// The placeholder of a video's features, refused in prompts (videos are not read).
    pub video_token_id: i64,
    /// The tokens around an image's placeholders (`<|vision_start|>`, `<|vision_end|>`).
    pub vision_start_token_id: i64,
    pub vision_end_token_id: i64,
}

impl VisionConfig {
    /// Width of one patch row of `pixel_values`: channels × temporal patch × patch².
    pub fn patch_dim(&self) -> i64 {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Head size of the tower's attention.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_heads
    }
}

/// The keys of `vision_config` this loader implements (with the old spellings of the Hub's
/// first Qwen2.5-VL configs: `in_chans`, `spatial_patch_size`).
const VISION_KEYS: &[&str] = &[
    "depth",
    "num_hidden_layers",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "num_attention_heads",
    "in_channels",
    "in_chans",
    "patch_size",
    "spatial_patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "window_size",
    "fullatt_block_indexes",
    "out_hidden_size",
    "rope_parameters",
    // Video only (the spacing of frames in time), which is not read.
    "tokens_per_second",
];

/// Reads `vision_config` of `top` (the checkpoint's `config.json`) for Qwen2.5-VL, with
/// transformers' defaults, and the image and video token ids of the top level.
pub(crate) fn qwen2_5_vl(path: &Path, top: &Map<String, Value>) -> Result<VisionConfig> {
    let v = top.get("vision_config").and_then(Value::as_object).ok_or_else(|| {
        ModelError::config(path, "vision_config", "missing: the vision tower's keys are not in this config")
    })?;
    let key = |k: &str| format!("vision_config.{k}");
    if let Some(bad) = v.keys().find(|k| !VISION_KEYS.contains(&k.as_str()) && !keys::INERT.contains(&k.as_str())) {
        return Err(ModelError::config(
            path,
            &key(bad),
            "not a vision key this loader implements (refused rather than ignored)",
        ));
    }
    let int = |names: &[&str], default: i64| -> Result<i64> {
        for n in names {
            match v.get(*n) {
                None | Some(Value::Null) => continue,
                Some(x) => {
                    return match x.as_i64() {
                        Some(i) if i > 0 => Ok(i),
                        _ => Err(ModelError::config(path, &key(n), format!("expected a positive integer, got {x}"))),
                    }
                }
            }
        }
        Ok(default)
    };
    let top_int = |n: &str, default: i64| -> Result<i64> {
        match top.get(n) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_i64()
                .filter(|i| *i >= 0)
                .ok_or_else(|| ModelError::config(path, n, format!("expected a token id, got {x}"))),
        }
    };
    let cfg = VisionConfig {
        depth: int(&["depth", "num_hidden_layers"], 32)?,
        hidden_size: int(&["hidden_size"], 3584)?,
        intermediate_size: int(&["intermediate_size"], 3420)?,
        num_heads: int(&["num_heads", "num_attention_heads"], 16)?,
        in_channels: int(&["in_channels", "in_chans"], 3)?,
        patch_size: int(&["patch_size", "spatial_patch_size"], 14)?,
        temporal_patch_size: int(&["temporal_patch_size"], 2)?,
        spatial_merge_size: int(&["spatial_merge_size"], 2)?,
        window_size: int(&["window_size"], 112)?,
        fullatt_blocks: match v.get("fullatt_block_indexes") {
            None | Some(Value::Null) => vec![7, 15, 23, 31],
            Some(x) => x.as_array().and_then(|a| a.iter().map(Value::as_i64).collect()).ok_or_else(|| {
                ModelError::config(path, &key("fullatt_block_indexes"), format!("expected block indices, got {x}"))
            })?,
        },
        out_hidden_size: int(&["out_hidden_size"], 3584)?,
        activation: match v.get("hidden_act").and_then(Value::as_str) {
            None => Activation::Silu,
            Some(name) => activation(path, &key("hidden_act"), name)?,
        },
        rope_theta: vision_rope_theta(path, v)?,
        image_token_id: top_int("image_token_id", 151655)?,
        video_token_id: top_int("video_token_id", 151656)?,
        vision_start_token_id: top_int("vision_start_token_id", 151652)?,
        vision_end_token_id: top_int("vision_end_token_id", 151653)?,
    };
    if cfg.hidden_size % cfg.num_heads != 0 || cfg.head_dim() % 4 != 0 {
        return Err(ModelError::config(
            path,
            &key("num_heads"),
            format!(
                "hidden_size {} over {} heads must give a head size divisible by 4",
                cfg.hidden_size, cfg.num_heads
            ),
        ));
    }
    let merged_window = cfg.spatial_merge_size * cfg.patch_size;
    if cfg.window_size < merged_window {
        return Err(ModelError::config(
            path,
            &key("window_size"),
            format!("{} is smaller than one merged patch ({merged_window} pixels)", cfg.window_size),
        ));
    }
    Ok(cfg)
}

/// The tower's rotary base: `rope_parameters.rope_theta` (10000 by default), of type `axial`.
fn vision_rope_theta(path: &Path, v: &Map<String, Value>) -> Result<f64> {
    let Some(block) = v.get("rope_parameters").filter(|b| !b.is_null()) else { return Ok(10_000.0) };
    let name = |k: &str| format!("vision_config.rope_parameters.{k}");
    let obj = block.as_object().ok_or_else(|| {
        ModelError::config(path, "vision_config.rope_parameters", format!("expected an object, got {block}"))
    })?;
    if let Some(bad) = obj.keys().find(|k| !["rope_type", "type", "rope_theta"].contains(&k.as_str())) {
        return Err(ModelError::config(path, &name(bad), "not a rotary parameter of the vision tower"));
    }
    match obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str) {
        None | Some("axial") | Some("default") => {}
        Some(other) => {
            return Err(ModelError::config(path, &name("rope_type"), format!("`{other}` (expected `axial`)")))
        }
    }
    match obj.get("rope_theta") {
        None => Ok(10_000.0),
        Some(t) => t.as_f64().filter(|t| t.is_finite() && *t > 0.0).ok_or_else(|| {
            ModelError::config(path, &name("rope_theta"), format!("must be a positive number, got {t}"))
        }),
    }
}
