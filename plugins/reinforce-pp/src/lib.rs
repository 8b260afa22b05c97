//! REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
//! Models"; OpenRLHF's `advantage_estimator = "reinforce"`, and `"reinforce_baseline"` with
//! `baseline = "group_mean"`): no critic — per-token KL penalties and the sequence reward summed
//! into discounted returns, whitened over the whole generation batch as advantages, PPO's clipped
//! ratio loss.
//!
//! Per generation batch ([`ReinforcePp::prepare`]); row `i` has `T_i` valid response tokens:
//!
//! ```text
//! r_i        ← r_i − mean_{j∈g(i)} r_j                     baseline = "group_mean" (REINFORCE++-baseline)
//! kl_t       = clamp(k(logp_old_t, logp_ref_t), −10, 10)    k1 = old − ref (kl_estimator)
//! rew_t      = −β·kl_t  (+ r_i at t = T_i − 1)               sequence reward on the last valid token
//! G_t        = rew_t + γ·G_{t+1}                             G_{T_i} = 0: discounted return, no critic
//! A_t        = (G_t − mean) / sqrt(var + 1e-8)               mean, var over every valid token of the batch
//! ```
//!
//! Per minibatch ([`ReinforcePp::loss`]):
//!
//! ```text
//! ρ_t   = exp(logp_t − logp_old_t)
//! L_t   = −min(ρ_t·A_t, clamp(ρ_t, 1 − ε, 1 + ε_high)·A_t)
//! loss  = Σ_t L_t·mask / Σ_t mask                         token_level_loss = true (OpenRLHF's default)
//!       = mean_i (Σ_t L_t·mask / Σ_t mask)                 token_level_loss = false
//! ```
//!
//! Differences from OpenRLHF's code (`compute_advantages_and_returns`, `compute_reward`,
//! `get_cumulative_returns`, `PolicyLoss`):
//! - The whitening is TRL's `masked_whiten` ([`ops::masked_whiten`]): unbiased variance,
//!   `rsqrt(var + 1e-8)`; OpenRLHF divides by the population variance, `rsqrt(max(var, 1e-8))`.
//!   With `N` valid tokens the advantages differ by the factor `sqrt((N − 1)/N)`.
//! - Padding holds advantage 0 here; OpenRLHF leaves `−mean·rstd` there (masked out of the loss).
//! - Groups come from `group_ids` (any order, any sizes; a group of one gets a centred reward of 0);
//!   OpenRLHF reshapes to `[prompts, n_samples_per_prompt]`.
//! - OpenRLHF forces `gamma = 1` for `reinforce_baseline`; here `gamma` applies to both.
//! - Not implemented: the adaptive KL controller, `reward_clip_range`, dual clip, the KL loss
//!   (`use_kl_loss`) and the vLLM importance-sampling corrections.
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! beta = 0.01                  # KL coefficient in the reward (OpenRLHF init_kl_coef); 0 = no reference
//! kl_estimator = "k1"          # "k1" | "k2" | "k3"
//! gamma = 1.0                  # discount of the returns
//! epsilon = 0.2                # lower ratio clip (and upper, unless epsilon_high)
//! # epsilon_high = 0.28        # upper ratio clip
//! baseline = "none"            # "none" (REINFORCE++) | "group_mean" (REINFORCE++-baseline)
//! token_level_loss = true      # token mean over the minibatch; false: mean of sequence means
//! ```

pub use rlhf_plugin_api::ops::KlEstimator;
use rlhf_plugin_api::ops::StdEstimator;
use rlhf_plugin_api::ops::{self, group_index, group_stats, masked, masked_mean, masked_row_sum, Metrics};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// What is subtracted from the sequence reward before the KL penalties are added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    /// Nothing (REINFORCE++).
    None,
    /// The mean reward of the sample's group (REINFORCE++-baseline).
    GroupMean,
}

/// The `[algorithm.config]` section; defaults are OpenRLHF's.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReinforcePpConfig {
    /// KL coefficient β of the per-token penalty in the reward (OpenRLHF `init_kl_coef`); 0 = no reference.
    pub beta: f64,
    /// Per-token KL estimator of the penalty: "k1" (OpenRLHF's default), "k2" or "k3".
    pub kl_estimator: KlEstimator,
    /// Discount γ of the returns.
    pub gamma: f64,
    /// Lower ratio clip ε: ratios are clamped to `[1 − ε, 1 + epsilon_high]`.
    pub epsilon: f64,
    /// Upper ratio clip; defaults to `epsilon`.
    pub epsilon_high: Option<f64>,
    /// "none" (REINFORCE++) or "group_mean" (REINFORCE++-baseline).
    pub baseline: Baseline,
    /// Token mean over the minibatch (true) or the mean of the sequences' token means (false).
    pub token_level_loss: bool,
}

