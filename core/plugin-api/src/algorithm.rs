//! The algorithm side of the ABI as plain Rust: implement [`Algorithm`] on a struct and export it
//! with [`export_algorithm!`](crate::export_algorithm). The adapter converts handles to
//! `tch::Tensor`, catches panics and turns every failure into a [`PluginError`].

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::std_types::{RResult, RStr, RString, RVec};
use tch::{Kind, Tensor};

use crate::abi::{keys, AlgorithmObj, HostContext, InputsAbi, LossAbi, Metric, NamedTensorBoxAbi, PreparedAbi};
use crate::error::PluginError;
use crate::tensor::{TensorBox, TensorRef};

/// What the constructor learns from the host (the JSON object of [`HostContext::context_json`];
/// keys a newer host adds are ignored, keys an older host lacks take their defaults).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default)]
pub struct Context {
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    pub seed: u64,
    /// GRPO's G.
    pub samples_per_prompt: u32,
}

impl Default for Context {
    fn default() -> Self {
        Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
    }
}

impl Context {
    /// The ABI form the host hands a constructor.
    pub fn to_json(&self) -> String {
        serde_json::json!({"device": self.device, "seed": self.seed, "samples_per_prompt": self.samples_per_prompt})
            .to_string()
    }

    pub(crate) fn from_abi(c: &HostContext) -> Result<Self, PluginError> {
        serde_json::from_str(c.context_json.as_str())
            .map_err(|e| PluginError::compute(format!("the host's context is not the expected JSON object: {e}")))
    }
}

/// What an algorithm needs the host to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Requirements {
    /// Reference-model log-probs (`ref_logprobs`).
    pub reference: bool,
    /// A critic: `values` / `old_values` and a value optimizer.
    pub critic: bool,
    /// Per-token entropy of the current policy in each minibatch.
    pub entropy: bool,
}

impl Requirements {
    /// The names that cross the ABI ([`keys::KNOWN_REQUIREMENTS`]).
    pub fn to_names(self) -> Vec<&'static str> {
        [(self.reference, keys::REFERENCE), (self.critic, keys::CRITIC), (self.entropy, keys::ENTROPY_REQ)]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect()
    }

    /// Parses requirement names; `Err(name)` for the first this interface does not know.
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut r = Requirements::default();
        for name in names {
            match name {
                keys::REFERENCE => r.reference = true,
                keys::CRITIC => r.critic = true,
                keys::ENTROPY_REQ => r.entropy = true,
                other => return Err(other.to_string()),
            }
        }
        Ok(r)
    }
}

/// A generation batch. Per-token tensors cover response tokens only; their padding positions
/// (where `action_mask` is 0) hold exactly 0.0, never NaN.
///
/// # Shapes
/// `B` samples, `R` response slots: `rewards [B]`, `group_ids [B]` (i64), every other tensor `[B, R]` f32
/// (checked by the adapter before [`Algorithm::prepare`] runs).
#[derive(Debug)]
pub struct Experience {
    pub rewards: Tensor,
    pub logprobs: Tensor,
    pub ref_logprobs: Option<Tensor>,
    pub values: Option<Tensor>,
    pub action_mask: Tensor,
    pub group_ids: Tensor,
    pub step: u64,
    /// The rollout engine's own log-probs of the sampled tokens (since 4.2; only from an
    /// external engine such as vLLM, whose numerics differ from the trainer's): the behaviour
    /// policy, for off-policy corrections. `None` with the trainer's own engine, where the
    /// behaviour policy is `logprobs`.
    pub behavior_logprobs: Option<Tensor>,
}

/// Per-token targets computed once per generation batch.
///
/// # Shapes
/// `advantages`, `returns`: `[B, R]` f32.
#[derive(Debug)]
pub struct Prepared {
    pub advantages: Tensor,
    pub returns: Option<Tensor>,
    pub metrics: Vec<(String, f64)>,
}

