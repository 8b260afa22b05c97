//! The seam between the host and plugin instances: the host's stages hand plain plugin-api types
//! ([`Experience`], [`Minibatch`], [`Sample`]) to these handles, and this is the one place where they
//! become ABI values and back. It also enforces the host's side of the plugin contract:
//! - padding positions (`action_mask == 0`) of every per-token input are exactly 0.0;
//! - what a plugin returns has the documented shapes and (scores) count;
//! - a plugin metric named like a host metric is namespaced with the plugin's name
//!   (`grpo/reward_std`), so it never silently replaces the host's value.

use abi_stable::std_types::{RResult, RStr, RVec};
use rlhf_plugin_api::abi::{keys, AlgorithmBox, HostContext, Metric, RewardBox, SampleAbi};
use rlhf_plugin_api::{Experience, LossOutput, Minibatch, PluginError, Prepared, Requirements, Sample, Scores};
use tch::{Kind, Tensor};

use super::loader::{LoadedPlugin, PluginMeta};
use crate::error::{Result, TrainerError};
use crate::metrics::is_host_metric;

fn call_err(meta: &PluginMeta, e: PluginError, section: &str) -> TrainerError {
    plugin_call_err(&meta.name, &meta.path, e, section)
}

/// A plugin's error as the host reports it: a config error with its key under `section`
/// (`algorithm.config.beta: ...`), anything else as the plugin said it.
pub(crate) fn plugin_call_err(name: &str, path: &std::path::Path, e: PluginError, section: &str) -> TrainerError {
    let message = match (&e.kind, e.key.as_ref().into_option()) {
        (rlhf_plugin_api::ErrorKind::Config, Some(key)) if !key.is_empty() => format!("{section}.{key}: {}", e.message),
        _ => e.to_string(),
    };
    TrainerError::PluginCall { name: name.to_string(), path: path.to_path_buf(), message }
}

fn plugin_err(meta: &PluginMeta, message: String) -> TrainerError {
    TrainerError::PluginCall { name: meta.name.clone(), path: meta.path.clone(), message }
}

/// A plugin's metrics, with names that collide with a host metric prefixed by the plugin's name.
fn namespaced(meta: &PluginMeta, metrics: RVec<Metric>) -> Vec<(String, f64)> {
    metrics
        .into_iter()
        .map(|m| {
            let name = m.name.as_str();
            let name = if is_host_metric(name) { format!("{}/{name}", meta.name) } else { name.to_string() };
            (name, m.value)
        })
        .collect()
}

/// `x` with its padding positions set to exactly 0.0 (a NaN or a stale value there cannot leak
/// into a plugin's reductions); gradients flow through the kept positions.
///
/// # Shapes
/// `x`, `valid`: `[B, R]` (`valid` bool); returns `[B, R]`.
fn zero_padding(x: &Tensor, valid: &Tensor) -> Result<Tensor> {
    Ok(x.f_where_scalarother(valid, 0.0)?)
}

fn zero_padding_opt(x: &Option<Tensor>, valid: &Tensor) -> Result<Option<Tensor>> {
    x.as_ref().map(|t| zero_padding(t, valid)).transpose()
}

/// An algorithm instance and where it came from.
pub struct AlgorithmHandle {
    pub meta: PluginMeta,
    obj: AlgorithmBox,
    req: Requirements,
    names: super::metric_names::MetricNames,
}

impl AlgorithmHandle {
    /// Builds the algorithm; `section` names its config section in errors (`algorithm.config`).
    /// A requirement this host does not know is refused here.
    pub fn new(p: &LoadedPlugin, config_json: &str, ctx: HostContext, section: &str) -> Result<Self> {
        let obj = match (p.module.new_algorithm())(RStr::from_str(config_json), ctx) {
            RResult::ROk(obj) => obj,
            RResult::RErr(e) => return Err(call_err(&p.meta, e, section)),
        };
        let names = obj.requirements();
        let req = Requirements::from_names(names.iter().map(|n| n.as_str())).map_err(|unknown| {
            plugin_err(
                &p.meta,
                format!(
                    "requires `{unknown}`, which this host does not provide (it provides: {})",
                    keys::KNOWN_REQUIREMENTS.join(", ")
                ),
            )
        })?;
        Ok(AlgorithmHandle { meta: p.meta.clone(), obj, req, names: Default::default() })
    }

    /// What the algorithm needs.
    pub fn requirements(&self) -> Requirements {
        self.req
    }

