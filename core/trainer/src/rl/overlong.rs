//! DAPO's overlong handling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
//! System at Scale", §3.4), for single-turn rollouts:
//!
//! - **soft overlong punishment** (`rollout.overlong_buffer = L_cache`, `overlong_penalty = f`):
//!   a response of `|y|` tokens (its EOS included) sampled under the limit `L_max =
//!   rollout.max_new_tokens` gets
//!
//!   ```text
//!   R_length(y) = 0                                  if |y| <= L_max − L_cache
//!               = f · ((L_max − L_cache) − |y|) / L_cache   otherwise (−f at the limit)
//!   ```
//!
//!   added to its reward as one more source, `overlong` (verl's `overlong_buffer`, OpenRLHF's
//!   `--overlong_buffer_len` / `--overlong_penalty_factor`);
//! - **overlong filtering** (`rollout.overlong_filter`): a truncated response (no EOS within
//!   `L_max`) keeps its reward and its place in its group's statistics but is masked out of the
//!   loss (TRL's `mask_truncated_completions`).

use tch::{Kind, Tensor};

use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::rl::experience::Batch;
use crate::rl::rollout::Rollout;
use crate::rl::score::SourceScores;

/// `R_length` of a response of `len` tokens under the limit `max_new` with a buffer of `buffer`
/// tokens and penalty `factor` (0 when `buffer` is 0).
pub fn penalty(len: i64, max_new: i64, buffer: i64, factor: f64) -> f64 {
    let free = max_new - buffer;
    if buffer <= 0 || len <= free {
        return 0.0;
    }
    factor * (free - len) as f64 / buffer as f64
}

/// The `overlong` source's score of every kept row of `rollout` (their response lengths, EOS
/// included).
pub fn scores(rollout: &Rollout, max_new: i64, buffer: i64, factor: f64) -> SourceScores {
    let scores = rollout.responses.iter().map(|(_, with_eos)| penalty(with_eos.len() as i64, max_new, buffer, factor));
    SourceScores { scores: scores.collect(), metrics: vec![] }
}

/// Which rows were cut at the limit: `max_new` response tokens, the last of them not an EOS.
///
/// # Shapes
/// `sequences`: `[N, P + R]` (responses left-aligned from column `prompt_len`), `action_mask`:
/// `[N, R]`; returns `[N]` bool.
pub fn truncated(
    sequences: &Tensor,
    action_mask: &Tensor,
    prompt_len: i64,
    max_new: i64,
    eos_ids: &[i64],
) -> Result<Tensor> {
    let (n, r) = (action_mask.size()[0], action_mask.size()[1]);
    if r < max_new {
        return Ok(Tensor::zeros([n], (Kind::Bool, action_mask.device())));
    }
    let full = action_mask.f_sum_dim_intlist(1, false, Kind::Int64)?.f_eq(max_new)?; // [N]
    let last = sequences.f_select(1, prompt_len + max_new - 1)?; // [N]
    let mut eos = Tensor::zeros([n], (Kind::Bool, action_mask.device()));
    for &id in eos_ids {
        eos = eos.f_logical_or(&last.f_eq(id)?)?;
    }
    Ok(full.f_logical_and(&eos.f_logical_not()?)?)
}

/// `action_mask` with the `truncated` rows zeroed.
///
/// # Shapes
/// `action_mask`: `[N, R]`, `truncated`: `[N]` bool; returns `[N, R]` of `action_mask`'s kind.
pub fn mask_rows(action_mask: &Tensor, truncated: &Tensor) -> Result<Tensor> {
    let keep = truncated.f_logical_not()?.f_to_kind(action_mask.kind())?.f_unsqueeze(1)?;
    Ok(action_mask.f_mul(&keep)?)
}

/// Overlong filtering of a whole batch (every rank holds it): the truncated rows keep their
/// advantages (their group's statistics are made) but leave the loss; `overlong/masked` counts
/// them.
pub fn filter(batch: &mut Batch, max_new: i64, eos_ids: &[i64], m: &mut StepMetrics) -> Result<()> {
    let cut = truncated(&batch.sequences, &batch.action_mask, batch.prompt_len, max_new, eos_ids)?;
    m.set("overlong/masked", cut.f_sum(Kind::Int64)?.f_int64_value(&[])? as f64);
    batch.action_mask = mask_rows(&batch.action_mask, &cut)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DAPO's formula on hand values: L_max = 20, L_cache = 4.
    #[test]
    fn the_penalty_is_linear_over_the_buffer() {
        let p = |len| penalty(len, 20, 4, 1.0);
        assert_eq!((p(1), p(16)), (0.0, 0.0));
        assert_eq!((p(17), p(18), p(19), p(20)), (-0.25, -0.5, -0.75, -1.0));
        assert_eq!(penalty(18, 20, 4, 0.5), -0.25);
        assert_eq!(penalty(20, 20, 0, 1.0), 0.0, "buffer 0 is off");
        assert_eq!(penalty(20, 20, 20, 1.0), -1.0);
        assert_eq!(penalty(1, 20, 20, 1.0), -0.05);
    }

    /// Three rows under a limit of 3 (prompt of 2): cut without EOS, ended by EOS at the limit,
    /// ended early; EOS ids 9 and 8.
    #[test]
    fn only_rows_cut_at_the_limit_without_eos_are_truncated_and_masked() {
        let seqs = Tensor::from_slice2(&[[1i64, 1, 5, 6, 7], [1, 1, 5, 6, 8], [1, 1, 5, 9, 0]]);
        let mask = Tensor::from_slice2(&[[1i64, 1, 1], [1, 1, 1], [1, 1, 0]]).to_kind(Kind::Float);
        let t = truncated(&seqs, &mask, 2, 3, &[9, 8]).unwrap();
        assert_eq!(Vec::<bool>::try_from(&t).unwrap(), [true, false, false]);
        let masked = mask_rows(&mask, &t).unwrap();
        assert_eq!(Vec::<f32>::try_from(masked.flatten(0, -1)).unwrap(), [0., 0., 0., 1., 1., 1., 1., 1., 0.]);
        // A limit the batch never reached truncates nothing.
        let t = truncated(&seqs, &mask, 2, 4, &[9]).unwrap();
        assert_eq!(Vec::<bool>::try_from(&t).unwrap(), [false, false, false]);
    }
}
