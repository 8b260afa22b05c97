//! What a decode is asked to do: [`GenerateConfig`] and [`StopCheck`].

use crate::error::{GenerationError, Result};
use crate::sampling::{RowWindow, Sampling};

/// Generation parameters.
#[derive(Debug, Clone)]
pub struct GenerateConfig {
    pub max_new_tokens: i64,
    pub sampling: Sampling,
    /// Any of these ends a sequence (the EOS token itself is part of the response).
    pub eos_token_ids: Vec<i64>,
    /// Written after a sequence ended.
    pub pad_token_id: i64,
    /// Seeds libtorch's generator before the noise key is drawn from it.
    pub seed: Option<u64>,
    /// Steps between checks whether every sequence has finished (0: pick by device).
    pub sync_every: i64,
    /// These rows are part of a larger batch split across processes: their noise is that of
    /// their rows in the whole batch ([`crate::noise`]); `None`: the batch is whole.
    pub rows: Option<RowWindow>,
    /// The prompts come in runs of this many identical rows (GRPO's G samples of a prompt): each
    /// prompt is prefilled once and its KV cache and first logits are repeated for its run, so
    /// prefill costs `batch / group` rows instead of `batch` (HF `generate` prefills every copy;
    /// vLLM shares them by prefix caching). 1: every row is prefilled. Rows that are not such runs
    /// are an input error.
    pub prefill_group: i64,
    /// Also return the log-probability of each sampled token under the distribution it was
    /// sampled from — `log_softmax(logits)` at the token, before temperature and truncation, as
    /// the trainer's own log-probs are — in [`Generated::logprobs`].
    pub logprobs: bool,
    /// The key of the sampling noise ([`crate::noise`]: one uniform per key, global row and
    /// step); `None` draws it from libtorch's generator (seeded per training step), which a
    /// decode running beside other work must not touch.
    pub noise_key: Option<u64>,
    /// On CUDA, capture the decode step as CUDA graphs and replay them ([`crate::graphs`]);
    /// eager steps where capture is impossible, and on other devices.
    pub cuda_graphs: bool,
}

impl GenerateConfig {
    /// Checks the sampling parameters and `max_new_tokens`.
    pub(crate) fn check(&self) -> Result<()> {
        self.sampling.validate()?;
        if self.max_new_tokens < 1 {
            return Err(GenerationError::Input(format!("max_new_tokens must be >= 1, got {}", self.max_new_tokens)));
        }
        Ok(())
    }

    /// Decode steps between host checks on `device` ([`GenerateConfig::sync_every`], 0 picked
    /// by device).
    pub(crate) fn sync_steps(&self, device: tch::Device) -> i64 {
        match self.sync_every {
            0 if device.is_cuda() => 16,
            0 => 1,
            n => n,
        }
    }

    /// Greedy decoding of up to `max_new_tokens`.
    pub fn greedy(max_new_tokens: i64, eos_token_ids: Vec<i64>, pad_token_id: i64) -> Self {
        GenerateConfig {
            max_new_tokens,
            sampling: Sampling::Greedy,
            eos_token_ids,
            pad_token_id,
            seed: None,
            sync_every: 0,
            rows: None,
            prefill_group: 1,
            logprobs: false,
            noise_key: None,
            cuda_graphs: true,
        }
    }
}

/// Decides after each decode step which rows stop there (their last token is kept, as an EOS
/// is): given the step's sampled token per row (pad for rows already finished), returns one flag
/// per row. Multi-turn rollouts end a turn at a stop string this way.
pub type StopCheck<'a> = &'a mut dyn FnMut(&[i64]) -> Result<Vec<bool>>;
