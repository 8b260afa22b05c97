//! The MLPs of the rotary decoders: the gated MLP `down(act(gate(x)) · up(x))` with separate or
//! fused (`gate_up_proj`, Phi-3) projections, and the routed mixture of experts of Qwen3-MoE and
//! Qwen3.5-MoE (with its gated shared expert; experts stored one by one or stacked).

mod stacked_step;

pub use stacked_step::ExpertSteps;

use std::sync::Mutex;

use tch::{Kind, Tensor};

use super::{activate, linear, FusedRows, Linear, RouterRecord};
use crate::config::{Activation, ArchConfig, GptOssMoe, MoeConfig};
use crate::error::Result;
use crate::lora::StackedWeight;
use crate::weights::WeightLoader;

/// gate and up projections.
#[derive(Debug)]
enum GateUp {
    /// Two checkpoint tensors, stored back to back in one buffer ([`FusedRows`]).
    Separate { gate_proj: Linear, up_proj: Linear, fused: Option<FusedRows> },
    /// One `[gate; up]` projection, split in halves.
    Fused(Linear),
}

/// Gated MLP: `down(act(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct GatedMlp {
    gate_up: GateUp,
    down_proj: Linear,
    act: Activation,
}

impl GatedMlp {
    /// Loads an MLP of intermediate size `inter` from scope `w`.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, inter: i64) -> Result<Self> {
        let (h, bias) = (cfg.hidden_size, cfg.mlp_bias);
        let gate_up = if cfg.fused_gate_up {
            GateUp::Fused(Linear::load(&w.pp("gate_up_proj"), h, 2 * inter, bias)?)
        } else {
            let mut gate_proj = Linear::load(&w.pp("gate_proj"), h, inter, bias)?;
            let mut up_proj = Linear::load(&w.pp("up_proj"), h, inter, bias)?;
            let fused = FusedRows::new(&mut [&mut gate_proj, &mut up_proj])?;
            GateUp::Separate { gate_proj, up_proj, fused }
        };
        Ok(GatedMlp { gate_up, down_proj: Linear::load(&w.pp("down_proj"), inter, h, bias)?, act: cfg.activation })
    }

    /// # Shapes
    /// - `x`: `[..., hidden]` → `[..., hidden]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let both = match &self.gate_up {
            GateUp::Separate { gate_proj, up_proj, fused } => {
                match FusedRows::try_forward(fused.as_ref(), &[gate_proj, up_proj], x)? {
                    Some(both) => both,
                    None => {
                        return self
                            .down_proj
                            .forward(&activate(&gate_proj.forward(x)?, self.act)?.f_mul(&up_proj.forward(x)?)?)
                    }
                }
            }
            GateUp::Fused(l) => l.forward(x)?,
        };
        // One split (one `cat` backward), not two narrows (each a zeroed full-size gradient).
        let half = both.size()[both.dim() - 1] / 2;
        let parts = both.f_split_with_sizes([half, half], -1)?;
        self.down_proj.forward(&activate(&parts[0], self.act)?.f_mul(&parts[1])?)
    }

    /// Lets go of the gate/up buffer ([`FusedRows::release`]).
    pub(crate) fn release_buffers(&mut self) {
        if let GateUp::Separate { fused: Some(f), .. } = &mut self.gate_up {
            f.release();
        }
    }

    /// The linear layers with their names below `mlp`.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = match &mut self.gate_up {
            GateUp::Separate { gate_proj, up_proj, .. } => vec![("gate_proj", gate_proj), ("up_proj", up_proj)],
            GateUp::Fused(l) => vec![("gate_up_proj", l)],
        };
        out.push(("down_proj", &mut self.down_proj));
        out
    }

    /// [`GatedMlp::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = match &self.gate_up {
            GateUp::Separate { gate_proj, up_proj, .. } => vec![("gate_proj", gate_proj), ("up_proj", up_proj)],
            GateUp::Fused(l) => vec![("gate_up_proj", l)],
        };
        out.push(("down_proj", &self.down_proj));
        out
    }
}

