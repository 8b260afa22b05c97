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

/// Which vision tower a checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TowerKind {
    /// Qwen2.5-VL: RMSNorm, SwiGLU, window attention ([`crate::vision_tower`]).
    Qwen2_5,
    /// Qwen3-VL and Qwen3.5: LayerNorm, a GELU MLP, a learned position grid resampled to each
    /// image, attention over the whole image, deep-stack features ([`crate::vision_tower3`]).
    Qwen3,
}

/// A Qwen-VL vision tower (`vision_config`, transformers' `Qwen2_5_VLVisionConfig`,
/// `Qwen3VLVisionConfig`, `Qwen3_5VisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub kind: TowerKind,
    pub depth: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_heads: i64,
    pub in_channels: i64,
    pub patch_size: i64,
    pub temporal_patch_size: i64,
    pub spatial_merge_size: i64,
    /// Qwen2.5-VL: window of the windowed-attention blocks, in pixels (112: 8 patches of 14, 4
    /// merged tokens).
    pub window_size: i64,
    /// Qwen2.5-VL: the blocks that attend over the whole image instead of windows.
    pub fullatt_blocks: Vec<i64>,
    /// Qwen3-VL, Qwen3.5: rows of the learned position table, a square grid.
    pub num_position_embeddings: i64,
    /// Qwen3-VL: the blocks whose output a deep-stack merger adds to the language model's first
    /// layers, in order (layer `j` takes block `deepstack_blocks[j]`'s).
    pub deepstack_blocks: Vec<i64>,
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

/// The keys of Qwen2.5-VL's `vision_config` this loader implements (with the old spellings of the
/// Hub's first Qwen2.5-VL configs: `in_chans`, `spatial_patch_size`).
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

/// The keys of Qwen3-VL's and Qwen3.5's `vision_config` (Qwen3.5's has no deep stack).
const VISION3_KEYS: &[&str] = &[
    "depth",
    "num_hidden_layers",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "num_attention_heads",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "out_hidden_size",
    "num_position_embeddings",
    "rope_parameters",
    "deepstack_visual_indexes",
];

/// Reads `vision_config` of a checkpoint's top level, and the placeholder token ids beside it.
struct Reader<'a> {
    path: &'a Path,
    top: &'a Map<String, Value>,
    v: &'a Map<String, Value>,
}

/// Largest value of a `vision_config` size. The tower multiplies up to four of them (channels ×
/// temporal patch × patch², hidden × merge²), so each is bounded for the products to fit in an
/// i64; real checkpoints reach 8,192 at most (Qwen2.5-VL-72B's `out_hidden_size`).
const MAX_VISION_SIZE: i64 = 1 << 15;

impl<'a> Reader<'a> {
    /// The `vision_config` of `top`, every key of it in `implemented` or inert.
    fn new(path: &'a Path, top: &'a Map<String, Value>, implemented: &[&str]) -> Result<Self> {
        let v = top.get("vision_config").and_then(Value::as_object).ok_or_else(|| {
            ModelError::config(path, "vision_config", "missing: the vision tower's keys are not in this config")
        })?;
        if let Some(bad) = v.keys().find(|k| !implemented.contains(&k.as_str()) && !keys::INERT.contains(&k.as_str())) {
            return Err(ModelError::config(
                path,
                &format!("vision_config.{bad}"),
                "not a vision key this loader implements (refused rather than ignored)",
            ));
        }
        Ok(Reader { path, top, v })
    }

    /// The first of `names` present, a positive integer of at most [`MAX_VISION_SIZE`], else
    /// `default`.
    fn int(&self, names: &[&str], default: i64) -> Result<i64> {
        for n in names {
            match self.v.get(*n) {
                None | Some(Value::Null) => continue,
                Some(x) => {
                    return match x.as_i64() {
                        Some(i) if i > 0 && i <= MAX_VISION_SIZE => Ok(i),
                        _ => Err(ModelError::config(
                            self.path,
                            &format!("vision_config.{n}"),
                            format!("expected a positive integer of at most {MAX_VISION_SIZE}, got {x}"),
                        )),
                    }
                }
            }
        }
        Ok(default)
    }

