//! `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.*` metadata.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`, used by GPT-2, SmolLM,
//! Llama 3, ...) are built. The tokens are already spelled in the byte-level alphabet and the
//! merges are given, so the BPE model is the file's data as it is. What the GGUF keeps only as a
//! name is the pre-tokenizer (`tokenizer.ggml.pre`): llama.cpp maps that name to its split regexes,
//! and [`pre_tokenizer`] maps it to the `tokenizers` pre-tokenizer that splits the same way.
//! Control tokens (`token_type` 3) become special added tokens and user-defined ones (4) plain
//! added tokens, so both are matched whole in text as llama.cpp does.

use serde_json::{json, Map, Value};

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;

/// `token_type` values of llama.cpp's vocabulary.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex (`tokenizer.ggml.pre` llama-bpe and friends).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (and Qwen3's) split: Llama 3's with single digits (`\p{N}`), as their `tokenizer.json` says.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special token ids a GGUF declares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// End of turn, when the file names one different from `eos`.
    pub eot: Option<u32>,
}

/// The two tokenizer files, ready to be written.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub special: SpecialIds,
    pub n_tokens: usize,
    /// Tokens spelled like an earlier one (kept only at their first id in the vocabulary).
    pub duplicate_tokens: usize,
}

/// `tokenizers`' pre-tokenizer for a llama.cpp pre-tokenizer name, or `None` when it is not one
/// this importer knows. The groups follow llama.cpp's `llama_vocab` regex table:
///
/// - `gpt-2`, `mpt`, `olmo`, `jais`: GPT-2's regex alone (`ByteLevel` with `use_regex`);
/// - `smollm`, `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva`: every digit
///   split off first (`\p{N}`), then GPT-2's regex — `Digits(individual_digits)` + `ByteLevel`,
///   which is also what these models' own `tokenizer.json` files say;
/// - `llama3`, `llama-v3`, `llama-bpe`, `smaug-bpe`, `falcon3`, `dbrx`: Llama 3's regex
///   (`Split` + `ByteLevel` without its own regex);
/// - `qwen2` (Qwen2, Qwen2.5, Qwen3): the same with single digits.
pub fn pre_tokenizer(pre: &str, add_prefix_space: bool) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex});
    Some(match pre {
        "gpt-2" | "mpt" | "olmo" | "jais" => byte_level(true),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx" | "qwen2" => {
            let split = if pre == "qwen2" { QWEN2_SPLIT } else { LLAMA3_SPLIT };
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
                    byte_level(false),
                ],
            })
        }
        _ => return None,
    })
}

/// Whether llama.cpp tokenizes this pre-tokenizer type with `ignore_merges` (a word that is
/// itself a token is not merged piece by piece), as the Llama 3 `tokenizer.json` also says.
fn ignore_merges(pre: &str) -> bool {
    matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx")
}

const KNOWN_PRE: &str = "gpt-2, mpt, olmo, jais, smollm, starcoder, refact, command-r, codeshell, exaone, minerva, \
                         llama3, llama-v3, llama-bpe, smaug-bpe, falcon3, dbrx, qwen2";

