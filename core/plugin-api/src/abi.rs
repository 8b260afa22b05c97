//! Everything with a fixed layout that crosses the boundary: the root module every plugin exports,
//! the `#[sabi_trait]` objects for algorithm and reward instances, and their argument structs.
//!
//! # How this interface grows (ABI 4.x)
//! A plugin built against plugin-api `4.m` keeps loading and working in every host `4.n` with
//! `n >= m`. What a minor version may append, and how an older plugin copes:
//! - **Inputs** of [`AlgorithmObj::prepare`] / [`AlgorithmObj::loss`] travel as a keyed map
//!   ([`InputsAbi`]: named tensors and named scalars, names in [`keys`]), never as struct fields.
//!   A new input is a new key; a plugin ignores keys it does not know, and a key it needs that the
//!   host lacks is a clear error at the call.
//! - **Requirements** are names ([`AlgorithmObj::requirements`]); a plugin that asks for a name the
//!   host does not know is refused when it is instantiated, naming the requirement.
//! - **Construction context** ([`HostContext::context_json`]) is a JSON object; new fields are new
//!   keys, defaulted when absent.
//! - **Trait methods** are appended after `#[sabi(last_prefix_field)]` with a default body: a host
//!   calling one on an older plugin's object runs the default (abi_stable's prefix-type vtables).
//! - **Root-module fields** likewise go after `#[sabi(last_prefix_field)]`.
//!
//! Everything else (the fields of these `repr(C)` structs, removing or renaming anything, changing
//! a key's meaning) is breaking: [`API_MAJOR`] and this crate's version (`0.MAJOR.0`) are bumped
//! together, and the host refuses plugins of another major with a message saying so.
//!
//! abi_stable's own loader assumes a library at least as new as its host and would refuse an
//! older plugin whose vtable lacks an appended method; the host's loader therefore checks the
//! plugin's layout as the interface and its own as the implementation (every type, field and
//! method the plugin has, the host has with the same layout; the host may have more), and compares
//! the crate version's `0.MAJOR` only.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec};
use abi_stable::{declare_root_module_statics, package_version_strings, sabi_trait, StableAbi};

use crate::error::PluginError;
use crate::tensor::{TensorBox, TensorRef};

/// Major version of this interface: plugins of another major are refused.
pub const API_MAJOR: u32 = 4;
/// Minor version: what this host appended to [`API_MAJOR`]. A plugin built against minor `m`
/// loads into hosts of minor `>= m`.
///
/// - 4.0: keyed inputs, named requirements, JSON context.
/// - 4.1: the `epoch`, `accumulation_steps` and `step_tokens` scalars of a minibatch; the optional
///   [`AlgorithmObj::resolved_config`].
/// - 4.2: the optional `behavior_logprobs` tensor of a batch and a minibatch (an external
///   rollout engine's log-probs).
/// - 4.3: the optional [`AlgorithmObj::describe_keys`].
/// - 4.4: the `step_rows` scalar of a minibatch (micro-batches of unequal sizes).
pub const API_MINOR: u32 = 4;
/// The tch version plugin-api is built with (the workspace pins it; a tidy test checks).
pub const TCH_VERSION: &str = "0.24.0";
/// The libtorch version plugin-api was compiled against.
pub const TORCH_VERSION: &str = env!("RLHF_TORCH_VERSION");