    /// A list of block indices (`default` when absent), each below `depth`.
    fn blocks(&self, name: &str, default: &[i64], depth: i64) -> Result<Vec<i64>> {
        let key = format!("vision_config.{name}");
        let list = match self.v.get(name) {
            None | Some(Value::Null) => default.to_vec(),
            Some(x) => x
                .as_array()
                .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<i64>>>())
                .ok_or_else(|| ModelError::config(self.path, &key, format!("expected block indices, got {x}")))?,
        };
        if let Some(bad) = list.iter().find(|&&b| b < 0 || b >= depth) {
            return Err(ModelError::config(self.path, &key, format!("block {bad} of a tower of {depth}")));
        }
        Ok(list)
    }

    /// A top-level token id, else `default`.
    fn token(&self, n: &str, default: i64) -> Result<i64> {
        match self.top.get(n) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_i64()
                .filter(|i| *i >= 0)
                .ok_or_else(|| ModelError::config(self.path, n, format!("expected a token id, got {x}"))),
        }
    }

    fn activation(&self, default: Activation) -> Result<Activation> {
        match self.v.get("hidden_act").and_then(Value::as_str) {
            None => Ok(default),
            Some(name) => activation(self.path, "vision_config.hidden_act", name),
        }
    }

    /// The placeholder tokens: `[image, video, start, end]`'s defaults.
    fn tokens(&self, cfg: &mut VisionConfig, defaults: [i64; 4]) -> Result<()> {
        cfg.image_token_id = self.token("image_token_id", defaults[0])?;
        cfg.video_token_id = self.token("video_token_id", defaults[1])?;
        cfg.vision_start_token_id = self.token("vision_start_token_id", defaults[2])?;
        cfg.vision_end_token_id = self.token("vision_end_token_id", defaults[3])?;
        Ok(())
    }

    /// Heads that split the width into head sizes divisible by 4 (the 2-D rotary's halves).
    fn check_heads(&self, cfg: &VisionConfig) -> Result<()> {
        if cfg.hidden_size % cfg.num_heads != 0 || cfg.head_dim() % 4 != 0 {
            return Err(ModelError::config(
                self.path,
                "vision_config.num_heads",
                format!(
                    "hidden_size {} over {} heads must give a head size divisible by 4",
                    cfg.hidden_size, cfg.num_heads
                ),
            ));
        }
        Ok(())
    }
}

/// Qwen-VL's placeholder tokens (`<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`,
/// `<|vision_end|>`) in Qwen2.5's and Qwen3's vocabulary.
const QWEN_TOKENS: [i64; 4] = [151655, 151656, 151652, 151653];

