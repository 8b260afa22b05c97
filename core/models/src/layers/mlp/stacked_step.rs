//! A mixture of experts in a decode step that a CUDA graph can capture. The routed forward
//! ([`SparseMoe::forward_routed_by`]) groups tokens by expert with a count per expert read back
//! to the host in every layer, which stops a capture and, eagerly, waits on the device in every
//! layer of every step. A step instead computes over the experts' stacked weights, with no host
//! read and no shape that depends on the routing, in one of two ways chosen by the batch alone
//! (so each batch size's graph keeps its way):
//!
//! - **every expert on every token**, each output weighted by the token's routing weight for
//!   that expert (0 where it was not routed): two or three GEMMs that read every expert's weights
//!   once — which a batch of a few dozen tokens with k experts each reads anyway — at
//!   `experts / k` times the routed FLOPs;
//! - **each token's k experts' weights gathered** (`index_select` on the stacks) and applied as a
//!   batched GEMM per (token, expert) pair: about three times the bytes of the experts the batch
//!   routes to, where the first way reads all of them. It is taken when `3 · tokens · k <
//!   experts`: a batch of one or a few rows, as the last rows of a long decode are after the
//!   finished ones were compacted away.
//!
//! Both are the routed forward's function within float rounding. The stacks: stacked
//! checkpoints (`experts.gate_up_proj`, gpt-oss's) are used as they are; experts stored one by
//! one have their weights laid in two stacks at load ([`SeparateStack`]), each expert's weights
//! views of its slices, so nothing is copied per step.

use tch::Tensor;

use super::{activate, Experts, FusedRows, GateUp, GatedMlp, Linear, SparseMoe};
use crate::config::{Activation, GptOssMoe};
use crate::error::Result;

/// How a decode step computes a mixture of experts ([`crate::CausalLm::set_expert_steps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSteps {
    /// Each token through its experts, counted on the host: eager decoding only. The default
    /// off CUDA, where the stacked ways cost more FLOPs than a CPU has to spare.
    Routed,
    /// Over the stacked weights, every expert on every token or each token's experts gathered,
    /// whichever reads fewer bytes for the batch (see the module docs). The default on CUDA.
    Stacked,
    /// Over the stacked weights, always every expert on every token.
    AllExperts,
    /// Over the stacked weights, always each token's experts gathered.
    Gathered,
}

/// The weights of experts stored one by one, laid in two stacks: each expert's gate and up
/// projections (its [`FusedRows`] buffer) and down projection are views of its slices.
#[derive(Debug)]
pub(crate) struct SeparateStack {
    gate_up: Tensor, // [experts, 2 · inter, hidden], gate rows first
    down: Tensor,    // [experts, hidden, inter]
}

