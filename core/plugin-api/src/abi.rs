//! Everything with a fixed layout that crosses the boundary: the root module every plugin exports,
//! the `#[sabi_trait]` objects for algorithm and reward instances, and their argument structs.
//!
//! Evolution is append-only: new fields go after `#[sabi(last_prefix_field)]`, new trait methods at
//! the end; nothing is removed or renamed. [`API_VERSION`] is bumped on any change.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, ROption, RResult, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, package_version_strings, sabi_trait, StableAbi};

use crate::error::PluginError;
use crate::tensor::{TensorBox, TensorRef};

/// Version of this interface; the host refuses plugins built against another.
pub const API_VERSION: u32 = 3;
/// The tch version plugin-api is built with (the workspace pins it; a tidy test checks).
pub const TCH_VERSION: &str = "0.24.0";
/// The libtorch version plugin-api was compiled against.
pub const TORCH_VERSION: &str = env!("RLHF_TORCH_VERSION");

/// What a plugin provides.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginKind {
    /// Advantages and losses (PPO, GRPO, ...).
    Algorithm,
    /// Scores for (prompt, response) samples.
    Reward,
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PluginKind::Algorithm => "algorithm",
            PluginKind::Reward => "reward",
        })
    }
}

/// What a plugin declares about itself; read before anything else is called.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct PluginInfo {
    /// The name users address it by (`--algo grpo`, `plugin = "reward-rules"`).
    pub name: RString,
    pub kind: PluginKind,
    /// The plugin's own version.
    pub version: RString,
    pub description: RString,
    /// [`API_VERSION`] of the plugin-api the plugin was compiled with.
    pub api_version: u32,
    /// [`TORCH_VERSION`] / [`TCH_VERSION`] the plugin was compiled with.
    pub torch_version: RString,
    pub tch_version: RString,
}

/// Log levels of the bridge (tracing's, most severe first).
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// The host's logger: each cdylib has its own `tracing` globals, so plugin events are forwarded
/// through this function pointer and re-emitted by the host with the plugin's name as target.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostLogger {
    pub log: extern "C" fn(level: LogLevel, plugin: RStr<'_>, message: RStr<'_>),
}

/// What the host hands a plugin constructor besides its config section.
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct HostContext {
    pub logger: HostLogger,
    /// Device the host trains on: `cpu`, `cuda:0`, ...
    pub device: RString,
    /// The run's seed.
    pub seed: u64,
    /// `samples_per_prompt` of the run (GRPO's group size G).
    pub samples_per_prompt: u32,
}

/// A named scalar for the metrics stream.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Metric {
    pub name: RString,
    pub value: f64,
}

/// What an algorithm needs the host to compute.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Requirements {
    /// Reference-model log-probs (`ref_logprobs`).
    pub reference: bool,
    /// A critic: `values` / `old_values` and a value optimizer.
    pub critic: bool,
    /// Per-token entropy of the current policy in each minibatch.
    pub entropy: bool,
}

/// One generation batch, handed to [`AlgorithmObj::prepare`]. Per-token tensors cover response
/// tokens only (`R` = longest response), aligned with `action_mask`.
#[repr(C)]
#[derive(StableAbi)]
pub struct ExperienceAbi<'a> {
    /// Weighted sum of reward sources per sample, `[B]` f32.
    pub rewards: TensorRef<'a>,
    /// Log-probs of the sampling (old) policy, `[B, R]` f32.
    pub logprobs: TensorRef<'a>,
    /// Reference-model log-probs, `[B, R]` f32 (when required).
    pub ref_logprobs: ROption<TensorRef<'a>>,
    /// Critic values of the state before each response token, `[B, R]` f32 (when required).
    pub values: ROption<TensorRef<'a>>,
    /// 1.0 on response tokens, `[B, R]` f32.
    pub action_mask: TensorRef<'a>,
    /// Samples of the same prompt share an id, `[B]` i64.
    pub group_ids: TensorRef<'a>,
    /// Optimizer steps done so far.
    pub step: u64,
}

/// What [`AlgorithmObj::prepare`] returns: per-token training targets kept by the host and sliced
/// into minibatches.
#[repr(C)]
#[derive(StableAbi)]
pub struct PreparedAbi {
    /// `[B, R]` f32.
    pub advantages: TensorBox,
    /// Value targets, `[B, R]` f32 (algorithms with a critic).
    pub returns: ROption<TensorBox>,
    pub metrics: RVec<Metric>,
}

