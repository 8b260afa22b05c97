//! Llama (Touvron et al. 2023) and Qwen2 decoders — the reference is transformers'
//! `modeling_llama.py` / `modeling_qwen2.py`. Pre-norm blocks with RMSNorm, rotary positions
//! (plain, linear or Llama-3 scaled), grouped-query attention through
//! `scaled_dot_product_attention`, and a SwiGLU MLP. Qwen2 differs only by a bias on q/k/v, which
//! [`ArchConfig::qkv_bias`] carries. Mistral without sliding window is the same graph.
//!
//! Tensor names: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.*`,
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
//! `model.norm.weight`.

use tch::Tensor;

use crate::config::{Activation, ArchConfig};
use crate::error::{ModelError, Result};
use crate::layers::{apply_rotary, attention_mask, KvCache, LayerShared, Linear, RmsNorm, Rotary};
use crate::weights::WeightLoader;

/// Self-attention with grouped key/value heads.
#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        Ok(Attention {
            q_proj: Linear::load(&w.pp("q_proj"), h, nh * hd, cfg.qkv_bias)?,
            k_proj: Linear::load(&w.pp("k_proj"), h, nkv * hd, cfg.qkv_bias)?,
            v_proj: Linear::load(&w.pp("v_proj"), h, nkv * hd, cfg.qkv_bias)?,
            o_proj: Linear::load(&w.pp("o_proj"), nh * hd, h, cfg.o_bias)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        })
    }

    /// # Shapes
    /// - `x`: `[batch, seq, hidden]`; `cos`, `sin`: `[batch, 1, seq, head_dim]`;
    ///   `mask`: `[batch, 1, seq, past + seq]` (bool) → `[batch, seq, hidden]`
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: Option<(&mut KvCache, usize)>,
    ) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let split = |t: Tensor, heads: i64| -> Result<Tensor> {
            Ok(t.f_view([b, s, heads, self.head_dim])?.f_transpose(1, 2)?) // [b, heads, s, hd]
        };
        let q = split(self.q_proj.forward(x)?, self.num_heads)?;
        let k = split(self.k_proj.forward(x)?, self.num_kv_heads)?;
        let v = split(self.v_proj.forward(x)?, self.num_kv_heads)?;
        let q = apply_rotary(&q, cos, sin)?;
        let k = apply_rotary(&k, cos, sin)?;
        let (k, v) = match cache {
            Some((cache, layer)) => cache.append(layer, &k, &v)?, // [b, kv, past + s, hd]
            None => (k, v),
        };
        let gqa = self.num_heads != self.num_kv_heads;
        let y = Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, None, gqa)?;
        let y = y.f_transpose(1, 2)?.f_reshape([b, s, self.num_heads * self.head_dim])?;
        self.o_proj.forward(&y)
    }
}

/// SwiGLU MLP: `down(act(gate(x)) * up(x))`.
#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
}

impl Mlp {
    fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Mlp {
            gate_proj: Linear::load(&w.pp("gate_proj"), h, i, bias)?,
            up_proj: Linear::load(&w.pp("up_proj"), h, i, bias)?,
            down_proj: Linear::load(&w.pp("down_proj"), i, h, bias)?,
            act: cfg.activation,
        })
    }

    /// # Shapes
    /// - `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = crate::layers::activate(&self.gate_proj.forward(x)?, self.act)?;
        self.down_proj.forward(&gate.f_mul(&self.up_proj.forward(x)?)?)
    }
}

#[derive(Debug)]
struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// The Llama/Qwen2 decoder stack without the LM head.
#[derive(Debug)]
pub struct LlamaModel {
    pub(crate) embed_tokens: Tensor, // [vocab, hidden]
    layers: Vec<Block>,
    norm: RmsNorm,
    rotary: Rotary,
}

