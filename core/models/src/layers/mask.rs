//! Attention masks (causal, padded, packed, windowed) and position ids.

use std::cell::RefCell;
use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::error::Result;

/// Boolean attention mask for `scaled_dot_product_attention` (`true` = may attend): causal over
/// absolute positions; a real query attends to the real keys of its own segment; a padding query
/// attends to every real key before it, as in transformers (so a right-padded row's values past
/// its end, which DeepSpeed-Chat's pairwise loss reads, depend on its content); a padding query
/// with no real key before it (left padding) sees itself, so no row is empty (it would be NaN).
///
/// `key_mask` holds segment ids: 0 = padding, any other value = a real token of that segment. A
/// plain 0/1 mask is one segment per row (the usual padding mask); a packed row of several examples
/// numbered 1, 2, 3... gets a block-diagonal causal mask, so no example attends to another. A
/// segment may have branches ([`branch_segment`]): sequences that continue it side by side (the
/// completions of one prompt, packed after it once), each seeing the segment and itself only —
/// its positions are then given by the packing, not by [`position_ids_from_mask`].
///
/// # Shapes
/// - `key_mask`: `[batch, past + seq]` (integer or bool); returns `[batch, 1, seq, past + seq]`
pub fn attention_mask(key_mask: &Tensor, past: i64, seq: i64) -> Result<Tensor> {
    windowed_attention_mask(key_mask, past, seq, None)
}

/// [`attention_mask`] with a sliding window: a query at slot `q` also sees no key at `k <= q −
/// window`, so at most `window` keys, its own included (transformers' `sliding_window_overlay`:
/// `kv_idx > q_idx − sliding_window`). Slots are what is windowed, as in transformers; padding
/// sits only at the ends of a row and a packed segment's slots are contiguous, so within a
/// sequence a slot distance is a position distance.
///
/// # Shapes
/// - `key_mask`: `[batch, past + seq]`; returns `[batch, 1, seq, past + seq]`
pub fn windowed_attention_mask(key_mask: &Tensor, past: i64, seq: i64, window: Option<i64>) -> Result<Tensor> {
    let device = key_mask.device();
    let total = past + seq;
    let q = Tensor::f_arange_start(past, total, (Kind::Int64, device))?.f_view([seq, 1])?;
    let k = Tensor::f_arange(total, (Kind::Int64, device))?.f_view([1, total])?;
    let mut causal = k.f_le_tensor(&q)?; // [seq, total]
    if let Some(w) = window {
        causal = causal.f_logical_and(&k.f_gt_tensor(&q.f_sub_scalar(w)?)?)?; // k > q − w
    }
    let diag = k.f_eq_tensor(&q)?; // [seq, total]
    let segs = key_mask.f_to_kind(Kind::Int64)?; // [b, total]

    // A token sees a key of its segment that is on no branch or on its own branch.
    let (base, branch) = (segs.f_bitwise_and(BRANCH_UNIT - 1)?, segs.f_bitwise_right_shift_tensor_scalar(BRANCH_BITS)?);
    let key_seg = base.f_view([-1, 1, 1, total])?; // [b, 1, 1, total]
    let query_seg = base.f_narrow(1, past, seq)?.f_view([-1, 1, seq, 1])?; // [b, 1, seq, 1]
    let key_branch = branch.f_view([-1, 1, 1, total])?; // [b, 1, 1, total]
    let query_branch = branch.f_narrow(1, past, seq)?.f_view([-1, 1, seq, 1])?; // [b, 1, seq, 1]
    let key_real = key_seg.f_ne(0)?; // [b, 1, 1, total]
    let visible_branch = key_branch.f_eq(0)?.f_logical_or(&key_branch.f_eq_tensor(&query_branch)?)?; // [b, 1, seq, total]
    let same = key_seg.f_eq_tensor(&query_seg)?.f_logical_and(&key_real)?.f_logical_and(&visible_branch)?; // [b, 1, seq, total]
    let pad_query = query_seg.f_eq(0)?.f_logical_and(&key_real)?; // [b, 1, seq, total]
    let allowed = causal.f_logical_and(&same.f_logical_or(&pad_query)?)?; // [b, 1, seq, total]
    let empty = allowed.f_any_dims(Some([-1i64].as_slice()), true)?.f_logical_not()?; // [b, 1, seq, 1]
    Ok(allowed.f_logical_or(&diag.f_logical_and(&empty)?)?) // [b, 1, seq, total]
}