/// One minibatch. `logprobs`, `values` and `entropy` carry gradients back to the host's models.
/// Padding positions of every per-token tensor hold exactly 0.0.
///
/// # Shapes
/// `rewards [b]`, every other tensor `[b, R]` f32 (checked by the adapter).
#[derive(Debug)]
pub struct Minibatch {
    pub logprobs: Tensor,
    pub old_logprobs: Tensor,
    pub ref_logprobs: Option<Tensor>,
    pub values: Option<Tensor>,
    pub old_values: Option<Tensor>,
    pub advantages: Tensor,
    pub returns: Option<Tensor>,
    pub action_mask: Tensor,
    pub entropy: Option<Tensor>,
    pub rewards: Tensor,
    pub step: u64,
    /// The PPO epoch (0-based) of this minibatch (since 4.1).
    pub epoch: u64,
    /// Micro-batches accumulated into this optimizer step over all ranks (minibatches, or the
    /// token-budget micro-batches they split into; since 4.1, 1 from an older host). The host
    /// divides the returned loss by it, so a per-minibatch mean needs no change.
    pub accumulation_steps: u64,
    /// Valid response tokens in all minibatches of this optimizer step (since 4.1; this
    /// minibatch's from an older host): a token mean over the whole accumulated batch divides
    /// `Σ loss·mask` by `step_tokens / accumulation_steps` (the host's division completes it).
    pub step_tokens: f64,
    /// Samples in all minibatches of this optimizer step (since 4.4; `b × accumulation_steps`
    /// from an older host): a per-sample mean over the whole accumulated batch divides `Σ x` by
    /// `step_rows / accumulation_steps` ([`crate::ops::row_mean`]), exact whatever each
    /// minibatch holds.
    pub step_rows: f64,
    /// The rollout engine's log-probs of these samples (since 4.2; see
    /// [`Experience::behavior_logprobs`]).
    pub behavior_logprobs: Option<Tensor>,
}

/// The loss to back-propagate and metrics to log (TRL's names where they exist:
/// `loss/policy`, `loss/value`, `clip_ratio`, `approx_kl`, ...).
#[derive(Debug)]
pub struct LossOutput {
    /// Scalar.
    pub loss: Tensor,
    pub metrics: Vec<(String, f64)>,
}

/// An RL algorithm: reward shaping, advantages and losses.
pub trait Algorithm: Send + Sized + 'static {
    /// Builds the algorithm from its config section (JSON text; parse it with
    /// [`parse_config`](crate::parse_config) into a `deny_unknown_fields` struct).
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError>;
    /// What the host must compute.
    fn requirements(&self) -> Requirements;
    /// Advantages (and returns) for a generation batch.
    fn prepare(&mut self, exp: &Experience) -> Result<Prepared, PluginError>;
    /// The loss of a minibatch.
    fn loss(&mut self, mb: &Minibatch) -> Result<LossOutput, PluginError>;
    /// State to checkpoint, as a JSON value (default: none). Anything [`Algorithm::prepare`] or
    /// [`Algorithm::loss`] changes across steps belongs here, or a resumed run diverges.
    fn state(&self) -> Result<serde_json::Value, PluginError> {
        Ok(serde_json::Value::Null)
    }
    /// Restores [`Algorithm::state`] (called on resume, after [`Algorithm::new`]).
    fn load_state(&mut self, _state: serde_json::Value) -> Result<(), PluginError> {
        Ok(())
    }
    /// The config with every default filled in, logged by the host at start (default: not
    /// reported).
    fn resolved_config(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// One line of help per config key and the peers' names for it, for `rlhf plugins --describe`
    /// and the generated algorithm reference (default: not described). The defaults come from
    /// [`Algorithm::resolved_config`] of an instance built from an empty section.
    fn describe_keys(&self) -> Vec<KeyDoc> {
        Vec::new()
    }
}

/// What [`Algorithm::describe_keys`] says about one config key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDoc {
    /// The key in `[algorithm.config]`.
    pub key: &'static str,
    /// One line: what it does, with its range.
    pub help: &'static str,
    /// The same setting in other trainers: `("TRL", "beta")`, `("verl", "actor.kl_loss_coef")`,
    /// `("OpenRLHF", "--init_kl_coef")`.
    pub peers: &'static [(&'static str, &'static str)],
}

