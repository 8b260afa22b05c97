//! Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024; TRL's `GRPOTrainer`): no
//! critic — each response's advantage is its reward standardised within the group of responses
//! sampled for the same prompt, shared by all its tokens.
//!
//! Per generation batch ([`Grpo::prepare`]), for sample `i` in group `g` (samples sharing a `group_id`;
//! groups need not be contiguous nor of equal size):
//!
//! ```text
//! mean_g = 1/G_g Σ_{j∈g} r_j         std_g = sqrt(1/G_g Σ_{j∈g} (r_j − mean_g)²)
//! A_i    = (r_i − mean_g) / (std_g + 1e-4)                 broadcast over the response's tokens
//! ```
//!
//! Per minibatch ([`Grpo::loss`]), per valid token `t`:
//!
//! ```text
//! ρ_t   = exp(logp_t − logp_old_t)                        on-policy logp_old = logp.detach():
//!                                                          exp(logp − logp.detach()), 1 in value
//! l1_t  = ρ_t·A,   l2_t = clamp(ρ_t, 1 − ε, 1 + ε_high)·A
//! KL_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1     (k3, non-negative)
//! L_t   = −min(l1_t, l2_t) + β·KL_t
//! loss  = mean_i ( Σ_t L_t·mask / Σ_t mask )               loss_type = "grpo" (DeepSeekMath's)
//! ```
//!
//! Options and where TRL differs (DeepSeekMath's formula is the default):
//! - `std`: DeepSeekMath divides by the population std; TRL uses `torch.std`, unbiased (`"unbiased"`).
//!   A group of one sample has std 0 either way (and A = 0), never NaN.
//! - `scale_rewards` (TRL's): `"group"` (default), `"batch"` — divide by the std of the whole batch's
//!   rewards instead (centring stays per group) — or `"none"` (Dr. GRPO: `A = r − mean_g`).
//! - `epsilon_high` (DAPO's clip-higher): the upper clip bound; defaults to `epsilon`.
//! - `loss_type` (TRL's names): `"grpo"` — each sequence's token mean, then the batch mean;
//!   `"bnpo"` — `Σ L·mask / Σ mask` over the minibatch;
//!   `"dr_grpo"` — `Σ L·mask / (b·max_completion_length)`;
//!   `"dapo"` — `Σ L·mask / (N / k)`: TRL normalises by `N`, the valid tokens of the whole
//!   gradient-accumulated batch (`step_tokens`), and the host divides each of the `k` accumulated
//!   minibatch losses by `k`, so the step's gradient is the whole batch's token mean. With one
//!   minibatch per optimizer step (`k = 1`) `N` is the minibatch's count and `dapo` equals `bnpo`.
//!   TRL's default `loss_type` changed across versions (recent ones use `dapo`).
//! - `beta`: TRL's default is 0.0 (no reference model at all); ours is 0.04 (DeepSeekMath's, TRL's
//!   former default). With `beta = 0` the host computes no reference log-probs.
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! beta = 0.04                  # KL weight; 0 = no reference model
//! epsilon = 0.2                # lower ratio clip (and upper, unless epsilon_high)
//! # epsilon_high = 0.28        # DAPO clip-higher
//! loss_type = "grpo"           # "grpo" | "bnpo" | "dr_grpo" | "dapo"
//! scale_rewards = "group"      # "group" | "batch" | "none"
//! std = "population"           # "population" | "unbiased"
//! # max_completion_length = 256  # dr_grpo's normaliser (default: the minibatch's R)
//! log_entropy = false          # log the policy's entropy
//! ```

pub use rlhf_plugin_api::ops::StdEstimator;
use rlhf_plugin_api::ops::{self, group_index, group_stats, masked, masked_mean, masked_row_sum, Metrics};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// How per-token losses are reduced to the minibatch loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Mean over sequences of each sequence's token mean (DeepSeekMath).
    Grpo,
    /// Token mean over the minibatch.
    Bnpo,
    /// Token sum over `b · max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// Token sum over the valid tokens of the accumulated batch; equals `bnpo` here.
    Dapo,
}