/// The experts' weights, as the checkpoint stores them.
#[derive(Debug)]
enum Experts {
    /// `experts.{e}.{gate,up,down}_proj.weight`, one gated MLP each; their weights laid in two
    /// stacks at load where they can be ([`stacked_step::SeparateStack`]).
    Separate(Vec<GatedMlp>, Option<stacked_step::SeparateStack>),
    /// `experts.gate_up_proj: [experts, 2 · inter, hidden]` (gate rows first) and
    /// `experts.down_proj: [experts, hidden, inter]` (Qwen3.5-MoE's Hub checkpoints, and the
    /// checkpoints transformers 5 writes); with `x_w` stored the other way round, `[experts,
    /// hidden, 2 · inter]` (gate columns first) and `[experts, inter, hidden]`, computing `x · W`
    /// (Qwen3-VL-MoE's Hub checkpoints). LoRA does not adapt them as linear layers of their own.
    Stacked { gate_up: StackedWeight, down: StackedWeight, act: Activation, x_w: bool },
    /// gpt-oss's: `experts.gate_up_proj: [experts, hidden, 2 · inter]` (gate and up interleaved,
    /// `x · W`), `experts.down_proj: [experts, inter, hidden]`, each with a bias
    /// (`*_bias: [experts, out]`), and the clamped SwiGLU of [`GptOssMoe`].
    GptOss { gate_up: StackedWeight, gate_up_bias: Tensor, down: StackedWeight, down_bias: Tensor, swiglu: GptOssMoe },
}

/// Each stacked tensor's experts as views, taken once per forward with `unbind` (one backward
/// for all experts, where a `select` per expert would each write a zeroed gradient of the whole
/// stack). Empty for [`Experts::Separate`].
struct ExpertViews(Vec<Vec<Tensor>>);

impl Experts {
    /// The per-expert views of the stacked tensors (see [`ExpertViews`]).
    fn views(&self) -> Result<ExpertViews> {
        let stacks: Vec<Tensor> = match self {
            Experts::Separate(..) => Vec::new(),
            Experts::Stacked { gate_up, down, .. } => vec![gate_up.effective()?, down.effective()?],
            Experts::GptOss { gate_up, gate_up_bias, down, down_bias, .. } => {
                vec![gate_up.effective()?, gate_up_bias.shallow_clone(), down.effective()?, down_bias.shallow_clone()]
            }
        };
        Ok(ExpertViews(stacks.into_iter().map(|t| t.f_unbind(0)).collect::<std::result::Result<_, _>>()?))
    }

    /// Expert `e` on its tokens, `[c, hidden]` → `[c, hidden]`.
    fn forward(&self, e: usize, x: &Tensor, views: &ExpertViews) -> Result<Tensor> {
        let v = |i: usize| &views.0[i][e];
        match self {
            Experts::Separate(m, _) => m[e].forward(x),
            Experts::Stacked { act, x_w, .. } => {
                let apply = |x: &Tensor, w: &Tensor| if *x_w { Ok(x.f_matmul(w)?) } else { linear(x, w, None) };
                let both = apply(x, v(0))?; // [c, 2 · inter]
                let half = both.size()[1] / 2;
                let parts = both.f_split_with_sizes([half, half], 1)?;
                apply(&activate(&parts[0], *act)?.f_mul(&parts[1])?, v(1))
            }
            Experts::GptOss { swiglu, .. } => {
                let both = x.f_matmul(v(0))?.f_add(v(1))?; // [c, 2 · inter], gate and up interleaved
                let pairs = both.f_view([both.size()[0], -1, 2])?.f_unbind(-1)?;
                let gate = pairs[0].f_clamp_max(swiglu.limit)?;
                let up = pairs[1].f_clamp(-swiglu.limit, swiglu.limit)?;
                let glu = gate.f_mul(&gate.f_mul_scalar(swiglu.alpha)?.f_sigmoid()?)?;
                let h = up.f_add_scalar(1.0)?.f_mul(&glu)?;
                Ok(h.f_matmul(v(2))?.f_add(v(3))?)
            }
        }
    }
}

/// The shared expert every token goes through, weighted by `sigmoid(gate(x))` (Qwen3.5-MoE).
#[derive(Debug)]
struct SharedExpert {
    mlp: GatedMlp,
    gate: Linear, // [1, hidden]
}

