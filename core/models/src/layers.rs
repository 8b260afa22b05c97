//! Building blocks shared by the model families: linear layers in both weight layouts, norms,
//! rotary embeddings, the attention mask and the KV cache.

use tch::{Kind, Tensor};

use crate::config::{Activation, RopeConfig, RopeScaling};
use crate::error::Result;
use crate::weights::WeightLoader;

/// `y = x Wᵀ + b` with `W: [out, in]` (torch `nn.Linear`), or `y = x W + b` with `W: [in, out]`
/// (GPT-2's `Conv1D`, stored transposed; we keep it as stored so saving round-trips bit-exactly).
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    transposed: bool,
    /// A LoRA update added to the output, when applied.
    pub lora: Option<crate::lora::LoraAdapter>,
}

impl Linear {
    /// Loads `weight: [out, in]` and, if `bias`, `bias: [out]`.
    pub fn load(w: &WeightLoader, in_dim: i64, out_dim: i64, bias: bool) -> Result<Self> {
        let weight = w.get("weight", &[out_dim, in_dim])?;
        let bias = if bias { Some(w.get("bias", &[out_dim])?) } else { None };
        Ok(Linear { weight, bias, transposed: false, lora: None })
    }

    /// Loads a GPT-2 `Conv1D`: `weight: [in, out]`, `bias: [out]`.
    pub fn load_conv1d(w: &WeightLoader, in_dim: i64, out_dim: i64) -> Result<Self> {
        let weight = w.get("weight", &[in_dim, out_dim])?;
        let bias = Some(w.get("bias", &[out_dim])?);
        Ok(Linear { weight, bias, transposed: true, lora: None })
    }

    /// `(in, out)` feature sizes.
    pub fn dims(&self) -> (i64, i64) {
        let s = self.weight.size();
        if self.transposed {
            (s[0], s[1])
        } else {
            (s[1], s[0])
        }
    }

    /// Whether the weight is stored `[in, out]` (GPT-2's `Conv1D`).
    pub fn transposed(&self) -> bool {
        self.transposed
    }

    /// # Shapes
    /// - `x`: `[..., in]` → `[..., out]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = if self.transposed {
            let y = x.f_matmul(&self.weight)?;
            match &self.bias {
                Some(b) => y.f_add(b)?,
                None => y,
            }
        } else {
            linear(x, &self.weight, self.bias.as_ref())?
        };
        match &self.lora {
            Some(l) if !l.is_disabled() => l.forward(x)?.f_add(&y).map_err(Into::into),
            _ => Ok(y),
        }
    }
}

/// Rows up to which [`linear`] puts the weight on the left on the CPU.
pub const FEW_ROWS: i64 = 32;

/// `y = x Wᵀ + b` (torch's `F.linear`) with `W: [out, in]`.
///
/// On the CPU in f32 with at most [`FEW_ROWS`] rows — a decode step — it is computed as `(W xᵀ)ᵀ`.
/// MKL's sgemm first copies ("packs") its right-hand operand into panels; in `x Wᵀ` that operand
/// is the whole weight, re-packed on every call, which at 16 rows took about as long as the
/// product itself. With the weight on the left it is streamed once and only the few rows of `x`
/// are packed: 1.1–1.8× faster per layer of SmolLM2 at 4–32 rows (its decode at 16 rows 1.25×,
/// at 32 rows 1.1×; a 3M-parameter Qwen2's at 32 rows ~1.2×), the same sums in another order
/// (results within f32 rounding of `F.linear`'s). From 64 rows on the two are even, and at 128
/// `F.linear` wins, so larger inputs, bf16 (oneDNN is faster there) and other devices use `F.linear`.
///
/// # Shapes
/// - `x`: `[..., in]`, `w`: `[out, in]`, `bias`: `[out]` → `[..., out]`
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (out, inp) = (w.size()[0], w.size()[1]);
    let rows = if inp == 0 { 0 } else { x.numel() as i64 / inp };
    // bf16 goes to oneDNN's kernels through `F.linear`, which are faster there (SmolLM2's decode
    // GEMMs at 16 rows: 17 ms with `F.linear`, 26 ms weight-on-the-left).
    let f32_cpu = w.device() == tch::Device::Cpu && w.kind() == Kind::Float;
    if !f32_cpu || x.dim() == 0 || rows == 0 || rows > FEW_ROWS {
        return Ok(x.f_linear(w, bias)?);
    }
    let y = w.f_mm(&x.f_reshape([rows, inp])?.f_transpose(0, 1)?)?.f_transpose(0, 1)?; // [rows, out], column-major
    let y = match bias {
        Some(b) => y.f_add(b)?,
        None => y,
    };
    let mut shape = x.size();
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
    Ok(y.f_contiguous()?.f_view(shape.as_slice())?)
}

