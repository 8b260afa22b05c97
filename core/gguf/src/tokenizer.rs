//! `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.*` metadata.
//!
//! Byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`, used by GPT-2, SmolLM,
//! Llama 3, Qwen, ...) and SentencePiece vocabularies (`llama`: Llama 2 and Mistral in `llama`
//! files, Gemma's in `gemma3` files; [`crate::spm`]) are built. The byte-level tokens are already spelled in the byte-level alphabet and the
//! merges are given, so the BPE model is the file's data as it is. What the GGUF keeps only as a
//! name is the pre-tokenizer (`tokenizer.ggml.pre`): llama.cpp maps that name to its split regexes,
//! and [`pre_tokenizer`] maps it to the `tokenizers` pre-tokenizer that splits the same way.
//! Control tokens (`token_type` 3) become special added tokens and user-defined ones (4) plain
//! added tokens, so both are matched whole in text as llama.cpp does.

use std::collections::HashMap;

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

/// Qwen3.5's split: Qwen2's with combining marks (`\p{M}`) kept on the letters they follow, as
/// its `tokenizer.json` says.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's split (OpenAI's `o200k_base`; gpt-oss, Llama 4), as gpt-oss's `tokenizer.json` says:
/// words keep a leading non-letter and an uppercase run with their lowercase tail, contractions
/// stay on the word, digits in threes.
const O200K_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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
/// - `qwen2` (Qwen2, Qwen2.5, Qwen3, Qwen3-Next): the same with single digits;
/// - `qwen35` (Qwen3.5): Qwen2's, combining marks kept with their letters;
/// - `gpt-4o`, `llama4` (gpt-oss): GPT-4o's regex, then `ByteLevel` without its own.
pub fn pre_tokenizer(pre: &str, add_prefix_space: bool) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex});
    Some(match pre {
        "gpt-2" | "mpt" | "olmo" | "jais" => byte_level(true),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx" | "qwen2" | "qwen35" | "gpt-4o"
        | "llama4" => {
            let split = match pre {
                "qwen2" => QWEN2_SPLIT,
                "qwen35" => QWEN35_SPLIT,
                "gpt-4o" | "llama4" => O200K_SPLIT,
                _ => LLAMA3_SPLIT,
            };
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

/// The longest SentencePiece token accepted (real vocabularies stay under a few dozen characters).
const MAX_SPM_TOKEN_CHARS: usize = 1024;

const KNOWN_PRE: &str = "gpt-2, mpt, olmo, jais, smollm, starcoder, refact, command-r, codeshell, exaone, minerva, \
                         llama3, llama-v3, llama-bpe, smaug-bpe, falcon3, dbrx, qwen2, gpt-4o, llama4";

/// The model side of `tokenizer.json` for one kind of vocabulary.
struct Backend {
    /// `model`, `normalizer`, `pre_tokenizer`, `decoder`.
    parts: Vec<(&'static str, Value)>,
    /// The post-processor before BOS/EOS are added (`ByteLevel` for byte-level vocabularies).
    post: Option<Value>,
    /// A SentencePiece vocabulary's token ids (`None` for a byte-level one). Such a vocabulary adds
    /// BOS where the file does not say, makes the declared special tokens (BOS, EOS, UNK, PAD)
    /// special whatever their type (transformers' tokenizer classes add them), and adds a
    /// user-defined token only where its spelling is in the vocabulary, as transformers does.
    spm_vocab: Option<HashMap<String, usize>>,
    duplicate_tokens: usize,
    /// Token spellings transformers' tokenizer class adds as special tokens besides the file's
    /// control tokens (Gemma's `<mask>`).
    class_specials: &'static [&'static str],
}

/// A byte-level BPE (`gpt2`): the file's tokens and merges as they are, the pre-tokenizer of
/// `tokenizer.ggml.pre`.
fn byte_level(g: &GgufFile, tokens: &[&str]) -> Result<Backend> {
    let path = g.path();
    let merges = g
        .opt_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| GgufError::metadata(path, "tokenizer.ggml.merges", "missing (a BPE vocabulary needs them)"))?;
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
    let mut vocab = Map::new();
    let mut duplicate_tokens = 0;
    for (i, token) in tokens.iter().enumerate() {
        if vocab.contains_key(*token) {
            duplicate_tokens += 1;
        } else {
            vocab.insert((*token).to_owned(), json!(i));
        }
    }
    let merge_pairs: Vec<Value> = merge_pairs(g, &merges)?.into_iter().map(|(a, b)| json!([a, b])).collect();
    let model = json!({
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
    });
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    Ok(Backend {
        parts: vec![("model", model), ("normalizer", Value::Null), ("pre_tokenizer", pre), ("decoder", decoder)],
        post: Some(
            json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": false, "use_regex": true}),
        ),
        spm_vocab: None,
        duplicate_tokens,
        class_specials: &[],
    })
}

/// `tokenizer.ggml.merges`, each entry two tokens separated by one space.
fn merge_pairs(g: &GgufFile, merges: &[&str]) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, merge) in merges.iter().enumerate() {
        let mut parts = merge.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => pairs.push((a.to_owned(), b.to_owned())),
            _ => {
                return Err(GgufError::metadata(
                    g.path(),
                    "tokenizer.ggml.merges",
                    format!("entry {i} {merge:?} is not two tokens separated by one space"),
                ))
            }
        }
    }
    Ok(pairs)
}

