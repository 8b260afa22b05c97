//! Gemma's SentencePiece vocabulary (`tokenizer.ggml.model = "llama"` in a `gemma3` file) as the
//! `tokenizers` BPE that transformers builds from the same file (`GemmaTokenizer`: byte fallback,
//! spaces written `▁` by the normalizer, no prefix space).
//!
//! The file lists tokens but no merges. As transformers does, tokens made only of two or more
//! spaces are respelled with `▁` (the file stores real spaces, the model looks them up as `▁`),
//! and the merges are rebuilt from the vocabulary: every split of a token into two tokens of the
//! vocabulary is a merge, ranked by the position of the merged token in the file (Gemma's scores
//! do not follow its merge order, its token order does), then by the longer left and the longer
//! right piece.

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

    /// The merges (transformers' `generate_merges` with the token positions as scores): for each
    /// token in order, its splits into two tokens of the vocabulary (ordered by the pieces' ids),
    /// then all of them ranked by the merged token's position, the left piece's length and the
    /// right piece's length, each first-largest-wins with ties kept in order.
    pub(crate) fn merges(&self) -> Vec<(String, String)> {
        // (rank key, left, right): the key is (−id of the merged token, |left|, |right|).
        let mut merges: Vec<((i64, usize, usize), &str, &str)> = Vec::new();
        for token in &self.order {
            let score = -(self.ids[token] as i64);
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
        merges.sort_by_key(|m| std::cmp::Reverse(m.0));
        merges.into_iter().map(|(_, l, r)| (l.to_owned(), r.to_owned())).collect()
    }
}

/// `tokenizer.json`'s model, normalizer, pre-tokenizer and decoder for Gemma's vocabulary.
pub(crate) fn gemma_backend(vocab: &Vocab, unk: &str) -> [(&'static str, Value); 4] {
    let ids: serde_json::Map<String, Value> = vocab.order.iter().map(|t| (t.clone(), json!(vocab.ids[t]))).collect();
    let merges: Vec<Value> = vocab.merges().into_iter().map(|(l, r)| json!([l, r])).collect();
    [
        (
            "model",
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
            }),
        ),
        ("normalizer", json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"})),
        (
            "pre_tokenizer",
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
        ),
        (
            "decoder",
            json!({
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                ],
            }),
        ),
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
        let got = vocab.merges();
        let want = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")];
        assert_eq!(got, want.map(|(l, r)| (l.to_owned(), r.to_owned())));
    }
}
