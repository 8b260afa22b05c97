//! Helpers for algorithm authors, so each algorithm file is only its formula: masked reductions,
//! per-token KL estimators and the adaptive KL controller, group statistics, explained variance,
//! input and config checks that name what is wrong, and a metrics builder.
//!
//! Conventions (those of [`Experience`](crate::Experience) and [`Minibatch`](crate::Minibatch)):
//! `B` (or `b`) samples, `R` response slots; `mask` is the f32 `action_mask` (1 on valid response
//! tokens, 0 on padding) and `valid` the bool tensor `mask > 0`. The host hands every per-token
//! input with exactly 0.0 on padding; what a plugin computes from them may not be 0 there
//! (`exp(0 − 0) = 1`, a broadcast sequence advantage). Helpers that take `valid` drop padding with
//! `where`, so nothing computed there reaches values or gradients; helpers that take `mask`
//! multiply by it, as the reference implementations do (`(x * mask).sum()`), and need `x` finite
//! on padding (true of the inputs; pass a derived tensor that may overflow through [`masked`]).
//!
//! Each helper is one fixed sequence of libtorch operations: two algorithms calling the same helper
//! compute the same numbers, bit for bit. Where reference implementations differ in a way that can
//! change the numbers (a clamp, `where` or `·mask`, a biased or unbiased variance), the variants are
//! distinct functions here, named for what they compute.
//!
//! The host checks the documented input shapes and dtypes before calling
//! [`Algorithm::prepare`](crate::Algorithm::prepare) and [`Algorithm::loss`](crate::Algorithm::loss),
//! so an algorithm need not re-check them; [`need`] fetches an optional input it requires and
//! [`expect_shape`] checks anything else.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::error::PluginError;

type Result<T> = std::result::Result<T, PluginError>;

// ---------------------------------------------------------------------------------------------
// Masked reductions
// ---------------------------------------------------------------------------------------------

/// `x` on valid slots, 0 elsewhere: `where(valid, x, 0)`. A value computed on padding (an overflow,
/// even NaN) would survive `x·mask` (and make its gradient NaN); `where` drops it, and the gradient
/// of a padded slot is exactly 0.
///
/// # Shapes
/// `x [B, R]` (or broadcastable to it, e.g. `[B, 1]`), `valid [B, R]` bool; returns `[B, R]`.
pub fn masked(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    Ok(x.f_where_scalarother(valid, 0.0)?)
}

/// The token mean `Σ x·mask / max(Σ mask, 1)` in f32 (DeepSpeed-Chat's and TRL's `masked_mean`,
/// `(x * mask).sum() / mask.sum()`, but 0 instead of NaN when no token is valid).
///
/// # Shapes
/// `x`, `mask`: `[B, R]`; returns a scalar `[]`.
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?;
    Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&n)?)
}

/// The token mean of a loss over the **whole optimizer step**: `Σ x·mask / (N / k)` when the step
/// has `k = accumulation_steps > 1` micro-batches (gradient accumulation, data-parallel ranks)
/// with `N = step_tokens` valid tokens in all of them — the host divides each micro-batch's loss
/// by `k`, so the step's gradient is that of the token mean over all `N` tokens, whatever each
/// micro-batch holds. With one micro-batch it is [`masked_mean`].
///
/// # Shapes
/// `x`, `mask`: `[b, R]`; returns a scalar.
pub fn token_mean(x: &Tensor, mask: &Tensor, accumulation_steps: u64, step_tokens: f64) -> Result<Tensor> {
    if accumulation_steps > 1 {
        let share = (step_tokens / accumulation_steps as f64).max(f64::MIN_POSITIVE);
        Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.f_div_scalar(share)?)
    } else {
        masked_mean(x, mask)
    }
}

