//! GPT-2 (Radford et al. 2019) — the reference is transformers' `modeling_gpt2.py`. Learned absolute
//! positions, pre-LayerNorm blocks, fused `c_attn` q/k/v projection and `Conv1D` weights stored as
//! `[in, out]`, gelu_new MLP. The LM head is tied to `wte` unless the config says otherwise.
//!
//! Tensor names: `transformer.{wte,wpe}.weight`, `transformer.h.{i}.ln_{1,2}.{weight,bias}`,
//! `transformer.h.{i}.attn.{c_attn,c_proj}.{weight,bias}`, `transformer.h.{i}.mlp.{c_fc,c_proj}.*`,
//! `transformer.ln_f.*`. The causal-mask buffers (`attn.bias`, `attn.masked_bias`) of old checkpoints
//! are ignored.

use std::path::Path;

use tch::Tensor;

use crate::config::{self, Activation, ArchConfig, AttnKind, BlockLayout, Family, HfConfig, NormKind, QkNorm};
use crate::error::{ModelError, Result};
use crate::layers::{activate, attention_mask, step_attention_mask, KvCache, LayerNorm, LayerShared, Linear};
use crate::weights::WeightLoader;

/// The keys GPT-2 implements (its own names; no rotary-decoder keys).
pub(crate) const CONFIG_KEYS: &[&str] = &[
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_ctx",
    "n_inner",
    "layer_norm_epsilon",
    "activation_function",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "tie_word_embeddings",
    // The summary head of `GPT2DoubleHeadsModel`, which a causal LM does not have.
    "summary_activation",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
];

/// Resolves a GPT-2 `config.json` with transformers' defaults.
pub(crate) fn resolve(path: &Path, hf: &HfConfig) -> Result<ArchConfig> {
    let hidden = config::require(path, "n_embd", hf.n_embd)?;
    let heads = config::require(path, "n_head", hf.n_head)?;
    if hidden % heads != 0 {
        return Err(ModelError::config(path, "n_head", format!("{heads} does not divide n_embd {hidden}")));
    }
    if hf.reorder_and_upcast_attn == Some(true) {
        return Err(ModelError::config(path, "reorder_and_upcast_attn", "true is not supported"));
    }
    if hf.scale_attn_weights == Some(false) {
        return Err(ModelError::config(path, "scale_attn_weights", "false is not supported"));
    }
    let act = hf.activation_function.as_deref().unwrap_or("gelu_new");
    let num_layers = config::require_layers(path, "n_layer", hf.n_layer)?;
    Ok(ArchConfig {
        family: Family::Gpt2,
        vocab_size: config::require(path, "vocab_size", hf.vocab_size)?,
        hidden_size: hidden,
        num_layers,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: hidden / heads,
        intermediate_size: hf.n_inner.unwrap_or(4 * hidden),
        norm_eps: hf.layer_norm_epsilon.unwrap_or(1e-5),
        rope: None,
        rope_local: None,
        rotary_dim: 0,
        max_position_embeddings: config::require(path, "n_positions", hf.n_positions)?,
        tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(true),
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        activation: config::activation(path, "activation_function", act)?,
        scale_attn_by_inverse_layer_idx: hf.scale_attn_by_inverse_layer_idx.unwrap_or(false),
        pad_token_id: None,
        num_labels: 2,
        norm: NormKind::Rms,
        qk_norm: QkNorm::None,
        layout: BlockLayout::PreNorm,
        fused_qkv: true,
        fused_gate_up: false,
        embed_scale: None,
        attn_scale: None,
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        layer_types: vec![AttnKind::Full; num_layers as usize],
        linear_attn: None,
        attn_output_gate: false,
        multimodal: None,
        vision: None,
        attn_sinks: false,
        mxfp4: false,
        gemma4: None,
        moe: None,
    })
}

#[derive(Debug)]
struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_c_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_c_proj: Linear,
    /// Softmax scale: 1/sqrt(head_dim), divided by (layer + 1) with `scale_attn_by_inverse_layer_idx`.
    scale: f64,
}

/// The GPT-2 transformer without the LM head.
#[derive(Debug)]
pub struct Gpt2Model {
    pub(crate) wte: Tensor, // [vocab, hidden]
    wpe: Tensor,            // [n_positions, hidden]
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    num_heads: i64,
    head_dim: i64,
    max_positions: i64,
    act: Activation,
}

