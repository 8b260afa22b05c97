//! The RL host. The data flow of a step reads as the module list:
//! [`data`] (prompts) → rollout and scoring, experience and optimisation in [`trainer`] →
//! [`metrics`]; [`plugins`] loads the algorithm and reward plugins, [`optim`] holds AdamW and the
//! schedules, [`config`] the layered configuration, [`builtin`] the embedded default task and model.

pub mod builtin;
pub mod config;
pub mod data;
pub mod error;
pub mod metrics;
pub mod optim;
pub mod plugins;
pub mod trainer;

pub use config::{ConfigSource, RlConfig};
pub use error::{Result, TrainerError};
pub use plugins::PluginRegistry;
pub use trainer::{RunSummary, Trainer};
