//! `[train]` of `rlhf train`: the RL loop's optimisation settings.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::optim::{OptimConfig, Schedule};

/// Optimisation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Generation batches (each followed by `ppo_epochs` passes over its minibatches).
    pub steps: usize,
    /// Passes over each generation batch.
    pub ppo_epochs: usize,
    /// Samples per optimizer step (DeepSpeed-Chat's per-device mini batch).
    pub minibatch_size: usize,
    /// Minibatches whose gradients are accumulated into one optimizer step (TRL's
    /// `gradient_accumulation_steps`): each minibatch's loss is divided by it, and token-mean
    /// losses over the whole accumulated batch (GRPO's `dapo`) see its token count.
    pub gradient_accumulation_steps: usize,
    /// The actor's (policy's) learning rate, as in `rlhf sft`, `rm` and `dpo` (was `actor_lr`).
    pub lr: f64,
    pub critic_lr: f64,
    pub weight_decay: f64,
    pub adam_betas: (f64, f64),
    pub adam_eps: f64,
    /// Optimizer steps of linear warm-up.
    pub warmup_steps: usize,
    pub schedule: Schedule,
    /// Gradient-norm clip per model (0 disables).
    pub max_grad_norm: f64,
    /// Steps in a row that train nothing (every optimizer step skipped for a non-finite loss, or
    /// no sample to train on) before the run stops with the likely cause; 0 = never stop.
    pub max_idle_steps: usize,
    /// EMA decay of an extra actor copy (DeepSpeed-Chat's `enable_ema`); none = off.
    pub ema_decay: Option<f64>,
    /// Weight of the unsupervised LM loss on `ptx_data` (InstructGPT's PPO-ptx); 0 = off.
    pub ptx_coef: f64,
    /// JSONL with a `text` field for the ptx loss.
    pub ptx_data: Option<PathBuf>,
    /// Upper bound on `rows × vocab` fp32 logits materialised at once.
    pub logprob_chunk_elements: i64,
    /// With one epoch of one minibatch holding the whole batch (no accumulation, no token
    /// budget, no LoRA dropout) the old log-probs are the minibatch's fresh ones detached: compute them in
    /// that pass rather than in a second forward (TRL does the same). `false` forces the
    /// separate pass.
    pub reuse_old_logprobs: bool,
    /// Activation checkpointing per decoder layer for the actor and the critic (transformers'
    /// `gradient_checkpointing`): only each layer's input is kept through the forward, and each
    /// layer is recomputed in backward — much less activation memory for one more forward.
    pub gradient_checkpointing: bool,
    /// Compute a prompt once for all the rows that hold it (GRPO's G samples) in the log-prob
    /// passes, its keys and values shared by the completions — the same numbers within float
    /// rounding, in about `(B·P + B·G·R) / (B·G·(P + R))` of the work, with or without
    /// gradient checkpointing. Off with LoRA dropout (the rows would share dropout masks).
    pub share_prompts: bool,
    /// Run the actor's, the reference's and the critic's passes padding-free (verl's
    /// `use_remove_padding`): each batch's rows without their padding, packed into as few rows
    /// of its width as hold them, every sequence attending only to itself. The same numbers
    /// within float rounding, in the layers' share of the work about `real tokens / (rows ×
    /// width)`. With `share_prompts` each shared prompt is laid once in a packed row and its
    /// completions after it, each seeing the prompt and itself, where the model attends by the
    /// mask alone (no linear attention, no sliding window narrower than the rows), in packed rows
    /// as wide as pays; each pass runs the layout of the fewest forward FLOPs (packed, shared
    /// prompts, or padded; `rlhf_models::PassCost`). Rows with images are computed padded.
    pub padding_free: bool,
    /// Split each rank's share of a minibatch into the fewest micro-batches of at most this many
    /// real tokens, balanced by tokens (verl's `use_dynamic_bsz` with `ppo_max_token_len_per_gpu`;
    /// needs `padding_free`). The algorithms' token and sample means stay over the whole
    /// optimizer step, so the gradient is the one of the minibatches whole within float rounding;
    /// a sequence longer than the budget is a micro-batch of its own. The old policy's, the
    /// reference's and the critic's passes run in micro-batches of the budget too, so the old
    /// log-probs have a pass of their own (`reuse_old_logprobs` does not apply). None: one
    /// micro-batch, and the experience passes over the whole batch.
    pub micro_batch_tokens: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 100,
            ppo_epochs: 1,
            minibatch_size: 32,
            gradient_accumulation_steps: 1,
            lr: 1e-6,
            critic_lr: 5e-6,
            weight_decay: 0.0,
            adam_betas: (0.9, 0.95),
            adam_eps: 1e-8,
            warmup_steps: 0,
            schedule: Schedule::Constant,
            max_grad_norm: 1.0,
            max_idle_steps: 5,
            ema_decay: None,
            ptx_coef: 0.0,
            ptx_data: None,
            logprob_chunk_elements: 1 << 26,
            reuse_old_logprobs: true,
            gradient_checkpointing: false,
            share_prompts: true,
            padding_free: false,
            micro_batch_tokens: None,
        }
    }
}

impl TrainConfig {
    /// The actor's optimizer settings (`lr` and the shared keys).
    pub fn actor_optim(&self) -> OptimConfig {
        self.optim(self.lr)
    }

    /// The critic's optimizer settings (`critic_lr` and the shared keys).
    pub fn critic_optim(&self) -> OptimConfig {
        self.optim(self.critic_lr)
    }

    fn optim(&self, lr: f64) -> OptimConfig {
        OptimConfig {
            lr,
            betas: self.adam_betas,
            eps: self.adam_eps,
            weight_decay: self.weight_decay,
            schedule: self.schedule,
            warmup_steps: self.warmup_steps,
            max_grad_norm: self.max_grad_norm,
        }
    }
}
