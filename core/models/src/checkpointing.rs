//! Activation (gradient) checkpointing per decoder layer, as transformers'
//! `gradient_checkpointing_enable()` does with `torch.utils.checkpoint` (Chen et al. 2016,
//! "Training Deep Nets with Sublinear Memory Cost").
//!
//! The forward runs without an autograd graph and keeps only each layer's input
//! `[batch, seq, hidden]`; its output is a leaf that requires a gradient, from which the caller
//! builds its head and loss. After the caller's `loss.backward()` has filled that leaf's
//! gradient `g`, [`Checkpointed::backward`] walks the layers from the last to the first: it
//! recomputes layer `i` from its saved input `xᵢ` (now a leaf) with a graph, and backpropagates
//! `Σ yᵢ ⊙ g` — whose gradient with respect to `yᵢ` is exactly `g` — which accumulates the
//! layer's parameter gradients and leaves `∂L/∂xᵢ` in `xᵢ.grad`, the `g` of the layer below.
//! The embeddings come last. Only one layer's activations exist at a time: memory for
//! activations goes from `layers × per-layer activations` to `layers × one hidden state + one
//! layer's activations`, for one more forward pass of compute.
//!
//! With a prompt shared by several rows ([`crate::prefix`]) the pass has two segments: the
//! distinct prompts, and the rest of every row on top of its prompt's keys and values. Layer `i`
//! of both is recomputed together (the rows' attention reads the prompts' keys and values of the
//! same layer) and one backward gives the gradients of both inputs.
//!
//! A model that computes the mixture-of-experts load-balancing loss records its routing in the
//! forward ([`crate::layers::load_balance`]): the loss is handed out as a leaf
//! ([`Checkpointed::aux_loss`]) for the caller to add to its own, and each layer's recomputation
//! backpropagates its share of it, `Σₑ (∂aux/∂pₑ) · pₑ,layer` times the gradient the caller's loss
//! left on the leaf.
//!
//! The recomputed forward must equal the first: nothing random may run in it (LoRA dropout is
//! refused by the trainer's config check).
//!
//! With sharded parameters (a [`crate::gate::ParamGate`], ZeRO stage 3) the pass is where each
//! unit is made whole and freed: the outer unit (embeddings, final norm, heads) from the start of
//! the forward to the end of the backward, each layer around its forward and again around its
//! recomputation, after which its gradients are reduced and freed. The gate sees the same calls
//! in the same order whatever the input, also when the loss did not depend on the pass.

use tch::{Kind, Tensor};

use crate::backbone::{Backbone, Routing};
use crate::error::{ModelError, Result};
use crate::gate::{gated, gather, prefetch, release, Gate, Unit};
use crate::layers::{KvCache, LayerShared, RouterStats};

/// Rows of one checkpointed forward: their inputs and what their layers share.
#[derive(Debug)]
struct Segment {
    ids: Tensor,
    positions: Tensor,
    key_mask: Tensor,
    /// Tokens before `ids` that the segment attends to (the shared prefix's).
    past: i64,
    /// Image features in place of the image placeholders (with the vision tower's graph when it
    /// trains).
    visual: Option<crate::visual_input::Visual>,
    shared: LayerShared,
    /// `[rows, seq, hidden]` each: the input of layer `i`, then the final norm's.
    inputs: Vec<Tensor>,
}

impl Segment {
    /// Embeds the segment (with a graph when the embeddings train).
    fn embed(
        backbone: &Backbone,
        (ids, positions, key_mask): (&Tensor, &Tensor, &Tensor),
        past: i64,
        visual: Option<&crate::visual_input::Visual>,
    ) -> Result<Self> {
        let (h, shared) = backbone.embed(ids, positions, key_mask, past, visual)?;
        let inputs = vec![h];
        Ok(Segment {
            ids: ids.shallow_clone(),
            positions: positions.shallow_clone(),
            key_mask: key_mask.shallow_clone(),
            past,
            visual: visual.map(crate::visual_input::Visual::shallow_clone),
            shared,
            inputs,
        })
    }

    /// The current top of the segment.
    fn top(&self) -> &Tensor {
        &self.inputs[self.inputs.len() - 1]
    }

