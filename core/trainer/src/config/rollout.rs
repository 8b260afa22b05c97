//! `[rollout]`: the generation batch, sampling, and the choice of engine: `engine = "local"` (the trainer's own batched
//! decode, the default) or `"vllm"` (vLLM servers over HTTP, `[rollout.vllm]`), and the
//! importance-sampling correction for the mismatch between the engine's sampling policy and the
//! trainer's (`[rollout.is_correction]`).

use serde::{Deserialize, Serialize};

use super::KeySource;
use crate::error::Result;

/// Most intra-op threads a setting may ask for: libtorch takes an `i32`, and no machine has more.
pub const MAX_THREADS: usize = 1024;
/// Most responses one generation batch may hold (`prompts_per_batch × samples_per_prompt`).
pub const MAX_BATCH_ROWS: usize = 1 << 20;

/// Generation during rollout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Distinct prompts per generation batch.
    pub prompts_per_batch: usize,
    /// Responses sampled per prompt (GRPO's G).
    pub samples_per_prompt: usize,
    pub max_new_tokens: i64,
    pub temperature: f64,
    /// 1.0 disables.
    pub top_p: f64,
    /// 0 disables.
    pub top_k: i64,
    /// `local` (the trainer's own decode) or `vllm` (`[rollout.vllm]`).
    pub engine: EngineKind,
    /// The local engine's decode precision: `model` (the policy itself) or `bf16` (a bf16 copy of
    /// the policy's weights, refreshed every optimizer step, with the policy's own f32 output
    /// head; the sampled tokens' log-probs then travel as behaviour log-probs, as vLLM's do).
    pub decode_dtype: DecodeDtype,
    pub vllm: VllmConfig,
    /// Correction for the engine's sampling policy differing from the trainer's.
    pub is_correction: IsCorrectionConfig,
    /// Mask truncated responses (no EOS within `max_new_tokens`) out of the loss (DAPO's
    /// overlong filtering; TRL's `mask_truncated_completions`).
    pub overlong_filter: bool,
    /// DAPO's soft overlong punishment: the last this many tokens before `max_new_tokens` cost a
    /// linearly growing penalty, up to `overlong_penalty` at the limit (0: off).
    pub overlong_buffer: i64,
    /// The penalty at the limit (verl's `overlong_buffer.penalty_factor`).
    pub overlong_penalty: f64,
    /// DAPO's dynamic sampling: drop groups whose scores are all equal, sample more.
    pub filter_groups: FilterGroupsConfig,
    /// Asynchronous rollouts: a generation worker samples the next batches while the current one
    /// trains, with weights at most this many optimizer steps old (0: generate, then train).
    pub max_staleness: usize,
    /// Intra-op threads of the asynchronous generation worker; the trainer keeps the rest
    /// (0: half of them, at least 1).
    pub generation_threads: usize,
    /// On CUDA, capture the decode step as CUDA graphs and replay them (the local engine); steps
    /// run eagerly where capture is impossible, which is logged once.
    pub cuda_graphs: bool,
}

/// `[rollout.filter_groups]`: DAPO's dynamic sampling (verl's `algorithm.filter_groups`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    /// What must differ within a group: `reward` (the weighted sum) or one score's name (a
    /// `[[rewards]]` name, `env`, `overlong`).
    pub metric: String,
    /// Generation batches a step may sample to fill its `prompts_per_batch` groups; a step that
    /// has fewer after this many trains on what it has.
    pub max_gen_batches: usize,
}

impl Default for FilterGroupsConfig {
    fn default() -> Self {
        FilterGroupsConfig { enable: false, metric: "reward".into(), max_gen_batches: 10 }
    }
}

impl FilterGroupsConfig {
    /// Checks the section against the step's score names (the sources, `env`, `overlong`).
    pub(crate) fn validate(&self, scores: &[String], src: &KeySource) -> Result<()> {
        if self.max_gen_batches == 0 {
            return Err(src.error("rollout.filter_groups.max_gen_batches", "must be >= 1"));
        }
        if self.metric != "reward" && !scores.contains(&self.metric) {
            let names = scores.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
            return Err(src.error(
                "rollout.filter_groups.metric",
                &format!("`{}` is neither `reward` nor a score of this run ({names})", self.metric),
            ));
        }
        Ok(())
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            prompts_per_batch: 8,
            samples_per_prompt: 4,
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            engine: EngineKind::Local,
            decode_dtype: DecodeDtype::Model,
            vllm: VllmConfig::default(),
            is_correction: IsCorrectionConfig::default(),
            overlong_filter: false,
            overlong_buffer: 0,
            overlong_penalty: 1.0,
            filter_groups: FilterGroupsConfig::default(),
            max_staleness: 0,
            generation_threads: 0,
            cuda_graphs: true,
        }
    }
}