impl KeyDoc {
    /// The JSON object the ABI carries.
    pub fn to_json(&self) -> serde_json::Value {
        let peers: serde_json::Map<String, serde_json::Value> =
            self.peers.iter().map(|(p, k)| (p.to_string(), serde_json::Value::String(k.to_string()))).collect();
        serde_json::json!({"key": self.key, "help": self.help, "peers": peers})
    }
}

pub(crate) fn metrics_abi(m: Vec<(String, f64)>) -> RVec<Metric> {
    m.into_iter().map(|(name, value)| Metric { name: name.into(), value }).collect()
}

/// Runs `f`, turning a panic into [`PluginError`].
pub fn guard<T>(f: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, PluginError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => RResult::ROk(v),
        Ok(Err(e)) => RResult::RErr(e),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            RResult::RErr(PluginError::panic(msg))
        }
    }
}

/// The keyed inputs of one call, read by name with the documented shapes checked.
struct Inputs<'a> {
    abi: InputsAbi<'a>,
    call: &'static str,
}

impl Inputs<'_> {
    fn tensor(&self, name: &str) -> Option<Tensor> {
        self.abi.tensors.iter().find(|t| t.name.as_str() == name).map(|t| t.tensor.to_tensor())
    }

    fn required(&self, name: &str) -> Result<Tensor, PluginError> {
        self.tensor(name).ok_or_else(|| PluginError::compute(format!("{}: the host passed no `{name}`", self.call)))
    }

    fn scalar(&self, name: &str) -> Option<f64> {
        self.abi.scalars.iter().find(|s| s.name.as_str() == name).map(|s| s.value)
    }
}

/// Checks that `t` has `shape` and `kind`, naming the tensor and the call otherwise.
pub(crate) fn check_input(call: &str, name: &str, t: &Tensor, shape: &[i64], kind: Kind) -> Result<(), PluginError> {
    if t.size() != shape || t.kind() != kind {
        return Err(PluginError::compute(format!(
            "{call}: `{name}` is {:?} {:?}, expected {shape:?} {kind:?}",
            t.kind(),
            t.size()
        )));
    }
    Ok(())
}

impl Experience {
    fn from_abi(abi: InputsAbi<'_>) -> Result<Self, PluginError> {
        let i = Inputs { abi, call: "prepare" };
        let logprobs = i.required(keys::LOGPROBS)?;
        let (b, r) = match logprobs.size()[..] {
            [b, r] => (b, r),
            _ => {
                return Err(PluginError::compute(format!(
                    "prepare: `logprobs` is {:?}, expected [B, R]",
                    logprobs.size()
                )))
            }
        };
        let exp = Experience {
            rewards: i.required(keys::REWARDS)?,
            logprobs,
            ref_logprobs: i.tensor(keys::REF_LOGPROBS),
            values: i.tensor(keys::VALUES),
            action_mask: i.required(keys::ACTION_MASK)?,
            group_ids: i.required(keys::GROUP_IDS)?,
            step: i.scalar(keys::STEP).unwrap_or(0.0) as u64,
            behavior_logprobs: i.tensor(keys::BEHAVIOR_LOGPROBS),
        };
        check_input(i.call, keys::REWARDS, &exp.rewards, &[b], Kind::Float)?;
        check_input(i.call, keys::GROUP_IDS, &exp.group_ids, &[b], Kind::Int64)?;
        for (name, t) in [
            (keys::LOGPROBS, Some(&exp.logprobs)),
            (keys::ACTION_MASK, Some(&exp.action_mask)),
            (keys::REF_LOGPROBS, exp.ref_logprobs.as_ref()),
            (keys::VALUES, exp.values.as_ref()),
            (keys::BEHAVIOR_LOGPROBS, exp.behavior_logprobs.as_ref()),
        ] {
            if let Some(t) = t {
                check_input(i.call, name, t, &[b, r], Kind::Float)?;
            }
        }
        Ok(exp)
    }
}

