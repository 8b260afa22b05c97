//! `rlhf sft` and `rlhf rm` (`rlhf dpo` reuses these in `dpo.rs`): their sections (`[run]`,
//! `[model]` with `model.lora`, `[data]`, `[train]`, `[checkpoint]`, `[wandb]`), the embedded
//! presets, and loading with range checks. The keys are named as `rlhf train` names them (the old
//! names are aliases, [`super::aliases::SUPERVISED`]). The loops are in [`crate::supervised`].

use std::path::PathBuf;

use rlhf_models::LoraConfig;
use serde::{Deserialize, Serialize};

use super::{load_layered_figment, CheckpointConfig, ConfigSource, KeySource};
use crate::error::{Result, TrainerError};
use crate::optim::{OptimConfig, Schedule};

/// `[run]`: seed, run directory, device and dtype.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PhaseRunConfig {
    /// Seeds libtorch (the fresh score head) and the data order.
    pub seed: u64,
    /// Run directory (metrics.jsonl, config.toml, checkpoints, the final model); default
    /// `runs/<phase>-<unix time>`.
    pub run_dir: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: String,
    /// `f32` or `bf16`.
    pub dtype: String,
}

impl Default for PhaseRunConfig {
    fn default() -> Self {
        PhaseRunConfig { seed: 42, run_dir: None, device: "cpu".into(), dtype: "f32".into() }
    }
}

/// `[model]`: the starting checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PhaseModelConfig {
    /// Hugging Face causal-LM directory, or `builtin:tiny` (the embedded tiny Llama, random weights).
    pub path: String,
    /// LoRA adapters (`rank = 0`: full fine-tuning); the saved model has them merged (RM: the score
    /// head always trains). Was the top-level `[lora]`.
    pub lora: LoraConfig,
}

impl Default for PhaseModelConfig {
    fn default() -> Self {
        PhaseModelConfig { path: "builtin:tiny".into(), lora: LoraConfig::default() }
    }
}

/// What happens to an example longer than `data.max_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    /// Keep the first `max_len` tokens (DeepSpeed-Chat's `truncation=True`); counted and reported.
    #[default]
    Truncate,
    /// Skip the example; counted and reported.
    Drop,
}

/// `[train]`: the optimisation loop.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PhaseTrainConfig {
    /// Passes over the training data.
    pub epochs: usize,
    /// Sequences (SFT) or pairs (RM) per forward pass.
    pub batch_size: usize,
    /// Forward passes per optimizer step (the effective batch is `batch_size ×
    /// gradient_accumulation_steps`; was `grad_accum`).
    pub gradient_accumulation_steps: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub adam_betas: (f64, f64),
    pub adam_eps: f64,
    /// Optimizer steps of linear warm-up.
    pub warmup_steps: usize,
    /// After warm-up: `constant`, `linear` or `cosine` decay to 0 at the last step.
    pub schedule: Schedule,
    /// Gradient-norm clip (0 disables).
    pub max_grad_norm: f64,
    /// Stop after this many optimizer steps (0 = run every epoch; was `max_steps`).
    pub steps: usize,
    /// Evaluate every N optimizer steps (0 = only before training and at the end).
    pub eval_every: usize,
    /// Sequences (SFT) or pairs (RM) per forward pass during evaluation.
    pub eval_batch_size: usize,
    /// Activation checkpointing per decoder layer of the trained model (transformers'
    /// `gradient_checkpointing`): only each layer's input is kept through the forward, each layer
    /// is recomputed in backward; the same gradients bit for bit, for one more forward.
    pub gradient_checkpointing: bool,
}

impl Default for PhaseTrainConfig {
    fn default() -> Self {
        PhaseTrainConfig {
            epochs: 1,
            batch_size: 8,
            gradient_accumulation_steps: 1,
            lr: 1e-5,
            weight_decay: 0.0,
            adam_betas: (0.9, 0.95),
            adam_eps: 1e-8,
            warmup_steps: 0,
            // As `rlhf train`: the same default for every phase.
            schedule: Schedule::Constant,
            max_grad_norm: 1.0,
            steps: 0,
            eval_every: 0,
            eval_batch_size: 16,
            gradient_checkpointing: false,
        }
    }
}

