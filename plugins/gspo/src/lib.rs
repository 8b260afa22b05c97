//! Group Sequence Policy Optimization (Zheng et al., Qwen 2025, "Group Sequence Policy
//! Optimization"; TRL's `GRPOTrainer` with `importance_sampling_level = "sequence"`): GRPO's
//! group-normalised advantages, but one importance ratio per response — the length-normalised
//! sequence likelihood ratio — clipped per sequence.
//!
//! Per generation batch ([`Gspo::prepare`]), as GRPO, for sample `i` in group `g` (samples sharing
//! a `group_id`; groups need not be contiguous nor of equal size):
//!
//! ```text
//! A_i = (r_i − mean_g) / (std_g + 1e-4)                    a group of one (std 0) gets A = 0
//! ```
//!
//! Per minibatch ([`Gspo::loss`]), `T_i` valid tokens in row `i`:
//!
//! ```text
//! s_i   = exp( 1/T_i Σ_t (logp_t − logp_old_t) )           = (π(y_i)/π_old(y_i))^(1/T_i)
//! L_i   = −min(s_i·A_i, clamp(s_i, 1 − ε, 1 + ε_high)·A_i)
//! KL_i  = 1/T_i Σ_t k3_t,   k3 = exp(ref − logp) − (ref − logp) − 1      (only when β > 0)
//! loss  = mean_i (L_i + β·KL_i)
//! ```
//!
//! The gradient is the sequence variant's: `∂L_i/∂logp_t = −A_i·s_i/T_i` on every token of an
//! unclipped sequence, 0 on a clipped one. TRL computes the same `s_i` from
//! `logp − logp_old` (`logp_old = logp.detach()` on-policy) broadcast over the tokens and then
//! reduces with `loss_type = "grpo"` (sequence mean of token means), which gives exactly this loss
//! and gradient; GSPO-token (`sg[s_i]·π_t/sg[π_t]`) has the same gradient when the advantage is per
//! sequence, and is not implemented separately.
//!
//! Defaults: `epsilon = 3e-4`, `epsilon_high = 4e-4` — the GSPO paper's (v2, §5.1), the values TRL's
//! documentation prescribes for `importance_sampling_level = "sequence"` (TRL's own config defaults
//! stay 0.2 for token-level GRPO); `beta = 0` as TRL and the paper (no reference model). The ratio
//! differs from 1 only off-policy (later minibatches of a batch, `ppo_epochs > 1`); on-policy GSPO
//! is GRPO with sequence-mean aggregation. The std is the population one by default (as this
//! repository's `grpo`); TRL uses `torch.std` (`std = "unbiased"`).
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! epsilon = 3e-4               # lower clip of the sequence ratio
//! epsilon_high = 4e-4          # upper clip of the sequence ratio
//! beta = 0.0                   # k3 KL weight; 0 = no reference model
//! scale_rewards = "group"      # "group" | "batch" | "none"
//! std = "population"           # "population" | "unbiased"
//! ```

pub use rlhf_plugin_api::ops::StdEstimator;
use rlhf_plugin_api::ops::{self, group_index, group_stats, masked, masked_row_sum, KlEstimator, Metrics};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// What the group-centred rewards are divided by (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// The group's std.
    Group,
    /// The std of the whole batch's rewards.
    Batch,
    /// Nothing.
    None,
}

/// The `[algorithm.config]` section; defaults are the GSPO paper's as configured in TRL.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GspoConfig {
    /// Lower clip ε of the sequence ratio: `s` is clamped to `[1 − ε, 1 + epsilon_high]`.
    pub epsilon: f64,
    /// Upper clip of the sequence ratio.
    pub epsilon_high: f64,
    /// Weight β of the k3 KL to the reference (0 = no reference model).
    pub beta: f64,
    /// Advantage scaling: "group", "batch" or "none".
    pub scale_rewards: ScaleRewards,
    /// Standard deviation estimator: "population" or "unbiased" (TRL).
    pub std: StdEstimator,
}

impl Default for GspoConfig {
    fn default() -> Self {
        GspoConfig {
            epsilon: 3e-4,
            epsilon_high: 4e-4,
            beta: 0.0,
            scale_rewards: ScaleRewards::Group,
            std: StdEstimator::Population,
        }
    }
}

