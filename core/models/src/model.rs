//! The two model shapes the trainer uses, loaded from and saved to Hugging Face directories:
//! [`CausalLm`] (`*ForCausalLM`: actor, reference, SFT) and [`ScalarHeadModel`]
//! (`*ForSequenceClassification` with `num_labels = 1`: reward model, critic).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::Value;
use tch::{nn, Device, Kind, Tensor};

use crate::adapters;
use crate::backbone::{Backbone, Routing};
use crate::checkpointing::{self, Checkpointed};
use crate::config::{ArchConfig, ModelConfig};
use crate::device::dtype_name;
use crate::error::{ModelError, Result};
use crate::layers::{position_ids_from_mask, KvCache};
use crate::lora::{self, LoraConfig};
use crate::vision_tower::VisionTower;
use crate::weights::{save_safetensors, write_json, Checkpoint, WeightLoader};

/// transformers' default `max_shard_size` is far above anything we shard by default.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5 << 30;

/// Files copied next to the weights on save so the directory stays a complete checkpoint.
const AUX_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    // A multimodal checkpoint's processors (its vision tower is saved back too).
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
];

pub(crate) fn check_ids(ids: &Tensor, mask: &Tensor) -> Result<()> {
    let (si, sm) = (ids.size(), mask.size());
    if si.len() != 2 || sm.len() != 2 || si[0] != sm[0] || sm[1] < si[1] {
        return Err(ModelError::Input(format!(
            "input_ids {si:?} and attention_mask {sm:?} must be [batch, seq] and [batch, past + seq]"
        )));
    }
    Ok(())
}

/// The `config.json` a save writes, before its dtype and overrides: the source's, without the
/// `quantization_config` of experts dequantised at load (they are saved unquantised).
pub(crate) fn saved_config(config: &ModelConfig) -> Value {
    let mut raw = config.raw.clone();
    if let (true, Some(obj)) = (config.arch.mxfp4, raw.as_object_mut()) {
        obj.remove("quantization_config");
    }
    raw
}

/// What a model of `arch` carries through from `ckpt` unchanged: a multimodal checkpoint's other
/// towers (unless `towers_loaded`), Gemma 4's `layer_scalar` constants.
pub(crate) fn passthrough(ckpt: &Checkpoint, arch: &ArchConfig, towers_loaded: bool) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = arch
        .multimodal
        .filter(|_| !towers_loaded)
        .map(|m| m.vision_prefixes.iter().flat_map(|p| ckpt.passthrough(p)).collect())
        .unwrap_or_default();
    if arch.gemma4.is_some() {
        for i in 0..arch.num_layers {
            let name = format!("{}.layers.{i}.layer_scalar", arch.backbone_prefix());
            if ckpt.contains(&name) {
                out.extend(ckpt.passthrough(&name));
            }
        }
    }
    out
}

pub(crate) fn new_var_store(device: Device, kind: Kind) -> nn::VarStore {
    let mut vs = nn::VarStore::new(device);
    vs.set_kind(kind);
    vs
}

/// Writes `config.json` (the source's, with dtype and the given overrides), the weights and the
/// tokenizer files of `source_dir` into `dir`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn save_dir(
    dir: &Path,
    source_dir: &Path,
    raw: &Value,
    kind: Kind,
    overrides: &[(&str, Value)],
    vs: &nn::VarStore,
    merged: Vec<(String, Tensor)>,
    passthrough: &[(String, Tensor)],
    max_shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut config = raw.clone();
    if let Some(obj) = config.as_object_mut() {
        let mut wrote = false;
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), Value::from(dtype_name(kind)));
                wrote = true;
            }
        }
        if !wrote {
            obj.insert("dtype".into(), Value::from(dtype_name(kind)));
        }
        for (k, v) in overrides {
            obj.insert((*k).to_string(), v.clone());
        }
    }
    write_json(&dir.join("config.json"), &config)?;
    // LoRA adapters are folded into their base weights: the output is a plain checkpoint.
    let mut tensors: BTreeMap<String, Tensor> =
        vs.variables().into_iter().filter(|(n, _)| !lora::is_adapter_var(n)).collect();
    tensors.extend(merged);
    tensors.extend(passthrough.iter().map(|(n, t)| (n.clone(), t.shallow_clone())));
    save_safetensors(dir, &tensors, max_shard_bytes)?;
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same(dir, source_dir) {
        for f in AUX_FILES {
            let src = source_dir.join(f);
            if src.exists() {
                std::fs::copy(&src, dir.join(f)).map_err(|e| ModelError::io(&src, e))?;
            }
        }
    }
    Ok(())
}