/// Routed mixture of experts (Shazeer et al. 2017; Qwen3-MoE's `SparseMoeBlock`): a router
/// `gate: [experts, hidden]` scores each token, softmax in f32, the top-k experts' gated MLPs run
/// on it and their outputs are summed weighted by the (optionally renormalised) probabilities.
/// Tokens are grouped by expert and each expert runs once on its own tokens (one gather of every
/// (token, expert) slot sorted by expert, split into each expert's rows, and one index-add of
/// the weighted outputs): no token goes through an expert it was not routed to, and no token is
/// dropped. Qwen3.5-MoE adds a shared expert on every token.
#[derive(Debug)]
pub struct SparseMoe {
    router: Tensor, // [experts, hidden]
    /// gpt-oss's router bias `[experts]`; it also softmaxes the top-k logits instead of taking
    /// the top-k probabilities.
    router_bias: Option<Tensor>,
    experts: Experts,
    shared: Option<SharedExpert>,
    num_experts: i64,
    top_k: i64,
    norm_topk_prob: bool,
    /// Gemma 4's router scalings, where they are its.
    gemma: Option<GemmaRouter>,
    /// Tokens routed to each expert by the forwards gradients flow through (the trained passes,
    /// whose router output requires a gradient) since the last [`SparseMoe::take_load`].
    load: Mutex<Vec<i64>>,
}

/// Gemma 4's router (transformers' `Gemma4TextRouter`): it scores `rms(x) · scale · hidden^-½`
/// (an RMS normalisation without weight), and each token's renormalised top-k weights are
/// multiplied by their expert's `per_expert_scale`.
#[derive(Debug)]
struct GemmaRouter {
    scale: Tensor,            // [hidden]
    per_expert_scale: Tensor, // [experts]
    eps: f64,
}

