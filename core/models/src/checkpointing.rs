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
//! The recomputed forward must equal the first: nothing random may run in it (LoRA dropout is
//! refused by the trainer's config check).

use tch::{Kind, Tensor};

use crate::backbone::Backbone;
use crate::error::{ModelError, Result};
use crate::layers::LayerShared;

/// One checkpointed forward pass: the inputs of every layer and of the final norm, and the
/// output leaf. Hand it back to the model that made it ([`crate::CausalLm::backward_checkpointed`]).
#[derive(Debug)]
pub struct Checkpointed {
    ids: Tensor,
    positions: Tensor,
    key_mask: Tensor,
    shared: LayerShared,
    /// `[batch, seq, hidden]` each: the input of layer `i`, then the final norm's.
    inputs: Vec<Tensor>,
    /// The final hidden states, a leaf requiring a gradient.
    hidden: Tensor,
}

impl Checkpointed {
    /// The final hidden states `[batch, seq, hidden]` (after the final norm), a leaf that requires
    /// a gradient: build the head and the loss from it.
    pub fn hidden(&self) -> &Tensor {
        &self.hidden
    }
}

/// Runs `backbone` without a graph, keeping the layer inputs.
///
/// # Shapes
/// - `ids`, `positions`, `key_mask`: `[batch, seq]` → [`Checkpointed::hidden`] `[batch, seq, hidden]`
pub(crate) fn forward(
    backbone: &Backbone,
    ids: &Tensor,
    positions: &Tensor,
    key_mask: &Tensor,
) -> Result<Checkpointed> {
    let (inputs, hidden, shared) = tch::no_grad(|| -> Result<_> {
        let (mut h, shared) = backbone.embed(ids, positions, key_mask, 0)?;
        let mut inputs = Vec::with_capacity(backbone.num_layers() + 1);
        for i in 0..backbone.num_layers() {
            let next = backbone.layer(i, &h, &shared, None)?;
            inputs.push(h);
            h = next;
        }
        let hidden = backbone.final_norm(&h)?;
        inputs.push(h);
        Ok((inputs, hidden, shared))
    })?;
    Ok(Checkpointed {
        ids: ids.shallow_clone(),
        positions: positions.shallow_clone(),
        key_mask: key_mask.shallow_clone(),
        shared,
        inputs,
        hidden: hidden.f_set_requires_grad(true)?,
    })
}

/// Backpropagates the gradient the caller's loss left on [`Checkpointed::hidden`] through the
/// final norm, the layers and the embeddings, accumulating every parameter's gradient. Nothing
/// happens when that gradient is undefined (the loss did not depend on the output). Call it once
/// per backpropagated loss: a second call would add the same gradients again.
pub(crate) fn backward(backbone: &Backbone, ck: &Checkpointed) -> Result<()> {
    let g = ck.hidden.grad();
    if !g.defined() {
        return Ok(());
    }
    let layers = backbone.num_layers();
    if ck.inputs.len() != layers + 1 {
        return Err(ModelError::Input(format!(
            "checkpointed pass of {} layers handed to a model of {layers}",
            ck.inputs.len().saturating_sub(1)
        )));
    }
    let mut g = through(&ck.inputs[layers], &g, |x| backbone.final_norm(x))?;
    for i in (0..layers).rev() {
        g = through(&ck.inputs[i], &g, |x| backbone.layer(i, x, &ck.shared, None))?;
    }
    // Embeddings: recomputed with a graph when they are trained (not under LoRA, say).
    let (h0, _) = backbone.embed(&ck.ids, &ck.positions, &ck.key_mask, 0)?;
    if h0.requires_grad() {
        vjp(&h0, &g)?;
    }
    Ok(())
}

/// Recomputes `f(x)` with a graph from `x` (as a leaf) and backpropagates `g` through it;
/// returns `∂L/∂x` (zeros where nothing flowed).
///
/// # Shapes
/// `x`: the segment's input; `g`: like `f(x)`; returns like `x`
fn through(x: &Tensor, g: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x = x.f_detach()?.f_set_requires_grad(true)?;
    let y = f(&x)?;
    vjp(&y, g)?;
    let dx = x.grad();
    Ok(if dx.defined() { dx } else { x.f_zeros_like()? })
}

/// Backpropagates `g` from `y`: the gradient of `Σ y ⊙ g` with respect to `y` is `g`.
fn vjp(y: &Tensor, g: &Tensor) -> Result<()> {
    if y.requires_grad() {
        y.f_mul(g)?.f_sum(Kind::Float)?.f_backward()?;
    }
    Ok(())
}
