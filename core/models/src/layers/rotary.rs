//! Rotary position embeddings (Su et al. 2021, "RoFormer") with transformers' scaling variants
//! (`modeling_rope_utils.py`): linear, Llama 3, YaRN, LongRoPE, dynamic NTK and Gemma 4's
//! proportional RoPE, and partial rotation (the leading `rotary_dim` dimensions of each head,
//! Phi-3's `partial_rotary_factor`).

use tch::{Kind, Tensor};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;

/// Frequencies that depend on the sequence length of the forward (transformers'
/// `dynamic_rope_update`).
#[derive(Debug)]
enum ByLength {
    /// LongRoPE: `long` when `max(position) + 1 > original`, else the short frequencies.
    LongRope { long: Tensor, original: f64 },
    /// Dynamic NTK: a larger base when `max(position) + 1 > max_position_embeddings`.
    Dynamic { theta: f64, factor: f64, max_position_embeddings: f64 },
}

/// Rotary inverse frequencies (fp32) and the factor cos and sin are scaled by.
#[derive(Debug)]
pub struct Rotary {
    inv_freq: Tensor, // [rotary_dim / 2], f32, on the model's device
    /// Multiplies cos and sin (YaRN's and LongRoPE's attention factor); 1 = none.
    attention_scaling: f64,
    by_length: Option<ByLength>,
    dim: i64,
    /// The multimodal RoPE's axis of each frequency (`[rotary_dim / 2]` int64, 0 time, 1 height,
    /// 2 width), for `[3, batch, seq]` positions.
    axes: Option<Tensor>,
}

/// `2i / dim` for `i < dim / 2`, as transformers computes it: `arange(0, dim, 2).float() / dim`.
///
/// # Shapes
/// returns `[dim / 2]` (f32)
fn exponents(dim: i64, device: tch::Device) -> Result<Tensor> {
    Ok(Tensor::f_arange_start_step(0, dim, 2, (Kind::Int64, device))?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(dim as f64)?)
}

/// `θ^(2i / dim)` for `i < dim / 2` in f32 tensors, `base` a 0-d f32 tensor holding θ.
fn powers(base: &Tensor, dim: i64) -> Result<Tensor> {
    Ok(base.f_pow(&exponents(dim, base.device())?)?)
}

/// `1 / θ^(2i / dim)` for `i < dim / 2` as transformers computes it: `θ ** (arange(0, dim, 2) / dim)`
/// in f32 tensors.
fn default_inv_freq(theta: f64, dim: i64, device: tch::Device) -> Result<Tensor> {
    Ok(powers(&Tensor::f_scalar_tensor(theta, (Kind::Float, device))?, dim)?.f_reciprocal()?)
}

impl Rotary {
    /// Computes `inv_freq` like transformers' `ROPE_INIT_FUNCTIONS`, in fp32, for the leading
    /// `dim` dimensions of each head; with the multimodal RoPE, each frequency's axis.
    pub fn new(cfg: &RopeConfig, dim: i64, device: tch::Device) -> Result<Self> {
        let mut rotary = Self::scaled(cfg, dim, device)?;
        if let Some(m) = cfg.mrope {
            rotary.axes = Some(Tensor::f_from_slice(&m.axes(dim / 2))?.f_to_device(device)?);
        }
        Ok(rotary)
    }