    /// The embeddings recomputed with a graph, `[rows, seq, hidden]`, and the per-layer inputs
    /// made from them (Gemma 4), `[rows, seq, layers, dim]`.
    fn embeddings(&self, backbone: &Backbone) -> Result<(Tensor, Option<Tensor>)> {
        let (h, shared) =
            backbone.embed(&self.ids, &self.positions, &self.key_mask, self.past, self.visual.as_ref())?;
        let per_layer = shared.side.per_layer.borrow_mut().take();
        Ok((h, per_layer))
    }
}

/// The leaves a backward swaps in for what a segment's layers read beside their input (Gemma 4's
/// per-layer inputs, and the keys and values later layers reuse): each layer's recomputation
/// accumulates its gradient into them; the layer that made a reused pair backpropagates it from
/// its recomputed pair, and the embeddings from the per-layer inputs.
#[derive(Debug, Default)]
struct SideLeaves {
    per_layer: Option<Tensor>,
    kv: std::collections::BTreeMap<usize, (Tensor, Tensor)>,
    /// Qwen3-VL's deep-stack features, where they carry the trained tower's graph.
    deepstack: Vec<Tensor>,
}

impl SideLeaves {
    /// Swaps leaves in for `segment`'s stored side inputs.
    fn swap_in(segment: &Segment) -> Result<Self> {
        let leaf = |t: &Tensor| -> Result<Tensor> { Ok(t.f_detach()?.f_set_requires_grad(true)?) };
        let side = &segment.shared.side;
        let per_layer = side.per_layer.borrow().as_ref().map(leaf).transpose()?;
        *side.per_layer.borrow_mut() = per_layer.as_ref().map(Tensor::shallow_clone);
        let mut kv = std::collections::BTreeMap::new();
        for (i, (k, v)) in side.kv.borrow_mut().iter_mut() {
            (*k, *v) = (leaf(k)?, leaf(v)?);
            kv.insert(*i, (k.shallow_clone(), v.shallow_clone()));
        }
        let mut deepstack = Vec::new();
        if let Some(d) = side.deepstack.borrow_mut().as_mut().filter(|d| d.features.iter().any(Tensor::requires_grad)) {
            for f in d.features.iter_mut() {
                *f = leaf(f)?;
                deepstack.push(f.shallow_clone());
            }
        }
        Ok(SideLeaves { per_layer, kv, deepstack })
    }

    /// `Σ k ⊙ ∂L/∂k + Σ v ⊙ ∂L/∂v` over the pair layer `i` just recomputed into `segment`, whose
    /// gradient with respect to that pair is what the reusing layers left on the leaves.
    fn reused_term(&self, i: usize, segment: &Segment) -> Result<Option<Tensor>> {
        let Some((lk, lv)) = self.kv.get(&i) else { return Ok(None) };
        let (k, v) = segment.shared.side.kv_of(i)?;
        let mut total: Option<Tensor> = None;
        for (y, leaf) in [(k, lk), (v, lv)] {
            let g = leaf.grad();
            if g.defined() && y.requires_grad() {
                let term = y.f_mul(&g)?.f_sum(Kind::Float)?;
                total = Some(match total {
                    Some(t) => t.f_add(&term)?,
                    None => term,
                });
            }
        }
        Ok(total)
    }

    /// The gradient the layers left on the per-layer inputs (zeros where none flowed).
    fn per_layer_grad(&self) -> Result<Option<Tensor>> {
        self.per_layer
            .as_ref()
            .map(|t| {
                let g = t.grad();
                Ok(if g.defined() { g } else { t.f_zeros_like()? })
            })
            .transpose()
    }
}

/// The distinct prefixes of a pass that shares them, and for each row the index of its prefix.
#[derive(Debug)]
struct SharedPart {
    prefixes: Segment,
    of_row: Tensor,
}

/// One checkpointed forward pass: the inputs of every layer and of the final norm, and the
/// output leaf. Hand it back to the model that made it ([`crate::CausalLm::backward_checkpointed`]).
#[derive(Debug)]
pub struct Checkpointed {
    rows: Segment,
    prefix: Option<SharedPart>,
    /// The final hidden states, a leaf requiring a gradient.
    hidden: Tensor,
    /// The load-balancing loss, in a model that computes it.
    aux: Option<AuxLeaf>,
    /// The gate of the model's sharded parameters, if any (the backward uses the forward's).
    gate: Gate,
}

