//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model directory's tokenizer files or
/// using them.
///
/// Every message is a single line that starts with the file (or model directory) it is
/// about and names the JSON key where one is involved, for example
/// `/models/llama/tokenizer_config.json: eos_token: expected a string or {"content": ...}, got 42`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A required file does not exist.
    #[error("{}: not found", path.display())]
    NotFound {
        /// The missing file.
        path: PathBuf,
    },

    /// A file exists but could not be read (permissions, not UTF-8, a directory, ...).
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file is not valid JSON.
    #[error("{}: invalid JSON at line {line} column {column}: {message}", path.display())]
    InvalidJson {
        /// The file.
        path: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The parser's description of the problem.
        message: String,
    },

    /// `tokenizer.json` is valid JSON but not a tokenizer the `tokenizers` crate understands.
    #[error("{}: invalid tokenizer at line {line} column {column}: {message}", path.display())]
    InvalidTokenizer {
        /// The `tokenizer.json` file.
        path: PathBuf,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// The deserializer's description of the problem.
        message: String,
    },

    /// `tokenizer.json` is valid JSON but not a Hugging Face tokenizers file at all.
    #[error(
        "{}: not a tokenizer.json: {reason} (a Hugging Face tokenizers file has `model`, `added_tokens`, ...)",
        path.display()
    )]
    NotATokenizer {
        /// The `tokenizer.json` file.
        path: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },

    /// A JSON file's top level is not an object.
    #[error("{}: expected a JSON object at the top level, got {got}", path.display())]
    NotAnObject {
        /// The file.
        path: PathBuf,
        /// A short rendering of what was found.
        got: String,
    },

    /// A key holds a value of the wrong type.
    #[error("{}: {key}: expected {expected}, got {got}", path.display())]
    WrongType {
        /// The file.
        path: PathBuf,
        /// The key, with a `[i]` index or `.field` suffix for nested values.
        key: String,
        /// What the key should hold.
        expected: &'static str,
        /// A short rendering of what was found.
        got: String,
    },

    /// A special token named in `tokenizer_config.json` is not in `tokenizer.json`'s vocabulary.
    #[error("{}: {key}: token {token:?} is not in the vocabulary of {}", path.display(), vocab.display())]
    UnknownToken {
        /// The file naming the token (`tokenizer_config.json`).
        path: PathBuf,
        /// The key (`pad_token`, `eos_token`, ...).
        key: String,
        /// The token's text.
        token: String,
        /// The `tokenizer.json` that lacks it.
        vocab: PathBuf,
    },

    /// No pad token can be determined from any of the files.
    #[error(
        "{}: no pad token: tokenizer_config.json has no pad_token, generation_config.json and \
         config.json have no pad_token_id, and there is no eos token to fall back to",
        dir.display()
    )]
    NoPadToken {
        /// The model directory.
        dir: PathBuf,
    },

    /// The model has no chat template at all.
    #[error("{}: no chat_template (the model has no chat template; use a plain prompt)", path.display())]
    NoChatTemplate {
        /// The `tokenizer_config.json` path (whether or not it exists).
        path: PathBuf,
    },

    /// `chat_template` is a list of named templates but none is called `default`.
    #[error("{}: chat_template: no template named \"default\" (found {names:?})", path.display())]
    NoDefaultChatTemplate {
        /// The `tokenizer_config.json` path.
        path: PathBuf,
        /// The names that are there.
        names: Vec<String>,
    },

    /// `apply_chat_template` was given no messages (transformers refuses this too).
    #[error(
        "chat template of {}: cannot apply a chat template to an empty conversation (provide at least one message)",
        path.display()
    )]
    EmptyConversation {
        /// The file the template came from.
        path: PathBuf,
    },

    /// The chat template does not compile.
    #[error("chat template of {}: syntax error: {message}", path.display())]
    TemplateSyntax {
        /// The file the template came from (`tokenizer_config.json` or `chat_template.jinja`).
        path: PathBuf,
        /// The template engine's description, with the template line.
        message: String,
    },

    /// Rendering the chat template failed (including a `raise_exception(...)` call in it).
    #[error("chat template of {}: render error: {message}", path.display())]
    TemplateRender {
        /// The file the template came from (`tokenizer_config.json` or `chat_template.jinja`).
        path: PathBuf,
        /// The template engine's description, with the template line.
        message: String,
    },

    /// The tokenizer failed to encode text.
    #[error("{}: encode failed: {message}", path.display())]
    Encode {
        /// The `tokenizer.json` path.
        path: PathBuf,
        /// The tokenizer's description.
        message: String,
    },

    /// A token id of the tokenizer (or a special-token id of the configs) has no row in the
    /// model's embedding: the tokenizer does not belong to the model.
    #[error(
        "{}: {what} has id {id}, but the model's vocab_size (config.json) is {vocab_size}: \
         the file does not match the model",
        path.display()
    )]
    IdOutOfRange {
        /// The file the id comes from: `tokenizer.json`, or the config that names a special id.
        path: PathBuf,
        /// Which id: `token "<x>"`, `eos_token_id`, `pad_token_id` or `bos_token_id`.
        what: String,
        /// The id.
        id: u32,
        /// The model's embedding rows.
        vocab_size: i64,
    },

    /// The tokenizer failed to decode ids (for example an id outside the vocabulary).
    #[error("{}: decode failed: {message}", path.display())]
    Decode {
        /// The `tokenizer.json` path.
        path: PathBuf,
        /// The tokenizer's description.
        message: String,
    },
}

/// Collapses a message onto one line.
pub(crate) fn one_line(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for (i, line) in message.lines().map(str::trim).filter(|l| !l.is_empty()).enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        out.push_str(line);
    }
    out
}

/// A short, one-line rendering of a JSON value for error messages.
pub(crate) fn describe(value: &serde_json::Value) -> String {
    const MAX: usize = 80;
    let text = value.to_string();
    if text.chars().count() <= MAX {
        text
    } else {
        let cut: String = text.chars().take(MAX).collect();
        format!("{cut}...")
    }
}
