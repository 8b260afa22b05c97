//! The text side of a Hugging Face model directory.
//!
//! [`HfTokenizer::from_dir`] loads
//!
//! * `tokenizer.json` (required) through the `tokenizers` crate,
//! * `tokenizer_config.json` (optional): the special tokens `bos_token`, `eos_token`,
//!   `pad_token`, `unk_token` (each a string, `null`, or an AddedToken object
//!   `{"content": ...}`), the `chat_template` (a string, or a list of
//!   `{"name", "template"}` of which `default` is used) and `clean_up_tokenization_spaces`,
//! * `chat_template.jinja` (optional): the chat template as newer transformers saves it;
//!   like transformers, it wins over `tokenizer_config.json`'s `chat_template`,
//! * `generation_config.json` and `config.json` (optional): `eos_token_id` (an integer or a
//!   list), `pad_token_id` and `bos_token_id`.
//!
//! It encodes and decodes like a transformers fast tokenizer and renders chat templates like
//! `apply_chat_template(messages, tokenize=False)`, using minijinja in place of jinja2.
//!
//! ```no_run
//! use rlhf_tokenizer::{ChatMessage, HfTokenizer};
//!
//! let tok = HfTokenizer::from_dir(std::path::Path::new("models/llama"))?;
//! let prompt = tok.apply_chat_template(&[ChatMessage::new("user", "Hi!")], true)?;
//! let ids = tok.encode(&prompt, false)?;
//! let stop = tok.eos_token_ids();
//! # let _ = (ids, stop);
//! # Ok::<(), rlhf_tokenizer::TokenizerError>(())
//! ```
//!
//! Errors are [`TokenizerError`]s whose messages name the file and the key involved.

#![warn(missing_docs)]

mod chat;
mod error;
mod files;
mod pyjson;
mod special;
mod strftime;

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::{ModelWrapper, Tokenizer};

pub use chat::ChatMessage;
pub use error::TokenizerError;

use chat::ChatTemplate;
use special::{dedup_keep_order, IdConfig, SpecialTokens};

