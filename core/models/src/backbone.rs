//! The decoder stack of each supported family behind one type: embeddings, layers and the final
//! norm, composed into a forward pass here and layer by layer by [`crate::checkpointing`].

use tch::Tensor;

use crate::config::{ArchConfig, Family};
use crate::decoder::DecoderModel;
use crate::error::Result;
use crate::gate::{gated, Gate};
use crate::gpt2::Gpt2Model;
use crate::layers::{KvCache, LayerShared, Linear, RouterStats};
use crate::weights::WeightLoader;

/// Whether a forward records its routing for the load-balancing loss: only a training pass does
/// (generation, evaluation and reference passes would compute statistics nobody reads).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Routing<'a> {
    Off,
    /// Recorded, each row's tokens counted `rows[b]` times where given.
    Record(Option<&'a Tensor>),
}

impl Routing<'_> {
    /// Drops or weights the record [`Backbone::embed`] made.
    pub(crate) fn apply(self, shared: &mut LayerShared) -> Result<()> {
        match (self, shared.router.as_mut()) {
            (Routing::Off, _) => shared.router = None,
            (Routing::Record(Some(rows)), Some(record)) => record.scale_rows(rows)?,
            _ => {}
        }
        Ok(())
    }
}

/// A decoder stack of one of the supported families.
#[derive(Debug)]
pub enum Backbone {
    Decoder(DecoderModel),
    Gpt2(Gpt2Model),
}

impl Backbone {
    pub(crate) fn load(w: &WeightLoader, cfg: &ArchConfig) -> Result<Self> {
        let w = cfg.backbone_prefix().split('.').fold(w.clone(), |w, part| w.pp(part));
        Ok(match cfg.family {
            Family::Gpt2 => Backbone::Gpt2(Gpt2Model::load(&w, cfg)?),
            _ => Backbone::Decoder(DecoderModel::load(&w, cfg)?),
        })
    }

    /// Final hidden states: embeddings, every layer, the final norm. With sharded layers (`gate`,
    /// ZeRO stage 3) each layer is gathered just before it runs and freed after.
    ///
    /// # Shapes
    /// - `input_ids`, `position_ids`: `[batch, seq]`; `key_mask`: `[batch, past + seq]` → `[batch, seq, hidden]`
    pub(crate) fn forward(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        key_mask: &Tensor,
        cache: Option<&mut KvCache>,
        gate: &Gate,
    ) -> Result<Tensor> {
        Ok(self.run(ids, pos, key_mask, cache, gate, Routing::Off, None)?.0)
    }