/// The projections of an expert whose gate and up projections share a [`FusedRows`] buffer and
/// have no biases, as the stacks take them: `[gate, up, down]`.
fn parts(m: &GatedMlp) -> Option<[&Linear; 3]> {
    match &m.gate_up {
        GateUp::Separate { gate_proj, up_proj, fused: Some(_) }
            if gate_proj.bias.is_none() && up_proj.bias.is_none() && m.down_proj.bias.is_none() =>
        {
            Some([gate_proj, up_proj, &m.down_proj])
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
        let Some([gate, _, down]) = experts.first().and_then(parts).map(|p| p.map(|l| &l.weight)) else {
            return Ok(None);
        };
        let (inter, hidden) = (gate.size()[0], gate.size()[1]);
        if experts.iter().any(|m| parts(m).is_none()) {
            return Ok(None);
        }
        let n = experts.len() as i64;
        let stack = tch::no_grad(|| -> Result<SeparateStack> {
            let gate_up = Tensor::f_empty([n, 2 * inter, hidden], (gate.kind(), gate.device()))?;
            let down_all = Tensor::f_empty([n, hidden, inter], (down.kind(), down.device()))?;
            for (e, m) in experts.iter().enumerate() {
                let [g, u, d] = parts(m).expect("checked above");
                let slot = gate_up.f_select(0, e as i64)?;
                slot.f_narrow(0, 0, inter)?.f_copy_(&g.weight)?;
                slot.f_narrow(0, inter, inter)?.f_copy_(&u.weight)?;
                down_all.f_select(0, e as i64)?.f_copy_(&d.weight)?;
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
    /// them. Host work only, nothing allocated: it runs in every layer of an eager decode step.
    fn holds(&self, experts: &[GatedMlp]) -> bool {
        let (inter, hidden) = (self.down.size()[2], self.down.size()[1]);
        let elt = self.down.kind().elt_size_in_bytes() as i64;
        let (gate_up, down) = (self.gate_up.data_ptr() as i64, self.down.data_ptr() as i64);
        // Each expert's gate, up and down weights: at these byte offsets, from these bases.
        let (step, at) = ([2 * inter * hidden, 2 * inter * hidden, hidden * inter], [0, inter * hidden, 0]);
        experts.iter().enumerate().all(|(e, m)| {
            parts(m).is_some_and(|p| {
                p.iter().zip([gate_up, gate_up, down]).enumerate().all(|(i, (l, base))| {
                    l.lora.as_ref().is_none_or(|a| a.is_disabled())
                        && l.weight.data_ptr() as i64 == base + (e as i64 * step[i] + at[i]) * elt
                })
            })
        })
    }
}

/// The activation between the two projections.
#[derive(Clone, Copy)]
enum Glu {
    /// `act(gate) · up`, gate in the first half.
    Gated(Activation),
    /// gpt-oss's clamped SwiGLU, gate and up interleaved.
    GptOss(GptOssMoe),
}

impl Glu {
    /// # Shapes
    /// - `both`: `[..., 2 · inter]` → `[..., inter]`
    fn apply(self, both: &Tensor) -> Result<Tensor> {
        match self {
            Glu::Gated(act) => {
                let half = both.size()[both.dim() - 1] / 2;
                let parts = both.f_split_with_sizes([half, half], -1)?;
                Ok(activate(&parts[0], act)?.f_mul(&parts[1])?)
            }
            Glu::GptOss(s) => {
                let pairs = both.f_unflatten(-1, [-1, 2])?.f_unbind(-1)?;
                let gate = pairs[0].f_clamp_max(s.limit)?;
                let up = pairs[1].f_clamp(-s.limit, s.limit)?;
                Ok(up.f_add_scalar(1.0)?.f_mul(&gate.f_mul(&gate.f_mul_scalar(s.alpha)?.f_sigmoid()?)?)?)
            }
        }
    }
}

/// A layer's experts as a step computes with them: gate/up `[E, 2 · inter, hidden]` and down
/// `[E, hidden, inter]` (`rows`: each matrix `[out, in]`) or `[E, hidden, 2 · inter]` and `[E,
/// inter, hidden]`; gpt-oss's biases `[E, 2 · inter]` and `[E, hidden]`.
struct Stacks {
    gate_up: Tensor,
    down: Tensor,
    rows: bool,
    biases: Option<(Tensor, Tensor)>,
    glu: Glu,
}

impl Stacks {
    /// `x` (`[.., in]`, batched like `w`) through `w`, each matrix `[out, in]` when `rows`.
    fn apply(x: &Tensor, w: &Tensor, rows: bool) -> Result<Tensor> {
        Ok(if rows { x.f_bmm(&w.f_transpose(1, 2)?)? } else { x.f_bmm(w)? })
    }

    /// Every expert on every token, weighted by `w`, summed. The weight multiplies the
    /// activations before the down projection (it is linear), so the sum over experts is the
    /// projection's own.
    ///
    /// # Shapes
    /// - `flat`: `[n, hidden]`; `w`: `[n, E]` → `[n, hidden]`
    fn all_experts(&self, flat: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (n, e) = (flat.size()[0], w.size()[1]);
        // [n, E, 2 · inter]: one GEMM against the stack seen as `[E · 2 · inter, hidden]`, or a
        // batched one against each expert's `[hidden, 2 · inter]`.
        let mut both = match self.rows {
            true => flat.f_mm(&self.gate_up.f_reshape([-1, flat.size()[1]])?.f_tr()?)?.f_view([n, e, -1])?,
            false => flat.f_matmul(&self.gate_up)?.f_transpose(0, 1)?,
        };
        if let Some((b, _)) = &self.biases {
            both = both.f_add(b)?;
        }
        let h = self.glu.apply(&both)?.f_mul(&w.f_unsqueeze(-1)?)?; // [n, E, inter]
        let mut out = match self.rows {
            // [E, n, inter] · [E, inter, hidden], summed over E
            true => Self::apply(&h.f_transpose(0, 1)?, &self.down, true)?.f_sum_dim_intlist(0, false, h.kind())?,
            // [n, E · inter] · [E · inter, hidden]
            false => h.f_reshape([n, -1])?.f_mm(&self.down.f_reshape([-1, self.down.size()[2]])?)?,
        };
        if let Some((_, b)) = &self.biases {
            out = out.f_add(&w.f_mm(b)?)?; // Σₑ wₜₑ · biasₑ
        }
        Ok(out)
    }

    /// Each token through the experts it was routed to, their weights gathered from the stacks.
    ///
    /// # Shapes
    /// - `flat`: `[n, hidden]`; `experts`: `[n, k]` int64; `weights`: `[n, k]` → `[n, hidden]`
    fn gathered(&self, flat: &Tensor, experts: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (n, k, hidden) = (flat.size()[0], experts.size()[1], flat.size()[1]);
        let idx = experts.f_reshape([-1])?; // [n·k]: token t's j-th expert at t·k + j
        let x = flat.f_unsqueeze(1)?.f_expand([n, k, hidden], false)?.f_reshape([n * k, 1, hidden])?;
        let mut both = Self::apply(&x, &self.gate_up.f_index_select(0, &idx)?, self.rows)?; // [n·k, 1, 2 · inter]
        if let Some((b, _)) = &self.biases {
            both = both.f_add(&b.f_index_select(0, &idx)?.f_unsqueeze(1)?)?;
        }
        let slot = weights.f_to_kind(flat.kind())?.f_reshape([n * k, 1, 1])?;
        let h = self.glu.apply(&both)?.f_mul(&slot)?; // [n·k, 1, inter]
        let mut y = Self::apply(&h, &self.down.f_index_select(0, &idx)?, self.rows)?; // [n·k, 1, hidden]
        if let Some((_, b)) = &self.biases {
            y = y.f_add(&b.f_index_select(0, &idx)?.f_unsqueeze(1)?.f_mul(&slot)?)?;
        }
        Ok(y.f_view([n, k, hidden])?.f_sum_dim_intlist(1, false, y.kind())?)
    }
}

impl SparseMoe {
    /// Whether the layer can compute a step over stacked weights now: stacked experts always;
    /// experts stored one by one while their stacks hold (no LoRA adapter on them, no storage
    /// swapped by ZeRO stage 3).
    pub fn steps_densely(&self) -> bool {
        match &self.experts {
            Experts::Separate(m, Some(stack)) => stack.holds(m),
            Experts::Separate(_, None) => false,
            Experts::Stacked { .. } | Experts::GptOss { .. } => true,
        }
    }

    /// The experts' stacks for a step (`None` where [`SparseMoe::steps_densely`] is false).
    fn stacks(&self) -> Result<Option<Stacks>> {
        Ok(Some(match &self.experts {
            Experts::Separate(m, Some(s)) if s.holds(m) => Stacks {
                gate_up: s.gate_up.shallow_clone(),
                down: s.down.shallow_clone(),
                rows: true,
                biases: None,
                glu: Glu::Gated(m[0].act),
            },
            Experts::Separate(..) => return Ok(None),
            Experts::Stacked { gate_up, down, act, x_w } => Stacks {
                gate_up: gate_up.effective()?,
                down: down.effective()?,
                rows: !x_w,
                biases: None,
                glu: Glu::Gated(*act),
            },
            Experts::GptOss { gate_up, gate_up_bias, down, down_bias, swiglu } => Stacks {
                gate_up: gate_up.effective()?,
                down: down.effective()?,
                rows: false,
                biases: Some((gate_up_bias.shallow_clone(), down_bias.shallow_clone())),
                glu: Glu::GptOss(*swiglu),
            },
        }))
    }

    /// The experts of a step over their stacked weights, the way `steps` says (`None`: the
    /// layer cannot, or `steps` is [`ExpertSteps::Routed`]).
    ///
    /// # Shapes
    /// - `flat`: `[n, hidden]`; `experts`: `[n, k]` int64; `weights`: `[n, k]` → `[n, hidden]`
    pub(super) fn forward_stacked(
        &self,
        flat: &Tensor,
        experts: &Tensor,
        weights: &Tensor,
        steps: ExpertSteps,
    ) -> Result<Option<Tensor>> {
        let (n, k) = (flat.size()[0], experts.size()[1]);
        let gather = match steps {
            ExpertSteps::Routed => return Ok(None),
            ExpertSteps::Stacked => 3 * n * k < self.num_experts,
            ExpertSteps::AllExperts => false,
            ExpertSteps::Gathered => true,
        };
        let Some(stacks) = self.stacks()? else { return Ok(None) };
        if gather {
            return stacks.gathered(flat, experts, weights).map(Some);
        }
        // [n, E]: each token's weight for each expert, 0 where it was not routed.
        let w = Tensor::f_zeros([n, self.num_experts], (weights.kind(), weights.device()))?
            .f_scatter(1, experts, weights)?
            .f_to_kind(flat.kind())?;
        stacks.all_experts(flat, &w).map(Some)
    }
}