/// Bits of a key-mask value below a branch number (see [`branch_segment`]).
const BRANCH_BITS: i64 = 32;
const BRANCH_UNIT: i64 = 1 << BRANCH_BITS;

/// The key-mask value of branch `branch` (1, 2, …) of segment `segment` (1, 2, …, below
/// 2³²): a token there sees the tokens of `segment` that are on no branch and those of its own
/// branch, causally ([`attention_mask`]); the segment's own tokens see no branch. Branch 0 is the
/// segment itself.
pub fn branch_segment(segment: i64, branch: i64) -> i64 {
    segment + branch * BRANCH_UNIT
}

/// The mask of a capture-safe decode step ([`crate::KvCache::set_write_slot`]): one query per
/// row at cache slot `slot`, attending over every slot of the cache where `key_mask` is set (the
/// slot itself included, set before the step) and, with a sliding window, no key at `k <= slot −
/// window`. For one query after the cached ones this is what [`windowed_attention_mask`] gives,
/// built without host values so the step can be captured and replayed.
///
/// # Shapes
/// - `key_mask`: `[batch, capacity]` (integer); `slot`: `[1]` int64 → `[batch, 1, 1, capacity]` (bool)
pub fn step_attention_mask(key_mask: &Tensor, slot: &Tensor, window: Option<i64>) -> Result<Tensor> {
    let (b, total) = (key_mask.size()[0], key_mask.size()[1]);
    let real = key_mask.f_ne(0)?.f_view([b, 1, 1, total])?;
    let Some(w) = window else { return Ok(real) };
    let k = Tensor::f_arange(total, (Kind::Int64, key_mask.device()))?; // [total]
    let inside = k.f_gt_tensor(&slot.f_sub_scalar(w)?)?; // k > slot − w
    Ok(real.f_logical_and(&inside.f_view([1, 1, 1, total])?)?)
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

/// What the decoder layers of one forward share: the attention masks (see [`attention_mask`]),
/// for rotary models the cos/sin tables of the positions, for linear attention the token masks.
///
/// # Shapes
/// `mask`, `sliding_mask`: `[batch, 1, seq, past + seq]` (bool); `rotary`, `rotary_local`:
/// `([batch, 1, seq, rotary_dim], same)`
#[derive(Debug)]
pub struct LayerShared {
    /// The mask of full-attention layers.
    pub mask: Tensor,
    /// The mask of sliding-window layers, where the model has some.
    pub sliding_mask: Option<Tensor>,
    pub rotary: Option<(Tensor, Tensor)>,
    /// The tables of sliding-window layers where their RoPE differs (Gemma 3).
    pub rotary_local: Option<(Tensor, Tensor)>,
    /// What linear-attention layers read of the key mask (empty for models without them).
    pub linear: super::LinearShared,
    /// Where the sparse layers add their routing for the load-balancing loss, in a model that
    /// computes it (see [`super::load_balance`]).
    pub router: Option<super::RouterRecord>,
    /// Gemma 4's per-layer inputs and the keys and values later layers reuse.
    pub side: SideInputs,
    /// How mixture-of-experts layers compute their experts ([`super::SparseMoe::forward`]):
    /// routed, or in a decode step over their stacked weights.
    pub experts: super::ExpertSteps,
}

/// What Gemma 4's layers read beyond their input and the shared tables: the forward's per-layer
/// inputs, and the keys and values a layer hands to the later layers that reuse them. Interior
/// mutability: a layer stores its keys and values as it runs, and the checkpointed backward swaps
/// both for leaves that collect their gradients ([`crate::checkpointing`]).
///
/// # Shapes
/// `per_layer`: `[batch, seq, layers, dim]`; `kv`: per storing layer, `([batch, kv_heads, keys,
/// head_dim], same)` as it attended to them (the cached ones included)
#[derive(Debug, Default)]
pub struct SideInputs {
    pub per_layer: RefCell<Option<Tensor>>,
    pub kv: RefCell<BTreeMap<usize, (Tensor, Tensor)>>,
    /// Qwen3-VL's deep-stack features, when the forward's prompts hold images.
    pub deepstack: RefCell<Option<Deepstack>>,
}

/// What Qwen3-VL's first layers add at the image tokens (DeepStack): `features[j]` to the output
/// of layer `j`.
///
/// # Shapes
/// `at`: `[batch, seq]` bool; `features`: `[image tokens, hidden]` each
#[derive(Debug)]
pub struct Deepstack {
    pub at: Tensor,
    pub features: Vec<Tensor>,
}

impl SideInputs {
    /// Per-layer inputs `per_layer` (`None` for models without them).
    pub fn with_per_layer(per_layer: Option<Tensor>) -> Self {
        SideInputs { per_layer: RefCell::new(per_layer), kv: Default::default(), deepstack: Default::default() }
    }

    /// `h` (layer `i`'s output) with its deep-stack features added at the image tokens, if it
    /// takes some.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn add_deepstack(&self, i: usize, h: Tensor) -> Result<Tensor> {
        match self.deepstack.borrow().as_ref() {
            Some(d) if i < d.features.len() => {
                Ok(h.f_index_put(&[Some(&d.at)], &d.features[i].f_to_kind(h.kind())?, true)?)
            }
            _ => Ok(h),
        }
    }

    /// Layer `i`'s slice of the per-layer inputs, `[batch, seq, dim]`.
    pub fn per_layer_input(&self, i: usize) -> Result<Tensor> {
        match self.per_layer.borrow().as_ref() {
            Some(t) => Ok(t.f_select(2, i as i64)?),
            None => {
                Err(crate::error::ModelError::Input(format!("layer {i} reads per-layer inputs this forward lacks")))
            }
        }
    }

    /// The keys and values layer `i` stored this forward.
    pub fn kv_of(&self, i: usize) -> Result<(Tensor, Tensor)> {
        self.kv.borrow().get(&i).map(|(k, v)| (k.shallow_clone(), v.shallow_clone())).ok_or_else(|| {
            crate::error::ModelError::Input(format!("layer {i}'s keys and values are reused before it ran"))
        })
    }

    /// Stores layer `i`'s keys and values for the layers that reuse them.
    pub fn store_kv(&self, i: usize, kv: (Tensor, Tensor)) {
        self.kv.borrow_mut().insert(i, kv);
    }
}

impl LayerShared {
    /// What the layers of a model with neither rotary embeddings, sliding windows, linear
    /// attention nor experts share: the attention mask (GPT-2).
    pub fn attention_only(mask: Tensor) -> Self {
        LayerShared {
            mask,
            sliding_mask: None,
            rotary: None,
            rotary_local: None,
            linear: Default::default(),
            router: None,
            side: Default::default(),
            experts: super::ExpertSteps::Routed,
        }
    }

    /// The mask of a layer that slides or not.
    pub fn mask_for(&self, sliding: bool) -> &Tensor {
        match (&self.sliding_mask, sliding) {
            (Some(m), true) => m,
            _ => &self.mask,
        }
    }

    /// The rotary tables of a layer that slides or not.
    pub fn rotary_for(&self, sliding: bool) -> Option<&(Tensor, Tensor)> {
        match (&self.rotary_local, sliding) {
            (Some(r), true) => Some(r),
            _ => self.rotary.as_ref(),
        }
    }
}
