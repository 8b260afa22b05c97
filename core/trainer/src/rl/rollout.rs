//! Stage 2, **rollout**: the actor samples a response for every prompt row; responses with no
//! token are dropped (DeepSpeed-Chat drops answers below a minimum length). A response that is
//! only EOS has one token: it is kept and scored, so a policy cannot escape its rewards by
//! stopping at once.

use rlhf_generation::{
    batch::to_rows, generate, generate_with_images, GenerateConfig, Generated, GenerationError, RowWindow, Sampling,
};
use rlhf_models::CausalLm;

use crate::config::RolloutConfig;
use crate::error::{Result, TrainerError};
use crate::rl::prompts::PromptBatch;

/// The sampled batch and the rows worth scoring.
pub struct Rollout {
    /// Prompt ‖ response ids, masks and `prompt_len`, `[P·G, prompt_len + R]`.
    pub generated: Generated,
    /// Rows with at least one response token, in order.
    pub kept_rows: Vec<usize>,
    /// Per kept row: (response ids without EOS, for the text; response ids with EOS).
    pub responses: Vec<(Vec<u32>, Vec<u32>)>,
    /// The engine's own log-probs of the sampled tokens, `[P·G, R]` (0 on padding): the
    /// behaviour policy of an external engine (vLLM); `None` from the trainer's own decode,
    /// whose behaviour policy is the actor itself.
    pub behavior_logprobs: Option<tch::Tensor>,
}

/// Samples responses with the rollout settings; `rows` places this batch in a larger one split
/// across data-parallel ranks (its noise is that of its rows in the whole batch, see
/// [`rlhf_generation::noise`]). With
/// `behavior`, the sampled tokens' log-probs under `actor` (a decode copy of the policy) are
/// returned as the behaviour log-probs.
///
/// # Shapes
/// `batch.padded`: `[N, P]`; the result's `generated.sequences`: `[N, P + R]`, `response_mask`:
/// `[N, R]` with `R <= max_new_tokens`.
pub fn sample(
    actor: &CausalLm,
    batch: &PromptBatch,
    cfg: &RolloutConfig,
    eos_ids: &[i64],
    pad: i64,
    rows: Option<RowWindow>,
    behavior: bool,
) -> Result<Rollout> {
    let gen_cfg = generate_config(cfg, eos_ids, pad, rows, cfg.samples_per_prompt as i64, behavior);
    sample_with(actor, batch, &gen_cfg)
}

/// As [`sample`], with the decode settings given whole (`gen_cfg.logprobs` returns the behaviour
/// log-probs).
///
/// # Shapes
/// As [`sample`].
pub fn sample_with(actor: &CausalLm, batch: &PromptBatch, gen_cfg: &GenerateConfig) -> Result<Rollout> {
    let (ids, mask) = (&batch.padded.input_ids, &batch.padded.attention_mask);
    let generated = match &batch.images {
        Some(images) => generate_with_images(actor, ids, mask, images, gen_cfg),
        None => generate(actor, ids, mask, gen_cfg),
    };
    let mut generated = generated.map_err(|e| diverged(actor, e))?;
    let behavior_logprobs = generated.logprobs.take();
    finish(generated, behavior_logprobs, &gen_cfg.eos_token_ids)
}

/// A decode error, with non-finite logits explained.
pub(crate) fn diverged(actor: &CausalLm, e: GenerationError) -> TrainerError {
    match e {
        e @ GenerationError::NonFiniteLogits { .. } => TrainerError::Run(format!(
            "{}: {e} (or, after training steps, training diverged)",
            actor.source_dir().display()
        )),
        e => e.into(),
    }
}

/// The decode settings of `[rollout]`: `prefill_group` rows share a prefill; `behavior` returns
/// the sampled tokens' log-probs.
pub(crate) fn generate_config(
    cfg: &RolloutConfig,
    eos_ids: &[i64],
    pad: i64,
    rows: Option<RowWindow>,
    prefill_group: i64,
    behavior: bool,
) -> GenerateConfig {
    GenerateConfig {
        max_new_tokens: cfg.max_new_tokens,
        // Temperature 0 is greedy decoding (held-out evaluation; training requires > 0).
        sampling: if cfg.temperature == 0.0 {
            Sampling::Greedy
        } else {
            Sampling::Sample {
                temperature: cfg.temperature,
                top_k: (cfg.top_k > 0).then_some(cfg.top_k),
                top_p: (cfg.top_p < 1.0).then_some(cfg.top_p),
            }
        },
        eos_token_ids: eos_ids.to_vec(),
        pad_token_id: pad,
        seed: None,
        sync_every: 0,
        rows,
        // `next_batch` lays out each prompt's G samples as adjacent identical rows, and a
        // data-parallel rank holds whole groups.
        prefill_group,
        logprobs: behavior,
        noise_key: None,
        cuda_graphs: cfg.cuda_graphs,
    }
}

/// The rows worth scoring of a generated batch (any engine): rows with at least one response
/// token, their response ids with and without EOS.
///
/// # Shapes
/// `generated` as [`sample`] returns it; `behavior_logprobs`: `[N, R]`.
pub fn finish(generated: Generated, behavior_logprobs: Option<tch::Tensor>, eos_ids: &[i64]) -> Result<Rollout> {
    let resp_rows = to_rows(&generated.responses()?)?;
    let mask_rows = to_rows(&generated.response_mask)?;
    let mut kept_rows = Vec::new();
    let mut responses = Vec::new();
    for (r, (ids, mask)) in resp_rows.iter().zip(&mask_rows).enumerate() {
        let tokens: Vec<u32> = ids.iter().zip(mask).filter(|(_, &mk)| mk == 1).map(|(&t, _)| t as u32).collect();
        if tokens.is_empty() {
            continue;
        }
        let content: Vec<u32> = tokens.iter().copied().filter(|t| !eos_ids.contains(&i64::from(*t))).collect();
        kept_rows.push(r);
        responses.push((content, tokens));
    }
    Ok(Rollout { generated, kept_rows, responses, behavior_logprobs })
}
