//! Off-policy correction for an external rollout engine. vLLM samples with its own kernels and
//! precision, so its policy `π_behavior` differs slightly from the trainer's `π_old` (which the
//! host recomputes). The importance weight `w = π_old / π_behavior` (TRL's
//! `vllm_importance_sampling_*`, the "truncated importance sampling" of Yao et al. 2025, "Your
//! efficient RL framework secretly brings you off-policy RL training") multiplies the per-token
//! advantages the loss sees. For the clipped token-level surrogates (grpo, ppo, reinforce-pp,
//! the template) that equals weighting the per-token policy-gradient loss, since
//! `min(r·A, clip(r)·A)·w = min(r·(wA), clip(r)·(wA))` for `w ≥ 0`; value and KL terms are not
//! weighted. rloo and gspo read one advantage per sequence (its token mean), so a token mode
//! weights their sequences by the mean token weight (the sequence modes are exact for them);
//! ppo-seq recomputes its advantages inside `loss`, so the correction does not reach it (a
//! plugin can read `behavior_logprobs` itself).
//!
//! - `token_truncate`: `w_t = min(exp(old_t − beh_t), cap)`;
//! - `token_mask`: `w_t = exp(old_t − beh_t)` where it lies in `[low, cap]`, else 0;
//! - `sequence_truncate` / `sequence_mask`: the same on the sequence ratio
//!   `exp(Σ_t (old_t − beh_t))`, applied to all of the sequence's tokens.
//!
//! Whenever the engine reports log-probs the mismatch is logged: `is/ratio_mean` (token mean of
//! `exp(old − beh)`), `is/logprob_diff_max` (largest `|old − beh|`), and with a mode
//! `is/clipped_fraction` or `is/masked_fraction` (of tokens, or of sequences).

use tch::{Kind, Tensor};

use crate::config::{IsCorrectionConfig, IsMode};
use crate::error::Result;
use crate::metrics::StepMetrics;