/// One minibatch, handed to [`AlgorithmObj::loss`]. Tensors marked *grad* carry autograd history
/// back to the host's models.
#[repr(C)]
#[derive(StableAbi)]
pub struct MinibatchAbi<'a> {
    /// Current policy log-probs, `[b, R]` f32, grad.
    pub logprobs: TensorRef<'a>,
    /// Sampling-policy log-probs, `[b, R]` f32.
    pub old_logprobs: TensorRef<'a>,
    pub ref_logprobs: ROption<TensorRef<'a>>,
    /// Current critic values, `[b, R]` f32, grad.
    pub values: ROption<TensorRef<'a>>,
    /// Critic values at rollout time, `[b, R]` f32.
    pub old_values: ROption<TensorRef<'a>>,
    pub advantages: TensorRef<'a>,
    pub returns: ROption<TensorRef<'a>>,
    pub action_mask: TensorRef<'a>,
    /// Current policy entropy, `[b, R]` f32, grad (when required).
    pub entropy: ROption<TensorRef<'a>>,
    /// Sequence rewards, `[b]` f32.
    pub rewards: TensorRef<'a>,
    pub step: u64,
}

/// What [`AlgorithmObj::loss`] returns.
#[repr(C)]
#[derive(StableAbi)]
pub struct LossAbi {
    /// The scalar the host back-propagates (policy + weighted value + penalties).
    pub loss: TensorBox,
    pub metrics: RVec<Metric>,
}

/// An algorithm instance.
#[sabi_trait]
pub trait AlgorithmObj: Send {
    /// What the host must compute for this algorithm.
    fn requirements(&self) -> Requirements;

    /// Reward shaping and advantages for a whole generation batch.
    fn prepare(&mut self, exp: ExperienceAbi<'_>) -> RResult<PreparedAbi, PluginError>;

    /// The loss of one minibatch.
    #[sabi(last_prefix_field)]
    fn loss(&mut self, mb: MinibatchAbi<'_>) -> RResult<LossAbi, PluginError>;

    /// State that must survive a checkpoint (e.g. an adaptive KL coefficient), as JSON. API 3.
    fn state(&self) -> RResult<RString, PluginError>;

    /// Restores [`AlgorithmObj::state`] on resume. API 3.
    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError>;
}

/// Owned algorithm object.
pub type AlgorithmBox = AlgorithmObj_TO<'static, RBox<()>>;

/// One sample to score.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct SampleAbi {
    /// The prompt as the model saw it (chat template applied).
    pub prompt: RString,
    pub response: RString,
    pub prompt_ids: RVec<u32>,
    pub response_ids: RVec<u32>,
    /// The dataset's `label`, if any.
    pub label: ROption<RString>,
    /// The dataset line's other fields as a JSON object.
    pub metadata_json: RString,
    /// The prompt as chat messages before any template, a JSON array of `{"role", "content"}`
    /// (a plain-text prompt is one user message), so a reward model can render the conversation
    /// with its own chat template.
    pub messages_json: RString,
}

/// Scores for a batch, one per sample, plus metrics.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct ScoresAbi {
    pub scores: RVec<f64>,
    pub metrics: RVec<Metric>,
}

/// A reward source instance.
#[sabi_trait]
pub trait RewardObj: Send {
    #[sabi(last_prefix_field)]
    fn score(&mut self, samples: RVec<SampleAbi>) -> RResult<ScoresAbi, PluginError>;

    /// State that must survive a checkpoint (e.g. running reward statistics), as JSON. API 3.
    fn state(&self) -> RResult<RString, PluginError>;

    /// Restores [`RewardObj::state`] on resume. API 3.
    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError>;
}

/// Owned reward object.
pub type RewardBox = RewardObj_TO<'static, RBox<()>>;

/// The root module every plugin exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    pub info: extern "C" fn() -> PluginInfo,
    /// Builds an algorithm from its config section (JSON text); reward plugins return Unsupported.
    pub new_algorithm: extern "C" fn(config: RStr<'_>, ctx: HostContext) -> RResult<AlgorithmBox, PluginError>,
    /// Builds a reward source; algorithm plugins return Unsupported.
    #[sabi(last_prefix_field)]
    pub new_reward: extern "C" fn(config: RStr<'_>, ctx: HostContext) -> RResult<RewardBox, PluginError>,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "rlhf_plugin";
    const NAME: &'static str = "rlhf_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
