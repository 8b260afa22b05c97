//! Gated DeltaNet linear attention (Yang, Kautz & Hatamizadeh 2024), as Qwen3.5 and Qwen3-Next
//! use it — transformers' `Qwen3_5GatedDeltaNet`:
//!
//! ```text
//! [q; k; v] = silu(causal_conv1d(in_proj_qkv(x)))      depthwise, kernel `linear_conv_kernel_dim`
//! β = sigmoid(in_proj_b(x));  g = −exp(A_log) · softplus(in_proj_a(x) + dt_bias)
//! o = gated_delta_rule(q, k, v, g, β)                  see [`super::delta_rule`]
//! y = out_proj(rmsnorm(o) · w · silu(in_proj_z(x)))    per value head
//! ```
//!
//! Padding tokens enter as zeros (transformers' `apply_mask_to_padding_states`), so a left-padded
//! row computes what it computes alone. With a cache the layer continues from its state (the last
//! `kernel − 1` convolution inputs and the recurrent state) and leaves the new one there; a
//! single new token takes the recurrent form, more take the chunked one.

use tch::{Kind, Tensor};

use super::{activate, delta_rule, CacheLayer, FusedRows, KvCache, Linear};
use crate::config::{Activation, ArchConfig, LinearAttnConfig};
use crate::error::{ModelError, Result};
use crate::weights::WeightLoader;

/// The input projections, as the checkpoint stores them.
#[derive(Debug)]
enum Projections {
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, each part whole.
    Split { qkv: Linear, z: Linear, b: Linear, a: Linear },
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, each grouped by key head (per key head its
    /// q, k, then the v and z of the value heads it serves; its b's, then its a's).
    Grouped { qkvz: Linear, ba: Linear },
}

impl Projections {
    fn parts(&self) -> Vec<&Linear> {
        match self {
            Projections::Split { qkv, z, b, a } => vec![qkv, z, b, a],
            Projections::Grouped { qkvz, ba } => vec![qkvz, ba],
        }
    }