/// Applies an MLP activation elementwise.
pub fn activate(x: &Tensor, act: Activation) -> Result<Tensor> {
    Ok(match act {
        Activation::Silu => x.f_silu()?,
        Activation::GeluTanh => x.f_gelu("tanh")?,
        Activation::Gelu => x.f_gelu("none")?,
        Activation::Relu => x.f_relu()?,
    })
}

/// Llama's RMSNorm: normalise in fp32, cast back, then scale (transformers' order of operations).
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `weight: [dim]`.
    pub fn load(w: &WeightLoader, dim: i64, eps: f64) -> Result<Self> {
        Ok(RmsNorm { weight: w.get("weight", &[dim])?, eps })
    }

    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.kind();
        let xf = x.f_to_kind(Kind::Float)?;
        let var = xf.f_pow_tensor_scalar(2)?.f_mean_dim(-1, true, Kind::Float)?;
        let normed = xf.f_mul(&var.f_add_scalar(self.eps)?.f_rsqrt()?)?.f_to_kind(kind)?;
        Ok(normed.f_mul(&self.weight)?)
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

/// Precomputed rotary inverse frequencies (fp32), with Llama-3 / linear scaling applied.
#[derive(Debug)]
pub struct Rotary {
    inv_freq: Tensor, // [head_dim / 2], f32, on the model's device
}

impl Rotary {
    /// Computes `inv_freq` like transformers' `ROPE_INIT_FUNCTIONS`, in fp32.
    pub fn new(cfg: &RopeConfig, head_dim: i64, device: tch::Device) -> Result<Self> {
        let half = (head_dim / 2) as usize;
        let base = cfg.theta as f32;
        let mut inv: Vec<f32> = (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32)).collect();
        match cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv.iter_mut().for_each(|f| *f /= factor as f32),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    original_max_position_embeddings as f32,
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
            }
        }
        Ok(Rotary { inv_freq: Tensor::f_from_slice(&inv)?.f_to_device(device)? })
    }

    /// cos and sin tables for the given positions, in `kind`.
    ///
    /// # Shapes
    /// - `position_ids`: `[batch, seq]` (int64)
    /// - returns: `([batch, 1, seq, head_dim], [batch, 1, seq, head_dim])`
    pub fn cos_sin(&self, position_ids: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let pos = position_ids.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?; // [b, s, 1]
        let freqs = pos.f_mul(&self.inv_freq)?; // [b, s, d/2]
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?; // [b, 1, s, d]
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    }
}

/// Applies rotary embeddings to q or k (rotate-half layout, as Hugging Face checkpoints store them).
///
/// # Shapes
/// - `x`: `[batch, heads, seq, head_dim]`; `cos`, `sin`: `[batch, 1, seq, head_dim]` → like `x`
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.size()[3];
    let x1 = x.f_narrow(3, 0, d / 2)?;
    let x2 = x.f_narrow(3, d / 2, d / 2)?;
    let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], 3)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// Boolean attention mask for `scaled_dot_product_attention` (`true` = may attend): causal over