/// What the group-centred rewards are divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// The group's std (DeepSeekMath).
    Group,
    /// The std of the whole batch's rewards.
    Batch,
    /// Nothing (Dr. GRPO).
    None,
}

/// The `[algorithm]` section; defaults follow DeepSeekMath.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoConfig {
    /// Weight β of the k3 KL to the reference (DeepSeekMath 0.04, TRL default 0.0; 0 = no reference).
    pub beta: f64,
    /// Lower ratio clip ε: ratios are clamped to `[1 − ε, 1 + epsilon_high]`.
    pub epsilon: f64,
    /// Upper ratio clip (DAPO clip-higher); defaults to `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Loss reduction: "grpo" (DeepSeekMath), "bnpo", "dr_grpo" or "dapo".
    pub loss_type: LossType,
    /// Advantage scaling: "group" (DeepSeekMath), "batch" or "none".
    pub scale_rewards: ScaleRewards,
    /// Standard deviation estimator: "population" (DeepSeekMath) or "unbiased" (TRL).
    pub std: StdEstimator,
    /// dr_grpo's constant normaliser; defaults to the minibatch's `R`.
    pub max_completion_length: Option<u64>,
    /// Ask the host for per-token entropy and log it as `entropy` (not part of the loss).
    pub log_entropy: bool,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            beta: 0.04,
            epsilon: 0.2,
            epsilon_high: None,
            loss_type: LossType::Grpo,
            scale_rewards: ScaleRewards::Group,
            std: StdEstimator::Population,
            max_completion_length: None,
            log_entropy: false,
        }
    }
}

impl GrpoConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        ops::check_nonnegative("beta", self.beta)?;
        ops::check_positive("epsilon", self.epsilon)?;
        if let Some(v) = self.epsilon_high {
            ops::check_positive("epsilon_high", v)?;
        }
        if self.max_completion_length == Some(0) {
            return Err(PluginError::config("max_completion_length", "must be > 0"));
        }
        Ok(())
    }
}

/// GRPO; stateless between batches.
#[derive(Debug)]
pub struct Grpo {
    cfg: GrpoConfig,
}

