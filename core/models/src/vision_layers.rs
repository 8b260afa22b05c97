//! What the Qwen-VL vision towers share ([`crate::vision_tower`], [`crate::vision_tower3`]): the
//! patches' coordinates in the processor's merge-block order, the 2-D rotary (each head's first
//! half turns with the patch's row, the second with its column, `θ^(−2i / (head_dim/2))`,
//! `rotate_half` layout, in f32), attention within segments, and what a tower returns.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::config::VisionConfig;
use crate::error::Result;
use crate::layers::apply_rotary;

/// What a tower makes of a batch's images, one row per image token in placeholder order.
///
/// # Shapes
/// `features`: `[tokens, out_hidden]`; `deepstack`: one `[tokens, out_hidden]` per deep-stack
/// layer (Qwen3-VL), added to the language model's first layers' outputs
#[derive(Debug)]
pub struct TowerOutput {
    pub features: Tensor,
    pub deepstack: Vec<Tensor>,
}

impl TowerOutput {
    /// The same features, sharing storage.
    pub fn shallow_clone(&self) -> TowerOutput {
        TowerOutput {
            features: self.features.shallow_clone(),
            deepstack: self.deepstack.iter().map(Tensor::shallow_clone).collect(),
        }
    }
}

/// Row and column of each patch of one `h × w` frame in the processor's order: merge block
/// `(bh, bw)` row-major, then `(i, j)` inside it.
pub(crate) fn merge_block_coords(h: i64, w: i64, m: i64, rows: &mut Vec<i64>, cols: &mut Vec<i64>) {
    for bh in 0..h / m {
        for bw in 0..w / m {
            for i in 0..m {
                for j in 0..m {
                    rows.push(bh * m + i);
                    cols.push(bw * m + j);
                }
            }
        }
    }
}

/// `1 / θ^(2i / (head_dim/2))`, `i < head_dim / 4`, in f32 as transformers computes it.
///
/// # Shapes
/// returns `[head_dim / 4]` f32
pub(crate) fn rotary_inv_freq(cfg: &VisionConfig, device: tch::Device) -> Result<Tensor> {
    let quarter = cfg.head_dim() / 2;
    let inv_freq = Tensor::f_arange_start_step(0, quarter, 2, (Kind::Float, device))?.f_div_scalar(quarter as f64)?;
    Ok(Tensor::f_scalar_tensor(cfg.rope_theta, (Kind::Float, device))?.f_pow(&inv_freq)?.f_reciprocal()?)
}

/// cos and signed sin tables (`[−sin, sin]`, see [`apply_rotary`]) of every patch's row and
/// column: each head's first half turns with the row, the second with the column, in f32.
///
/// # Shapes
/// - `inv_freq`: `[head_dim / 4]`; `rows`, `cols`: one per patch → `([patches, head_dim], same)`
pub(crate) fn rotary_tables(inv_freq: &Tensor, rows: &[i64], cols: &[i64]) -> Result<(Tensor, Tensor)> {
    let axis = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::f_from_slice(v)?
            .f_to_device(inv_freq.device())?
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(inv_freq)?)
    };
    let freqs = Tensor::f_cat(&[axis(rows)?, axis(cols)?], -1)?; // [n, head_dim / 2]
    let (c, s) = (freqs.f_cos()?, freqs.f_sin()?);
    Ok((Tensor::f_cat(&[&c, &c], -1)?, Tensor::f_cat(&[&s.f_neg()?, &s], -1)?))
}

/// Rotates `qkv`'s queries and keys with the 2-D tables, in f32 as transformers does.
///
/// # Shapes
/// - `qkv`: `[n, 3, heads, head_dim]`; `cos`, `sin`: `[n, head_dim]` → `q`, `k`, `v`
///   `[n, heads, head_dim]`
pub(crate) fn rotate_qkv(qkv: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, hd) = (qkv.size()[0], qkv.size()[3]);
    let rotate = |i: i64| -> Result<Tensor> {
        let x = qkv.f_select(1, i)?;
        let (c, s) = (cos.f_view([n, 1, 1, hd])?, sin.f_view([n, 1, 1, hd])?);
        Ok(apply_rotary(&x.f_to_kind(Kind::Float)?.f_unsqueeze(2)?, &c, &s)?.f_squeeze_dim(2)?.f_to_kind(x.kind())?)
    };
    Ok((rotate(0)?, rotate(1)?, qkv.f_select(1, 2)?))
}

/// Bidirectional attention of each segment's tokens among themselves; segments of equal length go
/// through one `scaled_dot_product_attention` call.
///
/// # Shapes
/// - `q`, `k`, `v`: `[tokens, heads, head_dim]`; `segments`: `(start, length)` covering every
///   token once → `[tokens, heads, head_dim]`
pub(crate) fn segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, segments: &[(i64, i64)]) -> Result<Tensor> {
    let mut by_len: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for &(start, len) in segments.iter().filter(|s| s.1 > 0) {
        by_len.entry(len).or_default().push(start);
    }
    let (heads, hd) = (q.size()[1], q.size()[2]);
    let (mut outs, mut places) = (Vec::new(), Vec::new());
    for (len, starts) in by_len {
        let idx: Vec<i64> = starts.iter().flat_map(|&s| s..s + len).collect();
        let idx = Tensor::f_from_slice(&idx)?.f_to_device(q.device())?;
        let group = |t: &Tensor| -> Result<Tensor> {
            Ok(t.f_index_select(0, &idx)?.f_view([starts.len() as i64, len, heads, hd])?.f_transpose(1, 2)?)
        };
        let y = Tensor::f_scaled_dot_product_attention(
            &group(q)?,
            &group(k)?,
            &group(v)?,
            None::<&Tensor>,
            0.0,
            false,
            None,
            false,
        )?; // [segments, heads, len, head_dim]
        outs.push(y.f_transpose(1, 2)?.f_reshape([-1, heads, hd])?);
        places.push(idx);
    }
    let y = Tensor::f_cat(&outs, 0)?;
    Ok(y.f_index_select(0, &Tensor::f_cat(&places, 0)?.f_argsort(0, false)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_attend_only_within_themselves() {
        let q = Tensor::randn([7, 2, 4], (Kind::Float, tch::Device::Cpu));
        let (k, v) = (q.randn_like(), q.randn_like());
        let segs = [(0, 3), (3, 2), (5, 2)];
        let y = segment_attention(&q, &k, &v, &segs).unwrap();
        for (s, l) in segs {
            let part = |t: &Tensor| t.narrow(0, s, l).transpose(0, 1).unsqueeze(0);
            let want = Tensor::scaled_dot_product_attention(
                &part(&q),
                &part(&k),
                &part(&v),
                None::<&Tensor>,
                0.0,
                false,
                None,
                false,
            );
            let got = y.narrow(0, s, l).transpose(0, 1).unsqueeze(0);
            assert!((got - want).abs().max().double_value(&[]) < 1e-6);
        }
    }
}