impl SparseMoe {
    /// Loads `mlp.gate.weight` and `mlp.experts.{e}.{gate,up,down}_proj` (or the stacked
    /// `mlp.experts.{gate_up,down}_proj`) from scope `w` (`mlp`), and the shared expert
    /// `mlp.shared_expert.*` with `mlp.shared_expert_gate.weight` where the model has one.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, moe: &MoeConfig) -> Result<Self> {
        let (h, n, inter) = (cfg.hidden_size, moe.num_experts, moe.intermediate_size);
        let ew = w.pp("experts");
        if let Some(swiglu) = moe.gpt_oss {
            let r = w.pp("router");
            let weight = |name: &str, shape: &[i64]| {
                if ew.contains(name) {
                    ew.get(name, shape)
                } else {
                    ew.get_mxfp4(name, shape)
                }
            };
            let experts = Experts::GptOss {
                gate_up: StackedWeight::new(weight("gate_up_proj", &[n, h, 2 * inter])?),
                gate_up_bias: ew.get("gate_up_proj_bias", &[n, 2 * inter])?,
                down: StackedWeight::new(weight("down_proj", &[n, inter, h])?),
                down_bias: ew.get("down_proj_bias", &[n, h])?,
                swiglu,
            };
            return Ok(SparseMoe {
                router: r.get("weight", &[n, h])?,
                router_bias: Some(r.get("bias", &[n])?),
                experts,
                shared: None,
                num_experts: n,
                top_k: moe.top_k,
                norm_topk_prob: false,
                gemma: None,
                load: Mutex::new(vec![0; n as usize]),
            });
        }
        let router = w.pp("gate").get("weight", &[n, h])?;
        let experts = if ew.contains("gate_up_proj") {
            // Which way round: the down projection tells (`[n, inter, hidden]` is `x · W`).
            let x_w = inter != h && ew.shape("down_proj") == Some(vec![n, inter, h]);
            let (gate_up, down) = match x_w {
                true => ([n, h, 2 * inter], [n, inter, h]),
                false => ([n, 2 * inter, h], [n, h, inter]),
            };
            Experts::Stacked {
                gate_up: StackedWeight::new(ew.get("gate_up_proj", &gate_up)?),
                down: StackedWeight::new(ew.get("down_proj", &down)?),
                act: cfg.activation,
                x_w,
            }
        } else {
            let mut mlps = (0..n).map(|e| GatedMlp::load(&ew.pp(e), cfg, inter)).collect::<Result<Vec<_>>>()?;
            let stack = stacked_step::SeparateStack::new(&mut mlps)?;
            Experts::Separate(mlps, stack)
        };
        let shared = match moe.shared_expert_intermediate_size {
            Some(size) => Some(SharedExpert {
                mlp: GatedMlp::load(&w.pp("shared_expert"), cfg, size)?,
                gate: Linear::load(&w.pp("shared_expert_gate"), h, 1, false)?,
            }),
            None => None,
        };
        Ok(SparseMoe {
            router,
            router_bias: None,
            experts,
            shared,
            num_experts: n,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            gemma: None,
            load: Mutex::new(vec![0; moe.num_experts as usize]),
        })
    }

    /// Loads Gemma 4's experts from a layer's scope `w`: `router.{proj.weight, scale,
    /// per_expert_scale}` and the stacked `experts.{gate_up_proj, down_proj}` (gate rows first).
    pub fn load_gemma4(w: &WeightLoader, cfg: &ArchConfig, moe: &MoeConfig) -> Result<Self> {
        let (h, n, inter) = (cfg.hidden_size, moe.num_experts, moe.intermediate_size);
        let (r, ew) = (w.pp("router"), w.pp("experts"));
        Ok(SparseMoe {
            router: r.pp("proj").get("weight", &[n, h])?,
            router_bias: None,
            experts: Experts::Stacked {
                gate_up: StackedWeight::new(ew.get("gate_up_proj", &[n, 2 * inter, h])?),
                down: StackedWeight::new(ew.get("down_proj", &[n, h, inter])?),
                act: cfg.activation,
                x_w: false,
            },
            shared: None,
            num_experts: n,
            top_k: moe.top_k,
            norm_topk_prob: true,
            gemma: Some(GemmaRouter {
                scale: r.get("scale", &[h])?,
                per_expert_scale: r.get("per_expert_scale", &[n])?,
                eps: cfg.norm_eps,
            }),
            load: Mutex::new(vec![0; n as usize]),
        })
    }

    /// The experts' linear layers, named `experts.{e}.{proj}` below `mlp` (none when stacked),
    /// and the shared expert's (`shared_expert.{proj}`, `shared_expert_gate`).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        if let Experts::Separate(experts, _) = &mut self.experts {
            for (e, m) in experts.iter_mut().enumerate() {
                out.extend(m.linears_mut().into_iter().map(|(n, l)| (format!("experts.{e}.{n}"), l)));
            }
        }
        if let Some(s) = &mut self.shared {
            out.extend(s.mlp.linears_mut().into_iter().map(|(n, l)| (format!("shared_expert.{n}"), l)));
            out.push(("shared_expert_gate".to_string(), &mut s.gate));
        }
        out
    }

    /// The stacked expert weights, named `experts.{gate_up_proj, down_proj}` (none when the
    /// experts are linear layers of their own).
    pub fn stacked_mut(&mut self) -> Vec<(String, &mut StackedWeight)> {
        match &mut self.experts {
            Experts::Separate(..) => Vec::new(),
            Experts::Stacked { gate_up, down, .. } | Experts::GptOss { gate_up, down, .. } => {
                vec![("experts.gate_up_proj".into(), gate_up), ("experts.down_proj".into(), down)]
            }
        }
    }

    /// [`SparseMoe::stacked_mut`], shared.
    pub fn stacked(&self) -> Vec<(String, &StackedWeight)> {
        match &self.experts {
            Experts::Separate(..) => Vec::new(),
            Experts::Stacked { gate_up, down, .. } | Experts::GptOss { gate_up, down, .. } => {
                vec![("experts.gate_up_proj".into(), gate_up), ("experts.down_proj".into(), down)]
            }
        }
    }

    /// [`SparseMoe::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        if let Experts::Separate(experts, _) = &self.experts {
            for (e, m) in experts.iter().enumerate() {
                out.extend(m.linears().into_iter().map(|(n, l)| (format!("experts.{e}.{n}"), l)));
            }
        }
        if let Some(s) = &self.shared {
            out.extend(s.mlp.linears().into_iter().map(|(n, l)| (format!("shared_expert.{n}"), l)));
            out.push(("shared_expert_gate".to_string(), &s.gate));
        }
        out
    }

    /// Lets go of the buffers the experts' and the shared expert's weights were laid in at load
    /// ([`FusedRows::release`]); a step then routes experts stored one by one.
    pub(crate) fn release_buffers(&mut self) {
        if let Experts::Separate(mlps, stack) = &mut self.experts {
            mlps.iter_mut().for_each(GatedMlp::release_buffers);
            *stack = None;
        }
        if let Some(s) = &mut self.shared {
            s.mlp.release_buffers();
        }
    }

    /// Tokens routed to each expert since the last call (trained passes only), and resets them.
    pub fn take_load(&self) -> Vec<i64> {
        let mut load = self.load.lock().unwrap_or_else(|p| p.into_inner());
        let out = load.clone();
        load.iter_mut().for_each(|c| *c = 0);
        out
    }

    /// Router probabilities (f32) and, for each token, its top-k experts and their weights in the
    /// input's dtype (transformers' `TopKRouter`).
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]` → `([tokens, experts] f32, [tokens, k] int64, [tokens, k])`
    pub fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        if let Some(g) = &self.gemma {
            let hidden = x.size()[1];
            let scaled = x.f_rms_norm([hidden], None::<&Tensor>, g.eps)?.f_mul(&g.scale)?;
            let logits = linear(&scaled.f_mul_scalar((hidden as f64).powf(-0.5))?, &self.router, None)?;
            let probs = logits.f_softmax(-1, Kind::Float)?;
            let (weights, experts) = probs.f_topk(self.top_k, -1, true, true)?;
            let weights = weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?)?;
            let weights = weights
                .f_mul(&g.per_expert_scale.f_index_select(0, &experts.f_reshape([-1])?)?.f_view_as(&weights)?)?;
            return Ok((probs, experts, weights.f_to_kind(x.kind())?));
        }
        let logits = linear(x, &self.router, self.router_bias.as_ref())?; // [n, E]
        let probs = logits.f_softmax(-1, Kind::Float)?;
        if self.router_bias.is_some() {
            // gpt-oss: the top-k logits, softmaxed in the logits' dtype.
            let (top, experts) = logits.f_topk(self.top_k, -1, true, true)?;
            return Ok((probs, experts, top.f_softmax(-1, top.kind())?.f_to_kind(x.kind())?));
        }
        let (mut weights, experts) = probs.f_topk(self.top_k, -1, true, true)?;
        if self.norm_topk_prob {
            weights = weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?)?;
        }
        Ok((probs, experts, weights.f_to_kind(x.kind())?))
    }

    /// Adds this layer's routing to `router` where the forward records it; `steps` other than
    /// [`ExpertSteps::Routed`]: computed over the experts' stacked weights where the layer can
    /// ([`SparseMoe::steps_densely`]), a decode step's capture-safe form.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn forward(&self, x: &Tensor, router: Option<&RouterRecord>, steps: ExpertSteps) -> Result<Tensor> {
        self.forward_routed_by(x, x, router, steps)
    }

    /// The experts on `x`, routed by `route_x` (Gemma 4 routes the residual stream and runs the
    /// experts on its normalised copy): each expert on the tokens routed to it, or as `steps`
    /// says over the experts' stacked weights ([`stacked_step`]).
    ///
    /// # Shapes
    /// - `route_x`, `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn forward_routed_by(
        &self,
        route_x: &Tensor,
        x: &Tensor,
        router: Option<&RouterRecord>,
        steps: ExpertSteps,
    ) -> Result<Tensor> {
        let shape = x.size();
        let hidden = shape[shape.len() - 1];
        let flat = x.f_reshape([-1, hidden])?; // [n, h]
        let (probs, experts, weights) = self.route(&route_x.f_reshape([-1, hidden])?)?; // [n, k] each
        if let Some(r) = router {
            r.add(&probs, &experts)?;
        }
        if let Some(out) = self.forward_stacked(&flat, &experts, &weights, steps)? {
            return Ok(self.add_shared(&flat, out)?.f_reshape(shape.as_slice())?);
        }
        let choice = experts.f_reshape([-1])?; // [n·k]: slot j of token t at t·k + j
        let order = choice.f_argsort_stable(true, 0, false)?; // slots grouped by expert, in token order
        let num_experts = self.num_experts;
        // One host copy: how many slots each expert has.
        let counts =
            Vec::<i64>::try_from(choice.f_bincount::<&Tensor>(None, num_experts)?.f_to_device(tch::Device::Cpu)?)?;
        if probs.requires_grad() {
            let mut load = self.load.lock().unwrap_or_else(|p| p.into_inner());
            load.iter_mut().zip(&counts).for_each(|(l, c)| *l += c);
        }
        let tokens = order.f_div_scalar_mode(self.top_k, "floor")?; // [n·k]
        let slot_weights = weights.f_reshape([-1])?.f_index_select(0, &order)?; // [n·k]
                                                                                // One gather of every slot's token, split by expert (views), and one index-add of the
                                                                                // weighted outputs: a gather and an index-add per expert would each copy or zero a
                                                                                // `[n, h]` tensor, forward or backward — O(experts · n · h) where this is O(k · n · h).
        let parts = flat.f_index_select(0, &tokens)?.f_split_with_sizes(counts.as_slice(), 0)?; // [c, h] each
        let views = self.experts.views()?;
        let mut ys = Vec::new();
        for (e, (x, &count)) in parts.iter().zip(&counts).enumerate() {
            if count > 0 {
                ys.push(self.experts.forward(e, x, &views)?); // [c, h]
            }
        }
        let mut out = flat.f_zeros_like()?;
        if !ys.is_empty() {
            let y = Tensor::f_cat(&ys, 0)?.f_mul(&slot_weights.f_unsqueeze(-1)?)?; // [n·k, h]
            out = out.f_index_add(0, &tokens, &y)?;
        }
        Ok(self.add_shared(&flat, out)?.f_reshape(shape.as_slice())?)
    }

    /// `out` plus the shared expert's output where the layer has one.
    ///
    /// # Shapes
    /// - `flat`, `out`: `[n, hidden]` → `[n, hidden]`
    fn add_shared(&self, flat: &Tensor, out: Tensor) -> Result<Tensor> {
        match &self.shared {
            Some(s) => Ok(out.f_add(&s.gate.forward(flat)?.f_sigmoid()?.f_mul(&s.mlp.forward(flat)?)?)?),
            None => Ok(out),
        }
    }
}

