//! The Qwen3-VL vision tower (transformers' `Qwen3VLVisionModel`; Qwen3.5's `Qwen3_5VisionModel`
//! is the same without the deep stack): a ViT over an image's patches that outputs one feature per
//! `merge × merge` block of patches in the language model's width, and — Qwen3-VL's DeepStack
//! (Meng et al. 2024) — one more such feature per chosen block, which the language model adds to
//! the outputs of its first layers at the image's tokens.
//!
//! - **Patch embedding**: a biased `Conv3d` whose kernel is its stride and the whole patch, i.e. a
//!   linear map of each `pixel_values` row, plus a **learned position** from a square
//!   `side × side` table resampled to the image's `h × w` patches: bilinear, corners aligned
//!   (`src = i · (side − 1) / max(h − 1, 1)` on each axis), the four taps' weights the product of
//!   the axes' `1 − |src − tap|`, summed in f32.
//! - **2-D rotary** as Qwen2.5-VL's ([`crate::vision_tower`]).
//! - **Blocks**: pre-norm LayerNorm (eps 1e-6), attention with one biased `qkv` over each image
//!   frame, a biased MLP `fc2(act(fc1 x))` (`gelu_pytorch_tanh`).
//! - **Merger**: LayerNorm over each patch, each `merge²` consecutive patches concatenated,
//!   `Linear → GELU → Linear` to `out_hidden_size`; a **deep-stack merger** normalises after the
//!   concatenation instead (over `merge² · hidden`).
//!
//! Tensor names below the tower: `patch_embed.proj.{weight,bias}`, `pos_embed.weight`,
//! `blocks.{i}.{norm1,norm2}.{weight,bias}`, `blocks.{i}.attn.{qkv,proj}.*`,
//! `blocks.{i}.mlp.{linear_fc1,linear_fc2}.*`, `merger.{norm,linear_fc1,linear_fc2}.*`,
//! `deepstack_merger_list.{j}.{norm,linear_fc1,linear_fc2}.*`.

use tch::{Kind, Tensor};

use crate::config::{Activation, VisionConfig};
use crate::error::Result;
use crate::layers::{activate, LayerNorm, Linear};
use crate::vision_layers::{
    merge_block_coords, rotary_inv_freq, rotary_tables, rotate_qkv, segment_attention, TowerOutput,
};
use crate::weights::WeightLoader;

const NORM_EPS: f64 = 1e-6;

#[derive(Debug)]
struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// A patch merger: `fc2(GELU(fc1(norm(x))))` over each `merge²` patches concatenated, the norm
/// before the concatenation (the main merger) or after it (a deep-stack merger).
#[derive(Debug)]
struct Merger {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    after_concat: bool,
}

impl Merger {
    fn load(w: &WeightLoader, cfg: &VisionConfig, after_concat: bool) -> Result<Self> {
        let d = cfg.hidden_size;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        Ok(Merger {
            norm: LayerNorm::load(&w.pp("norm"), if after_concat { merged } else { d }, NORM_EPS)?,
            fc1: Linear::load(&w.pp("linear_fc1"), merged, merged, true)?,
            fc2: Linear::load(&w.pp("linear_fc2"), merged, cfg.out_hidden_size, true)?,
            after_concat,
        })
    }

    /// # Shapes
    /// - `h`: `[patches, hidden]` → `[patches / merge², out_hidden_size]`
    fn forward(&self, h: &Tensor, merged: i64) -> Result<Tensor> {
        let x = match self.after_concat {
            true => self.norm.forward(&h.f_reshape([-1, merged])?)?,
            false => self.norm.forward(h)?.f_reshape([-1, merged])?,
        };
        self.fc2.forward(&activate(&self.fc1.forward(&x)?, Activation::Gelu)?)
    }

    fn parameters(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.norm.weight, &self.norm.bias];
        out.extend(linear_parameters(&self.fc1).chain(linear_parameters(&self.fc2)));
        out
    }
}