    /// The plugin's config with its defaults, as it reports it (`null` when it does not).
    pub fn resolved_config(&self) -> serde_json::Value {
        serde_json::from_str(self.obj.resolved_config().as_str()).unwrap_or(serde_json::Value::Null)
    }

    /// The plugin's description of its keys (`[{"key", "help", "peers"}]`), `None` when it gives
    /// none (a plugin built before 4.3, or one that does not describe them).
    pub fn describe_keys(&self) -> Option<Vec<serde_json::Value>> {
        match serde_json::from_str(self.obj.describe_keys().as_str()) {
            Ok(serde_json::Value::Array(keys)) => Some(keys),
            _ => None,
        }
    }

    /// Advantages (and returns) of a generation batch, checked to be `[B, R]` f32.
    ///
    /// # Shapes
    /// See [`Experience`]; returns `advantages`, `returns`: `[B, R]`.
    pub fn prepare(&mut self, exp: &Experience) -> Result<Prepared> {
        let valid = exp.action_mask.f_gt(0.0)?;
        let exp = Experience {
            rewards: exp.rewards.shallow_clone(),
            logprobs: zero_padding(&exp.logprobs, &valid)?,
            ref_logprobs: zero_padding_opt(&exp.ref_logprobs, &valid)?,
            values: zero_padding_opt(&exp.values, &valid)?,
            action_mask: exp.action_mask.shallow_clone(),
            group_ids: exp.group_ids.shallow_clone(),
            step: exp.step,
            behavior_logprobs: zero_padding_opt(&exp.behavior_logprobs, &valid)?,
        };
        let out = exp.with_abi(|inputs| self.obj.prepare(inputs)).into_result();
        let out = out.map_err(|e| call_err(&self.meta, e, "algorithm.config"))?;
        let mut advantages = None;
        let mut returns = None;
        for t in out.tensors {
            match t.name.as_str() {
                keys::ADVANTAGES => advantages = Some(t.tensor.into_tensor()),
                keys::RETURNS => returns = Some(t.tensor.into_tensor()),
                _ => {}
            }
        }
        let advantages = advantages.ok_or_else(|| plugin_err(&self.meta, "prepare returned no `advantages`".into()))?;
        let shape = exp.action_mask.size();
        for (what, t) in [("advantages", Some(&advantages)), ("returns", returns.as_ref())] {
            if let Some(t) = t {
                if t.size() != shape || t.kind() != Kind::Float {
                    return Err(plugin_err(
                        &self.meta,
                        format!("prepare returned {what} of {:?} {:?}, expected {shape:?} Float", t.kind(), t.size()),
                    ));
                }
            }
        }
        Ok(Prepared {
            advantages,
            returns,
            metrics: self.names.filter(&self.meta.name, namespaced(&self.meta, out.metrics)),
        })
    }

    /// The loss of a minibatch (a scalar carrying gradients to the host's models).
    ///
    /// # Shapes
    /// See [`Minibatch`]; returns a scalar.
    pub fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput> {
        let valid = mb.action_mask.f_gt(0.0)?;
        let mb = Minibatch {
            logprobs: zero_padding(&mb.logprobs, &valid)?,
            old_logprobs: zero_padding(&mb.old_logprobs, &valid)?,
            ref_logprobs: zero_padding_opt(&mb.ref_logprobs, &valid)?,
            values: zero_padding_opt(&mb.values, &valid)?,
            old_values: zero_padding_opt(&mb.old_values, &valid)?,
            advantages: zero_padding(&mb.advantages, &valid)?,
            returns: zero_padding_opt(&mb.returns, &valid)?,
            action_mask: mb.action_mask.shallow_clone(),
            entropy: zero_padding_opt(&mb.entropy, &valid)?,
            rewards: mb.rewards.shallow_clone(),
            step: mb.step,
            epoch: mb.epoch,
            accumulation_steps: mb.accumulation_steps,
            step_tokens: mb.step_tokens,
            step_rows: mb.step_rows,
            behavior_logprobs: zero_padding_opt(&mb.behavior_logprobs, &valid)?,
        };
        let out = mb.with_abi(|inputs| self.obj.loss(inputs)).into_result();
        let out = out.map_err(|e| call_err(&self.meta, e, "algorithm.config"))?;
        let loss = out.loss.into_tensor();
        if loss.dim() != 0 {
            return Err(plugin_err(
                &self.meta,
                format!("loss returned a tensor of shape {:?}, not a scalar", loss.size()),
            ));
        }
        Ok(LossOutput { loss, metrics: self.names.filter(&self.meta.name, namespaced(&self.meta, out.metrics)) })
    }

