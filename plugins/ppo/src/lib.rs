//! Token-level PPO with GAE, exactly as DeepSpeed-Chat phase 3 (`step3_rlhf_finetuning/ppo_trainer.py`:
//! `compute_rewards`, `get_advantages_and_returns`, `actor_loss_fn`, `critic_loss_fn`; walked through in
//! `seeds/deepspeed-chat-walkthrough.md` §3.6, with the "Boil → the → shoe" example of
//! `seeds/ppo-explained.md` §9 as a test).
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

use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

type Result<T> = std::result::Result<T, PluginError>;

/// Per-token KL estimate between the sampling policy and the reference, used in the reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// `old − ref` (DSC, TRL default).
    K1,
    /// `½·(old − ref)²` (OpenRLHF option).
    K2,
    /// `exp(ref − old) − (ref − old) − 1`, non-negative (Schulman's k3; TRL/OpenRLHF option).
    K3,
}

/// Adaptive KL controller of Ziegler et al. (2019) (TRL's `AdaptiveKLController`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveKl {
    /// KL (summed over a response, averaged over the batch) the controller steers towards.
    pub target: f64,
    /// Number of samples over which a full proportional correction is applied.
    pub horizon: f64,
}

impl Default for AdaptiveKl {
    fn default() -> Self {
        AdaptiveKl { target: 6.0, horizon: 10000.0 }
    }
}

impl AdaptiveKl {
    /// `err = clip(kl/target − 1, −0.2, 0.2)`; `kl_ctl · (1 + err·n_samples/horizon)`.
    pub fn update(&self, kl_ctl: f64, current_kl: f64, n_samples: i64) -> f64 {
        let proportional_error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        let mult = 1.0 + proportional_error * n_samples as f64 / self.horizon;
        kl_ctl * mult
    }
}

