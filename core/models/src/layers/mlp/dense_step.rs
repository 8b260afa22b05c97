//! A mixture of experts in a decode step that a CUDA graph can capture: every expert on every
//! token, each output weighted by the token's routing weight for that expert (0 for the experts
//! it was not routed to) and summed. It is [`SparseMoe::forward_routed_by`]'s function within
//! float rounding, but it counts nothing on the host and no shape depends on the routing — the
//! routed forward groups tokens by expert with a count per expert read back each layer, which
//! stops a capture and, eagerly, waits on the device in every layer of every step.
//!
//! Its cost is the experts' whole stack: their weights are read once per step, as a batch of
//! a few dozen tokens with k experts each reads them anyway, with `experts / k` times the routed
//! FLOPs — on a GPU that small step is bound by the weights it reads, and the graph saves
//! a launch per kernel. A batch of one token reads `experts / k` times the weights it needs.
//!
//! The stacks: stacked checkpoints (`experts.gate_up_proj`, gpt-oss's) are used as they are;
//! experts stored one by one have their weights laid in two stacks at load
//! ([`SeparateStack`]), each expert's weights views of its slices, so nothing is copied per step.

use tch::Tensor;

use super::{activate, Experts, FusedRows, GateUp, GatedMlp, SparseMoe};
use crate::error::Result;

/// The weights of experts stored one by one, laid in two stacks: each expert's gate and up
/// projections (its [`FusedRows`] buffer) and down projection are views of its slices.
#[derive(Debug)]
pub(crate) struct SeparateStack {
    gate_up: Tensor, // [experts, 2 · inter, hidden], gate rows first
    down: Tensor,    // [experts, hidden, inter]
}

/// The weight variables of an expert whose gate and up projections share a [`FusedRows`]
/// buffer and have no biases, as the stacks take them: `(gate, up, down)`.
fn parts(m: &GatedMlp) -> Option<(&Tensor, &Tensor, &Tensor)> {
    match &m.gate_up {
        GateUp::Separate { gate_proj, up_proj, fused: Some(_) }
            if gate_proj.bias.is_none() && up_proj.bias.is_none() && m.down_proj.bias.is_none() =>
        {
            Some((&gate_proj.weight, &up_proj.weight, &m.down_proj.weight))
        }
        _ => None,
    }
}

impl SeparateStack {
    /// Moves the experts' weights into the two stacks and re-points each expert's weights (the
    /// same variables: the optimizer, LoRA and saving see nothing change) and its gate/up buffer
    /// at its slices. `None`, leaving them as they are, when an expert has biases or a fused
    /// `gate_up_proj` tensor of its own.
    pub(crate) fn new(experts: &mut [GatedMlp]) -> Result<Option<SeparateStack>> {
        let Some((gate, _, down)) = experts.first().and_then(parts) else { return Ok(None) };
        let (inter, hidden) = (gate.size()[0], gate.size()[1]);
        if experts.iter().any(|m| parts(m).is_none()) {
            return Ok(None);
        }
        let n = experts.len() as i64;
        let options = (gate.kind(), gate.device());
        let stack = tch::no_grad(|| -> Result<SeparateStack> {
            let gate_up = Tensor::f_empty([n, 2 * inter, hidden], options)?;
            let down_all = Tensor::f_empty([n, hidden, inter], (down.kind(), down.device()))?;
            for (e, m) in experts.iter().enumerate() {
                let (g, u, d) = parts(m).expect("checked above");
                let slot = gate_up.f_select(0, e as i64)?;
                slot.f_narrow(0, 0, inter)?.f_copy_(g)?;
                slot.f_narrow(0, inter, inter)?.f_copy_(u)?;
                down_all.f_select(0, e as i64)?.f_copy_(d)?;
            }
            Ok(SeparateStack { gate_up, down: down_all })
        })?;
        for (e, m) in experts.iter_mut().enumerate() {
            let slot = stack.gate_up.f_select(0, e as i64)?;
            if let GateUp::Separate { gate_proj, up_proj, fused } = &mut m.gate_up {
                gate_proj.weight.f_set_data(&slot.f_narrow(0, 0, inter)?)?;
                up_proj.weight.f_set_data(&slot.f_narrow(0, inter, inter)?)?;
                *fused = Some(FusedRows::over(slot));
            }
            m.down_proj.weight.f_set_data(&stack.down.f_select(0, e as i64)?)?;
        }
        Ok(Some(stack))
    }

