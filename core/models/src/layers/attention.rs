//! Self-attention of the rotary decoders: grouped key/value heads, separate or fused (`qkv_proj`,
//! Phi-3) projections, optional q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection
//! (OLMo 2), a softmax scale of its own (Gemma's `query_pre_attn_scalar`), an output gate
//! (Qwen3.5), soft-capped scores (Gemma 2) or attention sinks (gpt-oss), which
//! `scaled_dot_product_attention` cannot compute, through an eager path, and Gemma 4's normalised
//! values, values that are the keys, and layers reusing an earlier layer's keys and values.

use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Kind, Tensor};

use super::{apply_rotary, FusedRows, KvCache, Linear, RmsNorm};
use crate::config::{ArchConfig, QkNorm};
use crate::error::Result;
use crate::weights::WeightLoader;

/// Logs once per process and kind of pass which kernel `scaled_dot_product_attention` picks on
/// CUDA for these inputs (libtorch's own choice, `_fused_sdp_choice`).
fn log_sdpa_choice(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: Option<f64>, gqa: bool, decode: bool) {
    static LOGGED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
    if !q.device().is_cuda() || LOGGED[usize::from(decode)].swap(true, Ordering::Relaxed) {
        return;
    }
    let name = match Tensor::f_internal_fused_sdp_choice(q, k, v, Some(mask), 0.0, false, scale, gqa) {
        Ok(0) => "math (unfused)",
        Ok(1) => "flash attention",
        Ok(2) => "memory-efficient attention",
        Ok(3) => "cuDNN attention",
        Ok(_) => "another",
        Err(_) => "unknown",
    };
    let pass = if decode { "decode steps" } else { "prompts and training" };
    tracing::info!("attention: scaled_dot_product_attention runs its {name} kernel for {pass} ({:?})", q.kind());
}

/// The q, k and v projections.
#[derive(Debug)]
enum Qkv {
    /// Three checkpoint tensors, stored back to back in one buffer ([`FusedRows`]).
    Separate { q_proj: Linear, k_proj: Linear, v_proj: Linear, fused: Option<FusedRows> },
    /// One `[q; k; v]` projection, split after.
    Fused(Linear),
    /// Queries and keys, the values being the keys (Gemma 4's `attention_k_eq_v`).
    KeysAsValues { q_proj: Linear, k_proj: Linear },
    /// Queries only: the layer attends to an earlier layer's keys and values (Gemma 4).
    QueryOnly(Linear),
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
    /// `q_proj` gives per head `[q; gate]` and the output is `· sigmoid(gate)` (Qwen3.5).
    output_gate: bool,
    /// Per head, a logit that joins the softmax and attends to nothing (`sinks: [heads]`, gpt-oss).
    sinks: Option<Tensor>,
    /// Values RMS-normalised per head without a weight, with this epsilon (Gemma 4).
    v_norm: Option<f64>,
}

