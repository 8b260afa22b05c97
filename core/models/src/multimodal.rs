//! Images in a causal language model's input (vision-language checkpoints, today Qwen2.5-VL):
//! the vision tower's features ([`CausalLm::visual`]) replace the image placeholders of
//! the prompt's token embeddings, and the tokens take the multimodal RoPE's 3-D positions
//! ([`CausalLm::image_positions`]); generation continues each row from its delta
//! (`position + delta` on all three axes).

use tch::{Kind, Tensor};

use crate::backbone::Routing;
use crate::checkpointing::{self, Checkpointed};
use crate::error::{ModelError, Result};
use crate::layers::KvCache;
use crate::model::{check_ids, CausalLm};
use crate::vision_tower::{TowerOutput, VisionTower};

pub use crate::visual_input::{Slots, Visual};

/// Images of a batch as the processor makes them: every image's patch rows one after another, in
/// the order their placeholders appear (row by row), and each image's grid; and, where a frozen
/// tower already ran on them ([`CausalLm::with_features`]), each image's features, which a pass
/// then takes instead of running the tower again.
#[derive(Debug)]
pub struct Images {
    /// `[patches, channels · temporal_patch · patch²]`
    pub pixel_values: Tensor,
    /// `[t, h, w]` in patches, per image.
    pub grids: Vec<[i64; 3]>,
    /// One per image, when computed.
    pub features: Option<Vec<TowerOutput>>,
}

impl Images {
    /// The processor's patches and grids, no features yet.
    pub fn new(pixel_values: Tensor, grids: Vec<[i64; 3]>) -> Images {
        Images { pixel_values, grids, features: None }
    }

    /// The same patches without their features (for a model whose tower differs).
    pub fn without_features(&self) -> Images {
        Images::new(self.pixel_values.shallow_clone(), self.grids.clone())
    }

    /// Patch rows (`t · h · w`) of each image.
    fn patch_counts(&self) -> Vec<i64> {
        self.grids.iter().map(|g| g[0] * g[1] * g[2]).collect()
    }

    /// The same images, sharing the patches' storage.
    pub fn shallow_clone(&self) -> Images {
        let features = self.features.as_ref().map(|f| f.iter().map(TowerOutput::shallow_clone).collect());
        Images { pixel_values: self.pixel_values.shallow_clone(), grids: self.grids.clone(), features }
    }

    /// No image (a batch of text rows that must still take the image path, see
    /// [`CausalLm::visual`]).
    pub fn none() -> Images {
        Images::new(Tensor::zeros([0, 0], (Kind::Float, tch::Device::Cpu)), Vec::new())
    }

    /// The images of `parts` one after another (with their features where every part has them);
    /// `None` when they hold no image.
    pub fn concat(parts: &[&Images]) -> Result<Option<Images>> {
        let grids: Vec<[i64; 3]> = parts.iter().flat_map(|i| i.grids.iter().copied()).collect();
        let rows: Vec<&Tensor> = parts.iter().map(|i| &i.pixel_values).filter(|t| t.size()[0] > 0).collect();
        if grids.is_empty() || rows.is_empty() {
            return Ok(None);
        }
        let features = parts
            .iter()
            .map(|i| i.features.as_ref().map(|f| f.iter().map(TowerOutput::shallow_clone)))
            .collect::<Option<Vec<_>>>()
            .map(|f| f.into_iter().flatten().collect());
        Ok(Some(Images { pixel_values: Tensor::f_cat(&rows, 0)?, grids, features }))
    }