/// The per-sample mean of `x` over the **whole optimizer step**: `Σ x / (S / k)` when the step
/// has `k = accumulation_steps > 1` micro-batches with `S = step_rows` samples in all of them —
/// the host divides each micro-batch's loss by `k`, so the step's gradient is that of the mean
/// over all `S` samples, whatever each micro-batch holds (verl's `seq-mean` over its global batch).
/// With one micro-batch it is `x.mean()`.
///
/// # Shapes
/// `x`: `[b]`; returns a scalar.
pub fn row_mean(x: &Tensor, accumulation_steps: u64, step_rows: f64) -> Result<Tensor> {
    if accumulation_steps > 1 {
        let share = (step_rows / accumulation_steps as f64).max(f64::MIN_POSITIVE);
        Ok(x.f_sum(Kind::Float)?.f_div_scalar(share)?)
    } else {
        Ok(x.f_mean(Kind::Float)?)
    }
}

/// Each row's sum over its valid tokens, `Σ_t x_t·mask_t`, in f32 (TRL's
/// `(per_token_loss * mask).sum(-1)`).
///
/// # Shapes
/// `x`, `mask`: `[B, R]`; returns `[B]`.
pub fn masked_row_sum(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(x.f_mul(mask)?.f_sum_dim_intlist(1, false, Kind::Float)?)
}

/// The fraction of valid tokens where `condition` holds: [`masked_mean`] of `condition` as 0/1
/// (TRL's `clip_ratio`, `vf_clipfrac`).
///
/// # Shapes
/// `condition [B, R]` bool, `mask [B, R]`; returns a scalar `[]`.
pub fn masked_fraction(condition: &Tensor, mask: &Tensor) -> Result<Tensor> {
    masked_mean(&condition.f_to_kind(Kind::Float)?, mask)
}

/// TRL's `masked_whiten`: `(x − mean)·rsqrt(var + 1e-8)` with the mean ([`masked_mean`]) and the
/// unbiased variance `Σ (x − mean)²·mask / max(Σ mask − 1, 1)` over the valid tokens; padding is 0.
///
/// # Shapes
/// `x`, `mask`: `[B, R]`, `x` finite on padding; returns `[B, R]`.
pub fn masked_whiten(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let n = mask.f_sum(Kind::Float)?; // []
    let centered = x.f_sub(&masked_mean(x, mask)?)?; // [B, R]
    let var = centered.f_square()?.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&n.f_sub_scalar(1.0)?.f_clamp_min(1.0)?)?;
    masked(&centered.f_mul(&var.f_add_scalar(1e-8)?.f_rsqrt()?)?, &mask.f_gt(0.0)?)
}

/// TRL's `approx_kl` between the current and the sampling policy: `½ · mean_t (logp − logp_old)²`
/// over the valid tokens ([`masked_mean`]).
///
/// # Shapes
/// `log_ratio` (`logp − logp_old`, finite on padding), `mask`: `[B, R]`; returns a scalar `[]`.
pub fn approx_kl(log_ratio: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(masked_mean(&log_ratio.f_square()?, mask)?.f_mul_scalar(0.5)?)
}

// ---------------------------------------------------------------------------------------------
// KL to a reference
// ---------------------------------------------------------------------------------------------

/// Which per-token KL estimator [`kl_estimate`] computes (config value `"k1"`, `"k2"` or `"k3"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// `logp − logp_ref`: unbiased, can be negative (DeepSpeed-Chat, TRL's default).
    K1,
    /// `½·(logp − logp_ref)²`: biased, non-negative.
    K2,
    /// `exp(logp_ref − logp) − (logp_ref − logp) − 1`: unbiased, non-negative.
    K3,
}

/// Per-token estimate of `KL(π ‖ π_ref)` from the log-probs of tokens sampled from `π` (Schulman,
/// "Approximating KL Divergence", 2020; OpenRLHF's `compute_approx_kl`), with
/// `log_ratio = logp − logp_ref`:
///
/// ```text
/// k1 = log_ratio      k2 = ½·log_ratio²      k3 = exp(−log_ratio) + log_ratio − 1
/// ```
///
/// # Shapes
/// `logp`, `logp_ref`: `[B, R]` (finite on padding); returns `[B, R]`.
pub fn kl_estimate(logp: &Tensor, logp_ref: &Tensor, estimator: KlEstimator) -> Result<Tensor> {
    let log_ratio = logp.f_sub(logp_ref)?; // log π/π_ref, [B, R]
    Ok(match estimator {
        KlEstimator::K1 => log_ratio,
        KlEstimator::K2 => log_ratio.f_square()?.f_mul_scalar(0.5)?,
        // exp(ref − logp) − (ref − logp) − 1 with ref − logp = −log_ratio
        KlEstimator::K3 => log_ratio.f_neg()?.f_exp()?.f_add(&log_ratio)?.f_sub_scalar(1.0)?,
    })
}