impl PhaseTrainConfig {
    /// Range checks; errors name the key and where its value came from.
    pub fn validate(&self, src: &crate::config::KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(&format!("train.{key}"), msg));
        if self.epochs == 0 {
            return bad("epochs", "must be >= 1");
        }
        if self.batch_size == 0 {
            return bad("batch_size", "must be >= 1");
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("gradient_accumulation_steps", "must be >= 1");
        }
        if self.eval_batch_size == 0 {
            return bad("eval_batch_size", "must be >= 1");
        }
        if let Err((setting, msg)) = self.optim().check() {
            let key = match setting {
                "betas" => "adam_betas",
                "eps" => "adam_eps",
                other => other,
            };
            return bad(key, msg);
        }
        Ok(())
    }

    /// The optimizer settings of this section.
    pub fn optim(&self) -> OptimConfig {
        OptimConfig {
            lr: self.lr,
            betas: self.adam_betas,
            eps: self.adam_eps,
            weight_decay: self.weight_decay,
            schedule: self.schedule,
            warmup_steps: self.warmup_steps,
            max_grad_norm: self.max_grad_norm,
        }
    }
}

/// Checkpointing recomputes each layer's forward in backward, which must draw the same numbers:
/// refused with LoRA dropout.
pub fn check_checkpointing(src: &KeySource, checkpointing: bool, lora: &LoraConfig) -> Result<()> {
    if checkpointing && lora.rank > 0 && lora.dropout > 0.0 {
        let msg = "needs model.lora.dropout = 0 (the recomputed forward would draw other dropout masks)";
        return Err(src.error("train.gradient_checkpointing", msg));
    }
    Ok(())
}

/// `model.lora`'s range checks, the error naming the key and where its value came from.
pub fn validate_lora(src: &KeySource, key: &str, lora: &LoraConfig) -> Result<()> {
    if let Err(e) = lora.validate() {
        let msg = e.to_string();
        let msg = msg.trim_start_matches("invalid input: lora");
        let field = msg.trim_start_matches('.').split(':').next().unwrap_or("");
        return Err(TrainerError::Config(format!("{}: {key}{msg}", src.of(&format!("{key}.{field}")))));
    }
    Ok(())
}

/// The checks every supervised phase makes after loading: `[train]`, `model.lora`,
/// checkpointing with dropout, `[distributed]`, `[checkpoint]` and `data.max_len`.
pub fn validate_phase(
    src: &KeySource,
    train: &PhaseTrainConfig,
    lora: &LoraConfig,
    checkpoint: &CheckpointConfig,
    distributed: &super::DistributedConfig,
    max_len: usize,
) -> Result<()> {
    train.validate(src)?;
    validate_lora(src, "model.lora", lora)?;
    check_checkpointing(src, train.gradient_checkpointing, lora)?;
    distributed.validate(src)?;
    if checkpoint.keep == 0 {
        return Err(src.error("checkpoint.keep", "must be >= 1"));
    }
    if max_len < 2 {
        return Err(src.error("data.max_len", "must be >= 2"));
    }
    Ok(())
}

/// A LoRA config or application error as a config error (`{label}: lora.rank: must be >= 0`).
pub fn lora_error(label: &str, e: rlhf_models::ModelError) -> TrainerError {
    match e {
        rlhf_models::ModelError::Input(m) => TrainerError::Config(format!("{label}: {m}")),
        other => TrainerError::Config(format!("{label}: lora: {other}")),
    }
}

/// Which assistant turns of a conversation are trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AssistantTurns {
    #[default]
    All,
    Last,
}

/// The pairwise ranking loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RmLoss {
    /// DeepSpeed-Chat's divergent-segment mean.
    #[default]
    Dsc,
    /// One term per pair at the last tokens.
    LastToken,
}

/// `[data]` of `rlhf sft`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftDataConfig {
    /// JSONL or Parquet (a file, a directory of `*.parquet` or a `*` glob) with `prompt`/`response`
    /// or chat `messages`; or `builtin:addition-sft`.
    pub train: String,
    /// A separate eval JSONL (or a built-in: its held-out split); unset: `eval_fraction` when > 0,
    /// else a built-in train set's held-out split.
    pub eval: Option<String>,
    /// Fraction of the train lines held out for evaluation when `eval` is unset (0 = none).
    pub eval_fraction: f64,
    /// Tokens per example (and per packed row).
    pub max_len: usize,
    /// `truncate` (keep the first `max_len` tokens) or `drop`.
    pub overlong: Overlong,
    /// Render prompt/response through the chat template when the tokenizer has one (else raw text).
    pub apply_chat_template: bool,
    /// Extra variables for the chat template, as transformers' `apply_chat_template(**kwargs)`
    /// (Qwen3's `enable_thinking = false`, say).
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Train on the prompt tokens too.
    pub loss_on_prompt: bool,
    /// `all` assistant turns of a conversation, or the `last`.
    pub assistant_turns: AssistantTurns,
    /// Concatenate examples into rows of up to `max_len` tokens (see `sft_data`).
    pub packing: bool,
    /// The columns (JSONL fields) holding the prompt, the response and the chat messages.
    pub prompt_key: String,
    pub response_key: String,
    pub messages_key: String,
}