    fn scaled(cfg: &RopeConfig, dim: i64, device: tch::Device) -> Result<Self> {
        let half = (dim / 2) as usize;
        let base = cfg.theta as f32;
        let mut inv: Vec<f32> = (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
        let plain = |inv: Vec<f32>, attention_scaling, by_length| -> Result<Self> {
            Ok(Rotary {
                inv_freq: Tensor::f_from_slice(&inv)?.f_to_device(device)?,
                attention_scaling,
                by_length,
                dim,
                axes: None,
            })
        };
        match &cfg.scaling {
            RopeScaling::None => plain(inv, 1.0, None),
            RopeScaling::Linear { factor } => {
                inv.iter_mut().for_each(|f| *f /= *factor as f32);
                plain(inv, 1.0, None)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let (factor, low, high, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                    let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                    *f = if medium {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
                plain(inv, 1.0, None)
            }
            RopeScaling::Yarn { .. } => {
                let inv_freq = yarn_inv_freq(cfg, dim, device)?;
                let RopeScaling::Yarn { attention_factor, .. } = cfg.scaling else { unreachable!() };
                Ok(Rotary { inv_freq, attention_scaling: attention_factor, by_length: None, dim, axes: None })
            }
            RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor } => {
                let powers = powers(&Tensor::f_scalar_tensor(cfg.theta, (Kind::Float, device))?, dim)?;
                let with = |factors: &[f64]| -> Result<Tensor> {
                    let f: Vec<f32> = factors.iter().map(|x| *x as f32).collect();
                    Ok(Tensor::f_from_slice(&f)?.f_to_device(device)?.f_mul(&powers)?.f_reciprocal()?)
                };
                Ok(Rotary {
                    inv_freq: with(short_factor)?,
                    attention_scaling: *attention_factor,
                    by_length: Some(ByLength::LongRope {
                        long: with(long_factor)?,
                        original: *original_max_position_embeddings,
                    }),
                    dim,
                    axes: None,
                })
            }
            RopeScaling::Proportional { partial, factor } => {
                // transformers: `int(partial · head_dim // 2)` rotating pairs, the rest zero.
                let rotated = ((partial * dim as f64) / 2.0).floor() as usize;
                for (i, f) in inv.iter_mut().enumerate() {
                    *f = if i < rotated { *f / *factor as f32 } else { 0.0 };
                }
                plain(inv, 1.0, None)
            }
            RopeScaling::Dynamic { factor, max_position_embeddings } => Ok(Rotary {
                inv_freq: default_inv_freq(cfg.theta, dim, device)?,
                attention_scaling: 1.0,
                by_length: Some(ByLength::Dynamic {
                    theta: cfg.theta,
                    factor: *factor,
                    max_position_embeddings: *max_position_embeddings,
                }),
                dim,
                axes: None,
            }),
        }
    }

    /// Whether the tables are computed without reading a value back to the host (all but
    /// LongRoPE and dynamic NTK, whose frequencies depend on the longest position).
    pub fn capturable(&self) -> bool {
        self.by_length.is_none()
    }

    /// The inverse frequencies for a forward whose longest position is `max(position_ids)`.
    fn inv_freq_for(&self, position_ids: &Tensor) -> Result<Tensor> {
        let Some(by_length) = &self.by_length else { return Ok(self.inv_freq.shallow_clone()) };
        // One host sync per forward, only for the length-dependent variants.
        let len = position_ids.f_max()?.f_int64_value(&[])? as f64 + 1.0;
        match by_length {
            ByLength::LongRope { long, original } if len > *original => Ok(long.shallow_clone()),
            ByLength::LongRope { .. } => Ok(self.inv_freq.shallow_clone()),
            ByLength::Dynamic { theta, factor, max_position_embeddings } if len > *max_position_embeddings => {
                // transformers computes this in f32 tensors: base · (f · len / max − (f − 1))^(d / (d − 2)).
                let device = self.inv_freq.device();
                let d = self.dim as f64;
                let grow = Tensor::f_scalar_tensor(len, (Kind::Float, device))?
                    .f_mul_scalar(*factor)?
                    .f_div_scalar(*max_position_embeddings)?
                    .f_sub_scalar(factor - 1.0)?
                    .f_pow_tensor_scalar(d / (d - 2.0))?;
                Ok(powers(&grow.f_mul_scalar(*theta)?, self.dim)?.f_reciprocal()?)
            }
            ByLength::Dynamic { .. } => Ok(self.inv_freq.shallow_clone()),
        }
    }

    /// cos and signed sin tables for the given positions, in `kind`: `cos(θ)` and
    /// `[−sin(θ), sin(θ)]` (the first half negated), the form [`apply_rotary`] takes.
    ///
    /// With the multimodal RoPE, positions may be `[3, batch, seq]` (time, height, width): each
    /// frequency turns with its axis's position (transformers' `mrope_section` split). Plain
    /// `[batch, seq]` positions are the same on every axis.
    ///
    /// # Shapes
    /// - `position_ids`: `[batch, seq]` or `[3, batch, seq]` (int64)
    /// - returns: `([batch, 1, seq, rotary_dim], [batch, 1, seq, rotary_dim])`
    pub fn cos_sin(&self, position_ids: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let inv_freq = self.inv_freq_for(position_ids)?;
        let pos = position_ids.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?; // [b, s, 1] or [3, b, s, 1]
        let freqs = match (position_ids.dim(), &self.axes) {
            (2, _) => pos.f_mul(&inv_freq)?,
            (3, Some(axes)) => {
                let all = pos.f_mul(&inv_freq)?; // [3, b, s, d/2]
                let (_, b, s, half) = all.size4()?;
                let pick = axes.f_view([1, 1, 1, half])?.f_expand([1, b, s, half], false)?;
                all.f_gather(0, &pick, false)?.f_squeeze_dim(0)? // [b, s, d/2]
            }
            _ => {
                return Err(crate::error::ModelError::Input(format!(
                    "position ids {:?}: expected [batch, seq]{}",
                    position_ids.size(),
                    if self.axes.is_some() { " or [3, batch, seq]" } else { "" }
                )))
            }
        };
        let freqs = freqs.f_unsqueeze(1)?; // [b, 1, s, d/2]
        let (cos, sin) = (freqs.f_cos()?, freqs.f_sin()?);
        let cos = Tensor::f_cat(&[&cos, &cos], -1)?; // [b, 1, s, d]
        let sin = Tensor::f_cat(&[&sin.f_neg()?, &sin], -1)?; // [b, 1, s, d]
        if self.attention_scaling == 1.0 {
            return Ok((cos.f_to_kind(kind)?, sin.f_to_kind(kind)?));
        }
        let a = self.attention_scaling;
        Ok((cos.f_mul_scalar(a)?.f_to_kind(kind)?, sin.f_mul_scalar(a)?.f_to_kind(kind)?))
    }
}

/// YaRN's blended frequencies (transformers' `_compute_yarn_parameters`).
fn yarn_inv_freq(cfg: &RopeConfig, dim: i64, device: tch::Device) -> Result<Tensor> {
    let RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } =
        cfg.scaling
    else {
        unreachable!("yarn_inv_freq on another scaling")
    };
    let base = cfg.theta;
    let d = dim as f64;
    // The dimension at which a frequency turns `rotations` times over the original context.
    let correction_dim = |rotations: f64| {
        d * (original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001; // no singularity
    }
    let pos_freqs = powers(&Tensor::f_scalar_tensor(base, (Kind::Float, device))?, dim)?; // [d/2]
    let extrapolation = pos_freqs.f_reciprocal()?;
    let interpolation = pos_freqs.f_mul_scalar(factor)?.f_reciprocal()?;
    let ramp = Tensor::f_arange(dim / 2, (Kind::Float, device))?
        .f_sub_scalar(low)?
        .f_div_scalar(high - low)?
        .f_clamp(0.0, 1.0)?;
    let extrapolation_factor = ramp.f_neg()?.f_add_scalar(1.0)?; // 1 − ramp
    let keep = extrapolation_factor.f_neg()?.f_add_scalar(1.0)?; // 1 − (1 − ramp)
    Ok(interpolation.f_mul(&keep)?.f_add(&extrapolation.f_mul(&extrapolation_factor)?)?)
}

/// Applies rotary embeddings to q or k (rotate-half layout, as Hugging Face checkpoints store
/// them); with tables narrower than the head, only its leading dimensions rotate.
///
/// transformers computes `x·cos + rotate_half(x)·sin` with `rotate_half(x) = [−x₂, x₁]`; with
/// the signed table `sin' = [−sin, sin]` of [`Rotary::cos_sin`] that is `x·cos + [x₂, x₁]·sin'`,
/// the same products (a sign flip is exact) in four kernels instead of six: the halves swapped
/// by one `flip`, two products and a sum.
///
/// # Shapes
/// - `x`: `[batch, heads, seq, head_dim]`; `cos`, `sin`: `[batch, 1, seq, rotary_dim]` → like `x`
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let size = x.size();
    let (d, r) = (size[3], cos.size()[3]);
    if r < d {
        let rotated = apply_rotary(&x.f_narrow(3, 0, r)?, cos, sin)?;
        return Ok(Tensor::f_cat(&[&rotated, &x.f_narrow(3, r, d - r)?], 3)?);
    }
    let halves = x.f_unflatten(3, [2, d / 2])?; // [b, h, s, 2, d/2]
    let swapped = halves.f_flip([3])?.f_view([size[0], size[1], size[2], d])?; // [x₂, x₁]
    Ok(x.f_mul(cos)?.f_add(&swapped.f_mul(sin)?)?)
}
