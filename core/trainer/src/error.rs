//! The trainer's error type. Messages are one line and name the file, config key or plugin.

use std::path::PathBuf;

/// Errors of the RL host.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// A checkpoint cannot be written, read or used (message names the directory).
    #[error("{0}")]
    Checkpoint(String),
    /// The merged configuration is invalid (message names source and key).
    #[error("{0}")]
    Config(String),
    /// A plugin file was refused or a plugin is missing.
    #[error("{0}")]
    Plugin(String),
    /// A plugin returned an error.
    #[error("plugin `{name}` ({path}): {message}")]
    PluginCall { name: String, path: PathBuf, message: String },
    /// A data file is unreadable or malformed.
    #[error("{path}: {message}")]
    Data { path: PathBuf, message: String },
    #[error(transparent)]
    Model(#[from] rlhf_models::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] rlhf_tokenizer::TokenizerError),
    #[error(transparent)]
    Generation(#[from] rlhf_generation::GenerationError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A collective failed or ranks disagree (message names the rank).
    #[error("{0}")]
    Distributed(String),
    /// SIGTERM or SIGINT stopped the run (the message says what was kept and how to continue).
    #[error(transparent)]
    Stopped(#[from] crate::signals::Stopped),
    /// Anything else that stops training, e.g. every sample dropped.
    #[error("{0}")]
    Run(String),
}

/// Result alias for this crate.
pub type Result<T, E = TrainerError> = std::result::Result<T, E>;

impl TrainerError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainerError::Io { path: path.into(), source }
    }
}
