//! Images of prompt rows (see [`rlhf_vision::prompt`]): read from a row's `images` field and its
//! chat messages' image parts when the data is parsed, then — for a model that reads images —
//! decoded to learn each image's grid, and the prompt's `<image>` markers turned into the model's
//! placeholders, one per merged patch, as transformers' processor does.

use std::path::Path;

use rlhf_models::ArchConfig;
use rlhf_tokenizer::HfTokenizer;
use rlhf_vision::prompt::{expand_placeholders, flatten_content, images_of, place_markers};
use rlhf_vision::{ImageRef, QwenVlProcessor};
use serde_json::{Map, Value};

use crate::error::{Result, TrainerError};

/// The row's `images` field, checked and with relative paths resolved from `base` (the data
/// file's directory), written back as absolute path strings (bytes kept as they are); chat
/// messages' content parts flattened to text with `<image>` markers.
pub(crate) fn normalize_row(obj: &mut Map<String, Value>, base: &Path, at: &str) -> std::result::Result<(), String> {
    if let Some(v) = obj.get_mut("images") {
        let refs = images_of(v, base, at)?;
        if let Value::Array(items) = v {
            for (item, r) in items.iter_mut().zip(&refs) {
                if let ImageRef::Path(p) = r {
                    *item = Value::String(p.display().to_string());
                }
            }
        }
    }
    let has_images = obj.get("images").is_some_and(|v| !v.is_null());
    for key in ["messages", "prompt"] {
        let Some(Value::Array(messages)) = obj.get_mut(key) else { continue };
        for (i, m) in messages.iter_mut().enumerate() {
            let Some(content) = m.get_mut("content").filter(|c| c.is_array()) else { continue };
            let text = flatten_content(content)
                .ok_or_else(|| format!("{at}: {key}[{i}].content: parts must be `text` or `image` (got {content})"))?;
            if !has_images && text.contains(rlhf_vision::prompt::IMAGE_MARKER) {
                return Err(format!("{at}: {key}[{i}].content: an image part, and the row has no `images`"));
            }
            *content = Value::String(text);
        }
    }
    Ok(())
}

/// Takes a row's images out of its metadata (the row was [`normalize_row`]ed), leaving their names
/// (paths, or `row N image i` for bytes) under `images` for the rewards.
pub(crate) fn take_images(metadata: &mut Value, at: &str) -> Result<Vec<ImageRef>> {
    let Some(v) = metadata.get_mut("images") else { return Ok(Vec::new()) };
    let refs = images_of(v, Path::new("/"), at).map_err(TrainerError::Run)?;
    *v = Value::Array(refs.iter().map(|r| Value::String(r.name())).collect());
    Ok(refs)
}

/// How a model that reads images wants them in its prompts.
#[derive(Debug, Clone)]
pub struct PromptImages {
    processor: QwenVlProcessor,
    /// What replaces an `<image>` marker in the rendered prompt.
    sequence: String,
    /// The placeholder token repeated once per merged patch.
    placeholder: u32,
    merge: usize,
}

impl PromptImages {
    /// For a model of `arch` loaded from `dir` that reads images: its processor
    /// (`preprocessor_config.json`, else Qwen-VL's defaults) and placeholder tokens; `None` for a
    /// model that reads none.
    pub fn for_model(dir: &Path, arch: &ArchConfig, tok: &HfTokenizer) -> Result<Option<Self>> {
        let Some(v) = &arch.vision else { return Ok(None) };
        let file = dir.join("preprocessor_config.json");
        let processor = if file.exists() {
            QwenVlProcessor::from_file(&file).map_err(|e| TrainerError::Run(e.to_string()))?
        } else {
            QwenVlProcessor::default()
        };
        let (p, m, t) = (v.patch_size as usize, v.spatial_merge_size as usize, v.temporal_patch_size as usize);
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (p, m, t) {
            return Err(TrainerError::Run(format!(
                "{}: patch_size {}, merge_size {} and temporal_patch_size {} differ from the vision tower's {p}, {m}, {t}",
                file.display(),
                processor.patch_size,
                processor.merge_size,
                processor.temporal_patch_size
            )));
        }
        let token = |id: i64| {
            u32::try_from(id).ok().and_then(|id| tok.id_to_token(id).map(|t| (id, t))).ok_or_else(|| {
                TrainerError::Run(format!("{}: token {id} of the vision config is not in the tokenizer", dir.display()))
            })
        };
        let (placeholder, pad) = token(v.image_token_id)?;
        let merge = m;
        let sequence = format!("{}{pad}{}", token(v.vision_start_token_id)?.1, token(v.vision_end_token_id)?.1);
        Ok(Some(PromptImages { processor, sequence, placeholder, merge }))
    }