fn linear_parameters(l: &Linear) -> impl Iterator<Item = &Tensor> {
    std::iter::once(&l.weight).chain(l.bias.as_ref())
}

/// The Qwen3-VL (and Qwen3.5) vision tower.
#[derive(Debug)]
pub struct Qwen3Tower {
    cfg: VisionConfig,
    patch_weight: Tensor, // [hidden, channels, temporal, patch, patch]
    patch_bias: Tensor,   // [hidden]
    pos_embed: Tensor,    // [side², hidden]
    blocks: Vec<Block>,
    merger: Merger,
    deepstack: Vec<Merger>,
    inv_freq: Tensor, // [head_dim / 4] f32
}

impl Qwen3Tower {
    /// Loads the tower from `w` (the `visual` scope).
    pub fn load(w: &WeightLoader, cfg: &VisionConfig) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let proj = w.pp("patch_embed").pp("proj");
        let patch_weight =
            proj.get("weight", &[d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size])?;
        let blocks = (0..cfg.depth)
            .map(|b| {
                let l = w.pp("blocks").pp(b);
                Ok(Block {
                    norm1: LayerNorm::load(&l.pp("norm1"), d, NORM_EPS)?,
                    norm2: LayerNorm::load(&l.pp("norm2"), d, NORM_EPS)?,
                    qkv: Linear::load(&l.pp("attn").pp("qkv"), d, 3 * d, true)?,
                    proj: Linear::load(&l.pp("attn").pp("proj"), d, d, true)?,
                    fc1: Linear::load(&l.pp("mlp").pp("linear_fc1"), d, i, true)?,
                    fc2: Linear::load(&l.pp("mlp").pp("linear_fc2"), i, d, true)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let deepstack = (0..cfg.deepstack_blocks.len())
            .map(|j| Merger::load(&w.pp("deepstack_merger_list").pp(j), cfg, true))
            .collect::<Result<Vec<_>>>()?;
        Ok(Qwen3Tower {
            patch_bias: proj.get("bias", &[d])?,
            patch_weight,
            pos_embed: w.pp("pos_embed").get("weight", &[cfg.num_position_embeddings, d])?,
            blocks,
            merger: Merger::load(&w.pp("merger"), cfg, false)?,
            deepstack,
            inv_freq: rotary_inv_freq(cfg, w.device())?,
            cfg: cfg.clone(),
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Every parameter of the tower.
    pub fn parameters(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.patch_weight, &self.patch_bias, &self.pos_embed];
        for b in &self.blocks {
            out.extend([&b.norm1.weight, &b.norm1.bias, &b.norm2.weight, &b.norm2.bias]);
            for l in [&b.qkv, &b.proj, &b.fc1, &b.fc2] {
                out.extend(linear_parameters(l));
            }
        }
        out.extend(self.merger.parameters());
        for m in &self.deepstack {
            out.extend(m.parameters());
        }
        out
    }

    /// The merged features of the images and the deep-stack ones, in the order of their patches
    /// (`pixel_values` already checked against `grids`).
    ///
    /// # Shapes
    /// - `pixel_values`: `[patches, channels · temporal_patch · patch²]`; `grids[i] = [t, h, w]`
    ///   → [`TowerOutput`] of `[patches / merge², out_hidden_size]` each
    pub(crate) fn forward(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> Result<TowerOutput> {
        let d = self.cfg.hidden_size;
        let m = self.cfg.spatial_merge_size;
        let kind = self.patch_weight.kind();
        let (mut rows, mut cols, mut frames, mut start) = (vec![], vec![], vec![], 0i64);
        for &[t, h, w] in grids {
            for _ in 0..t {
                merge_block_coords(h, w, m, &mut rows, &mut cols);
                frames.push((start, h * w));
                start += h * w;
            }
        }
        let weight = self.patch_weight.f_reshape([d, -1])?;
        let x = crate::layers::linear(&pixel_values.f_to_kind(kind)?, &weight, Some(&self.patch_bias))?; // [n, d]
        let mut h = x.f_add(&self.positions(grids, &rows, &cols)?.f_to_kind(kind)?)?;
        let (cos, sin) = rotary_tables(&self.inv_freq, &rows, &cols)?;
        let merged = d * m * m;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, block) in self.blocks.iter().enumerate() {
            h = self.block(block, &h, &cos, &sin, &frames)?;
            if let Some(j) = self.cfg.deepstack_blocks.iter().position(|&b| b == i as i64) {
                deepstack.push(self.deepstack[j].forward(&h, merged)?);
            }
        }
        Ok(TowerOutput { features: self.merger.forward(&h, merged)?, deepstack })
    }

    /// The learned positions of every patch: the position table resampled bilinearly (corners
    /// aligned) to each image's grid, in f32.
    ///
    /// # Shapes
    /// - `rows`, `cols`: one per patch → `[patches, hidden]` f32
    fn positions(&self, grids: &[[i64; 3]], rows: &[i64], cols: &[i64]) -> Result<Tensor> {
        let side = (self.cfg.num_position_embeddings as f64).sqrt() as i64;
        // Per axis: the two taps around `src = i · (side − 1) / max(size − 1, 1)` and their
        // weights `max(1 − |src − tap|, 0)`, in f32 as transformers computes them.
        let taps = |i: i64, size: i64| -> [(i64, f32); 2] {
            let src = (i as f32 * (side - 1) as f32) / ((size - 1).max(1) as f32);
            let floor = src.floor();
            [0, 1].map(|o| {
                let tap = (floor as i64 + o).clamp(0, side - 1);
                (tap, (1.0 - (src - floor - o as f32).abs()).max(0.0))
            })
        };
        let (mut index, mut weight) = (Vec::with_capacity(rows.len() * 4), Vec::with_capacity(rows.len() * 4));
        let mut k = 0usize;
        for &[t, h, w] in grids {
            for _ in 0..t * h * w {
                for (th, wh) in taps(rows[k], h) {
                    for (tw, ww) in taps(cols[k], w) {
                        index.push(th * side + tw);
                        weight.push(wh * ww);
                    }
                }
                k += 1;
            }
        }
        let device = self.pos_embed.device();
        let index = Tensor::f_from_slice(&index)?.f_to_device(device)?;
        let weight = Tensor::f_from_slice(&weight)?.f_to_device(device)?.f_view([-1, 4, 1])?;
        let table = self.pos_embed.f_index_select(0, &index)?.f_view([-1, 4, self.cfg.hidden_size])?;
        Ok(table.f_mul(&weight)?.f_sum_dim_intlist(1, false, Kind::Float)?)
    }

    /// One block: attention within each frame, then the MLP, each added to the residual.
    ///
    /// # Shapes
    /// - `h`: `[patches, hidden]`; `cos`, `sin`: `[patches, head_dim]` → `[patches, hidden]`
    fn block(&self, b: &Block, h: &Tensor, cos: &Tensor, sin: &Tensor, frames: &[(i64, i64)]) -> Result<Tensor> {
        let (n, heads, hd) = (h.size()[0], self.cfg.num_heads, self.cfg.head_dim());
        let qkv = b.qkv.forward(&b.norm1.forward(h)?)?.f_reshape([n, 3, heads, hd])?;
        let (q, k, v) = rotate_qkv(&qkv, cos, sin)?;
        let y = segment_attention(&q, &k, &v, frames)?.f_reshape([n, heads * hd])?;
        let h = h.f_add(&b.proj.forward(&y)?)?;
        let x = activate(&b.fc1.forward(&b.norm2.forward(&h)?)?, self.cfg.activation)?;
        Ok(h.f_add(&b.fc2.forward(&x)?)?)
    }
}
