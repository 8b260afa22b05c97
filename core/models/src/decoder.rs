//! The rotary decoder stack every family but GPT-2 shares, assembled from [`crate::layers`] as the
//! resolved [`ArchConfig`] says: where the norms sit ([`BlockLayout`]), which RMSNorm, q/k norms,
//! fused projections, sliding-window layers, a dense or routed MLP, scaled embeddings. What each
//! family sets is in its own file ([`crate::llama`], [`crate::qwen3`], [`crate::qwen3_moe`],
//! [`crate::gemma`], [`crate::olmo2`], [`crate::olmo3`], [`crate::phi3`], [`crate::qwen3_5`]). A layer
//! mixes its tokens by attention or, in hybrid models, by Gated DeltaNet linear attention.
//!
//! Tensor names (transformers'): `model.embed_tokens.weight`, `model.norm.weight`, and per layer
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.*` (or `qkv_proj`), `self_attn.{q,k}_norm.weight`
//! (or `linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.weight`,
//! `linear_attn.{conv1d.weight,dt_bias,A_log,norm.weight}`),
//! `mlp.{gate,up,down}_proj.*` (or `gate_up_proj`; or `mlp.gate.weight` and
//! `mlp.experts.{e}.{gate,up,down}_proj.weight`), and the norms `input_layernorm`,
//! `post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm` that the
//! layout has.

use tch::Tensor;

use crate::config::{ArchConfig, BlockLayout};
use crate::error::{ModelError, Result};
use crate::layers::{
    step_attention_mask, windowed_attention_mask, Attention, CacheLayer, Deepstack, ExpertSteps, ExpertsBeside,
    GatedDeltaNet, GatedMlp, KvCache, LayerShared, Linear, LinearShared, Mlp, PerLayerBranch, PerLayerEmbed, RmsNorm,
    Rotary, RouterRecord, SideInputs, SparseMoe,
};
use crate::lora::StackedWeight;
use crate::weights::WeightLoader;

/// The norms of one layer; which exist depends on the layout.
#[derive(Debug)]
struct Norms {
    /// Before attention (pre-norm and sandwich).
    input: Option<RmsNorm>,
    /// After attention (post-norm and sandwich); before the MLP in the pre-norm layout, where
    /// transformers names the pre-MLP norm `post_attention_layernorm`.
    post_attention: Option<RmsNorm>,
    /// Before the MLP (sandwich).
    pre_feedforward: Option<RmsNorm>,
    /// After the MLP (post-norm and sandwich).
    post_feedforward: Option<RmsNorm>,
}

/// What mixes the tokens of a layer: attention (`self_attn`) or Gated DeltaNet (`linear_attn`).
#[derive(Debug)]
enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

impl Mixer {
    /// The scope of its tensors below the layer.
    fn scope(&self) -> &'static str {
        match self {
            Mixer::Attention(_) => "self_attn",
            Mixer::Linear(_) => "linear_attn",
        }
    }

    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match self {
            Mixer::Attention(a) => a.linears_mut(),
            Mixer::Linear(l) => l.linears_mut(),
        }
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        match self {
            Mixer::Attention(a) => a.linears(),
            Mixer::Linear(l) => l.linears(),
        }
    }
}

#[derive(Debug)]
struct Block {
    norms: Norms,
    mixer: Mixer,
    mlp: Mlp,
    sliding: bool,
    /// The earlier layer whose keys and values this one attends to (Gemma 4).
    kv_source: Option<usize>,
    /// Whether a later layer reuses this one's keys and values.
    stores_kv: bool,
    /// Gemma 4's per-layer input branch after the MLP.
    per_layer: Option<PerLayerBranch>,
    /// Gemma 4's experts beside the dense MLP.
    experts_beside: Option<ExpertsBeside>,
    /// Gemma 4's `layer_scalar`, `[1]`: the layer's output is multiplied by it.
    scalar: Option<Tensor>,
}

fn apply(norm: &Option<RmsNorm>, x: Tensor) -> Result<Tensor> {
    match norm {
        Some(n) => n.forward(&x),
        None => Ok(x),
    }
}

/// The decoder stack without the LM head.
#[derive(Debug)]
pub struct DecoderModel {
    pub(crate) embed_tokens: Tensor, // [vocab, hidden]
    /// Gemma 4's per-layer input embeddings.
    per_layer_embed: Option<Box<PerLayerEmbed>>,
    layers: Vec<Block>,
    norm: RmsNorm,
    rotary: Rotary,
    /// The RoPE of sliding layers where it differs.
    rotary_local: Option<Rotary>,
    embed_scale: Option<f64>,
    sliding_window: Option<i64>,
    /// Whether [`DecoderModel::embed`] makes a record for the routing of the load-balancing loss
    /// (`output_router_logits`, [`crate::layers::load_balance`]; dropped again outside training
    /// passes, [`crate::backbone::Routing`]).
    router_aux: bool,
    /// The placeholder token whose embeddings image features replace (vision-language models).
    image_token: Option<i64>,
    /// How decode steps compute a mixture of experts, where not the device's default
    /// ([`DecoderModel::set_expert_steps`]).
    expert_steps: Option<ExpertSteps>,
}

impl DecoderModel {
    /// Loads the backbone from the `model.` scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let rope = cfg.rope.as_ref().ok_or_else(|| ModelError::Input("rotary decoder config without rope".into()))?;
        let embed_tokens = w.pp("embed_tokens").get("weight", &[cfg.vocab_size, cfg.hidden_size])?;
        let (h, eps, kind) = (cfg.hidden_size, cfg.norm_eps, cfg.norm);
        let norm = |l: &WeightLoader, name: &str| RmsNorm::load_kind(&l.pp(name), h, eps, kind);
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        for i in 0..cfg.num_layers {
            let l = w.pp("layers").pp(i);
            let norms = match cfg.layout {
                BlockLayout::PreNorm => Norms {
                    input: Some(norm(&l, "input_layernorm")?),
                    post_attention: None,
                    pre_feedforward: Some(norm(&l, "post_attention_layernorm")?),
                    post_feedforward: None,
                },
                BlockLayout::PostNorm => Norms {
                    input: None,
                    post_attention: Some(norm(&l, "post_attention_layernorm")?),
                    pre_feedforward: None,
                    post_feedforward: Some(norm(&l, "post_feedforward_layernorm")?),
                },
                BlockLayout::Sandwich => Norms {
                    input: Some(norm(&l, "input_layernorm")?),
                    post_attention: Some(norm(&l, "post_attention_layernorm")?),
                    pre_feedforward: Some(norm(&l, "pre_feedforward_layernorm")?),
                    post_feedforward: Some(norm(&l, "post_feedforward_layernorm")?),
                },
            };
            let sparse = cfg.moe.as_ref().filter(|m| m.sparse_layers.get(i as usize) == Some(&true));
            let layer = i as usize;
            let mlp = match sparse {
                Some(moe) => Mlp::Sparse(SparseMoe::load(&l.pp("mlp"), cfg, moe)?),
                None => Mlp::Dense(GatedMlp::load(&l.pp("mlp"), cfg, cfg.intermediate(layer))?),
            };
            let mixer = if cfg.is_linear(layer) {
                Mixer::Linear(GatedDeltaNet::load(&l.pp("linear_attn"), cfg)?)
            } else {
                Mixer::Attention(Attention::load(&l.pp("self_attn"), cfg, layer)?)
            };
            let per_layer_input = cfg.gemma4.as_ref().and_then(|g| g.per_layer_input);
            layers.push(Block {
                norms,
                mixer,
                mlp,
                sliding: cfg.is_sliding(layer),
                kv_source: cfg.kv_source(layer),
                stores_kv: (0..cfg.num_layers as usize).any(|j| cfg.kv_source(j) == Some(layer)),
                per_layer: per_layer_input.map(|p| PerLayerBranch::load(&l, cfg, p)).transpose()?,
                experts_beside: match cfg.gemma4.as_ref().and_then(|g| g.moe.as_ref()) {
                    Some(moe) => Some(ExpertsBeside::load(&l, cfg, moe)?),
                    None => None,
                },
                scalar: if cfg.gemma4.is_some() { l.constant("layer_scalar", &[1])? } else { None },
            });
        }
        let norm = RmsNorm::load_kind(&w.pp("norm"), h, eps, kind)?;
        let rotary = Rotary::new(rope, cfg.rotary_dim, w.device())?;
        let local_dim = cfg.gemma4.as_ref().map_or(cfg.rotary_dim, |g| g.local_rotary_dim);
        let rotary_local = cfg.rope_local.as_ref().map(|r| Rotary::new(r, local_dim, w.device())).transpose()?;
        let per_layer_input = cfg.gemma4.as_ref().and_then(|g| g.per_layer_input);
        Ok(DecoderModel {
            embed_tokens,
            per_layer_embed: per_layer_input.map(|p| PerLayerEmbed::load(w, cfg, p).map(Box::new)).transpose()?,
            layers,
            norm,
            rotary,
            rotary_local,
            embed_scale: cfg.embed_scale,
            sliding_window: cfg.sliding_window,
            router_aux: cfg.moe.as_ref().is_some_and(|m| m.aux_loss_coef.is_some()),
            image_token: cfg.vision.as_ref().map(|v| v.image_token_id),
            expert_steps: None,
        })
    }

    /// Lets go of the buffers projections (q/k/v, gate/up, a linear layer's inputs, experts
    /// stored one by one) were laid in at load, keeping each variable's own view: for ZeRO
    /// stage 3, which frees and regathers every variable's storage ([`crate::layers::FusedRows`]).
    pub(crate) fn release_buffers(&mut self) {
        for b in &mut self.layers {
            match &mut b.mixer {
                Mixer::Attention(a) => a.release_buffers(),
                Mixer::Linear(l) => l.release_buffers(),
            }
            b.mlp.release_buffers();
        }
    }

    /// How a decode step's mixture-of-experts layers compute their experts: `None` for the
    /// device's default — over their stacked weights on CUDA (capture-safe,
    /// [`ExpertSteps::Stacked`]), routed elsewhere, where the stacked ways cost more FLOPs.
    pub fn set_expert_steps(&mut self, steps: Option<ExpertSteps>) {
        self.expert_steps = steps;
    }

    /// Every linear layer with its weight path below the backbone scope (`layers.0.self_attn.q_proj`).
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter_mut().enumerate() {
            let scope = b.mixer.scope();
            for (name, l) in b.mixer.linears_mut() {
                out.push((format!("layers.{i}.{scope}.{name}"), l));
            }
            for (name, l) in b.mlp.linears_mut() {
                out.push((format!("layers.{i}.mlp.{name}"), l));
            }
            for (name, l) in b.per_layer.iter_mut().flat_map(PerLayerBranch::linears_mut) {
                out.push((format!("layers.{i}.{name}"), l));
            }
        }
        out
    }

    /// [`DecoderModel::linears_mut`], shared.
    pub(crate) fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter().enumerate() {
            let scope = b.mixer.scope();
            for (name, l) in b.mixer.linears() {
                out.push((format!("layers.{i}.{scope}.{name}"), l));
            }
            for (name, l) in b.mlp.linears() {
                out.push((format!("layers.{i}.mlp.{name}"), l));
            }
            for (name, l) in b.per_layer.iter().flat_map(PerLayerBranch::linears) {
                out.push((format!("layers.{i}.{name}"), l));
            }
        }
        out
    }

    /// The stacked expert weights with their path below the backbone scope
    /// (`layers.0.mlp.experts.gate_up_proj`; Gemma 4's `layers.0.experts.gate_up_proj`).
    pub(crate) fn stacked_mut(&mut self) -> Vec<(String, &mut StackedWeight)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter_mut().enumerate() {
            if let Mlp::Sparse(m) = &mut b.mlp {
                out.extend(m.stacked_mut().into_iter().map(|(n, w)| (format!("layers.{i}.mlp.{n}"), w)));
            }
            if let Some(e) = &mut b.experts_beside {
                out.extend(e.stacked_mut().into_iter().map(|(n, w)| (format!("layers.{i}.{n}"), w)));
            }
        }
        out
    }

    /// [`DecoderModel::stacked_mut`], shared.
    pub(crate) fn stacked(&self) -> Vec<(String, &StackedWeight)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter().enumerate() {
            if let Mlp::Sparse(m) = &b.mlp {
                out.extend(m.stacked().into_iter().map(|(n, w)| (format!("layers.{i}.mlp.{n}"), w)));
            }
            if let Some(e) = &b.experts_beside {
                out.extend(e.stacked().into_iter().map(|(n, w)| (format!("layers.{i}.{n}"), w)));
            }
        }
        out
    }

    /// The routed MLPs, with their layer index.
    pub(crate) fn sparse_mlps(&self) -> Vec<(usize, &SparseMoe)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter().enumerate() {
            if let Mlp::Sparse(m) = &b.mlp {
                out.push((i, m));
            }
        }
        out
    }

    /// Token embeddings — with `visual` features in place of the image placeholders, in order —
    /// and what every layer of this forward shares (masks, rotary tables).
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, seq]`; `position_ids`: `[batch, seq]` (or `[3, batch, seq]` with
    ///   the multimodal RoPE); `key_mask`: `[batch, past + seq]`; `visual`: `[placeholders, hidden]`
    /// - returns `[batch, seq, hidden]`
    pub fn embed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
        past: i64,
        visual: Option<&crate::visual_input::Visual>,
    ) -> Result<(Tensor, LayerShared)> {
        let seq = input_ids.size()[1];
        let (h, rotary, rotary_local, side) = self.embed_rotary(input_ids, position_ids, visual)?;
        let mask = windowed_attention_mask(key_mask, past, seq, None)?;
        let sliding_mask = match self.sliding_window {
            Some(w) if self.layers.iter().any(|b| b.sliding) => {
                Some(windowed_attention_mask(key_mask, past, seq, Some(w))?)
            }
            _ => None,
        };
        let linear = if self.has_linear() {
            LinearShared::new(&key_mask.f_narrow(1, past, seq)?)?
        } else {
            LinearShared::default()
        };
        let router = if self.router_aux { Some(RouterRecord::new(&key_mask.f_narrow(1, past, seq)?)?) } else { None };
        let experts = ExpertSteps::Routed;
        Ok((h, LayerShared { mask, sliding_mask, rotary: Some(rotary), rotary_local, linear, router, side, experts }))
    }

    /// Whether some layer is a linear-attention one.
    fn has_linear(&self) -> bool {
        self.layers.iter().any(|b| matches!(b.mixer, Mixer::Linear(_)))
    }

    /// What each layer keeps in a cache, in order: keys and values of its geometry (`cfg`'s),
    /// nothing for a layer reusing another's, a linear-attention layer's state.
    pub fn cache_layers(&self, cfg: &ArchConfig) -> Vec<CacheLayer> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, b)| match &b.mixer {
                Mixer::Attention(_) if b.kv_source.is_some() => CacheLayer::Attention { kv_heads: 0, head_dim: 0 },
                Mixer::Attention(_) => {
                    let g = cfg.heads(i);
                    CacheLayer::Attention { kv_heads: g.kv_heads, head_dim: g.head_dim }
                }
                Mixer::Linear(l) => l.cache_layer(),
            })
            .collect()
    }

    /// [`DecoderModel::embed`] for a capture-safe decode step: one token per row, written at
    /// cache slot `slot`, attending over the whole cache (see [`step_attention_mask`]).
    ///
    /// # Shapes
    /// - `input_ids`, `position_ids`: `[batch, 1]`; `key_mask`: `[batch, capacity]`; `slot`: `[1]`
    /// - returns `[batch, 1, hidden]`
    pub fn embed_step(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
        slot: &Tensor,
    ) -> Result<(Tensor, LayerShared)> {
        let (h, rotary, rotary_local, side) = self.embed_rotary(input_ids, position_ids, None)?;
        let mask = step_attention_mask(key_mask, slot, None)?;
        let sliding_mask = match self.sliding_window {
            Some(w) if self.layers.iter().any(|b| b.sliding) => Some(step_attention_mask(key_mask, slot, Some(w))?),
            _ => None,
        };
        let (linear, router) = (LinearShared::default(), None);
        let default = if input_ids.device().is_cuda() { ExpertSteps::Stacked } else { ExpertSteps::Routed };
        let experts = self.expert_steps.unwrap_or(default);
        let shared =
            LayerShared { mask, sliding_mask, rotary: Some(rotary), rotary_local, linear, router, side, experts };
        Ok((h, shared))
    }

    /// The embeddings (scaled where the family scales them), the rotary tables of the positions,
    /// and Gemma 4's per-layer inputs.
    ///
    /// # Shapes
    /// - `input_ids`, `position_ids`: `[batch, seq]` → `[batch, seq, hidden]` and tables
    ///   `[batch, 1, seq, rotary_dim]`
    #[allow(clippy::type_complexity)]
    fn embed_rotary(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        visual: Option<&crate::visual_input::Visual>,
    ) -> Result<(Tensor, (Tensor, Tensor), Option<(Tensor, Tensor)>, SideInputs)> {
        let mut h = Tensor::f_embedding(&self.embed_tokens, input_ids, -1, false, false)?;
        if let Some(scale) = self.embed_scale {
            // Gemma multiplies by √hidden rounded to the weights' dtype first.
            h = h.f_mul(&Tensor::f_scalar_tensor(scale, (h.kind(), h.device()))?)?;
        }
        let mut deepstack = None;
        if let Some(visual) = visual {
            let at;
            (h, at) = self.place_visual(&h, input_ids, visual)?;
            if !visual.deepstack.is_empty() {
                deepstack =
                    Some(Deepstack { at, features: visual.deepstack.iter().map(Tensor::shallow_clone).collect() });
            }
        }
        let rotary = self.rotary.cos_sin(position_ids, h.kind())?;
        let rotary_local = self.rotary_local.as_ref().map(|r| r.cos_sin(position_ids, h.kind())).transpose()?;
        let per_layer = self.per_layer_embed.as_ref().map(|p| p.forward(input_ids, &h)).transpose()?;
        let side = SideInputs::with_per_layer(per_layer);
        *side.deepstack.borrow_mut() = deepstack;
        Ok((h, rotary, rotary_local, side))
    }

    /// `h` with the rows of `visual.features` in place of the image placeholders `visual.slots`
    /// allows, in order (transformers' `masked_scatter`), and where they are.
    /// Only a pass from the first token (no cache before it) carries features.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]`; `input_ids`: `[batch, seq]`; `visual.features` (and each of
    ///   `visual.deepstack`): `[placeholders, hidden]` → `[batch, seq, hidden]` and `[batch, seq]` bool
    fn place_visual(
        &self,
        h: &Tensor,
        input_ids: &Tensor,
        visual: &crate::visual_input::Visual,
    ) -> Result<(Tensor, Tensor)> {
        let token = self
            .image_token
            .ok_or_else(|| ModelError::Input("image features for a model that reads no images".into()))?;
        let features = &visual.features;
        // Placeholders are the prompt's and the observations': an image token sampled in a
        // response is text.
        let at = input_ids.f_eq(token)?.f_logical_and(&visual.slots.mask(input_ids)?)?;
        let n = at.f_sum(tch::Kind::Int64)?.f_int64_value(&[])?;
        let width = h.size()[2];
        if let Some(f) = std::iter::once(features).chain(&visual.deepstack).find(|f| f.size() != [n, width]) {
            return Err(ModelError::Input(format!(
                "{n} image placeholders (token {token}) for image features {:?} (expected [{n}, {width}])",
                f.size()
            )));
        }
        if visual.deepstack.len() > self.layers.len() {
            return Err(ModelError::Input(format!(
                "{} deep-stack features for {} decoder layers",
                visual.deepstack.len(),
                self.layers.len()
            )));
        }
        Ok((h.f_masked_scatter(&at.f_unsqueeze(-1)?, &features.f_to_kind(h.kind())?)?, at))
    }

    /// Why a decode step of this model cannot be captured as a CUDA graph (it reads a value
    /// back to the host), if it cannot. A Gated DeltaNet layer's step can: its convolution and
    /// recurrent states are updated in the cache's own buffers, and it reads nothing back. So can
    /// a mixture of experts whose step computes over its stacked weights
    /// ([`SparseMoe::steps_densely`]); routing tokens to their experts counts them on the host.
    pub fn capture_blocker(&self) -> Option<&'static str> {
        let routed = |b: &Block| match (&b.mlp, &b.experts_beside) {
            (Mlp::Sparse(m), _) if !m.steps_densely() => true,
            (_, Some(e)) => !e.steps_densely(),
            _ => false,
        };
        if self.layers.iter().any(routed) {
            return Some(
                "its experts are stored one by one with biases or LoRA adapters, so each token is routed to its \
                 experts with host-side counts",
            );
        }
        if !self.rotary.capturable() || self.rotary_local.as_ref().is_some_and(|r| !r.capturable()) {
            return Some(
                "its RoPE scaling (LongRoPE or dynamic NTK) picks frequencies from the longest position on the host",
            );
        }
        None
    }

    /// Whether the layers attend by the key mask alone over rows of `seq` slots: no linear
    /// attention (a recurrence runs slot after slot) and no sliding window narrower than the rows
    /// (a window counts slots), so a packed sequence may see keys that are not its neighbours
    /// ([`crate::Packing::sharing`]).
    pub fn attends_by_mask(&self, seq: i64) -> bool {
        let narrow = self.sliding_window.is_some_and(|w| w < seq) && self.layers.iter().any(|b| b.sliding);
        !self.has_linear() && !narrow
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `i`: attention and MLP, each added to the residual stream with the layout's norms.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn layer(&self, i: usize, h: &Tensor, shared: &LayerShared, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let block = &self.layers[i];
        let n = &block.norms;
        let x = apply(&n.input, h.shallow_clone())?;
        let a = match &block.mixer {
            Mixer::Attention(attn) => {
                let (cos, sin) = shared
                    .rotary_for(block.sliding)
                    .ok_or_else(|| ModelError::Input("rotary layer without rotary tables".into()))?;
                let mask = shared.mask_for(block.sliding);
                let (y, kv) = match block.kv_source {
                    Some(j) => attn.forward(&x, cos, sin, mask, None, Some(shared.side.kv_of(j)?))?,
                    None => attn.forward(&x, cos, sin, mask, cache.map(|c| (c, i)), None)?,
                };
                if block.stores_kv {
                    shared.side.store_kv(i, kv);
                }
                y
            }
            Mixer::Linear(l) => l.forward(&x, &shared.linear, cache.map(|c| (c, i)))?,
        };
        let h = h.f_add(&apply(&n.post_attention, a)?)?;
        let x = apply(&n.pre_feedforward, h.shallow_clone())?;
        let mut m = block.mlp.forward(&x, shared.router.as_ref(), shared.experts)?;
        if let Some(experts) = &block.experts_beside {
            m = experts.forward(&h, &m, shared.router.as_ref(), shared.experts)?;
        }
        let m = apply(&n.post_feedforward, m)?;
        let mut h = h.f_add(&m)?;
        if let Some(branch) = &block.per_layer {
            h = branch.forward(&h, &shared.side.per_layer_input(i)?)?;
        }
        if let Some(s) = &block.scalar {
            h = h.f_mul(s)?;
        }
        shared.side.add_deepstack(i, h)
    }

    /// The last RMSNorm.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        self.norm.forward(h)
    }
}