/// A causal language model with its LM head (tied to the input embeddings when the config says so).
pub struct CausalLm {
    /// Owns every parameter, named as in the checkpoint.
    pub vs: nn::VarStore,
    pub config: ModelConfig,
    pub(crate) backbone: Backbone,
    lm_head: Option<Tensor>, // [vocab, hidden]; None when tied
    /// Replaces the output projection in [`CausalLm::logits_from_hidden`] (see
    /// [`CausalLm::set_output_head`]).
    output_head: Option<Tensor>,
    source_dir: PathBuf,
    /// Tensors of the checkpoint this model carries through unchanged (a multimodal checkpoint's
    /// vision tower), saved back as loaded.
    passthrough: Vec<(String, Tensor)>,
    /// Turns LoRA dropout on (training) or off (generation, evaluation).
    training: Arc<AtomicBool>,
    /// Switches the LoRA adapters off ([`CausalLm::with_adapters_disabled`]).
    adapters_off: Arc<AtomicBool>,
    /// Gathers and frees the units of sharded parameters in checkpointed passes.
    pub(crate) gate: crate::gate::Gate,
    /// The vision tower, where the checkpoint's images are read.
    pub(crate) vision: Option<VisionTower>,
}

impl std::fmt::Debug for CausalLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CausalLm").field("source_dir", &self.source_dir).field("arch", &self.config.arch).finish()
    }
}

