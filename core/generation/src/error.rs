//! Errors of generation and scoring.

/// Errors from generation, log-prob and perplexity computations.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    #[error(transparent)]
    Model(#[from] rlhf_models::ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// Inconsistent arguments, e.g. an empty batch or a top-p outside (0, 1].
    #[error("{0}")]
    Input(String),
    /// The model's logits held NaN or infinity (broken weights or config); the caller knows which
    /// model directory that was.
    #[error("the model produced non-finite logits (NaN or inf) by decode step {step}: its weights or config.json are broken")]
    NonFiniteLogits { step: i64 },
}

/// Result alias for this crate.
pub type Result<T, E = GenerationError> = std::result::Result<T, E>;