impl RolloutConfig {
    /// Checks the section; `lora_rank` is the actor's `model.lora.rank`.
    pub(crate) fn validate(&self, lora_rank: i64, src: &KeySource) -> Result<()> {
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        let r = self;
        if r.prompts_per_batch == 0 {
            return bad("rollout.prompts_per_batch", "must be >= 1");
        }
        if r.samples_per_prompt == 0 {
            return bad("rollout.samples_per_prompt", "must be >= 1");
        }
        if r.prompts_per_batch.checked_mul(r.samples_per_prompt).is_none_or(|rows| rows > MAX_BATCH_ROWS) {
            return bad(
                "rollout.prompts_per_batch",
                &format!("times rollout.samples_per_prompt must be at most {MAX_BATCH_ROWS} responses per batch"),
            );
        }
        if r.generation_threads > MAX_THREADS {
            return bad("rollout.generation_threads", &format!("must be at most {MAX_THREADS} (0: half the threads)"));
        }
        if r.filter_groups.enable && r.samples_per_prompt < 2 {
            return bad(
                "rollout.filter_groups.enable",
                "needs rollout.samples_per_prompt >= 2: a group of one response never has differing scores",
            );
        }
        if r.max_new_tokens < 1 {
            return bad("rollout.max_new_tokens", "must be >= 1");
        }
        if r.temperature.is_nan() || r.temperature <= 0.0 {
            return bad("rollout.temperature", "must be > 0 (RL needs sampling)");
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            return bad("rollout.top_p", "must be in (0, 1]");
        }
        if r.top_k < 0 {
            return bad("rollout.top_k", "must be >= 0 (0 disables)");
        }
        if !(0..=r.max_new_tokens).contains(&r.overlong_buffer) {
            return bad("rollout.overlong_buffer", "must be in [0, rollout.max_new_tokens] (0: off)");
        }
        if !(r.overlong_penalty.is_finite() && r.overlong_penalty >= 0.0) {
            return bad("rollout.overlong_penalty", "must be a number >= 0");
        }
        if r.decode_dtype == DecodeDtype::Bf16 {
            if r.engine != EngineKind::Local {
                return bad("rollout.decode_dtype", "\"bf16\" is the local engine's; vLLM has its own dtype");
            }
            if lora_rank > 0 {
                return bad("rollout.decode_dtype", "\"bf16\" does not support model.lora.rank > 0 yet");
            }
        }
        if r.max_staleness > 0 {
            let refuse = |why: &str| bad("rollout.max_staleness", &format!("asynchronous rollouts {why} yet"));
            if r.engine == EngineKind::Vllm && r.max_staleness > 1 {
                return refuse("on vLLM take max_staleness = 1 only (the servers hold one policy at a time)");
            }
            if r.engine == EngineKind::Local && lora_rank > 0 {
                return refuse("on the local engine do not support model.lora.rank > 0");
            }
            if r.filter_groups.enable {
                return refuse("do not combine with rollout.filter_groups (its refills depend on the step's scores)");
            }
        }
        validate_engine(r.engine, &r.vllm, &r.is_correction, lora_rank, src)
    }
}

/// The local engine's decode precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeDtype {
    /// The policy's own weights and dtype: the behaviour policy is the policy.
    #[default]
    Model,
    /// A bf16 copy of the weights for the decoder layers, the policy's f32 output head.
    Bf16,
}

/// Which engine generates the rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// The trainer's own batched KV-cache decode, in process.
    #[default]
    Local,
    /// vLLM servers (`[rollout.vllm]`), weights synced every step.
    Vllm,
}

/// How the policy reaches the vLLM servers after each optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightSync {
    /// The whole policy as a Hugging Face directory; the servers reload it
    /// (`/collective_rpc` `reload_weights`, needs `VLLM_SERVER_DEV_MODE=1`).
    #[default]
    Full,
    /// The LoRA adapter in PEFT's layout; the servers hot-swap it (`/v1/load_lora_adapter` with
    /// `load_inplace`, needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). Needs `model.lora.rank > 0`.
    Lora,
}

