//! The Qwen-VL image processor (transformers' `Qwen2VLImageProcessor`, used by Qwen2-VL,
//! Qwen2.5-VL, Qwen3-VL and Qwen3.5): each image resized to a multiple of `patch_size ·
//! merge_size` on both sides with its pixel count within `[min_pixels, max_pixels]`
//! ([`smart_resize`]), rescaled to `[0, 1]`, normalised per channel, and cut into
//! `patch_size²` patches repeated `temporal_patch_size` times (a still image is one frame of a
//! video), ordered so that each `merge_size × merge_size` block of patches is contiguous — the
//! rows the vision tower's patch merger folds into one token.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, VisionError};
use crate::load::RgbImage;
use crate::resample::{resize, Filter};

/// CLIP's channel means and deviations, Qwen2-VL's and Qwen2.5-VL's defaults.
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The processor's settings (`preprocessor_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct QwenVlProcessor {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub filter: Filter,
}

impl Default for QwenVlProcessor {
    /// transformers' defaults: 56² to 28² · 1280 pixels, patches of 14, 2 frames, 2 × 2 merged,
    /// CLIP's statistics, bicubic.
    fn default() -> Self {
        QwenVlProcessor {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            mean: CLIP_MEAN.map(|v| v as f32),
            std: CLIP_STD.map(|v| v as f32),
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
            filter: Filter::Bicubic,
        }
    }
}

/// One image's patches: `values` is `[patches, dim]` row-major, `dim = 3 · temporal · patch²`;
/// `grid` is `[t, h, w]` in patches (transformers' `image_grid_thw`).
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    pub values: Vec<f32>,
    pub dim: usize,
    pub grid: [usize; 3],
}

impl Patches {
    /// Number of patches (`t · h · w`).
    pub fn len(&self) -> usize {
        self.grid.iter().product()
    }

    /// Whether there are none (never, for a processed image).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens the image takes in the prompt after the merger: `len / merge²`.
    pub fn tokens(&self, merge_size: usize) -> usize {
        self.len() / (merge_size * merge_size)
    }
}

/// transformers' `smart_resize`: the size nearest `height × width` with both sides multiples of
/// `factor` and the area within `[min_pixels, max_pixels]`, keeping the aspect ratio; `Err` with
/// the reason for an aspect ratio above 200.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> std::result::Result<(usize, usize), String> {
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(format!("absolute aspect ratio must be smaller than 200, got {ratio}"));
    }
    // Python's `round` rounds halves to even.
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

impl QwenVlProcessor {
    /// Reads `preprocessor_config.json` (transformers' keys: `min_pixels`/`max_pixels` or
    /// `size.shortest_edge`/`size.longest_edge`, `patch_size`, `temporal_patch_size`,
    /// `merge_size`, `image_mean`, `image_std`, `rescale_factor`, `do_*`, `resample`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|source| VisionError::Io { path: path.to_path_buf(), source })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| VisionError::Config {
            path: path.to_path_buf(),
            key: "(file)".into(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_value(path, &value)
    }