impl Default for ReinforcePpConfig {
    fn default() -> Self {
        ReinforcePpConfig {
            beta: 0.01,
            kl_estimator: KlEstimator::K1,
            gamma: 1.0,
            epsilon: 0.2,
            epsilon_high: None,
            baseline: Baseline::None,
            token_level_loss: true,
        }
    }
}

impl ReinforcePpConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        ops::check_nonnegative("beta", self.beta)?;
        ops::check_unit_interval("gamma", self.gamma)?;
        ops::check_positive("epsilon", self.epsilon)?;
        if let Some(v) = self.epsilon_high {
            ops::check_positive("epsilon_high", v)?;
        }
        Ok(())
    }
}

/// REINFORCE++; stateless between batches.
#[derive(Debug)]
pub struct ReinforcePp {
    cfg: ReinforcePpConfig,
}

/// Discounted returns `G_t = x_t + γ·G_{t+1}` from the last slot backwards (`G_R = 0`).
///
/// # Shapes
/// `x [B, R]` (0 on padding); returns `[B, R]`.
pub fn discounted_returns(x: &Tensor, gamma: f64) -> Result<Tensor> {
    let (_, r) = x.size2()?;
    let mut g = x.f_select(1, r - 1)?.f_zeros_like()?; // [B]
    let mut columns = Vec::with_capacity(r as usize);
    for t in (0..r).rev() {
        g = x.f_select(1, t)?.f_add(&g.f_mul_scalar(gamma)?)?;
        columns.push(g.shallow_clone());
    }
    columns.reverse();
    Ok(Tensor::f_stack(&columns, 1)?)
}