/// Builds `tokenizer.json` and `tokenizer_config.json` from the file's metadata.
pub fn build(g: &GgufFile, model_max_length: Option<u64>) -> Result<TokenizerFiles> {
    let path = g.path();
    let model = g.opt_str("tokenizer.ggml.model")?.ok_or_else(|| {
        GgufError::metadata(path, "tokenizer.ggml.model", "missing: the file has no tokenizer to import")
    })?;
    if model != "gpt2" {
        return Err(GgufError::unsupported(
            path,
            format!("tokenizer.ggml.model `{model}` is not supported (only `gpt2`, byte-level BPE)"),
        ));
    }
    let tokens = g
        .opt_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| GgufError::metadata(path, "tokenizer.ggml.tokens", "missing"))?;
    let merges = g
        .opt_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| GgufError::metadata(path, "tokenizer.ggml.merges", "missing (a BPE vocabulary needs them)"))?;
    let n = tokens.len();
    let token_types = g.opt_int_array("tokenizer.ggml.token_type")?;
    if let Some(types) = &token_types {
        if types.len() != n {
            return Err(GgufError::metadata(
                path,
                "tokenizer.ggml.token_type",
                format!("has {} entries for {n} tokens", types.len()),
            ));
        }
    }
    let pre_name = g.opt_str("tokenizer.ggml.pre")?.ok_or_else(|| {
        GgufError::metadata(
            path,
            "tokenizer.ggml.pre",
            "missing: without it the split regex is unknown (files converted before May 2024 lack it; re-convert with a newer llama.cpp)",
        )
    })?;
    let add_prefix_space = g.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(false);
    let pre = pre_tokenizer(pre_name, add_prefix_space).ok_or_else(|| {
        GgufError::unsupported(path, format!("tokenizer.ggml.pre `{pre_name}` is not supported (known: {KNOWN_PRE})"))
    })?;

    let id = |key: &str| -> Result<Option<u32>> {
        match g.opt_u64(key)? {
            None => Ok(None),
            Some(v) if (v as usize) < n => Ok(Some(v as u32)),
            Some(v) => Err(GgufError::metadata(path, key, format!("id {v} is outside the {n} tokens"))),
        }
    };
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let special = SpecialIds {
        bos: id("tokenizer.ggml.bos_token_id")?,
        eos,
        unk: id("tokenizer.ggml.unknown_token_id")?,
        pad: id("tokenizer.ggml.padding_token_id")?,
        eot: id("tokenizer.ggml.eot_token_id")?.filter(|&t| Some(t) != eos),
    };
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

    // Without token types, at least the declared special tokens must stay whole.
    let declared: Vec<u32> =
        [special.bos, special.eos, special.unk, special.pad, special.eot].into_iter().flatten().collect();
    let kind = |i: usize| -> Option<bool> {
        match &token_types {
            Some(types) => match types[i] {
                TOKEN_TYPE_CONTROL => Some(true),
                TOKEN_TYPE_USER_DEFINED => Some(false),
                _ => None,
            },
            None => declared.contains(&(i as u32)).then_some(true),
        }
    };

    let mut vocab = Map::new();
    let mut duplicate_tokens = 0;
    for (i, token) in tokens.iter().enumerate() {
        if vocab.contains_key(*token) {
            duplicate_tokens += 1;
        } else {
            vocab.insert((*token).to_owned(), json!(i));
        }
    }
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, merge) in merges.iter().enumerate() {
        let mut parts = merge.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => merge_pairs.push(json!([a, b])),
            _ => {
                return Err(GgufError::metadata(
                    path,
                    "tokenizer.ggml.merges",
                    format!("entry {i} {merge:?} is not two tokens separated by one space"),
                ))
            }
        }
    }

    let mut added_tokens = Vec::new();
    let mut added_tokens_decoder = Map::new();
    for (i, token) in tokens.iter().enumerate() {
        let Some(is_special) = kind(i) else { continue };
        added_tokens.push(json!({
            "id": i, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": is_special,
        }));
        added_tokens_decoder.insert(
            i.to_string(),
            json!({
                "content": token, "lstrip": false, "normalized": false, "rstrip": false,
                "single_word": false, "special": is_special,
            }),
        );
    }

    let byte_level_post =
        json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": false, "use_regex": true});
    let post_processor = match (add_bos.then_some(special.bos).flatten(), add_eos.then_some(special.eos).flatten()) {
        (None, None) => byte_level_post,
        (bos, eos) => {
            let piece = |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": 0}});
            let wrap = |name: &str, type_id: u32| -> Vec<Value> {
                let mut out: Vec<Value> = bos.map(piece).into_iter().collect();
                out.push(json!({"Sequence": {"id": name, "type_id": type_id}}));
                out.extend(eos.map(piece));
                out
            };
            let single = wrap("A", 0);
            let mut pair = wrap("A", 0);
            pair.extend(wrap("B", 1));
            let specials: Map<String, Value> = [bos, eos]
                .into_iter()
                .flatten()
                .map(|id| {
                    let t = tokens[id as usize];
                    (t.to_owned(), json!({"id": t, "ids": [id], "tokens": [t]}))
                })
                .collect();
            json!({
                "type": "Sequence",
                "processors": [
                    byte_level_post,
                    {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials},
                ],
            })
        }
    };

    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges(pre_name),
            "vocab": vocab,
            "merges": merge_pairs,
        },
    });

    let text = |id: Option<u32>| id.map(|i| Value::String(tokens[i as usize].to_owned()));
    let mut config = Map::new();
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    config.insert("add_prefix_space".into(), json!(add_prefix_space));
    config.insert("added_tokens_decoder".into(), Value::Object(added_tokens_decoder));
    for (key, id) in
        [("bos_token", special.bos), ("eos_token", special.eos), ("pad_token", special.pad), ("unk_token", special.unk)]
    {
        if let Some(t) = text(id) {
            config.insert(key.into(), t);
        }
    }
    if let Some(template) = g.opt_str("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(template));
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    if let Some(len) = model_max_length {
        config.insert("model_max_length".into(), json!(len));
    }
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));

    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: Value::Object(config),
        special,
        n_tokens: n,
        duplicate_tokens,
    })
}
