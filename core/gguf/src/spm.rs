//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) as the `tokenizers` BPE that
//! transformers builds from the same file: Llama's (`LlamaTokenizer`: byte fallback, `▁` prepended
//! to the text and written for spaces by `Metaspace`, stripped again when decoding) and Gemma's
//! (`GemmaTokenizer`: byte fallback, spaces written `▁` by the normalizer, no prefix space).
//!
//! The files list tokens and scores but no merges; the merges are rebuilt from the vocabulary:
//! every split of a token into two tokens of the vocabulary is a merge, ranked by the merged
//! token's score, then by the longer left and the longer right piece (transformers'
//! `generate_merges`). Gemma's scores do not follow its merge order, its token order does, so
//! there the score is the position; and tokens made only of two or more spaces, stored with real
//! spaces, are respelled with `▁` as the model looks them up.

use std::collections::HashMap;

use serde_json::{json, Value};

/// The vocabulary as the model looks tokens up: each token's last id (a later duplicate
/// replaces an earlier one, as a Python dict built from the list does), and the tokens in order
/// of first appearance with that id.
pub(crate) struct Vocab {
    pub ids: HashMap<String, usize>,
    pub order: Vec<String>,
}

/// `tokens` with Gemma's whitespace tokens respelled (see the module docs).
pub(crate) fn respell(tokens: &[&str]) -> Vec<String> {
    tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.trim().is_empty() {
                "\u{2581}".repeat(t.chars().count())
            } else {
                (*t).to_owned()
            }
        })
        .collect()
}

impl Vocab {
    pub(crate) fn new(tokens: &[String]) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut order = Vec::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            if ids.insert(t.clone(), i).is_none() {
                order.push(t.clone());
            }
        }
        Vocab { ids, order }
    }

    /// The merges (transformers' `generate_merges`, `score` giving a token's score from its id):
    /// for each token in order, its splits into two tokens of the vocabulary (ordered by the
    /// pieces' ids), then all of them ranked by the merged token's score, the left piece's length
    /// and the right piece's length, each largest first, ties kept in order.
    pub(crate) fn merges(&self, score: impl Fn(usize) -> f64) -> Vec<(String, String)> {
        // (rank key, left, right): the key is (score of the merged token, |left|, |right|).
        let mut merges: Vec<((f64, usize, usize), &str, &str)> = Vec::new();
        for token in &self.order {
            let score = score(self.ids[token]);
            let mut local: Vec<(&str, &str)> = token
                .char_indices()
                .skip(1)
                .map(|(at, _)| token.split_at(at))
                .filter(|(l, r)| self.ids.contains_key(*l) && self.ids.contains_key(*r))
                .collect();
            local.sort_by_key(|(l, r)| (self.ids[*l], self.ids[*r]));
            merges.extend(local.into_iter().map(|(l, r)| ((score, l.chars().count(), r.chars().count()), l, r)));
        }
        // Descending and stable, as Python's `sorted(reverse=True)`.
        merges.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
        merges.into_iter().map(|(_, l, r)| (l.to_owned(), r.to_owned())).collect()
    }
}

/// The byte-fallback BPE model of a vocabulary.
fn bpe(vocab: &Vocab, merges: Vec<(String, String)>, unk: Option<&str>) -> Value {
    let ids: serde_json::Map<String, Value> = vocab.order.iter().map(|t| (t.clone(), json!(vocab.ids[t]))).collect();
    let merges: Vec<Value> = merges.into_iter().map(|(l, r)| json!([l, r])).collect();
    json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": unk,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": true,
        "byte_fallback": true,
        "ignore_merges": false,
        "vocab": ids,
        "merges": merges,
    })
}

/// `▁` back to spaces, byte tokens back to bytes.
fn decoders() -> Vec<Value> {
    vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ]
}

/// `tokenizer.json`'s model, normalizer, pre-tokenizer and decoder for a Llama-style vocabulary
/// (`scores` by token id). Phi-3's (`phi3`) writes the prefix and the spaces with a normalizer
/// instead of `Metaspace`, as transformers rebuilds it (it differs on text starting with a space).
pub(crate) fn llama_backend(vocab: &Vocab, scores: &[f32], phi3: bool) -> [(&'static str, Value); 4] {
    let merges = vocab.merges(|id| f64::from(scores[id]));
    let mut decoder = decoders();
    decoder.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    let (normalizer, pre_tokenizer) = if phi3 {
        let normalizer = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        ]});
        (normalizer, Value::Null)
    } else {
        let metaspace =
            json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false});
        (Value::Null, metaspace)
    };
    [
        ("model", bpe(vocab, merges, None)),
        ("normalizer", normalizer),
        ("pre_tokenizer", pre_tokenizer),
        ("decoder", json!({"type": "Sequence", "decoders": decoder})),
    ]
}

/// `tokenizer.json`'s model, normalizer, pre-tokenizer and decoder for Gemma's vocabulary.
/// `merges`: the file's (Gemma 4's BPE), or where it has none, rebuilt from the token order.
pub(crate) fn gemma_backend(
    vocab: &Vocab,
    merges: Option<Vec<(String, String)>>,
    unk: Option<&str>,
) -> [(&'static str, Value); 4] {
    let merges = merges.unwrap_or_else(|| vocab.merges(|id| -(id as f64)));
    [
        ("model", bpe(vocab, merges, unk)),
        ("normalizer", json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"})),
        (
            "pre_tokenizer",
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
        ),
        ("decoder", json!({"type": "Sequence", "decoders": decoders()})),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `generate_merges({t: i}, {t: -i})` on a small vocabulary, worked by hand.
    #[test]
    fn merges_follow_the_token_order_then_the_longer_left_piece() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "  "].iter().map(|s| s.to_string()).collect();
        let vocab = Vocab::new(&respell(&tokens.iter().map(String::as_str).collect::<Vec<_>>()));
        assert!(vocab.ids.contains_key("\u{2581}\u{2581}"));
        let got = vocab.merges(|id| -(id as f64));
        let want = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")];
        assert_eq!(got, want.map(|(l, r)| (l.to_owned(), r.to_owned())));
    }
}
