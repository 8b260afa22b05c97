//! Typed access to metadata keys, with errors that name the file and the key.

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;
use crate::types::Value;

impl GgufFile {
    fn typed<'a, T>(&'a self, key: &str, expected: &str, f: impl Fn(&'a Value) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v)
                .map(Some)
                .ok_or_else(|| GgufError::metadata(self.path(), key, format!("expected {expected}, got {}", brief(v)))),
        }
    }

    /// A non-negative integer, if the key is present.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    /// A non-negative integer that must be present.
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?.ok_or_else(|| GgufError::metadata(self.path(), key, "missing"))
    }

    /// A number, if the key is present.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", Value::as_f64)
    }

    /// A bool, if the key is present.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// A string, if the key is present.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", Value::as_str)
    }

    /// An array of strings, if the key is present.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.typed(key, "an array of strings", |v| v.as_array()?.iter().map(Value::as_str).collect())
    }

    /// An array of numbers as `f32` (SentencePiece scores), if the key is present.
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let number = |x: &Value| match *x {
            Value::F32(v) => Some(v),
            ref other => other.as_f64().map(|f| f as f32),
        };
        self.typed(key, "an array of numbers", |v| v.as_array()?.iter().map(number).collect())
    }

    /// An array of integers, if the key is present.
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.typed(key, "an array of integers", |v| {
            v.as_array()?.iter().map(|x| x.as_i128().and_then(|i| i64::try_from(i).ok())).collect()
        })
    }
}

/// A short description of a value for messages (arrays by type and length only).
fn brief(v: &Value) -> String {
    match v {
        Value::Array(t, items) => format!("an array of {} {t}", items.len()),
        Value::String(s) if s.len() > 40 => format!("a string of {} bytes", s.len()),
        other => format!("{other:?}"),
    }
}
