//! The built-in models' tokenizer files: a whitespace-split, word-level `tokenizer.json` and the
//! `tokenizer_config.json` / `generation_config.json` beside it.

use std::path::Path;

use serde_json::json;

use crate::error::Result;

/// A whitespace-split, word-level `tokenizer.json`: `specials` (ids 0, 1, ..., marked special),
/// then `words`; unknown words map to `unk`.
pub(crate) fn word_level_tokenizer(
    specials: &[&str],
    words: impl IntoIterator<Item = String>,
    unk: &str,
) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    for (i, w) in specials.iter().map(|s| s.to_string()).chain(words).enumerate() {
        vocab.insert(w, json!(i));
    }
    let added: Vec<_> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": unk}
    })
}

/// `tokenizer_config.json` and `generation_config.json` of a built-in model (`<pad>` 0, `<eos>` 1,
/// `<unk>`, no BOS) whose inputs are at most `max_len` tokens.
pub(crate) fn write_tokenizer_files(dir: &Path, max_len: usize) -> Result<()> {
    let write = |name: &str, v: &serde_json::Value| rlhf_models::weights::write_json(&dir.join(name), v);
    write(
        "tokenizer_config.json",
        &json!({"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "bos_token": null,
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}),
    )?;
    write("generation_config.json", &json!({"eos_token_id": 1, "pad_token_id": 0}))?;
    Ok(())
}