/// `[rollout.vllm]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VllmConfig {
    /// Base URLs of the servers (`http://host:8000`). A step's prompts are split over them, each
    /// prompt's samples on one server.
    pub urls: Vec<String>,
    /// The served model name (vLLM's `--served-model-name`; with LoRA sync, the adapter's name).
    pub model: String,
    /// Seconds one request may take (a weight reload included).
    pub timeout_s: f64,
    /// Further attempts after a request fails to connect, times out or gets a 5xx.
    pub retries: u32,
    pub weight_sync: WeightSync,
    /// Weight versions kept under `<run_dir>/rollout-weights` (older ones are removed).
    pub keep_versions: usize,
    /// After a sync, each server's log-prob of a probe token must be within this of the trainer's
    /// (else the server is taken to serve another policy, and the step stops).
    pub sync_tolerance: f64,
}

impl Default for VllmConfig {
    fn default() -> Self {
        VllmConfig {
            urls: Vec::new(),
            model: "policy".into(),
            timeout_s: 300.0,
            retries: 2,
            weight_sync: WeightSync::Full,
            keep_versions: 2,
            sync_tolerance: 1e-3,
        }
    }
}

/// What the importance-sampling correction does with `w = π_old / π_behavior`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsMode {
    /// No correction.
    #[default]
    None,
    /// Per token, `w_t = min(exp(old_t − behavior_t), cap)` (TRL's `token_truncate`, TIS).
    TokenTruncate,
    /// Per token, `w_t = exp(old_t − behavior_t)`, or 0 where that exceeds `cap` or is below
    /// `low` (TRL's `token_mask`).
    TokenMask,
    /// Per sequence, `w = min(exp(Σ_t old_t − behavior_t), cap)` on all its tokens.
    SequenceTruncate,
    /// Per sequence, `w = exp(Σ_t old_t − behavior_t)`, or 0 outside `[low, cap]` (TRL's
    /// `sequence_mask`).
    SequenceMask,
}

/// `[rollout.is_correction]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IsCorrectionConfig {
    pub mode: IsMode,
    /// Upper bound of `w` (truncate) or of the kept range (mask). TRL's
    /// `vllm_importance_sampling_cap`, 2.0.
    pub cap: f64,
    /// Lower bound of the kept range in the mask modes (0: none).
    pub low: f64,
}

impl Default for IsCorrectionConfig {
    fn default() -> Self {
        IsCorrectionConfig { mode: IsMode::None, cap: 2.0, low: 0.0 }
    }
}

/// Checks `[rollout.vllm]` and `[rollout.is_correction]` for `engine`; `lora_rank` is the
/// actor's `model.lora.rank`.
fn validate_engine(
    engine: EngineKind,
    v: &VllmConfig,
    is: &IsCorrectionConfig,
    lora_rank: i64,
    src: &KeySource,
) -> Result<()> {
    let bad = |key: &str, msg: &str| Err(src.error(key, msg));
    if !(is.cap.is_finite() && is.cap >= 1.0) {
        return bad("rollout.is_correction.cap", "must be a number >= 1");
    }
    if !(is.low.is_finite() && is.low >= 0.0 && is.low < 1.0) {
        return bad("rollout.is_correction.low", "must be in [0, 1)");
    }
    if engine == EngineKind::Local {
        return Ok(());
    }
    if v.urls.is_empty() {
        return bad("rollout.vllm.urls", "must name at least one server with rollout.engine = \"vllm\"");
    }
    for (i, u) in v.urls.iter().enumerate() {
        let ok = (u.starts_with("http://") || u.starts_with("https://")) && u.len() > "https://".len();
        if !ok {
            return bad(&format!("rollout.vllm.urls[{i}]"), &format!("`{u}` is not an http:// or https:// URL"));
        }
    }
    if v.model.trim().is_empty() {
        return bad("rollout.vllm.model", "must name the served model");
    }
    if !(v.timeout_s.is_finite() && v.timeout_s > 0.0) {
        return bad("rollout.vllm.timeout_s", "must be > 0");
    }
    if v.keep_versions == 0 {
        return bad("rollout.vllm.keep_versions", "must be >= 1");
    }
    if !(v.sync_tolerance.is_finite() && v.sync_tolerance > 0.0) {
        return bad("rollout.vllm.sync_tolerance", "must be > 0");
    }
    if v.weight_sync == WeightSync::Lora && lora_rank == 0 {
        return bad("rollout.vllm.weight_sync", "\"lora\" needs a LoRA actor (model.lora.rank > 0)");
    }
    Ok(())
}