    /// The token each merged patch of an image takes in the ids.
    pub fn placeholder(&self) -> u32 {
        self.placeholder
    }

    /// The processor turning the images into patches.
    pub fn processor(&self) -> &QwenVlProcessor {
        &self.processor
    }

    /// The patches of `images` for the model ([`rlhf_models::Images`]), in order.
    pub fn patches(&self, images: &[ImageRef]) -> Result<rlhf_models::Images> {
        let (mut rows, mut grids) = (Vec::with_capacity(images.len()), Vec::with_capacity(images.len()));
        for image in images {
            let name = image.name();
            let decoded = image.load().map_err(|e| TrainerError::Run(e.to_string()))?;
            let p = self.processor.preprocess(&decoded, &name).map_err(|e| TrainerError::Run(e.to_string()))?;
            rows.push(tch::Tensor::f_from_slice(&p.values)?.f_view([p.len() as i64, p.dim as i64])?);
            grids.push(p.grid.map(|g| g as i64));
        }
        let dim =
            (3 * self.processor.temporal_patch_size * self.processor.patch_size * self.processor.patch_size) as i64;
        let pixel_values = match rows.is_empty() {
            true => tch::Tensor::f_zeros([0, dim], (tch::Kind::Float, tch::Device::Cpu))?,
            false => tch::Tensor::f_cat(&rows, 0)?,
        };
        Ok(rlhf_models::Images::new(pixel_values, grids))
    }

    /// The rendered `text` with its markers replaced and its `ids` (tokenized from that text)
    /// with each placeholder repeated once per merged patch of its image; also each image's grid.
    /// Every image is decoded here, so a missing or corrupt one fails before training starts.
    pub fn expand(
        &self,
        text: &str,
        tok: &HfTokenizer,
        add_special: bool,
        images: &[ImageRef],
        at: &str,
    ) -> Result<(String, Vec<u32>, Vec<[usize; 3]>)> {
        let mut grids = Vec::with_capacity(images.len());
        for image in images {
            let name = image.name();
            let decoded = image.load().map_err(|e| TrainerError::Run(format!("{at}: {e}")))?;
            let grid = self.processor.grid(decoded.height, decoded.width, &name);
            grids.push(grid.map_err(|e| TrainerError::Run(format!("{at}: {e}")))?);
        }
        let (text, ids) = self.expand_grids(text, tok, add_special, &grids, at)?;
        Ok((text, ids, grids))
    }

    /// [`PromptImages::expand`] for images whose grids are known (already patched).
    pub fn expand_grids(
        &self,
        text: &str,
        tok: &HfTokenizer,
        add_special: bool,
        grids: &[[usize; 3]],
        at: &str,
    ) -> Result<(String, Vec<u32>)> {
        let text = place_markers(text, grids.len(), &self.sequence, at).map_err(TrainerError::Run)?;
        let ids = tok.encode(&text, add_special)?;
        let tokens: Vec<usize> = grids.iter().map(|g| g[0] * g[1] * g[2] / (self.merge * self.merge)).collect();
        let ids = expand_placeholders(&ids, self.placeholder, &tokens, at).map_err(TrainerError::Run)?;
        Ok((text, ids))
    }
}
