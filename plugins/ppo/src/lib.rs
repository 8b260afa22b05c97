//! Token-level PPO with GAE, exactly as DeepSpeed-Chat phase 3 (`step3_rlhf_finetuning/ppo_trainer.py`:
//! `compute_rewards`, `get_advantages_and_returns`, `actor_loss_fn`, `critic_loss_fn`).
//!
//! Per generation batch ([`Ppo::prepare`]); row `i` has `T_i` valid response tokens, `t < T_i`:
//!
//! ```text
//! r_t        = −kl_ctl · k(logp_old_t, logp_ref_t)                 KL penalty in the reward; k1 = old − ref
//! r_{T_i−1} += clamp(score_i, −clip_reward_value, clip_reward_value)  clipped score on the last valid token
//! r_t = V_t  = 0                                                      for t ≥ T_i (after the row's end)
//! δ_t        = r_t + γ·V_{t+1} − V_t                                  V_R = 0
//! A_t        = δ_t + γλ·A_{t+1}                                       GAE, backwards from t = R−1; detached
//! G_t        = A_t + V_t                                              returns: the critic's targets
//! ```
//!
//! `V_t` is the critic's value of the state just before response token `t` (DSC's `values[:, start:]`).
//!
//! Per minibatch ([`Ppo::loss`]), `mean_t` a masked mean over the minibatch's valid tokens:
//!
//! ```text
//! ρ_t      = exp((logp_t − logp_old_t) · mask_t)
//! pg_loss  = mean_t max(−A_t·ρ_t, −A_t·clamp(ρ_t, 1−ε, 1+ε))
//! Vclip_t  = clamp(V_t, Vold_t − ε_v, Vold_t + ε_v)
//! vf_loss  = ½ · mean_t max((V_t − G_t)², (Vclip_t − G_t)²)
//! loss     = pg_loss + vf_coef·vf_loss − entropy_coef·mean_t H_t
//! ```
//!
//! DSC back-props `pg_loss` into the actor and `vf_loss` into the critic separately; the host
//! back-props one scalar, and since the advantages are constants and the two models share no
//! parameters, `vf_coef = 1` gives exactly DSC's gradients.
//!
//! Where TRL (`PPOTrainer`) and OpenRLHF differ — the DSC behaviour is the default, theirs an option:
//! - TRL and OpenRLHF whiten the advantages over the batch's valid tokens (`whiten_advantages`;
//!   TRL's `masked_whiten`: unbiased variance, `rsqrt(var + 1e-8)`, padding reset to 0); DSC does not.
//! - The per-token KL estimator in the reward: DSC and TRL use k1 = old − ref; OpenRLHF offers
//!   k2 = ½(old − ref)² and TRL/OpenRLHF k3 = exp(ref − old) − (ref − old) − 1 (`kl_estimator`).
//! - TRL's `AdaptiveKLController` (Ziegler et al., 2019; on by default in TRL's pre-0.12 `PPOTrainer`)
//!   adapts `kl_ctl` towards a target KL; DSC keeps it fixed (`adaptive_kl`).
//! - TRL does not clip the score by default and defaults `vf_coef` to 0.1 and `kl_coef` to 0.05; set
//!   `clip_reward_value` large to switch clipping off.
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! kl_ctl = 0.1                # initial KL coefficient in the reward
//! clip_reward_value = 5.0     # score clamped to ±this
//! gamma = 1.0
//! lam = 0.95
//! cliprange = 0.2             # policy ratio clip
//! cliprange_value = 0.2       # value clip around the rollout values
//! vf_coef = 1.0               # weight of DSC's ½·max(vf1, vf2) value loss
//! entropy_coef = 0.0          # entropy bonus (the host computes entropy only when ≠ 0)
//! whiten_advantages = false   # TRL / OpenRLHF option
//! kl_estimator = "k1"         # "k1" | "k2" | "k3"
//! adaptive_kl = { target = 6.0, horizon = 10000 }   # optional; absent = fixed kl_ctl
//! ```

