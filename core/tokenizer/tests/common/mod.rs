//! Helpers shared by the integration tests: a tiny hand-written WordLevel `tokenizer.json`
//! and model directories built from it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// Special (added) tokens of the tiny tokenizer, with their ids.
pub const SPECIAL: &[(&str, u32)] = &[
    ("<unk>", 0),
    ("<s>", 1),
    ("</s>", 2),
    ("<pad>", 3),
    ("<|im_start|>", 4),
    ("<|im_end|>", 5),
    ("<|begin_of_text|>", 6),
    ("<|eot_id|>", 7),
];

/// Ordinary words of the tiny tokenizer, ids following the special tokens.
pub const WORDS: &[&str] = &["hello", "world", ".", "do", "n't", "user", "assistant", "system", "!", "?"];

/// The id of a word or special token of the tiny tokenizer.
pub fn id(token: &str) -> u32 {
    if let Some((_, id)) = SPECIAL.iter().find(|(t, _)| *t == token) {
        return *id;
    }
    let pos = WORDS.iter().position(|w| *w == token).expect("word in tiny vocab");
    (SPECIAL.len() + pos) as u32
}

/// A WordLevel tokenizer splitting on whitespace, whose post-processor prepends `<s>`;
/// `with_padding` stores a padding configuration (which loading must switch off).
pub fn tokenizer_json(with_padding: bool) -> Value {
    let mut vocab = serde_json::Map::new();
    for (tok, id) in SPECIAL {
        vocab.insert((*tok).to_owned(), json!(id));
    }
    for (i, w) in WORDS.iter().enumerate() {
        vocab.insert((*w).to_owned(), json!(SPECIAL.len() + i));
    }
    let added: Vec<Value> = SPECIAL
        .iter()
        .map(|(tok, id)| {
            json!({"id": id, "content": tok, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let padding = if with_padding {
        json!({"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": null,
               "pad_id": 3, "pad_type_id": 0, "pad_token": "<pad>"})
    } else {
        Value::Null
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": padding,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

/// Writes a JSON value to `dir/name`.
pub fn write_json(dir: &Path, name: &str, value: &Value) {
    std::fs::write(dir.join(name), serde_json::to_string_pretty(value).expect("serialise")).expect("write json");
}

/// A temporary model directory.
pub struct ModelDir {
    pub tmp: tempfile::TempDir,
}

impl ModelDir {
    /// A directory holding only the tiny `tokenizer.json`.
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_json(tmp.path(), "tokenizer.json", &tokenizer_json(false));
        Self { tmp }
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// A path inside the directory.
    pub fn file(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// Writes `tokenizer_config.json`.
    pub fn tokenizer_config(self, value: Value) -> Self {
        write_json(self.path(), "tokenizer_config.json", &value);
        self
    }

    /// Writes `generation_config.json`.
    pub fn generation_config(self, value: Value) -> Self {
        write_json(self.path(), "generation_config.json", &value);
        self
    }

    /// Writes `config.json`.
    pub fn config(self, value: Value) -> Self {
        write_json(self.path(), "config.json", &value);
        self
    }

    /// Writes any file.
    pub fn raw(self, name: &str, text: &str) -> Self {
        std::fs::write(self.file(name), text).expect("write file");
        self
    }
}

/// A character-level BPE tokenizer (no merges) over `a`, `.` and `</s>`, splitting on
/// whitespace, without a decoder (tokens are joined with spaces).
pub fn bpe_tokenizer_json() -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 3, "content": "</s>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": {"<unk>": 0, "a": 1, ".": 2, "</s>": 3}, "merges": []}
    })
}
