//! `template-reinforce`: REINFORCE with a per-group mean baseline — the template for writing a
//! new algorithm plugin in one file against `rlhf-plugin-api` alone. Copy `plugins/template/`,
//! rename the package in `Cargo.toml` and the plugin in [`export_algorithm!`] at the bottom, then
//! change the four methods of [`Algorithm`]. `docs/plugins.md` walks through this file.
//!
//! The algorithm (Williams 1992, with the group baseline GRPO uses):
//!
//! ```text
//! A_i      = r_i − mean{ r_j : group_j = group_i }            (÷ (std_group + eps) if normalize)
//! A_{i,t}  = A_i · mask_{i,t}                                  broadcast over response tokens
//! loss     = − Σ_{i,t} A_{i,t} · logp_{i,t} · mask_{i,t} / Σ_{i,t} mask_{i,t}
//! ```
//!
//! The gradient of `loss` is the policy-gradient estimate `−E[A ∇ log π]`; the host
//! back-propagates it into the policy through `logprobs`. No critic, no reference model, no
//! clipping: one gradient step per batch is the textbook setting (set `ppo_epochs = 1`).
//!
//! # Config
//!
//! ```toml
//! [algorithm]
//! name = "template-reinforce"
//!
//! [algorithm.config]
//! normalize = false   # divide advantages by the group's reward std (GRPO-style)
//! eps = 1e-6          # added to that std; must be > 0
//! ```

// The prelude brings the traits (`Algorithm`), data (`Experience`, `Minibatch`, `Prepared`,
// `LossOutput`, `Requirements`, `Context`), `PluginError`, `parse_config`, the export macros and
// tch's `Tensor` / `Kind`. Nothing else from the host is needed. `ops` holds the tensor helpers
// algorithms share: masked means, group statistics, shape checks, a metrics builder.
use rlhf_plugin_api::ops::{self, Metrics, StdEstimator};
use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

/// The plugin's config section: the `[algorithm.config]` table of the run config, handed over as
/// JSON.
///
/// `deny_unknown_fields` turns a typo into an error naming the key (`normalise: unknown field`);
/// `default` makes every key optional, taking its value from [`Default`] below.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Divide each advantage by its group's reward standard deviation plus `eps`.
    pub normalize: bool,
    /// Added to the standard deviation before dividing (> 0); used only with `normalize`.
    pub eps: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config { normalize: false, eps: 1e-6 }
    }
}

/// The algorithm's state: here just its config. Algorithms with state across steps (an adaptive
/// KL coefficient, running statistics) keep it here; the host calls the methods in order on one
/// thread.
#[derive(Debug)]
pub struct TemplateReinforce {
    config: Config,
}

impl Algorithm for TemplateReinforce {
    /// Called once when the run starts, with the `[algorithm.config]` section as JSON text.
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError> {
        // Syntax and types: `parse_config` reports `key.path: message` errors.
        let config: Config = parse_config(config)?;
        // Semantics: check value ranges yourself and name the key the same way.
        if !(config.eps > 0.0 && config.eps.is_finite()) {
            return Err(PluginError::config("eps", format!("must be a positive number, got {}", config.eps)));
        }
        // Settings of the host that cannot work with this algorithm: a group baseline needs at
        // least two samples per prompt (with one, every advantage is 0).
        ops::require_groups(ctx, "template-reinforce")?;
        // `tracing` events reach the host's log with the plugin's name as target
        // (`RUST_LOG=template-reinforce=debug` filters them).
        tracing::info!(
            normalize = config.normalize,
            eps = config.eps,
            group_size = ctx.samples_per_prompt,
            "template-reinforce ready"
        );
        Ok(TemplateReinforce { config })
    }

    /// What the host must compute for us: nothing beyond the policy's log-probs.
    fn requirements(&self) -> Requirements {
        Requirements { reference: false, critic: false, entropy: false }
    }

