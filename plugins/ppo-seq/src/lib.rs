//! Simplified sequence-level PPO, a teaching simplification: one action per response — log-probs
//! summed over the response, one advantage per sample (final reward minus final value), no GAE and
//! no per-token loss. The ratio clipping of PPO is kept.
//!
//! Per minibatch ([`PpoSeq::loss`]), `mean` over the `b` samples, `Σ_t` over valid response tokens:
//!
//! ```text
//! actor_logp = Σ_t logp_t        old_logp = Σ_t logp_old_t        ref_logp = Σ_t logp_ref_t
//! A          = R − V.detach()                       R: the sample's reward, V: its final value
//! ratio      = exp(actor_logp − old_logp)
//! policy_loss = −mean(min(ratio·A, clamp(ratio, 1−ε, 1+ε)·A))
//! value_loss  = mean((V − R)²)
//! kl_ref      = mean(actor_logp − ref_logp)         penalty: the policy's drift from the SFT model
//! kl          = mean(actor_logp − old_logp)         monitoring only (`ppo_seq/kl_old`)
//! loss        = policy_loss + vf_coef·value_loss + kl_coef·kl_ref
//! ```
//!
//! **Which value.** "The sample's final value" does not say where the critic is read. The response
//! is one action taken in one state — the prompt — so by default (`value_at = "prompt"`) `V` is the
//! critic at the first response slot, `V(prompt)` (the host's `values[:, t]` is V(s) for the state
//! before token t). That baseline does not depend on the action, so the gradient stays unbiased.
//! `value_at = "last"` reads the last valid response token instead, the state just before the final
//! token: that critic has seen (almost) the whole answer, so once it fits, `R − V` goes to 0 for
//! right and wrong answers alike and the policy stops learning — on the embedded addition preset the
//! reward fell from 0.06 to 0.02–0.08 over 300 steps on four seeds with `"last"`, and rose from
//! 0.14–0.17 to 0.72–0.81 on three seeds with `"prompt"`.
//!
//! [`PpoSeq::prepare`] needs nothing from the batch beyond `R − V_old`: it returns it broadcast over
//! each row's valid tokens as `advantages` (for logging and the host's bookkeeping; the loss recomputes
//! A from the current critic) and `R` broadcast as `returns`.
//!
//! This is not what TRL or OpenRLHF implement (they do token-level PPO with GAE — see the `ppo`
//! plugin).
//!
//! # Config
//!
//! ```toml
//! [algorithm.config]
//! cliprange = 0.2   # sequence ratio clip
//! vf_coef = 0.5     # weight of the value loss
//! kl_coef = 0.02    # weight of the KL-to-reference penalty
//! value_at = "prompt"  # V read at the prompt ("prompt") or at the last response token ("last")
//! ```

use rlhf_plugin_api::ops::{self, masked, Metrics};
use rlhf_plugin_api::prelude::*;
use serde::{Deserialize, Serialize};

type Result<T> = std::result::Result<T, PluginError>;

/// Which critic output is the sample's value `V`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueAt {
    /// `V(prompt)`: the value of the state before the first response token. The response is the
    /// single action, so this is the baseline that does not depend on it (the default).
    Prompt,
    /// The value at the last valid response token (the state before the final token). It has seen
    /// nearly the whole response, so once the critic fits, `R − V → 0` for every sample and the
    /// policy stops learning (measured: the embedded preset's reward falls instead of rising).
    Last,
}

/// The `[algorithm]` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoSeqConfig {
    /// Policy ratio clip ε: the sequence ratio is clamped to `[1 − ε, 1 + ε]`.
    pub cliprange: f64,
    /// Weight of the value loss `mean((V − R)²)`.
    pub vf_coef: f64,
    /// Weight of the KL-to-reference penalty `mean(actor_logp − ref_logp)` in the loss.
    pub kl_coef: f64,
    /// Where `V` is read: `"prompt"` (default) or `"last"`; see [`ValueAt`].
    pub value_at: ValueAt,
}

impl Default for PpoSeqConfig {
    fn default() -> Self {
        PpoSeqConfig { cliprange: 0.2, vf_coef: 0.5, kl_coef: 0.02, value_at: ValueAt::Prompt }
    }
}

impl PpoSeqConfig {
    /// Range checks that serde cannot express; errors name the key.
    fn validate(&self) -> Result<()> {
        ops::check_positive("cliprange", self.cliprange)?;
        ops::check_nonnegative("vf_coef", self.vf_coef)?;
        ops::check_nonnegative("kl_coef", self.kl_coef)
    }
}