/// absolute positions; a real query attends to the real keys of its own segment; a padding query
/// attends to every real key before it, as in transformers (so a right-padded row's values past
/// its end, which DeepSpeed-Chat's pairwise loss reads, depend on its content); a padding query
/// with no real key before it (left padding) sees itself, so no row is empty (it would be NaN).
///
/// `key_mask` holds segment ids: 0 = padding, any other value = a real token of that segment. A
/// plain 0/1 mask is one segment per row (the usual padding mask); a packed row of several examples
/// numbered 1, 2, 3... gets a block-diagonal causal mask, so no example attends to another.
///
/// # Shapes
/// - `key_mask`: `[batch, past + seq]` (integer or bool); returns `[batch, 1, seq, past + seq]`
pub fn attention_mask(key_mask: &Tensor, past: i64, seq: i64) -> Result<Tensor> {
    let device = key_mask.device();
    let total = past + seq;
    let q = Tensor::f_arange_start(past, total, (Kind::Int64, device))?.f_view([seq, 1])?;
    let k = Tensor::f_arange(total, (Kind::Int64, device))?.f_view([1, total])?;
    let causal = k.f_le_tensor(&q)?; // [seq, total]
    let diag = k.f_eq_tensor(&q)?; // [seq, total]
    let segs = key_mask.f_to_kind(Kind::Int64)?; // [b, total]
    let key_seg = segs.f_view([-1, 1, 1, total])?; // [b, 1, 1, total]
    let query_seg = segs.f_narrow(1, past, seq)?.f_view([-1, 1, seq, 1])?; // [b, 1, seq, 1]
    let key_real = key_seg.f_ne(0)?; // [b, 1, 1, total]
    let same = key_seg.f_eq_tensor(&query_seg)?.f_logical_and(&key_real)?; // [b, 1, seq, total]
    let pad_query = query_seg.f_eq(0)?.f_logical_and(&key_real)?; // [b, 1, seq, total]
    let allowed = causal.f_logical_and(&same.f_logical_or(&pad_query)?)?; // [b, 1, seq, total]
    let empty = allowed.f_any_dims(Some([-1i64].as_slice()), true)?.f_logical_not()?; // [b, 1, seq, 1]
    Ok(allowed.f_logical_or(&diag.f_logical_and(&empty)?)?) // [b, 1, seq, total]
}

/// Position ids for left- or right-padded batches: `t − (start of t's segment)`, so real tokens
/// get `cumsum(mask != 0) − 1` as transformers' `generate` passes them (a sequence's positions do
/// not depend on its left padding), left padding gets 0, and right padding keeps counting as
/// transformers' default `arange` does. With segment ids in `mask` (see [`attention_mask`])
/// positions restart at 0 where a new segment begins, as transformers' padding-free packing
/// passes them.
///
/// # Shapes
/// - `mask`: `[batch, seq]` → `[batch, seq]` (int64)
pub fn position_ids_from_mask(mask: &Tensor) -> Result<Tensor> {
    let segs = mask.f_to_kind(Kind::Int64)?; // [b, s]
    let (b, s) = (segs.size()[0], segs.size()[1]);
    let t = Tensor::f_arange(s, (Kind::Int64, segs.device()))?.f_view([1, s])?.f_expand([b, s], false)?; // [b, s]
                                                                                                         // A segment starts at a real token whose id differs from the previous slot's (padding sits only
                                                                                                         // at the ends of a row, so the previous slot is the previous real token or padding).
    let first = Tensor::f_full([b, 1], -1, (Kind::Int64, segs.device()))?; // [b, 1]
    let prev = Tensor::f_cat(&[&first, &segs.f_narrow(1, 0, s - 1)?], 1)?; // [b, s]: segs[t − 1]
    let start = segs.f_ne_tensor(&prev)?.f_logical_and(&segs.f_ne(0)?)?; // [b, s]
    let seg_start = t.f_where_scalarother(&start, -1)?.f_cummax(-1)?.0; // [b, s]: −1 before any
    let pos = t.f_sub(&seg_start)?; // [b, s]
    Ok(pos.f_where_scalarother(&seg_start.f_ge(0)?, 0)?)
}