/// The adaptive KL controller of Ziegler et al. (2019) (TRL's and OpenRLHF's
/// `AdaptiveKLController`): steers the coefficient of a KL penalty towards a target KL. As a config
/// section: `{ target = 6.0, horizon = 10000 }` (both optional, both > 0).
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
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
    /// The next coefficient after a batch of `n_samples` whose measured KL is `current_kl`:
    /// `err = clip(kl/target − 1, −0.2, 0.2)`; `kl_ctl · (1 + err·n_samples/horizon)`.
    pub fn update(&self, kl_ctl: f64, current_kl: f64, n_samples: i64) -> f64 {
        let proportional_error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        let mult = 1.0 + proportional_error * n_samples as f64 / self.horizon;
        kl_ctl * mult
    }
}

// ---------------------------------------------------------------------------------------------
// Per-sample values and response positions
// ---------------------------------------------------------------------------------------------

/// A per-sample value broadcast over its row's valid tokens, 0 on padding (a sequence advantage
/// shared by all of a response's tokens).
///
/// # Shapes
/// `x [B]`, `valid [B, R]` bool; returns `[B, R]` of `x`'s dtype.
pub fn per_token(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    masked(&x.f_unsqueeze(1)?, valid) // [B, 1] → [B, R]
}

/// Each row's last valid slot, `max_t t · valid_t` (0 for an empty row): where DeepSpeed-Chat's
/// `compute_rewards` puts the score. With right padding alone this is `Σ_t valid_t − 1`; a
/// multi-turn trajectory's action mask also has holes (observation tokens), and its last valid
/// slot is the last sampled token.
///
/// # Shapes
/// `valid [B, R]` bool; returns `[B, 1]` i64 (the index form of `gather` and `scatter_add`).
pub fn last_index(valid: &Tensor) -> Result<Tensor> {
    let r = valid.size().get(1).copied().unwrap_or(0);
    let slots = Tensor::f_arange(r, (Kind::Int64, valid.device()))?.f_unsqueeze(0)?; // [1, R]
    Ok(valid.f_to_kind(Kind::Int64)?.f_mul(&slots)?.f_amax(1, true)?)
}

/// Each row's entry at its last valid token ([`last_index`]; slot 0 for an empty row).
///
/// # Shapes
/// `x`, `valid`: `[B, R]`; returns `[B]`.
pub fn last_valid(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    Ok(x.f_gather(1, &last_index(valid)?, false)?.f_squeeze_dim(1)?)
}

// ---------------------------------------------------------------------------------------------
// Group statistics
// ---------------------------------------------------------------------------------------------

/// Which standard deviation [`group_stats`] computes (config value `"population"` or
/// `"unbiased"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StdEstimator {
    /// `sqrt(1/n Σ (x − mean)²)` (numpy's default, DeepSeekMath's formula).
    Population,
    /// `sqrt(1/(n−1) Σ (x − mean)²)` (`torch.std`, TRL's `GRPOTrainer`); 0 for a group of one
    /// (the divisor is clamped to 1), never NaN.
    Unbiased,
}

/// Refuses one sample per prompt for an algorithm whose advantage compares the samples of a prompt
/// with each other (GRPO, GSPO, RLOO, a group-mean baseline): a group of one has advantage 0, so
/// the rewards would teach nothing. TRL refuses fewer than 2 generations per prompt the same way.
pub fn require_groups(ctx: &crate::algorithm::Context, algorithm: &str) -> Result<()> {
    if ctx.samples_per_prompt >= 2 {
        return Ok(());
    }
    Err(PluginError::unsupported(format!(
        "rollout.samples_per_prompt = {}: {algorithm} compares the samples of a prompt with each other, so it needs \
         >= 2 (with one, every advantage is 0 and the rewards teach nothing)",
        ctx.samples_per_prompt
    )))
}