/// Reads `vision_config` of `top` (the checkpoint's `config.json`) for Qwen2.5-VL, with
/// transformers' defaults, and the image and video token ids of the top level.
pub(crate) fn qwen2_5_vl(path: &Path, top: &Map<String, Value>) -> Result<VisionConfig> {
    let r = Reader::new(path, top, VISION_KEYS)?;
    let depth = r.int(&["depth", "num_hidden_layers"], 32)?;
    let mut cfg = VisionConfig {
        kind: TowerKind::Qwen2_5,
        depth,
        hidden_size: r.int(&["hidden_size"], 3584)?,
        intermediate_size: r.int(&["intermediate_size"], 3420)?,
        num_heads: r.int(&["num_heads", "num_attention_heads"], 16)?,
        in_channels: r.int(&["in_channels", "in_chans"], 3)?,
        patch_size: r.int(&["patch_size", "spatial_patch_size"], 14)?,
        temporal_patch_size: r.int(&["temporal_patch_size"], 2)?,
        spatial_merge_size: r.int(&["spatial_merge_size"], 2)?,
        window_size: r.int(&["window_size"], 112)?,
        fullatt_blocks: r.blocks("fullatt_block_indexes", &[7, 15, 23, 31], i64::MAX)?,
        num_position_embeddings: 0,
        deepstack_blocks: Vec::new(),
        out_hidden_size: r.int(&["out_hidden_size"], 3584)?,
        activation: r.activation(Activation::Silu)?,
        rope_theta: vision_rope_theta(path, r.v)?,
        image_token_id: 0,
        video_token_id: 0,
        vision_start_token_id: 0,
        vision_end_token_id: 0,
    };
    r.tokens(&mut cfg, QWEN_TOKENS)?;
    r.check_heads(&cfg)?;
    let merged_window = cfg.spatial_merge_size * cfg.patch_size;
    if cfg.window_size < merged_window {
        return Err(ModelError::config(
            path,
            "vision_config.window_size",
            format!("{} is smaller than one merged patch ({merged_window} pixels)", cfg.window_size),
        ));
    }
    Ok(cfg)
}

/// Reads `vision_config` of a Qwen3-VL checkpoint (with its deep stack).
pub(crate) fn qwen3_vl(path: &Path, top: &Map<String, Value>) -> Result<VisionConfig> {
    qwen3_tower(path, top, true, QWEN_TOKENS)
}

/// Reads `vision_config` of a Qwen3.5 checkpoint: Qwen3-VL's tower without the deep stack, and
/// Qwen3.5's vocabulary's placeholder tokens.
pub(crate) fn qwen3_5(path: &Path, top: &Map<String, Value>) -> Result<VisionConfig> {
    qwen3_tower(path, top, false, [248056, 248057, 248053, 248054])
}

/// The Qwen3-VL tower with transformers' defaults; `deepstack` says whether the family has one.
fn qwen3_tower(path: &Path, top: &Map<String, Value>, deepstack: bool, tokens: [i64; 4]) -> Result<VisionConfig> {
    let keys = match deepstack {
        true => VISION3_KEYS,
        false => &VISION3_KEYS[..VISION3_KEYS.len() - 1],
    };
    let r = Reader::new(path, top, keys)?;
    let depth = r.int(&["depth", "num_hidden_layers"], 27)?;
    let mut cfg = VisionConfig {
        kind: TowerKind::Qwen3,
        depth,
        hidden_size: r.int(&["hidden_size"], 1152)?,
        intermediate_size: r.int(&["intermediate_size"], 4304)?,
        num_heads: r.int(&["num_heads", "num_attention_heads"], 16)?,
        in_channels: r.int(&["in_channels"], 3)?,
        patch_size: r.int(&["patch_size"], 16)?,
        temporal_patch_size: r.int(&["temporal_patch_size"], 2)?,
        spatial_merge_size: r.int(&["spatial_merge_size"], 2)?,
        window_size: 0,
        fullatt_blocks: Vec::new(),
        num_position_embeddings: r.int(&["num_position_embeddings"], 2304)?,
        deepstack_blocks: match deepstack {
            true => r.blocks("deepstack_visual_indexes", &[8, 16, 24], depth)?,
            false => Vec::new(),
        },
        out_hidden_size: r.int(&["out_hidden_size"], 3584)?,
        activation: r.activation(Activation::GeluTanh)?,
        rope_theta: vision_rope_theta(path, r.v)?,
        image_token_id: 0,
        video_token_id: 0,
        vision_start_token_id: 0,
        vision_end_token_id: 0,
    };
    r.tokens(&mut cfg, tokens)?;
    r.check_heads(&cfg)?;
    let side = (cfg.num_position_embeddings as f64).sqrt() as i64;
    if side * side != cfg.num_position_embeddings {
        return Err(ModelError::config(
            path,
            "vision_config.num_position_embeddings",
            format!("{} is not a square grid of positions", cfg.num_position_embeddings),
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