    /// Whether the stacks still are the experts' weights: each expert's weights view their
    /// slices (ZeRO stage 3 swaps a gathered weight's storage) and no LoRA adapter adds to
    /// them. Host work only.
    fn holds(&self, experts: &[GatedMlp]) -> bool {
        let at = |t: &Tensor, base: &Tensor, offset: i64| {
            t.data_ptr() as i64 == base.data_ptr() as i64 + offset * base.kind().elt_size_in_bytes() as i64
        };
        let (inter, hidden) = (self.down.size()[2], self.down.size()[1]);
        experts.iter().enumerate().all(|(e, m)| {
            let e = e as i64;
            let idle = m.linears().iter().all(|(_, l)| l.lora.as_ref().is_none_or(|a| a.is_disabled()));
            idle && parts(m).is_some_and(|(g, u, d)| {
                at(g, &self.gate_up, e * 2 * inter * hidden)
                    && at(u, &self.gate_up, (e * 2 + 1) * inter * hidden)
                    && at(d, &self.down, e * hidden * inter)
            })
        })
    }
}

impl SparseMoe {
    /// Whether the layer can run every expert on every token now ([`SparseMoe::forward`] with
    /// `dense`): stacked experts always; experts stored one by one while their stacks hold.
    pub fn steps_densely(&self) -> bool {
        match &self.experts {
            Experts::Separate(m, Some(stack)) => stack.holds(m),
            Experts::Separate(_, None) => false,
            Experts::Stacked { .. } | Experts::GptOss { .. } => true,
        }
    }

    /// Every expert on every token of `flat`, weighted by the routing and summed: `Σₑ wₜₑ ·
    /// expertₑ(xₜ)`, `wₜₑ` the token's weight for expert e where it was routed there, else 0.
    /// The weight multiplies the activations before the down projection (it is linear), so the
    /// sum over experts is the down projection's own.
    ///
    /// # Shapes
    /// - `flat`: `[n, hidden]`; `experts`: `[n, k]` int64; `weights`: `[n, k]` → `[n, hidden]`
    pub(super) fn forward_dense(&self, flat: &Tensor, experts: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (n, count) = (flat.size()[0], self.num_experts);
        // [n, E]: each token's weight for each expert.
        let w = Tensor::f_zeros([n, count], (weights.kind(), weights.device()))?.f_scatter(1, experts, weights)?;
        let w = w.f_to_kind(flat.kind())?;
        // Pre-activations `[n, E, 2 · inter]` from a stack `[E, 2 · inter, hidden]` (`rows`) or
        // `[E, hidden, 2 · inter]`: one GEMM against the stack seen as `[E · 2 · inter, hidden]`,
        // or one batched against each expert's.
        let project = |stack: &Tensor, rows: bool| -> Result<Tensor> {
            Ok(match rows {
                true => flat.f_mm(&stack.f_reshape([-1, stack.size()[2]])?.f_tr()?)?.f_view([n, count, -1])?,
                false => flat.f_matmul(stack)?.f_transpose(0, 1)?, // [E, n, 2 · inter] → [n, E, ·]
            })
        };
        // The weighted activations `[n, E, inter]` through a down stack `[E, hidden, inter]`
        // (`rows`: a batched GEMM per expert, summed) or `[E, inter, hidden]` (one GEMM over all).
        let down = |h: &Tensor, stack: &Tensor, rows: bool| -> Result<Tensor> {
            let h = h.f_mul(&w.f_unsqueeze(-1)?)?;
            Ok(match rows {
                true => h.f_transpose(0, 1)?.f_bmm(&stack.f_transpose(1, 2)?)?.f_sum_dim_intlist(0, false, h.kind())?,
                false => h.f_reshape([n, -1])?.f_mm(&stack.f_reshape([-1, stack.size()[2]])?)?,
            })
        };
        let gated = |both: &Tensor, act| -> Result<Tensor> {
            let half = both.size()[2] / 2;
            let parts = both.f_split_with_sizes([half, half], 2)?;
            Ok(activate(&parts[0], act)?.f_mul(&parts[1])?)
        };
        match &self.experts {
            Experts::Separate(m, Some(stack)) => {
                let h = gated(&project(&stack.gate_up, true)?, m[0].act)?;
                down(&h, &stack.down, true)
            }
            Experts::Separate(_, None) => unreachable!("steps_densely is false without stacks"),
            Experts::Stacked { gate_up, down: d, act, x_w } => {
                let h = gated(&project(&gate_up.effective()?, !x_w)?, *act)?;
                down(&h, &d.effective()?, !x_w)
            }
            Experts::GptOss { gate_up, gate_up_bias, down: d, down_bias, swiglu } => {
                let both = project(&gate_up.effective()?, false)?.f_add(gate_up_bias)?; // gate and up interleaved
                let pairs = both.f_reshape([n, count, -1, 2])?.f_unbind(-1)?;
                let gate = pairs[0].f_clamp_max(swiglu.limit)?;
                let up = pairs[1].f_clamp(-swiglu.limit, swiglu.limit)?;
                let h = up.f_add_scalar(1.0)?.f_mul(&gate.f_mul(&gate.f_mul_scalar(swiglu.alpha)?.f_sigmoid()?)?)?;
                // Σₑ wₜₑ · biasₑ: the biases of the experts a token went to.
                Ok(down(&h, &d.effective()?, false)?.f_add(&w.f_mm(&down_bias.f_to_kind(flat.kind())?)?)?)
            }
        }
    }
}
