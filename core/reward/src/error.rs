//! The crate's one error type.

use std::path::PathBuf;

/// Errors from loading a reward model or scoring texts with it.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The model directory does not exist.
    #[error("{}: model directory not found", dir.display())]
    NoModelDir { dir: PathBuf },
    /// A scorer setting is out of range (`batch_size`, `max_len`).
    #[error("{key}: {message}")]
    Setting { key: &'static str, message: String },
    /// Text `index` of a batch encodes to no token at all, so it has no score.
    #[error("text {index} has no tokens (an empty text without special tokens)")]
    EmptyText { index: usize },
    /// A model named by Hub id cannot be had.
    #[error(transparent)]
    Hub(#[from] rlhf_hub::HubError),
    #[error(transparent)]
    Model(#[from] rlhf_models::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] rlhf_tokenizer::TokenizerError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Result alias for this crate.
pub type Result<T, E = RewardError> = std::result::Result<T, E>;