/// Gemma's SentencePiece vocabulary (see [`crate::spm`]).
fn gemma(tokens: &[&str], unk: Option<u32>) -> Backend {
    let respelled = crate::spm::respell(tokens);
    let vocab = crate::spm::Vocab::new(&respelled);
    let unk = unk.map_or("<unk>", |i| tokens[i as usize]);
    let parts = crate::spm::gemma_backend(&vocab, None, Some(unk));
    sentencepiece(tokens.len(), vocab, parts, &["<mask>"])
}

/// Gemma 4's vocabulary (`tokenizer.ggml.model = "gemma4"`): a BPE over characters (not bytes)
/// with its merges stored, `▁` for spaces and `<0xXX>` byte tokens for what it cannot spell — the
/// `tokenizer.json` transformers' `GemmaTokenizer` builds, with the file's merges. (llama.cpp
/// also splits the text at newline runs before merging; the two agree unless a merge joins a
/// newline to another character.)
fn gemma4(g: &GgufFile, tokens: &[&str], unk: Option<u32>) -> Result<Backend> {
    let merges = g.opt_str_array("tokenizer.ggml.merges")?.ok_or_else(|| {
        GgufError::metadata(g.path(), "tokenizer.ggml.merges", "missing (a BPE vocabulary needs them)")
    })?;
    let merges = merge_pairs(g, &merges)?;
    let owned: Vec<String> = tokens.iter().map(|t| (*t).to_owned()).collect();
    let vocab = crate::spm::Vocab::new(&owned);
    let unk = unk.map(|i| tokens[i as usize]).or_else(|| vocab.ids.contains_key("<unk>").then_some("<unk>"));
    let parts = crate::spm::gemma_backend(&vocab, Some(merges), unk);
    Ok(sentencepiece(tokens.len(), vocab, parts, &["<mask>"]))
}

/// A SentencePiece vocabulary's [`Backend`]: BOS added by default, the declared special tokens
/// (and `class_specials`) special.
fn sentencepiece(
    n_tokens: usize,
    vocab: crate::spm::Vocab,
    parts: [(&'static str, Value); 4],
    class_specials: &'static [&'static str],
) -> Backend {
    Backend {
        parts: parts.into_iter().collect(),
        post: None,
        duplicate_tokens: n_tokens - vocab.order.len(),
        spm_vocab: Some(vocab.ids),
        class_specials,
    }
}

/// The added tokens (`tokenizer.json`'s list and `tokenizer_config.json`'s decoder map): control
/// tokens special, user-defined ones plain; a SentencePiece vocabulary's declared special tokens
/// special too (transformers' tokenizer classes add them), and so is any declared token when the
/// file gives no types.
fn added(
    tokens: &[&str],
    token_types: Option<&[i64]>,
    special: &SpecialIds,
    backend: &Backend,
) -> (Vec<Value>, Map<String, Value>) {
    let declared: Vec<u32> =
        [special.bos, special.eos, special.unk, special.pad, special.eot].into_iter().flatten().collect();
    let kind = |i: usize| -> Option<bool> {
        let named = declared.contains(&(i as u32)) || backend.class_specials.contains(&tokens[i]);
        match token_types {
            Some(types) => match types[i] {
                TOKEN_TYPE_CONTROL => Some(true),
                TOKEN_TYPE_USER_DEFINED => {
                    backend.spm_vocab.as_ref().is_none_or(|v| v.contains_key(tokens[i])).then_some(false)
                }
                _ if named && backend.spm_vocab.is_some() => Some(true),
                _ => None,
            },
            None => named.then_some(true),
        }
    };
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
    (added_tokens, added_tokens_decoder)
}

/// The post-processor: `base` (if any), then BOS / EOS around each sequence where added.
fn post_processor(tokens: &[&str], (bos, eos): (Option<u32>, Option<u32>), base: Option<&Value>) -> Value {
    if bos.is_none() && eos.is_none() {
        return base.cloned().unwrap_or(Value::Null);
    }
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
    let template = json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials});
    match base {
        Some(post) => json!({"type": "Sequence", "processors": [post, template]}),
        None => template,
    }
}