use rlhf_plugin_api::ops::{self, masked, masked_mean, scalar, Metrics};
pub use rlhf_plugin_api::ops::{AdaptiveKl, KlEstimator};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// The `[algorithm]` section; defaults are DeepSpeed-Chat's.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    /// Initial coefficient of the per-token KL penalty in the reward (DSC `kl_ctl`).
    pub kl_ctl: f64,
    /// The score is clamped to `[−clip_reward_value, clip_reward_value]` before it enters the reward.
    pub clip_reward_value: f64,
    /// Discount factor γ.
    pub gamma: f64,
    /// GAE λ.
    pub lam: f64,
    /// Policy ratio clip ε: ratios are clamped to `[1 − ε, 1 + ε]`.
    pub cliprange: f64,
    /// Value clip ε_v: new values are clamped to `old ± ε_v`.
    pub cliprange_value: f64,
    /// Weight of DSC's `0.5·max(vf1, vf2)` value loss in the single loss.
    pub vf_coef: f64,
    /// Weight of the entropy bonus (0 = none, as in DSC; the host then computes no entropy).
    pub entropy_coef: f64,
    /// Whiten advantages over the batch's valid tokens (TRL / OpenRLHF; DSC does not).
    pub whiten_advantages: bool,
    /// Per-token KL estimator in the reward: "k1" (DSC), "k2" or "k3".
    pub kl_estimator: KlEstimator,
    /// Adaptive KL controller `{ target, horizon }`; absent = fixed `kl_ctl`.
    pub adaptive_kl: Option<AdaptiveKl>,
}

impl Default for PpoConfig {
    fn default() -> Self {
        PpoConfig {
            kl_ctl: 0.1,
            clip_reward_value: 5.0,
            gamma: 1.0,
            lam: 0.95,
            cliprange: 0.2,
            cliprange_value: 0.2,
            vf_coef: 1.0,
            entropy_coef: 0.0,
            whiten_advantages: false,
            kl_estimator: KlEstimator::K1,
            adaptive_kl: None,
        }
    }
}

impl PpoConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        for (key, v) in [("kl_ctl", self.kl_ctl), ("vf_coef", self.vf_coef), ("entropy_coef", self.entropy_coef)] {
            ops::check_nonnegative(key, v)?;
        }
        let positive = [
            ("clip_reward_value", self.clip_reward_value),
            ("cliprange", self.cliprange),
            ("cliprange_value", self.cliprange_value),
        ];
        for (key, v) in positive {
            ops::check_positive(key, v)?;
        }
        ops::check_unit_interval("gamma", self.gamma)?;
        ops::check_unit_interval("lam", self.lam)?;
        if let Some(a) = &self.adaptive_kl {
            ops::check_positive("adaptive_kl.target", a.target)?;
            ops::check_positive("adaptive_kl.horizon", a.horizon)?;
        }
        Ok(())
    }
}

/// Token-level PPO; holds the (possibly adapted) KL coefficient between batches.
#[derive(Debug)]
pub struct Ppo {
    cfg: PpoConfig,
    /// The KL coefficient the next `prepare` uses.
    kl_ctl: f64,
}