impl Minibatch {
    fn from_abi(abi: InputsAbi<'_>) -> Result<Self, PluginError> {
        let i = Inputs { abi, call: "loss" };
        let logprobs = i.required(keys::LOGPROBS)?;
        let (b, r) = match logprobs.size()[..] {
            [b, r] => (b, r),
            _ => {
                return Err(PluginError::compute(format!("loss: `logprobs` is {:?}, expected [b, R]", logprobs.size())))
            }
        };
        let action_mask = i.required(keys::ACTION_MASK)?;
        // A 4.0 host sends no step_tokens: its optimizer step is this minibatch.
        let step_tokens = match i.scalar(keys::STEP_TOKENS) {
            Some(n) => n,
            None => action_mask.f_sum(Kind::Float)?.f_double_value(&[])?,
        };
        let accumulation_steps = i.scalar(keys::ACCUMULATION_STEPS).unwrap_or(1.0).max(1.0) as u64;
        // A host older than 4.4 sends no step_rows: its minibatches hold `b` samples each.
        let step_rows = i.scalar(keys::STEP_ROWS).unwrap_or((b as u64 * accumulation_steps) as f64);
        let mb = Minibatch {
            logprobs,
            old_logprobs: i.required(keys::OLD_LOGPROBS)?,
            ref_logprobs: i.tensor(keys::REF_LOGPROBS),
            values: i.tensor(keys::VALUES),
            old_values: i.tensor(keys::OLD_VALUES),
            advantages: i.required(keys::ADVANTAGES)?,
            returns: i.tensor(keys::RETURNS),
            action_mask,
            entropy: i.tensor(keys::ENTROPY),
            rewards: i.required(keys::REWARDS)?,
            step: i.scalar(keys::STEP).unwrap_or(0.0) as u64,
            epoch: i.scalar(keys::EPOCH).unwrap_or(0.0) as u64,
            accumulation_steps,
            step_tokens,
            step_rows,
            behavior_logprobs: i.tensor(keys::BEHAVIOR_LOGPROBS),
        };
        check_input(i.call, keys::REWARDS, &mb.rewards, &[b], Kind::Float)?;
        for (name, t) in [
            (keys::LOGPROBS, Some(&mb.logprobs)),
            (keys::OLD_LOGPROBS, Some(&mb.old_logprobs)),
            (keys::ADVANTAGES, Some(&mb.advantages)),
            (keys::ACTION_MASK, Some(&mb.action_mask)),
            (keys::REF_LOGPROBS, mb.ref_logprobs.as_ref()),
            (keys::VALUES, mb.values.as_ref()),
            (keys::OLD_VALUES, mb.old_values.as_ref()),
            (keys::RETURNS, mb.returns.as_ref()),
            (keys::ENTROPY, mb.entropy.as_ref()),
            (keys::BEHAVIOR_LOGPROBS, mb.behavior_logprobs.as_ref()),
        ] {
            if let Some(t) = t {
                check_input(i.call, name, t, &[b, r], Kind::Float)?;
            }
        }
        Ok(mb)
    }
}

fn named<'a>(list: &[(&'static str, Option<&'a Tensor>)]) -> Vec<crate::abi::NamedTensorAbi<'a>> {
    list.iter()
        .filter_map(|(name, t)| {
            t.map(|t| crate::abi::NamedTensorAbi { name: (*name).into(), tensor: TensorRef::new(t) })
        })
        .collect()
}