impl SftDataConfig {
    /// The column mapping of `prompt_key`, `response_key`, `messages_key`.
    pub fn columns(&self) -> crate::tabular::Columns {
        crate::tabular::Columns::new(&[
            ("prompt", "prompt_key", &self.prompt_key),
            ("response", "response_key", &self.response_key),
            ("messages", "messages_key", &self.messages_key),
        ])
        .requiring(&[&["prompt", "response"], &["messages"]])
    }
}

impl Default for SftDataConfig {
    fn default() -> Self {
        SftDataConfig {
            train: "builtin:addition-sft".into(),
            eval: None,
            eval_fraction: 0.0,
            max_len: 512,
            overlong: Overlong::Truncate,
            apply_chat_template: true,
            chat_template_kwargs: serde_json::Map::new(),
            loss_on_prompt: false,
            assistant_turns: AssistantTurns::All,
            packing: false,
            prompt_key: "prompt".into(),
            response_key: "response".into(),
            messages_key: "messages".into(),
        }
    }
}

/// The whole `rlhf sft` configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    pub run: PhaseRunConfig,
    pub model: PhaseModelConfig,
    pub data: SftDataConfig,
    pub train: PhaseTrainConfig,
    pub checkpoint: CheckpointConfig,
    pub distributed: super::DistributedConfig,
    pub wandb: rlhf_wandb::WandbConfig,
    pub tensorboard: crate::tensorboard::TensorboardConfig,
}

/// The embedded presets of the supervised phases (`configs/sft.toml`, `configs/rm.toml`,
/// `configs/dpo.toml`).
pub const PHASE_PRESETS: &[(&str, &str)] = &[
    ("sft", include_str!("../../../../configs/sft.toml")),
    ("rm", include_str!("../../../../configs/rm.toml")),
    ("dpo", include_str!("../../../../configs/dpo.toml")),
];

impl SftConfig {
    /// Loads base (file or the embedded `sft` preset), `RLHF_*` variables and `--set` overrides, and
    /// validates.
    pub fn load(source: &ConfigSource, sets: &[String]) -> Result<Self> {
        let (mut cfg, fig): (SftConfig, _) =
            load_layered_figment(source, PHASE_PRESETS, sets, super::aliases::SUPERVISED)?;
        let label = match source {
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Preset(n) => format!("preset {n}"),
        };
        let src = KeySource { fig: &fig, base: &label };
        validate_phase(&src, &cfg.train, &cfg.model.lora, &cfg.checkpoint, &cfg.distributed, cfg.data.max_len)?;
        super::check_shared(&src, &cfg.data.columns(), &cfg.tensorboard)?;
        let lora = &cfg.model.lora;
        let dropout = if lora.rank > 0 { lora.dropout } else { 0.0 };
        cfg.distributed.apply_to_checkpointing(&src, &mut cfg.train.gradient_checkpointing, dropout)?;
        Ok(cfg)
    }
}

/// `[data]` of `rlhf rm`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmDataConfig {
    /// JSONL or Parquet of `prompt`/`chosen`/`rejected` (text or chat lists); or
    /// `builtin:addition-pairs`.
    pub train: String,
    /// A separate eval JSONL (or a built-in: its held-out split); unset: `eval_fraction` when > 0,
    /// else a built-in train set's held-out split.
    pub eval: Option<String>,
    /// Fraction of the train lines held out for evaluation when `eval` is unset (0 = none).
    pub eval_fraction: f64,
    /// Tokens per side of a pair.
    pub max_len: usize,
    /// `truncate` (keep the first `max_len` tokens of both sides, as DSC) or `drop`.
    pub overlong: Overlong,
    /// Render through the chat template when the tokenizer has one (else `prompt + response`).
    pub apply_chat_template: bool,
    /// Extra variables for the chat template, as transformers' `apply_chat_template(**kwargs)`
    /// (Qwen3's `enable_thinking = false`, say).
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Append EOS to every side (DSC appends its end-of-conversation token). Off by default: the
    /// `reward-model` plugin scores the text as is, and training should see what scoring sees.
    pub append_eos: bool,
    /// The columns (JSONL fields) holding the prompt and the two responses.
    pub prompt_key: String,
    pub chosen_key: String,
    pub rejected_key: String,
}

impl RmDataConfig {
    /// The column mapping of `prompt_key`, `chosen_key`, `rejected_key`.
    pub fn columns(&self) -> crate::tabular::Columns {
        crate::tabular::Columns::new(&[
            ("prompt", "prompt_key", &self.prompt_key),
            ("chosen", "chosen_key", &self.chosen_key),
            ("rejected", "rejected_key", &self.rejected_key),
        ])
        .requiring(&[&["chosen", "rejected"]])
    }
}

