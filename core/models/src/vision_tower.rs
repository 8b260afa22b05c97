//! The Qwen-VL vision towers ([`VisionTower`]: Qwen2.5-VL's, below, and Qwen3-VL's in
//! [`crate::vision_tower3`]) and what they share: the patches' coordinates, the 2-D rotary, the
//! attention within segments.
//!
//! The Qwen2.5-VL tower (transformers' `Qwen2_5_VisionTransformerPretrainedModel`) is a ViT over
//! an image's patches that outputs one feature per `merge × merge` block of patches, in the
//! language model's width.
//!
//! - **Patch embedding**: a `Conv3d` whose kernel is its stride and the whole patch, i.e. a linear
//!   map of each `pixel_values` row (`channels · temporal_patch · patch²` values) to the hidden
//!   size, computed as one matrix product.
//! - **2-D rotary**: each head's first half rotates with the patch's row, the second half with its
//!   column (`θ^(−2i / (head_dim/2))`, `rotate_half` layout), in f32.
//! - **Window attention**: the patches are reordered so that each window of
//!   `window_size / (patch · merge)` merged tokens a side is contiguous (transformers'
//!   `get_vision_window_index`); blocks in `fullatt_block_indexes` attend over the whole image,
//!   the others within their window. Attention never crosses images. Segments of equal length are
//!   batched into one `scaled_dot_product_attention`.
//! - **Blocks**: pre-norm, RMSNorm (`w · x`, eps 1e-6), attention with one biased `qkv`, a biased
//!   SwiGLU MLP.
//! - **Merger**: RMSNorm, each `merge²` consecutive patches concatenated, `Linear → GELU →
//!   Linear` to `out_hidden_size`; the window order undone.
//!
//! Tensor names below the tower: `patch_embed.proj.weight`, `blocks.{i}.{norm1,norm2}.weight`,
//! `blocks.{i}.attn.{qkv,proj}.*`, `blocks.{i}.mlp.{gate_proj,up_proj,down_proj}.*`,
//! `merger.ln_q.weight`, `merger.mlp.{0,2}.*`.

use tch::Tensor;

use crate::config::{ArchConfig, NormKind, TowerKind, VisionConfig};
use crate::error::{ModelError, Result};
use crate::layers::{activate, Linear, RmsNorm};
pub use crate::vision_layers::TowerOutput;
use crate::vision_layers::{merge_block_coords, rotary_inv_freq, rotary_tables, rotate_qkv, segment_attention};
use crate::weights::WeightLoader;

const NORM_EPS: f64 = 1e-6;

#[derive(Debug)]
struct Block {
    norm1: RmsNorm,
    norm2: RmsNorm,
    qkv: Linear,
    proj: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Attends over the whole image rather than its windows.
    full: bool,
}

/// The Qwen2.5-VL vision tower.
#[derive(Debug)]
pub struct WindowTower {
    cfg: VisionConfig,
    patch_embed: Tensor, // [hidden, channels, temporal, patch, patch]
    blocks: Vec<Block>,
    merger_norm: RmsNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    inv_freq: Tensor, // [head_dim / 4] f32
}

/// Where each patch goes and what it attends to, computed on the host from the grids.
struct Layout {
    /// The merged tokens in window order: `order[i]` is the merged token at place `i`.
    order: Vec<i64>,
    /// `(start, length)` in patches of each window, in window order.
    windows: Vec<(i64, i64)>,
    /// `(start, length)` in patches of each image frame.
    frames: Vec<(i64, i64)>,
    /// Row and column of each patch, in the processor's order.
    rows: Vec<i64>,
    cols: Vec<i64>,
}

