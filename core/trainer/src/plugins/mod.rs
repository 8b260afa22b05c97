//! Plugins: [`loader`] finds and checks the libraries, [`handles`] wraps instances behind the plain
//! plugin-api types (the one place where ABI values are built).

pub mod environment;
pub mod handles;
pub mod loader;
pub mod metric_names;

pub use environment::EnvHandle;
pub use handles::{AlgorithmHandle, RewardHandle};
pub use loader::{default_plugin_dirs, host_context, load_file, LoadedEnv, LoadedPlugin, PluginMeta, PluginRegistry};