impl Algorithm for Ppo {
    fn new(config: &str, _ctx: &Context) -> Result<Self> {
        let cfg: PpoConfig = parse_config(config)?;
        cfg.validate()?;
        Ok(Ppo { kl_ctl: cfg.kl_ctl, cfg })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: true, critic: true, entropy: self.cfg.entropy_coef != 0.0 }
    }

    fn resolved_config(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn describe_keys(&self) -> Vec<KeyDoc> {
        vec![
            KeyDoc {
                key: "kl_ctl",
                help: "initial coefficient of the per-token KL penalty in the reward",
                peers: &[("TRL", "kl_coef"), ("verl", "algorithm.kl_ctrl.kl_coef"), ("OpenRLHF", "--init_kl_coef")],
            },
            KeyDoc {
                key: "clip_reward_value",
                help: "the score is clamped to [-clip_reward_value, clip_reward_value] before it enters the reward",
                peers: &[("DeepSpeed-Chat", "clip_reward_value")],
            },
            KeyDoc {
                key: "gamma",
                help: "discount factor of GAE",
                peers: &[("TRL", "gamma"), ("verl", "algorithm.gamma"), ("OpenRLHF", "--gamma")],
            },
            KeyDoc {
                key: "lam",
                help: "GAE lambda",
                peers: &[("TRL", "lam"), ("verl", "algorithm.lam"), ("OpenRLHF", "--lambd")],
            },
            KeyDoc {
                key: "cliprange",
                help: "policy ratio clip: ratios are clamped to [1 - cliprange, 1 + cliprange]",
                peers: &[
                    ("TRL", "cliprange"),
                    ("verl", "actor_rollout_ref.actor.clip_ratio"),
                    ("OpenRLHF", "--eps_clip"),
                ],
            },
            KeyDoc {
                key: "cliprange_value",
                help: "value clip: new values are clamped to old values +- cliprange_value",
                peers: &[("TRL", "cliprange_value"), ("verl", "critic.cliprange_value"), ("OpenRLHF", "--value_clip")],
            },
            KeyDoc {
                key: "vf_coef",
                help: "weight of the clipped value loss 0.5 max(vf1, vf2) in the single loss",
                peers: &[("TRL", "vf_coef")],
            },
            KeyDoc {
                key: "entropy_coef",
                help: "weight of the entropy bonus; 0 = none (the host then computes no entropy)",
                peers: &[("verl", "actor_rollout_ref.actor.entropy_coeff")],
            },
            KeyDoc {
                key: "whiten_advantages",
                help: "whiten advantages over the batch's valid tokens (TRL and OpenRLHF do; DeepSpeed-Chat does not)",
                peers: &[],
            },
            KeyDoc {
                key: "kl_estimator",
                help: "per-token KL estimator of the penalty: k1, k2 or k3",
                peers: &[("TRL", "kl_estimator"), ("verl", "algorithm.kl_penalty"), ("OpenRLHF", "--kl_estimator")],
            },
            KeyDoc {
                key: "adaptive_kl",
                help: "adaptive KL controller { target, horizon }; unset = the fixed kl_ctl",
                peers: &[("verl", "algorithm.kl_ctrl.target_kl, horizon"), ("OpenRLHF", "--kl_target, --kl_horizon")],
            },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`; `exp.logprobs`, `ref_logprobs`, `values`, `action_mask [B, R]`;
    /// returns `advantages`, `returns [B, R]`, 0 on padding.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let mask = &exp.action_mask; // [B, R]
        let (b, _r) = mask.size2()?;
        let valid = mask.f_gt(0.0)?; // [B, R] bool
        let old = masked(&exp.logprobs, &valid)?; // [B, R]
        let reff = masked(ops::need(&exp.ref_logprobs, "ref_logprobs", "ppo")?, &valid)?; // [B, R]
        let values = masked(ops::need(&exp.values, "values", "ppo")?, &valid)?; // [B, R], 0 after each end

        let kl_coef = self.kl_ctl;
        let rewards = compute_rewards(&old, &reff, &exp.rewards, &valid, kl_coef, &self.cfg)?; // [B, R]
        let (advantages, returns) = get_advantages_and_returns(&values, &rewards, mask, self.cfg.gamma, self.cfg.lam)?;
        let advantages = if self.cfg.whiten_advantages { ops::masked_whiten(&advantages, mask)? } else { advantages };

        // Mean over samples of the summed k1 KL of each response (TRL's `objective/kl`).
        let rollout_kl = scalar(&old.f_sub(&reff)?.f_sum_dim_intlist(1, false, Kind::Float)?.f_mean(Kind::Float)?)?;
        if let Some(adaptive) = &self.cfg.adaptive_kl {
            if !rollout_kl.is_finite() {
                return Err(PluginError::compute(format!("adaptive KL: the batch KL is {rollout_kl}")));
            }
            self.kl_ctl = adaptive.update(self.kl_ctl, rollout_kl, b);
        }

        let metrics = Metrics::new()
            .value("ppo/kl_coef", kl_coef)
            .value("ppo/rollout_kl", rollout_kl)
            .scalar("ppo/shaped_reward_mean", &masked_mean(&rewards, mask)?)?
            .scalar("ppo/advantages_mean", &masked_mean(&advantages, mask)?)?
            .scalar("ppo/returns_mean", &masked_mean(&returns, mask)?)?
            .scalar("ppo/values_mean", &masked_mean(&values, mask)?)?
            .finish();
        Ok(Prepared { advantages, returns: Some(returns), metrics })
    }

    /// The adaptive KL coefficient survives checkpoints.
    fn state(&self) -> Result<serde_json::Value> {
        Ok(serde_json::json!({ "kl_ctl": self.kl_ctl }))
    }

    fn load_state(&mut self, state: serde_json::Value) -> Result<()> {
        self.kl_ctl = state
            .get("kl_ctl")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| PluginError::config("state.kl_ctl", "missing from the checkpoint"))?;
        Ok(())
    }

    /// # Shapes
    /// Every `mb` tensor `[b, R]` (`rewards [b]`, unused); the loss is a scalar.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let cfg = &self.cfg;
        let mask = &mb.action_mask; // [b, R]
        let valid = mask.f_gt(0.0)?; // [b, R] bool
        let logp = masked(&mb.logprobs, &valid)?; // [b, R], grad
        let old = masked(&mb.old_logprobs, &valid)?; // [b, R]
        let advantages = masked(&mb.advantages, &valid)?; // [b, R]
        let values = masked(ops::need(&mb.values, "values", "ppo")?, &valid)?; // [b, R], grad
        let old_values = masked(ops::need(&mb.old_values, "old_values", "ppo")?, &valid)?; // [b, R]
        let returns = masked(ops::need(&mb.returns, "returns", "ppo")?, &valid)?; // [b, R]

        // actor_loss_fn
        let log_ratio = logp.f_sub(&old)?.f_mul(mask)?; // [b, R]
        let ratio = log_ratio.f_exp()?;
        let pg_losses1 = advantages.f_neg()?.f_mul(&ratio)?;
        let pg_losses2 = advantages.f_neg()?.f_mul(&ratio.f_clamp(1.0 - cfg.cliprange, 1.0 + cfg.cliprange)?)?;
        // Token means over the whole optimizer step (exact under accumulation and data parallelism).
        let token_mean = |x: &Tensor| ops::token_mean(x, mask, mb.accumulation_steps, mb.step_tokens);
        let pg_loss = token_mean(&pg_losses1.f_maximum(&pg_losses2)?)?; // []

        // critic_loss_fn
        let lo = old_values.f_sub_scalar(cfg.cliprange_value)?;
        let hi = old_values.f_add_scalar(cfg.cliprange_value)?;
        let values_clipped = values.f_clamp_tensor(Some(&lo), Some(&hi))?; // [b, R]
        let vf_losses1 = values.f_sub(&returns)?.f_square()?;
        let vf_losses2 = values_clipped.f_sub(&returns)?.f_square()?;
        let vf_loss = token_mean(&vf_losses1.f_maximum(&vf_losses2)?)?.f_mul_scalar(0.5)?; // []

        let mut loss = pg_loss.f_add(&vf_loss.f_mul_scalar(cfg.vf_coef)?)?;
        let entropy = match &mb.entropy {
            Some(h) => Some(token_mean(&masked(h, &valid)?)?), // [], grad
            None if cfg.entropy_coef != 0.0 => return Err(ops::missing("entropy", "ppo")),
            None => None,
        };
        if let (Some(h), true) = (&entropy, cfg.entropy_coef != 0.0) {
            loss = loss.f_sub(&h.f_mul_scalar(cfg.entropy_coef)?)?;
        }

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let mut m = Metrics::new();
            m.scalar("loss/policy", &pg_loss)?
                .scalar("loss/value", &vf_loss)?
                .scalar("clip_ratio", &ops::masked_fraction(&pg_losses2.f_gt_tensor(&pg_losses1)?, mask)?)?
                .scalar("approx_kl", &ops::approx_kl(&logp.f_sub(&old)?, mask)?)?
                .scalar("ppo/vf_clipfrac", &ops::masked_fraction(&vf_losses2.f_gt_tensor(&vf_losses1)?, mask)?)?
                .scalar("ppo/ratio_mean", &masked_mean(&ratio, mask)?)?;
            if let Some(reff) = &mb.ref_logprobs {
                // Mean over sequences of Σ_t (logp − ref): the policy's KL to the reference.
                let k1 = ops::masked_row_sum(&logp.f_sub(&masked(reff, &valid)?)?, mask)?; // [b]
                m.scalar("kl", &k1.f_mean(Kind::Float)?)?;
            }
            if let Some(h) = &entropy {
                m.scalar("entropy", h)?;
            }
            m.optional("explained_var", ops::masked_explained_variance(&values, &returns, mask)?);
            Ok(m.finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

/// DSC `compute_rewards`: `−kl_ctl·k(old, ref)` on every token, the clipped score added on each row's
/// last valid token (index `Σ mask − 1`), 0 after the row's end. An empty row gets no score.
///
/// # Shapes
/// `old`, `reff`, `valid`: `[B, R]` (old/ref already 0 on padding); `score`: `[B]`; returns `[B, R]`.
fn compute_rewards(
    old: &Tensor,
    reff: &Tensor,
    score: &Tensor,
    valid: &Tensor,
    kl_ctl: f64,
    cfg: &PpoConfig,
) -> Result<Tensor> {
    let kl_divergence_estimate = ops::kl_estimate(old, reff, cfg.kl_estimator)?.f_mul_scalar(-kl_ctl)?; // [B, R]
    let reward_clip = score.f_clamp(-cfg.clip_reward_value, cfg.clip_reward_value)?; // [B]
    let ends = ops::last_index(valid)?; // [B, 1]
    let reward_clip = reward_clip.f_to_kind(old.kind())?.f_unsqueeze(1)?; // [B, 1]
    let rewards = kl_divergence_estimate.f_scatter_add(1, &ends, &reward_clip)?; // [B, R]
    masked(&rewards, valid) // rewards[j, ends[j] + 1:] = 0
}

/// DSC `get_advantages_and_returns`: GAE backwards over the action tokens, `returns = advantages +
/// values`. A slot outside the action mask is skipped — the next action's value and advantage
/// carry over it, its own advantage is 0 — so padding contributes nothing and the observation
/// tokens inside a multi-turn trajectory are not steps of the MDP (verl's multi-turn GAE):
///
/// ```text
/// δ_t = r_t + γ·V_next − V_t,   A_t = δ_t + γλ·A_next   (next = the next action slot)
/// ```
///
/// With right padding alone (single-turn) this is DSC's loop over all `R` slots, bit for bit.
///
/// # Shapes
/// `values`, `rewards`, `mask`: `[B, R]` (values and rewards 0 outside the mask); returns
/// `(advantages, returns)`, both `[B, R]`.
fn get_advantages_and_returns(
    values: &Tensor,
    rewards: &Tensor,
    mask: &Tensor,
    gamma: f64,
    lam: f64,
) -> Result<(Tensor, Tensor)> {
    let (b, length) = rewards.size2()?;
    let mut lastgaelam = Tensor::f_zeros([b], (rewards.kind(), rewards.device()))?; // [B]
    let mut nextvalues = lastgaelam.f_zeros_like()?; // [B]
    let mut advantages_reversed = Vec::with_capacity(length as usize);
    for t in (0..length).rev() {
        let valid = mask.f_select(1, t)?.f_gt(0.0)?; // [B] bool
        let v = values.f_select(1, t)?; // [B]
        let delta = rewards.f_select(1, t)?.f_add(&nextvalues.f_mul_scalar(gamma)?)?.f_sub(&v)?;
        let gae = delta.f_add(&lastgaelam.f_mul_scalar(gamma * lam)?)?;
        lastgaelam = gae.f_where_self(&valid, &lastgaelam)?;
        nextvalues = v.f_where_self(&valid, &nextvalues)?;
        advantages_reversed.push(gae.f_where_scalarother(&valid, 0.0)?);
    }
    if advantages_reversed.is_empty() {
        return Ok((rewards.f_zeros_like()?, rewards.f_zeros_like()?));
    }
    advantages_reversed.reverse();
    let advantages = Tensor::f_stack(&advantages_reversed, 1)?; // [B, R]
    let returns = advantages.f_add(values)?;
    Ok((advantages.f_detach()?, returns))
}

rlhf_plugin_api::export_algorithm!(
    Ppo,
    name: "ppo",
    description: "Token-level PPO with GAE (DeepSpeed-Chat phase 3): KL-in-reward, reward clip, clipped losses"
);

#[cfg(test)]
mod tests;