/// A layer's MLP: dense, or a routed mixture of experts.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per layer, built once: the size is not worth a box
pub enum Mlp {
    Dense(GatedMlp),
    Sparse(SparseMoe),
}

impl Mlp {
    /// A sparse layer adds its routing to `router` where the forward records it, and computes
    /// its experts as `steps` says ([`SparseMoe::forward`]).
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn forward(&self, x: &Tensor, router: Option<&RouterRecord>, steps: ExpertSteps) -> Result<Tensor> {
        match self {
            Mlp::Dense(m) => m.forward(x),
            Mlp::Sparse(m) => m.forward(x, router, steps),
        }
    }

    /// Lets go of the buffers laid at load ([`FusedRows::release`]).
    pub(crate) fn release_buffers(&mut self) {
        match self {
            Mlp::Dense(m) => m.release_buffers(),
            Mlp::Sparse(m) => m.release_buffers(),
        }
    }

    /// The linear layers with their names below `mlp`.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        match self {
            Mlp::Dense(m) => m.linears_mut().into_iter().map(|(n, l)| (n.to_string(), l)).collect(),
            Mlp::Sparse(m) => m.linears_mut(),
        }
    }

    /// [`Mlp::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        match self {
            Mlp::Dense(m) => m.linears().into_iter().map(|(n, l)| (n.to_string(), l)).collect(),
            Mlp::Sparse(m) => m.linears(),
        }
    }
}
