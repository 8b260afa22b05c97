//! The algorithm side of the ABI as plain Rust: implement [`Algorithm`] on a struct and export it
//! with [`export_algorithm!`](crate::export_algorithm). The adapter converts handles to
//! `tch::Tensor`, catches panics and turns every failure into a [`PluginError`].

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use tch::Tensor;

use crate::abi::{AlgorithmObj, ExperienceAbi, HostContext, LossAbi, Metric, MinibatchAbi, PreparedAbi, Requirements};
use crate::error::PluginError;
use crate::tensor::TensorBox;

/// What the constructor learns from the host.
#[derive(Debug, Clone)]
pub struct Context {
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    pub seed: u64,
    /// GRPO's G.
    pub samples_per_prompt: u32,
}

impl From<&HostContext> for Context {
    fn from(c: &HostContext) -> Self {
        Context { device: c.device.to_string(), seed: c.seed, samples_per_prompt: c.samples_per_prompt }
    }
}

/// A generation batch. Per-token tensors cover response tokens only.
///
/// # Shapes
/// `B` samples, `R` response slots: `rewards [B]`, `group_ids [B]` (i64), every other tensor `[B, R]` f32.
#[derive(Debug)]
pub struct Experience {
    pub rewards: Tensor,
    pub logprobs: Tensor,
    pub ref_logprobs: Option<Tensor>,
    pub values: Option<Tensor>,
    pub action_mask: Tensor,
    pub group_ids: Tensor,
    pub step: u64,
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
///
/// # Shapes
/// `rewards [b]`, every other tensor `[b, R]` f32.
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

fn opt(t: &ROption<crate::tensor::TensorRef<'_>>) -> Option<Tensor> {
    t.as_ref().map(|r| r.to_tensor()).into_option()
}

/// Adapts an [`Algorithm`] to the ABI object.
#[doc(hidden)]
pub struct AlgorithmAdapter<A: Algorithm>(pub A);

impl<A: Algorithm> AlgorithmObj for AlgorithmAdapter<A> {
    fn requirements(&self) -> Requirements {
        match catch_unwind(AssertUnwindSafe(|| self.0.requirements())) {
            Ok(r) => r,
            // Nothing to report through; ask for everything so later calls surface the panic.
            Err(_) => Requirements { reference: true, critic: true, entropy: true },
        }
    }

    fn prepare(&mut self, exp: ExperienceAbi<'_>) -> RResult<PreparedAbi, PluginError> {
        guard(|| {
            let exp = Experience {
                rewards: exp.rewards.to_tensor(),
                logprobs: exp.logprobs.to_tensor(),
                ref_logprobs: opt(&exp.ref_logprobs),
                values: opt(&exp.values),
                action_mask: exp.action_mask.to_tensor(),
                group_ids: exp.group_ids.to_tensor(),
                step: exp.step,
            };
            let p = self.0.prepare(&exp)?;
            Ok(PreparedAbi {
                advantages: TensorBox::new(p.advantages),
                returns: p.returns.map(TensorBox::new).into(),
                metrics: metrics_abi(p.metrics),
            })
        })
    }

    fn loss(&mut self, mb: MinibatchAbi<'_>) -> RResult<LossAbi, PluginError> {
        guard(|| {
            let mb = Minibatch {
                logprobs: mb.logprobs.to_tensor(),
                old_logprobs: mb.old_logprobs.to_tensor(),
                ref_logprobs: opt(&mb.ref_logprobs),
                values: opt(&mb.values),
                old_values: opt(&mb.old_values),
                advantages: mb.advantages.to_tensor(),
                returns: opt(&mb.returns),
                action_mask: mb.action_mask.to_tensor(),
                entropy: opt(&mb.entropy),
                rewards: mb.rewards.to_tensor(),
                step: mb.step,
            };
            let out = self.0.loss(&mb)?;
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
}