    fn named_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match self {
            Projections::Split { qkv, z, b, a } => {
                vec![("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)]
            }
            Projections::Grouped { qkvz, ba } => vec![("in_proj_qkvz", qkvz), ("in_proj_ba", ba)],
        }
    }

    fn named(&self) -> Vec<(&'static str, &Linear)> {
        match self {
            Projections::Split { qkv, z, b, a } => {
                vec![("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)]
            }
            Projections::Grouped { qkvz, ba } => vec![("in_proj_qkvz", qkvz), ("in_proj_ba", ba)],
        }
    }
}

/// A Gated DeltaNet layer (`linear_attn`).
#[derive(Debug)]
pub struct GatedDeltaNet {
    proj: Projections,
    /// The input projections in one buffer (one GEMM).
    fused: Option<FusedRows>,
    conv_weight: Tensor, // [conv_dim, 1, kernel]
    dt_bias: Tensor,     // [value_heads]
    a_log: Tensor,       // [value_heads]
    norm_weight: Tensor, // [value_head_dim]
    out_proj: Linear,
    cfg: LinearAttnConfig,
    activation: Activation,
    eps: f64,
}

/// What the linear-attention layers of one forward share, from its key mask.
///
/// # Shapes
/// `token_mask`: `[batch, seq]` bool (real tokens); `starts`: `[batch, seq]` bool (a packed row's
/// sequence starts)
#[derive(Debug, Default)]
pub struct LinearShared {
    pub token_mask: Option<Tensor>,
    pub starts: Option<Tensor>,
}

impl LinearShared {
    /// From the segment ids of this forward's tokens (see [`super::attention_mask`]): padding
    /// masked, and in a packed row (a segment id above 1) the tokens where a new sequence begins.
    /// One value is read back to the host (whether the row is packed), so a decode step (one
    /// token, never padding) takes [`LinearShared::default`].
    ///
    /// # Shapes
    /// - `segs`: `[batch, seq]` (integer)
    pub fn new(segs: &Tensor) -> Result<Self> {
        let segs = segs.f_to_kind(Kind::Int64)?;
        let s = segs.size()[1];
        let token_mask = Some(segs.f_ne(0)?);
        let packed = s > 1 && segs.f_max()?.f_int64_value(&[])? > 1;
        let starts = if packed {
            let prev = Tensor::f_cat(&[&segs.f_narrow(1, 0, 1)?, &segs.f_narrow(1, 0, s - 1)?], 1)?; // segs[t − 1]
            Some(segs.f_ne_tensor(&prev)?)
        } else {
            None
        };
        Ok(LinearShared { token_mask, starts })
    }
}

impl GatedDeltaNet {
    /// Loads the `linear_attn` scope of a layer.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let l = cfg.linear_attn.ok_or_else(|| ModelError::Input("linear attention without its sizes".into()))?;
        let h = cfg.hidden_size;
        let value_dim = l.num_value_heads * l.value_head_dim;
        let (proj, fused) = if l.grouped_projections {
            let mut qkvz = Linear::load(&w.pp("in_proj_qkvz"), h, l.conv_dim() + value_dim, false)?;
            let mut ba = Linear::load(&w.pp("in_proj_ba"), h, 2 * l.num_value_heads, false)?;
            let fused = FusedRows::new(&mut [&mut qkvz, &mut ba])?;
            (Projections::Grouped { qkvz, ba }, fused)
        } else {
            let mut qkv = Linear::load(&w.pp("in_proj_qkv"), h, l.conv_dim(), false)?;
            let mut z = Linear::load(&w.pp("in_proj_z"), h, value_dim, false)?;
            let mut b = Linear::load(&w.pp("in_proj_b"), h, l.num_value_heads, false)?;
            let mut a = Linear::load(&w.pp("in_proj_a"), h, l.num_value_heads, false)?;
            let fused = FusedRows::new(&mut [&mut qkv, &mut z, &mut b, &mut a])?;
            (Projections::Split { qkv, z, b, a }, fused)
        };
        Ok(GatedDeltaNet {
            proj,
            fused,
            conv_weight: w.pp("conv1d").get("weight", &[l.conv_dim(), 1, l.conv_kernel])?,
            dt_bias: w.get("dt_bias", &[l.num_value_heads])?,
            a_log: w.get("A_log", &[l.num_value_heads])?,
            norm_weight: w.pp("norm").get("weight", &[l.value_head_dim])?,
            out_proj: Linear::load(&w.pp("out_proj"), value_dim, h, false)?,
            cfg: l,
            activation: cfg.activation,
            eps: cfg.norm_eps,
        })
    }

    /// What this layer keeps in a cache.
    pub fn cache_layer(&self) -> CacheLayer {
        let cfg = &self.cfg;
        CacheLayer::Linear {
            conv_dim: cfg.conv_dim(),
            conv_len: cfg.conv_kernel - 1,
            heads: cfg.num_value_heads,
            key_dim: cfg.key_head_dim,
            value_dim: cfg.value_head_dim,
        }
    }

    /// `(conv state, recurrent state)` of an empty cache for `batch` rows.
    fn zero_state(&self, batch: i64, kind: Kind, device: tch::Device) -> Result<(Tensor, Tensor)> {
        let l = &self.cfg;
        Ok((
            Tensor::f_zeros([batch, l.conv_dim(), l.conv_kernel - 1], (kind, device))?,
            Tensor::f_zeros([batch, l.num_value_heads, l.key_head_dim, l.value_head_dim], (Kind::Float, device))?,
        ))
    }

    /// The linear layers with their names below `linear_attn`.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = self.proj.named_mut();
        out.push(("out_proj", &mut self.out_proj));
        out
    }

    /// [`GatedDeltaNet::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = self.proj.named();
        out.push(("out_proj", &self.out_proj));
        out
    }