impl LlamaModel {
    /// Loads the backbone from the `model.` scope.
    pub fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let rope = cfg.rope.as_ref().ok_or_else(|| ModelError::Input("llama config without rope".into()))?;
        let embed_tokens = w.pp("embed_tokens").get("weight", &[cfg.vocab_size, cfg.hidden_size])?;
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        for i in 0..cfg.num_layers {
            let l = w.pp("layers").pp(i);
            layers.push(Block {
                input_layernorm: RmsNorm::load(&l.pp("input_layernorm"), cfg.hidden_size, cfg.norm_eps)?,
                self_attn: Attention::load(&l.pp("self_attn"), cfg)?,
                post_attention_layernorm: RmsNorm::load(
                    &l.pp("post_attention_layernorm"),
                    cfg.hidden_size,
                    cfg.norm_eps,
                )?,
                mlp: Mlp::load(&l.pp("mlp"), cfg)?,
            });
        }
        let norm = RmsNorm::load(&w.pp("norm"), cfg.hidden_size, cfg.norm_eps)?;
        let rotary = Rotary::new(rope, cfg.head_dim, w.device())?;
        Ok(LlamaModel { embed_tokens, layers, norm, rotary })
    }

    /// Every linear layer with its weight path below the backbone scope (`layers.0.self_attn.q_proj`).
    pub(crate) fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter_mut().enumerate() {
            let a = &mut b.self_attn;
            let m = &mut b.mlp;
            for (name, l) in [
                ("self_attn.q_proj", &mut a.q_proj),
                ("self_attn.k_proj", &mut a.k_proj),
                ("self_attn.v_proj", &mut a.v_proj),
                ("self_attn.o_proj", &mut a.o_proj),
                ("mlp.gate_proj", &mut m.gate_proj),
                ("mlp.up_proj", &mut m.up_proj),
                ("mlp.down_proj", &mut m.down_proj),
            ] {
                out.push((format!("layers.{i}.{name}"), l));
            }
        }
        out
    }

    /// [`LlamaModel::linears_mut`], shared.
    pub(crate) fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, b) in self.layers.iter().enumerate() {
            let (a, m) = (&b.self_attn, &b.mlp);
            for (name, l) in [
                ("self_attn.q_proj", &a.q_proj),
                ("self_attn.k_proj", &a.k_proj),
                ("self_attn.v_proj", &a.v_proj),
                ("self_attn.o_proj", &a.o_proj),
                ("mlp.gate_proj", &m.gate_proj),
                ("mlp.up_proj", &m.up_proj),
                ("mlp.down_proj", &m.down_proj),
            ] {
                out.push((format!("layers.{i}.{name}"), l));
            }
        }
        out
    }

    /// Token embeddings, and what every layer of this forward shares (mask, rotary tables).
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
        let seq = input_ids.size()[1];
        let h = Tensor::f_embedding(&self.embed_tokens, input_ids, -1, false, false)?;
        let rotary = self.rotary.cos_sin(position_ids, h.kind())?;
        let mask = attention_mask(key_mask, past, seq)?;
        Ok((h, LayerShared { mask, rotary: Some(rotary) }))
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `i`: pre-norm attention and MLP, each added to the residual stream.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn layer(&self, i: usize, h: &Tensor, shared: &LayerShared, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let block = &self.layers[i];
        let (cos, sin) =
            shared.rotary.as_ref().ok_or_else(|| ModelError::Input("llama layer without rotary tables".into()))?;
        let x = block.input_layernorm.forward(h)?;
        let h = h.f_add(&block.self_attn.forward(&x, cos, sin, &shared.mask, cache.map(|c| (c, i)))?)?;
        let x = block.post_attention_layernorm.forward(&h)?;
        Ok(h.f_add(&block.mlp.forward(&x)?)?)
    }

    /// The last RMSNorm.
    ///
    /// # Shapes
    /// - `h`: `[batch, seq, hidden]` → `[batch, seq, hidden]`
    pub fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        self.norm.forward(h)
    }
}