/// The names of the keyed inputs and requirements (see the module docs). Per-token tensors are
/// `[B, R]` f32 over response tokens, with padding positions exactly 0.0 (never NaN).
pub mod keys {
    /// Weighted sum of reward sources per sample, `[B]` f32.
    pub const REWARDS: &str = "rewards";
    /// Sampling-policy log-probs, `[B, R]` f32 (in a minibatch: the current policy's, with grad).
    pub const LOGPROBS: &str = "logprobs";
    /// Sampling-policy log-probs of a minibatch, `[b, R]` f32.
    pub const OLD_LOGPROBS: &str = "old_logprobs";
    /// Reference-model log-probs, `[B, R]` f32 (requirement [`REFERENCE`]).
    pub const REF_LOGPROBS: &str = "ref_logprobs";
    /// Critic values of the state before each response token, `[B, R]` f32 (requirement
    /// [`CRITIC`]; in a minibatch the current values, with grad).
    pub const VALUES: &str = "values";
    /// Critic values at rollout time in a minibatch, `[b, R]` f32.
    pub const OLD_VALUES: &str = "old_values";
    /// 1.0 on response tokens (EOS included), 0.0 on padding, `[B, R]` f32.
    pub const ACTION_MASK: &str = "action_mask";
    /// Samples of the same prompt share an id, `[B]` i64.
    pub const GROUP_IDS: &str = "group_ids";
    /// [`crate::Prepared`] outputs, `[B, R]` f32.
    pub const ADVANTAGES: &str = "advantages";
    pub const RETURNS: &str = "returns";
    /// Current-policy entropy in a minibatch, `[b, R]` f32 with grad (requirement [`ENTROPY`]).
    pub const ENTROPY: &str = "entropy";
    /// Scalar: optimizer steps done so far.
    pub const STEP: &str = "step";
    /// Scalar (4.1): the PPO epoch (0-based) this minibatch belongs to.
    pub const EPOCH: &str = "epoch";
    /// Scalar (4.1): micro-batches whose gradients the host accumulates into this optimizer step
    /// over all ranks (`train.gradient_accumulation_steps` minibatches, each split by
    /// `train.micro_batch_tokens`); the host divides each micro-batch's loss by it.
    pub const ACCUMULATION_STEPS: &str = "accumulation_steps";
    /// Scalar (4.1): valid response tokens in all the minibatches of this optimizer step, the
    /// normaliser of a token mean over the whole accumulated batch (TRL's `num_items_in_batch`).
    pub const STEP_TOKENS: &str = "step_tokens";
    /// Scalar (4.4): samples in all the minibatches of this optimizer step, the normaliser of a
    /// per-sample mean over the whole accumulated batch (verl's `global_batch_size`): the host's
    /// micro-batches need not hold as many samples each (`train.micro_batch_tokens`).
    pub const STEP_ROWS: &str = "step_rows";
    /// The rollout engine's log-probs of the sampled tokens, `[B, R]` (`[b, R]` in a minibatch)
    /// f32 (4.2; only when an external engine such as vLLM generated the batch).
    pub const BEHAVIOR_LOGPROBS: &str = "behavior_logprobs";

    /// Requirement: reference-model log-probs.
    pub const REFERENCE: &str = "reference";
    /// Requirement: a critic, its values and a value optimizer.
    pub const CRITIC: &str = "critic";
    /// Requirement: per-token entropy of the current policy in each minibatch.
    pub const ENTROPY_REQ: &str = "entropy";
    /// Every requirement this host can satisfy.
    pub const KNOWN_REQUIREMENTS: &[&str] = &[REFERENCE, CRITIC, ENTROPY_REQ];
}

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
    /// [`API_MAJOR`] and [`API_MINOR`] of the plugin-api the plugin was compiled with.
    pub api_major: u32,
    pub api_minor: u32,
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
    /// A JSON object: `device` (`cpu`, `cuda:0`, ...), `seed`, `samples_per_prompt` (GRPO's G);
    /// later minors append keys (see [`crate::Context`]).
    pub context_json: RString,
}

/// A named scalar for the metrics stream.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct Metric {
    pub name: RString,
    pub value: f64,
}

/// A named tensor input (names in [`keys`]).
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct NamedTensorAbi<'a> {
    pub name: RStr<'a>,
    pub tensor: TensorRef<'a>,
}

/// A named scalar input (names in [`keys`]); integers are exact up to 2^53.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct NamedScalarAbi<'a> {
    pub name: RStr<'a>,
    pub value: f64,
}

