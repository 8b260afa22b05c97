//! The plugin ABI of the rlhf trainer — the only crate a plugin author depends on (besides tch).
//!
//! A plugin is a `cdylib` that implements one of three plain Rust traits and exports it with a macro:
//! - [`Algorithm`]: reward shaping, advantages and losses (PPO, GRPO, ...), exported with
//!   [`export_algorithm!`];
//! - [`RewardSource`]: scores for (prompt, response) samples, exported with [`export_reward!`];
//! - [`Environment`]: multi-turn episodes (tools, games), exported with [`export_environment!`]
//!   (its own root module and interface version, [`abi::ENV_API_MAJOR`]).
//!
//! Under the hood ([`abi`]) everything that crosses the boundary is `abi_stable`: a prefix root
//! module checked for layout and version when loaded, `#[sabi_trait]` objects for instances,
//! tensors as opaque libtorch handles ([`tensor`]), errors as [`PluginError`] with config-key paths,
//! and a log bridge ([`log`]) so `tracing` events in a plugin reach the host. Every exported method
//! catches panics. See `docs/plugins.md` for a complete walk-through.

// `#[sabi_trait]` expands to impls inside consts, which this lint flags.
#[allow(non_local_definitions)]
pub mod abi;
pub mod algorithm;
pub mod environment;
pub mod error;
pub mod export;
pub mod log;
pub mod reward;
pub mod tensor;

pub use abi::{
    keys, Metric, PluginInfo, PluginKind, API_MAJOR, API_MINOR, ENV_API_MAJOR, ENV_API_MINOR, TCH_VERSION,
    TORCH_VERSION,
};
pub use algorithm::{Algorithm, Context, Experience, KeyDoc, LossOutput, Minibatch, Prepared, Requirements};
pub use environment::{Action, Environment, Episode, StepOutcome};
pub use error::{parse_config, ErrorKind, PluginError};
pub use reward::{ChatMessage, RewardSource, Sample, Scores};

#[doc(hidden)]
pub use abi_stable;
pub use tch;

/// Everything a plugin file usually imports.
pub mod prelude {
    pub use crate::{
        export_algorithm, export_environment, export_reward, parse_config, Action, Algorithm, Context, Environment,
        Episode, Experience, KeyDoc, LossOutput, Minibatch, PluginError, Prepared, Requirements, RewardSource, Sample,
        Scores, StepOutcome,
    };
    pub use tch::{Kind, Tensor};
}
