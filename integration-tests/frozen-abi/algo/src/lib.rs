//! `frozen-reinforce`: a small but real algorithm plugin compiled against the **frozen plugin-api
//! 4.0** (`../plugin-api-4.0`), standing for every plugin built before the ABI grew. It never sees
//! what later minors appended (the `epoch` input, `resolved_config`), and
//! `integration-tests/tests/abi_growth.rs` checks that the current host still loads it, trains with
//! it and falls back to the defaults of the methods it lacks.
//!
//! REINFORCE (Williams 1992) with the group-mean baseline of GRPO (Shao et al. 2024, DeepSeekMath),
//! and an optional k3 KL penalty against the reference model (Schulman, "Approximating KL
//! divergence", 2020; the estimator GRPO uses):
//!
//! ```text
//! A_i     = r_i − mean{ r_j : group_j = group_i }            one advantage per sample
//! A_{i,t} = A_i · mask_{i,t}                                  broadcast over response tokens
//! k3_{i,t} = exp(ref_{i,t} − logp_{i,t}) − (ref_{i,t} − logp_{i,t}) − 1
//! loss    = Σ_{i,t} (−A_{i,t}·logp_{i,t} + β·k3_{i,t}) · mask_{i,t} / Σ_{i,t} mask_{i,t}
//! ```
//!
//! Padding positions (`mask` 0) of every per-token input are 0.0, so multiplying by the mask and
//! dividing by its sum is the token mean over valid tokens. No `ops` helpers: they are not part of
//! the 4.0 snapshot, and this file must not need anything newer.
//!
//! # Config
//!
//! ```toml
//! [algorithm]
//! name = "frozen-reinforce"
//!
//! [algorithm.config]
//! beta = 0.0   # weight of the k3 KL penalty; > 0 requires the reference model
//! ```

use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

/// The plugin's declared name.
pub const NAME: &str = "frozen-reinforce";

/// The `[algorithm.config]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Weight of the k3 KL penalty against the reference model (≥ 0; 0: no reference model).
    pub beta: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config { beta: 0.0 }
    }
}

/// The algorithm: its config and the number of batches prepared (checkpointed state).
#[derive(Debug)]
pub struct FrozenReinforce {
    config: Config,
    batches: u64,
}

impl Algorithm for FrozenReinforce {
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError> {
        let config: Config = parse_config(config)?;
        if !(config.beta >= 0.0 && config.beta.is_finite()) {
            return Err(PluginError::config("beta", format!("must be a finite number >= 0, got {}", config.beta)));
        }
        tracing::info!(beta = config.beta, group_size = ctx.samples_per_prompt, "{NAME} (plugin-api 4.0) ready");
        Ok(FrozenReinforce { config, batches: 0 })
    }

    fn requirements(&self) -> Requirements {
        Requirements { reference: self.config.beta > 0.0, critic: false, entropy: false }
    }

    /// # Shapes
    /// `rewards [B]`, `group_ids [B]` i64, `action_mask [B, R]` → advantages `[B, R]`.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared, PluginError> {
        let rewards = exp.rewards.f_to_kind(Kind::Float)?; // [B]
        let ids = &exp.group_ids;
        // same[i, j] = 1 when samples i and j come from the same prompt (ids are arbitrary labels).
        let same = ids.f_unsqueeze(1)?.f_eq_tensor(&ids.f_unsqueeze(0)?)?.f_to_kind(Kind::Float)?; // [B, B]
        let count = same.f_sum_dim_intlist(1, false, Kind::Float)?; // [B], ≥ 1
        let mean = same.f_mv(&rewards)?.f_div(&count)?; // [B]
        let advantage = rewards.f_sub(&mean)?; // [B]
        let advantages = advantage.f_unsqueeze(1)?.f_mul(&exp.action_mask)?; // [B, R]
        self.batches += 1;
        let metrics = vec![
            ("frozen/advantage_abs_mean".to_string(), advantage.f_abs()?.f_mean(Kind::Float)?.f_double_value(&[])?),
            ("frozen/batches".to_string(), self.batches as f64),
        ];
        Ok(Prepared { advantages, returns: None, metrics })
    }

    /// # Shapes
    /// `logprobs`, `advantages`, `action_mask`, `ref_logprobs`: `[b, R]` → loss `[]`.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput, PluginError> {
        let mask = &mb.action_mask;
        let tokens = mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?; // []
        let masked_mean =
            |x: &Tensor| -> Result<Tensor, PluginError> { Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&tokens)?) };
        let policy = masked_mean(&mb.advantages.f_mul(&mb.logprobs)?.f_neg()?)?;
        let mut metrics = vec![("frozen/policy_loss".to_string(), policy.f_detach()?.f_double_value(&[])?)];
        let mut loss = policy;
        if self.config.beta > 0.0 {
            let reference = mb.ref_logprobs.as_ref().ok_or_else(|| {
                PluginError::compute("beta > 0 but the host passed no `ref_logprobs` (requirement `reference`)")
            })?;
            let d = reference.f_sub(&mb.logprobs)?;
            let k3 = masked_mean(&d.f_exp()?.f_sub(&d)?.f_sub_scalar(1.0)?)?;
            metrics.push(("frozen/kl".to_string(), k3.f_detach()?.f_double_value(&[])?));
            loss = loss.f_add(&k3.f_mul_scalar(self.config.beta)?)?;
        }
        Ok(LossOutput { loss, metrics })
    }

    fn state(&self) -> Result<serde_json::Value, PluginError> {
        Ok(serde_json::json!({ "batches": self.batches }))
    }

    fn load_state(&mut self, state: serde_json::Value) -> Result<(), PluginError> {
        self.batches = state.get("batches").and_then(serde_json::Value::as_u64).unwrap_or(0);
        Ok(())
    }
}