/// Dense group indices `0..G` for arbitrary `group_ids` (any values, any order, groups neither
/// contiguous nor of equal size), numbered in order of first appearance, and `G`.
///
/// # Shapes
/// `group_ids [B]` i64; returns `([B]` i64 on the same device, `G)`.
pub fn group_index(group_ids: &Tensor) -> Result<(Tensor, i64)> {
    let ids = Vec::<i64>::try_from(&group_ids.f_to(Device::Cpu)?)?;
    let mut dense: HashMap<i64, i64> = HashMap::new();
    let index: Vec<i64> = ids
        .iter()
        .map(|id| {
            let next = dense.len() as i64;
            *dense.entry(*id).or_insert(next)
        })
        .collect();
    Ok((Tensor::f_from_slice(&index)?.f_to(group_ids.device())?, dense.len() as i64))
}

/// Per-group mean and standard deviation, accumulated with `index_add` in `x`'s dtype (pass f64 so
/// that a group of equal values has a std of exactly 0):
///
/// ```text
/// n_g = Σ_{i∈g} 1      mean_g = Σ_{i∈g} x_i / n_g      std_g = sqrt(Σ_{i∈g} (x_i − mean_g)² / d_g)
/// d_g = n_g (Population)  or  max(n_g − 1, 1) (Unbiased)
/// ```
///
/// Gather a per-sample form with `mean.f_index_select(0, group)`.
///
/// # Shapes
/// `x [B]`, `group [B]` i64 in `0..n_groups` (from [`group_index`]); returns `(mean [G], std [G])`.
pub fn group_stats(x: &Tensor, group: &Tensor, n_groups: i64, std: StdEstimator) -> Result<(Tensor, Tensor)> {
    let zeros = Tensor::f_zeros([n_groups], (x.kind(), x.device()))?; // [G]
    let counts = zeros.f_index_add(0, group, &x.f_ones_like()?)?; // n_g
    let mean = zeros.f_index_add(0, group, x)?.f_div(&counts)?; // 1/n_g Σ x
    let squares = x.f_sub(&mean.f_index_select(0, group)?)?.f_square()?; // [B]
    let sum_squares = zeros.f_index_add(0, group, &squares)?; // Σ (x − mean_g)²
    let denominator = match std {
        StdEstimator::Population => counts,
        StdEstimator::Unbiased => counts.f_sub_scalar(1.0)?.f_clamp_min(1.0)?,
    };
    Ok((mean, sum_squares.f_div(&denominator)?.f_sqrt()?))
}

// ---------------------------------------------------------------------------------------------
// Explained variance
// ---------------------------------------------------------------------------------------------

/// `1 − Var(targets − values) / Var(targets)` over all elements, with the population variance
/// `torch.var(x, unbiased=False)` (cleanrl's `explained_var` on per-sample values); `None` when
/// the targets have no variance.
///
/// # Shapes
/// `values`, `targets`: `[b]`.
pub fn explained_variance(values: &Tensor, targets: &Tensor) -> Result<Option<f64>> {
    let var = |x: &Tensor| -> Result<f64> { scalar(&x.f_var_dim(0i64, false, false)?) };
    let var_targets = var(targets)?;
    if var_targets > 0.0 {
        Ok(Some(1.0 - var(&targets.f_sub(values)?)? / var_targets))
    } else {
        Ok(None)
    }
}