impl Checkpointed {
    /// The final hidden states (after the final norm), a leaf that requires a gradient: build the
    /// head and the loss from it. `[batch, seq, hidden]`, or with a shared prefix of `P` tokens
    /// `[batch, seq − P + 1, hidden]` (positions `P − 1 ..`, see
    /// [`crate::CausalLm::hidden_states_after_prefix`]).
    pub fn hidden(&self) -> &Tensor {
        &self.hidden
    }

    /// The mixture-of-experts load-balancing loss of the pass (`[]` f32, a leaf that requires a
    /// gradient) in a model that computes it (`output_router_logits`): add it, weighted, to the
    /// loss built on [`Checkpointed::hidden`].
    pub fn aux_loss(&self) -> Option<&Tensor> {
        self.aux.as_ref().map(|a| &a.loss)
    }
}

/// The load-balancing loss of a checkpointed pass: its value as a leaf, and `∂aux/∂p` (`[experts]`)
/// to weight the probabilities each layer's recomputation records.
#[derive(Debug)]
struct AuxLeaf {
    loss: Tensor,
    grad_of_probs: Tensor,
}

impl AuxLeaf {
    /// The leaf of a forward's routing statistics (of both segments of a shared-prefix pass).
    fn of(stats: impl IntoIterator<Item = Option<RouterStats>>) -> Result<Option<AuxLeaf>> {
        RouterStats::sum(stats)?
            .map(|s| Ok(AuxLeaf { loss: s.loss()?.f_set_requires_grad(true)?, grad_of_probs: s.grad_of_probs()? }))
            .transpose()
    }
}

/// For each distinct prefix, how many rows hold it (`of_row`: `[batch]` → `[prefixes]`): the
/// weight of its tokens in the routing statistics.
pub(crate) fn rows_per_prefix(of_row: &Tensor, prefixes: i64) -> Result<Tensor> {
    Ok(of_row.f_bincount::<&Tensor>(None, prefixes)?)
}

/// Runs `backbone` without a graph, keeping the layer inputs; `visual` features replace the image
/// placeholders (their graph, if any, is backpropagated with the embeddings').
///
/// # Shapes
/// - `ids`, `key_mask`: `[batch, seq]`; `positions`: `[batch, seq]` or `[3, batch, seq]` →
///   [`Checkpointed::hidden`] `[batch, seq, hidden]`
pub(crate) fn forward(
    backbone: &Backbone,
    gate: &Gate,
    (ids, positions, key_mask): (&Tensor, &Tensor, &Tensor),
    visual: Option<&crate::visual_input::Visual>,
) -> Result<Checkpointed> {
    gather(gate, Unit::Outer)?;
    prefetch(gate, Unit::Layer(0))?;
    let (rows, hidden) = tch::no_grad(|| -> Result<_> {
        let mut rows = Segment::embed(backbone, (ids, positions, key_mask), 0, visual)?;
        for i in 0..backbone.num_layers() {
            let next = gated(gate, i, || backbone.layer(i, rows.top(), &rows.shared, None))?;
            rows.inputs.push(next);
        }
        let hidden = backbone.final_norm(rows.top())?;
        Ok((rows, hidden))
    })?;
    let aux = AuxLeaf::of([rows.shared.router.as_ref().and_then(|r| r.take())])?;
    Ok(Checkpointed { rows, prefix: None, hidden: hidden.f_set_requires_grad(true)?, aux, gate: gate.clone() })
}

