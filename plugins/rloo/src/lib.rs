//! REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"; TRL's
//! `RLOOTrainer`): no critic — each response's baseline is the mean reward of the *other* responses
//! sampled for the same prompt, and the whole response is one action.
//!
//! Per generation batch ([`Rloo::prepare`]), for sample `i` in group `g` (samples sharing a
//! `group_id`; groups need not be contiguous nor of equal size), `n_g` samples in the group:
//!
//! ```text
//! r'_i = r_i − β·Σ_t (logp_old_t − logp_ref_t)            kl_in_reward (TRL): sequence k1 KL in the reward
//! b_i  = (Σ_{j∈g} r'_j − r'_i) / (n_g − 1)                leave-one-out baseline; b_i = r'_i when n_g = 1
//! A_i  = r'_i − b_i                                        (a group of one gets A = 0)
//! A_i  ← (A_i − mean A) / (std A + 1e-4)                   normalize_advantages (unbiased std over the batch)
//! ```
//!
//! Per minibatch ([`Rloo::loss`]), `ratio_level = "sequence"` (TRL's RLOO, the default: the response
//! is one action, its log-prob the sum of its tokens' log-probs):
//!
//! ```text
//! s_i      = exp(Σ_t (logp_t − logp_old_t))                1 in value on-policy
//! L_i      = −min(s_i·A_i, clamp(s_i, 1 − ε, 1 + ε_high)·A_i)
//! loss     = mean_i L_i  (+ β·mean_t k3_t when kl_in_reward = false)
//! ```
//!
//! This is TRL's aggregation (`RLOOTrainer._compute_loss`: `logps = (per_token_logps * mask).sum(1)`,
//! `coef_1 = exp(logps − old_logps)`, `loss = per_sequence_loss.mean()`, before and after its 2025
//! rewrite) and the paper's REINFORCE gradient `A_i·∇ log π(y_i)` on-policy.
//! `ratio_level = "token"`: `ρ_t = exp(logp_t − logp_old_t)`, `L_t = −min(ρ_t·A_i, clamp(ρ_t)·A_i)`,
//! `loss = mean_i (Σ_t L_t·mask / Σ_t mask)` (GRPO's aggregation; each token's gradient is `1/T_i`
//! of the sequence-level one on-policy). The clip matters only off-policy (`ppo_epochs > 1`, or
//! the later minibatches of a batch).
//!
//! `kl_in_reward = false` moves the KL out of the reward into the loss as
//! `β · masked_mean_t k3_t`, `k3 = exp(ref − logp) − (ref − logp) − 1` (OpenRLHF's `use_kl_loss`
//! with `kl_estimator = "k3"`: a token mean over the minibatch).
//!
//! Where TRL differs: TRL views the rewards as `[prompts, num_generations]` (contiguous, equal
//! groups of at least two); here groups come from `group_ids` and a group of one gets advantage 0
//! (so `normalize_advantages` then shifts it to `−mean/std`). TRL has no token-level ratio and no KL
//! in the loss (both options here); its `reward_clip_range` is not implemented. Defaults are TRL's
//! (`beta = 0.05`, `epsilon = 0.2`, `normalize_advantages = false`).
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! beta = 0.05                  # KL weight; 0 = no reference model
//! kl_in_reward = true          # true: β·Σ_t k1 subtracted from the reward; false: β·k3 in the loss
//! epsilon = 0.2                # lower ratio clip (and upper, unless epsilon_high)
//! # epsilon_high = 0.28        # upper ratio clip
//! normalize_advantages = false # whiten the advantages over the batch
//! ratio_level = "sequence"     # "sequence" (TRL) | "token"
//! ```

use rlhf_plugin_api::ops::{self, group_index, group_stats, masked, masked_mean, masked_row_sum, Metrics};
use rlhf_plugin_api::ops::{KlEstimator, StdEstimator};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// Where the importance ratio is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// One ratio per response from its summed log-probs (TRL's RLOO).
    Sequence,
    /// One ratio per token, per-sequence token means, then the batch mean.
    Token,
}

