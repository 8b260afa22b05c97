//! The one error type of the model crate. Every message is one line that names the file and the
//! key or tensor involved, so a user can fix a checkpoint without reading a backtrace.

use std::path::PathBuf;

/// Errors from loading, running or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A required file of the checkpoint directory is absent.
    #[error("{path}: not found")]
    MissingFile { path: PathBuf },

    /// A file exists but could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    /// A JSON file does not parse, or a key has the wrong type.
    #[error("{path}: {message}")]
    Json { path: PathBuf, message: String },

    /// A config value is present but not supported or out of range.
    #[error("{path}: {key}: {message}")]
    Config { path: PathBuf, key: String, message: String },

    /// A safetensors file is malformed.
    #[error("{path}: invalid safetensors: {message}")]
    Safetensors { path: PathBuf, message: String },

    /// The checkpoint lacks a tensor the architecture needs.
    #[error("{files}: missing tensor `{name}`")]
    MissingTensor { name: String, files: String },

    /// A tensor exists with the wrong shape.
    #[error("{path}: tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch { path: PathBuf, name: String, expected: Vec<i64>, actual: Vec<i64> },

    /// A tensor is stored in a dtype we cannot load.
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDtype { path: PathBuf, name: String, dtype: String },

    /// A device string such as `cuda:3` is malformed or the device is unavailable.
    #[error("device `{device}`: {message}")]
    Device { device: String, message: String },

    /// Inputs to a tensor function have inconsistent shapes or values.
    #[error("invalid input: {0}")]
    Input(String),

    /// The gate of a model's sharded parameters failed (a collective, as the trainer words it).
    #[error("{0}")]
    Gate(String),

    /// An error raised inside libtorch.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Result alias for this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile { path }
        } else {
            ModelError::Io { path, source }
        }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, key: &str, message: impl Into<String>) -> Self {
        ModelError::Config { path: path.into(), key: key.to_string(), message: message.into() }
    }
}