impl Algorithm for Grpo {
    fn new(config: &str, ctx: &Context) -> Result<Self> {
        let cfg: GrpoConfig = parse_config(config)?;
        cfg.validate()?;
        ops::require_groups(ctx, "GRPO")?;
        Ok(Grpo { cfg })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: self.cfg.beta != 0.0, critic: false, entropy: self.cfg.log_entropy }
    }

    fn resolved_config(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn describe_keys(&self) -> Vec<KeyDoc> {
        vec![
            KeyDoc { key: "beta", help: "weight of the k3 KL to the reference in the loss; 0 = no reference model", peers: &[("TRL", "beta"), ("verl", "actor_rollout_ref.actor.kl_loss_coef"), ("OpenRLHF", "--init_kl_coef")] },
            KeyDoc { key: "epsilon", help: "lower ratio clip: ratios are clamped to [1 - epsilon, 1 + epsilon_high]", peers: &[("TRL", "epsilon"), ("verl", "actor_rollout_ref.actor.clip_ratio_low"), ("OpenRLHF", "--eps_clip")] },
            KeyDoc { key: "epsilon_high", help: "upper ratio clip (DAPO's clip-higher); unset = epsilon", peers: &[("TRL", "epsilon_high"), ("verl", "actor_rollout_ref.actor.clip_ratio_high")] },
            KeyDoc { key: "loss_type", help: "loss reduction: grpo (mean of sequence means), bnpo, dr_grpo or dapo (token mean over the accumulated batch)", peers: &[("TRL", "loss_type"), ("verl", "actor_rollout_ref.actor.loss_agg_mode")] },
            KeyDoc { key: "scale_rewards", help: "advantage scaling: group (divide by the group's std), batch or none", peers: &[("TRL", "scale_rewards"), ("verl", "algorithm.norm_adv_by_std_in_grpo")] },
            KeyDoc { key: "std", help: "standard deviation estimator of the scaling: population (DeepSeekMath) or unbiased (TRL)", peers: &[] },
            KeyDoc { key: "max_completion_length", help: "dr_grpo's constant normaliser; unset = the minibatch's response length", peers: &[("TRL", "max_completion_length")] },
            KeyDoc { key: "log_entropy", help: "log the policy's per-token entropy as `entropy` (not part of the loss)", peers: &[] },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.action_mask [B, R]`; returns `advantages [B, R]`
    /// (each sample's A on its valid tokens, 0 on padding) and no returns.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let mask = &exp.action_mask; // [B, R]
        let valid = mask.f_gt(0.0)?; // [B, R] bool

        // Statistics in f64, so that a group of equal rewards has a std of exactly 0.
        let rewards = exp.rewards.f_to_kind(Kind::Double)?; // [B]
        let (group, n_groups) = group_index(&exp.group_ids)?; // [B] in 0..G
        let (mean_g, std_g) = group_stats(&rewards, &group, n_groups, self.cfg.std)?; // [G], [G]
        let centered = rewards.f_sub(&mean_g.f_index_select(0, &group)?)?; // r_i − mean_g, [B]
        let advantages = match self.cfg.scale_rewards {
            ScaleRewards::Group => centered.f_div(&std_g.f_index_select(0, &group)?.f_add_scalar(1e-4)?)?,
            ScaleRewards::Batch => {
                let whole_batch = group.f_zeros_like()?; // one group: every sample
                let (_, std_batch) = group_stats(&rewards, &whole_batch, 1, self.cfg.std)?; // [1]
                centered.f_div(&std_batch.f_add_scalar(1e-4)?)?
            }
            ScaleRewards::None => centered,
        }; // [B]

        let zero_std = std_g.f_lt(1e-8)?.f_to_kind(Kind::Double)?; // [G]
        let metrics = Metrics::new()
            .scalar("grpo/advantages_mean", &advantages.f_mean(Kind::Double)?)?
            .scalar("grpo/advantages_std", &advantages.f_var_dim(0i64, false, false)?.f_sqrt()?)?
            .scalar("reward_std", &std_g.f_mean(Kind::Double)?)?
            .scalar("grpo/frac_zero_std_groups", &zero_std.f_mean(Kind::Double)?)?
            .value("grpo/num_groups", n_groups as f64)
            .finish();
        let advantages = ops::per_token(&advantages.f_to_kind(mask.kind())?, &valid)?; // [B, R]
        Ok(Prepared { advantages, returns: None, metrics })
    }

    /// # Shapes
    /// Every `mb` tensor `[b, R]` (`rewards [b]`, unused); the loss is a scalar.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let cfg = &self.cfg;
        let mask = &mb.action_mask; // [b, R]
        let (_, r) = mask.size2()?;
        let valid = mask.f_gt(0.0)?; // [b, R] bool
        let logp = masked(&mb.logprobs, &valid)?; // [b, R], grad
        let old = masked(&mb.old_logprobs, &valid)?; // [b, R]
        let advantages = masked(&mb.advantages, &valid)?; // [b, R]
        let (epsilon_low, epsilon_high) = (cfg.epsilon, cfg.epsilon_high.unwrap_or(cfg.epsilon));

        let log_ratio = logp.f_sub(&old)?; // [b, R]
        let coef_1 = log_ratio.f_exp()?; // ρ
        let coef_2 = coef_1.f_clamp(1.0 - epsilon_low, 1.0 + epsilon_high)?;
        let per_token_loss1 = coef_1.f_mul(&advantages)?;
        let per_token_loss2 = coef_2.f_mul(&advantages)?;
        let pg_per_token = per_token_loss1.f_minimum(&per_token_loss2)?.f_neg()?; // [b, R]
        let per_token_kl = if cfg.beta != 0.0 {
            let reff = masked(ops::need(&mb.ref_logprobs, "ref_logprobs", "grpo")?, &valid)?; // [b, R]
            let d = reff.f_sub(&logp)?; // ref − logp
            Some(d.f_exp()?.f_sub(&d)?.f_sub_scalar(1.0)?) // k3, [b, R]
        } else {
            None
        };
        let per_token_loss = match &per_token_kl {
            Some(kl) => pg_per_token.f_add(&kl.f_mul_scalar(cfg.beta)?)?,
            None => pg_per_token.shallow_clone(),
        }; // [b, R]
        let max_completion_length = cfg.max_completion_length.map_or(r, |l| l as i64);
        let loss = aggregate(&per_token_loss, mask, cfg.loss_type, max_completion_length, mb)?; // []

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let is_low_clipped = coef_1.f_lt(1.0 - epsilon_low)?.f_logical_and(&advantages.f_lt(0.0)?)?; // [b, R]
            let is_high_clipped = coef_1.f_gt(1.0 + epsilon_high)?.f_logical_and(&advantages.f_gt(0.0)?)?;
            let is_region_clipped = is_low_clipped.f_logical_or(&is_high_clipped)?;
            let mut m = Metrics::new();
            m.scalar("loss/policy", &aggregate(&pg_per_token, mask, cfg.loss_type, max_completion_length, mb)?)?
                .scalar("clip_ratio", &ops::masked_fraction(&is_region_clipped, mask)?)?
                .scalar("clip_ratio/low_mean", &ops::masked_fraction(&is_low_clipped, mask)?)?
                .scalar("clip_ratio/high_mean", &ops::masked_fraction(&is_high_clipped, mask)?)?
                .scalar("approx_kl", &ops::approx_kl(&log_ratio, mask)?)?;
            if let Some(kl) = &per_token_kl {
                m.scalar("kl", &masked_mean(kl, mask)?)?;
            }
            if let Some(h) = &mb.entropy {
                m.scalar("entropy", &masked_mean(&masked(h, &valid)?, mask)?)?;
            }
            Ok(m.finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

/// Reduces per-token losses to the minibatch loss according to `loss_type`.
///
/// # Shapes
/// `per_token`, `mask`: `[b, R]`; returns a scalar.
fn aggregate(
    per_token: &Tensor,
    mask: &Tensor,
    loss_type: LossType,
    max_completion_length: i64,
    mb: &Minibatch,
) -> Result<Tensor> {
    let (b, _r) = mask.size2()?;
    let row_sums = masked_row_sum(per_token, mask)?; // Σ_t L·mask, [b]
    Ok(match loss_type {
        // mean_i (Σ_t L·mask / Σ_t mask), over the step's samples when it has several micro-batches
        LossType::Grpo => {
            let row_lengths = mask.f_sum_dim_intlist(1, false, Kind::Float)?.f_clamp_min(1.0)?; // [b]
            ops::row_mean(&row_sums.f_div(&row_lengths)?, mb.accumulation_steps, mb.step_rows)?
        }
        // Σ L·mask / (N / k) over the k accumulated minibatches' N tokens
        LossType::Dapo if mb.accumulation_steps > 1 => {
            let share = mb.step_tokens / mb.accumulation_steps as f64;
            row_sums.f_sum(Kind::Float)?.f_div_scalar(share.max(1.0))?
        }
        // Σ L·mask / Σ mask
        LossType::Bnpo | LossType::Dapo => {
            row_sums.f_sum(Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?)?
        }
        // Σ L·mask / (b · max_completion_length), b the step's samples / k with k micro-batches
        LossType::DrGrpo => {
            let rows = if mb.accumulation_steps > 1 { mb.step_rows / mb.accumulation_steps as f64 } else { b as f64 };
            row_sums.f_sum(Kind::Float)?.f_div_scalar(rows.max(1.0) * max_completion_length as f64)?
        }
    })
}

rlhf_plugin_api::export_algorithm!(
    Grpo,
    name: "grpo",
    description: "GRPO: group-standardised rewards as advantages, clipped ratio, k3 KL to the reference; no critic"
);

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_plugin_api::testing::{assert_close, metric, t2, values_of};
    use serde_json::json;
    use tch::Device;

    const NAN: f32 = f32::NAN;

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 4 }
    }

    fn grpo(cfg: serde_json::Value) -> Grpo {
        Grpo::new(&cfg.to_string(), &ctx()).unwrap()
    }

    /// Group 7 = rows 0, 1, 3, 4 with rewards [1, 0, 0, 1]; group 3 = rows 2, 5 with [0.5, 0.5]
    /// (interleaved, unequal sizes).
    fn experience() -> Experience {
        Experience {
            rewards: Tensor::from_slice(&[1.0f32, 0.0, 0.5, 0.0, 1.0, 0.5]),
            logprobs: Tensor::zeros([6, 3], (Kind::Float, Device::Cpu)),
            ref_logprobs: None,
            values: None,
            action_mask: t2(&[
                &[1., 1., 1.],
                &[1., 1., 0.],
                &[1., 0., 0.],
                &[1., 1., 1.],
                &[1., 1., 0.],
                &[1., 1., 1.],
            ]),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 7, 7, 3]),
            step: 0,
            behavior_logprobs: None,
        }
    }

    /// Group 7: mean 0.5, population std sqrt(¼·4·0.25) = 0.5 → A = ±0.5/(0.5 + 1e-4) = ±0.9998000.
    /// Group 3: std 0 → A = 0; it is one of two groups with zero std. reward_std = (0.5 + 0)/2.
    /// advantages_std: [a, −a, 0, −a, a, 0] → a·sqrt(4/6) = 0.8163333.
    #[test]
    fn group_advantages_by_hand() {
        let p = grpo(json!({})).prepare(&experience()).unwrap();
        let a = 0.5 / 0.5001;
        #[rustfmt::skip]
        let expected = [a, a, a,  -a, -a, 0.,  0., 0., 0.,  -a, -a, -a,  a, a, 0.,  0., 0., 0.];
        assert_close(&values_of(&p.advantages), &expected, 1e-6);
        assert!(p.returns.is_none());
        assert_eq!(metric(&p.metrics, "grpo/frac_zero_std_groups"), 0.5);
        assert!((metric(&p.metrics, "reward_std") - 0.25).abs() < 1e-9);
        assert!((metric(&p.metrics, "grpo/advantages_std") - 0.8163333).abs() < 1e-6);
        assert_eq!(metric(&p.metrics, "grpo/num_groups"), 2.0);
    }

    /// unbiased: std_7 = sqrt(1/3·4·0.25) = 0.5773503 → A = 0.5/0.5774503 = 0.8658754.
    /// batch: rewards' population std = sqrt(1/6·4·0.25) = 0.4082483 → A = 0.5/0.4083483 = 1.2244449
    ///   (group 3 still centred on its own mean → 0).
    /// none: A = r − mean_g = ±0.5.
    #[test]
    fn std_and_scaling_options() {
        let first_tokens = |cfg: serde_json::Value| {
            let p = grpo(cfg).prepare(&experience()).unwrap();
            values_of(&p.advantages.select(1, 0))
        };
        let a = 0.8658754;
        assert_close(&first_tokens(json!({"std": "unbiased"})), &[a, -a, 0., -a, a, 0.], 1e-6);
        let a = 1.2244449;
        assert_close(&first_tokens(json!({"scale_rewards": "batch"})), &[a, -a, 0., -a, a, 0.], 1e-6);
        assert_close(&first_tokens(json!({"scale_rewards": "none"})), &[0.5, -0.5, 0., -0.5, 0.5, 0.], 1e-7);
    }

    /// A group of one sample: std 0 under both estimators (no NaN), A = 0.
    #[test]
    fn singleton_group_is_finite() {
        for std in ["population", "unbiased"] {
            let mut exp = experience();
            exp.group_ids = Tensor::from_slice(&[7i64, 7, 42, 7, 7, 3]);
            let p = grpo(json!({ "std": std })).prepare(&exp).unwrap();
            let adv = values_of(&p.advantages.select(1, 0));
            assert!(adv.iter().all(|x| x.is_finite()), "{adv:?}");
            assert_eq!((adv[2], adv[5]), (0.0, 0.0));
            assert_eq!(metric(&p.metrics, "grpo/frac_zero_std_groups"), 2.0 / 3.0);
        }
    }

    /// b = 2, R = 3; row 0: 3 tokens, A = +1; row 1: 2 tokens, A = −1, slot 2 garbage.
    /// ε = 0.2, ε_high = 0.28, β = 0.04. logp − old and ref − logp per token:
    ///   (0,0): ρ = 1    → −1;                                     d = 0    → k3 = 0
    ///   (0,1): ρ = 1.3  → clamp 1.28: −min(1.3, 1.28) = −1.28     d = 0.5  → k3 = e^0.5 − 1.5 = 0.1487213
    ///   (0,2): ρ = 0.7  → clamp 0.8: −min(0.7, 0.8) = −0.7        d = 0
    ///   (1,0): ρ = 0.7, A = −1 → −min(−0.7, −0.8) = 0.8           d = −0.5 → k3 = e^−0.5 − 0.5 = 0.1065307
    ///   (1,1): ρ = 1, A = −1 → 1.0                                d = 0
    /// L = [−1, −1.28 + 0.04·0.1487213, −0.7 | 0.8 + 0.04·0.1065307, 1.0]
    ///   row sums: −2.9740511, 1.8042612; tokens 3 + 2 = 5
    /// grpo:    (−2.9740511/3 + 1.8042612/2)/2 = −0.0446099
    /// bnpo, dapo: (−2.9740511 + 1.8042612)/5 = −0.2339580
    /// dr_grpo: −1.1697899/(2·3) = −0.1949650; with max_completion_length 4: /8 = −0.1462237
    fn minibatch() -> (Minibatch, Tensor) {
        let (l13, l07) = (1.3f32.ln(), 0.7f32.ln());
        let old = t2(&[&[-1.0, -1.0, -1.0], &[-2.0, -2.0, NAN]]);
        let logp = t2(&[&[-1.0, -1.0 + l13, -1.0 + l07], &[-2.0 + l07, -2.0, 3.0]]).set_requires_grad(true);
        let reff = t2(&[&[-1.0, -0.5 + l13, -1.0 + l07], &[-2.5 + l07, -2.0, NAN]]);
        let mb = Minibatch {
            logprobs: logp.shallow_clone(),
            old_logprobs: old,
            ref_logprobs: Some(reff),
            values: None,
            old_values: None,
            advantages: t2(&[&[1.0, 1.0, 1.0], &[-1.0, -1.0, NAN]]),
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

    #[test]
    fn loss_types_by_hand() {
        let base = json!({"beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28});
        let with = |extra: serde_json::Value| {
            let mut cfg = base.clone();
            cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let out = grpo(cfg).loss(&minibatch().0).unwrap();
            (out.loss.double_value(&[]), out.metrics)
        };
        let (grpo_loss, m) = with(json!({"loss_type": "grpo"}));
        assert!((grpo_loss + 0.0446099).abs() < 1e-6, "{grpo_loss}");
        // Policy part alone: (−2.98/3 + 1.8/2)/2 = −0.0466667.
        assert!((metric(&m, "loss/policy") + 0.0466667).abs() < 1e-6);
        assert!((metric(&m, "clip_ratio") - 0.4).abs() < 1e-6);
        assert!((metric(&m, "clip_ratio/low_mean") - 0.2).abs() < 1e-6);
        assert!((metric(&m, "clip_ratio/high_mean") - 0.2).abs() < 1e-6);
        assert!((metric(&m, "kl") - (0.1487213 + 0.1065307) / 5.0).abs() < 1e-6);
        let approx_kl = 0.5 * (1.3f64.ln().powi(2) + 2.0 * 0.7f64.ln().powi(2)) / 5.0;
        assert!((metric(&m, "approx_kl") - approx_kl).abs() < 1e-6);
        for loss_type in ["bnpo", "dapo"] {
            let (l, _) = with(json!({ "loss_type": loss_type }));
            assert!((l + 0.2339580).abs() < 1e-6, "{loss_type}: {l}");
        }
        let (l, _) = with(json!({"loss_type": "dr_grpo"}));
        assert!((l + 0.1949650).abs() < 1e-6, "{l}");
        let (l, _) = with(json!({"loss_type": "dr_grpo", "max_completion_length": 4}));
        assert!((l + 0.1462237).abs() < 1e-6, "{l}");
        // epsilon_high = epsilon: (0,1) clips at 1.2 → row 0 sum −2.8940511 → bnpo −1.0897899/5.
        let out = grpo(json!({"loss_type": "bnpo"})).loss(&minibatch().0).unwrap();
        assert!((out.loss.double_value(&[]) + 0.2179580).abs() < 1e-6);
    }

    /// d loss/d logp for loss_type grpo (row weights 1/(3·2) and 1/(2·2)):
    ///   pg part: −ρ·A where unclipped, 0 where clipped; k3 part: β·(1 − e^d), d = ref − logp.
    ///   (0,0): −1/6 = −0.1666667          (0,1): clipped; 0.04·(1 − e^0.5)/6 = −0.0043248
    ///   (0,2): −0.7/6 = −0.1166667        (1,0): clipped; 0.04·(1 − e^−0.5)/4 = 0.0039347
    ///   (1,1): +1/4 = 0.25                (1,2): padding, 0
    #[test]
    fn gradients_flow_to_logprobs() {
        let (mb, logp) = minibatch();
        let out = grpo(json!({"beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28})).loss(&mb).unwrap();
        out.loss.backward();
        let expected = [-0.1666667, -0.0043248, -0.1166667, 0.0039347, 0.25, 0.0];
        assert_close(&values_of(&logp.grad()), &expected, 1e-6);
    }

    /// β = 0: no reference needed (and none asked for); the loss is the policy part alone.
    #[test]
    fn beta_zero_needs_no_reference() {
        let mut algo = grpo(json!({"beta": 0.0, "epsilon_high": 0.28}));
        assert!(!algo.requirements().reference);
        let (mut mb, _) = minibatch();
        mb.ref_logprobs = None;
        let out = algo.loss(&mb).unwrap();
        assert!((out.loss.double_value(&[]) + 0.0466667).abs() < 1e-6);
        assert!(out.metrics.iter().all(|(n, _)| n != "kl"));
    }

    #[test]
    fn requirements_and_defaults() {
        let g = grpo(json!({}));
        assert_eq!(g.requirements(), Requirements { reference: true, critic: false, entropy: false });
        let c = &g.cfg;
        assert_eq!((c.beta, c.epsilon, c.epsilon_high, c.max_completion_length), (0.04, 0.2, None, None));
        assert_eq!(
            (c.loss_type, c.scale_rewards, c.std),
            (LossType::Grpo, ScaleRewards::Group, StdEstimator::Population)
        );
        assert!(grpo(json!({"log_entropy": true})).requirements().entropy);
        let resolved = g.resolved_config();
        assert_eq!(
            (&resolved["std"], &resolved["loss_type"], &resolved["beta"]),
            (&json!("population"), &json!("grpo"), &json!(0.04))
        );
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| Grpo::new(&cfg.to_string(), &ctx()).unwrap_err().to_string();
        let e = err(json!({"kl_coef": 0.1}));
        assert!(e.starts_with("kl_coef: unknown field"), "{e}");
        // As TRL: a group of one sample has advantage 0, whatever its reward.
        let one = Grpo::new("{}", &Context::default()).unwrap_err().to_string();
        assert!(one.starts_with("rollout.samples_per_prompt = 1: GRPO compares the samples of a prompt"), "{one}");
        let e = err(json!({"beta": "high"}));
        assert!(e.starts_with("beta: invalid type"), "{e}");
        let e = err(json!({"loss_type": "foo"}));
        assert!(e.starts_with("loss_type: unknown variant `foo`"), "{e}");
        let e = err(json!({"scale_rewards": true}));
        assert!(e.starts_with("scale_rewards: "), "{e}");
        let e = err(json!({"max_completion_length": -1}));
        assert!(e.starts_with("max_completion_length: invalid value"), "{e}");
    }
}