impl GspoConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        ops::check_positive("epsilon", self.epsilon)?;
        ops::check_positive("epsilon_high", self.epsilon_high)?;
        ops::check_nonnegative("beta", self.beta)?;
        if self.epsilon >= 1.0 {
            return Err(PluginError::config("epsilon", format!("must be < 1, got {}", self.epsilon)));
        }
        Ok(())
    }
}

/// GSPO; stateless between batches.
#[derive(Debug)]
pub struct Gspo {
    cfg: GspoConfig,
}

impl Algorithm for Gspo {
    fn new(config: &str, ctx: &Context) -> Result<Self> {
        let cfg: GspoConfig = parse_config(config)?;
        cfg.validate()?;
        ops::require_groups(ctx, "GSPO")?;
        Ok(Gspo { cfg })
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
                key: "epsilon",
                help: "lower clip of the sequence ratio: s is clamped to [1 - epsilon, 1 + epsilon_high]",
                peers: &[("TRL", "epsilon"), ("verl", "actor_rollout_ref.actor.clip_ratio_low")],
            },
            KeyDoc {
                key: "epsilon_high",
                help: "upper clip of the sequence ratio",
                peers: &[("TRL", "epsilon_high"), ("verl", "actor_rollout_ref.actor.clip_ratio_high")],
            },
            KeyDoc {
                key: "beta",
                help: "weight of the k3 KL to the reference; 0 = no reference model",
                peers: &[("TRL", "beta"), ("verl", "actor_rollout_ref.actor.kl_loss_coef")],
            },
            KeyDoc {
                key: "scale_rewards",
                help: "advantage scaling: group, batch or none",
                peers: &[("TRL", "scale_rewards"), ("verl", "algorithm.norm_adv_by_std_in_grpo")],
            },
            KeyDoc { key: "std", help: "standard deviation estimator: population or unbiased (TRL)", peers: &[] },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.action_mask [B, R]`; returns
    /// `advantages [B, R]` (each sample's A on its valid tokens, 0 on padding).
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let mask = &exp.action_mask; // [B, R]
        let valid = mask.f_gt(0.0)?;
        // Statistics in f64, so that a group of equal rewards has a std of exactly 0.
        let rewards = exp.rewards.f_to_kind(Kind::Double)?; // [B]
        let (group, n_groups) = group_index(&exp.group_ids)?; // [B] in 0..G
        let (mean_g, std_g) = group_stats(&rewards, &group, n_groups, self.cfg.std)?; // [G], [G]
        let centered = rewards.f_sub(&mean_g.f_index_select(0, &group)?)?; // [B]
        let advantages = match self.cfg.scale_rewards {
            ScaleRewards::Group => centered.f_div(&std_g.f_index_select(0, &group)?.f_add_scalar(1e-4)?)?,
            ScaleRewards::Batch => {
                let (_, std_batch) = group_stats(&rewards, &group.f_zeros_like()?, 1, self.cfg.std)?; // [1]
                centered.f_div(&std_batch.f_add_scalar(1e-4)?)?
            }
            ScaleRewards::None => centered,
        }; // [B]

        let zero_std = std_g.f_lt(1e-8)?.f_to_kind(Kind::Double)?; // [G]
        let metrics = Metrics::new()
            .scalar("gspo/advantages_mean", &advantages.f_mean(Kind::Double)?)?
            .scalar("gspo/advantages_std", &advantages.f_var_dim(0i64, false, false)?.f_sqrt()?)?
            .scalar("gspo/frac_reward_zero_std", &zero_std.f_mean(Kind::Double)?)?
            .value("gspo/num_groups", n_groups as f64)
            .finish();
        let advantages = ops::per_token(&advantages.f_to_kind(mask.kind())?, &valid)?; // [B, R]
        Ok(Prepared { advantages, returns: None, metrics })
    }

    /// # Shapes
    /// Every `mb` tensor `[b, R]` (`rewards [b]`, unused); the loss is a scalar.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let cfg = &self.cfg;
        let mask = &mb.action_mask; // [b, R]
        let valid = mask.f_gt(0.0)?;
        let logp = masked(&mb.logprobs, &valid)?; // [b, R], grad
        let log_ratio = logp.f_sub(&masked(&mb.old_logprobs, &valid)?)?; // [b, R]
        let lengths = mask.f_sum_dim_intlist(1, false, Kind::Float)?.f_clamp_min(1.0)?; // T_i, [b]
        let token_mean = |x: &Tensor| -> Result<Tensor> { Ok(masked_row_sum(x, mask)?.f_div(&lengths)?) }; // [b]

        // The sequence advantage, read back from its broadcast form (0 for an empty row).
        let advantage = token_mean(&masked(&mb.advantages, &valid)?)?; // [b]
        let (low, high) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high);

        let seq_log_ratio = token_mean(&log_ratio)?; // 1/T Σ_t log ratio, [b]
        let coef_1 = seq_log_ratio.f_exp()?; // s_i
        let coef_2 = coef_1.f_clamp(low, high)?;
        let pg = coef_1.f_mul(&advantage)?.f_minimum(&coef_2.f_mul(&advantage)?)?.f_neg()?; // [b]
        let policy_loss = ops::row_mean(&pg, mb.accumulation_steps, mb.step_rows)?; // over the step's samples
        let seq_kl = if cfg.beta != 0.0 {
            let reff = masked(ops::need(&mb.ref_logprobs, "ref_logprobs", "gspo")?, &valid)?;
            Some(token_mean(&masked(&ops::kl_estimate(&logp, &reff, KlEstimator::K3)?, &valid)?)?)
        // [b]
        } else {
            None
        };
        let loss = match &seq_kl {
            Some(kl) => {
                let kl = ops::row_mean(kl, mb.accumulation_steps, mb.step_rows)?;
                policy_loss.f_add(&kl.f_mul_scalar(cfg.beta)?)?
            }
            None => policy_loss.shallow_clone(),
        };

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let is_low = coef_1.f_lt(low)?.f_logical_and(&advantage.f_lt(0.0)?)?.f_to_kind(Kind::Float)?;
            let is_high = coef_1.f_gt(high)?.f_logical_and(&advantage.f_gt(0.0)?)?.f_to_kind(Kind::Float)?;
            let mut m = Metrics::new();
            m.scalar("loss/policy", &policy_loss)?
                .scalar("clip_ratio", &is_low.f_add(&is_high)?.f_mean(Kind::Float)?)?
                .scalar("clip_ratio/low_mean", &is_low.f_mean(Kind::Float)?)?
                .scalar("clip_ratio/high_mean", &is_high.f_mean(Kind::Float)?)?
                .scalar("approx_kl", &ops::approx_kl(&log_ratio, mask)?)?
                .scalar("gspo/seq_ratio_mean", &coef_1.f_mean(Kind::Float)?)?;
            if let Some(kl) = &seq_kl {
                m.scalar("gspo/kl", &kl.f_mean(Kind::Float)?)?;
            }
            Ok(m.finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

rlhf_plugin_api::export_algorithm!(
    Gspo,
    name: "gspo",
    description: "GSPO: group-normalised advantages, length-normalised sequence ratio clipped per sequence; no critic"
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

    fn gspo(cfg: serde_json::Value) -> Gspo {
        Gspo::new(&cfg.to_string(), &group_ctx()).unwrap()
    }

    /// Group 7 = rows 0, 1, 3, 4 (interleaved with group 3) with rewards [1, 0, 0, 1]; group 3 =
    /// rows 2, 5 with equal rewards [0.5, 0.5]; group 42 = row 6 alone (0.3).
    fn experience() -> Experience {
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

    /// Group 7: mean 0.5, population std 0.5 → A = ±0.5/0.5001; unbiased std sqrt(1/3) →
    /// ±0.5/0.5774503 = ±0.8658754. Groups 3 (equal rewards) and 42 (alone): std 0 → A = 0.
    /// batch: population std of all 7 rewards 0.3843893 → ±0.5/0.3844893 = ±1.3004264.
    /// advantages_std = sqrt(4·0.9998²/7) = 0.7557778.
    #[test]
    fn group_advantages_by_hand() {
        let p = gspo(json!({})).prepare(&experience()).unwrap();
        let a = 0.5 / 0.5001;
        #[rustfmt::skip]
        let expected = [a, a, a,  -a, -a, 0.,  0., 0., 0.,  -a, -a, -a,  a, a, 0.,  0., 0., 0.,  0., 0., 0.];
        assert_close(&values_of(&p.advantages), &expected, 1e-6);
        assert!((metric(&p.metrics, "gspo/frac_reward_zero_std") - 2.0 / 3.0).abs() < 1e-12);
        assert!((metric(&p.metrics, "gspo/advantages_std") - 0.7557778).abs() < 1e-6);
        assert_eq!(metric(&p.metrics, "gspo/num_groups"), 3.0);
        let first =
            |cfg: serde_json::Value| values_of(&gspo(cfg).prepare(&experience()).unwrap().advantages.select(1, 0));
        let a = 0.8658754;
        assert_close(&first(json!({"std": "unbiased"})), &[a, -a, 0., -a, a, 0., 0.], 1e-6);
        let a = 1.3004264;
        assert_close(&first(json!({"scale_rewards": "batch"})), &[a, -a, 0., -a, a, 0., 0.], 1e-5);
        assert_close(&first(json!({"scale_rewards": "none"})), &[0.5, -0.5, 0., -0.5, 0.5, 0., 0.], 1e-7);
    }

    /// b = 2, R = 3; row 0: 3 tokens, A = +1, log ratios [0, ln 1.3, ln 0.7] → s_0 = 0.91^(1/3) =
    /// 0.9690521; row 1: 2 tokens, A = −1, log ratios [ln 0.7, 0] → s_1 = 0.7^(1/2) = 0.8366600.
    /// ref − logp: row 0 [0, 0.5, 0], row 1 [−0.5, 0].
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

    /// ε = 0.2 (both): nothing clipped → (−0.9690521 + 0.8366600)/2 = −0.0661960.
    /// β = 0.04: KL_0 = (e^0.5 − 1.5)/3, KL_1 = (e^−0.5 − 0.5)/2 → mean 0.0514195 → −0.0641393.
    /// Defaults (3e-4, 4e-4): row 0 (A > 0, s < 1) stays −0.9690521; row 1 (A < 0, s < 0.9997) is
    /// clipped: −min(−0.83666, −0.9997) = 0.9997 → (−0.9690521 + 0.9997)/2 = 0.0153239.
    #[test]
    fn loss_by_hand() {
        let run = |cfg: serde_json::Value| {
            let out = gspo(cfg).loss(&minibatch().0).unwrap();
            (out.loss.double_value(&[]), out.metrics)
        };
        let (l, m) = run(json!({"epsilon": 0.2, "epsilon_high": 0.2}));
        assert!((l + 0.0661960).abs() < 1e-6, "{l}");
        assert_eq!(metric(&m, "clip_ratio"), 0.0);
        assert!((metric(&m, "gspo/seq_ratio_mean") - (0.9690521 + 0.8366600) / 2.0).abs() < 1e-6);
        let approx_kl = 0.5 * (1.3f64.ln().powi(2) + 2.0 * 0.7f64.ln().powi(2)) / 5.0;
        assert!((metric(&m, "approx_kl") - approx_kl).abs() < 1e-6);
        assert!(m.iter().all(|(n, _)| n != "gspo/kl"));
        let (l, m) = run(json!({"epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.04}));
        assert!((l + 0.0641393).abs() < 1e-6, "{l}");
        assert!((metric(&m, "gspo/kl") - 0.0514195).abs() < 1e-6);
        assert!((metric(&m, "loss/policy") + 0.0661960).abs() < 1e-6);
        let (l, m) = run(json!({}));
        assert!((l - 0.0153239).abs() < 1e-6, "{l}");
        assert_eq!((metric(&m, "clip_ratio"), metric(&m, "clip_ratio/low_mean")), (0.5, 0.5));
        assert_eq!(metric(&m, "clip_ratio/high_mean"), 0.0);
    }

    /// ∂/∂logp_t = −A_i·s_i/(T_i·b) + β·(1 − e^(ref − logp))/(T_i·b):
    ///   row 0: −0.9690521/6 = −0.1615087 per token, (0, 1) also 0.04·(1 − e^0.5)/6 → −0.1658335;
    ///   row 1: 0.8366600/4 = 0.2091650 per token, (1, 0) also 0.04·(1 − e^−0.5)/4 → 0.2130997.
    /// With the defaults row 1 is clipped: its gradient is 0.
    #[test]
    fn analytic_gradients() {
        let grad = |cfg: serde_json::Value| {
            let (mb, logp) = minibatch();
            gspo(cfg).loss(&mb).unwrap().loss.backward();
            values_of(&logp.grad())
        };
        let expected = [-0.1615087, -0.1658335, -0.1615087, 0.2130997, 0.209165, 0.0];
        assert_close(&grad(json!({"epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.04})), &expected, 1e-6);
        let expected = [-0.1615087, -0.1615087, -0.1615087, 0.0, 0.0, 0.0];
        assert_close(&grad(json!({})), &expected, 1e-6);
    }

    /// Central finite differences of the loss in each valid log-prob match autograd (clip bounds far
    /// from the ratios, so the loss is smooth there).
    #[test]
    fn gradients_match_finite_differences() {
        let cfg = json!({"epsilon": 0.5, "epsilon_high": 0.5, "beta": 0.04});
        let (mb, logp) = minibatch();
        gspo(cfg.clone()).loss(&mb).unwrap().loss.backward();
        let analytic = values_of(&logp.grad());
        let base = values_of(&logp.detach());
        let h = 1e-2f32;
        for k in 0..5 {
            let at = |d: f32| {
                let mut x = base.clone();
                x[k] += d;
                let (mut mb, _) = minibatch();
                mb.logprobs = Tensor::from_slice(&x).view([2, 3]);
                gspo(cfg.clone()).loss(&mb).unwrap().loss.double_value(&[]) as f32
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            assert!((numeric - analytic[k]).abs() < 1e-3, "[{k}]: {numeric} vs {}", analytic[k]);
        }
    }

    #[test]
    fn requirements_defaults_and_resolved_config() {
        let g = gspo(json!({}));
        assert_eq!(g.requirements(), Requirements { reference: false, critic: false, entropy: false });
        assert!(gspo(json!({"beta": 0.01})).requirements().reference);
        let c = &g.cfg;
        assert_eq!((c.epsilon, c.epsilon_high, c.beta), (3e-4, 4e-4, 0.0));
        assert_eq!((c.scale_rewards, c.std), (ScaleRewards::Group, StdEstimator::Population));
        let resolved = g.resolved_config();
        assert_eq!((&resolved["epsilon_high"], &resolved["std"]), (&json!(4e-4), &json!("population")));
        let (mut mb, _) = minibatch();
        mb.ref_logprobs = None;
        let e = gspo(json!({"beta": 0.01})).loss(&mb).unwrap_err().to_string();
        assert!(e.contains("gspo: the host passed no `ref_logprobs`"), "{e}");
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| Gspo::new(&cfg.to_string(), &group_ctx()).unwrap_err().to_string();
        let one = Gspo::new("{}", &Context::default()).unwrap_err().to_string();
        assert!(one.starts_with("rollout.samples_per_prompt = 1: GSPO compares the samples of a prompt"), "{one}");
        let e = err(json!({"importance_sampling_level": "token"}));
        assert!(e.starts_with("importance_sampling_level: unknown field"), "{e}");
        let e = err(json!({"epsilon": 1.5}));
        assert!(e.starts_with("epsilon: must be < 1"), "{e}");
        let e = err(json!({"epsilon_high": 0.0}));
        assert!(e.starts_with("epsilon_high: must be > 0"), "{e}");
        let e = err(json!({"beta": "none"}));
        assert!(e.starts_with("beta: invalid type"), "{e}");
        let e = err(json!({"scale_rewards": "sequence"}));
        assert!(e.starts_with("scale_rewards: unknown variant `sequence`"), "{e}");
    }
}
