//! Where a configured model comes from: a directory, or a Hugging Face Hub id (`org/name` or
//! `org/name@revision`) resolved through the Hugging Face cache and downloaded when missing
//! ([`rlhf_hub`]). `builtin:` models are written by their callers. Each id is resolved once per
//! process, so validating a config early (before anything is created) and loading later cost
//! one lookup.

use std::path::PathBuf;

use crate::error::{Result, TrainerError};

/// The directory of the model `spec` names for config key `key` (named in errors).
pub fn resolve(spec: &str, key: &str) -> Result<PathBuf> {
    rlhf_hub::resolve_model(spec).map_err(|e| TrainerError::Config(format!("{key}: {e}")))
}