/// Sequence-level PPO; stateless between batches.
#[derive(Debug)]
pub struct PpoSeq {
    cfg: PpoSeqConfig,
}

impl Algorithm for PpoSeq {
    fn new(config: &str, _ctx: &Context) -> Result<Self> {
        let cfg: PpoSeqConfig = parse_config(config)?;
        cfg.validate()?;
        Ok(PpoSeq { cfg })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: true, critic: true, entropy: false }
    }

    fn resolved_config(&self) -> serde_json::Value {
        serde_json::to_value(&self.cfg).unwrap_or_default()
    }

    fn describe_keys(&self) -> Vec<KeyDoc> {
        vec![
            KeyDoc {
                key: "cliprange",
                help: "policy ratio clip: the sequence ratio is clamped to [1 - cliprange, 1 + cliprange]",
                peers: &[("TRL", "cliprange"), ("OpenRLHF", "--eps_clip")],
            },
            KeyDoc { key: "vf_coef", help: "weight of the value loss mean((V - R)^2)", peers: &[("TRL", "vf_coef")] },
            KeyDoc {
                key: "kl_coef",
                help: "weight of the KL-to-reference penalty mean(actor_logp - ref_logp) in the loss",
                peers: &[],
            },
            KeyDoc {
                key: "value_at",
                help: "where V is read: prompt (the state before the response) or last (its last token)",
                peers: &[],
            },
        ]
    }

    /// # Shapes
    /// `exp.rewards [B]`, `exp.values`, `action_mask [B, R]`; returns `advantages`, `returns [B, R]`,
    /// each row's value on its valid tokens and 0 on padding.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let mask = &exp.action_mask; // [B, R]
        let valid = mask.f_gt(0.0)?; // [B, R] bool
        let old_values = masked(ops::need(&exp.values, "values", "ppo-seq")?, &valid)?; // [B, R]
        let rewards = exp.rewards.f_to_kind(mask.kind())?; // [B]
        let v_old = sample_value(&old_values, &valid, self.cfg.value_at)?; // [B]
        let advantages = rewards.f_sub(&v_old)?; // [B]
        let metrics = Metrics::new()
            .scalar("ppo_seq/advantages_mean", &advantages.f_mean(Kind::Float)?)?
            .scalar("ppo_seq/values_mean", &v_old.f_mean(Kind::Float)?)?
            .finish();
        Ok(Prepared {
            advantages: ops::per_token(&advantages, &valid)?,
            returns: Some(ops::per_token(&rewards, &valid)?),
            metrics,
        })
    }

    /// # Shapes
    /// `mb.rewards [b]`, every other `mb` tensor `[b, R]`; the loss is a scalar.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let cfg = &self.cfg;
        let mask = &mb.action_mask; // [b, R]
        let valid = mask.f_gt(0.0)?; // [b, R] bool

        // Step 1: sequence log-probs.
        let actor_logp = seq_sum(&mb.logprobs, &valid)?; // [b], grad
        let old_logp = seq_sum(&mb.old_logprobs, &valid)?; // [b]
        let ref_logp = seq_sum(ops::need(&mb.ref_logprobs, "ref_logprobs", "ppo-seq")?, &valid)?; // [b]

        // Step 2: KL to the old policy (monitoring) and to the reference (penalty).
        let kl = actor_logp.f_sub(&old_logp)?.f_mean(Kind::Float)?; // []

        // Means over the step's samples (each micro-batch's share of them with several).
        let step_mean = |x: &Tensor| ops::row_mean(x, mb.accumulation_steps, mb.step_rows);
        let kl_ref = step_mean(&actor_logp.f_sub(&ref_logp)?)?; // [], grad

        // Step 3: advantage from the final value.
        let values = masked(ops::need(&mb.values, "values", "ppo-seq")?, &valid)?; // [b, R], grad
        let values = sample_value(&values, &valid, cfg.value_at)?; // [b], grad
        let rewards = mb.rewards.f_to_kind(values.kind())?; // [b]
        let advantages = rewards.f_sub(&values.f_detach()?)?; // [b]

        // Step 4: ratio and clipped surrogate.
        let ratio = actor_logp.f_sub(&old_logp)?.f_exp()?; // [b]
        let surr1 = ratio.f_mul(&advantages)?;
        let surr2 = ratio.f_clamp(1.0 - cfg.cliprange, 1.0 + cfg.cliprange)?.f_mul(&advantages)?;
        let policy_loss = step_mean(&surr1.f_minimum(&surr2)?)?.f_neg()?; // []

        // Step 5: value loss (MSE to the reward).
        let value_loss = step_mean(&values.f_sub(&rewards)?.f_square()?)?; // []

        // Step 6: total.
        let loss =
            policy_loss.f_add(&value_loss.f_mul_scalar(cfg.vf_coef)?)?.f_add(&kl_ref.f_mul_scalar(cfg.kl_coef)?)?;

        let metrics = tch::no_grad(|| -> Result<Vec<(String, f64)>> {
            let clipped = surr2.f_lt_tensor(&surr1)?.f_to_kind(Kind::Float)?; // [b]
            let log_ratio = masked(&mb.logprobs, &valid)?.f_sub(&masked(&mb.old_logprobs, &valid)?)?; // [b, R]
            Ok(Metrics::new()
                .scalar("loss/policy", &policy_loss)?
                .scalar("loss/value", &value_loss)?
                .scalar("kl", &kl_ref)?
                .scalar("ppo_seq/kl_old", &kl)?
                .scalar("clip_ratio", &clipped.f_mean(Kind::Float)?)?
                .scalar("approx_kl", &ops::approx_kl(&log_ratio, mask)?)?
                .scalar("ppo_seq/ratio_mean", &ratio.f_mean(Kind::Float)?)?
                .scalar("ppo_seq/advantages_mean", &advantages.f_mean(Kind::Float)?)?
                .optional("explained_var", ops::explained_variance(&values, &rewards)?)
                .finish())
        })?;
        Ok(LossOutput { loss, metrics })
    }
}