impl Default for RmDataConfig {
    fn default() -> Self {
        RmDataConfig {
            train: "builtin:addition-pairs".into(),
            eval: None,
            eval_fraction: 0.0,
            max_len: 512,
            overlong: Overlong::Truncate,
            apply_chat_template: true,
            chat_template_kwargs: serde_json::Map::new(),
            append_eos: false,
            prompt_key: "prompt".into(),
            chosen_key: "chosen".into(),
            rejected_key: "rejected".into(),
        }
    }
}

/// `[train]` of `rlhf rm`: the keys of [`PhaseTrainConfig`] plus the loss. (Written out rather
/// than `#[serde(flatten)]`, which serde does not combine with `deny_unknown_fields`.)
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmTrainConfig {
    /// `dsc` (divergent-segment mean, the default) or `last_token`.
    pub loss: RmLoss,
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
    /// Run the pairs padding-free (OpenRLHF's `--packing_samples`): each batch's chosen and
    /// rejected rows without their padding, packed into as few rows as hold them, every sequence
    /// attending only to itself — the padded pass's scores and gradients within float rounding.
    /// Needs `loss = "last_token"`: DeepSpeed-Chat's loss also reads the shorter side's padding.
    pub padding_free: bool,
}

impl Default for RmTrainConfig {
    fn default() -> Self {
        let c = PhaseTrainConfig::default();
        RmTrainConfig {
            loss: RmLoss::Dsc,
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
        }
    }
}

impl RmTrainConfig {
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

/// The whole `rlhf rm` configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmConfig {
    pub run: PhaseRunConfig,
    /// The causal LM the backbone comes from (usually the SFT output).
    pub model: PhaseModelConfig,
    pub data: RmDataConfig,
    pub train: RmTrainConfig,
    pub checkpoint: CheckpointConfig,
    pub distributed: super::DistributedConfig,
    pub wandb: rlhf_wandb::WandbConfig,
    pub tensorboard: crate::tensorboard::TensorboardConfig,
}

impl RmConfig {
    /// Loads base (file or the embedded `rm` preset), `RLHF_*` variables and `--set` overrides, and
    /// validates.
    pub fn load(source: &ConfigSource, sets: &[String]) -> Result<Self> {
        let (mut cfg, fig): (RmConfig, _) =
            load_layered_figment(source, PHASE_PRESETS, sets, super::aliases::SUPERVISED)?;
        let label = match source {
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Preset(n) => format!("preset {n}"),
        };
        let src = KeySource { fig: &fig, base: &label };
        let common = cfg.train.common();
        validate_phase(&src, &common, &cfg.model.lora, &cfg.checkpoint, &cfg.distributed, cfg.data.max_len)?;
        super::check_shared(&src, &cfg.data.columns(), &cfg.tensorboard)?;
        if cfg.train.padding_free && cfg.train.loss == RmLoss::Dsc {
            let why = "needs train.loss = \"last_token\" (DeepSpeed-Chat's loss, the default, also reads the values \
                       at the shorter side's padding, which a padding-free pass does not compute)";
            return Err(src.error("train.padding_free", why));
        }
        let lora = &cfg.model.lora;
        let dropout = if lora.rank > 0 { lora.dropout } else { 0.0 };
        cfg.distributed.apply_to_checkpointing(&src, &mut cfg.train.gradient_checkpointing, dropout)?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_load_and_overrides_apply() {
        let sft = SftConfig::load(&ConfigSource::Preset("sft".into()), &[]).unwrap();
        assert_eq!((sft.model.path.as_str(), sft.data.train.as_str()), ("builtin:tiny", "builtin:addition-sft"));
        let rm = RmConfig::load(&ConfigSource::Preset("rm".into()), &["train.loss=\"last_token\"".into()]).unwrap();
        assert_eq!(rm.train.loss, RmLoss::LastToken);
        let e = RmConfig::load(&ConfigSource::Preset("rm".into()), &["train.padding_free=true".into()]).unwrap_err();
        assert!(e.to_string().contains("train.padding_free: needs train.loss = \"last_token\""), "{e}");
        assert_eq!(rm.data.train, "builtin:addition-pairs");
        let e = SftConfig::load(&ConfigSource::Preset("sft".into()), &["lora.rank=-1".into()]).unwrap_err();
        assert!(e.to_string().contains("--set lora.rank=-1: model.lora.rank: must be >= 0"), "{e}");
        let e = SftConfig::load(&ConfigSource::Preset("sft".into()), &["data.max_len=1".into()]).unwrap_err();
        assert!(e.to_string().contains("data.max_len"), "{e}");
    }
}