/// `1 − Var(targets − values) / Var(targets)` over the valid tokens, each variance the masked mean
/// of the squared deviation from the masked mean (cleanrl's `explained_var` on per-token values);
/// `None` when the targets have no variance.
///
/// # Shapes
/// `values`, `targets`, `mask`: `[b, R]`, `values` and `targets` finite on padding.
pub fn masked_explained_variance(values: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<Option<f64>> {
    let var = |x: &Tensor| -> Result<f64> {
        let centered = x.f_sub(&masked_mean(x, mask)?)?;
        scalar(&masked_mean(&centered.f_square()?, mask)?)
    };
    let var_targets = var(targets)?;
    if var_targets > 0.0 {
        Ok(Some(1.0 - var(&targets.f_sub(values)?)? / var_targets))
    } else {
        Ok(None)
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs and checks
// ---------------------------------------------------------------------------------------------

/// An optional input that the algorithm's [`Requirements`](crate::Requirements) ask the host for,
/// or an error naming it and the plugin: `grpo: the host passed no `ref_logprobs` although the
/// requirements ask for it`. (Its shape is already checked by the host.)
pub fn need<'a>(t: &'a Option<Tensor>, name: &str, plugin: &str) -> Result<&'a Tensor> {
    t.as_ref().ok_or_else(|| missing(name, plugin))
}

/// The error of [`need`]: `plugin` required the input `name` and the host passed none.
pub fn missing(name: &str, plugin: &str) -> PluginError {
    PluginError::compute(format!("{plugin}: the host passed no `{name}` although the requirements ask for it"))
}

/// `Ok` when `t` has exactly `shape`, else an error naming the tensor:
/// `values: expected shape [4, 3], got [4]`. For tensors the host does not check (the documented
/// inputs are checked before `prepare` and `loss` run).
///
/// # Shapes
/// `t`: any; `shape`: the expected sizes.
pub fn expect_shape(name: &str, t: &Tensor, shape: &[i64]) -> Result<()> {
    let got = t.size();
    if got == shape {
        Ok(())
    } else {
        Err(PluginError::compute(format!("{name}: expected shape {shape:?}, got {got:?}")))
    }
}

/// A range check of a config value: `Err(config(key, "must be >= 0, got v"))` unless `v >= 0`
/// (NaN fails).
pub fn check_nonnegative(key: &str, v: f64) -> Result<()> {
    if v.is_nan() || v < 0.0 {
        return Err(PluginError::config(key, format!("must be >= 0, got {v}")));
    }
    Ok(())
}

/// A range check of a config value: `Err(config(key, "must be > 0, got v"))` unless `v > 0` (NaN
/// fails).
pub fn check_positive(key: &str, v: f64) -> Result<()> {
    if v.is_nan() || v <= 0.0 {
        return Err(PluginError::config(key, format!("must be > 0, got {v}")));
    }
    Ok(())
}

/// A range check of a config value: `Err(config(key, "must be in [0, 1], got v"))` unless
/// `0 <= v <= 1` (NaN fails).
pub fn check_unit_interval(key: &str, v: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&v) {
        return Err(PluginError::config(key, format!("must be in [0, 1], got {v}")));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// A scalar tensor's value as f64.
///
/// # Shapes
/// `t`: `[]` (or one element).
pub fn scalar(t: &Tensor) -> Result<f64> {
    Ok(t.f_double_value(&[])?)
}

/// Builds the `(name, value)` list of [`Prepared::metrics`](crate::Prepared::metrics) and
/// [`LossOutput::metrics`](crate::LossOutput::metrics), in insertion order:
///
/// ```ignore
/// let metrics = Metrics::new()
///     .scalar("loss/policy", &pg_loss)?
///     .scalar("clip_ratio", &ops::masked_fraction(&clipped, mask)?)?
///     .value("ppo/kl_coef", kl_coef)
///     .finish();
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics(Vec<(String, f64)>);

impl Metrics {
    /// An empty list.
    pub fn new() -> Self {
        Metrics::default()
    }

    /// Adds `name = value`.
    pub fn value(&mut self, name: &str, value: f64) -> &mut Self {
        self.0.push((name.to_string(), value));
        self
    }

    /// Adds `name =` the value of the scalar tensor `t` ([`scalar`]).
    ///
    /// # Shapes
    /// `t`: `[]`.
    pub fn scalar(&mut self, name: &str, t: &Tensor) -> Result<&mut Self> {
        let value = scalar(t)?;
        Ok(self.value(name, value))
    }

    /// Adds `name = value` when there is a value (e.g. [`explained_variance`]).
    pub fn optional(&mut self, name: &str, value: Option<f64>) -> &mut Self {
        if let Some(v) = value {
            self.value(name, v);
        }
        self
    }

    /// The list, leaving this builder empty.
    pub fn finish(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.0)
    }
}

impl From<Metrics> for Vec<(String, f64)> {
    fn from(m: Metrics) -> Self {
        m.0
    }
}

#[cfg(test)]
mod tests;