/// [`forward`] with each distinct prefix computed once: `prefix_*` are the distinct prefixes
/// (`[u, p]`), `rest_*` the rest of every row (`[batch, seq − p]`, `key_mask` `[batch, seq]`),
/// `of_row` (`[batch]`) the prefix of each row.
///
/// # Shapes
/// → [`Checkpointed::hidden`] `[batch, seq − p + 1, hidden]`
pub(crate) fn forward_after_prefix(
    backbone: &Backbone,
    gate: &Gate,
    prefix: (&Tensor, &Tensor, &Tensor),
    rest: (&Tensor, &Tensor, &Tensor),
    of_row: &Tensor,
) -> Result<Checkpointed> {
    let (p_ids, p_pos, p_mask) = prefix;
    let (ids, positions, key_mask) = rest;
    let p = p_ids.size()[1];
    gather(gate, Unit::Outer)?;
    prefetch(gate, Unit::Layer(0))?;
    let (prefixes, rows, hidden) = tch::no_grad(|| -> Result<_> {
        let mut pre = Segment::embed(backbone, (p_ids, p_pos, p_mask), 0, None)?;
        Routing::Record(Some(&rows_per_prefix(of_row, p_ids.size()[0])?)).apply(&mut pre.shared)?;
        let mut rows = Segment::embed(backbone, (ids, positions, key_mask), p, None)?;
        for i in 0..backbone.num_layers() {
            let (np, nr) = gated(gate, i, || {
                layer_pair(backbone, i, (pre.top(), &pre.shared), (rows.top(), &rows.shared), of_row)
            })?;
            pre.inputs.push(np);
            rows.inputs.push(nr);
        }
        let hidden = final_pair(backbone, pre.top(), rows.top(), of_row)?;
        Ok((pre, rows, hidden))
    })?;
    let taken = |s: &Segment| s.shared.router.as_ref().and_then(|r| r.take());
    let aux = AuxLeaf::of([taken(&prefixes), taken(&rows)])?;
    let prefix = Some(SharedPart { prefixes, of_row: of_row.shallow_clone() });
    Ok(Checkpointed { rows, prefix, hidden: hidden.f_set_requires_grad(true)?, aux, gate: gate.clone() })
}

/// [`forward_after_prefix`] without keeping the layer inputs or making a leaf: the layers of both
/// segments interleaved, each layer gathered once (a sharded model's gate sees the calls of a
/// plain forward whatever the prefix sharing).
///
/// # Shapes
/// → `[batch, seq − p + 1, hidden]`, and with `record` (a training pass) the routing statistics
/// of both segments (see [`crate::backbone::Backbone::run`])
pub(crate) fn forward_after_prefix_plain(
    backbone: &Backbone,
    gate: &Gate,
    prefix: (&Tensor, &Tensor, &Tensor),
    rest: (&Tensor, &Tensor, &Tensor),
    of_row: &Tensor,
    record: bool,
) -> Result<(Tensor, Option<RouterStats>)> {
    let (p_ids, p_pos, p_mask) = prefix;
    let (ids, positions, key_mask) = rest;
    let p = p_ids.size()[1];
    let (mut hp, mut pre_shared) = backbone.embed(p_ids, p_pos, p_mask, 0, None)?;
    let (mut hr, mut rows_shared) = backbone.embed(ids, positions, key_mask, p, None)?;
    if record {
        Routing::Record(Some(&rows_per_prefix(of_row, p_ids.size()[0])?)).apply(&mut pre_shared)?;
    } else {
        Routing::Off.apply(&mut pre_shared)?;
        Routing::Off.apply(&mut rows_shared)?;
    }
    for i in 0..backbone.num_layers() {
        (hp, hr) = gated(gate, i, || layer_pair(backbone, i, (&hp, &pre_shared), (&hr, &rows_shared), of_row))?;
    }
    let stats = RouterStats::sum([&pre_shared, &rows_shared].map(|s| s.router.as_ref().and_then(|r| r.take())))?;
    Ok((final_pair(backbone, &hp, &hr, of_row)?, stats))
}

/// Layer `i` of the prefixes `[u, p, hidden]`, then of the rows `[batch, s, hidden]` attending to
/// their prefix's keys and values.
fn layer_pair(
    backbone: &Backbone,
    i: usize,
    prefixes: (&Tensor, &LayerShared),
    rows: (&Tensor, &LayerShared),
    of_row: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let mut cache = KvCache::growing();
    let yp = backbone.layer(i, prefixes.0, prefixes.1, Some(&mut cache))?;
    cache.select_rows(of_row)?;
    let yr = backbone.layer(i, rows.0, rows.1, Some(&mut cache))?;
    Ok((yp, yr))
}

