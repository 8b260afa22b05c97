//! The RL host. The data flow of a step reads as the module list:
//! [`data`] (prompts) → rollout and scoring, experience and optimisation in [`trainer`] →
//! [`metrics`]; [`plugins`] loads the algorithm and reward plugins, [`optim`] holds AdamW and the
//! schedules, [`config`] the layered configuration, [`builtin`] the embedded default task and model.
//!
//! The supervised phases before RL: [`sft`] (DeepSpeed-Chat phase 1, examples in [`sft_data`]) and
//! [`rm`] (phase 2, preference pairs and losses in [`pairs`]), sharing the loop of [`phase`].

pub mod builtin;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod metrics;
pub mod optim;
pub mod pairs;
pub mod phase;
pub mod plugin_log;
pub mod plugins;
pub mod progress;
pub mod rm;
pub mod sft;
pub mod sft_data;
pub mod trainer;

pub use config::{ConfigSource, RlConfig};
pub use error::{Result, TrainerError};
pub use plugins::PluginRegistry;
pub use trainer::{RunSummary, Trainer};