/// `Σ_t x_t` over each row's valid tokens (`(logp_tokens * mask).sum(dim=1)`, with padding dropped
/// by `where` so garbage there cannot leak in).
///
/// # Shapes
/// `x`, `valid`: `[b, R]`; returns `[b]`.
fn seq_sum(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    Ok(masked(x, valid)?.f_sum_dim_intlist(1, false, x.kind())?)
}

/// Each row's value `V`: its entry at the first response slot (`ValueAt::Prompt`, 0 for an empty
/// row) or at its last valid token (`ValueAt::Last`).
///
/// # Shapes
/// `x`, `valid`: `[b, R]`, `x` already 0 on padding; returns `[b]`.
fn sample_value(x: &Tensor, valid: &Tensor, at: ValueAt) -> Result<Tensor> {
    match at {
        ValueAt::Prompt => Ok(x.f_select(1, 0)?),
        ValueAt::Last => ops::last_valid(x, valid),
    }
}

rlhf_plugin_api::export_algorithm!(
    PpoSeq,
    name: "ppo-seq",
    description: "Sequence-level PPO: summed response log-probs, A = R - V(prompt), clipped ratio, KL penalty in the loss"
);

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_plugin_api::testing::{assert_close, metric, t2, values_of};
    use serde_json::json;

    const NAN: f32 = f32::NAN;

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
    }

    fn algo(cfg: serde_json::Value) -> PpoSeq {
        PpoSeq::new(&cfg.to_string(), &ctx()).unwrap()
    }

    /// ε = 0.2, vf_coef = 0.5, kl_coef = 0.02; R = [2, −2].
    ///
    /// Row 0 (3 tokens): actor_logp = −0.5 − 1 − 0.5 = −2.0, old_logp = −0.6 − 1.2 − 0.6 = −2.4,
    ///   ref_logp = −3.0; V = values[0, 2] = 0.5; A = 2 − 0.5 = 1.5;
    ///   ratio = exp(0.4) = 1.4918247 → clamp 1.2: surr1 = 2.2377371, surr2 = 1.8 → min 1.8 (clipped)
    /// Row 1 (2 tokens, slot 2 garbage): actor_logp = −0.3 − 0.2 = −0.5, old_logp = −0.4, ref_logp = −0.8;
    ///   V = values[1, 1] = −1; A = −2 − (−1) = −1; ratio = exp(−0.1) = 0.9048374 (inside):
    ///   surr1 = surr2 = −0.9048374
    /// policy_loss = −(1.8 − 0.9048374)/2 = −0.4475813
    /// value_loss  = ((0.5 − 2)² + (−1 + 2)²)/2 = (2.25 + 1)/2 = 1.625
    /// kl_ref      = ((−2 + 3) + (−0.5 + 0.8))/2 = 0.65;  kl_old = (0.4 − 0.1)/2 = 0.15
    /// loss        = −0.4475813 + 0.5·1.625 + 0.02·0.65 = 0.3779187
    #[test]
    fn loss_by_hand_batch_of_two() {
        let mut a = algo(json!({"value_at": "last"}));
        let logp = t2(&[&[-0.5, -1.0, -0.5], &[-0.3, -0.2, NAN]]).set_requires_grad(true);
        let values = t2(&[&[9.0, 9.0, 0.5], &[7.0, -1.0, NAN]]).set_requires_grad(true);
        let mb = Minibatch {
            logprobs: logp.shallow_clone(),
            old_logprobs: t2(&[&[-0.6, -1.2, -0.6], &[-0.3, -0.1, 4.0]]),
            ref_logprobs: Some(t2(&[&[-1.0, -1.0, -1.0], &[-0.4, -0.4, NAN]])),
            values: Some(values.shallow_clone()),
            old_values: Some(t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]])),
            advantages: t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]),
            returns: Some(t2(&[&[2.0, 2.0, 2.0], &[-2.0, -2.0, 0.0]])),
            action_mask: t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]),
            entropy: None,
            rewards: Tensor::from_slice(&[2.0f32, -2.0]),
            step: 0,
            epoch: 0,
            accumulation_steps: 1,
            step_tokens: 0.0,
            step_rows: 0.0,
            behavior_logprobs: None,
        };
        let out = a.loss(&mb).unwrap();
        let m = &out.metrics;
        assert!((metric(m, "loss/policy") + 0.4475813).abs() < 1e-6, "{m:?}");
        assert!((metric(m, "loss/value") - 1.625).abs() < 1e-6);
        assert!((metric(m, "kl") - 0.65).abs() < 1e-6);
        assert!((metric(m, "ppo_seq/kl_old") - 0.15).abs() < 1e-6);
        assert!((metric(m, "clip_ratio") - 0.5).abs() < 1e-9);
        assert!((out.loss.double_value(&[]) - 0.3779187).abs() < 1e-6);
        // explained_var: Var(R) = 4, R − V = [1.5, −1] → Var = 1.5625 → 1 − 1.5625/4 = 0.609375.
        assert!((metric(m, "explained_var") - 0.609375).abs() < 1e-6);

        out.loss.backward();
        // Values: only value_loss reaches the critic (A is detached): vf_coef·2(V − R)/b = 0.5·(V − R)
        // → row 0: 0.5·(0.5 − 2) = −0.75, row 1: 0.5·(−1 + 2) = 0.5, at the last valid slot; others 0.
        assert_close(&values_of(&values.grad()), &[0.0, 0.0, -0.75, 0.0, 0.5, 0.0], 1e-6);
        // Log-probs: row 0 is clipped → only kl_coef/b = 0.01 per token; row 1:
        // −ratio·A/b + 0.01 = 0.9048374/2 + 0.01 = 0.4624187 per valid token; padding 0.
        assert_close(&values_of(&logp.grad()), &[0.01, 0.01, 0.01, 0.4624187, 0.4624187, 0.0], 1e-6);
    }

    /// Advantages R − V_old(last) and returns R, broadcast over valid tokens.
    /// Row 0: V_old(last) = values[0, 1] = 0.25, R = 1 → A = 0.75; row 1 (1 token): V = −0.5, R = 0 → 0.5.
    #[test]
    fn prepare_broadcasts_sequence_advantage() {
        let mut a = algo(json!({"value_at": "last"}));
        let exp = Experience {
            rewards: Tensor::from_slice(&[1.0f32, 0.0]),
            logprobs: t2(&[&[-1.0, -1.0], &[-1.0, NAN]]),
            ref_logprobs: Some(t2(&[&[-1.0, -1.0], &[-1.0, NAN]])),
            values: Some(t2(&[&[3.0, 0.25], &[-0.5, NAN]])),
            action_mask: t2(&[&[1.0, 1.0], &[1.0, 0.0]]),
            group_ids: Tensor::from_slice(&[0i64, 1]),
            step: 0,
            behavior_logprobs: None,
        };
        let p = a.prepare(&exp).unwrap();
        assert_close(&values_of(&p.advantages), &[0.75, 0.75, 0.5, 0.0], 1e-6);
        assert_close(&values_of(&p.returns.unwrap()), &[1.0, 1.0, 0.0, 0.0], 1e-6);
        assert!((metric(&p.metrics, "ppo_seq/advantages_mean") - 0.625).abs() < 1e-6);
    }

    /// The default `value_at = "prompt"` reads `V` at slot 0. Same batch shape as above, one row:
    /// R = 2, values = [0.5, 9, 9] → V = 0.5, A = 1.5; logp = old_logp (ratio 1, unclipped):
    /// policy_loss = −1.5, value_loss = (0.5 − 2)² = 2.25, kl_ref = −2 − (−3) = 1
    /// loss = −1.5 + 0.5·2.25 + 0.02·1 = −0.355; ∂loss/∂V(slot 0) = 0.5·2·(0.5 − 2) = −1.5.
    #[test]
    fn value_at_prompt_reads_the_first_slot() {
        let mut a = algo(json!({}));
        let values = t2(&[&[0.5, 9.0, 9.0]]).set_requires_grad(true);
        let exp = Experience {
            rewards: Tensor::from_slice(&[2.0f32]),
            logprobs: t2(&[&[-1.0, -1.0, -1.0]]),
            ref_logprobs: Some(t2(&[&[-1.0, -1.0, -1.0]])),
            values: Some(t2(&[&[0.5, 9.0, 9.0]])),
            action_mask: t2(&[&[1.0, 1.0, 1.0]]),
            group_ids: Tensor::from_slice(&[0i64]),
            step: 0,
            behavior_logprobs: None,
        };
        let p = a.prepare(&exp).unwrap();
        assert_close(&values_of(&p.advantages), &[1.5, 1.5, 1.5], 1e-6);
        let mb = Minibatch {
            logprobs: t2(&[&[-0.5, -1.0, -0.5]]),
            old_logprobs: t2(&[&[-0.5, -1.0, -0.5]]),
            ref_logprobs: Some(t2(&[&[-1.0, -1.0, -1.0]])),
            values: Some(values.shallow_clone()),
            old_values: Some(t2(&[&[0.5, 9.0, 9.0]])),
            advantages: p.advantages,
            returns: p.returns,
            action_mask: t2(&[&[1.0, 1.0, 1.0]]),
            entropy: None,
            rewards: Tensor::from_slice(&[2.0f32]),
            step: 0,
            epoch: 0,
            accumulation_steps: 1,
            step_tokens: 0.0,
            step_rows: 0.0,
            behavior_logprobs: None,
        };
        let out = a.loss(&mb).unwrap();
        assert!((metric(&out.metrics, "loss/policy") + 1.5).abs() < 1e-6, "{:?}", out.metrics);
        assert!((metric(&out.metrics, "loss/value") - 2.25).abs() < 1e-6);
        assert!((out.loss.double_value(&[]) + 0.355).abs() < 1e-6);
        out.loss.backward();
        assert_close(&values_of(&values.grad()), &[-1.5, 0.0, 0.0], 1e-6);
    }

    #[test]
    fn empty_row_is_finite() {
        let mut a = algo(json!({}));
        let nan_row = || t2(&[&[NAN, NAN]]);
        let mb = Minibatch {
            logprobs: nan_row(),
            old_logprobs: nan_row(),
            ref_logprobs: Some(nan_row()),
            values: Some(nan_row()),
            old_values: Some(nan_row()),
            advantages: nan_row(),
            returns: Some(nan_row()),
            action_mask: t2(&[&[0.0, 0.0]]),
            entropy: None,
            rewards: Tensor::from_slice(&[1.0f32]),
            step: 0,
            epoch: 0,
            accumulation_steps: 1,
            step_tokens: 0.0,
            step_rows: 0.0,
            behavior_logprobs: None,
        };
        let out = a.loss(&mb).unwrap();
        assert!(out.loss.double_value(&[]).is_finite());
        assert!(out.metrics.iter().all(|(_, v)| v.is_finite()), "{:?}", out.metrics);
    }

    #[test]
    fn requirements_and_defaults() {
        let a = algo(json!({}));
        assert_eq!(a.requirements(), Requirements { reference: true, critic: true, entropy: false });
        assert_eq!((a.cfg.cliprange, a.cfg.vf_coef, a.cfg.kl_coef), (0.2, 0.5, 0.02));
        assert_eq!(a.cfg.value_at, ValueAt::Prompt);
        assert_eq!(
            a.resolved_config(),
            json!({"cliprange": 0.2, "vf_coef": 0.5, "kl_coef": 0.02, "value_at": "prompt"})
        );
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |cfg: serde_json::Value| PpoSeq::new(&cfg.to_string(), &ctx()).unwrap_err().to_string();
        let e = err(json!({"gamma": 1.0}));
        assert!(e.starts_with("gamma: unknown field"), "{e}");
        let e = err(json!({"kl_coef": [0.1]}));
        assert!(e.starts_with("kl_coef: invalid type"), "{e}");
        let e = err(json!({"value_at": "middle"}));
        assert!(e.starts_with("value_at: unknown variant"), "{e}");
        let e = err(json!({"cliprange": -0.2}));
        assert!(e.starts_with("cliprange: must be > 0"), "{e}");
    }
}