/// A model directory's tokenizer, special tokens and chat template.
///
/// Cheap to share across threads (`Send + Sync`); cloning copies the vocabulary.
#[derive(Clone)]
pub struct HfTokenizer {
    dir: PathBuf,
    tokenizer_path: PathBuf,
    tokenizer: Tokenizer,
    special: SpecialTokens,
    eos_ids: Vec<u32>,
    pad_id: u32,
    bos_id: Option<u32>,
    /// The file each of the eos, pad and bos ids was read from (errors name it).
    id_files: [PathBuf; 3],
    clean_up_tokenization_spaces: bool,
    chat_template: ChatTemplate,
    /// Extra variables every chat template rendering sees (transformers' `apply_chat_template`
    /// keyword arguments, e.g. Qwen3's `enable_thinking`).
    template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special.tokens)
            .field("eos_token_ids", &self.eos_ids)
            .field("pad_token_id", &self.pad_id)
            .field("bos_token_id", &self.bos_id)
            .field("chat_template", &self.chat_template)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json` and `config.json` from a model directory (all but
    /// `tokenizer.json` optional) and resolves the special token ids.
    ///
    /// Padding and truncation stored in `tokenizer.json` are switched off, as transformers
    /// does for a plain `tokenizer(text)` call.
    ///
    /// Fails when a file is unreadable or malformed, a key has the wrong type, a special
    /// token of `tokenizer_config.json` that is needed for an id is not in the vocabulary,
    /// or no pad token can be determined (see [`HfTokenizer::pad_token_id`]). A chat template
    /// that does not compile is reported by [`HfTokenizer::apply_chat_template`] instead.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_path = dir.join("tokenizer.json");
        let text = files::read_text_required(&tokenizer_path)?;
        // Syntax first, with serde_json alone: the tokenizers library panics on some syntax errors
        // (a file cut inside its `decoder` object hits an `expect` in 0.22), which a truncated
        // download or a full disk produces.
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&text) {
            let (line, column, message) = files::split_json_error(&e);
            return Err(TokenizerError::InvalidJson { path: tokenizer_path, line, column, message });
        }
        let parsed = std::panic::catch_unwind(|| serde_json::from_str::<Tokenizer>(&text));
        let parsed = parsed.map_err(|_| TokenizerError::NotATokenizer {
            path: tokenizer_path.clone(),
            reason: "the tokenizers library panicked reading it".into(),
        })?;
        let mut tokenizer: Tokenizer = parsed.map_err(|e| {
            // The tokenizers crate reports some data errors (`{"foo": 1}`) as syntax errors: tell
            // them apart by parsing again as plain JSON, which only costs on this error path.
            let value = match files::parse_json(&tokenizer_path, &text) {
                Ok(value) => value,
                Err(json_error) => return json_error,
            };
            let missing = ["model"].into_iter().find(|key| value.get(key).is_none());
            match (&value, missing) {
                (Value::Object(_), None) => {
                    let (line, column, message) = files::split_json_error(&e);
                    TokenizerError::InvalidTokenizer { path: tokenizer_path.clone(), line, column, message }
                }
                (Value::Object(_), Some(key)) => {
                    TokenizerError::NotATokenizer { path: tokenizer_path.clone(), reason: format!("no `{key}` key") }
                }
                (other, _) => TokenizerError::NotATokenizer {
                    path: tokenizer_path.clone(),
                    reason: format!("the top level is {}, not an object", error::describe(other)),
                },
            }
        })?;
        drop(text);
        // transformers takes the pad token from tokenizer.json's padding section when
        // tokenizer_config.json does not mention one; remember it before switching padding off.
        let json_pad_token = tokenizer.get_padding().map(|p| p.pad_token.clone());
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(|e| TokenizerError::InvalidTokenizer {
            path: tokenizer_path.clone(),
            line: 0,
            column: 0,
            message: error::one_line(&e.to_string()),
        })?;

        let config_path = dir.join("tokenizer_config.json");
        let tok_config = files::read_json_object_optional(&config_path)?;
        let mut special = match &tok_config {
            Some(c) => SpecialTokens::parse(&config_path, c)?,
            None => SpecialTokens::default(),
        };
        if let Some(pad) = json_pad_token {
            if !special.mentions("pad_token") && tokenizer.token_to_id(&pad).is_some() {
                special.tokens.push(("pad_token", pad));
            }
        }
        // transformers 5 applies the clean-up only when asked, and never to BPE models
        // unless forced with the long-named override key.
        let clean_up_tokenization_spaces = match &tok_config {
            Some(c) => {
                let asked = special::parse_bool(&config_path, c, "clean_up_tokenization_spaces")?.unwrap_or(false);
                let force_bpe = special::parse_bool(
                    &config_path,
                    c,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                )?
                .unwrap_or(false);
                let is_bpe = matches!(tokenizer.get_model(), ModelWrapper::BPE(_));
                asked && (!is_bpe || force_bpe)
            }
            None => false,
        };
        let chat_template = ChatTemplate::load(dir, &config_path, tok_config.as_ref())?;

        let ids = SpecialIds::resolve(dir, &tokenizer, &special, &config_path, &tokenizer_path)?;
        let (eos_ids, pad_id, bos_id) = (ids.eos, ids.pad, ids.bos);
        Ok(Self {
            dir: dir.to_path_buf(),
            tokenizer_path,
            tokenizer,
            special,
            eos_ids,
            pad_id,
            bos_id,
            id_files: ids.files,
            clean_up_tokenization_spaces,
            chat_template,
            template_kwargs: serde_json::Map::new(),
        })
    }

    /// The model directory this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Token ids of `text`. With `add_special_tokens`, `tokenizer.json`'s own post-processor
    /// runs (BOS etc., exactly like transformers' `tokenizer(text)`); nothing else is added.
    /// Special tokens written in the text (`<|im_start|>`) are recognised either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| self.encode_error(&*e))
    }

    /// [`HfTokenizer::encode`] for many texts, in parallel; results are in input order and
    /// not padded.
    pub fn encode_batch(&self, texts: &[String], add_special_tokens: bool) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.tokenizer
            .encode_batch_fast(inputs, add_special_tokens)
            .map(|encs| encs.iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| self.encode_error(&*e))
    }

    fn encode_error(&self, e: &(dyn std::error::Error + Send + Sync)) -> TokenizerError {
        TokenizerError::Encode { path: self.tokenizer_path.clone(), message: error::one_line(&e.to_string()) }
    }

    /// Text of `ids`, like transformers' `tokenizer.decode(ids, skip_special_tokens=...)`:
    /// `tokenizer.json`'s decoder, then — when `tokenizer_config.json` sets
    /// `clean_up_tokenization_spaces: true` and the model is not BPE (transformers 5 skips
    /// BPE models unless `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`
    /// is also true) — transformers' clean-up of spaces before punctuation and contractions
    /// (`" ."` → `"."`, `" n't"` → `"n't"`, ...). Ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let text = self.tokenizer.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode {
            path: self.tokenizer_path.clone(),
            message: error::one_line(&e.to_string()),
        })?;
        Ok(if self.clean_up_tokenization_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// Renders the chat template like transformers'
    /// `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`.
    ///
    /// The template sees `messages`, `add_generation_prompt`, `tools` and `documents`
    /// (both `none`, as transformers passes them), and the special tokens of
    /// `tokenizer_config.json` that are set (`bos_token`, `eos_token`, `pad_token`,
    /// `unk_token`, `sep_token`, `cls_token`, `mask_token`; unset ones are undefined).
    /// Python string and dict methods (`.strip()`, `.split()`, `.items()`, ...),
    /// `raise_exception(msg)`, `strftime_now(fmt)` (UTC) and transformers' `tojson` work.
    ///
    /// Fails when there is no template, it does not compile, `messages` is empty (as in
    /// transformers), or rendering fails (including the template calling `raise_exception`).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.chat_template.render(messages, add_generation_prompt, &self.special, &self.template_kwargs)
    }

    /// Extra variables for every chat template rendering, as transformers'
    /// `apply_chat_template(..., **kwargs)` passes them (Qwen3's `enable_thinking = false`, say).
    /// Names the template already receives (`messages`, `add_generation_prompt`, `tools`,
    /// `documents`, special tokens) are refused, as transformers refuses a repeated argument.
    pub fn set_chat_template_kwargs(
        &mut self,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), TokenizerError> {
        let reserved = ["messages", "add_generation_prompt", "tools", "documents"];
        if let Some(k) =
            kwargs.keys().find(|k| reserved.contains(&k.as_str()) || self.special.tokens.iter().any(|(t, _)| t == k))
        {
            return Err(TokenizerError::TemplateRender {
                path: self.dir.join("tokenizer_config.json"),
                message: format!("chat_template_kwargs: `{k}` is an argument the template already gets"),
            });
        }
        self.template_kwargs = kwargs.clone();
        Ok(())
    }

    /// Whether the model has a chat template (from `chat_template.jinja` or
    /// `tokenizer_config.json`). A list of named templates without a `default` one counts
    /// as none.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.exists()
    }

    /// Ids that end generation: `generation_config.json`'s `eos_token_id` (an integer or a
    /// list) if set, else `config.json`'s, else the id of `tokenizer_config.json`'s
    /// `eos_token`. Deduplicated, order kept; empty if none of them is set.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The id to pad with: `tokenizer_config.json`'s `pad_token` if set (when that file does
    /// not mention `pad_token`, the `pad_token` of `tokenizer.json`'s padding section, as in
    /// transformers), else `generation_config.json`'s `pad_token_id`, else `config.json`'s,
    /// else the first eos id. ([`HfTokenizer::from_dir`] fails when none of these exists.)
    pub fn pad_token_id(&self) -> u32 {
        self.pad_id
    }

    /// The id of the beginning-of-sequence token: `tokenizer_config.json`'s `bos_token` if
    /// set, else `generation_config.json`'s `bos_token_id`, else `config.json`'s. `None` when
    /// `tokenizer_config.json` says `"bos_token": null` (as transformers' `bos_token_id`),
    /// whatever the model configs say.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The text of a special token from `tokenizer_config.json` (`"eos_token"`,
    /// `"pad_token"`, ...), if set there.
    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special.get(key)
    }

    /// The id of a token (added tokens included), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The text of a token id, if it is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// The vocabulary size including added tokens (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Checks that every id this tokenizer can produce (its vocabulary with the added tokens,
    /// and the eos / pad / bos ids of the configs) is below `vocab_size`, the rows of the
    /// model's embedding; an id beyond it would crash the embedding lookup. The error names the
    /// file the id came from (`generation_config.json`, `config.json`, `tokenizer.json`...).
    pub fn check_fits_vocab(&self, vocab_size: i64) -> Result<(), TokenizerError> {
        let out_of_range = |path: &Path, what: String, id: u32| TokenizerError::IdOutOfRange {
            path: path.to_path_buf(),
            what,
            id,
            vocab_size,
        };
        let fits = |id: u32| i64::from(id) < vocab_size;
        if let Some((token, &id)) = self.tokenizer.get_vocab(true).iter().max_by_key(|(_, &id)| id) {
            if !fits(id) {
                return Err(out_of_range(&self.tokenizer_path, format!("token {token:?}"), id));
            }
        }
        let [eos, pad, bos] = &self.id_files;
        let specials = self.eos_ids.iter().map(|&id| ("eos_token_id", id, eos));
        let specials =
            specials.chain([("pad_token_id", self.pad_id, pad)]).chain(self.bos_id.map(|id| ("bos_token_id", id, bos)));
        for (what, id, file) in specials {
            if !fits(id) {
                return Err(out_of_range(file, what.to_string(), id));
            }
        }
        Ok(())
    }

    /// The underlying `tokenizers` tokenizer (padding and truncation switched off).
    pub fn inner(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// The eos, pad and bos ids of a model directory and the file each came from: the configs'
/// `eos_token_id` / `pad_token_id` / `bos_token_id` (`generation_config.json`, then `config.json`)
/// and `tokenizer_config.json`'s special tokens, in transformers' order of precedence.
struct SpecialIds {
    eos: Vec<u32>,
    pad: u32,
    bos: Option<u32>,
    files: [PathBuf; 3],
}

impl SpecialIds {
    fn resolve(
        dir: &Path,
        tokenizer: &Tokenizer,
        special: &SpecialTokens,
        config_path: &Path,
        tokenizer_path: &Path,
    ) -> Result<Self, TokenizerError> {
        let config_path = config_path.to_path_buf();
        let gen_path = dir.join("generation_config.json");
        let gen = match files::read_json_object_optional(&gen_path)? {
            Some(c) => IdConfig::parse(&gen_path, &c)?,
            None => IdConfig::default(),
        };
        let model_path = dir.join("config.json");
        let model = match files::read_json_object_optional(&model_path)? {
            Some(c) => IdConfig::parse(&model_path, &c)?,
            None => IdConfig::default(),
        };

        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match special.get(key) {
                None => Ok(None),
                Some(token) => match tokenizer.token_to_id(token) {
                    Some(id) => Ok(Some(id)),
                    None => Err(TokenizerError::UnknownToken {
                        path: config_path.clone(),
                        key: key.to_owned(),
                        token: token.to_owned(),
                        vocab: tokenizer_path.to_path_buf(),
                    }),
                },
            }
        };

        let (eos_ids, eos_file) = if !gen.eos.is_empty() {
            (dedup_keep_order(gen.eos), gen_path.clone())
        } else if !model.eos.is_empty() {
            (dedup_keep_order(model.eos), model_path.clone())
        } else {
            (token_id("eos_token")?.into_iter().collect(), config_path.clone())
        };
        // The first of these that names an id, with its file.
        let first = |ids: [(Option<u32>, &PathBuf); 3]| ids.into_iter().find_map(|(id, f)| Some((id?, f.clone())));
        let (pad_id, pad_file) =
            match first([(token_id("pad_token")?, &config_path), (gen.pad, &gen_path), (model.pad, &model_path)]) {
                Some(found) => found,
                None => match eos_ids.first() {
                    Some(&id) => (id, eos_file.clone()),
                    None => return Err(TokenizerError::NoPadToken { dir: dir.to_path_buf() }),
                },
            };
        // An explicit `"bos_token": null` means the tokenizer has none (transformers'
        // `tokenizer.bos_token_id` is None), even if the model configs name one.
        let (bos_id, bos_file) = if special.is_null("bos_token") {
            (None, config_path.clone())
        } else {
            match first([(token_id("bos_token")?, &config_path), (gen.bos, &gen_path), (model.bos, &model_path)]) {
                Some((id, f)) => (Some(id), f),
                None => (None, config_path.clone()),
            }
        };

        Ok(SpecialIds { eos: eos_ids, pad: pad_id, bos: bos_id, files: [eos_file, pad_file, bos_file] })
    }
}

/// transformers' `PreTrainedTokenizerBase.clean_up_tokenization`.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}