impl Layout {
    fn new(cfg: &VisionConfig, grids: &[[i64; 3]]) -> Self {
        let m = cfg.spatial_merge_size;
        let unit = m * m;
        let side = cfg.window_size / m / cfg.patch_size; // merged tokens per window side
        let (mut order, mut windows, mut frames, mut rows, mut cols) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut offset, mut start) = (0i64, 0i64);
        for &[t, h, w] in grids {
            for _ in 0..t {
                frames.push((start, h * w));
                start += h * w;
                merge_block_coords(h, w, m, &mut rows, &mut cols);
            }
            let (lh, lw) = (h / m, w / m);
            let mut window_start = windows.last().map_or(0, |&(s, l)| s + l);
            for f in 0..t {
                for wy in 0..(lh + side - 1) / side {
                    for wx in 0..(lw + side - 1) / side {
                        let mut len = 0;
                        for y in wy * side..((wy + 1) * side).min(lh) {
                            for x in wx * side..((wx + 1) * side).min(lw) {
                                order.push(offset + (f * lh + y) * lw + x);
                                len += unit;
                            }
                        }
                        windows.push((window_start, len));
                        window_start += len;
                    }
                }
            }
            offset += t * lh * lw;
        }
        Layout { order, windows, frames, rows, cols }
    }
}

/// A Qwen-VL vision tower: Qwen2.5-VL's windowed one, or Qwen3-VL's (also Qwen3.5's).
#[derive(Debug)]
pub enum VisionTower {
    Qwen2_5(WindowTower),
    Qwen3(crate::vision_tower3::Qwen3Tower),
}

impl VisionTower {
    /// The vision tower of `cfg` from its scope in the checkpoint, where the model reads images.
    pub(crate) fn load_for(w: &WeightLoader, cfg: &ArchConfig) -> Result<Option<Self>> {
        let (Some(vision), Some(mm)) = (&cfg.vision, cfg.multimodal) else { return Ok(None) };
        let prefix = mm.vision_prefixes.first().copied().unwrap_or("visual.");
        let w = prefix.trim_end_matches('.').split('.').fold(w.clone(), |w, part| w.pp(part));
        Ok(Some(match vision.kind {
            TowerKind::Qwen2_5 => VisionTower::Qwen2_5(WindowTower::load(&w, vision)?),
            TowerKind::Qwen3 => VisionTower::Qwen3(crate::vision_tower3::Qwen3Tower::load(&w, vision)?),
        }))
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        match self {
            VisionTower::Qwen2_5(t) => &t.cfg,
            VisionTower::Qwen3(t) => t.config(),
        }
    }

    /// Every parameter of the tower.
    pub fn parameters(&self) -> Vec<&Tensor> {
        match self {
            VisionTower::Qwen2_5(t) => t.parameters(),
            VisionTower::Qwen3(t) => t.parameters(),
        }
    }

