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

/// The tokenizer of `dir` with the configured chat template keyword arguments
/// (`data.chat_template_kwargs`).
pub fn tokenizer(
    dir: &std::path::Path,
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> Result<rlhf_tokenizer::HfTokenizer> {
    let mut tok = rlhf_tokenizer::HfTokenizer::from_dir(dir)?;
    tok.set_chat_template_kwargs(kwargs).map_err(|e| TrainerError::Config(format!("data.{e}")))?;
    Ok(tok)
}

/// A LoRA setting the model refused, named by its config key: `section` is `model.lora` or
/// `model.critic_lora` (the model's messages name `lora.<key>`).
pub fn lora_error(section: &str, e: rlhf_models::ModelError) -> TrainerError {
    match e {
        rlhf_models::ModelError::Input(m) => {
            TrainerError::Config(format!("{section}{}", m.strip_prefix("lora").unwrap_or(&format!(": {m}"))))
        }
        other => TrainerError::Config(format!("{section}: {other}")),
    }
}