impl CausalLm {
    /// Loads `config.json` and the safetensors weights of `dir` onto `device` in `kind`.
    pub fn from_dir(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let mut config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::from_dir(dir)?;
        config.match_checkpoint(&ckpt);
        let vs = new_var_store(device, kind);
        let w = WeightLoader::new(&ckpt, &vs, kind);
        let cfg = &config.arch;
        let backbone = Backbone::load(&w, cfg)?;
        let vision = VisionTower::load_for(&w, cfg)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(w.pp("lm_head").get("weight", &[cfg.vocab_size, cfg.hidden_size])?)
        };
        let passthrough = passthrough(&ckpt, cfg, vision.is_some());
        // A tied model may still store its head (a copy of the embedding, which it reads).
        ckpt.check_all_used(|n| crate::weights::ignorable(n) || (cfg.tie_word_embeddings && n == "lm_head.weight"))?;
        Ok(CausalLm {
            vs,
            config,
            backbone,
            lm_head,
            output_head: None,
            source_dir: dir.to_path_buf(),
            passthrough,
            training: Arc::default(),
            adapters_off: Arc::default(),
            gate: None,
            vision,
        })
    }

    /// The resolved architecture.
    pub fn arch(&self) -> &ArchConfig {
        &self.config.arch
    }

    /// Device of the parameters.
    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Floating dtype of the parameters.
    pub fn kind(&self) -> Kind {
        self.vs.kind()
    }

    /// Directory the model was loaded from (its tokenizer lives there).
    pub fn source_dir(&self) -> &Path {
        &self.source_dir
    }

    /// Stops gradient tracking on every parameter (a frozen reference model).
    pub fn freeze(&mut self) {
        self.vs.freeze();
    }

    /// Per sparse layer (mixture of experts), its index and the tokens the trained passes —
    /// those gradients flow through — routed to each expert since the last call, which resets
    /// them. Empty for a dense model.
    pub fn take_expert_load(&self) -> Vec<(usize, Vec<i64>)> {
        self.backbone.sparse_mlps().into_iter().map(|(i, m)| (i, m.take_load())).collect()
    }

    /// The output projection, `[vocab, hidden]`.
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or_else(|| self.backbone.embeddings())
    }

    /// Final hidden states.
    ///
    /// # Shapes
    /// - `input_ids`, `position_ids`: `[batch, seq]`; `attention_mask`: `[batch, past + seq]`
    ///   (covering cached tokens too); returns `[batch, seq, hidden]`.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        check_ids(input_ids, attention_mask)?;
        self.backbone.forward(input_ids, position_ids, attention_mask, cache, &self.gate)
    }

    /// [`CausalLm::hidden_states`] without a cache, and the mixture-of-experts load-balancing
    /// loss of the pass (`[]` f32, with its graph) where the model computes it
    /// ([`CausalLm::router_aux_loss_coef`]; padding does not count).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq]`; returns `[batch, seq, hidden]`
    pub fn hidden_states_with_aux(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        check_ids(input_ids, attention_mask)?;
        let (h, stats) = self.backbone.run(
            input_ids,
            position_ids,
            attention_mask,
            None,
            &self.gate,
            Routing::Record(None),
            None,
        )?;
        Ok((h, stats.map(|s| s.loss()).transpose()?))
    }

    /// The weight of the mixture-of-experts load-balancing loss (Switch Transformers' auxiliary
    /// loss, [`crate::layers::load_balance`]) in the training loss, where the config asks for it
    /// (`output_router_logits: true`, `router_aux_loss_coef`); the training passes then return
    /// the loss ([`CausalLm::hidden_states_with_aux`], [`Checkpointed::aux_loss`]).
    pub fn router_aux_loss_coef(&self) -> Option<f64> {
        self.config.arch.moe.as_ref().and_then(|m| m.aux_loss_coef)
    }

    /// Whether a pass over rows of `seq` tokens may be packed with shared prompts laid once
    /// ([`crate::Packing::sharing`]): the layers attend by the mask alone (no linear attention, no
    /// sliding window narrower than `seq`), and no load-balancing loss counts the tokens (a
    /// shared prompt's would count once, not once per row).
    pub fn packs_shared_prompts(&self, seq: i64) -> bool {
        self.backbone.packs_shared_prompts(seq, self.router_aux_loss_coef().is_some())
    }

    /// [`CausalLm::hidden_states`] (without a cache) as a checkpointed pass: no autograd graph,
    /// each layer's input kept; build the loss from [`Checkpointed::hidden`], backpropagate it,
    /// then hand the pass to [`CausalLm::backward_checkpointed`] (see [`crate::checkpointing`]).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq]`; hidden `[batch, seq, hidden]`
    pub fn hidden_states_checkpointed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
    ) -> Result<Checkpointed> {
        check_ids(input_ids, attention_mask)?;
        checkpointing::forward(&self.backbone, &self.gate, (input_ids, position_ids, attention_mask), None)
    }

    /// Sets (or with `None` removes) the gate of this model's sharded parameters, which its
    /// checkpointed passes call around each unit ([`crate::gate`]). With a gate the buffers the
    /// projections were laid in at load are let go: sharding frees each variable's storage, and
    /// a buffer would keep it whole ([`crate::layers::FusedRows`]).
    pub fn set_gate(&mut self, gate: crate::gate::Gate) {
        if gate.is_some() {
            self.backbone.release_buffers();
            crate::gate::return_freed_memory();
        }
        self.gate = gate;
    }

    /// Accumulates the parameter gradients of a checkpointed pass of this model once the loss
    /// built on its hidden states has been backpropagated.
    pub fn backward_checkpointed(&self, ck: &Checkpointed) -> Result<()> {
        checkpointing::backward(&self.backbone, ck)
    }

    /// Logits in the model's dtype.
    ///
    /// # Shapes
    /// - `hidden`: `[..., hidden]` → `[..., vocab]`
    pub fn logits_from_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = match &self.output_head {
            Some(w) => crate::layers::linear(&hidden.f_to_kind(w.kind())?, w, None)?,
            None => crate::layers::linear(hidden, self.lm_head_weight(), None)?,
        };
        match self.config.arch.final_softcap {
            // Gemma 2: `cap · tanh(logits / cap)`.
            Some(cap) => Ok(logits.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?),
            None => Ok(logits),
        }
    }

    /// Computes the logits with `weight` `[vocab, hidden]` (and in its dtype) instead of this
    /// model's own output projection: a bf16 decode copy of an f32 policy samples from the f32
    /// head of the policy itself (the same tensor, so it follows every optimizer step).
    pub fn set_output_head(&mut self, weight: Tensor) -> Result<()> {
        let want = [self.config.arch.vocab_size, self.config.arch.hidden_size];
        if weight.size() != want {
            return Err(ModelError::Input(format!("output head {:?}, expected {want:?}", weight.size())));
        }
        self.output_head = Some(weight);
        Ok(())
    }

    /// Full forward without a cache; positions come from the mask.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → logits `[batch, seq, vocab]`
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let pos = position_ids_from_mask(attention_mask)?;
        let h = self.hidden_states(input_ids, attention_mask, &pos, None)?;
        self.logits_from_hidden(&h)
    }

    /// One capture-safe decode step (see `Backbone::decode_step`): the next token of every row
    /// fed at cache slot `slot`, returning the logits after it.
    ///
    /// # Shapes
    /// - `ids`, `pos`: `[batch, 1]` int64; `key_mask`: `[batch, capacity]` int64 (the slot set);
    ///   `slot`: `[1]` int64 on the model's device → `[batch, vocab]`
    pub fn decode_step(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        key_mask: &Tensor,
        slot: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        if cache.max_len() != key_mask.size()[1] || cache.rows() != ids.size()[0] {
            return Err(ModelError::Input(format!(
                "decode step: key mask {:?} and ids {:?} do not match a cache of {} rows and {} slots",
                key_mask.size(),
                ids.size(),
                cache.rows(),
                cache.max_len()
            )));
        }
        let h = self.backbone.decode_step(ids, pos, key_mask, slot, cache, &self.gate)?; // [b, 1, hidden]
        self.logits_from_hidden(&h.f_select(1, 0)?)
    }

    /// Why [`CausalLm::decode_step`] cannot be captured as a CUDA graph on this model (it reads a
    /// value back to the host), if it cannot: routed experts, a length-dependent RoPE, or sharded
    /// parameters gathered around each layer (ZeRO stage 3).
    pub fn capture_blocker(&self) -> Option<&'static str> {
        if self.gate.is_some() {
            return Some("its parameters are sharded (ZeRO stage 3) and gathered around each layer");
        }
        self.backbone.capture_blocker()
    }

    /// How decode steps compute a mixture of experts (`None`: the device's default, see
    /// `DecoderModel::set_expert_steps`) — a CPU can compute what a step on CUDA does, to check
    /// it. No effect on a model without experts.
    pub fn set_expert_steps(&mut self, steps: Option<crate::layers::ExpertSteps>) {
        if let crate::backbone::Backbone::Decoder(m) = &mut self.backbone {
            m.set_expert_steps(steps);
        }
    }

    /// A KV cache sized for `batch` sequences of up to `max_len` tokens (linear-attention
    /// layers keep their fixed-size state instead).
    pub fn new_cache(&self, batch: i64, max_len: i64) -> Result<KvCache> {
        let a = self.arch();
        match &self.backbone {
            Backbone::Decoder(m) => {
                let layers = m.cache_layers(a);
                KvCache::with_layers(&layers, batch, max_len, self.kind(), self.device())
            }
            Backbone::Gpt2(_) => {
                KvCache::new(a.num_layers, batch, a.num_kv_heads, max_len, a.head_dim, self.kind(), self.device())
            }
        }
    }

    /// Adds LoRA adapters to the targeted layers and freezes every other weight (see [`lora`]);
    /// a no-op when `cfg.rank == 0`. Returns the number of adapted layers.
    pub fn apply_lora(&mut self, cfg: &LoraConfig) -> Result<usize> {
        let prefix = self.config.arch.backbone_prefix();
        adapters::check_targets(&self.backbone, prefix, cfg)?;
        let off = &self.adapters_off;
        let n = adapters::apply(&self.vs, self.backbone.linears_mut(prefix), cfg, &[], &self.training, off)?;
        Ok(n + adapters::apply_stacked(&self.vs, self.backbone.stacked_mut(prefix), cfg, off)?)
    }

    /// Folds the LoRA updates into the base weights (in place; the adapters become zero).
    pub fn merge_lora(&mut self) -> Result<()> {
        let prefix = self.config.arch.backbone_prefix();
        adapters::merge_in_place(self.backbone.linears_mut(prefix))?;
        adapters::merge_stacked_in_place(self.backbone.stacked_mut(prefix))
    }

    /// Training mode turns LoRA dropout on; the default is off.
    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::Relaxed);
    }

    /// Runs `f` with the LoRA adapters switched off: the model computes its base weights alone (the
    /// reference of LoRA DPO, without a second copy in memory). Without adapters, just `f()`.
    pub fn with_adapters_disabled<T>(&self, f: impl FnOnce() -> T) -> T {
        struct Reset<'a>(&'a AtomicBool);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        self.adapters_off.store(true, Ordering::Relaxed);
        let _reset = Reset(&self.adapters_off);
        f()
    }

    /// Saves config, weights (same names and layout as loaded; LoRA merged) and tokenizer files
    /// into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_sharded(dir, DEFAULT_MAX_SHARD_BYTES)
    }

    /// Saves the LoRA adapters alone in PEFT's layout (`adapter_config.json`,
    /// `adapter_model.safetensors`), loadable by PEFT and by vLLM's LoRA support on top of the
    /// base model this one was loaded from.
    pub fn save_lora_adapter(&self, dir: &Path) -> Result<()> {
        let prefix = self.config.arch.backbone_prefix();
        let (mut config, tensors) =
            adapters::peft_adapter(self.backbone.linears(prefix), self.backbone.stacked(prefix))?;
        if let Some(obj) = config.as_object_mut() {
            obj.insert("base_model_name_or_path".into(), Value::from(self.source_dir.display().to_string()));
        }
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        write_json(&dir.join("adapter_config.json"), &config)?;
        let tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        crate::weights::save_safetensors_file(&dir.join("adapter_model.safetensors"), &tensors)
    }

    /// [`CausalLm::save`] with an explicit shard size.
    pub fn save_sharded(&self, dir: &Path, max_shard_bytes: usize) -> Result<()> {
        let prefix = self.config.arch.backbone_prefix();
        let mut merged = adapters::merged_weights(self.backbone.linears(prefix))?;
        merged.extend(adapters::merged_stacked(self.backbone.stacked(prefix))?);
        let (raw, kind) = (saved_config(&self.config), self.kind());
        save_dir(dir, &self.source_dir, &raw, kind, &[], &self.vs, merged, &self.passthrough, max_shard_bytes)
    }
}