export_algorithm!(
    FrozenReinforce,
    name: "frozen-reinforce",
    description: "REINFORCE with a group-mean baseline, built against the frozen plugin-api 4.0 (ABI-growth test)",
);

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 2 }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
    }

    fn assert_close(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    /// Two prompts (ids 7 and 3), two samples each; rewards [1, 0 | 2, 4] → A = [0.5, −0.5, −1, 1].
    /// Σ A·logp·mask = 0.5·(−1 − 2) − 0.5·(−1) − 1·(−0.5 − 0.5 − 1) + 1·(−2) = −1 over 7 tokens.
    #[test]
    fn advantages_and_loss_by_hand() {
        let mut algo = FrozenReinforce::new("{}", &ctx()).unwrap();
        assert_eq!(algo.requirements(), Requirements::default());
        let t2 = |v: &[f32]| Tensor::from_slice(v).view([4, 3]);
        let exp = Experience {
            rewards: Tensor::from_slice(&[1f32, 0., 2., 4.]),
            logprobs: t2(&[-1., -2., 0., -1., 0., 0., -0.5, -0.5, -1., -2., 0., 0.]),
            ref_logprobs: None,
            values: None,
            action_mask: t2(&[1., 1., 0., 1., 0., 0., 1., 1., 1., 1., 0., 0.]),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 3]),
            step: 0,
        };
        let prepared = algo.prepare(&exp).unwrap();
        assert_close(&values(&prepared.advantages), &[0.5, 0.5, 0., -0.5, 0., 0., -1., -1., -1., 1., 0., 0.]);
        let logprobs = exp.logprobs.copy().set_requires_grad(true);
        let mb = Minibatch {
            logprobs: logprobs.shallow_clone(),
            old_logprobs: exp.logprobs.copy(),
            ref_logprobs: None,
            values: None,
            old_values: None,
            advantages: prepared.advantages.shallow_clone(),
            returns: None,
            action_mask: exp.action_mask.shallow_clone(),
            entropy: None,
            rewards: exp.rewards.shallow_clone(),
            step: 0,
        };
        let out = algo.loss(&mb).unwrap();
        assert_close(&[out.loss.double_value(&[]) as f32], &[1. / 7.]);
        out.loss.backward();
        let want: Vec<f32> = values(&prepared.advantages).iter().map(|a| -a / 7.).collect();
        assert_close(&values(&logprobs.grad()), &want);
    }

    #[test]
    fn beta_requires_the_reference_and_is_range_checked() {
        let algo = FrozenReinforce::new(r#"{"beta": 0.1}"#, &ctx()).unwrap();
        assert!(algo.requirements().reference);
        let e = FrozenReinforce::new(r#"{"beta": -1}"#, &ctx()).unwrap_err();
        assert_eq!(e.to_string(), "beta: must be a finite number >= 0, got -1");
        let e = FrozenReinforce::new(r#"{"betta": 1}"#, &ctx()).unwrap_err();
        assert!(e.to_string().starts_with("betta: unknown field"), "{e}");
    }
}