/// The `[algorithm]` section; defaults are DeepSpeed-Chat's.
#[derive(Debug, Clone, Deserialize)]
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
        let nonneg = [("kl_ctl", self.kl_ctl), ("vf_coef", self.vf_coef), ("entropy_coef", self.entropy_coef)];
        for (key, v) in nonneg {
            if v.is_nan() || v < 0.0 {
                return Err(PluginError::config(key, format!("must be >= 0, got {v}")));
            }
        }
        let positive = [
            ("clip_reward_value", self.clip_reward_value),
            ("cliprange", self.cliprange),
            ("cliprange_value", self.cliprange_value),
        ];
        for (key, v) in positive {
            if v.is_nan() || v <= 0.0 {
                return Err(PluginError::config(key, format!("must be > 0, got {v}")));
            }
        }
        for (key, v) in [("gamma", self.gamma), ("lam", self.lam)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(PluginError::config(key, format!("must be in [0, 1], got {v}")));
            }
        }
        if let Some(a) = &self.adaptive_kl {
            for (key, v) in [("adaptive_kl.target", a.target), ("adaptive_kl.horizon", a.horizon)] {
                if v.is_nan() || v <= 0.0 {
                    return Err(PluginError::config(key, format!("must be > 0, got {v}")));
                }
            }
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

    /// # Shapes
    /// `exp.rewards [B]`; `exp.logprobs`, `ref_logprobs`, `values`, `action_mask [B, R]`;
    /// returns `advantages`, `returns [B, R]`, 0 on padding.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let mask = &exp.action_mask; // [B, R]
        let (b, r) = mask.size2()?;
        expect_shape("rewards", &exp.rewards, &[b])?;
        expect_shape("logprobs", &exp.logprobs, &[b, r])?;
        let valid = mask.f_gt(0.0)?; // [B, R] bool
        let old = masked(&exp.logprobs, &valid)?; // [B, R]
        let reff = masked(need(&exp.ref_logprobs, "ref_logprobs", &[b, r])?, &valid)?; // [B, R]
        let values = masked(need(&exp.values, "values", &[b, r])?, &valid)?; // [B, R], 0 after each end

        let kl_coef = self.kl_ctl;
        let rewards = compute_rewards(&old, &reff, &exp.rewards, &valid, kl_coef, &self.cfg)?; // [B, R]
        let (advantages, returns) = get_advantages_and_returns(&values, &rewards, self.cfg.gamma, self.cfg.lam)?;
        let advantages =
            if self.cfg.whiten_advantages { masked_whiten(&advantages, mask, &valid)? } else { advantages };

        // Mean over samples of the summed k1 KL of each response (TRL's `objective/kl`).
        let rollout_kl = scalar(&old.f_sub(&reff)?.f_sum_dim_intlist(1, false, Kind::Float)?.f_mean(Kind::Float)?)?;
        if let Some(adaptive) = &self.cfg.adaptive_kl {
            if !rollout_kl.is_finite() {
                return Err(PluginError::compute(format!("adaptive KL: the batch KL is {rollout_kl}")));
            }
            self.kl_ctl = adaptive.update(self.kl_ctl, rollout_kl, b);
        }

        let metrics = vec![
            ("ppo/kl_coef".to_string(), kl_coef),
            ("ppo/rollout_kl".to_string(), rollout_kl),
            ("ppo/shaped_reward_mean".to_string(), scalar(&masked_mean(&rewards, mask)?)?),
            ("ppo/advantages_mean".to_string(), scalar(&masked_mean(&advantages, mask)?)?),
            ("ppo/returns_mean".to_string(), scalar(&masked_mean(&returns, mask)?)?),
            ("ppo/values_mean".to_string(), scalar(&masked_mean(&values, mask)?)?),
        ];
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
        let (b, r) = mask.size2()?;
        let valid = mask.f_gt(0.0)?; // [b, R] bool
        let shape = [b, r];
        expect_shape("logprobs", &mb.logprobs, &shape)?;
        expect_shape("old_logprobs", &mb.old_logprobs, &shape)?;
        expect_shape("advantages", &mb.advantages, &shape)?;
        let logp = masked(&mb.logprobs, &valid)?; // [b, R], grad
        let old = masked(&mb.old_logprobs, &valid)?; // [b, R]
        let advantages = masked(&mb.advantages, &valid)?; // [b, R]
        let values = masked(need(&mb.values, "values", &shape)?, &valid)?; // [b, R], grad
        let old_values = masked(need(&mb.old_values, "old_values", &shape)?, &valid)?; // [b, R]
        let returns = masked(need(&mb.returns, "returns", &shape)?, &valid)?; // [b, R]

        // actor_loss_fn
        let log_ratio = logp.f_sub(&old)?.f_mul(mask)?; // [b, R]
        let ratio = log_ratio.f_exp()?;
        let pg_losses1 = advantages.f_neg()?.f_mul(&ratio)?;
        let pg_losses2 = advantages.f_neg()?.f_mul(&ratio.f_clamp(1.0 - cfg.cliprange, 1.0 + cfg.cliprange)?)?;
        let pg_loss = masked_mean(&pg_losses1.f_maximum(&pg_losses2)?, mask)?; // []

        // critic_loss_fn
        let lo = old_values.f_sub_scalar(cfg.cliprange_value)?;
        let hi = old_values.f_add_scalar(cfg.cliprange_value)?;
        let values_clipped = values.f_clamp_tensor(Some(&lo), Some(&hi))?; // [b, R]
        let vf_losses1 = values.f_sub(&returns)?.f_square()?;
        let vf_losses2 = values_clipped.f_sub(&returns)?.f_square()?;
        let vf_loss = masked_mean(&vf_losses1.f_maximum(&vf_losses2)?, mask)?.f_mul_scalar(0.5)?; // []

        let mut loss = pg_loss.f_add(&vf_loss.f_mul_scalar(cfg.vf_coef)?)?;
        let entropy = match &mb.entropy {
            Some(h) => Some(masked_mean(&masked(h, &valid)?, mask)?), // [], grad
            None if cfg.entropy_coef != 0.0 => return Err(missing("entropy")),
            None => None,
        };
        if let (Some(h), true) = (&entropy, cfg.entropy_coef != 0.0) {
            loss = loss.f_sub(&h.f_mul_scalar(cfg.entropy_coef)?)?;
        }

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let clipped = pg_losses2.f_gt_tensor(&pg_losses1)?.f_to_kind(Kind::Float)?; // [b, R]
            let vf_clipped = vf_losses2.f_gt_tensor(&vf_losses1)?.f_to_kind(Kind::Float)?; // [b, R]
            let approx_kl = masked_mean(&logp.f_sub(&old)?.f_square()?, mask)?.f_mul_scalar(0.5)?;
            let mut m = vec![
                ("loss/policy".to_string(), scalar(&pg_loss)?),
                ("loss/value".to_string(), scalar(&vf_loss)?),
                ("clip_ratio".to_string(), scalar(&masked_mean(&clipped, mask)?)?),
                ("approx_kl".to_string(), scalar(&approx_kl)?),
                ("ppo/vf_clipfrac".to_string(), scalar(&masked_mean(&vf_clipped, mask)?)?),
                ("ppo/ratio_mean".to_string(), scalar(&masked_mean(&ratio, mask)?)?),
            ];
            if let Some(reff) = &mb.ref_logprobs {
                // Mean over sequences of Σ_t (logp − ref): the policy's KL to the reference.
                let k1 = logp.f_sub(&masked(reff, &valid)?)?.f_mul(mask)?; // [b, R]
                m.push(("kl".into(), scalar(&k1.f_sum_dim_intlist(1, false, Kind::Float)?.f_mean(Kind::Float)?)?));
            }
            if let Some(h) = &entropy {
                m.push(("entropy".into(), scalar(h)?));
            }
            if let Some(ev) = explained_variance(&values, &returns, mask)? {
                m.push(("explained_var".into(), ev));
            }
            Ok(m)
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
    let kl_divergence_estimate = kl_estimate(old, reff, cfg.kl_estimator)?.f_mul_scalar(-kl_ctl)?; // [B, R]
    let reward_clip = score.f_clamp(-cfg.clip_reward_value, cfg.clip_reward_value)?; // [B]
    let ends = valid.f_sum_dim_intlist(1, true, Kind::Int64)?.f_sub_scalar(1)?.f_clamp_min(0)?; // [B, 1]
    let reward_clip = reward_clip.f_to_kind(old.kind())?.f_unsqueeze(1)?; // [B, 1]
    let rewards = kl_divergence_estimate.f_scatter_add(1, &ends, &reward_clip)?; // [B, R]
    masked(&rewards, valid) // rewards[j, ends[j] + 1:] = 0
}