/// The `[algorithm.config]` section; defaults are TRL's.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlooConfig {
    /// KL weight β (TRL 0.05); 0 = no reference model.
    pub beta: f64,
    /// true: sequence k1 KL subtracted from the reward (TRL); false: β·k3 token mean in the loss.
    pub kl_in_reward: bool,
    /// Lower ratio clip ε: ratios are clamped to `[1 − ε, 1 + epsilon_high]`.
    pub epsilon: f64,
    /// Upper ratio clip; defaults to `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Whiten the advantages over the batch (TRL's `normalize_advantages`).
    pub normalize_advantages: bool,
    /// "sequence" (TRL) or "token".
    pub ratio_level: RatioLevel,
}

impl Default for RlooConfig {
    fn default() -> Self {
        RlooConfig {
            beta: 0.05,
            kl_in_reward: true,
            epsilon: 0.2,
            epsilon_high: None,
            normalize_advantages: false,
            ratio_level: RatioLevel::Sequence,
        }
    }
}

impl RlooConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        ops::check_nonnegative("beta", self.beta)?;
        ops::check_positive("epsilon", self.epsilon)?;
        if let Some(v) = self.epsilon_high {
            ops::check_positive("epsilon_high", v)?;
        }
        Ok(())
    }
}

/// RLOO; stateless between batches.
#[derive(Debug)]
pub struct Rloo {
    cfg: RlooConfig,
}

/// The leave-one-out baseline of every sample: the mean of the other members of its group, or
/// the sample's own value when it is alone.
///
/// # Shapes
/// `x [B]` (f64), `group [B]` i64 in `0..n_groups`; returns `[B]`.
pub fn leave_one_out_baseline(x: &Tensor, group: &Tensor, n_groups: i64) -> Result<Tensor> {
    let zeros = Tensor::f_zeros([n_groups], (x.kind(), x.device()))?; // [G]
    let counts = zeros.f_index_add(0, group, &x.f_ones_like()?)?.f_index_select(0, group)?; // n_g, [B]
    let sums = zeros.f_index_add(0, group, x)?.f_index_select(0, group)?; // Σ_{j∈g} x_j, [B]
    let others = sums.f_sub(x)?.f_div(&counts.f_sub_scalar(1.0)?.f_clamp_min(1.0)?)?; // [B]
    Ok(others.f_where_self(&counts.f_gt(1.0)?, x)?)
}

