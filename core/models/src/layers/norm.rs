//! Normalisation layers: the RMSNorm variants of the rotary families and GPT-2's LayerNorm.

use tch::{Kind, Tensor};

use crate::config::NormKind;
use crate::error::Result;
use crate::weights::WeightLoader;

/// RMSNorm (Zhang & Sennrich 2019) in the variant [`NormKind`] names: normalise in fp32, then
/// scale by `w` (cast back first: Llama; cast back after: OLMo 2) or by `1 + w` (Gemma).
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
    kind: NormKind,
}

impl RmsNorm {
    /// Loads `weight: [dim]` of a Llama RMSNorm.
    pub fn load(w: &WeightLoader, dim: i64, eps: f64) -> Result<Self> {
        Self::load_kind(w, dim, eps, NormKind::Rms)
    }

    /// Loads `weight: [dim]` of an RMSNorm of the given kind.
    pub fn load_kind(w: &WeightLoader, dim: i64, eps: f64, kind: NormKind) -> Result<Self> {
        Ok(RmsNorm { weight: w.get("weight", &[dim])?, eps, kind })
    }

    /// libtorch's `rms_norm` normalises in f32 and casts back (one kernel on CUDA), then scales
    /// in f32 when given the weight: so `rms_norm(x) · w` is Llama's formula and `rms_norm(x, w)`
    /// OLMo 2's, exactly (checked against the composite below in f32 and bf16). Gemma's `1 + w`
    /// keeps the composite.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = [self.weight.size()[0]];
        Ok(match self.kind {
            NormKind::Rms => x.f_rms_norm(dim, None::<&Tensor>, self.eps)?.f_mul(&self.weight)?,
            NormKind::RmsScaleInF32 if self.weight.kind() == x.kind() => {
                x.f_rms_norm(dim, Some(&self.weight), self.eps)?
            }
            _ => self.composite(x)?,
        })
    }

    /// The formulas written out: normalise in fp32, then scale by `w` (cast back first: Llama;
    /// cast back after: OLMo 2) or by `1 + w` (Gemma).
    ///
    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn composite(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.kind();
        let xf = x.f_to_kind(Kind::Float)?;
        let var = xf.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
        let normed = xf.f_mul(&var.f_add_scalar(self.eps)?.f_rsqrt()?)?; // f32
        Ok(match self.kind {
            NormKind::Rms => normed.f_to_kind(kind)?.f_mul(&self.weight)?,
            // `weight * x` promotes to f32 before the cast back.
            NormKind::RmsScaleInF32 => self.weight.f_mul(&normed)?.f_to_kind(kind)?,
            NormKind::Gemma => {
                let scale = self.weight.f_to_kind(Kind::Float)?.f_add_scalar(1.0)?;
                normed.f_mul(&scale)?.f_to_kind(kind)?
            }
        })
    }
}

/// LayerNorm with weight and bias (GPT-2).
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    eps: f64,
    dim: i64,
}

impl LayerNorm {
    /// Loads `weight: [dim]`, `bias: [dim]`.
    pub fn load(w: &WeightLoader, dim: i64, eps: f64) -> Result<Self> {
        Ok(LayerNorm { weight: w.get("weight", &[dim])?, bias: w.get("bias", &[dim])?, eps, dim })
    }

    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_layer_norm([self.dim], Some(&self.weight), Some(&self.bias), self.eps, true)?)
    }
}