impl Algorithm for ReinforcePp {
    fn new(config: &str, ctx: &Context) -> Result<Self> {
        let cfg: ReinforcePpConfig = parse_config(config)?;
        cfg.validate()?;
        if cfg.baseline == Baseline::GroupMean {
            ops::require_groups(ctx, "REINFORCE++-baseline")?;
        }
        Ok(ReinforcePp { cfg })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: self.cfg.beta != 0.0, critic: false, entropy: false }
    }

    fn resolved_config(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn describe_keys(&self) -> Vec<KeyDoc> {
        vec![
            KeyDoc {
                key: "beta",
                help: "coefficient of the per-token KL penalty in the reward; 0 = no reference model",
                peers: &[("OpenRLHF", "--init_kl_coef"), ("verl", "algorithm.kl_ctrl.kl_coef")],
            },
            KeyDoc {
                key: "kl_estimator",
                help: "per-token KL estimator of the penalty: k1, k2 or k3",
                peers: &[("OpenRLHF", "--kl_estimator"), ("verl", "algorithm.kl_penalty")],
            },
            KeyDoc {
                key: "gamma",
                help: "discount of the returns",
                peers: &[("OpenRLHF", "--gamma"), ("verl", "algorithm.gamma")],
            },
            KeyDoc {
                key: "epsilon",
                help: "lower ratio clip: ratios are clamped to [1 - epsilon, 1 + epsilon_high]",
                peers: &[("OpenRLHF", "--eps_clip"), ("verl", "actor_rollout_ref.actor.clip_ratio_low")],
            },
            KeyDoc {
                key: "epsilon_high",
                help: "upper ratio clip; unset = epsilon",
                peers: &[("verl", "actor_rollout_ref.actor.clip_ratio_high")],
            },
            KeyDoc {
                key: "baseline",
                help: "none (REINFORCE++) or group_mean (REINFORCE++-baseline)",
                peers: &[("OpenRLHF", "--advantage_estimator"), ("verl", "algorithm.adv_estimator")],
            },
            KeyDoc {
                key: "token_level_loss",
                help: "token mean over the minibatch (true) or the mean of the sequences' token means (false)",
                peers: &[("verl", "actor_rollout_ref.actor.loss_agg_mode")],
            },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.logprobs`, `exp.ref_logprobs`,
    /// `exp.action_mask [B, R]`; returns `advantages [B, R]` (0 on padding).
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let cfg = &self.cfg;
        let mask = &exp.action_mask; // [B, R]
        let valid = mask.f_gt(0.0)?;
        let mut metrics = Metrics::new();

        let mut score = exp.rewards.f_to_kind(Kind::Double)?; // [B]
        if cfg.baseline == Baseline::GroupMean {
            let (group, n_groups) = group_index(&exp.group_ids)?;
            let (mean_g, _) = group_stats(&score, &group, n_groups, StdEstimator::Population)?; // [G]
            let baseline = mean_g.f_index_select(0, &group)?; // [B]
            metrics.scalar("reinforce_pp/baseline_mean", &baseline.f_mean(Kind::Double)?)?;
            score = score.f_sub(&baseline)?;
        }
        // The sequence reward on each row's last valid token (an empty row keeps none).
        let score = score.f_to_kind(Kind::Float)?.f_unsqueeze(1)?; // [B, 1]
        let last = ops::last_index(&valid)?; // [B, 1]
        let mut rewards = masked(&mask.f_zeros_like()?.f_scatter(1, &last, &score)?, &valid)?; // [B, R]
        if cfg.beta != 0.0 {
            let reff = masked(ops::need(&exp.ref_logprobs, "ref_logprobs", "reinforce-pp")?, &valid)?;
            let old = masked(&exp.logprobs, &valid)?;
            let kl = masked(&ops::kl_estimate(&old, &reff, cfg.kl_estimator)?.f_clamp(-10.0, 10.0)?, &valid)?;
            rewards = rewards.f_sub(&kl.f_mul_scalar(cfg.beta)?)?;
            metrics.scalar("reinforce_pp/kl", &masked_mean(&kl, mask)?)?;
        }
        let returns = masked(&discounted_returns(&rewards, cfg.gamma)?, &valid)?; // [B, R]
        let advantages = ops::masked_whiten(&returns, mask)?; // [B, R]

        metrics
            .scalar("reinforce_pp/return", &masked_row_sum(&rewards, mask)?.f_mean(Kind::Float)?)?
            .scalar("reinforce_pp/returns_mean", &masked_mean(&returns, mask)?)?
            .scalar("reinforce_pp/advantages_max", &advantages.f_max()?)?
            .scalar("reinforce_pp/advantages_min", &advantages.f_min()?)?;
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
        let advantages = masked(&mb.advantages, &valid)?; // [b, R]
        let (low, high) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high.unwrap_or(cfg.epsilon));

        let ratio = log_ratio.f_exp()?; // ρ
        let surr1 = ratio.f_mul(&advantages)?;
        let surr2 = ratio.f_clamp(low, high)?.f_mul(&advantages)?;
        let per_token_loss = surr1.f_minimum(&surr2)?.f_neg()?; // [b, R]
        let loss = if cfg.token_level_loss {
            // The token mean over the whole optimizer step (accumulation, data-parallel ranks).
            ops::token_mean(&per_token_loss, mask, mb.accumulation_steps, mb.step_tokens)?
        } else {
            // Mean over the non-empty rows of each row's token mean (OpenRLHF's `aggregate_loss`).
            let lengths = mask.f_sum_dim_intlist(1, false, Kind::Float)?; // [b]
            let row_means = masked_row_sum(&per_token_loss, mask)?.f_div(&lengths.f_clamp_min(1.0)?)?;
            let rows = lengths.f_gt(0.0)?.f_to_kind(Kind::Float)?; // [b]
            if mb.accumulation_steps > 1 {
                // Over the step's samples (each micro-batch's share of them).
                ops::row_mean(&row_means.f_mul(&rows)?, mb.accumulation_steps, mb.step_rows)?
            } else {
                row_means.f_mul(&rows)?.f_sum(Kind::Float)?.f_div(&rows.f_sum(Kind::Float)?.f_clamp_min(1.0)?)?
            }
        };

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let is_low = ratio.f_lt(low)?.f_logical_and(&advantages.f_lt(0.0)?)?;
            let is_high = ratio.f_gt(high)?.f_logical_and(&advantages.f_gt(0.0)?)?;
            Ok(Metrics::new()
                .scalar("loss/policy", &loss)?
                .scalar("clip_ratio", &ops::masked_fraction(&is_low.f_logical_or(&is_high)?, mask)?)?
                .scalar("clip_ratio/low_mean", &ops::masked_fraction(&is_low, mask)?)?
                .scalar("clip_ratio/high_mean", &ops::masked_fraction(&is_high, mask)?)?
                .scalar("approx_kl", &ops::approx_kl(&log_ratio, mask)?)?
                .finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

rlhf_plugin_api::export_algorithm!(
    ReinforcePp,
    name: "reinforce-pp",
    description: "REINFORCE++: KL-shaped token rewards, discounted returns whitened over the batch, clipped ratio; no critic"
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

    fn rpp(cfg: serde_json::Value) -> ReinforcePp {
        ReinforcePp::new(&cfg.to_string(), &group_ctx()).unwrap()
    }

    /// Two rows: row 0, 3 tokens, reward 1, old − ref = [0.5, 0, −0.5]; row 1, 2 tokens, reward 0,
    /// old − ref = [0.2, 0.2] (padding 0).
    fn small_batch() -> Experience {
        Experience {
            rewards: Tensor::from_slice(&[1.0f32, 0.0]),
            logprobs: t2(&[&[-1.0, -1.0, -1.0], &[-2.0, -2.0, 0.0]]),
            ref_logprobs: Some(t2(&[&[-1.5, -1.0, -0.5], &[-2.2, -2.2, 0.0]])),
            values: None,
            action_mask: t2(&[&[1., 1., 1.], &[1., 1., 0.]]),
            group_ids: Tensor::from_slice(&[0i64, 1]),
            step: 0,
            behavior_logprobs: None,
        }
    }

    /// β = 0.1, k1: rewards row 0 [−0.05, 0, 0.05 + 1], row 1 [−0.02, −0.02].
    /// γ = 1: returns [1.0, 1.05, 1.05 | −0.04, −0.02]; mean 3.04/5 = 0.608, unbiased variance
    ///   (0.392² + 2·0.442² + 0.648² + 0.628²)/4 = 0.3396700 → A = (G − 0.608)/0.5828122.
    /// γ = 0.5: row 0 [−0.05 + 0.5·0.525, 0 + 0.5·1.05, 1.05] = [0.2125, 0.525, 1.05],
    ///   row 1 [−0.02 − 0.01, −0.02] = [−0.03, −0.02] → whitened likewise (mean 0.3475).
    #[test]
    fn kl_shaped_returns_whitened_by_hand() {
        let p = rpp(json!({"beta": 0.1})).prepare(&small_batch()).unwrap();
        let expected = [0.6726009, 0.7583919, 0.7583919, -1.1118505, -1.0775341, 0.0];
        assert_close(&values_of(&p.advantages), &expected, 1e-5);
        assert!((metric(&p.metrics, "reinforce_pp/kl") - 0.4 / 5.0).abs() < 1e-7);
        assert!((metric(&p.metrics, "reinforce_pp/return") - (1.0 - 0.04) / 2.0).abs() < 1e-6);
        assert!((metric(&p.metrics, "reinforce_pp/returns_mean") - 0.608).abs() < 1e-6);
        assert!(p.returns.is_none());
        let p = rpp(json!({"beta": 0.1, "gamma": 0.5})).prepare(&small_batch()).unwrap();
        let expected = [-0.2980198, 0.3918408, 1.5508066, -0.8333516, -0.811276, 0.0];
        assert_close(&values_of(&p.advantages), &expected, 1e-5);
        // k3 of old − ref = [0.5, 0, −0.5 | 0.2, 0.2]: e^−0.5 − 0.5, 0, e^0.5 − 1.5, 2·(e^−0.2 − 0.8).
        let p = rpp(json!({"beta": 0.1, "kl_estimator": "k3"})).prepare(&small_batch()).unwrap();
        let k3 = 0.1065307 + 0.1487213 + 2.0 * 0.0187308;
        assert!((metric(&p.metrics, "reinforce_pp/kl") - k3 / 5.0).abs() < 1e-6);
    }

    /// Group 7 = rows 0, 1, 3, 4 (interleaved with group 3) with rewards [1, 0, 0, 1]; group 3 =
    /// rows 2, 5 with equal rewards [0.5, 0.5]; group 42 = row 6 alone (0.3). Lengths 3, 2, 1, 3,
    /// 2, 3, 2 (16 tokens).
    fn grouped_batch() -> Experience {
        Experience {
            rewards: Tensor::from_slice(&[1.0f32, 0.0, 0.5, 0.0, 1.0, 0.5, 0.3]),
            logprobs: Tensor::zeros([7, 3], (Kind::Float, tch::Device::Cpu)),
            ref_logprobs: None,
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

    /// β = 0, γ = 1: every valid token's return is its row's (centred) reward.
    /// group_mean: [±0.5 for group 7, 0 for the equal pair, 0 for the singleton]; token mean
    ///   (1.5 − 1 − 1.5 + 1)/16 = 0, unbiased variance 10·0.25/15 → ±0.5/0.4082483 = ±1.2247449.
    /// none: returns [1, 0, 0.5, 0, 1, 0.5, 0.3] per row; mean 7.6/16 = 0.475, whitened:
    ///   1 → 1.2683478, 0 → −1.1475528, 0.5 → 0.0603975, 0.3 → −0.4227826.
    #[test]
    fn group_mean_baseline_by_hand() {
        let p = rpp(json!({"beta": 0.0, "baseline": "group_mean"})).prepare(&grouped_batch()).unwrap();
        let a = 1.2247449;
        #[rustfmt::skip]
        let expected = [a, a, a,  -a, -a, 0.,  0., 0., 0.,  -a, -a, -a,  a, a, 0.,  0., 0., 0.,  0., 0., 0.];
        assert_close(&values_of(&p.advantages), &expected, 1e-5);
        assert!((metric(&p.metrics, "reinforce_pp/baseline_mean") - (2.0 + 1.0 + 0.3) / 7.0).abs() < 1e-7);
        let p = rpp(json!({"beta": 0.0})).prepare(&grouped_batch()).unwrap();
        let (one, zero, half, small) = (1.2683478, -1.1475528, 0.0603975, -0.4227826);
        #[rustfmt::skip]
        let expected = [one, one, one,  zero, zero, 0.,  half, 0., 0.,  zero, zero, zero,  one, one, 0.,
                        half, half, half,  small, small, 0.];
        assert_close(&values_of(&p.advantages), &expected, 1e-5);
        assert!(p.metrics.iter().all(|(n, _)| n != "reinforce_pp/baseline_mean" && n != "reinforce_pp/kl"));
    }

    #[test]
    fn discounted_returns_by_hand() {
        let g = discounted_returns(&t2(&[&[1.0, 2.0, 4.0]]), 0.5).unwrap();
        assert_close(&values_of(&g), &[1.0 + 0.5 * 4.0, 2.0 + 0.5 * 4.0, 4.0], 1e-7);
    }

    /// b = 2, R = 3, per-token advantages row 0 [+1, +1, +1], row 1 [−1, −1]; ratios row 0
    /// [1, 1.3, 0.7], row 1 [0.7, 1].
    fn minibatch() -> (Minibatch, Tensor) {
        let (l13, l07) = (1.3f32.ln(), 0.7f32.ln());
        let logp = t2(&[&[-1.0, -1.0 + l13, -1.0 + l07], &[-2.0 + l07, -2.0, 0.0]]).set_requires_grad(true);
        let mb = Minibatch {
            logprobs: logp.shallow_clone(),
            old_logprobs: t2(&[&[-1.0, -1.0, -1.0], &[-2.0, -2.0, 0.0]]),
            ref_logprobs: None,
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

    /// L = [−1, −min(1.3, 1.2) = −1.2, −0.7 | −min(−0.7, −0.8) = 0.8, 1.0].
    /// token_level_loss: (−2.9 + 1.8)/5 = −0.22; else (−2.9/3 + 1.8/2)/2 = −0.0333333.
    /// Clipped: (0, 1) high, (1, 0) low → 2/5.
    #[test]
    fn loss_by_hand() {
        let out = rpp(json!({})).loss(&minibatch().0).unwrap();
        assert!((out.loss.double_value(&[]) + 0.22).abs() < 1e-6);
        assert!((metric(&out.metrics, "clip_ratio") - 0.4).abs() < 1e-6);
        assert!((metric(&out.metrics, "clip_ratio/high_mean") - 0.2).abs() < 1e-6);
        assert!((metric(&out.metrics, "clip_ratio/low_mean") - 0.2).abs() < 1e-6);
        let approx_kl = 0.5 * (1.3f64.ln().powi(2) + 2.0 * 0.7f64.ln().powi(2)) / 5.0;
        assert!((metric(&out.metrics, "approx_kl") - approx_kl).abs() < 1e-6);
        let out = rpp(json!({"token_level_loss": false})).loss(&minibatch().0).unwrap();
        assert!((out.loss.double_value(&[]) + 0.0333333).abs() < 1e-6);
        let out = rpp(json!({"epsilon_high": 0.28})).loss(&minibatch().0).unwrap();
        assert!((out.loss.double_value(&[]) + 0.236).abs() < 1e-6); // (−2.98 + 1.8)/5
    }

    /// d loss/d logp_t = −A_t·ρ_t/5 where unclipped, 0 where clipped:
    /// [−0.2, 0, −0.14 | 0, 0.2, 0]; and central finite differences agree with a wide clip.
    #[test]
    fn gradients_analytic_and_finite_differences() {
        let (mb, logp) = minibatch();
        rpp(json!({})).loss(&mb).unwrap().loss.backward();
        assert_close(&values_of(&logp.grad()), &[-0.2, 0.0, -0.14, 0.0, 0.2, 0.0], 1e-6);
        for token_level_loss in [true, false] {
            let cfg = json!({"epsilon": 0.5, "token_level_loss": token_level_loss});
            let (mb, logp) = minibatch();
            rpp(cfg.clone()).loss(&mb).unwrap().loss.backward();
            let analytic = values_of(&logp.grad());
            let base = values_of(&logp.detach());
            let h = 1e-2f32;
            for k in 0..5 {
                let at = |d: f32| {
                    let mut x = base.clone();
                    x[k] += d;
                    let (mut mb, _) = minibatch();
                    mb.logprobs = Tensor::from_slice(&x).view([2, 3]);
                    rpp(cfg.clone()).loss(&mb).unwrap().loss.double_value(&[]) as f32
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                assert!((numeric - analytic[k]).abs() < 1e-3, "[{k}]: {numeric} vs {}", analytic[k]);
            }
        }
    }

    #[test]
    fn requirements_defaults_and_resolved_config() {
        let r = rpp(json!({}));
        assert_eq!(r.requirements(), Requirements { reference: true, critic: false, entropy: false });
        assert!(!rpp(json!({"beta": 0.0})).requirements().reference);
        let c = &r.cfg;
        assert_eq!((c.beta, c.gamma, c.epsilon, c.epsilon_high), (0.01, 1.0, 0.2, None));
        assert_eq!((c.kl_estimator, c.baseline, c.token_level_loss), (KlEstimator::K1, Baseline::None, true));
        let resolved = r.resolved_config();
        assert_eq!((&resolved["baseline"], &resolved["kl_estimator"]), (&json!("none"), &json!("k1")));
        let mut exp = small_batch();
        exp.ref_logprobs = None;
        let e = r.cfg.clone();
        let e = ReinforcePp { cfg: e }.prepare(&exp).unwrap_err().to_string();
        assert!(e.contains("reinforce-pp: the host passed no `ref_logprobs`"), "{e}");
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| ReinforcePp::new(&cfg.to_string(), &group_ctx()).unwrap_err().to_string();
        // One sample per prompt: REINFORCE++ runs, its group-mean baseline would centre every reward to 0.
        assert!(ReinforcePp::new("{}", &Context::default()).is_ok());
        let one = ReinforcePp::new(r#"{"baseline": "group_mean"}"#, &Context::default()).unwrap_err().to_string();
        assert!(one.starts_with("rollout.samples_per_prompt = 1: REINFORCE++-baseline compares"), "{one}");
        let e = err(json!({"init_kl_coef": 0.1}));
        assert!(e.starts_with("init_kl_coef: unknown field"), "{e}");
        let e = err(json!({"gamma": 1.5}));
        assert!(e.starts_with("gamma: must be in [0, 1]"), "{e}");
        let e = err(json!({"baseline": "rloo"}));
        assert!(e.starts_with("baseline: unknown variant `rloo`"), "{e}");
        let e = err(json!({"kl_estimator": "k4"}));
        assert!(e.starts_with("kl_estimator: unknown variant"), "{e}");
        let e = err(json!({"epsilon_high": -1.0}));
        assert!(e.starts_with("epsilon_high: must be > 0"), "{e}");
    }
}