impl Gpt2Model {
    /// Every linear layer with its weight path below the backbone scope (`h.0.attn.c_attn`).
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            for (name, l) in [
                ("attn.c_attn", &mut b.c_attn),
                ("attn.c_proj", &mut b.attn_c_proj),
                ("mlp.c_fc", &mut b.c_fc),
                ("mlp.c_proj", &mut b.mlp_c_proj),
            ] {
                out.push((format!("h.{i}.{name}"), l));
            }
        }
        out
    }

    /// [`Gpt2Model::linears_mut`], shared.
    pub(crate) fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            for (name, l) in [
                ("attn.c_attn", &b.c_attn),
                ("attn.c_proj", &b.attn_c_proj),
                ("mlp.c_fc", &b.c_fc),
                ("mlp.c_proj", &b.mlp_c_proj),
            ] {
                out.push((format!("h.{i}.{name}"), l));
            }
        }
        out
    }

    /// Loads the backbone from the `transformer.` scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.norm_eps);
        let wte = w.pp("wte").get("weight", &[cfg.vocab_size, h])?;
        let wpe = w.pp("wpe").get("weight", &[cfg.max_position_embeddings, h])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers as usize);
        for i in 0..cfg.num_layers {
            let l = w.pp("h").pp(i);
            let mut scale = 1.0 / (cfg.head_dim as f64).sqrt();
            if cfg.scale_attn_by_inverse_layer_idx {
                scale /= (i + 1) as f64;
            }
            blocks.push(Block {
                ln_1: LayerNorm::load(&l.pp("ln_1"), h, eps)?,
                c_attn: Linear::load_conv1d(&l.pp("attn").pp("c_attn"), h, 3 * h)?,
                attn_c_proj: Linear::load_conv1d(&l.pp("attn").pp("c_proj"), h, h)?,
                ln_2: LayerNorm::load(&l.pp("ln_2"), h, eps)?,
                c_fc: Linear::load_conv1d(&l.pp("mlp").pp("c_fc"), h, cfg.intermediate_size)?,
                mlp_c_proj: Linear::load_conv1d(&l.pp("mlp").pp("c_proj"), cfg.intermediate_size, h)?,
                scale,
            });
        }
        let ln_f = LayerNorm::load(&w.pp("ln_f"), h, eps)?;
        Ok(Gpt2Model {
            wte,
            wpe,
            blocks,
            ln_f,
            num_heads: cfg.num_heads,
            head_dim: cfg.head_dim,
            max_positions: cfg.max_position_embeddings,
            act: cfg.activation,
        })
    }

    /// Token plus position embeddings, and what every layer of this forward shares.
    ///
    /// # Shapes
    /// - `input_ids`, `position_ids`: `[batch, seq]`; `key_mask`: `[batch, past + seq]`
    /// - returns `[batch, seq, hidden]`
    pub fn embed(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        key_mask: &Tensor,
        past: i64,
    ) -> Result<(Tensor, LayerShared)> {
        let s = input_ids.size()[1];
        // Positions never exceed the token index, so this bound needs no device sync.
        if past + s > self.max_positions {
            return Err(ModelError::Input(format!(
                "{} tokens exceed GPT-2's n_positions = {} (sequence too long)",
                past + s,
                self.max_positions
            )));
        }
        let tok = Tensor::f_embedding(&self.wte, input_ids, -1, false, false)?;
        let pos = Tensor::f_embedding(&self.wpe, position_ids, -1, false, false)?;
        let mask = attention_mask(key_mask, past, s)?;
        Ok((tok.f_add(&pos)?, LayerShared::attention_only(mask)))
    }

    /// [`Gpt2Model::embed`] for a capture-safe decode step (see [`step_attention_mask`]).
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
        let capacity = key_mask.size()[1];
        if capacity > self.max_positions {
            return Err(ModelError::Input(format!(
                "{capacity} tokens exceed GPT-2's n_positions = {} (sequence too long)",
                self.max_positions
            )));
        }
        let tok = Tensor::f_embedding(&self.wte, input_ids, -1, false, false)?;
        let pos = Tensor::f_embedding(&self.wpe, position_ids, -1, false, false)?;
        let mask = step_attention_mask(key_mask, slot, None)?;
        Ok((tok.f_add(&pos)?, LayerShared::attention_only(mask)))
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    /// Layer `i`: pre-norm attention and MLP, each added to the residual stream.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn layer(&self, i: usize, h: &Tensor, shared: &LayerShared, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, s) = (h.size()[0], h.size()[1]);
        let block = &self.blocks[i];
        let hidden = self.num_heads * self.head_dim;
        let x = block.ln_1.forward(h)?;
        let qkv = block.c_attn.forward(&x)?; // [b, s, 3h]
        let parts = qkv.f_split(hidden, 2)?;
        let heads =
            |t: &Tensor| -> Result<Tensor> { Ok(t.f_view([b, s, self.num_heads, self.head_dim])?.f_transpose(1, 2)?) };
        let (q, k, v) = (heads(&parts[0])?, heads(&parts[1])?, heads(&parts[2])?);
        let (k, v) = match cache {
            Some(c) => c.append(i, &k, &v)?,
            None => (k, v),
        };
        let y = Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(&shared.mask), 0.0, false, block.scale, false)?;
        let y = y.f_transpose(1, 2)?.f_reshape([b, s, hidden])?;
        let h = h.f_add(&block.attn_c_proj.forward(&y)?)?;
        let x = block.ln_2.forward(&h)?;
        let m = block.mlp_c_proj.forward(&activate(&block.c_fc.forward(&x)?, self.act)?)?;
        Ok(h.f_add(&m)?)
    }

    /// `ln_f`.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        self.ln_f.forward(h)
    }
}