    /// The plugin's checkpoint state (JSON).
    pub fn state(&self) -> Result<serde_json::Value> {
        let text = self.obj.state().into_result().map_err(|e| call_err(&self.meta, e, "algorithm state"))?;
        plugin_state_json(&self.meta, text.as_str())
    }

    /// Restores the plugin's checkpoint state.
    pub fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let text = state.to_string();
        self.obj.load_state(RStr::from_str(&text)).into_result().map_err(|e| call_err(&self.meta, e, "algorithm state"))
    }
}

fn plugin_state_json(meta: &PluginMeta, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| plugin_err(meta, format!("state() returned invalid JSON: {e}")))
}

fn sample_abi(s: &Sample) -> SampleAbi {
    SampleAbi {
        prompt: s.prompt.as_str().into(),
        response: s.response.as_str().into(),
        prompt_ids: s.prompt_ids.clone().into(),
        response_ids: s.response_ids.clone().into(),
        label: s.label.clone().map(Into::into).into(),
        metadata_json: s.metadata.to_string().into(),
        messages_json: serde_json::to_string(&s.messages).unwrap_or_else(|_| "[]".into()).into(),
    }
}

/// A reward source instance.
pub struct RewardHandle {
    pub meta: PluginMeta,
    obj: RewardBox,
    names: super::metric_names::MetricNames,
}

impl RewardHandle {
    /// Builds the reward source; `section` names its config section in errors (`rewards[0].config`).
    pub fn new(p: &LoadedPlugin, config_json: &str, ctx: HostContext, section: &str) -> Result<Self> {
        match (p.module.new_reward())(RStr::from_str(config_json), ctx) {
            RResult::ROk(obj) => Ok(RewardHandle { meta: p.meta.clone(), obj, names: Default::default() }),
            RResult::RErr(e) => Err(call_err(&p.meta, e, section)),
        }
    }

    /// One score per sample (the count is checked); metrics namespaced like an algorithm's.
    pub fn score(&mut self, samples: &[Sample]) -> Result<Scores> {
        let n = samples.len();
        let abi: RVec<SampleAbi> = samples.iter().map(sample_abi).collect();
        let out = self.obj.score(abi).into_result().map_err(|e| call_err(&self.meta, e, "rewards"))?;
        if out.scores.len() != n {
            return Err(plugin_err(&self.meta, format!("returned {} scores for {n} samples", out.scores.len())));
        }
        Ok(Scores {
            scores: out.scores.into(),
            metrics: self.names.filter(&self.meta.name, namespaced(&self.meta, out.metrics)),
        })
    }

    /// The plugin's checkpoint state (JSON).
    pub fn state(&self) -> Result<serde_json::Value> {
        let text = self.obj.state().into_result().map_err(|e| call_err(&self.meta, e, "reward state"))?;
        plugin_state_json(&self.meta, text.as_str())
    }

    /// Restores the plugin's checkpoint state.
    pub fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let text = state.to_string();
        self.obj.load_state(RStr::from_str(&text)).into_result().map_err(|e| call_err(&self.meta, e, "reward state"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn padding_becomes_zero_and_gradients_flow_through_the_rest() {
        let x = Tensor::from_slice(&[1f32, f32::NAN, 3.0, 4.0]).view([2, 2]).set_requires_grad(true);
        let valid = Tensor::from_slice(&[1f32, 0., 1., 1.]).view([2, 2]).gt(0.0);
        let y = zero_padding(&x, &valid).unwrap();
        assert_eq!(Vec::<f32>::try_from(y.flatten(0, -1)).unwrap(), [1.0, 0.0, 3.0, 4.0]);
        y.sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(x.grad().flatten(0, -1)).unwrap(), [1.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn metrics_named_like_host_metrics_get_the_plugin_prefix() {
        let meta = PluginMeta {
            name: "algo".into(),
            kind: rlhf_plugin_api::PluginKind::Algorithm,
            version: "1".into(),
            description: String::new(),
            path: PathBuf::from("libalgo.so"),
        };
        let metrics: RVec<Metric> = ["kl", "loss/policy", "rewards/x/mean", "algo/own", "reward_std"]
            .into_iter()
            .map(|n| Metric { name: n.into(), value: 1.0 })
            .collect();
        let names: Vec<String> = namespaced(&meta, metrics).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["algo/kl", "loss/policy", "algo/rewards/x/mean", "algo/own", "algo/reward_std"]);
    }
}
