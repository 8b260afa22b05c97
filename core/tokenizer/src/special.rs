//! Special tokens from `tokenizer_config.json` and token ids from
//! `generation_config.json` / `config.json`.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{describe, TokenizerError};

/// The special-token keys of `tokenizer_config.json` that are read and handed to the chat
/// template (transformers passes its `special_tokens_map` the same way).
pub(crate) const TOKEN_KEYS: [&str; 7] =
    ["bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"];

/// Special tokens as text, from `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SpecialTokens {
    /// `(key, text)` for each key of [`TOKEN_KEYS`] that is set.
    pub(crate) tokens: Vec<(&'static str, String)>,
    /// Keys present with an explicit `null` ("this tokenizer has no such token").
    pub(crate) nulls: Vec<&'static str>,
}

impl SpecialTokens {
    /// Parses all [`TOKEN_KEYS`] of a `tokenizer_config.json` object.
    pub(crate) fn parse(path: &Path, config: &Map<String, Value>) -> Result<Self, TokenizerError> {
        let mut tokens = Vec::new();
        let mut nulls = Vec::new();
        for key in TOKEN_KEYS {
            match parse_token(path, key, config.get(key))? {
                Some(text) => tokens.push((key, text)),
                None if config.get(key).is_some_and(Value::is_null) => nulls.push(key),
                None => {}
            }
        }
        Ok(Self { tokens, nulls })
    }

    /// Whether `tokenizer_config.json` mentions the key at all (a token or `null`).
    pub(crate) fn mentions(&self, key: &str) -> bool {
        self.get(key).is_some() || self.is_null(key)
    }

    /// Whether the key is present with an explicit `null`.
    pub(crate) fn is_null(&self, key: &str) -> bool {
        self.nulls.contains(&key)
    }

    /// The text of one special token, if set.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.tokens.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
    }
}

/// Parses one special token: a string, `null`, or an AddedToken object `{"content": ...}`.
pub(crate) fn parse_token(path: &Path, key: &str, value: Option<&Value>) -> Result<Option<String>, TokenizerError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(obj)) if obj.contains_key("content") => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(TokenizerError::WrongType {
                path: path.to_path_buf(),
                key: format!("{key}.content"),
                expected: "a string",
                got: describe(other),
            }),
            None => Ok(None),
        },
        Some(other) => Err(TokenizerError::WrongType {
            path: path.to_path_buf(),
            key: key.to_owned(),
            expected: "a string or {\"content\": ...}",
            got: describe(other),
        }),
    }
}

/// Interprets a JSON number as a token id. `Ok(None)` for negative integers, which
/// some configs use (`-1`) to mean "unset".
fn id_from_number(value: &Value) -> Option<Option<u32>> {
    let Value::Number(n) = value else {
        return None;
    };
    if let Some(u) = n.as_u64() {
        return u32::try_from(u).ok().map(Some);
    }
    if n.as_i64().is_some() {
        // Negative integer: the conventional "no such token".
        return Some(None);
    }
    None
}

/// Parses a single token id (`pad_token_id`, `bos_token_id`): an integer or `null`.
/// Negative integers are treated as unset.
pub(crate) fn parse_id(path: &Path, config: &Map<String, Value>, key: &str) -> Result<Option<u32>, TokenizerError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => id_from_number(value).ok_or_else(|| TokenizerError::WrongType {
            path: path.to_path_buf(),
            key: key.to_owned(),
            expected: "an integer token id (0 to 4294967295) or null",
            got: describe(value),
        }),
    }
}

/// Parses `eos_token_id`: an integer, a list of integers, or `null`. Returns the ids in
/// order (empty when unset). A negative id is refused: unlike a pad id of `-1` ("none"), an end
/// of sequence that can never be generated would let every response run to its length limit.
pub(crate) fn parse_id_list(path: &Path, config: &Map<String, Value>, key: &str) -> Result<Vec<u32>, TokenizerError> {
    let negative = |key: String, item: &Value| TokenizerError::WrongType {
        path: path.to_path_buf(),
        key,
        expected: "a token id >= 0 (a negative end-of-sequence id can never be generated)",
        got: describe(item),
    };
    match config.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => {
            let mut ids = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match id_from_number(item) {
                    Some(Some(id)) => ids.push(id),
                    Some(None) => return Err(negative(format!("{key}[{i}]"), item)),
                    None => {
                        return Err(TokenizerError::WrongType {
                            path: path.to_path_buf(),
                            key: format!("{key}[{i}]"),
                            expected: "an integer token id (0 to 4294967295)",
                            got: describe(item),
                        })
                    }
                }
            }
            Ok(ids)
        }
        Some(value) => match id_from_number(value) {
            Some(Some(id)) => Ok(vec![id]),
            Some(None) => Err(negative(key.to_owned(), value)),
            None => Err(TokenizerError::WrongType {
                path: path.to_path_buf(),
                key: key.to_owned(),
                expected: "an integer token id or a list of them",
                got: describe(value),
            }),
        },
    }
}