/// A Llama-style SentencePiece vocabulary (see [`crate::spm`]): the file's tokens, merges from
/// its scores.
fn llama_spm(g: &GgufFile, tokens: &[&str], phi3: bool) -> Result<Backend> {
    let path = g.path();
    let scores = g.opt_f32_array("tokenizer.ggml.scores")?.ok_or_else(|| {
        GgufError::metadata(path, "tokenizer.ggml.scores", "missing (a SentencePiece vocabulary needs them)")
    })?;
    if scores.len() != tokens.len() {
        return Err(GgufError::metadata(
            path,
            "tokenizer.ggml.scores",
            format!("has {} entries for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let owned: Vec<String> = tokens.iter().map(|t| (*t).to_owned()).collect();
    let vocab = crate::spm::Vocab::new(&owned);
    let parts = crate::spm::llama_backend(&vocab, &scores, phi3);
    Ok(sentencepiece(tokens.len(), vocab, parts, &[]))
}

/// Builds `tokenizer.json` and `tokenizer_config.json` from the metadata of a file of llama.cpp
/// architecture `architecture`: a byte-level BPE (`gpt2`), or a SentencePiece vocabulary (`llama`
/// in a `llama` file: Llama 2, Mistral; in a `gemma3` file: Gemma's).
pub fn build(g: &GgufFile, architecture: &str, model_max_length: Option<u64>) -> Result<TokenizerFiles> {
    let path = g.path();
    let model = g.opt_str("tokenizer.ggml.model")?.ok_or_else(|| {
        GgufError::metadata(path, "tokenizer.ggml.model", "missing: the file has no tokenizer to import")
    })?;
    let tokens = g
        .opt_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| GgufError::metadata(path, "tokenizer.ggml.tokens", "missing"))?;
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
    if model == "llama" {
        // Rebuilding the merges splits every token at every character: a token of n characters
        // costs n² — bounded, so that a hostile file cannot stall the import.
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| t.chars().count() > MAX_SPM_TOKEN_CHARS) {
            return Err(GgufError::metadata(
                path,
                "tokenizer.ggml.tokens",
                format!(
                    "token {i} has {} characters (a SentencePiece token has at most {MAX_SPM_TOKEN_CHARS})",
                    t.chars().count()
                ),
            ));
        }
    }
    let backend = match model {
        "gpt2" => byte_level(g, &tokens)?,
        "llama" if matches!(architecture, "gemma2" | "gemma3") => gemma(&tokens, special.unk),
        "gemma4" => gemma4(g, &tokens, special.unk)?,
        "llama" if matches!(architecture, "llama" | "phi3") => llama_spm(g, &tokens, architecture == "phi3")?,
        _ => {
            return Err(GgufError::unsupported(
                path,
                format!(
                    "tokenizer.ggml.model `{model}` is not supported for `{architecture}` (`gpt2`, byte-level BPE; \
                     `llama`, SentencePiece, for llama, phi3, gemma2 and gemma3; `gemma4`)"
                ),
            ))
        }
    };
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(backend.spm_vocab.is_some());
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let add_prefix_space = g.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(false);

    // Control tokens are special, user-defined ones plain added tokens; a SentencePiece
    // vocabulary's declared special tokens are special too (transformers' tokenizer classes add
    // them), and so is any token the file gives no types for.
    let (added_tokens, added_tokens_decoder) = added(&tokens, token_types.as_deref(), &special, &backend);
    let bos_eos = (add_bos.then_some(special.bos).flatten(), add_eos.then_some(special.eos).flatten());
    let post_processor = post_processor(&tokens, bos_eos, backend.post.as_ref());

    let mut tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "post_processor": post_processor,
    });
    if let Some(t) = tokenizer_json.as_object_mut() {
        t.extend(backend.parts.into_iter().map(|(k, v)| (k.to_owned(), v)));
    }
    let duplicate_tokens = backend.duplicate_tokens;

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