    /// Once per generation batch: turn sequence rewards into per-token advantages. The host has
    /// checked the shapes and dtypes below before calling.
    ///
    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.action_mask [B, R]` → advantages `[B, R]`.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared, PluginError> {
        // Group ids are arbitrary i64 labels (any values, groups not necessarily contiguous):
        // `group_index` numbers them 0..G. Statistics in f64, so equal rewards have a std of exactly 0.
        let rewards = exp.rewards.f_to_kind(Kind::Double)?; // [B]
        let (group, n_groups) = ops::group_index(&exp.group_ids)?; // [B] in 0..G
        let (mean, std) = ops::group_stats(&rewards, &group, n_groups, StdEstimator::Unbiased)?; // [G], [G]
        let std = std.f_index_select(0, &group)?; // each sample's group's std, [B]
        let mut advantage = rewards.f_sub(&mean.f_index_select(0, &group)?)?; // [B]
        if self.config.normalize {
            advantage = advantage.f_div(&std.f_add_scalar(self.config.eps)?)?;
        }
        // Broadcast the sequence advantage over the response tokens; padding gets 0.
        let valid = exp.action_mask.f_gt(0.0)?; // [B, R] bool
        let advantages = ops::per_token(&advantage.f_to_kind(Kind::Float)?, &valid)?; // [B, R]

        // Samples whose group's rewards are all equal have zero advantage: no learning signal.
        let zero_std = std.f_le(1e-8)?.f_to_kind(Kind::Float)?; // [B]
        let metrics = Metrics::new()
            .scalar("advantages/mean_abs", &advantage.f_abs()?.f_mean(Kind::Float)?)?
            .scalar("frac_reward_zero_std", &zero_std.f_mean(Kind::Float)?)?
            .finish();
        // `returns` are value targets for a critic; REINFORCE has none.
        Ok(Prepared { advantages, returns: None, metrics })
    }

    /// Once per minibatch (and epoch): the scalar loss. `mb.logprobs` carries gradients to the
    /// policy; everything else is data.
    ///
    /// # Shapes
    /// `mb.logprobs`, `mb.advantages`, `mb.action_mask`: `[b, R]` → loss `[]`.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput, PluginError> {
        // Token-level mean over the minibatch's response tokens: Σ A·logp·mask / max(Σ mask, 1).
        let pg_loss = ops::masked_mean(&mb.advantages.f_mul(&mb.logprobs)?, &mb.action_mask)?.f_neg()?; // []

        // Read scalars for metrics without keeping the graph alive.
        let metrics = Metrics::new().scalar("loss/policy", &pg_loss.f_detach()?)?.finish();
        Ok(LossOutput { loss: pg_loss, metrics })
    }
}

// The plugin's header: the name users address it by (`--algo template-reinforce`) and a one-line
// description for `rlhf plugins`. One `export_algorithm!` (or `export_reward!`) per cdylib.
export_algorithm!(
    TemplateReinforce,
    name: "template-reinforce",
    description: "REINFORCE with a per-group mean baseline (the template for new algorithm plugins)",
);

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_plugin_api::tch::Device;

    fn ctx() -> Context {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 2 }
    }

    fn t1(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    fn t2(rows: &[[f32; 3]]) -> Tensor {
        Tensor::from_slice(rows.concat().as_slice()).view([rows.len() as i64, 3])
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

    // Two prompts (ids 7 and 3, in any order), two samples each; rewards [1, 0 | 2, 4].
    // Group means: [0.5, 0.5, 3, 3] → A = [0.5, −0.5, −1, 1].
    fn experience() -> Experience {
        Experience {
            rewards: t1(&[1., 0., 2., 4.]),
            logprobs: t2(&[[-1., -2., -9.], [-1., -9., -9.], [-0.5, -0.5, -1.], [-2., -9., -9.]]),
            ref_logprobs: None,
            values: None,
            action_mask: t2(&[[1., 1., 0.], [1., 0., 0.], [1., 1., 1.], [1., 0., 0.]]),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 3]),
            step: 0,
            behavior_logprobs: None,
        }
    }

    #[test]
    fn advantages_and_loss_by_hand() {
        let mut algo = TemplateReinforce::new("{}", &ctx()).unwrap();
        assert_eq!(algo.requirements(), Requirements::default());
        let exp = experience();
        let prepared = algo.prepare(&exp).unwrap();
        assert_close(&values(&prepared.advantages), &[0.5, 0.5, 0., -0.5, 0., 0., -1., -1., -1., 1., 0., 0.]);

        // Σ A·logp·mask = 0.5·(−1) + 0.5·(−2) − 0.5·(−1) − 1·(−0.5 − 0.5 − 1) + 1·(−2) = −1
        // over 7 tokens → loss = 1/7; ∂loss/∂logp = −A·mask/7.
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
            epoch: 0,
            accumulation_steps: 1,
            step_tokens: 0.0,
            step_rows: 0.0,
            behavior_logprobs: None,
        };
        let out = algo.loss(&mb).unwrap();
        assert_close(&[out.loss.double_value(&[]) as f32], &[1. / 7.]);
        assert_eq!(out.metrics[0].0, "loss/policy");
        out.loss.backward();
        let want: Vec<f32> = values(&prepared.advantages).iter().map(|a| -a / 7.).collect();
        assert_close(&values(&logprobs.grad()), &want);
    }

    #[test]
    fn normalize_divides_by_group_std() {
        let mut algo = TemplateReinforce::new(r#"{"normalize": true, "eps": 1e-9}"#, &ctx()).unwrap();
        // Third group of one sample: std 0, advantage 0.
        let exp = Experience {
            rewards: t1(&[1., 0., 2., 4., 9.]),
            action_mask: Tensor::ones([5, 3], (Kind::Float, Device::Cpu)),
            group_ids: Tensor::from_slice(&[7i64, 7, 3, 3, 5]),
            logprobs: Tensor::zeros([5, 3], (Kind::Float, Device::Cpu)),
            ..experience()
        };
        let prepared = algo.prepare(&exp).unwrap();
        // Unbiased stds: group 7: √0.5, group 3: √2 → A = ±0.5/√0.5, ±1/√2 = ±1/√2.
        let s = std::f32::consts::FRAC_1_SQRT_2;
        let first_token: Vec<f32> = values(&prepared.advantages.select(1, 0));
        assert_close(&first_token, &[s, -s, -s, s, 0.]);
        let zero_std = prepared.metrics.iter().find(|(n, _)| n == "frac_reward_zero_std").unwrap().1;
        assert!((zero_std - 0.2).abs() < 1e-6);
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |json: &str| TemplateReinforce::new(json, &ctx()).unwrap_err().to_string();
        assert!(err(r#"{"normalise": true}"#).starts_with("normalise: unknown field `normalise`"));
        assert!(err(r#"{"normalize": "yes"}"#).starts_with("normalize: invalid type: string \"yes\""));
        assert_eq!(err(r#"{"eps": 0}"#), "eps: must be a positive number, got 0");
        // The host's settings are checked too: one sample per prompt leaves the baseline nothing.
        let one = Context { samples_per_prompt: 1, ..ctx() };
        let e = TemplateReinforce::new("{}", &one).unwrap_err().to_string();
        assert!(e.starts_with("rollout.samples_per_prompt = 1: template-reinforce compares"), "{e}");
    }
}