/// The final norm of both segments, each row's prefix's last position first:
/// `[u, p, hidden]`, `[batch, s, hidden]` → `[batch, s + 1, hidden]`.
fn final_pair(backbone: &Backbone, prefixes: &Tensor, rows: &Tensor, of_row: &Tensor) -> Result<Tensor> {
    let p = prefixes.size()[1];
    let last = backbone.final_norm(prefixes)?.f_narrow(1, p - 1, 1)?.f_index_select(0, of_row)?; // [batch, 1, h]
    Ok(Tensor::f_cat(&[&last, &backbone.final_norm(rows)?], 1)?)
}

/// Backpropagates the gradient the caller's loss left on [`Checkpointed::hidden`] through the
/// final norm, the layers and the embeddings, accumulating every parameter's gradient. Nothing
/// happens when that gradient is undefined (the loss did not depend on the output). Call it once
/// per backpropagated loss: a second call would add the same gradients again.
pub(crate) fn backward(backbone: &Backbone, ck: &Checkpointed) -> Result<()> {
    let layers = backbone.num_layers();
    if ck.rows.inputs.len() != layers + 1 {
        return Err(ModelError::Input(format!(
            "checkpointed pass of {} layers handed to a model of {layers}",
            ck.rows.inputs.len().saturating_sub(1)
        )));
    }
    let mut g = ck.hidden.grad();
    // The load-balancing loss's weights `∂L/∂aux · ∂aux/∂p`, where the caller's loss used it.
    let aux = match &ck.aux {
        Some(a) if a.loss.grad().defined() => Some(a.grad_of_probs.f_mul(&a.loss.grad())?),
        _ => None,
    };
    if !g.defined() && aux.is_some() {
        g = ck.hidden.f_zeros_like()?;
    }
    // What the layers read beside their input, as leaves (Gemma 4).
    let segments: Vec<&Segment> = ck.prefix.iter().map(|p| &p.prefixes).chain([&ck.rows]).collect();
    let leaves = segments.iter().map(|s| SideLeaves::swap_in(s)).collect::<Result<Vec<_>>>()?;
    let rows_leaves = &leaves[leaves.len() - 1];
    // One more output per recomputed layer, backpropagated with gradient 1: its share of the
    // load-balancing loss, and the terms that carry the gradient of its reused keys and values.
    let one = Tensor::f_ones([], (Kind::Float, ck.hidden.device()))?;
    let with_extra = |i: usize, mut y: Vec<Tensor>| -> Result<Vec<Tensor>> {
        let mut terms = Vec::new();
        for (s, l) in segments.iter().zip(&leaves) {
            if let (Some(w), Some(stats)) = (&aux, s.shared.router.as_ref().and_then(|r| r.take())) {
                terms.push(stats.probs.f_mul(w)?.f_sum(Kind::Float)?);
            }
            terms.extend(l.reused_term(i, s)?);
        }
        if let Some(first) = terms.pop() {
            y.push(terms.iter().try_fold(first, |t, x| t.f_add(x))?);
        }
        Ok(y)
    };
    let gate = &ck.gate;
    // Layer `i`'s recomputation and backward between gathering it (the layer below prefetched
    // meanwhile) and reducing its gradients.
    let layer_back = |i: usize, f: &dyn Fn() -> Result<Vec<Tensor>>| -> Result<Vec<Tensor>> {
        gather(gate, Unit::Layer(i))?;
        if i > 0 {
            prefetch(gate, Unit::Layer(i - 1))?;
        }
        let g = f()?;
        release(gate, Unit::Layer(i), true)?;
        Ok(g)
    };
    if layers > 0 {
        prefetch(gate, Unit::Layer(layers - 1))?;
    }
    if !g.defined() {
        // Nothing to backpropagate; a gate still sees every layer's calls (collectives).
        for i in (0..layers).rev() {
            layer_back(i, &|| Ok(Vec::new()))?;
        }
        return release(gate, Unit::Outer, true);
    }
    match &ck.prefix {
        None => {
            let mut g = through(&[&ck.rows.inputs[layers]], &[&g], |x| Ok(vec![backbone.final_norm(x[0])?]))?;
            for i in (0..layers).rev() {
                let f = |x: &[&Tensor]| with_extra(i, vec![backbone.layer(i, x[0], &ck.rows.shared, None)?]);
                g = layer_back(i, &|| through(&[&ck.rows.inputs[i]], &[&g[0], &one], f))?;
            }
            embeddings_back(backbone, &ck.rows, rows_leaves, &g[0])?;
        }
        Some(SharedPart { prefixes: pre, of_row }) => {
            let tops = [&pre.inputs[layers], &ck.rows.inputs[layers]];
            let mut g = through(&tops, &[&g], |x| Ok(vec![final_pair(backbone, x[0], x[1], of_row)?]))?;
            for i in (0..layers).rev() {
                let f = |x: &[&Tensor]| {
                    let (yp, yr) = layer_pair(backbone, i, (x[0], &pre.shared), (x[1], &ck.rows.shared), of_row)?;
                    with_extra(i, vec![yp, yr])
                };
                let gs = [&g[0], &g[1], &one];
                g = layer_back(i, &|| through(&[&pre.inputs[i], &ck.rows.inputs[i]], &gs, f))?;
            }
            // Tied embeddings are used three times (LM head, rows, prefixes); one plain backward
            // sums their gradients in that order, and so do these separate calls, bit for bit.
            embeddings_back(backbone, &ck.rows, rows_leaves, &g[1])?;
            embeddings_back(backbone, pre, &leaves[0], &g[0])?;
        }
    }
    release(gate, Unit::Outer, true)
}