fn scalars(list: &[(&'static str, f64)]) -> Vec<crate::abi::NamedScalarAbi<'static>> {
    list.iter().map(|&(name, value)| crate::abi::NamedScalarAbi { name: name.into(), value }).collect()
}

impl Experience {
    /// Runs `f` on the keyed ABI form of this batch (the host's side of [`AlgorithmObj::prepare`]).
    pub fn with_abi<T>(&self, f: impl FnOnce(InputsAbi<'_>) -> T) -> T {
        let tensors = named(&[
            (keys::REWARDS, Some(&self.rewards)),
            (keys::LOGPROBS, Some(&self.logprobs)),
            (keys::REF_LOGPROBS, self.ref_logprobs.as_ref()),
            (keys::VALUES, self.values.as_ref()),
            (keys::ACTION_MASK, Some(&self.action_mask)),
            (keys::GROUP_IDS, Some(&self.group_ids)),
            (keys::BEHAVIOR_LOGPROBS, self.behavior_logprobs.as_ref()),
        ]);
        let scalars = scalars(&[(keys::STEP, self.step as f64)]);
        f(InputsAbi { tensors: tensors.as_slice().into(), scalars: scalars.as_slice().into() })
    }
}

impl Minibatch {
    /// Runs `f` on the keyed ABI form of this minibatch (the host's side of [`AlgorithmObj::loss`]).
    pub fn with_abi<T>(&self, f: impl FnOnce(InputsAbi<'_>) -> T) -> T {
        let tensors = named(&[
            (keys::LOGPROBS, Some(&self.logprobs)),
            (keys::OLD_LOGPROBS, Some(&self.old_logprobs)),
            (keys::REF_LOGPROBS, self.ref_logprobs.as_ref()),
            (keys::VALUES, self.values.as_ref()),
            (keys::OLD_VALUES, self.old_values.as_ref()),
            (keys::ADVANTAGES, Some(&self.advantages)),
            (keys::RETURNS, self.returns.as_ref()),
            (keys::ACTION_MASK, Some(&self.action_mask)),
            (keys::ENTROPY, self.entropy.as_ref()),
            (keys::REWARDS, Some(&self.rewards)),
            (keys::BEHAVIOR_LOGPROBS, self.behavior_logprobs.as_ref()),
        ]);
        let scalars = scalars(&[
            (keys::STEP, self.step as f64),
            (keys::EPOCH, self.epoch as f64),
            (keys::ACCUMULATION_STEPS, self.accumulation_steps as f64),
            (keys::STEP_TOKENS, self.step_tokens),
            (keys::STEP_ROWS, self.step_rows),
        ]);
        f(InputsAbi { tensors: tensors.as_slice().into(), scalars: scalars.as_slice().into() })
    }
}

/// Adapts an [`Algorithm`] to the ABI object.
#[doc(hidden)]
pub struct AlgorithmAdapter<A: Algorithm>(pub A);

impl<A: Algorithm> AlgorithmObj for AlgorithmAdapter<A> {
    fn requirements(&self) -> RVec<RString> {
        let r = match catch_unwind(AssertUnwindSafe(|| self.0.requirements())) {
            Ok(r) => r,
            // Nothing to report through; ask for everything so later calls surface the panic.
            Err(_) => Requirements { reference: true, critic: true, entropy: true },
        };
        r.to_names().into_iter().map(RString::from).collect()
    }

    fn prepare(&mut self, exp: InputsAbi<'_>) -> RResult<PreparedAbi, PluginError> {
        guard(|| {
            let p = self.0.prepare(&Experience::from_abi(exp)?)?;
            let mut tensors =
                vec![NamedTensorBoxAbi { name: keys::ADVANTAGES.into(), tensor: TensorBox::new(p.advantages) }];
            if let Some(r) = p.returns {
                tensors.push(NamedTensorBoxAbi { name: keys::RETURNS.into(), tensor: TensorBox::new(r) });
            }
            Ok(PreparedAbi { tensors: tensors.into(), metrics: metrics_abi(p.metrics) })
        })
    }

    fn loss(&mut self, mb: InputsAbi<'_>) -> RResult<LossAbi, PluginError> {
        guard(|| {
            let out = self.0.loss(&Minibatch::from_abi(mb)?)?;
            Ok(LossAbi { loss: TensorBox::new(out.loss), metrics: metrics_abi(out.metrics) })
        })
    }

    fn state(&self) -> RResult<RString, PluginError> {
        guard(|| Ok(self.0.state()?.to_string().into()))
    }

    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError> {
        guard(|| {
            let v = serde_json::from_str(state.as_str())
                .map_err(|e| PluginError::config("state", format!("not JSON: {e}")))?;
            self.0.load_state(v)
        })
    }

    fn resolved_config(&self) -> RString {
        catch_unwind(AssertUnwindSafe(|| self.0.resolved_config().to_string())).unwrap_or_else(|_| "null".into()).into()
    }

    fn describe_keys(&self) -> RString {
        let keys = || {
            let docs = self.0.describe_keys();
            if docs.is_empty() {
                return "null".to_string();
            }
            serde_json::Value::Array(docs.iter().map(KeyDoc::to_json).collect()).to_string()
        };
        catch_unwind(AssertUnwindSafe(keys)).unwrap_or_else(|_| "null".into()).into()
    }
}
