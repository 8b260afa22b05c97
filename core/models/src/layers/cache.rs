//! The key/value cache of incremental decoding, and the state of linear-attention layers.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// What one layer keeps between forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLayer {
    /// Keys and values, `[batch, kv_heads, max_len, head_dim]` each.
    Attention { kv_heads: i64, head_dim: i64 },
    /// A Gated DeltaNet layer's state: the last `conv_len` inputs of its convolution
    /// (`[batch, conv_dim, conv_len]`, the model's dtype) and the recurrent state
    /// (`[batch, heads, key_dim, value_dim]`, f32) — a fixed size, whatever the length.
    Linear { conv_dim: i64, conv_len: i64, heads: i64, key_dim: i64, value_dim: i64 },
}

/// Key/value buffers for incremental decoding: preallocated and written in place ([`KvCache::new`],
/// generation), or grown by concatenation ([`KvCache::growing`]) so that autograd can differentiate
/// through what it holds (a shared prompt prefix computed with gradients). A linear-attention
/// layer keeps its state instead ([`CacheLayer::Linear`]), overwritten by each forward.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer `(k, v)`, each `[batch, kv_heads, max_len, head_dim]` (growing: `[.., len, ..]`),
    /// or for a linear-attention layer `(conv state, recurrent state)` (see [`CacheLayer`]).
    layers: Vec<(Tensor, Tensor)>,
    /// Whether any layer is a linear-attention one.
    has_linear: bool,
    len: i64,
    max_len: i64,
    growing: bool,
    /// Set during a capture-safe decode step ([`KvCache::set_write_slot`]): the one new token of
    /// each row is written at this slot (`[1]` int64, on the device) and every layer attends over
    /// all `max_len` slots, the key mask hiding the empty ones. `len` is then the caller's to keep.
    write_slot: Option<Tensor>,
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
        let layers = vec![CacheLayer::Attention { kv_heads, head_dim }; num_layers as usize];
        Self::with_layers(&layers, batch, max_len, kind, device)
    }

    /// Allocates each layer's buffers as `layers` says (zeros: an empty cache, a zero state).
    pub fn with_layers(
        layers: &[CacheLayer],
        batch: i64,
        max_len: i64,
        kind: Kind,
        device: tch::Device,
    ) -> Result<Self> {
        let mut bufs = Vec::with_capacity(layers.len());
        for l in layers {
            bufs.push(match *l {
                CacheLayer::Attention { kv_heads, head_dim } => (
                    Tensor::f_zeros([batch, kv_heads, max_len, head_dim], (kind, device))?,
                    Tensor::f_zeros([batch, kv_heads, max_len, head_dim], (kind, device))?,
                ),
                CacheLayer::Linear { conv_dim, conv_len, heads, key_dim, value_dim } => (
                    Tensor::f_zeros([batch, conv_dim, conv_len], (kind, device))?,
                    Tensor::f_zeros([batch, heads, key_dim, value_dim], (Kind::Float, device))?,
                ),
            });
        }
        let has_linear = layers.iter().any(|l| matches!(l, CacheLayer::Linear { .. }));
        Ok(KvCache { layers: bufs, has_linear, len: 0, max_len, growing: false, write_slot: None })
    }

    /// The state of linear-attention layer `layer`: `(conv state, recurrent state)`, or `None`
    /// before the first forward of a growing cache.
    pub fn linear_state(&self, layer: usize) -> Option<(Tensor, Tensor)> {
        self.layers.get(layer).filter(|(c, _)| c.defined()).map(|(c, s)| (c.shallow_clone(), s.shallow_clone()))
    }

    /// Stores the state of linear-attention layer `layer` after a forward: in place in a
    /// preallocated cache (so a captured decode step replays into the same buffers), by
    /// replacement in a growing one (keeping autograd's graph).
    ///
    /// # Shapes
    /// `conv`: `[batch, conv_dim, conv_len]`; `state`: `[batch, heads, key_dim, value_dim]` f32
    pub fn set_linear_state(&mut self, layer: usize, conv: &Tensor, state: &Tensor) -> Result<()> {
        self.has_linear = true;
        if self.growing {
            while self.layers.len() <= layer {
                self.layers.push((Tensor::new(), Tensor::new()));
            }
            self.layers[layer] = (conv.shallow_clone(), state.shallow_clone());
            return Ok(());
        }
        let (c, s) = &mut self.layers[layer];
        c.f_copy_(conv)?;
        // A state updated in its buffer ([`KvCache::updates_state_in_place`]) is there already.
        if s.data_ptr() != state.data_ptr() {
            s.f_copy_(state)?;
        }
        Ok(())
    }

    /// Whether layer `layer`'s linear-attention state may be updated where it lies: a
    /// preallocated cache (its buffers belong to no autograd graph) outside of autograd.
    pub fn updates_state_in_place(&self) -> bool {
        !self.growing && !super::grad_enabled()
    }

    /// An empty cache without buffers: each append concatenates (no in-place write), so the cached
    /// keys and values stay part of the autograd graph.
    pub fn growing() -> Self {
        KvCache { layers: Vec::new(), has_linear: false, len: 0, max_len: i64::MAX, growing: true, write_slot: None }
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

    /// Writes the new keys/values of `layer` at the current end and returns all cached ones;
    /// with a write slot set ([`KvCache::set_write_slot`]), writes the one new token there and
    /// returns the whole buffers.
    ///
    /// # Shapes
    /// - `k`, `v`: `[batch, kv_heads, seq, head_dim]` → `([batch, kv_heads, len + seq, head_dim], same)`
    ///   (with a write slot: `seq = 1` → `[batch, kv_heads, max_len, head_dim]`)
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let seq = k.size()[2];
        if let Some(slot) = &self.write_slot {
            if seq != 1 || self.growing {
                return Err(ModelError::Input(format!(
                    "a decode step writes one token per row into a preallocated cache, got {seq}"
                )));
            }
            let (kb, vb) = &mut self.layers[layer];
            let _ = kb.f_index_copy_(2, slot, k)?;
            let _ = vb.f_index_copy_(2, slot, v)?;
            return Ok((kb.shallow_clone(), vb.shallow_clone()));
        }
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
            return Err(ModelError::Input(format!(
                "KV cache full: {} + {seq} tokens exceed its {} slots",
                self.len, self.max_len
            )));
        }
        let (kb, vb) = &mut self.layers[layer];
        kb.f_narrow(2, self.len, seq)?.f_copy_(k)?;
        vb.f_narrow(2, self.len, seq)?.f_copy_(v)?;
        Ok((kb.f_narrow(2, 0, self.len + seq)?, vb.f_narrow(2, 0, self.len + seq)?))
    }

    /// A cache of `max_len` slots holding, for row `r`, the slots `index[r]` of this one, in
    /// that order (a multi-turn decode drops its masked slots this way).
    ///
    /// # Shapes
    /// `index`: `[batch, width]` (int64, `width <= max_len`); each buffer `[batch, kv_heads,
    /// max_len, head_dim]`
    pub fn gather_slots(&self, index: &Tensor, max_len: i64) -> Result<KvCache> {
        if self.has_linear {
            return Err(ModelError::Input(
                "a linear-attention layer's state cannot drop cached slots (re-prefill instead)".into(),
            ));
        }
        let (b, width) = (index.size()[0], index.size()[1]);
        let mut layers = Vec::with_capacity(self.layers.len());
        for (k, v) in &self.layers {
            let size = k.size();
            let idx = index.f_view([b, 1, width, 1])?.f_expand([b, size[1], width, size[3]], false)?;
            let move_to = |t: &Tensor| -> Result<Tensor> {
                let out = Tensor::f_zeros([b, size[1], max_len, size[3]], (t.kind(), t.device()))?;
                out.f_narrow(2, 0, width)?.f_copy_(&t.f_gather(2, &idx, false)?)?;
                Ok(out)
            };
            layers.push((move_to(k)?, move_to(v)?));
        }
        Ok(KvCache { layers, has_linear: false, len: width, max_len, growing: false, write_slot: None })
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

    /// Sets (or with `None` clears) the slot a capture-safe decode step writes (see
    /// [`KvCache::append`]).
    pub fn set_write_slot(&mut self, slot: Option<Tensor>) {
        self.write_slot = slot;
    }

    /// Declares the first `len` slots cached (after decode steps that wrote at a slot).
    pub fn set_len(&mut self, len: i64) -> Result<()> {
        if len < 0 || len > self.max_len {
            return Err(ModelError::Input(format!("cache length {len} outside 0..={}", self.max_len)));
        }
        self.len = len;
        Ok(())
    }

    /// Rows in the cache (0 for a growing cache with nothing appended).
    pub fn rows(&self) -> i64 {
        self.layers.first().filter(|(k, _)| k.defined()).map_or(0, |(k, _)| k.size()[0])
    }
}
