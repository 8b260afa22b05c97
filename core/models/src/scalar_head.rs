//! [`ScalarHeadModel`]: a backbone with one scalar per token (reward model, critic), loaded from
//! and saved as transformers' `*ForSequenceClassification` with one label; with the checkpoint's
//! vision tower where it reads images (the critic of a vision-language policy).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::Value;
use tch::{nn, Device, Kind, Tensor};

use crate::adapters;
use crate::backbone::Backbone;
use crate::checkpointing::{self, Checkpointed};
use crate::config::{ArchConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::layers::position_ids_from_mask;
use crate::lora::LoraConfig;
use crate::model::{check_ids, new_var_store, passthrough, save_dir, saved_config, DEFAULT_MAX_SHARD_BYTES};
use crate::multimodal::Images;
use crate::vision_tower::VisionTower;
use crate::visual_input::Visual;
use crate::weights::{Checkpoint, WeightLoader};

/// A backbone with a scalar head `score.weight: [1, hidden]` (no bias), transformers'
/// `*ForSequenceClassification` with `num_labels = 1`. Used as reward model and critic.
pub struct ScalarHeadModel {
    pub vs: nn::VarStore,
    pub config: ModelConfig,
    backbone: Backbone,
    /// The vision tower, where the checkpoint reads images (a critic of a vision-language policy).
    vision: Option<VisionTower>,
    score: Tensor, // [1, hidden]
    source_dir: PathBuf,
    /// As [`CausalLm`]'s: carried through, saved back as loaded.
    passthrough: Vec<(String, Tensor)>,
    training: Arc<AtomicBool>,
    gate: crate::gate::Gate,
}

impl std::fmt::Debug for ScalarHeadModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScalarHeadModel").field("source_dir", &self.source_dir).finish()
    }
}

impl ScalarHeadModel {
    /// Loads a `*ForSequenceClassification` checkpoint with one label.
    pub fn from_dir(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        if config.arch.num_labels != 1 {
            return Err(ModelError::config(
                &config.path,
                "num_labels",
                format!("a scalar head needs num_labels = 1, got {}", config.arch.num_labels),
            ));
        }
        let hidden = config.arch.hidden_size;
        Self::load(dir, config, device, kind, |w| w.get("weight", &[1, hidden]), crate::weights::ignorable)
    }

    /// Builds a scalar-head model from a causal-LM checkpoint: the backbone is copied, the LM head
    /// dropped, and a fresh `score` head drawn from N(0, 1/(hidden + 1)²) (OpenRLHF's critic init).
    pub fn from_causal_lm_dir(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let hidden = config.arch.hidden_size;
        let score = |w: &WeightLoader| w.new_normal("weight", &[1, hidden], 1.0 / (hidden as f64 + 1.0));
        // The language model's head is dropped on purpose.
        Self::load(dir, config, device, kind, score, |n| crate::weights::ignorable(n) || n == "lm_head.weight")
    }

    /// The backbone of `dir`'s checkpoint, the `score` head `score` makes from the `score` scope,
    /// and the parts carried through; every other tensor must be used or `ignorable`.
    fn load(
        dir: &Path,
        config: ModelConfig,
        device: Device,
        kind: Kind,
        score: impl FnOnce(&WeightLoader) -> Result<Tensor>,
        ignorable: impl Fn(&str) -> bool,
    ) -> Result<Self> {
        let ckpt = Checkpoint::from_dir(dir)?;
        let mut config = config;
        config.match_checkpoint(&ckpt);
        let vs = new_var_store(device, kind);
        let w = WeightLoader::new(&ckpt, &vs, kind);
        let backbone = Backbone::load(&w, &config.arch)?;
        let vision = VisionTower::load_for(&w, &config.arch)?;
        let score = score(&w.pp("score"))?;
        let passthrough = passthrough(&ckpt, &config.arch, vision.is_some());
        ckpt.check_all_used(ignorable)?;
        Ok(ScalarHeadModel {
            vs,
            config,
            backbone,
            vision,
            score,
            source_dir: dir.to_path_buf(),
            passthrough,
            training: Arc::default(),
            gate: None,
        })
    }

    /// Device of the parameters.
    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Floating dtype of the parameters.
    pub fn kind(&self) -> Kind {
        self.vs.kind()
    }

    /// The resolved architecture.
    pub fn arch(&self) -> &ArchConfig {
        &self.config.arch
    }

    /// Stops gradient tracking on every parameter.
    pub fn freeze(&mut self) {
        self.vs.freeze();
    }