/// The inputs of [`AlgorithmObj::prepare`] (one generation batch) and [`AlgorithmObj::loss`] (one
/// minibatch) as a keyed map, so later minors can add inputs without breaking older plugins.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct InputsAbi<'a> {
    pub tensors: RSlice<'a, NamedTensorAbi<'a>>,
    pub scalars: RSlice<'a, NamedScalarAbi<'a>>,
}

/// An owned, named tensor output.
#[repr(C)]
#[derive(StableAbi)]
pub struct NamedTensorBoxAbi {
    pub name: RString,
    pub tensor: TensorBox,
}

/// What [`AlgorithmObj::prepare`] returns: per-token training targets kept by the host and sliced
/// into minibatches ([`keys::ADVANTAGES`], optionally [`keys::RETURNS`]).
#[repr(C)]
#[derive(StableAbi)]
pub struct PreparedAbi {
    pub tensors: RVec<NamedTensorBoxAbi>,
    pub metrics: RVec<Metric>,
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
    /// What the host must compute: names of [`keys::KNOWN_REQUIREMENTS`].
    fn requirements(&self) -> RVec<RString>;

    /// Reward shaping and advantages for a whole generation batch.
    fn prepare(&mut self, exp: InputsAbi<'_>) -> RResult<PreparedAbi, PluginError>;

    /// The loss of one minibatch.
    fn loss(&mut self, mb: InputsAbi<'_>) -> RResult<LossAbi, PluginError>;

    /// State that must survive a checkpoint (e.g. an adaptive KL coefficient), as JSON.
    fn state(&self) -> RResult<RString, PluginError>;

    /// Restores [`AlgorithmObj::state`] on resume.
    #[sabi(last_prefix_field)]
    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError>;

    /// The plugin's config with every default filled in, as JSON (`null`: not reported). 4.1:
    /// a 4.0 plugin's object has no such method, and the host gets this default.
    fn resolved_config(&self) -> RString {
        RString::from("null")
    }

    /// The plugin's config keys as a JSON array of `{"key", "help", "peers": {"TRL": name, ...}}`
    /// (`null`: not described), which `rlhf plugins --describe` prints beside each key's default
    /// from [`AlgorithmObj::resolved_config`]. 4.3: older plugins get this default.
    fn describe_keys(&self) -> RString {
        RString::from("null")
    }
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
    fn score(&mut self, samples: RVec<SampleAbi>) -> RResult<ScoresAbi, PluginError>;

    /// State that must survive a checkpoint (e.g. running reward statistics), as JSON.
    fn state(&self) -> RResult<RString, PluginError>;

    /// Restores [`RewardObj::state`] on resume.
    #[sabi(last_prefix_field)]
    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError>;
}

/// Owned reward object.
pub type RewardBox = RewardObj_TO<'static, RBox<()>>;

/// Major version of the environment interface ([`EnvPluginMod`]), versioned apart from the
/// algorithm/reward one: an environment plugin exports its own root module, so the third kind
/// did not change [`PluginKind`] (an exhaustive enum whose growth would refuse every older
/// algorithm and reward plugin).
pub const ENV_API_MAJOR: u32 = 1;
/// Minor version of the environment interface; grows as [`API_MINOR`] does (see the module docs).
///
/// - 1.0: batched `reset` / `step`, optional `stop_strings`.
/// - 1.1: the optional [`EnvObj::take_images`] (images in observations).
pub const ENV_API_MINOR: u32 = 1;

/// What an environment plugin declares about itself; read before anything else is called.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct EnvInfo {
    /// The name users address it by (`[environment] plugin = "env-calculator"`).
    pub name: RString,
    pub version: RString,
    pub description: RString,
    /// [`ENV_API_MAJOR`] and [`ENV_API_MINOR`] the plugin was compiled with.
    pub api_major: u32,
    pub api_minor: u32,
    pub torch_version: RString,
    pub tch_version: RString,
}

/// One episode (trajectory) starting: the prompt row it continues.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct EpisodeAbi {
    /// The episode's id within this batch (its row); `step` actions carry it.
    pub id: u64,
    /// The prompt as the model saw it (chat template applied).
    pub prompt: RString,
    pub prompt_ids: RVec<u32>,
    pub label: ROption<RString>,
    /// The dataset line's other fields as a JSON object.
    pub metadata_json: RString,
    /// The untemplated prompt messages, a JSON array of `{"role", "content"}`.
    pub messages_json: RString,
}