/// The advantages with the correction of `cfg` applied (unchanged without behaviour log-probs or
/// with mode `none`), and the mismatch metrics.
///
/// # Shapes
/// `old`, `behavior`, `mask`, `advantages`: `[B, R]` f32; returns `[B, R]`.
pub fn apply(
    cfg: &IsCorrectionConfig,
    old: &Tensor,
    behavior: Option<&Tensor>,
    mask: &Tensor,
    advantages: Tensor,
    m: &mut StepMetrics,
) -> Result<Tensor> {
    let Some(beh) = behavior else { return Ok(advantages) };
    let tokens = mask.f_sum(Kind::Float)?.double_value(&[]).max(1.0);
    let log_ratio = old.f_sub(beh)?.f_mul(mask)?; // [B, R], 0 on padding
    let ratio = log_ratio.f_exp()?; // 1 on padding
    m.set("is/ratio_mean", ratio.f_mul(mask)?.f_sum(Kind::Float)?.double_value(&[]) / tokens);
    m.set("is/logprob_diff_max", log_ratio.f_abs()?.f_max()?.double_value(&[]));
    let sequence = matches!(cfg.mode, IsMode::SequenceTruncate | IsMode::SequenceMask);
    let ratio = if sequence {
        log_ratio.f_sum_dim_intlist(1, true, Kind::Float)?.f_exp()?.f_expand_as(mask)?
    // [B, R]
    } else {
        ratio
    };
    // The units counted in the fractions: tokens, or sequences with at least one token.
    let units = if sequence { mask.f_amax(&[1i64][..], false)? } else { mask.shallow_clone() };
    let per_unit = |t: &Tensor| -> Result<Tensor> {
        Ok(if sequence { t.f_to_kind(Kind::Float)?.f_amax(&[1i64][..], false)? } else { t.f_to_kind(Kind::Float)? })
    };
    let fraction = |hit: &Tensor| -> Result<f64> {
        let n = units.f_sum(Kind::Float)?.double_value(&[]).max(1.0);
        Ok(per_unit(hit)?.f_mul(&units)?.f_sum(Kind::Float)?.double_value(&[]) / n)
    };
    let w = match cfg.mode {
        IsMode::None => return Ok(advantages),
        IsMode::TokenTruncate | IsMode::SequenceTruncate => {
            m.set("is/clipped_fraction", fraction(&ratio.f_gt(cfg.cap)?)?);
            ratio.f_clamp_max(cfg.cap)?
        }
        IsMode::TokenMask | IsMode::SequenceMask => {
            let outside = ratio.f_gt(cfg.cap)?.f_logical_or(&ratio.f_lt(cfg.low)?)?;
            m.set("is/masked_fraction", fraction(&outside)?);
            ratio.f_masked_fill(&outside, 0.0)?
        }
    };
    Ok(advantages.f_mul(&w.f_mul(mask)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], shape: [i64; 2]) -> Tensor {
        Tensor::from_slice(v).view(shape)
    }

    fn run(mode: IsMode) -> (Vec<f32>, StepMetrics) {
        // Row 0: log ratios ln 3 and 0; row 1: ln 0.5 and padding.
        let old = t(&[3f32.ln(), 0.0, 0.5f32.ln(), 0.0], [2, 2]);
        let beh = t(&[0.0; 4], [2, 2]);
        let mask = t(&[1.0, 1.0, 1.0, 0.0], [2, 2]);
        let adv = t(&[1.0, 2.0, -1.0, 0.0], [2, 2]);
        let cfg = IsCorrectionConfig { mode, cap: 2.0, low: 0.6 };
        let mut m = StepMetrics::default();
        let out = apply(&cfg, &old, Some(&beh), &mask, adv, &mut m).unwrap();
        (Vec::<f32>::try_from(out.view([-1])).unwrap(), m)
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5)
    }

    #[test]
    fn the_four_modes_weight_the_advantages() {
        let (a, m) = run(IsMode::None);
        assert_eq!(a, [1.0, 2.0, -1.0, 0.0]);
        assert!((m.get("is/ratio_mean").unwrap() - (3.0 + 1.0 + 0.5) / 3.0).abs() < 1e-6);
        assert!((m.get("is/logprob_diff_max").unwrap() - 3f64.ln()).abs() < 1e-6);
        let (a, m) = run(IsMode::TokenTruncate);
        assert!(close(&a, &[2.0, 2.0, -0.5, 0.0]), "{a:?}");
        assert!((m.get("is/clipped_fraction").unwrap() - 1.0 / 3.0).abs() < 1e-6);
        let (a, m) = run(IsMode::TokenMask);
        assert!(close(&a, &[0.0, 2.0, 0.0, 0.0]), "{a:?}");
        assert!((m.get("is/masked_fraction").unwrap() - 2.0 / 3.0).abs() < 1e-6);
        // Sequence ratios: 3 (row 0), 0.5 (row 1).
        let (a, m) = run(IsMode::SequenceTruncate);
        assert!(close(&a, &[2.0, 4.0, -0.5, 0.0]), "{a:?}");
        assert!((m.get("is/clipped_fraction").unwrap() - 0.5).abs() < 1e-6);
        let (a, m) = run(IsMode::SequenceMask);
        assert!(close(&a, &[0.0, 0.0, 0.0, 0.0]), "{a:?}");
        assert!((m.get("is/masked_fraction").unwrap() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn without_behaviour_log_probs_nothing_changes() {
        let adv = Tensor::from_slice(&[1.0f32, 2.0]).view([1, 2]);
        let mask = Tensor::from_slice(&[1.0f32, 1.0]).view([1, 2]);
        let cfg = IsCorrectionConfig { mode: IsMode::TokenTruncate, ..Default::default() };
        let mut m = StepMetrics::default();
        let out = apply(&cfg, &adv, None, &mask, adv.shallow_clone(), &mut m).unwrap();
        assert!(out.equal(&adv));
        assert!(m.means().is_empty());
    }
}