/// Per-token KL estimate of the sampling policy against the reference.
///
/// # Shapes
/// `old`, `reff`: `[B, R]`; returns `[B, R]`.
fn kl_estimate(old: &Tensor, reff: &Tensor, estimator: KlEstimator) -> Result<Tensor> {
    let log_ratio = old.f_sub(reff)?; // log π_old/π_ref, [B, R]
    Ok(match estimator {
        KlEstimator::K1 => log_ratio,
        KlEstimator::K2 => log_ratio.f_square()?.f_mul_scalar(0.5)?,
        // exp(ref − old) − (ref − old) − 1 with ref − old = −log_ratio
        KlEstimator::K3 => log_ratio.f_neg()?.f_exp()?.f_add(&log_ratio)?.f_sub_scalar(1.0)?,
    })
}

/// DSC `get_advantages_and_returns`: GAE backwards over all `R` slots (rewards and values are 0 after
/// each row's end, so padding contributes nothing), `returns = advantages + values`.
///
/// # Shapes
/// `values`, `rewards`: `[B, R]`; returns `(advantages, returns)`, both `[B, R]`.
fn get_advantages_and_returns(values: &Tensor, rewards: &Tensor, gamma: f64, lam: f64) -> Result<(Tensor, Tensor)> {
    let (b, length) = rewards.size2()?;
    let mut lastgaelam = Tensor::f_zeros([b], (rewards.kind(), rewards.device()))?; // [B]
    let mut advantages_reversed = Vec::with_capacity(length as usize);
    for t in (0..length).rev() {
        let nextvalues = if t < length - 1 { values.f_select(1, t + 1)? } else { lastgaelam.f_zeros_like()? }; // [B]
        let delta = rewards.f_select(1, t)?.f_add(&nextvalues.f_mul_scalar(gamma)?)?.f_sub(&values.f_select(1, t)?)?;
        lastgaelam = delta.f_add(&lastgaelam.f_mul_scalar(gamma * lam)?)?;
        advantages_reversed.push(lastgaelam.shallow_clone());
    }
    if advantages_reversed.is_empty() {
        return Ok((rewards.f_zeros_like()?, rewards.f_zeros_like()?));
    }
    advantages_reversed.reverse();
    let advantages = Tensor::f_stack(&advantages_reversed, 1)?; // [B, R]
    let returns = advantages.f_add(values)?;
    Ok((advantages.f_detach()?, returns))
}