/// One turn of the policy in one episode.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct ActionAbi {
    pub id: u64,
    /// 0-based turn of the episode.
    pub turn: u32,
    /// The sampled text of this turn, special tokens (EOS) removed.
    pub text: RString,
    /// The sampled token ids of this turn, EOS included when sampled.
    pub token_ids: RVec<u32>,
    /// The episode's last turn (the policy sampled EOS, or a turn or token limit is reached):
    /// whatever `step` answers, the episode is over.
    pub ended: bool,
}

/// The environment's answer to one action.
#[repr(C)]
#[derive(StableAbi, Debug, Clone)]
pub struct StepAbi {
    /// Text appended after the action (tokenized by the host); ignored when `done`.
    pub observation: RString,
    /// Reward of this turn; an episode's environment reward is the sum over its turns.
    pub reward: f64,
    pub done: bool,
    /// Per-episode numbers, summed over the episode's turns and averaged over episodes as
    /// `env/<name>/mean` (e.g. `tool_calls`).
    pub metrics: RVec<Metric>,
    /// Non-empty: this episode failed (a tool server down, say): it ends and costs the configured
    /// penalty, and counts in `env/errors`.
    pub error: RString,
}

/// An image of an observation: its encoded bytes (PNG, JPEG, WebP, …), or — with `bytes` empty —
/// the path of an image file the host can read.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Default, PartialEq)]
pub struct ImageAbi {
    pub bytes: RVec<u8>,
    pub path: RString,
}

/// An environment instance.
#[sabi_trait]
pub trait EnvObj: Send {
    /// Starts a batch of episodes (ids are rows of the whole batch, so each batch reuses the last
    /// batch's ids: a reset ends the earlier episodes); returns one first
    /// observation per episode, appended to its prompt (may be empty).
    fn reset(&mut self, episodes: RVec<EpisodeAbi>) -> RResult<RVec<RString>, PluginError>;

    /// Answers one action per listed episode, in order.
    fn step(&mut self, actions: RVec<ActionAbi>) -> RResult<RVec<StepAbi>, PluginError>;

    /// State that must survive a checkpoint, as JSON.
    fn state(&self) -> RResult<RString, PluginError>;

    /// Restores [`EnvObj::state`] on resume.
    #[sabi(last_prefix_field)]
    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError>;

    /// Strings that end a turn of the policy (e.g. the end of a tool call), added to the
    /// configured `environment.stop`.
    fn stop_strings(&self) -> RVec<RString> {
        RVec::new()
    }

    /// The images of the observations the last `reset` or `step` returned, one list per episode
    /// (or action) in order — each observation's `<image>` markers take its images in order;
    /// empty when no observation has any. The host calls it once after each `reset` and `step`.
    fn take_images(&mut self) -> RVec<RVec<ImageAbi>> {
        RVec::new()
    }
}

/// Owned environment object.
pub type EnvBox = EnvObj_TO<'static, RBox<()>>;

/// The root module an environment plugin exports (instead of [`PluginMod`]).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = EnvPluginModRef)))]
#[sabi(missing_field(panic))]
pub struct EnvPluginMod {
    pub info: extern "C" fn() -> EnvInfo,
    /// Builds an environment from its config section (JSON text).
    #[sabi(last_prefix_field)]
    pub new_environment: extern "C" fn(config: RStr<'_>, ctx: HostContext) -> RResult<EnvBox, PluginError>,
}

impl RootModule for EnvPluginModRef {
    declare_root_module_statics! {EnvPluginModRef}
    const BASE_NAME: &'static str = "rlhf_env_plugin";
    const NAME: &'static str = "rlhf_env_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

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