/// The id fields of `generation_config.json` or `config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct IdConfig {
    pub(crate) eos: Vec<u32>,
    pub(crate) pad: Option<u32>,
    pub(crate) bos: Option<u32>,
}

impl IdConfig {
    /// Reads `eos_token_id`, `pad_token_id` and `bos_token_id`.
    pub(crate) fn parse(path: &Path, config: &Map<String, Value>) -> Result<Self, TokenizerError> {
        Ok(Self {
            eos: parse_id_list(path, config, "eos_token_id")?,
            pad: parse_id(path, config, "pad_token_id")?,
            bos: parse_id(path, config, "bos_token_id")?,
        })
    }
}

/// Removes repeated ids, keeping the first occurrence of each.
pub(crate) fn dedup_keep_order(ids: Vec<u32>) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::with_capacity(ids.len());
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

/// Reads an optional boolean key.
pub(crate) fn parse_bool(path: &Path, config: &Map<String, Value>, key: &str) -> Result<Option<bool>, TokenizerError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(TokenizerError::WrongType {
            path: path.to_path_buf(),
            key: key.to_owned(),
            expected: "a boolean",
            got: describe(other),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn token_in_all_three_forms() {
        let p = Path::new("/m/tokenizer_config.json");
        let cfg = obj(json!({
            "bos_token": "<s>",
            "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false},
            "pad_token": null,
        }));
        let t = SpecialTokens::parse(p, &cfg).unwrap();
        assert_eq!(t.get("bos_token"), Some("<s>"));
        assert_eq!(t.get("eos_token"), Some("</s>"));
        assert_eq!(t.get("pad_token"), None);
        assert!(t.is_null("pad_token"));
        assert_eq!(t.get("unk_token"), None);
        assert!(!t.is_null("unk_token"));
    }

    #[test]
    fn token_wrong_types_name_key() {
        let p = Path::new("/m/tokenizer_config.json");
        let e = parse_token(p, "eos_token", Some(&json!(42))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "/m/tokenizer_config.json: eos_token: expected a string or {\"content\": ...}, got 42"
        );
        let e = parse_token(p, "bos_token", Some(&json!({"content": 7}))).unwrap_err();
        assert_eq!(e.to_string(), "/m/tokenizer_config.json: bos_token.content: expected a string, got 7");
        let e = parse_token(p, "unk_token", Some(&json!([1]))).unwrap_err();
        assert!(e.to_string().contains("unk_token: expected"), "{e}");
    }

    #[test]
    fn ids_int_list_null_negative() {
        let p = Path::new("/m/generation_config.json");
        let cfg = obj(json!({
            "eos_token_id": [5, 7, 5],
            "pad_token_id": -1,
            "bos_token_id": 1,
        }));
        let ids = IdConfig::parse(p, &cfg).unwrap();
        assert_eq!(ids.eos, vec![5, 7, 5]);
        assert_eq!(dedup_keep_order(ids.eos), vec![5, 7]);
        assert_eq!(ids.pad, None);
        assert_eq!(ids.bos, Some(1));

        let cfg = obj(json!({"eos_token_id": 3, "pad_token_id": null}));
        let ids = IdConfig::parse(p, &cfg).unwrap();
        assert_eq!(ids.eos, vec![3]);
        assert_eq!(ids.pad, None);
        // A negative eos id (a list entry or the value) is refused, naming file and key.
        for (cfg, key) in
            [(json!({"eos_token_id": -1}), "eos_token_id"), (json!({"eos_token_id": [2, -1]}), "eos_token_id[1]")]
        {
            let e = IdConfig::parse(p, &obj(cfg)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("/m/generation_config.json: {key}: expected a token id >= 0")), "{e}");
        }
    }

    #[test]
    fn id_wrong_types_name_key() {
        let p = Path::new("/m/config.json");
        let e = IdConfig::parse(p, &obj(json!({"eos_token_id": "2"}))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "/m/config.json: eos_token_id: expected an integer token id or a list of them, got \"2\""
        );
        let e = IdConfig::parse(p, &obj(json!({"eos_token_id": [1, 2.5]}))).unwrap_err();
        assert!(e.to_string().contains("eos_token_id[1]: expected"), "{e}");
        let e = IdConfig::parse(p, &obj(json!({"pad_token_id": 1.0}))).unwrap_err();
        assert!(e.to_string().contains("pad_token_id: expected"), "{e}");
        let e = IdConfig::parse(p, &obj(json!({"bos_token_id": 4294967296u64}))).unwrap_err();
        assert!(e.to_string().contains("bos_token_id: expected"), "{e}");
    }
}