    /// The images `which` names, in that order: their patch rows and grids.
    pub fn select(&self, which: &[usize]) -> Result<Images> {
        let counts = self.patch_counts();
        let starts: Vec<i64> = counts.iter().scan(0, |s, c| Some(std::mem::replace(s, *s + c))).collect();
        if let Some(bad) = which.iter().find(|&&i| i >= counts.len()) {
            return Err(ModelError::Input(format!("image {bad} of {}", counts.len())));
        }
        let parts: Vec<Tensor> = which
            .iter()
            .map(|&i| self.pixel_values.f_narrow(0, starts[i], counts[i]))
            .collect::<std::result::Result<_, _>>()?;
        let pixel_values = match parts.is_empty() {
            true => self.pixel_values.f_narrow(0, 0, 0)?,
            false => Tensor::f_cat(&parts, 0)?,
        };
        let features = self.features.as_ref().map(|f| which.iter().map(|&i| f[i].shallow_clone()).collect());
        Ok(Images { pixel_values, grids: which.iter().map(|&i| self.grids[i]).collect(), features })
    }
}

impl CausalLm {
    /// The images of each row of `input_ids`, as index ranges into `images`: a row takes as many
    /// images, in order, as its placeholders cover.
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, seq]`
    pub fn images_per_row(&self, input_ids: &Tensor, images: &Images) -> Result<Vec<std::ops::Range<usize>>> {
        let cfg = self.tower()?.config();
        let merge = cfg.spatial_merge_size * cfg.spatial_merge_size;
        let per_row = input_ids.f_eq(cfg.image_token_id)?.f_sum_dim_intlist(-1, false, Kind::Int64)?;
        let per_row = Vec::<i64>::try_from(per_row.f_to_device(tch::Device::Cpu)?)?;
        let tokens: Vec<i64> = images.patch_counts().iter().map(|c| c / merge).collect();
        let (mut out, mut next) = (Vec::with_capacity(per_row.len()), 0usize);
        for (row, mut want) in per_row.into_iter().enumerate() {
            let first = next;
            while want > 0 {
                let Some(&n) = tokens.get(next) else {
                    return Err(ModelError::Input(format!("row {row}: more image placeholders than images")));
                };
                want -= n;
                next += 1;
            }
            if want < 0 {
                return Err(ModelError::Input(format!("row {row}: its image placeholders end inside an image")));
            }
            out.push(first..next);
        }
        if next != tokens.len() {
            return Err(ModelError::Input(format!("{} images for {next} the placeholders cover", tokens.len())));
        }
        Ok(out)
    }

    /// The vision tower, where this model reads images.
    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }

    fn tower(&self) -> Result<&VisionTower> {
        self.vision.as_ref().ok_or_else(|| {
            ModelError::Input(format!("model_type `{}` reads no images", self.config.arch.family.model_type()))
        })
    }

    /// The features of `images` for a pass whose placeholders are where `slots` allows: one
    /// row per image token in placeholder order (and Qwen3-VL's deep-stack rows); with a graph
    /// when the tower's parameters require gradients. With a parameter gate (ZeRO stage 3) the
    /// tower — in the outer unit — is gathered for it and released after, also for no image: the
    /// gate's calls are collectives every rank makes, whatever its rows hold (a trained tower
    /// under a gate is not supported: its graph would outlive the gathered weights).
    ///
    /// # Shapes
    /// - returns [`Visual`] of `[patches / merge², hidden]` each, in the model's dtype
    pub fn visual(&self, images: &Images, slots: Slots) -> Result<Visual> {
        let opts = (self.kind(), self.device());
        let out = tower_features(self.tower()?, &self.gate, self.config.arch.hidden_size, opts, images)?;
        Ok(Visual { features: out.features, deepstack: out.deepstack, slots })
    }

    /// `images` with each image's features from this model's tower, computed now without a graph
    /// (for a frozen tower: every later pass over them, [`CausalLm::visual`], takes these instead
    /// of running the tower again).
    ///
    /// # Shapes
    /// - each image's features `[t · h · w / merge², hidden]` (and as many deep-stack rows)
    pub fn with_features(&self, images: &Images) -> Result<Images> {
        let merge = self.tower()?.config().spatial_merge_size.pow(2);
        let all = tch::no_grad(|| self.visual(&images.without_features(), Slots::prompt(0)))?;
        let counts: Vec<i64> = images.patch_counts().iter().map(|c| c / merge).collect();
        let split = |t: &Tensor| t.f_split_with_sizes(&counts, 0);
        let features = split(&all.features)?;
        let deep = all.deepstack.iter().map(split).collect::<std::result::Result<Vec<_>, _>>()?;
        let per_image = features
            .into_iter()
            .enumerate()
            .map(|(i, features)| TowerOutput {
                features,
                deepstack: deep.iter().map(|d| d[i].shallow_clone()).collect(),
            })
            .collect();
        Ok(Images { features: Some(per_image), ..images.shallow_clone() })
    }

    /// Whether `other`'s vision tower is this model's, weight for weight (the features of one are
    /// the other's).
    pub fn same_vision(&self, other: Option<&VisionTower>) -> bool {
        same_tower(self.vision.as_ref(), other)
    }

    /// Whether the model's passes go through a parameter gate (ZeRO stage 3).
    pub fn is_gated(&self) -> bool {
        self.gate.is_some()
    }

    /// The multimodal positions of a batch whose placeholders — where `slots` allows — hold
    /// `grids`' images, and each row's delta (see [`crate::qwen2_5_vl::mrope_positions`]).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[3, batch, seq]` and `[batch]` int64
    pub fn image_positions(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        grids: &[[i64; 3]],
        slots: &Slots,
    ) -> Result<(Tensor, Tensor)> {
        image_positions(self.tower()?, input_ids, attention_mask, grids, slots)
    }

    /// Final hidden states with `visual`'s features in place of the prompt's image placeholders
    /// ([`CausalLm::visual`]), at the multimodal `position_ids`
    /// ([`CausalLm::image_positions`]); `cache`, when given, must be empty.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`; `position_ids`: `[3, batch, seq]`;
    ///   `visual.features`: `[placeholders, hidden]` → `[batch, seq, hidden]`
    pub fn hidden_states_with_images(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        visual: &Visual,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        check_ids(input_ids, attention_mask)?;
        let routing = Routing::Off;
        Ok(self.backbone.run(input_ids, position_ids, attention_mask, cache, &self.gate, routing, Some(visual))?.0)
    }

    /// [`CausalLm::hidden_states_with_images`] as a checkpointed pass (see
    /// [`CausalLm::hidden_states_checkpointed`]); the features' graph, when the tower trains, is
    /// backpropagated with the embeddings' by [`CausalLm::backward_checkpointed`].
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`; `position_ids`: `[3, batch, seq]`;
    ///   `visual.features`: `[placeholders, hidden]`; hidden `[batch, seq, hidden]`
    pub fn hidden_states_checkpointed_with_images(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        visual: &Visual,
    ) -> Result<Checkpointed> {
        check_ids(input_ids, attention_mask)?;
        let inputs = (input_ids, position_ids, attention_mask);
        checkpointing::forward(&self.backbone, &self.gate, inputs, Some(visual))
    }

    /// Full forward of prompts with images, without a cache.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → logits `[batch, seq, vocab]`
    pub fn forward_with_images(&self, input_ids: &Tensor, attention_mask: &Tensor, images: &Images) -> Result<Tensor> {
        let seq = input_ids.size()[1];
        let (pos, _) = self.image_positions(input_ids, attention_mask, &images.grids, &Slots::prompt(seq))?;
        let visual = self.visual(images, Slots::prompt(seq))?;
        let h = self.hidden_states_with_images(input_ids, attention_mask, &pos, &visual, None)?;
        self.logits_from_hidden(&h)
    }

    /// Stops (or restarts) gradient tracking on the vision tower's parameters; returns how many
    /// there are.
    pub fn set_vision_trainable(&self, trainable: bool) -> usize {
        let params = self.vision.as_ref().map(VisionTower::parameters).unwrap_or_default();
        for p in &params {
            let _ = p.shallow_clone().set_requires_grad(trainable);
        }
        params.len()
    }
}

/// The positions of the next token of each row after a prompt with images: its plain position
/// (`attention_mask` counted) plus the row's delta, on all three axes.
///
/// # Shapes
/// - `plain`: `[batch, seq]`; `deltas`: `[batch]` → `[batch, seq]`
pub fn shifted_positions(plain: &Tensor, deltas: &Tensor) -> Result<Tensor> {
    Ok(plain.f_add(&deltas.f_to_kind(Kind::Int64)?.f_unsqueeze(-1)?)?)
}

/// Whether two towers are the same, weight for weight (the features of one are the other's).
pub fn same_tower(a: Option<&VisionTower>, b: Option<&VisionTower>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => {
            let (pa, pb) = (a.parameters(), b.parameters());
            a.config() == b.config()
                && pa.len() == pb.len()
                && pa.iter().zip(&pb).all(|(x, y)| {
                    let alike = x.size() == y.size() && x.kind() == y.kind() && x.device() == y.device();
                    alike && x.f_equal(y).unwrap_or(false)
                })
        }
        _ => false,
    }
}

/// The multimodal positions of a batch whose placeholders — where `slots` allows — hold
/// `grids`' images, for `tower`'s placeholders (see [`crate::qwen2_5_vl::mrope_positions`]).
///
/// # Shapes
/// - `input_ids`, `attention_mask`: `[batch, seq]` → `[3, batch, seq]` and `[batch]` int64
pub(crate) fn image_positions(
    tower: &VisionTower,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    grids: &[[i64; 3]],
    slots: &Slots,
) -> Result<(Tensor, Tensor)> {
    let cfg = tower.config();
    crate::qwen2_5_vl::mrope_positions(
        input_ids,
        attention_mask,
        grids,
        slots,
        cfg.image_token_id,
        cfg.video_token_id,
        cfg.spatial_merge_size,
    )
}

/// `images`' features from `tower` (see [`CausalLm::visual`]), or the ones they carry when the
/// model is not gated; `hidden`, `kind` and `device` are the language model's.
///
/// # Shapes
/// - returns `[patches / merge², hidden]` (and as many deep-stack rows)
pub(crate) fn tower_features(
    tower: &VisionTower,
    gate: &crate::gate::Gate,
    hidden: i64,
    (kind, device): (Kind, tch::Device),
    images: &Images,
) -> Result<TowerOutput> {
    let none = || Tensor::f_zeros([0, hidden], (kind, device));
    // Features computed before (a frozen tower's): no tower pass. A gated model always runs it,
    // so that every rank makes the same gate calls.
    if let (Some(per_image), false) = (&images.features, gate.is_some()) {
        if per_image.len() != images.grids.len() {
            return Err(ModelError::Input(format!(
                "features of {} images for {} images",
                per_image.len(),
                images.grids.len()
            )));
        }
        let cat = |parts: Vec<&Tensor>| -> Result<Tensor> {
            Ok(if parts.is_empty() { none()? } else { Tensor::f_cat(&parts, 0)? })
        };
        let features = cat(per_image.iter().map(|f| &f.features).collect())?;
        let deepstack = (0..tower.config().deepstack_blocks.len())
            .map(|j| cat(per_image.iter().map(|f| &f.deepstack[j]).collect()))
            .collect::<Result<_>>()?;
        return Ok(TowerOutput { features, deepstack });
    }
    crate::gate::gather(gate, crate::gate::Unit::Outer)?;
    let out = if images.grids.is_empty() {
        let deep = tower.config().deepstack_blocks.iter().map(|_| none()).collect::<std::result::Result<_, _>>();
        none().and_then(|f| Ok(TowerOutput { features: f, deepstack: deep? })).map_err(ModelError::from)
    } else {
        let x = images.pixel_values.f_to_device(device).map_err(ModelError::from);
        x.and_then(|x| tower.forward(&x, &images.grids))
    };
    crate::gate::release(gate, crate::gate::Unit::Outer, false)?;
    out
}