    /// The input projections side by side in Qwen3.5's order, `[b, s, conv_dim + value_dim +
    /// 2 · heads]`: q, k, v (each all heads), z, β's and a's inputs.
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        let parts = self.proj.parts();
        let all = match FusedRows::try_forward(self.fused.as_ref(), &parts, x)? {
            Some(all) => all,
            None => Tensor::f_cat(&parts.iter().map(|p| p.forward(x)).collect::<Result<Vec<_>>>()?, -1)?,
        };
        if matches!(self.proj, Projections::Split { .. }) {
            return Ok(all);
        }
        // Grouped by key head: per key head [q; k; v·rep; z·rep], then per key head [b·rep; a·rep].
        let l = &self.cfg;
        let (b, s) = (x.size()[0], x.size()[1]);
        let (hk, dk, rep, dv) =
            (l.num_key_heads, l.key_head_dim, l.num_value_heads / l.num_key_heads, l.value_head_dim);
        let width = 2 * dk + 2 * rep * dv;
        let qkvz = all.f_narrow(-1, 0, hk * width)?.f_view([b, s, hk, width])?;
        let ba = all.f_narrow(-1, hk * width, 2 * l.num_value_heads)?.f_view([b, s, hk, 2 * rep])?;
        let part = |t: &Tensor, from: i64, len: i64| -> Result<Tensor> {
            Ok(t.f_narrow(-1, from, len)?.f_reshape([b, s, hk * len])?)
        };
        let pieces = [
            part(&qkvz, 0, dk)?,
            part(&qkvz, dk, dk)?,
            part(&qkvz, 2 * dk, rep * dv)?,
            part(&qkvz, 2 * dk + rep * dv, rep * dv)?,
            part(&ba, 0, rep)?,
            part(&ba, rep, rep)?,
        ];
        Ok(Tensor::f_cat(&pieces, -1)?)
    }

    /// The causal depthwise convolution and its activation; with a cache state, continued from
    /// the inputs before (returned as the new state: the last `kernel − 1` inputs).
    ///
    /// # Shapes
    /// - `mixed`: `[b, conv_dim, s]`; `conv_state`: `[b, conv_dim, kernel − 1]`; `starts`:
    ///   `[b, s]` → (`[b, conv_dim, s]`, the new state)
    fn conv(
        &self,
        mixed: &Tensor,
        conv_state: Option<&Tensor>,
        starts: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (c, s, kernel) = (self.cfg.conv_dim(), mixed.size()[2], self.cfg.conv_kernel);
        let w = self.conv_weight.f_to_kind(mixed.kind())?;
        let no_bias: Option<&Tensor> = None;
        let (out, state) = match (conv_state, starts) {
            (Some(prev), _) => {
                let full = Tensor::f_cat(&[&prev.f_to_kind(mixed.kind())?, mixed], 2)?; // [b, c, kernel − 1 + s]
                let out = full.f_conv1d(&w, no_bias, [1], [0], [1], c)?;
                (out, Some(full.f_narrow(2, s, kernel - 1)?))
            }
            (None, Some(starts)) => (self.segmented_conv(mixed, &w, starts)?, None),
            (None, None) => (mixed.f_conv1d(&w, no_bias, [1], [kernel - 1], [1], c)?.f_narrow(2, 0, s)?, None),
        };
        Ok((activate(&out, self.activation)?, state))
    }

    /// The convolution of a packed row: input `t − d` reaches output `t` only from the same
    /// sequence (no start in `(t − d, t]`), so no sequence sees the one packed before it.
    ///
    /// # Shapes
    /// - `x`: `[b, c, s]`; `w`: `[c, 1, kernel]`; `starts`: `[b, s]` → `[b, c, s]`
    fn segmented_conv(&self, x: &Tensor, w: &Tensor, starts: &Tensor) -> Result<Tensor> {
        let (s, kernel) = (x.size()[2], self.cfg.conv_kernel);
        let count = starts.f_to_kind(Kind::Int64)?.f_cumsum(1, Kind::Int64)?; // [b, s]
        let mut out = x.f_mul(&w.f_select(2, kernel - 1)?)?; // d = 0: [b, c, s] · [c, 1]
        for d in 1..kernel.min(s + 1) {
            let shifted = x.f_constant_pad_nd([d, 0])?.f_narrow(2, 0, s)?; // x[t − d]
            let before = count.f_constant_pad_nd([d, 0])?.f_narrow(1, 0, s)?; // count[t − d]
            let same = before.f_eq_tensor(&count)?.f_unsqueeze(1)?.f_to_kind(x.kind())?; // [b, 1, s]
            out = out.f_add(&shifted.f_mul(&same)?.f_mul(&w.f_select(2, kernel - 1 - d)?)?)?;
        }
        Ok(out)
    }