/// TRL's `masked_whiten`: `(x − mean)·rsqrt(var + 1e-8)` with the mean and unbiased variance over
/// valid tokens, then 0 on padding.
///
/// # Shapes
/// `x`, `mask`, `valid`: `[B, R]`; returns `[B, R]`.
fn masked_whiten(x: &Tensor, mask: &Tensor, valid: &Tensor) -> Result<Tensor> {
    let n = mask.f_sum(Kind::Float)?; // []
    let centered = x.f_sub(&masked_mean(x, mask)?)?; // [B, R]
    let var = centered.f_square()?.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&n.f_sub_scalar(1.0)?.f_clamp_min(1.0)?)?;
    masked(&centered.f_mul(&var.f_add_scalar(1e-8)?.f_rsqrt()?)?, valid)
}

/// `1 − Var(returns − values) / Var(returns)` over valid tokens (cleanrl's `explained_var`); `None`
/// when the returns have no variance.
///
/// # Shapes
/// `values`, `returns`, `mask`: `[b, R]`.
fn explained_variance(values: &Tensor, returns: &Tensor, mask: &Tensor) -> Result<Option<f64>> {
    let var = |x: &Tensor| -> Result<f64> {
        let centered = x.f_sub(&masked_mean(x, mask)?)?;
        scalar(&masked_mean(&centered.f_square()?, mask)?)
    };
    let var_returns = var(returns)?;
    if var_returns > 0.0 {
        Ok(Some(1.0 - var(&returns.f_sub(values)?)? / var_returns))
    } else {
        Ok(None)
    }
}

/// `x` on valid slots, 0 elsewhere. Padded slots may hold garbage, even NaN, which `x·mask` would
/// keep (and whose gradient would be NaN); `where` drops it.
///
/// # Shapes
/// `x [B, R]`, `valid [B, R]` bool; returns `[B, R]`.
fn masked(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    Ok(x.f_where_scalarother(valid, 0.0)?)
}

/// `Σ x·mask / max(Σ mask, 1)`: DSC's `sum(x * mask) / mask.sum()`, 0 instead of NaN when empty.
///
/// # Shapes
/// `x`, `mask`: `[B, R]`; returns a scalar.
fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?;
    Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&n)?)
}

/// A scalar tensor's value.
fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.f_double_value(&[])?)
}

/// An optional input the requirements ask the host for, shape-checked.
fn need<'a>(t: &'a Option<Tensor>, name: &str, shape: &[i64]) -> Result<&'a Tensor> {
    let t = t.as_ref().ok_or_else(|| missing(name))?;
    expect_shape(name, t, shape)?;
    Ok(t)
}

fn missing(name: &str) -> PluginError {
    PluginError::compute(format!("ppo: the host passed no `{name}` although the requirements ask for it"))
}

/// The host's contract on shapes; a mismatch is a host bug worth naming.
fn expect_shape(name: &str, t: &Tensor, shape: &[i64]) -> Result<()> {
    if t.size() == shape {
        Ok(())
    } else {
        Err(PluginError::compute(format!("{name}: expected shape {shape:?}, got {:?}", t.size())))
    }
}

