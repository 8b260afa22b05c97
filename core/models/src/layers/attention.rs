//! Self-attention of the rotary decoders: grouped key/value heads, separate or fused (`qkv_proj`,
//! Phi-3) projections, optional q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection
//! (OLMo 2), a softmax scale of its own (Gemma's `query_pre_attn_scalar`), and soft-capped scores
//! (Gemma 2), which `scaled_dot_product_attention` cannot compute, through an eager path.

use tch::{Kind, Tensor};

use super::{apply_rotary, KvCache, Linear, RmsNorm};
use crate::config::{ArchConfig, QkNorm};
use crate::error::Result;
use crate::weights::WeightLoader;

/// The q, k and v projections.
#[derive(Debug)]
enum Qkv {
    Separate {
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
    },
    /// One `[q; k; v]` projection, split after.
    Fused(Linear),
}

/// Self-attention with grouped key/value heads.
#[derive(Debug)]
pub struct Attention {
    qkv: Qkv,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    qk_norm: QkNorm,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    /// Softmax scale; `None` = 1/√head_dim.
    scale: Option<f64>,
    softcap: Option<f64>,
}

impl Attention {
    /// Loads the `self_attn` scope of a layer.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let qkv = if cfg.fused_qkv {
            Qkv::Fused(Linear::load(&w.pp("qkv_proj"), h, (nh + 2 * nkv) * hd, cfg.qkv_bias)?)
        } else {
            Qkv::Separate {
                q_proj: Linear::load(&w.pp("q_proj"), h, nh * hd, cfg.qkv_bias)?,
                k_proj: Linear::load(&w.pp("k_proj"), h, nkv * hd, cfg.qkv_bias)?,
                v_proj: Linear::load(&w.pp("v_proj"), h, nkv * hd, cfg.qkv_bias)?,
            }
        };
        let (q_dim, k_dim) = match cfg.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (hd, hd),
            QkNorm::Projection => (nh * hd, nkv * hd),
        };
        let norm = |name: &str, dim: i64| -> Result<Option<RmsNorm>> {
            if dim == 0 {
                return Ok(None);
            }
            Ok(Some(RmsNorm::load_kind(&w.pp(name), dim, cfg.norm_eps, cfg.norm)?))
        };
        Ok(Attention {
            qkv,
            o_proj: Linear::load(&w.pp("o_proj"), nh * hd, h, cfg.o_bias)?,
            q_norm: norm("q_norm", q_dim)?,
            k_norm: norm("k_norm", k_dim)?,
            qk_norm: cfg.qk_norm,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: cfg.attn_scale,
            softcap: cfg.attn_softcap,
        })
    }

    /// The linear layers with their names below `self_attn`.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = match &mut self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj } => {
                vec![("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
            }
            Qkv::Fused(l) => vec![("qkv_proj", l)],
        };
        out.push(("o_proj", &mut self.o_proj));
        out
    }

    /// [`Attention::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = match &self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj } => {
                vec![("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
            }
            Qkv::Fused(l) => vec![("qkv_proj", l)],
        };
        out.push(("o_proj", &self.o_proj));
        out
    }

    /// `(q, k, v)` projections, `[b, s, heads · head_dim]` each, with a whole-projection norm.
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = match &self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj } => (q_proj.forward(x)?, k_proj.forward(x)?, v_proj.forward(x)?),
            Qkv::Fused(l) => {
                let qkv = l.forward(x)?;
                let (q_len, kv_len) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
                let parts = qkv.f_split_with_sizes([q_len, kv_len, kv_len], -1)?;
                (parts[0].shallow_clone(), parts[1].shallow_clone(), parts[2].shallow_clone())
            }
        };
        if self.qk_norm == QkNorm::Projection {
            let (qn, kn) = (self.q_norm.as_ref(), self.k_norm.as_ref());
            if let (Some(qn), Some(kn)) = (qn, kn) {
                return Ok((qn.forward(&q)?, kn.forward(&k)?, v));
            }
        }
        Ok((q, k, v))
    }

    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`; `cos`, `sin`: `[batch, 1, seq, rotary_dim]`;
    ///   `mask`: `[batch, 1, seq, past + seq]` (bool) → `[batch, seq, hidden]`
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let split = |t: Tensor, heads: i64| -> Result<Tensor> {
            Ok(t.f_view([b, s, heads, self.head_dim])?.f_transpose(1, 2)?) // [b, heads, s, hd]
        };
        let (q, k, v) = self.project(x)?;
        let mut q = split(q, self.num_heads)?;
        let mut k = split(k, self.num_kv_heads)?;
        let v = split(v, self.num_kv_heads)?;
        if self.qk_norm == QkNorm::PerHead {
            if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
                q = qn.forward(&q)?;
                k = kn.forward(&k)?;
            }
        }
        let q = apply_rotary(&q, cos, sin)?;
        let k = apply_rotary(&k, cos, sin)?;
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v)?, // [b, kv, past + s, hd]
            None => (k, v),
        };
        let y = match self.softcap {
            Some(cap) => self.eager(&q, &k, &v, mask, cap)?,
            None => {
                let gqa = self.num_heads != self.num_kv_heads;
                Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, self.scale, gqa)?
            }
        };
        let y = y.f_transpose(1, 2)?.f_reshape([b, s, self.num_heads * self.head_dim])?;
        self.o_proj.forward(&y)
    }

    /// Attention with soft-capped scores, as transformers' `eager_attention_forward`:
    /// `softmax(cap · tanh(q kᵀ · scale / cap) + mask)` in f32, then `· v`.
    ///
    /// # Shapes
    /// - `q`: `[b, heads, s, hd]`; `k`, `v`: `[b, kv_heads, t, hd]`; `mask`: `[b, 1, s, t]` → `[b, heads, s, hd]`
    fn eager(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, cap: f64) -> Result<Tensor> {
        let groups = self.num_heads / self.num_kv_heads;
        let (k, v) = if groups > 1 {
            (k.f_repeat_interleave_self_int(groups, 1, None)?, v.f_repeat_interleave_self_int(groups, 1, None)?)
        } else {
            (k.shallow_clone(), v.shallow_clone())
        };
        let scale = self.scale.unwrap_or(1.0 / (self.head_dim as f64).sqrt());
        let scores = q.f_matmul(&k.f_transpose(2, 3)?)?.f_mul_scalar(scale)?; // [b, h, s, t]
        let scores = scores.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        let scores = scores.f_masked_fill(&mask.f_logical_not()?, f64::NEG_INFINITY)?;
        let probs = scores.f_softmax(-1, Kind::Float)?.f_to_kind(q.kind())?;
        Ok(probs.f_matmul(&v)?)
    }
}