/// What the decoder layers of one forward share: the attention mask (see [`attention_mask`]) and,
/// for rotary models, the cos/sin tables of the positions.
///
/// # Shapes
/// `mask`: `[batch, 1, seq, past + seq]` (bool); `rotary`: `([batch, 1, seq, head_dim], same)`
#[derive(Debug)]
pub struct LayerShared {
    pub mask: Tensor,
    pub rotary: Option<(Tensor, Tensor)>,
}

/// Key/value buffers for incremental decoding: preallocated and written in place ([`KvCache::new`],
/// generation), or grown by concatenation ([`KvCache::growing`]) so that autograd can differentiate
/// through what it holds (a shared prompt prefix computed with gradients).
#[derive(Debug)]
pub struct KvCache {
    /// Per layer `(k, v)`, each `[batch, kv_heads, max_len, head_dim]` (growing: `[.., len, ..]`).
    layers: Vec<(Tensor, Tensor)>,
    len: i64,
    max_len: i64,
    growing: bool,
}

impl KvCache {
    /// Allocates buffers for `num_layers` layers.
    pub fn new(
        num_layers: i64,
        batch: i64,
        kv_heads: i64,
        max_len: i64,
        head_dim: i64,
        kind: Kind,
        device: tch::Device,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(num_layers as usize);
        for _ in 0..num_layers {
            let k = Tensor::f_zeros([batch, kv_heads, max_len, head_dim], (kind, device))?;
            let v = Tensor::f_zeros([batch, kv_heads, max_len, head_dim], (kind, device))?;
            layers.push((k, v));
        }
        Ok(KvCache { layers, len: 0, max_len, growing: false })
    }

    /// An empty cache without buffers: each append concatenates (no in-place write), so the cached
    /// keys and values stay part of the autograd graph.
    pub fn growing() -> Self {
        KvCache { layers: Vec::new(), len: 0, max_len: i64::MAX, growing: true }
    }

    /// Tokens already cached.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Capacity in tokens.
    pub fn max_len(&self) -> i64 {
        self.max_len
    }