/// Backpropagates `g` (`[rows, seq, hidden]`) through `segment`'s recomputed embeddings, with the
/// gradient its layers left on the per-layer inputs made from them and on the deep-stack
/// features (one backward through a trained vision tower's graph).
fn embeddings_back(backbone: &Backbone, segment: &Segment, leaves: &SideLeaves, g: &Tensor) -> Result<()> {
    let (h, per_layer) = segment.embeddings(backbone)?;
    let (mut y, mut grads) = (vec![h], vec![g.shallow_clone()]);
    if let (Some(p), Some(gp)) = (per_layer, leaves.per_layer_grad()?) {
        y.push(p);
        grads.push(gp);
    }
    let features = segment.visual.as_ref().map_or(&[][..], |v| &v.deepstack[..]);
    for (f, l) in features.iter().zip(&leaves.deepstack) {
        let gl = l.grad();
        if gl.defined() {
            y.push(f.shallow_clone());
            grads.push(gl);
        }
    }
    vjp(&y, &grads.iter().collect::<Vec<_>>())
}

/// Recomputes `f(x)` with a graph from the `x` (as leaves) and backpropagates `g` (one per
/// output) through it; returns `∂L/∂x` (zeros where nothing flowed).
///
/// # Shapes
/// `x`: the segment's inputs; `g`: like `f(x)`; returns like `x`
fn through(x: &[&Tensor], g: &[&Tensor], f: impl Fn(&[&Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    let leaves =
        x.iter().map(|x| x.f_detach()?.f_set_requires_grad(true)).collect::<std::result::Result<Vec<_>, _>>()?;
    let y = f(&leaves.iter().collect::<Vec<_>>())?;
    vjp(&y, g)?;
    leaves
        .iter()
        .map(|x| {
            let dx = x.grad();
            Ok(if dx.defined() { dx } else { x.f_zeros_like()? })
        })
        .collect()
}

/// Backpropagates each `g` from its `y`: the gradient of `Σ y ⊙ g` with respect to `y` is `g`.
/// Outputs without a graph (embeddings that do not train, under LoRA) are skipped, and so are
/// gradients without an output (`g` may be longer than `y`).
fn vjp(y: &[Tensor], g: &[&Tensor]) -> Result<()> {
    let mut total: Option<Tensor> = None;
    for (y, g) in y.iter().zip(g).filter(|(y, _)| y.requires_grad()) {
        let term = y.f_mul(g)?.f_sum(Kind::Float)?;
        total = Some(match total {
            Some(t) => t.f_add(&term)?,
            None => term,
        });
    }
    if let Some(t) = total {
        t.f_backward()?;
    }
    Ok(())
}
