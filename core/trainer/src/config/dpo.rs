//! `rlhf dpo`: its sections (`[run]`, `[model]` with the reference and `model.lora`, `[data]` as
//! `rlhf rm`, `[train]` with the preference loss, `[checkpoint]`, `[wandb]`) and loading with
//! range checks. The loop is
//! [`crate::supervised::dpo`].

use rlhf_models::LoraConfig;
use serde::{Deserialize, Serialize};

use super::phases::{validate_phase, PhaseRunConfig, PhaseTrainConfig, RmDataConfig, PHASE_PRESETS};
use super::{load_layered_figment, CheckpointConfig, ConfigSource, KeySource};
use crate::error::Result;
use crate::optim::Schedule;

/// The preference loss (`train.loss_type`, TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpoLossType {
    /// DPO (TRL `DPOTrainer` `loss_type="sigmoid"`); with `label_smoothing` > 0, cDPO.
    #[default]
    Sigmoid,
    /// IPO (TRL `loss_type="ipo"`), on log-probs averaged over the response tokens as TRL does.
    Ipo,
    /// SimPO (TRL `CPOTrainer` `loss_type="simpo"`, `cpo_alpha = 0`): reference-free,
    /// length-normalised, margin `simpo_gamma`.
    Simpo,
}

/// `[model]` of `rlhf dpo`: the policy's starting checkpoint and the reference.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoModelConfig {
    /// Hugging Face causal-LM directory (usually the SFT output), or `builtin:tiny`.
    pub path: String,
    /// `policy` (the starting weights, the default: a frozen copy, or with LoRA the policy with
    /// its adapters switched off), `precomputed` (the starting policy's log-probs of every pair,
    /// computed once before training), or a model directory. Unused by `simpo`.
    pub reference: String,
    /// LoRA adapters on the policy (`rank = 0`: full fine-tuning); the saved model has them merged.
    pub lora: LoraConfig,
}

impl Default for DpoModelConfig {
    fn default() -> Self {
        DpoModelConfig { path: "builtin:tiny".into(), reference: "policy".into(), lora: LoraConfig::default() }
    }
}

/// `[train]` of `rlhf dpo`: the keys of [`PhaseTrainConfig`] plus the loss. (Written out rather
/// than `#[serde(flatten)]`, which serde does not combine with `deny_unknown_fields`.)
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoTrainConfig {
    /// `sigmoid` (DPO, the default), `ipo` or `simpo`.
    pub loss_type: DpoLossType,
    /// β: the strength of the implicit KL penalty (TRL default 0.1).
    pub beta: f64,
    /// ε of cDPO / conservative SimPO (`sigmoid`, `simpo`); 0 = plain DPO.
    pub label_smoothing: f64,
    /// SimPO's target reward margin γ (TRL `CPOConfig.simpo_gamma`; the SimPO repository's
    /// `gamma_beta_ratio` is `simpo_gamma / beta`).
    pub simpo_gamma: f64,
    pub epochs: usize,
    /// Pairs per forward pass (2 × this many sequences).
    pub batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub adam_betas: (f64, f64),
    pub adam_eps: f64,
    pub warmup_steps: usize,
    pub schedule: Schedule,
    pub max_grad_norm: f64,
    pub steps: usize,
    pub eval_every: usize,
    pub eval_batch_size: usize,
    pub gradient_checkpointing: bool,
    /// Run the policy's and the reference's passes padding-free (TRL's `padding_free`): each
    /// batch's chosen and rejected rows without their padding, packed into as few rows of the
    /// batch's width as hold them, every sequence attending only to itself — the padded passes'
    /// log-probs and gradients within float rounding.
    pub padding_free: bool,
    /// With `padding_free`: each pair's prompt laid once, its chosen and rejected answers after
    /// it each seeing the prompt and itself (and one copy for all pairs of the same prompt), where
    /// the model attends by the mask alone; the same numbers within float rounding. Off with LoRA
    /// dropout (a prompt's activations then differ from row to row).
    pub share_prompts: bool,
}

impl Default for DpoTrainConfig {
    fn default() -> Self {
        let c = PhaseTrainConfig::default();
        DpoTrainConfig {
            loss_type: DpoLossType::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
            simpo_gamma: 0.5,
            epochs: c.epochs,
            batch_size: c.batch_size,
            gradient_accumulation_steps: c.gradient_accumulation_steps,
            lr: c.lr,
            weight_decay: c.weight_decay,
            adam_betas: c.adam_betas,
            adam_eps: c.adam_eps,
            warmup_steps: c.warmup_steps,
            schedule: c.schedule,
            max_grad_norm: c.max_grad_norm,
            steps: c.steps,
            eval_every: c.eval_every,
            eval_batch_size: c.eval_batch_size,
            gradient_checkpointing: c.gradient_checkpointing,
            padding_free: false,
            share_prompts: true,
        }
    }
}

