//! Reading the JSON files of a model directory with path-naming errors.

use std::io::ErrorKind;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{describe, TokenizerError};

/// Reads a text file; `Ok(None)` when it does not exist.
pub(crate) fn read_text_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(match text.strip_prefix('\u{feff}') {
            Some(rest) => rest.to_owned(),
            None => text,
        })),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Read { path: path.to_path_buf(), source }),
    }
}

/// Reads a text file that must exist.
pub(crate) fn read_text_required(path: &Path) -> Result<String, TokenizerError> {
    read_text_optional(path)?.ok_or_else(|| TokenizerError::NotFound { path: path.to_path_buf() })
}

/// Splits a `serde_json` error into (line, column, message without the position suffix).
pub(crate) fn split_json_error(e: &serde_json::Error) -> (usize, usize, String) {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full);
    (e.line(), e.column(), crate::error::one_line(message))
}

/// Parses JSON text, naming `path` in errors.
pub(crate) fn parse_json(path: &Path, text: &str) -> Result<Value, TokenizerError> {
    serde_json::from_str(text).map_err(|e| {
        let (line, column, message) = split_json_error(&e);
        TokenizerError::InvalidJson { path: path.to_path_buf(), line, column, message }
    })
}

/// Reads an optional JSON file whose top level must be an object.
pub(crate) fn read_json_object_optional(path: &Path) -> Result<Option<Map<String, Value>>, TokenizerError> {
    let Some(text) = read_text_optional(path)? else {
        return Ok(None);
    };
    match parse_json(path, &text)? {
        Value::Object(map) => Ok(Some(map)),
        other => Err(TokenizerError::NotAnObject { path: path.to_path_buf(), got: describe(&other) }),
    }
}