impl Attention {
    /// Loads the `self_attn` scope of layer `layer`.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, layer: usize) -> Result<Self> {
        let geometry = cfg.heads(layer);
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_heads, geometry.kv_heads, geometry.head_dim);
        let q_out = if cfg.attn_output_gate { 2 * nh * hd } else { nh * hd };
        let values_are_keys = cfg.gemma4.as_ref().is_some_and(|g| g.values_are_keys[layer]);
        let reuses = cfg.kv_source(layer).is_some();
        let qkv = if cfg.fused_qkv {
            Qkv::Fused(Linear::load(&w.pp("qkv_proj"), h, (nh + 2 * nkv) * hd, cfg.qkv_bias)?)
        } else if reuses {
            Qkv::QueryOnly(Linear::load(&w.pp("q_proj"), h, q_out, cfg.qkv_bias)?)
        } else if values_are_keys {
            let q_proj = Linear::load(&w.pp("q_proj"), h, q_out, cfg.qkv_bias)?;
            Qkv::KeysAsValues { q_proj, k_proj: Linear::load(&w.pp("k_proj"), h, nkv * hd, cfg.qkv_bias)? }
        } else {
            let mut q_proj = Linear::load(&w.pp("q_proj"), h, q_out, cfg.qkv_bias)?;
            let mut k_proj = Linear::load(&w.pp("k_proj"), h, nkv * hd, cfg.qkv_bias)?;
            let mut v_proj = Linear::load(&w.pp("v_proj"), h, nkv * hd, cfg.qkv_bias)?;
            let fused = FusedRows::new(&mut [&mut q_proj, &mut k_proj, &mut v_proj])?;
            Qkv::Separate { q_proj, k_proj, v_proj, fused }
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
            k_norm: if reuses { None } else { norm("k_norm", k_dim)? },
            qk_norm: cfg.qk_norm,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: cfg.attn_scale,
            softcap: cfg.attn_softcap,
            output_gate: cfg.attn_output_gate,
            sinks: if cfg.attn_sinks { Some(w.get("sinks", &[nh])?) } else { None },
            v_norm: cfg.gemma4.as_ref().map(|_| cfg.norm_eps),
        })
    }

    /// The linear layers with their names below `self_attn`.
    /// Lets go of the q/k/v buffer ([`FusedRows::release`]).
    pub(crate) fn release_buffers(&mut self) {
        if let Qkv::Separate { fused: Some(f), .. } = &mut self.qkv {
            f.release();
        }
    }

    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = match &mut self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj, .. } => {
                vec![("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
            }
            Qkv::Fused(l) => vec![("qkv_proj", l)],
            Qkv::KeysAsValues { q_proj, k_proj } => vec![("q_proj", q_proj), ("k_proj", k_proj)],
            Qkv::QueryOnly(q_proj) => vec![("q_proj", q_proj)],
        };
        out.push(("o_proj", &mut self.o_proj));
        out
    }

    /// [`Attention::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = match &self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj, .. } => {
                vec![("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", v_proj)]
            }
            Qkv::Fused(l) => vec![("qkv_proj", l)],
            Qkv::KeysAsValues { q_proj, k_proj } => vec![("q_proj", q_proj), ("k_proj", k_proj)],
            Qkv::QueryOnly(q_proj) => vec![("q_proj", q_proj)],
        };
        out.push(("o_proj", &self.o_proj));
        out
    }

    /// The q, k and v projections side by side, `[b, s, (heads + 2 · kv_heads) · head_dim]` (with
    /// an output gate, `[b, s, (2 · heads + 2 · kv_heads) · head_dim]`: per head `[q; gate]` first).
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        match &self.qkv {
            Qkv::Separate { q_proj, k_proj, v_proj, fused } => {
                let parts = [q_proj, k_proj, v_proj];
                match FusedRows::try_forward(fused.as_ref(), &parts, x)? {
                    Some(qkv) => Ok(qkv),
                    None => Ok(Tensor::f_cat(&[q_proj.forward(x)?, k_proj.forward(x)?, v_proj.forward(x)?], -1)?),
                }
            }
            Qkv::Fused(l) => l.forward(x),
            Qkv::KeysAsValues { q_proj, k_proj } => {
                let k = k_proj.forward(x)?;
                Ok(Tensor::f_cat(&[&q_proj.forward(x)?, &k, &k], -1)?)
            }
            Qkv::QueryOnly(q_proj) => q_proj.forward(x),
        }
    }

    /// Rotated queries and keys, `([b, heads, s, hd], [b, kv_heads, s, hd])`, the values
    /// `[b, s, kv_heads · hd]` and, where the model has one, the output gate `[b, s, heads · hd]`,
    /// from the projections (see [`Attention::project`]), with the q/k norms the model has.
    /// Without norms, q and k are rotated together (one set of kernels for both). The parts are
    /// taken with one `split_with_sizes` each, whose backward is one `cat`: a `narrow` per part
    /// would each write its gradient into a zeroed tensor of the whole projection's size.
    fn split_rotated(
        &self,
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let (b, s) = (qkv.size()[0], qkv.size()[1]);
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let heads = |t: &Tensor, n: i64| -> Result<Tensor> { Ok(t.f_view([b, s, n, hd])?.f_transpose(1, 2)?) };
        if self.q_norm.is_none() && !self.output_gate {
            let [qk, v] = two(qkv.f_split_with_sizes([(nh + nkv) * hd, nkv * hd], -1)?)?;
            let [q, k] = two(apply_rotary(&heads(&qk, nh + nkv)?, cos, sin)?.f_split_with_sizes([nh, nkv], 1)?)?;
            return Ok((q, k, v, None));
        }
        let parts = qkv.f_split_with_sizes([self.q_width(), nkv * hd, nkv * hd], -1)?;
        let (q, gate) = if self.output_gate {
            let [q, gate] = two(parts[0].f_view([b, s, nh, 2 * hd])?.f_split_with_sizes([hd, hd], -1)?)?;
            (q.f_reshape([b, s, nh * hd])?, Some(gate.f_reshape([b, s, nh * hd])?))
        } else {
            (parts[0].shallow_clone(), None)
        };
        let k = &parts[1];
        let (q, k) = match (self.qk_norm, &self.q_norm, &self.k_norm) {
            (QkNorm::PerHead, Some(qn), Some(kn)) => (qn.forward(&heads(&q, nh)?)?, kn.forward(&heads(k, nkv)?)?),
            (QkNorm::Projection, Some(qn), Some(kn)) => (heads(&qn.forward(&q)?, nh)?, heads(&kn.forward(k)?, nkv)?),
            _ => (heads(&q, nh)?, heads(k, nkv)?),
        };
        Ok((apply_rotary(&q, cos, sin)?, apply_rotary(&k, cos, sin)?, parts[2].shallow_clone(), gate))
    }

    /// Width of the query projection's output (with the gate where there is one).
    fn q_width(&self) -> i64 {
        let q = self.num_heads * self.head_dim;
        if self.output_gate {
            2 * q
        } else {
            q
        }
    }

    /// Attends over the keys and values of `x` (after the cached ones), or with `reuse` over an
    /// earlier layer's (Gemma 4's shared layers, which cache nothing); also returns the keys and
    /// values attended to, for the layers that reuse them.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`; `cos`, `sin`: `[batch, 1, seq, rotary_dim]`;
    ///   `mask`: `[batch, 1, seq, keys]` (bool) → `[batch, seq, hidden]`, where `keys` is
    ///   `past + seq`, or the cache's capacity in a decode step that writes at a slot; `reuse` and
    ///   the returned keys and values: `([batch, kv_heads, keys, head_dim], same)`
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
        reuse: Option<(Tensor, Tensor)>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qkv = self.project(x)?;
        let (q, (k, v), gate) = match reuse {
            Some(kv) => {
                let q = qkv.f_view([b, s, nh, hd])?;
                let q = match &self.q_norm {
                    Some(n) => n.forward(&q)?,
                    None => q,
                };
                (apply_rotary(&q.f_transpose(1, 2)?, cos, sin)?, kv, None)
            }
            None => {
                let (q, k, v, gate) = self.split_rotated(&qkv, cos, sin)?;
                let mut v = v.f_view([b, s, nkv, hd])?;
                if let Some(eps) = self.v_norm {
                    v = v.f_rms_norm([hd], None::<&Tensor>, eps)?;
                }
                let v = v.f_transpose(1, 2)?;
                let kv = match cache {
                    Some((cache, layer)) => cache.append(layer, &k, &v)?, // [b, kv, keys, hd]
                    None => (k, v),
                };
                (q, kv, gate)
            }
        };
        let eager = self.softcap.is_some() || self.sinks.is_some();
        let y = match () {
            _ if eager => self.eager(&q, &k, &v, mask)?,
            // One query per row with grouped keys: the `heads / kv_heads` queries that share a key
            // head are attended as that head's rows ([b, kv, groups, hd]), so every SDPA kernel
            // takes them without `enable_gqa` and the keys are read once per group.
            _ if s == 1 && nh != nkv => {
                let grouped = q.f_reshape([b, nkv, nh / nkv, hd])?;
                log_sdpa_choice(&grouped, &k, &v, mask, self.scale, false, true);
                let y = Tensor::f_scaled_dot_product_attention(
                    &grouped,
                    &k,
                    &v,
                    Some(mask),
                    0.0,
                    false,
                    self.scale,
                    false,
                )?;
                y.f_reshape([b, nh, 1, hd])?
            }
            _ => {
                let gqa = nh != nkv;
                log_sdpa_choice(&q, &k, &v, mask, self.scale, gqa, s == 1);
                Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, self.scale, gqa)?
            }
        };
        let mut y = y.f_transpose(1, 2)?.f_reshape([b, s, nh * hd])?;
        if let Some(gate) = gate {
            y = y.f_mul(&gate.f_sigmoid()?)?;
        }
        Ok((self.o_proj.forward(&y)?, (k, v)))
    }

    /// Attention with soft-capped scores or sinks, as transformers' `eager_attention_forward`:
    /// `softmax(cap · tanh(q kᵀ · scale / cap) + mask)` in f32, then `· v`; with sinks, each head's
    /// sink logit is one more column of the softmax, dropped after it (gpt-oss).
    ///
    /// # Shapes
    /// - `q`: `[b, heads, s, hd]`; `k`, `v`: `[b, kv_heads, t, hd]`; `mask`: `[b, 1, s, t]` → `[b, heads, s, hd]`
    fn eager(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let groups = self.num_heads / self.num_kv_heads;
        let (k, v) = if groups > 1 {
            (k.f_repeat_interleave_self_int(groups, 1, None)?, v.f_repeat_interleave_self_int(groups, 1, None)?)
        } else {
            (k.shallow_clone(), v.shallow_clone())
        };
        let scale = self.scale.unwrap_or(1.0 / (self.head_dim as f64).sqrt());
        let mut scores = q.f_matmul(&k.f_transpose(2, 3)?)?.f_mul_scalar(scale)?; // [b, h, s, t]
        if let Some(cap) = self.softcap {
            scores = scores.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        let scores = scores.f_masked_fill(&mask.f_logical_not()?, f64::NEG_INFINITY)?;
        let probs = match &self.sinks {
            Some(sinks) => {
                let (b, h, s, t) = (scores.size()[0], scores.size()[1], scores.size()[2], scores.size()[3]);
                let sink = sinks.f_to_kind(scores.kind())?.f_view([1, h, 1, 1])?.f_expand([b, h, s, 1], false)?;
                let all = Tensor::f_cat(&[&scores, &sink], -1)?.f_softmax(-1, Kind::Float)?; // [b, h, s, t + 1]
                all.f_narrow(-1, 0, t)?
            }
            None => scores.f_softmax(-1, Kind::Float)?,
        };
        Ok(probs.f_to_kind(q.kind())?.f_matmul(&v)?)
    }
}

/// The two parts of a split.
fn two(parts: Vec<Tensor>) -> Result<[Tensor; 2]> {
    <[Tensor; 2]>::try_from(parts)
        .map_err(|p| crate::error::ModelError::Input(format!("expected 2 parts, got {}", p.len())))
}