    /// The merged features of the images (and the deep-stack ones), in the order of their
    /// patches, after checking `pixel_values` against `grids`.
    ///
    /// # Shapes
    /// - `pixel_values`: `[patches, channels · temporal_patch · patch²]` (all images' rows, one
    ///   after another); `grids[i] = [t, h, w]` in patches → `[patches / merge², out_hidden_size]`
    pub fn forward(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> Result<TowerOutput> {
        check_patches(self.config(), pixel_values, grids)?;
        match self {
            VisionTower::Qwen2_5(t) => Ok(TowerOutput { features: t.forward(pixel_values, grids)?, deepstack: vec![] }),
            VisionTower::Qwen3(t) => t.forward(pixel_values, grids),
        }
    }
}

/// Checks `pixel_values` against `grids` before any computation.
fn check_patches(c: &VisionConfig, pixel_values: &Tensor, grids: &[[i64; 3]]) -> Result<()> {
    let m = c.spatial_merge_size;
    let patches: i64 = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    if let Some(g) = grids.iter().find(|g| g.iter().any(|&x| x <= 0) || g[1] % m != 0 || g[2] % m != 0) {
        return Err(ModelError::Input(format!("image grid {g:?}: height and width must be positive multiples of {m}")));
    }
    if pixel_values.size() != [patches, c.patch_dim()] {
        return Err(ModelError::Input(format!(
            "pixel_values {:?} do not match the grids {grids:?}: expected [{patches}, {}]",
            pixel_values.size(),
            c.patch_dim()
        )));
    }
    Ok(())
}

impl WindowTower {
    /// Loads the tower from `w` (the `visual` scope).
    pub fn load(w: &WeightLoader, cfg: &VisionConfig) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let patch_embed = w
            .pp("patch_embed")
            .pp("proj")
            .get("weight", &[d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size])?;
        let norm = |l: &WeightLoader, dim| RmsNorm::load_kind(l, dim, NORM_EPS, NormKind::Rms);
        let blocks = (0..cfg.depth)
            .map(|b| {
                let l = w.pp("blocks").pp(b);
                Ok(Block {
                    norm1: norm(&l.pp("norm1"), d)?,
                    norm2: norm(&l.pp("norm2"), d)?,
                    qkv: Linear::load(&l.pp("attn").pp("qkv"), d, 3 * d, true)?,
                    proj: Linear::load(&l.pp("attn").pp("proj"), d, d, true)?,
                    gate: Linear::load(&l.pp("mlp").pp("gate_proj"), d, i, true)?,
                    up: Linear::load(&l.pp("mlp").pp("up_proj"), d, i, true)?,
                    down: Linear::load(&l.pp("mlp").pp("down_proj"), i, d, true)?,
                    full: cfg.fullatt_blocks.contains(&b),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let merger = w.pp("merger");
        let inv_freq = rotary_inv_freq(cfg, w.device())?;
        Ok(WindowTower {
            patch_embed,
            blocks,
            merger_norm: norm(&merger.pp("ln_q"), d)?,
            merger_fc1: Linear::load(&merger.pp("mlp").pp(0), merged, merged, true)?,
            merger_fc2: Linear::load(&merger.pp("mlp").pp(2), merged, cfg.out_hidden_size, true)?,
            inv_freq,
            cfg: cfg.clone(),
        })
    }

    /// Every parameter of the tower.
    pub fn parameters(&self) -> Vec<&Tensor> {
        fn linear(l: &Linear) -> impl Iterator<Item = &Tensor> {
            std::iter::once(&l.weight).chain(l.bias.as_ref())
        }
        let mut out = vec![&self.patch_embed, &self.merger_norm.weight];
        for b in &self.blocks {
            out.extend([&b.norm1.weight, &b.norm2.weight]);
            for l in [&b.qkv, &b.proj, &b.gate, &b.up, &b.down] {
                out.extend(linear(l));
            }
        }
        out.extend(linear(&self.merger_fc1).chain(linear(&self.merger_fc2)));
        out
    }

    /// The merged features of the images, in the order of their patches.
    ///
    /// # Shapes
    /// - `pixel_values`: `[patches, channels · temporal_patch · patch²]` (all images' rows, one
    ///   after another); `grids[i] = [t, h, w]` in patches → `[patches / merge², out_hidden_size]`
    fn forward(&self, pixel_values: &Tensor, grids: &[[i64; 3]]) -> Result<Tensor> {
        let layout = Layout::new(&self.cfg, grids);
        let device = pixel_values.device();
        let kind = self.patch_embed.kind();
        let d = self.cfg.hidden_size;
        let weight = self.patch_embed.f_reshape([d, -1])?;
        let x = crate::layers::linear(&pixel_values.f_to_kind(kind)?, &weight, None)?; // [n, d]
        let n = x.size()[0];
        let unit = self.cfg.spatial_merge_size * self.cfg.spatial_merge_size;
        let order = Tensor::f_from_slice(&layout.order)?.f_to_device(device)?;
        // Reorders whole merge blocks: [n, ...] → the same rows in window order.
        let permute = |t: &Tensor| -> Result<Tensor> {
            let rest = &t.size()[1..];
            let blocks: Vec<i64> = [n / unit, unit].iter().chain(rest).copied().collect();
            Ok(t.f_reshape(blocks.as_slice())?.f_index_select(0, &order)?.f_reshape(t.size().as_slice())?)
        };
        let mut h = permute(&x)?;
        let (cos, sin) = rotary_tables(&self.inv_freq, &layout.rows, &layout.cols)?;
        let (cos, sin) = (permute(&cos)?, permute(&sin)?);
        for block in &self.blocks {
            let segments = if block.full { &layout.frames } else { &layout.windows };
            h = self.block(block, &h, &cos, &sin, segments)?;
        }
        let merged = self.merger_norm.forward(&h)?.f_reshape([n / unit, unit * d])?;
        let merged =
            self.merger_fc2.forward(&activate(&self.merger_fc1.forward(&merged)?, crate::config::Activation::Gelu)?)?;
        Ok(merged.f_index_select(0, &order.f_argsort(0, false)?)?)
    }

    /// One block: attention within `segments`, then the MLP, each added to the residual.
    ///
    /// # Shapes
    /// - `h`: `[patches, hidden]`; `cos`, `sin`: `[patches, head_dim]` → `[patches, hidden]`
    fn block(&self, b: &Block, h: &Tensor, cos: &Tensor, sin: &Tensor, segments: &[(i64, i64)]) -> Result<Tensor> {
        let (n, heads, hd) = (h.size()[0], self.cfg.num_heads, self.cfg.head_dim());
        let qkv = b.qkv.forward(&b.norm1.forward(h)?)?.f_reshape([n, 3, heads, hd])?;
        let (q, k, v) = rotate_qkv(&qkv, cos, sin)?;
        let y = segment_attention(&q, &k, &v, segments)?.f_reshape([n, heads * hd])?;
        let h = h.f_add(&b.proj.forward(&y)?)?;
        let x = b.norm2.forward(&h)?;
        let m = activate(&b.gate.forward(&x)?, self.cfg.activation)?.f_mul(&b.up.forward(&x)?)?;
        Ok(h.f_add(&b.down.forward(&m)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Activation;

    fn cfg() -> VisionConfig {
        VisionConfig {
            kind: TowerKind::Qwen2_5,
            num_position_embeddings: 0,
            deepstack_blocks: vec![],
            depth: 1,
            hidden_size: 8,
            intermediate_size: 8,
            num_heads: 2,
            in_channels: 3,
            patch_size: 2,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: 8, // 2 merged tokens a side
            fullatt_blocks: vec![],
            out_hidden_size: 4,
            activation: Activation::Silu,
            rope_theta: 10_000.0,
            image_token_id: 0,
            video_token_id: 1,
            vision_start_token_id: 2,
            vision_end_token_id: 3,
        }
    }

    #[test]
    fn windows_follow_transformers_window_index() {
        // An image of 6 × 4 patches: 3 × 2 merged tokens, windows of 2 × 2 merged tokens.
        let l = Layout::new(&cfg(), &[[1, 6, 4], [1, 2, 2]]);
        // transformers: index [[0,1],[2,3],[4,5]] padded to 4 × 2 → windows [0,1,2,3], [4,5].
        assert_eq!(l.order, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(l.windows, vec![(0, 16), (16, 8), (24, 4)]);
        assert_eq!(l.frames, vec![(0, 24), (24, 4)]);
        // A wider image: 2 × 6 merged tokens, windows side by side.
        let l = Layout::new(&cfg(), &[[1, 4, 12]]);
        assert_eq!(l.order, vec![0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(l.windows, vec![(0, 16), (16, 16), (32, 16)]);
        // The first merge block of the first image: rows 0,0,1,1 and columns 0,1,0,1.
        assert_eq!((&l.rows[..4], &l.cols[..4]), (&[0, 0, 1, 1][..], &[0, 1, 0, 1][..]));
        assert_eq!((&l.rows[4..8], &l.cols[4..8]), (&[0, 0, 1, 1][..], &[2, 3, 2, 3][..]));
    }
}