rlhf_plugin_api::export_algorithm!(
    Ppo,
    name: "ppo",
    description: "Token-level PPO with GAE (DeepSpeed-Chat phase 3): KL-in-reward, reward clip, clipped losses"
);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tch::Device;

    const NAN: f32 = f32::NAN;

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
    }

    fn ppo(cfg: serde_json::Value) -> Ppo {
        Ppo::new(&cfg.to_string(), &ctx()).unwrap()
    }

    fn t2(rows: &[&[f32]]) -> Tensor {
        Tensor::from_slice2(rows)
    }

    fn t1(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    fn values_of(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
    }

    fn assert_close(actual: &[f32], expected: &[f32], tol: f32) {
        assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
        for (a, e) in actual.iter().zip(expected) {
            assert!((a - e).abs() <= tol, "{actual:?} vs {expected:?}");
        }
    }

    fn metric(m: &[(String, f64)], name: &str) -> f64 {
        m.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no metric {name} in {m:?}")).1
    }

    fn experience(score: &[f32], old: &[&[f32]], reff: &[&[f32]], values: &[&[f32]], mask: &[&[f32]]) -> Experience {
        Experience {
            rewards: t1(score),
            logprobs: t2(old),
            ref_logprobs: Some(t2(reff)),
            values: Some(t2(values)),
            action_mask: t2(mask),
            group_ids: Tensor::arange(score.len() as i64, (Kind::Int64, Device::Cpu)),
            step: 0,
        }
    }

    /// seeds/ppo-explained.md §9: V = [8, 9, 1], final score 0, no KL, γ = 1, λ = 0 (pure TD):
    /// A = [9 − 8, 1 − 9, 0 − 1] = [+1, −8, −1], returns = A + V = [9, 1, 0].
    #[test]
    fn boil_the_shoe() {
        let mut algo = ppo(json!({"kl_ctl": 0.0, "gamma": 1.0, "lam": 0.0}));
        let exp = experience(
            &[0.0],
            &[&[-1.0, -2.0, -3.0]],
            &[&[-0.5, -0.5, -0.5]],
            &[&[8.0, 9.0, 1.0]],
            &[&[1.0, 1.0, 1.0]],
        );
        let p = algo.prepare(&exp).unwrap();
        assert_close(&values_of(&p.advantages), &[1.0, -8.0, -1.0], 1e-6);
        assert_close(&values_of(&p.returns.unwrap()), &[9.0, 1.0, 0.0], 1e-6);
    }

    /// γ = 0.9, λ = 0.95 (γλ = 0.855), kl_ctl = 0.1, clip_reward_value = 5.
    ///
    /// Row 0 (3 tokens): k1 = old − ref = [0.5, −1.0, 0.0] → r = [−0.05, 0.1, 0.0]; score 7 → 5 at t = 2:
    ///   r = [−0.05, 0.1, 5.0], V = [1, 2, 3]
    ///   t=2: δ = 5 + 0 − 3 = 2.0;             A = 2.0
    ///   t=1: δ = 0.1 + 0.9·3 − 2 = 0.8;        A = 0.8 + 0.855·2.0 = 2.51
    ///   t=0: δ = −0.05 + 0.9·2 − 1 = 0.75;     A = 0.75 + 0.855·2.51 = 2.89605
    ///   returns = A + V = [3.89605, 4.51, 5.0]
    /// Row 1 (2 tokens, slot 2 padded with garbage incl. NaN): k1 = [0.0, 0.2] → r = [0, −0.02];
    ///   score −8 → −5 at t = 1: r = [0, −5.02], V = [0.5, −1.0, (0)]
    ///   t=2: padding → A = 0
    ///   t=1: δ = −5.02 + 0.9·0 − (−1) = −4.02;  A = −4.02
    ///   t=0: δ = 0 + 0.9·(−1) − 0.5 = −1.4;     A = −1.4 + 0.855·(−4.02) = −4.8371
    ///   returns = [−4.3371, −5.02, 0]
    #[test]
    fn gae_by_hand_with_kl_clip_and_padding() {
        let mut algo = ppo(json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95, "clip_reward_value": 5.0}));
        let exp = experience(
            &[7.0, -8.0],
            &[&[-1.0, -2.0, -0.5], &[-0.2, -0.4, 9.0]],
            &[&[-1.5, -1.0, -0.5], &[-0.2, -0.6, -3.0]],
            &[&[1.0, 2.0, 3.0], &[0.5, -1.0, NAN]],
            &[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]],
        );
        let p = algo.prepare(&exp).unwrap();
        assert_close(&values_of(&p.advantages), &[2.89605, 2.51, 2.0, -4.8371, -4.02, 0.0], 1e-5);
        assert_close(&values_of(&p.returns.unwrap()), &[3.89605, 4.51, 5.0, -4.3371, -5.02, 0.0], 1e-5);
        assert_eq!(metric(&p.metrics, "ppo/kl_coef"), 0.1);
        // Σ k1 per row: [−0.5, 0.2] → mean −0.15.
        assert!((metric(&p.metrics, "ppo/rollout_kl") + 0.15).abs() < 1e-6);
        assert!(!p.advantages.requires_grad());
    }

    /// One token, γ = λ = 1, V = 0, score 0, kl_ctl = 1, old − ref = 0.5: A = −k.
    /// k1 = 0.5; k2 = ½·0.25 = 0.125; k3 = exp(−0.5) + 0.5 − 1 = 0.1065307.
    #[test]
    fn kl_estimators() {
        for (est, k) in [("k1", 0.5f32), ("k2", 0.125), ("k3", 0.1065307)] {
            let mut algo = ppo(json!({"kl_ctl": 1.0, "lam": 1.0, "kl_estimator": est}));
            let exp = experience(&[0.0], &[&[-1.0]], &[&[-1.5]], &[&[0.0]], &[&[1.0]]);
            let p = algo.prepare(&exp).unwrap();
            assert_close(&values_of(&p.advantages), &[-k], 1e-6);
        }
    }

    /// Whitened advantages have mean 0 and unbiased std 1 over the valid tokens, 0 on padding;
    /// returns are computed from the raw advantages.
    #[test]
    fn whitening() {
        let cfg = json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95, "whiten_advantages": true});
        let exp = || {
            experience(
                &[7.0, -8.0],
                &[&[-1.0, -2.0, -0.5], &[-0.2, -0.4, 9.0]],
                &[&[-1.5, -1.0, -0.5], &[-0.2, -0.6, -3.0]],
                &[&[1.0, 2.0, 3.0], &[0.5, -1.0, NAN]],
                &[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]],
            )
        };
        let p = ppo(cfg).prepare(&exp()).unwrap();
        let a = values_of(&p.advantages);
        assert_eq!(a[5], 0.0);
        let valid = &a[..5];
        let mean = valid.iter().sum::<f32>() / 5.0;
        let var = valid.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 4.0;
        assert!(mean.abs() < 1e-6, "{mean}");
        assert!((var.sqrt() - 1.0).abs() < 1e-5, "{var}");
        let raw = ppo(json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95})).prepare(&exp()).unwrap();
        assert_close(&values_of(&p.returns.unwrap()), &values_of(&raw.returns.unwrap()), 0.0);
    }

    /// kl_ctl = 0.1, target 6, horizon 10000, B = 2.
    /// Batch 1: Σ k1 per row = [3, 5] → KL 4; err = clip(4/6 − 1 = −0.333, ±0.2) = −0.2;
    ///   kl_ctl = 0.1·(1 − 0.2·2/10000) = 0.099996.
    /// Batch 2 (uses 0.099996): KL 6.6; err = 6.6/6 − 1 = 0.1; kl_ctl = 0.099996·(1 + 0.1·2/10000).
    #[test]
    fn adaptive_kl_update() {
        let mut algo = ppo(json!({"kl_ctl": 0.1, "adaptive_kl": {"target": 6.0, "horizon": 10000}}));
        let batch = |k: [f32; 2]| {
            experience(&[0.0, 0.0], &[&[k[0]], &[k[1]]], &[&[0.0], &[0.0]], &[&[0.0], &[0.0]], &[&[1.0], &[1.0]])
        };
        let p = algo.prepare(&batch([3.0, 5.0])).unwrap();
        assert_eq!(metric(&p.metrics, "ppo/kl_coef"), 0.1);
        assert!((algo.kl_ctl - 0.099996).abs() < 1e-12, "{}", algo.kl_ctl);
        let p = algo.prepare(&batch([6.0, 7.2])).unwrap();
        assert!((metric(&p.metrics, "ppo/kl_coef") - 0.099996).abs() < 1e-12);
        assert!((algo.kl_ctl - 0.099996 * (1.0 + 0.1 * 2.0 / 10000.0)).abs() < 1e-9, "{}", algo.kl_ctl);
        // Fixed controller: unchanged.
        let mut fixed = ppo(json!({"kl_ctl": 0.1}));
        fixed.prepare(&batch([3.0, 5.0])).unwrap();
        assert_eq!(fixed.kl_ctl, 0.1);
    }

    /// ε = ε_v = 0.2, vf_coef 1. Valid tokens (1,1) is padding (garbage):
    ///   (0,0): ρ = 1.5, A = 2  → −3.0 vs −2·1.2 = −2.4 → −2.4 (clipped branch)
    ///   (0,1): ρ = 1,   A = −1 → 1.0 vs 1.0           → 1.0
    ///   (1,0): ρ = 0.5, A = 1  → −0.5 vs −0.8         → −0.5 (unclipped: pessimistic)
    ///   pg_loss = (−2.4 + 1.0 − 0.5)/3 = −0.6333333; clip_ratio = 1/3
    ///   values (v, old, ret): (1, 0.5, 2) → vclip 0.7: max(1, 1.69) = 1.69 (clipped)
    ///                         (0, 0.1, −1) → vclip 0: max(1, 1) = 1
    ///                         (3, 2, 2.5) → vclip 2.2: max(0.25, 0.09) = 0.25
    ///   vf_loss = ½·(1.69 + 1 + 0.25)/3 = 0.49; vf_clipfrac = 1/3
    ///   entropy [1, 2, 3] → mean 2; entropy_coef 0.01 → loss = −0.6333333 + 0.49 − 0.02 = −0.1633333
    ///   kl: Σ (logp − ref) per row = [0.1 + 0.2, 0.3] → mean 0.3
    ///   approx_kl = ½·(ln²1.5 + 0 + ln²0.5)/3
    ///   explained_var: returns [2, −1, 2.5], values [1, 0, 3]: Var(ret) = 7.1666667/3,
    ///   Var(ret − v) = Var([1, −1, −0.5]) = 2.1666667/3 → 1 − 2.1666667/7.1666667 = 0.6976744
    #[test]
    fn loss_by_hand_with_clipping() {
        let mut algo = ppo(json!({"entropy_coef": 0.01}));
        assert!(algo.requirements().entropy);
        let (l15, l05) = (1.5f32.ln(), 0.5f32.ln());
        let logp = t2(&[&[-1.0 + l15, -1.0], &[-2.0 + l05, NAN]]).set_requires_grad(true);
        let values = t2(&[&[1.0, 0.0], &[3.0, NAN]]).set_requires_grad(true);
        let mb = Minibatch {
            logprobs: logp.shallow_clone(),
            old_logprobs: t2(&[&[-1.0, -1.0], &[-2.0, 5.0]]),
            ref_logprobs: Some(t2(&[&[-1.1 + l15, -1.2], &[-2.3 + l05, 7.0]])),
            values: Some(values.shallow_clone()),
            old_values: Some(t2(&[&[0.5, 0.1], &[2.0, NAN]])),
            advantages: t2(&[&[2.0, -1.0], &[1.0, NAN]]),
            returns: Some(t2(&[&[2.0, -1.0], &[2.5, 1e30]])),
            action_mask: t2(&[&[1.0, 1.0], &[1.0, 0.0]]),
            entropy: Some(t2(&[&[1.0, 2.0], &[3.0, NAN]])),
            rewards: t1(&[0.0, 0.0]),
            step: 0,
        };
        let out = algo.loss(&mb).unwrap();
        let m = &out.metrics;
        assert!((metric(m, "loss/policy") + 0.6333333).abs() < 1e-6);
        assert!((metric(m, "loss/value") - 0.49).abs() < 1e-6);
        assert!((out.loss.double_value(&[]) + 0.1633333).abs() < 1e-6);
        assert!((metric(m, "clip_ratio") - 1.0 / 3.0).abs() < 1e-6);
        assert!((metric(m, "ppo/vf_clipfrac") - 1.0 / 3.0).abs() < 1e-6);
        assert!((metric(m, "entropy") - 2.0).abs() < 1e-6);
        assert!((metric(m, "kl") - 0.3).abs() < 1e-6);
        let approx_kl = 0.5 * (1.5f64.ln().powi(2) + 0.5f64.ln().powi(2)) / 3.0;
        assert!((metric(m, "approx_kl") - approx_kl).abs() < 1e-6);
        assert!((metric(m, "explained_var") - 0.6976744).abs() < 1e-6);

        // Gradients: padding gets none (and no NaN); the clipped (0,0) token gets none from pg_loss;
        // (1,0): d/dlogp of −A·ρ/3 = −1·0.5/3.
        out.loss.backward();
        let g = values_of(&logp.grad());
        assert_close(&g, &[0.0, 1.0 / 3.0, -0.5 / 3.0, 0.0], 1e-6);
        // Value grads: ½·d/dv of the chosen branch /3: (0,0) clipped branch is constant → 0;
        // (0,1): (v − ret) = 1 → 1/3 (both branches tie: torch splits, sum is the same); (1,0): 0.5/3.
        assert_close(&values_of(&values.grad()), &[0.0, 1.0 / 3.0, 0.5 / 3.0, 0.0], 1e-6);
    }

    /// A row with an empty mask produces neither NaN advantages nor a NaN loss, even with NaN garbage.
    #[test]
    fn all_masked_row_is_finite() {
        let mut algo = ppo(json!({"whiten_advantages": true}));
        let exp = experience(
            &[1.0, 3.0],
            &[&[-1.0, -1.0], &[NAN, NAN]],
            &[&[-1.0, -1.0], &[NAN, 0.0]],
            &[&[0.5, 0.5], &[NAN, NAN]],
            &[&[1.0, 1.0], &[0.0, 0.0]],
        );
        let p = algo.prepare(&exp).unwrap();
        let returns = p.returns.unwrap();
        assert!(values_of(&p.advantages).iter().all(|x| x.is_finite()));
        assert!(values_of(&returns).iter().all(|x| x.is_finite()));
        // The empty row gets no score: advantages and returns are 0, not the score at slot 0.
        assert_close(&values_of(&p.advantages.narrow(0, 1, 1)), &[0.0, 0.0], 0.0);
        assert_close(&values_of(&returns.narrow(0, 1, 1)), &[0.0, 0.0], 0.0);
        assert!(p.metrics.iter().all(|(_, v)| v.is_finite()), "{:?}", p.metrics);
        // A minibatch made of the empty row alone.
        let mb = Minibatch {
            logprobs: t2(&[&[NAN, NAN]]),
            old_logprobs: t2(&[&[NAN, NAN]]),
            ref_logprobs: Some(t2(&[&[NAN, NAN]])),
            values: Some(t2(&[&[NAN, NAN]])),
            old_values: Some(t2(&[&[NAN, NAN]])),
            advantages: p.advantages.narrow(0, 1, 1),
            returns: Some(returns.narrow(0, 1, 1)),
            action_mask: t2(&[&[0.0, 0.0]]),
            entropy: None,
            rewards: t1(&[3.0]),
            step: 0,
        };
        let out = algo.loss(&mb).unwrap();
        assert_eq!(out.loss.double_value(&[]), 0.0);
        assert!(out.metrics.iter().all(|(_, v)| v.is_finite()), "{:?}", out.metrics);
    }

    #[test]
    fn missing_or_misshaped_inputs_are_errors() {
        let mut algo = ppo(json!({}));
        let exp = experience(&[0.0], &[&[-1.0], &[-1.0]], &[&[-1.0], &[-1.0]], &[&[0.0], &[0.0]], &[&[1.0], &[1.0]]);
        let e = algo.prepare(&exp).unwrap_err();
        assert_eq!(e.to_string(), "rewards: expected shape [2], got [1]");
        let mut exp = experience(&[0.0], &[&[-1.0]], &[&[-1.0]], &[&[0.0]], &[&[1.0]]);
        exp.values = None;
        let e = algo.prepare(&exp).unwrap_err();
        assert!(e.to_string().contains("no `values`"), "{e}");
    }

    #[test]
    fn requirements_follow_config() {
        let r = ppo(json!({})).requirements();
        assert_eq!(r, Requirements { reference: true, critic: true, entropy: false });
    }

    #[test]
    fn defaults_are_deepspeed_chat() {
        let c = ppo(json!({})).cfg;
        assert_eq!((c.kl_ctl, c.clip_reward_value, c.gamma, c.lam), (0.1, 5.0, 1.0, 0.95));
        assert_eq!((c.cliprange, c.cliprange_value, c.vf_coef, c.entropy_coef), (0.2, 0.2, 1.0, 0.0));
        assert_eq!((c.whiten_advantages, c.kl_estimator), (false, KlEstimator::K1));
        assert!(c.adaptive_kl.is_none());
        let a = ppo(json!({"adaptive_kl": {}})).cfg.adaptive_kl.unwrap();
        assert_eq!((a.target, a.horizon), (6.0, 10000.0));
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| Ppo::new(&cfg.to_string(), &ctx()).unwrap_err().to_string();
        let e = err(json!({"kl_coef": 0.1}));
        assert!(e.starts_with("kl_coef: unknown field"), "{e}");
        let e = err(json!({"gamma": "one"}));
        assert!(e.starts_with("gamma: invalid type"), "{e}");
        let e = err(json!({"kl_estimator": "k4"}));
        assert!(e.starts_with("kl_estimator: unknown variant `k4`"), "{e}");
        let e = err(json!({"adaptive_kl": {"target": "six"}}));
        assert!(e.starts_with("adaptive_kl.target: invalid type"), "{e}");
        let e = err(json!({"lam": 1.5}));
        assert!(e.starts_with("lam: must be in [0, 1]"), "{e}");
    }
}
