//! `[data]` of `rlhf train`: the prompts and how they are read.

use serde::{Deserialize, Serialize};

/// Prompt data.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// JSONL with `prompt` or chat `messages`, optional `label`; Parquet (a file, a directory of
    /// `*.parquet` or a `*` glob) with those columns; or `builtin:addition`.
    pub prompts: String,
    /// Prompts longer than this many tokens are truncated from the left (with a warning).
    pub max_prompt_len: usize,
    /// Render prompts through the tokenizer's chat template when it has one.
    pub apply_chat_template: bool,
    /// Extra variables for the chat template, as transformers' `apply_chat_template(**kwargs)`
    /// (Qwen3's `enable_thinking = false`, say).
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Shuffle prompts every pass over the data.
    pub shuffle: bool,
    /// The columns (JSONL fields) holding the prompt, the chat messages and the label; a dotted
    /// name is a path into nested objects (verl's `reward_model.ground_truth`). A renamed label
    /// column also stays in the line's metadata under its own name.
    pub prompt_key: String,
    pub messages_key: String,
    pub label_key: String,
}

impl DataConfig {
    /// The column mapping of `prompt_key`, `messages_key`, `label_key`.
    pub fn columns(&self) -> crate::tabular::Columns {
        crate::tabular::Columns::new(&[
            ("prompt", "prompt_key", &self.prompt_key),
            ("messages", "messages_key", &self.messages_key),
            ("label", "label_key", &self.label_key),
        ])
        .requiring(&[&["prompt"], &["messages"]])
        .keeping(&["label"])
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            prompts: "builtin:addition".into(),
            max_prompt_len: 256,
            apply_chat_template: true,
            chat_template_kwargs: serde_json::Map::new(),
            shuffle: true,
            prompt_key: "prompt".into(),
            messages_key: "messages".into(),
            label_key: "label".into(),
        }
    }
}