impl Algorithm for Rloo {
    fn new(config: &str, ctx: &Context) -> Result<Self> {
        let cfg: RlooConfig = parse_config(config)?;
        cfg.validate()?;
        ops::require_groups(ctx, "RLOO")?;
        Ok(Rloo { cfg })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: self.cfg.beta != 0.0, critic: false, entropy: false }
    }

    fn resolved_config(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn describe_keys(&self) -> Vec<KeyDoc> {
        vec![
            KeyDoc { key: "beta", help: "KL weight; 0 = no reference model", peers: &[("TRL", "beta")] },
            KeyDoc { key: "kl_in_reward", help: "true: the sequence k1 KL is subtracted from the reward (TRL); false: beta times the k3 token mean in the loss", peers: &[] },
            KeyDoc { key: "epsilon", help: "lower ratio clip: ratios are clamped to [1 - epsilon, 1 + epsilon_high]", peers: &[("TRL", "epsilon")] },
            KeyDoc { key: "epsilon_high", help: "upper ratio clip; unset = epsilon", peers: &[("TRL", "epsilon_high")] },
            KeyDoc { key: "normalize_advantages", help: "whiten the advantages over the batch", peers: &[("TRL", "normalize_advantages")] },
            KeyDoc { key: "ratio_level", help: "importance ratio per sequence (TRL) or per token", peers: &[] },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.logprobs`, `exp.ref_logprobs`,
    /// `exp.action_mask [B, R]`; returns `advantages [B, R]` (each sample's A on its valid tokens).
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let cfg = &self.cfg;
        let mask = &exp.action_mask; // [B, R]
        let valid = mask.f_gt(0.0)?;
        let mut metrics = Metrics::new();

        // Statistics in f64, so that equal rewards give exactly equal baselines.
        let mut rewards = exp.rewards.f_to_kind(Kind::Double)?; // [B]
        if cfg.kl_in_reward && cfg.beta != 0.0 {
            let reff = masked(ops::need(&exp.ref_logprobs, "ref_logprobs", "rloo")?, &valid)?;
            let per_token_kl = masked(&exp.logprobs, &valid)?.f_sub(&reff)?; // k1 = old − ref, [B, R]
            let kl = masked_row_sum(&per_token_kl, mask)?.f_to_kind(Kind::Double)?; // [B]
            rewards = rewards.f_sub(&kl.f_mul_scalar(cfg.beta)?)?;
            metrics.scalar("rloo/kl", &masked_mean(&per_token_kl, mask)?)?;
        }
        let (group, n_groups) = group_index(&exp.group_ids)?; // [B] in 0..G
        let baseline = leave_one_out_baseline(&rewards, &group, n_groups)?; // [B]
        let mut advantages = rewards.f_sub(&baseline)?; // [B]
        if cfg.normalize_advantages {
            let std = advantages.f_std(true)?.f_nan_to_num(0.0, None, None)?; // torch.std (unbiased)
            advantages = advantages.f_sub(&advantages.f_mean(Kind::Double)?)?.f_div(&std.f_add_scalar(1e-4)?)?;
        }

        let (_, std_g) = group_stats(&rewards, &group, n_groups, StdEstimator::Population)?; // [G]
        let zero_std = std_g.f_lt(1e-8)?.f_to_kind(Kind::Double)?; // [G]
        metrics
            .scalar("rloo/advantages_mean", &advantages.f_mean(Kind::Double)?)?
            .scalar("rloo/advantages_std", &advantages.f_var_dim(0i64, false, false)?.f_sqrt()?)?
            .scalar("rloo/baseline_mean", &baseline.f_mean(Kind::Double)?)?
            .scalar("rloo/frac_reward_zero_std", &zero_std.f_mean(Kind::Double)?)?
            .value("rloo/num_groups", n_groups as f64);
        let advantages = ops::per_token(&advantages.f_to_kind(mask.kind())?, &valid)?; // [B, R]
        Ok(Prepared { advantages, returns: None, metrics: metrics.finish() })
    }

    /// # Shapes
    /// Every `mb` tensor `[b, R]` (`rewards [b]`, unused); the loss is a scalar.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let cfg = &self.cfg;
        let mask = &mb.action_mask; // [b, R]
        let valid = mask.f_gt(0.0)?;
        let logp = masked(&mb.logprobs, &valid)?; // [b, R], grad
        let log_ratio = logp.f_sub(&masked(&mb.old_logprobs, &valid)?)?; // [b, R]
        let lengths = mask.f_sum_dim_intlist(1, false, Kind::Float)?.f_clamp_min(1.0)?; // [b]

        // The sequence advantage, read back from its broadcast form (0 for an empty row).
        let advantage = masked_row_sum(&masked(&mb.advantages, &valid)?, mask)?.f_div(&lengths)?; // [b]
        let (low, high) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high.unwrap_or(cfg.epsilon));

        // The ratio and the advantage at the level of the loss: [b] or [b, R].
        let (coef_1, adv) = match cfg.ratio_level {
            RatioLevel::Sequence => (masked_row_sum(&log_ratio, mask)?.f_exp()?, advantage),
            RatioLevel::Token => (log_ratio.f_exp()?, masked(&advantage.f_unsqueeze(1)?, &valid)?),
        };
        let coef_2 = coef_1.f_clamp(low, high)?;
        let pg = coef_1.f_mul(&adv)?.f_minimum(&coef_2.f_mul(&adv)?)?.f_neg()?; // [b] or [b, R]

        // The mean over the step's samples (each micro-batch's share of it with several).
        let mean_over = |x: &Tensor| -> Result<Tensor> {
            let per_row = match cfg.ratio_level {
                RatioLevel::Sequence => x.shallow_clone(),
                RatioLevel::Token => masked_row_sum(x, mask)?.f_div(&lengths)?,
            }; // [b]
            ops::row_mean(&per_row, mb.accumulation_steps, mb.step_rows)
        };
        let policy_loss = mean_over(&pg)?; // []
        let per_token_kl = match (cfg.kl_in_reward, cfg.beta != 0.0) {
            (false, true) => {
                let reff = masked(ops::need(&mb.ref_logprobs, "ref_logprobs", "rloo")?, &valid)?;
                Some(masked(&ops::kl_estimate(&logp, &reff, KlEstimator::K3)?, &valid)?)
                // [b, R]
            }
            _ => None,
        };
        let loss = match &per_token_kl {
            Some(kl) => {
                let kl = ops::token_mean(kl, mask, mb.accumulation_steps, mb.step_tokens)?;
                policy_loss.f_add(&kl.f_mul_scalar(cfg.beta)?)?
            }
            None => policy_loss.shallow_clone(),
        };

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let is_low = coef_1.f_lt(low)?.f_logical_and(&adv.f_lt(0.0)?)?.f_to_kind(Kind::Float)?;
            let is_high = coef_1.f_gt(high)?.f_logical_and(&adv.f_gt(0.0)?)?.f_to_kind(Kind::Float)?;
            let fraction = |x: &Tensor| -> Result<Tensor> {
                match cfg.ratio_level {
                    RatioLevel::Sequence => Ok(x.f_mean(Kind::Float)?),
                    RatioLevel::Token => masked_mean(x, mask),
                }
            };
            let mut m = Metrics::new();
            m.scalar("loss/policy", &policy_loss)?
                .scalar("clip_ratio", &fraction(&is_low.f_add(&is_high)?)?)?
                .scalar("clip_ratio/low_mean", &fraction(&is_low)?)?
                .scalar("clip_ratio/high_mean", &fraction(&is_high)?)?
                .scalar("approx_kl", &ops::approx_kl(&log_ratio, mask)?)?;
            if let Some(kl) = &per_token_kl {
                m.scalar("rloo/kl", &masked_mean(kl, mask)?)?;
            }
            Ok(m.finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

rlhf_plugin_api::export_algorithm!(
    Rloo,
    name: "rloo",
    description: "RLOO: leave-one-out group baseline, sequence KL in the reward, clipped sequence ratio; no critic"
);

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_plugin_api::testing::{assert_close, metric, t2, values_of};
    use serde_json::json;

    /// Four samples per prompt.
    fn group_ctx() -> Context {
        Context { samples_per_prompt: 4, ..Context::default() }
    }

    fn rloo(cfg: serde_json::Value) -> Rloo {
        Rloo::new(&cfg.to_string(), &group_ctx()).unwrap()
    }

    /// Group 7 = rows 0, 1, 3, 4 (interleaved with group 3) with rewards [1, 0, 0, 1]; group 3 =
    /// rows 2, 5 with equal rewards [0.5, 0.5]; group 42 = row 6 alone. Row lengths 3, 2, 1, 3, 2,
    /// 3, 2 (16 tokens). Row 0's old − ref per token is [0.5, 0.25, 0.25] (Σ = 1), 0 elsewhere.
    fn experience() -> Experience {
        let mut logprobs = Tensor::zeros([7, 3], (Kind::Float, tch::Device::Cpu));
        let mut reff = logprobs.zeros_like();
        logprobs.get(0).copy_(&Tensor::from_slice(&[-1.0f32, -1.0, -1.0]));
        reff.get(0).copy_(&Tensor::from_slice(&[-1.5f32, -1.25, -1.25]));
        Experience {
            rewards: Tensor::from_slice(&[1.0f32, 0.0, 0.5, 0.0, 1.0, 0.5, 0.3]),
            logprobs: std::mem::take(&mut logprobs),
            ref_logprobs: Some(std::mem::take(&mut reff)),
            values: None,
            action_mask: t2(&[
                &[1., 1., 1.],
                &[1., 1., 0.],
                &[1., 0., 0.],
                &[1., 1., 1.],
                &[1., 1., 0.],
                &[1., 1., 1.],
                &[1., 1., 0.],
            ]),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 7, 7, 3, 42]),
            step: 0,
            behavior_logprobs: None,
        }
    }

    /// β = 0. Group 7 (Σ = 2, n = 4): b_i = (2 − r_i)/3 → b = [1/3, 2/3, 2/3, 1/3], A = ±2/3.
    /// Group 3: b = 0.5 = r → A = 0. Group 42 alone: b = r = 0.3, A = 0.
    /// baseline_mean = (2 + 1 + 0.3)/7; advantages_std = sqrt(4·(4/9)/7) = 0.5039526;
    /// groups 3 and 42 have zero std: 2/3.
    #[test]
    fn leave_one_out_advantages_by_hand() {
        let p = rloo(json!({"beta": 0.0})).prepare(&experience()).unwrap();
        let a = 2.0 / 3.0;
        #[rustfmt::skip]
        let expected = [a, a, a,  -a, -a, 0.,  0., 0., 0.,  -a, -a, -a,  a, a, 0.,  0., 0., 0.,  0., 0., 0.];
        assert_close(&values_of(&p.advantages), &expected, 1e-6);
        assert!(p.returns.is_none());
        assert!((metric(&p.metrics, "rloo/baseline_mean") - 3.3 / 7.0).abs() < 1e-7);
        assert!(metric(&p.metrics, "rloo/advantages_mean").abs() < 1e-12);
        assert!((metric(&p.metrics, "rloo/advantages_std") - 0.5039526).abs() < 1e-6);
        assert!((metric(&p.metrics, "rloo/frac_reward_zero_std") - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(metric(&p.metrics, "rloo/num_groups"), 3.0);
        assert!(p.metrics.iter().all(|(n, _)| n != "rloo/kl"));
    }

    /// β = 0.05, KL in the reward: r'_0 = 1 − 0.05·1 = 0.95, group 7 = [0.95, 0, 0, 1] (Σ 1.95):
    /// A = [0.95 − 1/3, 0 − 0.65, 0 − 0.65, 1 − 0.95/3] = [0.6166667, −0.65, −0.65, 0.6833333].
    /// Σ baselines = 1.95 + 1 + 0.3 → mean 3.25/7; rloo/kl = 1/16 tokens.
    #[test]
    fn kl_in_the_reward_by_hand() {
        let p = rloo(json!({})).prepare(&experience()).unwrap();
        let first = values_of(&p.advantages.select(1, 0));
        assert_close(&first, &[0.6166667, -0.65, 0., -0.65, 0.6833333, 0., 0.], 1e-6);
        assert!((metric(&p.metrics, "rloo/baseline_mean") - 3.25 / 7.0).abs() < 1e-7);
        assert!((metric(&p.metrics, "rloo/kl") - 0.0625).abs() < 1e-7);
        let mut exp = experience();
        exp.ref_logprobs = None;
        let e = rloo(json!({})).prepare(&exp).unwrap_err().to_string();
        assert!(e.contains("rloo: the host passed no `ref_logprobs`"), "{e}");
        // KL in the loss: the reward is left alone.
        let p = rloo(json!({"kl_in_reward": false})).prepare(&experience()).unwrap();
        let a = 2.0 / 3.0;
        assert_close(&values_of(&p.advantages.select(1, 0)), &[a, -a, 0., -a, a, 0., 0.], 1e-6);
    }

    /// normalize_advantages: mean 0, unbiased std sqrt((16/9)/6) = 0.5443311 → ±(2/3)/0.5444311.
    #[test]
    fn normalized_advantages_by_hand() {
        let p = rloo(json!({"beta": 0.0, "normalize_advantages": true})).prepare(&experience()).unwrap();
        let a = 1.2245199;
        assert_close(&values_of(&p.advantages.select(1, 0)), &[a, -a, 0., -a, a, 0., 0.], 1e-5);
    }

    /// b = 2, R = 3; row 0: 3 tokens, A = +1, log ratios [0, ln 1.3, ln 0.7];
    /// row 1: 2 tokens, A = −1, log ratios [ln 0.7, 0]. ref − logp: row 0 [0, 0.5, 0], row 1 [−0.5, 0].
    fn minibatch() -> (Minibatch, Tensor) {
        let (l13, l07) = (1.3f32.ln(), 0.7f32.ln());
        let logp = t2(&[&[-1.0, -1.0 + l13, -1.0 + l07], &[-2.0 + l07, -2.0, 0.0]]).set_requires_grad(true);
        let mb = Minibatch {
            logprobs: logp.shallow_clone(),
            old_logprobs: t2(&[&[-1.0, -1.0, -1.0], &[-2.0, -2.0, 0.0]]),
            ref_logprobs: Some(t2(&[&[-1.0, -0.5 + l13, -1.0 + l07], &[-2.5 + l07, -2.0, 0.0]])),
            values: None,
            old_values: None,
            advantages: t2(&[&[1.0, 1.0, 1.0], &[-1.0, -1.0, 0.0]]),
            returns: None,
            action_mask: t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]),
            entropy: None,
            rewards: Tensor::from_slice(&[1.0f32, 0.0]),
            step: 0,
            epoch: 0,
            accumulation_steps: 1,
            step_tokens: 0.0,
            step_rows: 0.0,
            behavior_logprobs: None,
        };
        (mb, logp)
    }

    fn loss_of(cfg: serde_json::Value) -> (f64, Vec<(String, f64)>) {
        let out = rloo(cfg).loss(&minibatch().0).unwrap();
        (out.loss.double_value(&[]), out.metrics)
    }

    /// Sequence ratios: row 0 1.3·0.7 = 0.91 (inside [0.8, 1.2]) → −0.91; row 1 0.7 with A = −1 →
    /// −min(−0.7, −0.8) = 0.8 (low-clipped). loss = (−0.91 + 0.8)/2 = −0.055.
    /// KL in the loss: k3 = [0, e^0.5 − 1.5 | e^−0.5 − 0.5, 0] → mean 0.2552520/5 = 0.0510504;
    /// loss = −0.055 + 0.05·0.0510504 = −0.0524475.
    #[test]
    fn sequence_loss_by_hand() {
        let (l, m) = loss_of(json!({}));
        assert!((l + 0.055).abs() < 1e-6, "{l}");
        assert!((metric(&m, "loss/policy") + 0.055).abs() < 1e-6);
        assert_eq!((metric(&m, "clip_ratio"), metric(&m, "clip_ratio/low_mean")), (0.5, 0.5));
        assert_eq!(metric(&m, "clip_ratio/high_mean"), 0.0);
        let approx_kl = 0.5 * (1.3f64.ln().powi(2) + 2.0 * 0.7f64.ln().powi(2)) / 5.0;
        assert!((metric(&m, "approx_kl") - approx_kl).abs() < 1e-6);
        assert!(m.iter().all(|(n, _)| n != "rloo/kl"));
        let (l, m) = loss_of(json!({"kl_in_reward": false}));
        assert!((l + 0.0524475).abs() < 1e-6, "{l}");
        assert!((metric(&m, "rloo/kl") - 0.0510504).abs() < 1e-6);
    }

    /// Token ratios: row 0 [1 → −1, 1.3 → clamp 1.2 → −1.2, 0.7 → −0.7], mean −0.9666667;
    /// row 1 [0.7, A = −1 → 0.8 (clipped), 1 → 1], mean 0.9 → loss −0.0333333; 2 of 5 tokens clipped.
    /// epsilon_high = 0.28: (0, 1) → −1.28, row 0 mean −0.9933333 → loss −0.0466667.
    #[test]
    fn token_loss_by_hand() {
        let (l, m) = loss_of(json!({"ratio_level": "token"}));
        assert!((l + 0.0333333).abs() < 1e-6, "{l}");
        assert!((metric(&m, "clip_ratio") - 0.4).abs() < 1e-6);
        assert!((metric(&m, "clip_ratio/low_mean") - 0.2).abs() < 1e-6);
        assert!((metric(&m, "clip_ratio/high_mean") - 0.2).abs() < 1e-6);
        let (l, _) = loss_of(json!({"ratio_level": "token", "epsilon_high": 0.28}));
        assert!((l + 0.0466667).abs() < 1e-6, "{l}");
    }

    /// Sequence level, KL in the loss: d/dlogp_t = −A_i·s_i/b where unclipped (row 0: −0.91/2 on
    /// each token; row 1 clipped: 0) plus β/5·(1 − e^(ref − logp)): (0, 1) −0.0064872, (1, 0) 0.0039347.
    /// Token level: row weights 1/(2·3), 1/(2·2); (0, 1) and (1, 0) clipped: [−1/6, 0, −0.7/6 | 0, 1/4].
    #[test]
    fn analytic_gradients() {
        let grad = |cfg: serde_json::Value| {
            let (mb, logp) = minibatch();
            rloo(cfg).loss(&mb).unwrap().loss.backward();
            values_of(&logp.grad())
        };
        let expected = [-0.455, -0.4614872, -0.455, 0.0039347, 0.0, 0.0];
        assert_close(&grad(json!({"kl_in_reward": false})), &expected, 1e-6);
        let expected = [-0.1666667, 0.0, -0.1166667, 0.0, 0.25, 0.0];
        assert_close(&grad(json!({"ratio_level": "token"})), &expected, 1e-6);
    }

    /// Central finite differences of the loss in each valid log-prob (clip bounds far from the
    /// ratios, so the loss is smooth there) match autograd, for both ratio levels.
    #[test]
    fn gradients_match_finite_differences() {
        for level in ["sequence", "token"] {
            let cfg = json!({"kl_in_reward": false, "epsilon": 0.5, "ratio_level": level});
            let (mb, logp) = minibatch();
            rloo(cfg.clone()).loss(&mb).unwrap().loss.backward();
            let analytic = values_of(&logp.grad());
            let base = values_of(&logp.detach());
            let h = 1e-2f32;
            for (k, &valid) in [true, true, true, true, true, false].iter().enumerate() {
                let at = |d: f32| {
                    let mut x = base.clone();
                    x[k] += d;
                    let (mut mb, _) = minibatch();
                    mb.logprobs = Tensor::from_slice(&x).view([2, 3]);
                    rloo(cfg.clone()).loss(&mb).unwrap().loss.double_value(&[]) as f32
                };
                let numeric = if valid { (at(h) - at(-h)) / (2.0 * h) } else { 0.0 };
                assert!((numeric - analytic[k]).abs() < 1e-3, "{level} [{k}]: {numeric} vs {}", analytic[k]);
            }
        }
    }

    #[test]
    fn requirements_defaults_and_resolved_config() {
        let r = rloo(json!({}));
        assert_eq!(r.requirements(), Requirements { reference: true, critic: false, entropy: false });
        assert!(!rloo(json!({"beta": 0.0})).requirements().reference);
        let c = &r.cfg;
        assert_eq!((c.beta, c.epsilon, c.epsilon_high, c.kl_in_reward), (0.05, 0.2, None, true));
        assert_eq!((c.normalize_advantages, c.ratio_level), (false, RatioLevel::Sequence));
        let resolved = r.resolved_config();
        assert_eq!((&resolved["ratio_level"], &resolved["beta"]), (&json!("sequence"), &json!(0.05)));
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| Rloo::new(&cfg.to_string(), &group_ctx()).unwrap_err().to_string();
        let one = Rloo::new("{}", &Context::default()).unwrap_err().to_string();
        assert!(one.starts_with("rollout.samples_per_prompt = 1: RLOO compares the samples of a prompt"), "{one}");
        let e = err(json!({"rloo_k": 4}));
        assert!(e.starts_with("rloo_k: unknown field"), "{e}");
        let e = err(json!({"beta": -0.1}));
        assert!(e.starts_with("beta: must be >= 0"), "{e}");
        let e = err(json!({"epsilon": 0}));
        assert!(e.starts_with("epsilon: must be > 0"), "{e}");
        let e = err(json!({"ratio_level": "word"}));
        assert!(e.starts_with("ratio_level: unknown variant `word`"), "{e}");
        let e = err(json!({"kl_in_reward": "yes"}));
        assert!(e.starts_with("kl_in_reward: invalid type"), "{e}");
    }
}