    /// [`QwenVlProcessor::from_file`] of parsed JSON (`path` for errors).
    pub fn from_value(path: &Path, v: &Value) -> Result<Self> {
        let err =
            |key: &str, message: String| VisionError::Config { path: path.to_path_buf(), key: key.into(), message };
        let mut p = QwenVlProcessor::default();
        let uint = |key: &str, v: Option<&Value>| -> Result<Option<usize>> {
            match v {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| err(key, format!("expected a positive integer, got {x}"))),
            }
        };
        let size = v.get("size");
        if let Some(n) = uint("size.shortest_edge", size.and_then(|s| s.get("shortest_edge")))? {
            p.min_pixels = n;
        }
        if let Some(n) = uint("size.longest_edge", size.and_then(|s| s.get("longest_edge")))? {
            p.max_pixels = n;
        }
        if let Some(n) = uint("min_pixels", v.get("min_pixels"))? {
            p.min_pixels = n;
        }
        if let Some(n) = uint("max_pixels", v.get("max_pixels"))? {
            p.max_pixels = n;
        }
        for (key, field) in [
            ("patch_size", &mut p.patch_size),
            ("temporal_patch_size", &mut p.temporal_patch_size),
            ("merge_size", &mut p.merge_size),
        ] {
            if let Some(n) = uint(key, v.get(key))? {
                *field = n;
            }
        }
        let triple = |key: &str| -> Result<Option<[f32; 3]>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => {
                    let items: Option<Vec<f64>> = x.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect());
                    match items {
                        Some(a) if a.len() == 3 => Ok(Some([a[0] as f32, a[1] as f32, a[2] as f32])),
                        _ => Err(err(key, format!("expected three numbers, got {x}"))),
                    }
                }
            }
        };
        if let Some(m) = triple("image_mean")? {
            p.mean = m;
        }
        if let Some(s) = triple("image_std")? {
            if s.contains(&0.0) {
                return Err(err("image_std", "must not be zero".into()));
            }
            p.std = s;
        }
        if let Some(r) = v.get("rescale_factor").filter(|x| !x.is_null()) {
            p.rescale_factor =
                r.as_f64().ok_or_else(|| err("rescale_factor", format!("expected a number, got {r}")))?;
        }
        for (key, field) in
            [("do_resize", &mut p.do_resize), ("do_rescale", &mut p.do_rescale), ("do_normalize", &mut p.do_normalize)]
        {
            if let Some(b) = v.get(key).filter(|x| !x.is_null()) {
                *field = b.as_bool().ok_or_else(|| err(key, format!("expected true or false, got {b}")))?;
            }
        }
        p.filter = match v.get("resample").and_then(Value::as_u64) {
            None | Some(3) => Filter::Bicubic,
            Some(2) => Filter::Bilinear,
            Some(other) => {
                return Err(err("resample", format!("{other}: only 2 (bilinear) and 3 (bicubic) are implemented")))
            }
        };
        // Sizes beyond any released processor's would only make a patch row or an image too large
        // to allocate: refused by name.
        for (key, value, limit) in [
            ("patch_size", p.patch_size, 64),
            ("temporal_patch_size", p.temporal_patch_size, 16),
            ("merge_size", p.merge_size, 8),
            ("max_pixels", p.max_pixels, crate::load::MAX_PIXELS as usize),
        ] {
            if value > limit {
                return Err(err(key, format!("{value} is beyond what this processor accepts (at most {limit})")));
            }
        }
        if p.min_pixels > p.max_pixels {
            return Err(err("size", format!("min_pixels {} exceeds max_pixels {}", p.min_pixels, p.max_pixels)));
        }
        Ok(p)
    }

    /// The side lengths a multiple of: `patch_size · merge_size`.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// The size (height, width) an image of `height × width` is processed at: `smart_resize`'s, or
    /// its own without `do_resize`; checked to be whole merged patches.
    fn target_size(&self, height: usize, width: usize, name: &str) -> Result<(usize, usize)> {
        let size_err = |message: String| VisionError::Size { source_name: name.to_string(), message };
        let (h, w) = if self.do_resize {
            smart_resize(height, width, self.factor(), self.min_pixels, self.max_pixels).map_err(size_err)?
        } else {
            (height, width)
        };
        if h % self.factor() != 0 || w % self.factor() != 0 {
            return Err(size_err(format!("{w}×{h} is not a multiple of {} on both sides", self.factor())));
        }
        Ok((h, w))
    }

    /// The grid `[1, h, w]` in patches of an image of `height × width`, as [`Self::preprocess`]
    /// gives it, without computing the patches.
    pub fn grid(&self, height: usize, width: usize, name: &str) -> Result<[usize; 3]> {
        let (h, w) = self.target_size(height, width, name)?;
        Ok([1, h / self.patch_size, w / self.patch_size])
    }

    /// The patches of `image` (`name` for errors): resized, rescaled, normalised, patchified.
    pub fn preprocess(&self, image: &RgbImage, name: &str) -> Result<Patches> {
        let (h, w) = self.target_size(image.height, image.width, name)?;
        let image =
            if (h, w) == (image.height, image.width) { image.clone() } else { resize(image, w, h, self.filter) };
        let (h, w, p, m, t) = (image.height, image.width, self.patch_size, self.merge_size, self.temporal_patch_size);
        // Per channel, as transformers: `u8 · rescale` in f64 cast to f32, then `(x − mean) / std` in f32.
        let value = |byte: u8, c: usize| -> f32 {
            let mut x = if self.do_rescale { (f64::from(byte) * self.rescale_factor) as f32 } else { f32::from(byte) };
            if self.do_normalize {
                x = (x - self.mean[c]) / self.std[c];
            }
            x
        };
        let (gh, gw) = (h / p, w / p);
        let dim = 3 * t * p * p;
        let mut values = Vec::with_capacity(gh * gw * dim);
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for py in 0..p {
                                    for px in 0..p {
                                        values.push(value(image.data[((y0 + py) * w + x0 + px) * 3 + c], c));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Patches { values, dim, grid: [1, gh, gw] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_transformers_by_hand() {
        // 448 × 448 is already a multiple of 28 within range.
        assert_eq!(smart_resize(448, 448, 28, 3136, 1_003_520), Ok((448, 448)));
        // round(100 / 28) = 4 (3.57); round(42 / 28) = 2 (1.5 rounds to even).
        assert_eq!(smart_resize(100, 42, 28, 56, 1_003_520), Ok((112, 56)));
        // Too small: scaled up to at least min_pixels.
        assert_eq!(smart_resize(20, 20, 28, 3136, 1_003_520), Ok((56, 56)));
        // Too large: scaled down under max_pixels.
        let (h, w) = smart_resize(4000, 3000, 28, 3136, 1_003_520).unwrap();
        assert!(h * w <= 1_003_520 && h % 28 == 0 && w % 28 == 0, "{h}x{w}");
        assert!(smart_resize(10, 2100, 28, 3136, 1_003_520).unwrap_err().contains("aspect ratio"));
    }

    #[test]
    fn absurd_sizes_are_refused_by_key() {
        let path = Path::new("preprocessor_config.json");
        for (json, key) in [
            (r#"{"patch_size": 1099511627776}"#, "patch_size: 1099511627776 is beyond"),
            (r#"{"merge_size": 1000}"#, "merge_size: 1000 is beyond"),
            (r#"{"max_pixels": 1e30}"#, "max_pixels: expected a positive integer"),
            (r#"{"size": {"shortest_edge": 5000, "longest_edge": 4000}}"#, "size: min_pixels 5000 exceeds"),
            (r#"{"image_std": [1, 0, 1]}"#, "image_std: must not be zero"),
            (r#"{"resample": 1}"#, "resample: 1: only"),
        ] {
            let v: Value = serde_json::from_str(json).unwrap();
            let e = QwenVlProcessor::from_value(path, &v).unwrap_err().to_string();
            assert!(e.contains(key), "{json}: {e}");
        }
    }
}
