//! What Gemma 4 adds to a decoder layer: per-layer input embeddings (PLE, transformers'
//! `get_per_layer_inputs` and `project_per_layer_inputs`: every layer gets a small input of its
//! own, made from the token — a slice of `embed_tokens_per_layer` — and from the input embeddings
//! — a slice of `per_layer_model_projection` — which gates a residual branch after the layer's
//! MLP), and the mixture of experts that runs beside the dense MLP (`enable_moe_block`).

use tch::Tensor;

use super::{activate, ExpertSteps, Linear, RmsNorm, RouterRecord, SparseMoe};
use crate::config::{Activation, ArchConfig, MoeConfig, NormKind, PerLayerInput};
use crate::error::Result;
use crate::weights::WeightLoader;

/// The model-level half: the token table, the projection and its norm.
#[derive(Debug)]
pub struct PerLayerEmbed {
    /// `[vocab_per_layer, layers · dim]`
    embed: Tensor,
    projection: Linear,
    norm: RmsNorm,
    layers: i64,
    dim: i64,
    hidden: i64,
}

impl PerLayerEmbed {
    /// Loads `embed_tokens_per_layer`, `per_layer_model_projection` and
    /// `per_layer_projection_norm` from the backbone scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, p: PerLayerInput) -> Result<Self> {
        let (layers, h) = (cfg.num_layers, cfg.hidden_size);
        Ok(PerLayerEmbed {
            embed: w.pp("embed_tokens_per_layer").get("weight", &[p.vocab, layers * p.dim])?,
            projection: Linear::load(&w.pp("per_layer_model_projection"), h, layers * p.dim, false)?,
            norm: RmsNorm::load_kind(&w.pp("per_layer_projection_norm"), p.dim, cfg.norm_eps, NormKind::RmsScaleInF32)?,
            layers,
            dim: p.dim,
            hidden: h,
        })
    }

    /// `(norm(proj(e) · hidden^-½) + E[ids] · √dim) · 2^-½`, each scale rounded to the weights'
    /// dtype first where transformers rounds it (the embedding's, as Gemma's main embedding).
    ///
    /// # Shapes
    /// - `ids`: `[batch, seq]`; `embeds` (the scaled input embeddings): `[batch, seq, hidden]` →
    ///   `[batch, seq, layers, dim]`
    pub fn forward(&self, ids: &Tensor, embeds: &Tensor) -> Result<Tensor> {
        let (b, s) = (ids.size()[0], ids.size()[1]);
        let shape = [b, s, self.layers, self.dim];
        let scale = Tensor::f_scalar_tensor((self.dim as f64).sqrt(), (self.embed.kind(), self.embed.device()))?;
        let tokens = Tensor::f_embedding(&self.embed, ids, -1, false, false)?.f_mul(&scale)?.f_view(shape)?;
        let projected = self.projection.forward(embeds)?.f_mul_scalar((self.hidden as f64).powf(-0.5))?;
        let projected = self.norm.forward(&projected.f_view(shape)?)?;
        Ok(projected.f_add(&tokens)?.f_mul_scalar(0.5f64.sqrt())?)
    }
}

/// The layer-level half: `h + norm(W_up(act(W_gate(h)) · input))`.
#[derive(Debug)]
pub struct PerLayerBranch {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
    activation: Activation,
}

impl PerLayerBranch {
    /// Loads `per_layer_input_gate`, `per_layer_projection` and `post_per_layer_input_norm` from
    /// a layer's scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, p: PerLayerInput) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(PerLayerBranch {
            gate: Linear::load(&w.pp("per_layer_input_gate"), h, p.dim, false)?,
            projection: Linear::load(&w.pp("per_layer_projection"), p.dim, h, false)?,
            norm: RmsNorm::load_kind(&w.pp("post_per_layer_input_norm"), h, cfg.norm_eps, cfg.norm)?,
            activation: cfg.activation,
        })
    }

    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`; `input`: `[batch, seq, dim]` → `[batch, seq, hidden]`
    pub fn forward(&self, h: &Tensor, input: &Tensor) -> Result<Tensor> {
        let gated = activate(&self.gate.forward(h)?, self.activation)?.f_mul(&input.f_to_kind(h.kind())?)?;
        Ok(h.f_add(&self.norm.forward(&self.projection.forward(&gated)?)?)?)
    }

    /// The linear layers with their names below the layer.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        vec![("per_layer_input_gate", &mut self.gate), ("per_layer_projection", &mut self.projection)]
    }

    /// [`PerLayerBranch::linears_mut`], shared.
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        vec![("per_layer_input_gate", &self.gate), ("per_layer_projection", &self.projection)]
    }
}

/// Gemma 4's experts beside the dense MLP (transformers' `Gemma4TextDecoderLayer` with
/// `enable_moe_block`): `post₁(mlp(pre(h))) + post₂(experts(pre₂(h)))`, routed by `h` itself.
#[derive(Debug)]
pub struct ExpertsBeside {
    experts: SparseMoe,
    post_mlp: RmsNorm,
    pre_experts: RmsNorm,
    post_experts: RmsNorm,
}

impl ExpertsBeside {
    /// Loads `router.*`, `experts.*` and the norms `post_feedforward_layernorm_1`,
    /// `pre_feedforward_layernorm_2`, `post_feedforward_layernorm_2` from a layer's scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig, moe: &MoeConfig) -> Result<Self> {
        let norm = |name: &str| RmsNorm::load_kind(&w.pp(name), cfg.hidden_size, cfg.norm_eps, cfg.norm);
        Ok(ExpertsBeside {
            experts: SparseMoe::load_gemma4(w, cfg, moe)?,
            post_mlp: norm("post_feedforward_layernorm_1")?,
            pre_experts: norm("pre_feedforward_layernorm_2")?,
            post_experts: norm("post_feedforward_layernorm_2")?,
        })
    }

    /// The stacked expert weights, named `experts.{gate_up_proj, down_proj}` below the layer.
    pub fn stacked_mut(&mut self) -> Vec<(String, &mut crate::lora::StackedWeight)> {
        self.experts.stacked_mut()
    }

    /// [`ExpertsBeside::stacked_mut`], shared.
    pub fn stacked(&self) -> Vec<(String, &crate::lora::StackedWeight)> {
        self.experts.stacked()
    }

    /// Whether a step may run every expert on every token ([`SparseMoe::steps_densely`]).
    pub fn steps_densely(&self) -> bool {
        self.experts.steps_densely()
    }

    /// The dense MLP's output `mlp` combined with the experts' on the residual stream `h`
    /// (`steps`: see [`SparseMoe::forward`]).
    ///
    /// # Shapes
    /// - `h`, `mlp`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn forward(
        &self,
        h: &Tensor,
        mlp: &Tensor,
        router: Option<&RouterRecord>,
        steps: ExpertSteps,
    ) -> Result<Tensor> {
        let experts = self.experts.forward_routed_by(h, &self.pre_experts.forward(h)?, router, steps)?;
        Ok(self.post_mlp.forward(mlp)?.f_add(&self.post_experts.forward(&experts)?)?)
    }
}
