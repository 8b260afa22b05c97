//! The trainer: the RL host ([`rl`]) and the supervised phases ([`supervised`]), over shared
//! pieces that depend on neither — [`config`] (every command's layered configuration), [`optim`]
//! (AdamW and schedules), [`checkpoint`], [`data`] (prompts), [`builtin`] (the embedded task and
//! model), [`plugins`] (loader and the plain-type seam to plugin instances), [`metrics`],
//! [`progress`], [`plugin_log`], [`run_lock`] (one process per run directory), [`tabular`] (Parquet
//! rows and the data column mapping), [`dist`] (data parallelism over c10d ranks),
//! [`train_engine`] (one trained model's optimizer under its ZeRO stage), [`router_aux`] (a
//! mixture of experts' load-balancing loss in the training loss) and [`shard_files`] (sharded
//! optimizer states in checkpoints).
//!
//! An RL step reads as the modules of [`rl`]: prompts → rollout → score → experience →
//! advantages → optimise (minibatch loss → optimizer step) → metrics/checkpoint.

pub mod adamw;
pub mod arrow_dir;
pub mod builtin;
pub mod builtin_calc;
pub mod builtin_models;
pub mod builtin_shapes;
pub mod builtin_tokenizer;
pub mod builtin_vl;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod dist;
pub mod error;
pub mod metrics;
pub mod model_source;
pub mod optim;
pub mod plugin_log;
pub mod plugins;
pub mod progress;
pub mod prompt_images;
pub mod random_qwen2;
pub mod ranked_checkpoint;
pub mod rl;
pub mod router_aux;
pub mod run_lock;
pub mod shard_files;
pub mod signals;
pub mod sinks;
pub mod supervised;
pub mod tabular;
pub mod tensorboard;
pub mod train_engine;

pub use config::{ConfigSource, RlConfig};
pub use error::{Result, TrainerError};
pub use plugins::PluginRegistry;
pub use rl::{RunSummary, Trainer};
pub use supervised::{dpo, pairs, phase, rm, sft, sft_data};