    /// [`Backbone::forward`], recording the routing as `routing` says: in a training pass of a model
    /// that computes the load-balancing loss, also the routing statistics of the pass
    /// ([`crate::layers::load_balance`]); `visual` features replace the image placeholders
    /// ([`DecoderModel::embed`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        key_mask: &Tensor,
        mut cache: Option<&mut KvCache>,
        gate: &Gate,
        routing: Routing,
        visual: Option<&crate::visual_input::Visual>,
    ) -> Result<(Tensor, Option<RouterStats>)> {
        let past = cache.as_ref().map_or(0, |c| c.len());
        let (mut h, mut shared) = self.embed(ids, pos, key_mask, past, visual)?;
        routing.apply(&mut shared)?;
        for i in 0..self.num_layers() {
            h = gated(gate, i, || self.layer(i, &h, &shared, cache.as_deref_mut()))?;
        }
        if let Some(c) = cache {
            c.advance(ids.size()[1]);
        }
        Ok((self.final_norm(&h)?, shared.router.and_then(|r| r.take())))
    }

    /// One capture-safe decode step: embeddings, every layer writing its keys and values at cache
    /// slot `slot` and attending over the whole cache where `key_mask` is set, the final norm.
    /// Nothing is read back to the host and no shape depends on a value, so the step can be
    /// captured as a CUDA graph and replayed (see `rlhf_generation`).
    ///
    /// # Shapes
    /// - `ids`, `pos`: `[batch, 1]`; `key_mask`: `[batch, capacity]`; `slot`: `[1]` int64 →
    ///   `[batch, 1, hidden]`
    pub(crate) fn decode_step(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        key_mask: &Tensor,
        slot: &Tensor,
        cache: &mut KvCache,
        gate: &Gate,
    ) -> Result<Tensor> {
        let (mut h, shared) = match self {
            Backbone::Decoder(m) => m.embed_step(ids, pos, key_mask, slot)?,
            Backbone::Gpt2(m) => m.embed_step(ids, pos, key_mask, slot)?,
        };
        cache.set_write_slot(Some(slot.shallow_clone()));
        let layers = (0..self.num_layers()).try_for_each(|i| -> Result<()> {
            h = gated(gate, i, || self.layer(i, &h, &shared, Some(&mut *cache)))?;
            Ok(())
        });
        cache.set_write_slot(None);
        layers?;
        self.final_norm(&h)
    }

    /// Whether a pass over rows of `seq` tokens may be packed with shared prompts laid once
    /// ([`crate::Packing::sharing`]): the layers attend by the mask alone
    /// ([`DecoderModel::attends_by_mask`]; GPT-2's always do), and no load-balancing loss counts
    /// the tokens (`router_aux`: a shared prompt's would count once, not once per row).
    pub(crate) fn packs_shared_prompts(&self, seq: i64, router_aux: bool) -> bool {
        !router_aux
            && match self {
                Backbone::Decoder(m) => m.attends_by_mask(seq),
                Backbone::Gpt2(_) => true,
            }
    }

    /// See `DecoderModel::release_buffers` (GPT-2 lays nothing in shared buffers).
    pub(crate) fn release_buffers(&mut self) {
        if let Backbone::Decoder(m) = self {
            m.release_buffers();
        }
    }

    /// Why [`Backbone::decode_step`] cannot be captured as a CUDA graph, if it cannot.
    pub(crate) fn capture_blocker(&self) -> Option<&'static str> {
        match self {
            Backbone::Decoder(m) => m.capture_blocker(),
            Backbone::Gpt2(_) => None,
        }
    }

    /// Embeddings and what the layers share; see [`DecoderModel::embed`].
    pub(crate) fn embed(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        key_mask: &Tensor,
        past: i64,
        visual: Option<&crate::visual_input::Visual>,
    ) -> Result<(Tensor, LayerShared)> {
        match (self, visual) {
            (Backbone::Decoder(m), _) => m.embed(ids, pos, key_mask, past, visual),
            (Backbone::Gpt2(m), None) => m.embed(ids, pos, key_mask, past),
            (Backbone::Gpt2(_), Some(_)) => Err(crate::error::ModelError::Input("GPT-2 reads no images".into())),
        }
    }

    pub(crate) fn num_layers(&self) -> usize {
        match self {
            Backbone::Decoder(m) => m.num_layers(),
            Backbone::Gpt2(m) => m.num_layers(),
        }
    }

    /// Layer `i`, `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub(crate) fn layer(
        &self,
        i: usize,
        h: &Tensor,
        shared: &LayerShared,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        match self {
            Backbone::Decoder(m) => m.layer(i, h, shared, cache),
            Backbone::Gpt2(m) => m.layer(i, h, shared, cache),
        }
    }

    pub(crate) fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        match self {
            Backbone::Decoder(m) => m.final_norm(h),
            Backbone::Gpt2(m) => m.final_norm(h),
        }
    }

    /// Every linear layer with its full weight path (`model.layers.0.self_attn.q_proj`).
    pub(crate) fn linears_mut(&mut self, prefix: &str) -> Vec<(String, &mut Linear)> {
        let layers = match self {
            Backbone::Decoder(m) => m.linears_mut(),
            Backbone::Gpt2(m) => m.linears_mut(),
        };
        layers.into_iter().map(|(n, l)| (format!("{prefix}.{n}"), l)).collect()
    }

    pub(crate) fn linears(&self, prefix: &str) -> Vec<(String, &Linear)> {
        let layers = match self {
            Backbone::Decoder(m) => m.linears(),
            Backbone::Gpt2(m) => m.linears(),
        };
        layers.into_iter().map(|(n, l)| (format!("{prefix}.{n}"), l)).collect()
    }

    /// Every stacked expert weight with its full path (`model.layers.0.mlp.experts.gate_up_proj`).
    pub(crate) fn stacked_mut(&mut self, prefix: &str) -> Vec<(String, &mut crate::lora::StackedWeight)> {
        match self {
            Backbone::Decoder(m) => m.stacked_mut().into_iter().map(|(n, w)| (format!("{prefix}.{n}"), w)).collect(),
            Backbone::Gpt2(_) => Vec::new(),
        }
    }

    /// [`Backbone::stacked_mut`], shared.
    pub(crate) fn stacked(&self, prefix: &str) -> Vec<(String, &crate::lora::StackedWeight)> {
        match self {
            Backbone::Decoder(m) => m.stacked().into_iter().map(|(n, w)| (format!("{prefix}.{n}"), w)).collect(),
            Backbone::Gpt2(_) => Vec::new(),
        }
    }

    /// The routed MLPs with their layer index (none for dense models).
    pub(crate) fn sparse_mlps(&self) -> Vec<(usize, &crate::layers::SparseMoe)> {
        match self {
            Backbone::Decoder(m) => m.sparse_mlps(),
            Backbone::Gpt2(_) => Vec::new(),
        }
    }

    pub(crate) fn embeddings(&self) -> &Tensor {
        match self {
            Backbone::Decoder(m) => &m.embed_tokens,
            Backbone::Gpt2(m) => &m.wte,
        }
    }
}
