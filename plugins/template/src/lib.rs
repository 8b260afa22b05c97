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
// tch's `Tensor` / `Kind`. Nothing else from the host is needed.
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

    /// Once per generation batch: turn sequence rewards into per-token advantages.
    ///
    /// # Shapes
    /// `exp.rewards [B]`, `exp.group_ids [B]` i64, `exp.action_mask [B, R]` → advantages `[B, R]`.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared, PluginError> {
        let (b, _r) = batch_shape(&exp.action_mask)?;
        expect_shape("rewards", &exp.rewards, &[b])?;
        expect_shape("group_ids", &exp.group_ids, &[b])?;

        let group = group_stats(&exp.rewards, &exp.group_ids)?;
        let mut advantage = exp.rewards.f_to_kind(Kind::Float)?.f_sub(&group.mean)?; // [B]
        if self.config.normalize {
            advantage = advantage.f_div(&group.std.f_add_scalar(self.config.eps)?)?;
        }
        // Broadcast the sequence advantage over the response tokens; padding gets 0.
        let advantages = advantage.f_unsqueeze(1)?.f_mul(&exp.action_mask)?; // [B, R]

        // Groups whose rewards are all equal have zero advantage: no learning signal.
        let zero_std = group.std.f_le(1e-8)?.f_to_kind(Kind::Float)?.f_mean(Kind::Float)?;
        let metrics = vec![
            ("advantages/mean_abs".to_string(), advantage.f_abs()?.f_mean(Kind::Float)?.f_double_value(&[])?),
            ("frac_reward_zero_std".to_string(), zero_std.f_double_value(&[])?),
        ];
        // `returns` are value targets for a critic; REINFORCE has none.
        Ok(Prepared { advantages, returns: None, metrics })
    }

    /// Once per minibatch (and epoch): the scalar loss. `mb.logprobs` carries gradients to the
    /// policy; everything else is data.
    ///
    /// # Shapes
    /// `mb.logprobs`, `mb.advantages`, `mb.action_mask`: `[b, R]` → loss `[]`.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput, PluginError> {
        let (b, r) = batch_shape(&mb.action_mask)?;
        expect_shape("logprobs", &mb.logprobs, &[b, r])?;
        expect_shape("advantages", &mb.advantages, &[b, r])?;

        let mask = &mb.action_mask;
        // Token-level mean over the minibatch's response tokens (at least 1 to avoid 0/0).
        let tokens = mask.f_sum(Kind::Float)?.f_clamp_min(1.0)?;
        let pg_loss = mb.advantages.f_mul(&mb.logprobs)?.f_mul(mask)?.f_sum(Kind::Float)?.f_neg()?.f_div(&tokens)?; // []

        // Read scalars for metrics without keeping the graph alive.
        let metrics = vec![("loss/policy".to_string(), pg_loss.f_detach()?.f_double_value(&[])?)];
        Ok(LossOutput { loss: pg_loss, metrics })
    }
}

/// Per-sample statistics of the sample's group.
///
/// # Shapes
/// `mean`, `std`: `[B]` f32.
#[derive(Debug)]
pub struct GroupStats {
    /// Mean reward of the sample's group.
    pub mean: Tensor,
    /// Unbiased standard deviation of the group's rewards (0 for a group of one).
    pub std: Tensor,
}

/// Mean and std of each sample's group. Group ids are arbitrary i64 labels (not necessarily
/// `0..G`, not necessarily contiguous), so membership is computed with a `[B, B]` equality matrix
/// — fine for the batch sizes of RL fine-tuning.
///
/// # Shapes
/// `rewards [B]`, `group_ids [B]` i64.
pub fn group_stats(rewards: &Tensor, group_ids: &Tensor) -> Result<GroupStats, PluginError> {
    let rewards = rewards.f_to_kind(Kind::Float)?;
    // same[i, j] = 1 when samples i and j come from the same prompt.
    let same = group_ids.f_unsqueeze(1)?.f_eq_tensor(&group_ids.f_unsqueeze(0)?)?.f_to_kind(Kind::Float)?; // [B, B]
    let count = same.f_sum_dim_intlist(1, false, Kind::Float)?; // [B], ≥ 1: i is in its own group
    let mean = same.f_mv(&rewards)?.f_div(&count)?; // [B]
                                                    // dev[i, j] = r_j − mean_i; only j in i's group count.
    let dev = rewards.f_unsqueeze(0)?.f_sub(&mean.f_unsqueeze(1)?)?; // [B, B]
    let var = same
        .f_mul(&dev.f_square()?)?
        .f_sum_dim_intlist(1, false, Kind::Float)?
        .f_div(&count.f_sub_scalar(1.0)?.f_clamp_min(1.0)?)?; // [B]
    Ok(GroupStats { mean, std: var.f_sqrt()? })
}

/// `(B, R)` of a `[B, R]` mask, or an error naming the tensor.
fn batch_shape(action_mask: &Tensor) -> Result<(i64, i64), PluginError> {
    match action_mask.size()[..] {
        [b, r] => Ok((b, r)),
        ref other => Err(PluginError::compute(format!("action_mask: expected [B, R], got {other:?}"))),
    }
}

/// An error naming `what` unless `t` has exactly `shape`.
fn expect_shape(what: &str, t: &Tensor, shape: &[i64]) -> Result<(), PluginError> {
    let got = t.size();
    if got != shape {
        return Err(PluginError::compute(format!("{what}: expected shape {shape:?}, got {got:?}")));
    }
    Ok(())
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
    fn shape_errors_name_the_tensor() {
        let mut algo = TemplateReinforce::new("", &ctx()).unwrap();
        let exp = Experience { rewards: t1(&[1., 2., 3.]), ..experience() };
        let e = algo.prepare(&exp).unwrap_err();
        assert_eq!(e.to_string(), "rewards: expected shape [4], got [3]");
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |json: &str| TemplateReinforce::new(json, &ctx()).unwrap_err().to_string();
        assert!(err(r#"{"normalise": true}"#).starts_with("normalise: unknown field `normalise`"));
        assert!(err(r#"{"normalize": "yes"}"#).starts_with("normalize: invalid type: string \"yes\""));
        assert_eq!(err(r#"{"eps": 0}"#), "eps: must be a positive number, got 0");
    }
}