    /// Per-token scalar outputs (critic values), in fp32.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch, seq]`
    pub fn values(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        check_ids(input_ids, attention_mask)?;
        let pos = position_ids_from_mask(attention_mask)?;
        let h = self.backbone.forward(input_ids, &pos, attention_mask, None, &self.gate)?;
        self.head(&h)
    }

    /// The score head on hidden states: `[..., hidden]` → `[...]` (fp32).
    fn head(&self, h: &Tensor) -> Result<Tensor> {
        Ok(h.f_linear::<&Tensor>(&self.score, None)?.f_squeeze_dim(-1)?.f_to_kind(Kind::Float)?)
    }

    /// [`ScalarHeadModel::values`] from a checkpointed pass of the backbone (see
    /// [`CausalLm::hidden_states_checkpointed`]); after the loss has been backpropagated, hand the
    /// pass to [`ScalarHeadModel::backward_checkpointed`].
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch, seq]`
    pub fn values_checkpointed(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<(Tensor, Checkpointed)> {
        check_ids(input_ids, attention_mask)?;
        let pos = position_ids_from_mask(attention_mask)?;
        let ck = checkpointing::forward(&self.backbone, &self.gate, (input_ids, &pos, attention_mask), None)?;
        Ok((self.head(ck.hidden())?, ck))
    }

    /// The vision tower, where this model reads images.
    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }

    /// Stops (or restarts) gradient tracking on the vision tower's parameters; returns how many
    /// there are.
    pub fn set_vision_trainable(&self, trainable: bool) -> usize {
        let params = self.vision.as_ref().map(VisionTower::parameters).unwrap_or_default();
        for p in &params {
            let _ = p.shallow_clone().set_requires_grad(trainable);
        }
        params.len()
    }

    /// [`ScalarHeadModel::values_pass`] of sequences whose placeholders — where `slots` allows —
    /// hold `images` (see [`crate::CausalLm::visual`]): their features in place of the
    /// placeholders, every token at its multimodal position.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch, seq]`
    pub fn values_pass_with_images(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        images: &Images,
        slots: crate::multimodal::Slots,
        checkpointed: bool,
    ) -> Result<(Tensor, Option<Checkpointed>)> {
        check_ids(input_ids, attention_mask)?;
        let tower = self.vision.as_ref().ok_or_else(|| {
            ModelError::Input(format!("model_type `{}` reads no images", self.config.arch.family.model_type()))
        })?;
        let (pos, _) = crate::multimodal::image_positions(tower, input_ids, attention_mask, &images.grids, &slots)?;
        let out = crate::multimodal::tower_features(
            tower,
            &self.gate,
            self.config.arch.hidden_size,
            (self.kind(), self.device()),
            images,
        )?;
        let visual = Visual { features: out.features, deepstack: out.deepstack, slots };
        if checkpointed {
            let ck =
                checkpointing::forward(&self.backbone, &self.gate, (input_ids, &pos, attention_mask), Some(&visual))?;
            return Ok((self.head(ck.hidden())?, Some(ck)));
        }
        let routing = crate::backbone::Routing::Off;
        let (h, _) = self.backbone.run(input_ids, &pos, attention_mask, None, &self.gate, routing, Some(&visual))?;
        Ok((self.head(&h)?, None))
    }

    /// [`ScalarHeadModel::values_checkpointed`] when `checkpointed`, else
    /// [`ScalarHeadModel::values`] (with no pass to hand back).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch, seq]`
    pub fn values_pass(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        checkpointed: bool,
    ) -> Result<(Tensor, Option<Checkpointed>)> {
        if checkpointed {
            let (v, ck) = self.values_checkpointed(input_ids, attention_mask)?;
            return Ok((v, Some(ck)));
        }
        Ok((self.values(input_ids, attention_mask)?, None))
    }

    /// [`ScalarHeadModel::values_pass`] padding-free ([`crate::packing`]): the backbone and the
    /// head run on the rows packed without their padding, the values are put back in the batch's
    /// layout — the padded pass's values at the real tokens within float rounding, 0 at the
    /// padding. With `shared_prompt = Some(p)`, rows that share their first `p` tokens (GRPO's or
    /// PPO's samples of one prompt) have them laid once in a packed row where the model attends by
    /// the mask alone ([`crate::Packing::sharing`], [`crate::CausalLm::packs_shared_prompts`]).
    /// The padded pass where packing saves no row.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch, seq]`; `p < seq`
    pub fn values_pass_packed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        checkpointed: bool,
        shared_prompt: Option<i64>,
    ) -> Result<(Tensor, Option<Checkpointed>)> {
        check_ids(input_ids, attention_mask)?;
        let seq = input_ids.size()[1];
        let router_aux = self.config.arch.moe.as_ref().is_some_and(|m| m.aux_loss_coef.is_some());
        let prefix = match shared_prompt {
            Some(p) if self.backbone.packs_shared_prompts(seq, router_aux) && p >= 1 && p < seq => {
                Some(crate::SharedPrefixes::find(input_ids, attention_mask, p)?)
                    .filter(crate::SharedPrefixes::any_shared)
            }
            _ => None,
        };
        let shares = |width: i64| self.backbone.packs_shared_prompts(width, router_aux);
        let cost = crate::PassCost::of(&self.config.arch);
        let packing = crate::Packing::cheapest(input_ids, attention_mask, prefix.as_ref(), seq, &shares, cost)?;
        tracing::debug!(
            "values pass of {} rows × {seq}: packed {}",
            input_ids.size()[0],
            packing.as_ref().map_or("None".to_string(), |p| format!("Some({} rows × {})", p.rows(), p.width()))
        );
        let Some(p) = packing else {
            return self.values_pass(input_ids, attention_mask, checkpointed);
        };
        // [rows, width, h] → [rows, width, 1] → [batch, seq]
        let values =
            |h: &Tensor| -> Result<Tensor> { Ok(p.unpack(&self.head(h)?.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?) };
        if checkpointed {
            let ck = checkpointing::forward(&self.backbone, &self.gate, (&p.ids, &p.positions, &p.mask), None)?;
            return Ok((values(ck.hidden())?, Some(ck)));
        }
        let h = self.backbone.forward(&p.ids, &p.positions, &p.mask, None, &self.gate)?;
        Ok((values(&h)?, None))
    }

    /// See [`CausalLm::set_gate`].
    pub fn set_gate(&mut self, gate: crate::gate::Gate) {
        if gate.is_some() {
            self.backbone.release_buffers();
            crate::gate::return_freed_memory();
        }
        self.gate = gate;
    }

    /// See [`CausalLm::backward_checkpointed`].
    pub fn backward_checkpointed(&self, ck: &Checkpointed) -> Result<()> {
        checkpointing::backward(&self.backbone, ck)
    }

    /// One score per sequence, read at its last non-pad token (works for left and right padding).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]` → `[batch]`
    pub fn scores(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let values = self.values(input_ids, attention_mask)?;
        let last = last_token_index(attention_mask)?;
        Ok(values.f_gather(1, &last.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?)
    }

    /// [`ScalarHeadModel::scores`] of right-padded rows whose first `shared_prompt` columns
    /// several rows may hold alike (a prompt's samples, left-padded in those columns), in the
    /// layout of the fewest forward FLOPs ([`crate::PassCost`]): packed padding-free, each shared
    /// prompt laid once where the model attends by the mask alone ([`crate::Packing::cheapest`]);
    /// each shared prompt computed once and the rest of every row on top of its keys and values
    /// ([`crate::CausalLm::hidden_states_after_prefix`]); or the rows as they are. The same
    /// scores within float rounding. Every row must have a real token after column
    /// `shared_prompt`. Reads the mask back to the host.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`, `shared_prompt < seq` → `[batch]`
    pub fn scores_sharing(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        shared_prompt: Option<i64>,
    ) -> Result<Tensor> {
        check_ids(input_ids, attention_mask)?;
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let last = last_token_index(attention_mask)?; // [batch]
        let prefix = match shared_prompt.filter(|p| (1..seq).contains(p)) {
            Some(p) if last.f_min()?.f_int64_value(&[])? < p => {
                return Err(ModelError::Input(format!("a row ends within its first {p} (shared) columns")));
            }
            Some(p) => Some(crate::SharedPrefixes::find(input_ids, attention_mask, p)?)
                .filter(crate::SharedPrefixes::any_shared),
            None => None,
        };
        let cost = crate::PassCost::of(&self.config.arch);
        let shares = |width: i64| self.backbone.packs_shared_prompts(width, false);
        let packing = crate::Packing::cheapest(input_ids, attention_mask, prefix.as_ref(), seq, &shares, cost)?;
        let packed_cost = packing.as_ref().map(|p| cost.rows(p.rows(), p.width()));
        let prefix_cost = prefix.as_ref().map(|p| cost.shared_prefix(p.first.len() as i64, p.len, batch, seq));
        tracing::debug!(
            "scores of {batch} rows × {seq}: packed {:?}, shared prompts {:?}, padded {:.3e} FLOP",
            packing.as_ref().map(|p| (p.rows(), p.width(), cost.rows(p.rows(), p.width()))),
            prefix.as_ref().map(|p| (p.first.len(), p.len, prefix_cost)),
            cost.rows(batch, seq)
        );
        // [batch, n] values → each row's value at column `last − from`: [batch]
        let at = |values: &Tensor, from: i64| -> Result<Tensor> {
            Ok(values.f_gather(1, &last.f_sub_scalar(from)?.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?)
        };
        match (packing, prefix) {
            (Some(p), _) if prefix_cost.is_none_or(|c| packed_cost.is_some_and(|pc| pc <= c)) => {
                let h = self.backbone.forward(&p.ids, &p.positions, &p.mask, None, &self.gate)?; // [rows, width, h]
                let values = p.unpack(&self.head(&h)?.f_unsqueeze(-1)?)?.f_squeeze_dim(-1)?; // [batch, seq]
                at(&values, 0)
            }
            (_, Some(prefix)) => {
                let ids_mask = (input_ids, attention_mask);
                let (h, _) =
                    crate::prefix::backbone_after_prefix(&self.backbone, &self.gate, ids_mask, &prefix, false)?;
                at(&self.head(&h)?, prefix.len - 1) // [batch, seq − p + 1] → [batch]
            }
            _ => self.scores(input_ids, attention_mask),
        }
    }

    /// Adds LoRA adapters to the targeted backbone layers and freezes every other weight except
    /// the `score` head; a no-op when `cfg.rank == 0`. Returns the number of adapted layers.
    pub fn apply_lora(&mut self, cfg: &LoraConfig) -> Result<usize> {
        let prefix = self.config.arch.backbone_prefix();
        adapters::check_targets(&self.backbone, prefix, cfg)?;
        let off = Arc::default();
        let n = adapters::apply(&self.vs, self.backbone.linears_mut(prefix), cfg, &["score."], &self.training, &off)?;
        Ok(n + adapters::apply_stacked(&self.vs, self.backbone.stacked_mut(prefix), cfg, &off)?)
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

    /// Saves in the `*ForSequenceClassification` layout (`num_labels = 1`, `score.weight`), LoRA
    /// merged.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let arch = self.config.arch.sequence_classification_architecture();
        let pad = self.config.arch.pad_token_id.map(Value::from).unwrap_or_else(|| {
            // transformers needs a pad id to find the last token of a padded batch.
            let text = self.config.raw.get("text_config");
            let eos = self.config.raw.get("eos_token_id").or(text.and_then(|t| t.get("eos_token_id")));
            let eos = eos.cloned().unwrap_or(Value::from(0));
            match eos {
                Value::Array(a) => a.first().cloned().unwrap_or(Value::from(0)),
                v => v,
            }
        });
        let overrides = [
            ("architectures", serde_json::json!([arch])),
            ("num_labels", Value::from(1)),
            ("id2label", serde_json::json!({"0": "LABEL_0"})),
            ("label2id", serde_json::json!({"LABEL_0": 0})),
            ("pad_token_id", pad.clone()),
        ];
        let prefix = self.config.arch.backbone_prefix();
        let mut merged = adapters::merged_weights(self.backbone.linears(prefix))?;
        merged.extend(adapters::merged_stacked(self.backbone.stacked(prefix))?);
        // transformers reads a multimodal classifier's pad id from its text config.
        let mut raw = saved_config(&self.config);
        if let Some(text) = raw.get_mut("text_config").and_then(Value::as_object_mut) {
            text.insert("pad_token_id".into(), pad);
        }
        save_dir(
            dir,
            &self.source_dir,
            &raw,
            self.kind(),
            &overrides,
            &self.vs,
            merged,
            &self.passthrough,
            DEFAULT_MAX_SHARD_BYTES,
        )
    }
}

/// Index of the last 1 in each row of a mask.
///
/// # Shapes
/// - `mask`: `[batch, seq]` → `[batch]` (int64)
pub fn last_token_index(mask: &Tensor) -> Result<Tensor> {
    let seq = mask.size()[1];
    let idx = Tensor::f_arange(seq, (Kind::Int64, mask.device()))?;
    Ok(mask.f_to_kind(Kind::Int64)?.f_mul(&idx)?.f_argmax(-1, false)?)
}