    /// Writes the new keys/values of `layer` at the current end and returns all cached ones.
    ///
    /// # Shapes
    /// - `k`, `v`: `[batch, kv_heads, seq, head_dim]` → `([batch, kv_heads, len + seq, head_dim], same)`
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let seq = k.size()[2];
        if self.growing {
            // Layers not seen yet hold undefined tensors (a layer may be run alone, as the
            // checkpointed backward recomputes one layer at a time).
            while self.layers.len() <= layer {
                self.layers.push((Tensor::new(), Tensor::new()));
            }
            let (kb, vb) = &mut self.layers[layer];
            if kb.defined() {
                *kb = Tensor::f_cat(&[&*kb, k], 2)?;
                *vb = Tensor::f_cat(&[&*vb, v], 2)?;
            } else {
                (*kb, *vb) = (k.shallow_clone(), v.shallow_clone());
            }
            return Ok((kb.shallow_clone(), vb.shallow_clone()));
        }
        if self.len + seq > self.max_len {
            return Err(crate::error::ModelError::Input(format!(
                "KV cache full: {} + {seq} tokens exceed its {} slots",
                self.len, self.max_len
            )));
        }
        let (kb, vb) = &mut self.layers[layer];
        kb.f_narrow(2, self.len, seq)?.f_copy_(k)?;
        vb.f_narrow(2, self.len, seq)?.f_copy_(v)?;
        Ok((kb.f_narrow(2, 0, self.len + seq)?, vb.f_narrow(2, 0, self.len + seq)?))
    }

    /// Repeats every row `times` times in place (`[r0, r0, r1, r1]` for 2), keeping what is
    /// cached: prompts prefilled once, then decoded as several samples each.
    ///
    /// # Shapes
    /// each buffer `[batch, kv_heads, max_len, head_dim]` → `[batch · times, kv_heads, max_len, head_dim]`
    pub fn repeat_rows(&mut self, times: i64) -> Result<()> {
        for (k, v) in self.layers.iter_mut() {
            *k = k.f_repeat_interleave_self_int(times, 0, None)?;
            *v = v.f_repeat_interleave_self_int(times, 0, None)?;
        }
        Ok(())
    }

    /// Keeps the rows `index` in that order (`[r0, r0, r1]` for `[0, 0, 1]`): one cached prefix
    /// given to every sequence that shares it. Differentiable: the gradient of a row sums over
    /// its copies.
    ///
    /// # Shapes
    /// `index`: `[rows]` (int64); each buffer `[batch, ..]` → `[rows, ..]`
    pub fn select_rows(&mut self, index: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().filter(|(k, _)| k.defined()) {
            *k = k.f_index_select(0, index)?;
            *v = v.f_index_select(0, index)?;
        }
        Ok(())
    }

    /// Marks `seq` more tokens as cached; called once per forward after every layer appended.
    pub fn advance(&mut self, seq: i64) {
        self.len += seq;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_is_causal_padded_and_never_empty() {
        // One row left-padded by 2.
        let key_mask = Tensor::from_slice(&[0i64, 0, 1, 1]).view([1, 4]);
        let m = attention_mask(&key_mask, 0, 4).unwrap().view([4, 4]);
        let rows: Vec<Vec<bool>> = (0..4).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[0], vec![true, false, false, false]); // pad sees itself only
        assert_eq!(rows[1], vec![false, true, false, false]);
        assert_eq!(rows[2], vec![false, false, true, false]);
        assert_eq!(rows[3], vec![false, false, true, true]);
        // With one cached token, the single new query at absolute index 4 sees all real keys.
        let key_mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1]).view([1, 5]);
        let m = attention_mask(&key_mask, 4, 1).unwrap().view([5]);
        assert_eq!(Vec::<bool>::try_from(m).unwrap(), vec![false, false, true, true, true]);
    }

    #[test]
    fn packed_segments_attend_within_themselves_and_restart_positions() {
        // Two examples packed in one row (ids 1 and 2), then right padding.
        let key_mask = Tensor::from_slice(&[1i64, 1, 2, 2, 2, 0]).view([1, 6]);
        let m = attention_mask(&key_mask, 0, 6).unwrap().view([6, 6]);
        let rows: Vec<Vec<bool>> = (0..6).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[1], vec![true, true, false, false, false, false]);
        assert_eq!(rows[2], vec![false, false, true, false, false, false]); // not the first example
        assert_eq!(rows[4], vec![false, false, true, true, true, false]);
        // Trailing padding sees the real keys before it (not itself), as in transformers.
        assert_eq!(rows[5], vec![true, true, true, true, true, false]);
        let p = position_ids_from_mask(&key_mask).unwrap().view([6]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 1, 0, 1, 2, 3]); // right pad keeps counting
                                                                              // A plain 0/1 mask, right-padded: transformers' `arange`.
        let p = position_ids_from_mask(&Tensor::from_slice(&[1i64, 1, 1, 0, 0]).view([1, 5])).unwrap().view([5]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 1, 2, 3, 4]);
        let m = attention_mask(&Tensor::from_slice(&[1i64, 1, 0]).view([1, 3]), 0, 3).unwrap().view([3, 3]);
        assert_eq!(Vec::<bool>::try_from(m.get(2)).unwrap(), vec![true, true, false]);
    }

    #[test]
    fn positions_ignore_left_padding() {
        let mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1]).view([1, 5]);
        let p = position_ids_from_mask(&mask).unwrap().view([5]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 0, 0, 1, 2]);
    }

    #[test]
    fn rotate_half_matches_formula() {
        let x = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([1, 1, 1, 4]);
        let cos = Tensor::from_slice(&[0.5f32, 0.5, 0.5, 0.5]).view([1, 1, 1, 4]);
        let sin = Tensor::from_slice(&[1f32, 1., 1., 1.]).view([1, 1, 1, 4]);
        let y = apply_rotary(&x, &cos, &sin).unwrap().view([4]);
        // x*cos + [-x3, -x4, x1, x2]*sin
        assert_eq!(Vec::<f32>::try_from(y).unwrap(), vec![0.5 - 3., 1. - 4., 1.5 + 1., 2. + 2.]);
    }
}