    /// Lets go of the input projections' buffer ([`FusedRows::release`]).
    pub(crate) fn release_buffers(&mut self) {
        if let Some(f) = &mut self.fused {
            f.release();
        }
    }

    /// # Shapes
    /// - `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn forward(&self, x: &Tensor, shared: &LinearShared, cache: Option<(&mut KvCache, usize)>) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let l = &self.cfg;
        let (key_dim, value_dim) = (l.num_key_heads * l.key_head_dim, l.num_value_heads * l.value_head_dim);
        let x = match &shared.token_mask {
            Some(m) => x.f_mul(&m.f_unsqueeze(-1)?.f_to_kind(x.kind())?)?,
            None => x.shallow_clone(),
        };
        // Split in one op (one backward), not narrowed four times.
        let parts = self
            .project(&x)?
            .f_split_with_sizes([l.conv_dim(), value_dim, l.num_value_heads, l.num_value_heads], -1)?;
        let [mixed, z, beta, a] =
            <[Tensor; 4]>::try_from(parts).map_err(|_| ModelError::Input("projection split".into()))?;
        let mixed = mixed.f_transpose(1, 2)?; // [b, conv_dim, s]
        let beta = beta.f_sigmoid()?; // [b, s, hv]

        // g = −exp(A_log) · softplus(a + dt_bias), in f32.
        let g = a
            .f_to_kind(Kind::Float)?
            .f_add(&self.dt_bias)?
            .f_softplus()?
            .f_mul(&self.a_log.f_to_kind(Kind::Float)?.f_exp()?.f_neg()?)?;

        let (cache, layer) = match cache {
            Some((c, i)) => (Some(c), i),
            None => (None, 0),
        };
        // A growing cache's first forward starts from a zero state, as a preallocated one holds.
        let state = match cache.as_ref() {
            Some(c) => match c.linear_state(layer) {
                Some(st) => Some(st),
                None => Some(self.zero_state(b, x.kind(), x.device())?),
            },
            None => None,
        };
        if state.is_some() && shared.starts.is_some() {
            return Err(ModelError::Input("a packed row cannot continue from a cached linear-attention state".into()));
        }
        let (conv_out, conv_state) = self.conv(&mixed, state.as_ref().map(|(c, _)| c), shared.starts.as_ref())?;
        let qkv = conv_out.f_transpose(1, 2)?.f_split_with_sizes([key_dim, key_dim, value_dim], -1)?; // [b, s, ·]
        let q = qkv[0].f_reshape([b, s, l.num_key_heads, l.key_head_dim])?;
        let k = qkv[1].f_reshape([b, s, l.num_key_heads, l.key_head_dim])?;
        let v = qkv[2].f_reshape([b, s, l.num_value_heads, l.value_head_dim])?;
        let recurrent_state = state.as_ref().map(|(_, r)| r);
        let (o, new_state) = if recurrent_state.is_some() && s == 1 {
            let in_place = cache.as_ref().is_some_and(|c| c.updates_state_in_place());
            delta_rule::recurrent(&q, &k, &v, &g, &beta, recurrent_state, in_place)?
        } else {
            delta_rule::chunked(&q, &k, &v, &g, &beta, recurrent_state, shared.starts.as_ref())?
        };
        if let (Some(c), Some(conv_state)) = (cache, conv_state) {
            c.set_linear_state(layer, &conv_state, &new_state)?;
        }
        // Gated RMSNorm per value head: normalise in f32, cast back, · w, then · silu(z) in f32.
        let o = o.f_rms_norm([l.value_head_dim], None::<&Tensor>, self.eps)?.f_mul(&self.norm_weight)?;
        let z = z.f_reshape([b, s, l.num_value_heads, l.value_head_dim])?;
        let gated = o.f_to_kind(Kind::Float)?.f_mul(&z.f_to_kind(Kind::Float)?.f_silu()?)?.f_to_kind(x.kind())?;
        self.out_proj.forward(&gated.f_reshape([b, s, value_dim])?)
    }
}