impl DpoTrainConfig {
    /// The loop settings.
    pub fn common(&self) -> PhaseTrainConfig {
        PhaseTrainConfig {
            epochs: self.epochs,
            batch_size: self.batch_size,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            lr: self.lr,
            weight_decay: self.weight_decay,
            adam_betas: self.adam_betas,
            adam_eps: self.adam_eps,
            warmup_steps: self.warmup_steps,
            schedule: self.schedule,
            max_grad_norm: self.max_grad_norm,
            steps: self.steps,
            eval_every: self.eval_every,
            eval_batch_size: self.eval_batch_size,
            gradient_checkpointing: self.gradient_checkpointing,
        }
    }
}

/// The whole `rlhf dpo` configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    pub run: PhaseRunConfig,
    pub model: DpoModelConfig,
    /// The pairs, read as `rlhf rm` reads them.
    pub data: RmDataConfig,
    pub train: DpoTrainConfig,
    pub checkpoint: CheckpointConfig,
    pub distributed: super::DistributedConfig,
    pub wandb: rlhf_wandb::WandbConfig,
    pub tensorboard: crate::tensorboard::TensorboardConfig,
}

impl DpoConfig {
    /// Loads base (file or the embedded `dpo` preset), `RLHF_*` variables and `--set` overrides, and
    /// validates.
    pub fn load(source: &ConfigSource, sets: &[String]) -> Result<Self> {
        let (mut cfg, fig): (DpoConfig, _) =
            load_layered_figment(source, PHASE_PRESETS, sets, super::aliases::SUPERVISED)?;
        let label = match source {
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Preset(n) => format!("preset {n}"),
        };
        let src = KeySource { fig: &fig, base: &label };
        let common = cfg.train.common();
        validate_phase(&src, &common, &cfg.model.lora, &cfg.checkpoint, &cfg.distributed, cfg.data.max_len)?;
        super::check_shared(&src, &cfg.data.columns(), &cfg.tensorboard)?;
        let lora = &cfg.model.lora;
        let dropout = if lora.rank > 0 { lora.dropout } else { 0.0 };
        cfg.distributed.apply_to_checkpointing(&src, &mut cfg.train.gradient_checkpointing, dropout)?;
        let t = &cfg.train;
        if !(t.beta.is_finite() && t.beta > 0.0) {
            return Err(src.error("train.beta", "must be > 0"));
        }
        if !(0.0..0.5).contains(&t.label_smoothing) {
            return Err(src.error("train.label_smoothing", "must be in [0, 0.5)"));
        }
        if t.label_smoothing > 0.0 && t.loss_type == DpoLossType::Ipo {
            return Err(src.error("train.label_smoothing", "applies to `sigmoid` and `simpo`, not `ipo`"));
        }
        if !t.simpo_gamma.is_finite() {
            return Err(src.error("train.simpo_gamma", "must be finite"));
        }
        if cfg.model.reference.trim().is_empty() {
            return Err(src.error("model.reference", "`policy`, `precomputed` or a model directory"));
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_loads_and_checks_ranges() {
        let c = DpoConfig::load(&ConfigSource::Preset("dpo".into()), &[]).unwrap();
        assert_eq!((c.train.loss_type, c.data.train.as_str()), (DpoLossType::Sigmoid, "builtin:addition-pairs"));
        let c = DpoConfig::load(&ConfigSource::Preset("dpo".into()), &["train.loss_type=\"simpo\"".into()]).unwrap();
        assert_eq!(c.train.loss_type, DpoLossType::Simpo);
        for (set, key) in [
            ("train.beta=0", "train.beta"),
            ("train.label_smoothing=0.5", "train.label_smoothing"),
            ("train.loss_type=\"hinge\"", "train.loss_type"),
        ] {
            let e = DpoConfig::load(&ConfigSource::Preset("dpo".into()), &[set.into()]).unwrap_err();
            assert!(e.to_string().contains(key), "{set}: {e}");
        }
        let e = DpoConfig::load(
            &ConfigSource::Preset("dpo".into()),
            &["train.loss_type=\"ipo\"".into(), "train.label_smoothing=0.1".into()],
        )
        .unwrap_err();
        assert!(e.to_string().contains("not `ipo`"), "{e}");
    }
}
