//! Loading a model directory: special tokens, id precedence, encode/decode and errors.

mod common;

use common::{id, ModelDir};
use rlhf_tokenizer::{HfTokenizer, TokenizerError};
use serde_json::json;

fn load(dir: &ModelDir) -> HfTokenizer {
    match HfTokenizer::from_dir(dir.path()) {
        Ok(t) => t,
        Err(e) => panic!("load failed: {e}"),
    }
}

fn load_err(dir: &ModelDir) -> TokenizerError {
    match HfTokenizer::from_dir(dir.path()) {
        Ok(t) => panic!("expected an error, loaded {t:?}"),
        Err(e) => e,
    }
}

fn assert_one_line(e: &TokenizerError) {
    let s = e.to_string();
    assert!(!s.contains('\n'), "multi-line message: {s:?}");
}

#[test]
fn special_tokens_in_all_three_forms() {
    let dir = ModelDir::new().tokenizer_config(json!({
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false,
                      "normalized": false, "rstrip": false, "single_word": false},
        "pad_token": null,
        "unk_token": {"content": "<unk>"},
    }));
    let tok = load(&dir);
    assert_eq!(tok.bos_token_id(), Some(id("<s>")));
    assert_eq!(tok.eos_token_ids(), &[id("</s>")]);
    // pad_token null: falls back to the first eos id.
    assert_eq!(tok.pad_token_id(), id("</s>"));
    assert_eq!(tok.special_token("unk_token"), Some("<unk>"));
    assert_eq!(tok.special_token("pad_token"), None);
    assert_eq!(tok.special_token("eos_token"), Some("</s>"));
}

#[test]
fn eos_precedence_generation_config_then_config_then_tokenizer_config() {
    let tc = json!({"eos_token": "</s>", "pad_token": "<pad>"});
    // All three: generation_config's list wins, deduplicated in order.
    let dir = ModelDir::new()
        .tokenizer_config(tc.clone())
        .generation_config(json!({"eos_token_id": [7, 2, 7, 5]}))
        .config(json!({"eos_token_id": 4}));
    assert_eq!(load(&dir).eos_token_ids(), &[7, 2, 5]);

    // generation_config as an int.
    let dir = ModelDir::new()
        .tokenizer_config(tc.clone())
        .generation_config(json!({"eos_token_id": 7}))
        .config(json!({"eos_token_id": [4, 5]}));
    assert_eq!(load(&dir).eos_token_ids(), &[7]);

    // generation_config without eos (or null): config.json's list.
    let dir = ModelDir::new()
        .tokenizer_config(tc.clone())
        .generation_config(json!({"eos_token_id": null, "max_new_tokens": 3}))
        .config(json!({"eos_token_id": [4, 5, 4]}));
    assert_eq!(load(&dir).eos_token_ids(), &[4, 5]);

    // Only tokenizer_config.
    let dir = ModelDir::new().tokenizer_config(tc).config(json!({"hidden_size": 8}));
    assert_eq!(load(&dir).eos_token_ids(), &[id("</s>")]);

    // Nothing at all: empty, and pad comes from tokenizer_config.
    let dir = ModelDir::new().tokenizer_config(json!({"pad_token": "<pad>"}));
    let tok = load(&dir);
    assert!(tok.eos_token_ids().is_empty());
    assert_eq!(tok.pad_token_id(), id("<pad>"));
}

#[test]
fn pad_precedence_and_fallback() {
    // tokenizer_config pad_token beats the id files.
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>", "pad_token": "<pad>"}))
        .generation_config(json!({"pad_token_id": 9}))
        .config(json!({"pad_token_id": 10}));
    assert_eq!(load(&dir).pad_token_id(), id("<pad>"));

    // then generation_config, then config.json.
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .generation_config(json!({"pad_token_id": 9}))
        .config(json!({"pad_token_id": 10}));
    assert_eq!(load(&dir).pad_token_id(), 9);
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .generation_config(json!({"pad_token_id": null}))
        .config(json!({"pad_token_id": 10}));
    assert_eq!(load(&dir).pad_token_id(), 10);

    // then the first eos id (negative pad ids mean unset).
    let dir = ModelDir::new().generation_config(json!({"eos_token_id": [7, 2]})).config(json!({"pad_token_id": -1}));
    assert_eq!(load(&dir).pad_token_id(), 7);

    // none at all: an error naming the directory.
    let dir = ModelDir::new().tokenizer_config(json!({"bos_token": "<s>"}));
    let e = load_err(&dir);
    assert!(matches!(e, TokenizerError::NoPadToken { .. }), "{e:?}");
    assert!(e.to_string().starts_with(&format!("{}: no pad token", dir.path().display())));
    assert_one_line(&e);
}

#[test]
fn bos_precedence() {
    let dir = ModelDir::new()
        .tokenizer_config(json!({"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}))
        .generation_config(json!({"bos_token_id": 1}));
    assert_eq!(load(&dir).bos_token_id(), Some(id("<|begin_of_text|>")));
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .generation_config(json!({"bos_token_id": 6}))
        .config(json!({"bos_token_id": 1}));
    assert_eq!(load(&dir).bos_token_id(), Some(6));
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"})).config(json!({"bos_token_id": 1}));
    assert_eq!(load(&dir).bos_token_id(), Some(1));
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    assert_eq!(load(&dir).bos_token_id(), None);
    // An explicit null in tokenizer_config.json: no bos, whatever the model configs say.
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>", "bos_token": null}))
        .generation_config(json!({"bos_token_id": 6}))
        .config(json!({"bos_token_id": 1}));
    assert_eq!(load(&dir).bos_token_id(), None);
}

#[test]
fn encode_applies_only_the_post_processor() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    let tok = load(&dir);
    let plain = tok.encode("hello world .", false).unwrap();
    assert_eq!(plain, vec![id("hello"), id("world"), id(".")]);
    let with = tok.encode("hello world .", true).unwrap();
    assert_eq!(with, vec![id("<s>"), id("hello"), id("world"), id(".")]);
    // Special tokens written in the text are recognised; unknown words map to <unk>.
    let ids = tok.encode("<|im_start|>user hello zebra<|im_end|>", false).unwrap();
    assert_eq!(ids, vec![id("<|im_start|>"), id("user"), id("hello"), id("<unk>"), id("<|im_end|>")]);
    assert_eq!(tok.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn encode_batch_matches_encode_and_is_not_padded() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    // A tokenizer.json that carries a padding configuration.
    common::write_json(dir.path(), "tokenizer.json", &common::tokenizer_json(true));
    let tok = load(&dir);
    let texts: Vec<String> = vec!["hello".into(), "hello world . do n't".into(), String::new()];
    for add in [false, true] {
        let batch = tok.encode_batch(&texts, add).unwrap();
        let single: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, add).unwrap()).collect();
        assert_eq!(batch, single);
    }
    assert_eq!(tok.encode_batch(&texts, false).unwrap()[0], vec![id("hello")]);
    assert!(tok.encode_batch(&[], true).unwrap().is_empty());
    // Like transformers, the padding section's pad_token is the pad token when
    // tokenizer_config.json does not mention one ...
    assert_eq!(tok.pad_token_id(), id("<pad>"));
    assert_eq!(tok.special_token("pad_token"), Some("<pad>"));
    // ... but an explicit null there wins.
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "pad_token": null}));
    common::write_json(dir.path(), "tokenizer.json", &common::tokenizer_json(true));
    let tok = load(&dir);
    assert_eq!(tok.pad_token_id(), id("</s>"));
    assert_eq!(tok.special_token("pad_token"), None);
}

#[test]
fn decode_skip_special() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    let tok = load(&dir);
    let ids = [id("<s>"), id("hello"), id("world"), id("</s>")];
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> hello world </s>");
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello world");
    // No clean-up by default.
    let ids = [id("do"), id("n't"), id("!")];
    assert_eq!(tok.decode(&ids, true).unwrap(), "do n't !");
    // An id outside the vocabulary is skipped by the tokenizers crate, like in Python.
    assert_eq!(tok.decode(&[id("hello"), 999], true).unwrap(), "hello");
}

#[test]
fn decode_clean_up_tokenization_spaces() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "clean_up_tokenization_spaces": true}));
    let tok = load(&dir);
    let ids = [id("hello"), id("world"), id("."), id("do"), id("n't"), id("?"), id("!")];
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello world. don't?!");
}

#[test]
fn decode_clean_up_is_skipped_for_bpe_like_transformers_5() {
    let config = json!({"eos_token": "</s>", "clean_up_tokenization_spaces": true});
    let dir = ModelDir::new().tokenizer_config(config);
    common::write_json(dir.path(), "tokenizer.json", &common::bpe_tokenizer_json());
    let tok = load(&dir);
    let ids = tok.encode("a . a", false).unwrap();
    assert_eq!(ids, vec![1, 2, 1]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "a . a");

    let config = json!({"eos_token": "</s>", "clean_up_tokenization_spaces": true,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": true});
    let dir = ModelDir::new().tokenizer_config(config);
    common::write_json(dir.path(), "tokenizer.json", &common::bpe_tokenizer_json());
    assert_eq!(load(&dir).decode(&ids, true).unwrap(), "a. a");
}

#[test]
fn vocab_and_token_lookup() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    let tok = load(&dir);
    assert_eq!(tok.vocab_size(), common::SPECIAL.len() + common::WORDS.len());
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(id("<|im_end|>")));
    assert_eq!(tok.token_to_id("world"), Some(id("world")));
    assert_eq!(tok.token_to_id("zebra"), None);
    assert_eq!(tok.id_to_token(id("world")).as_deref(), Some("world"));
    assert_eq!(tok.dir(), dir.path());
}

#[test]
fn tokenizer_is_send_sync_clone() {
    fn check<T: Send + Sync + Clone + std::fmt::Debug>() {}
    check::<HfTokenizer>();
    fn check_err<T: std::error::Error + Send + Sync + 'static>() {}
    check_err::<TokenizerError>();
}

// ---- errors ----

#[test]
fn error_missing_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let e = HfTokenizer::from_dir(tmp.path()).unwrap_err();
    assert_eq!(e.to_string(), format!("{}: not found", tmp.path().join("tokenizer.json").display()));
    let e = HfTokenizer::from_dir(&tmp.path().join("no-such-dir")).unwrap_err();
    assert!(matches!(e, TokenizerError::NotFound { .. }), "{e:?}");
}

#[test]
fn error_bad_json_in_tokenizer_config() {
    let dir = ModelDir::new().raw("tokenizer_config.json", "{\n  \"eos_token\": \"</s>\",\n    oops\n}");
    let e = load_err(&dir);
    let msg = e.to_string();
    let prefix = format!("{}: invalid JSON at line 3 column 5: ", dir.file("tokenizer_config.json").display());
    assert!(msg.starts_with(&prefix), "{msg}");
    assert!(!msg.ends_with("column 5"), "position repeated: {msg}");
    assert!(matches!(e, TokenizerError::InvalidJson { line: 3, column: 5, .. }), "{e:?}");
    assert_one_line(&e);
}

#[test]
fn error_bad_json_in_each_file() {
    for name in ["generation_config.json", "config.json", "tokenizer.json"] {
        let dir =
            ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"})).raw(name, "{\"eos_token_id\": [1, 2,]}");
        let e = load_err(&dir);
        let prefix = format!("{}: invalid JSON at line 1 column ", dir.file(name).display());
        assert!(e.to_string().starts_with(&prefix), "{name}: {e}");
        assert_one_line(&e);
    }
}

#[test]
fn error_tokenizer_json_not_a_tokenizer() {
    let mut bad = common::tokenizer_json(false);
    bad["model"]["type"] = json!("NoSuchModel");
    let dir = ModelDir::new();
    common::write_json(dir.path(), "tokenizer.json", &bad);
    let e = load_err(&dir);
    assert!(matches!(e, TokenizerError::InvalidTokenizer { .. }), "{e:?}");
    let prefix = format!("{}: invalid tokenizer at line ", dir.file("tokenizer.json").display());
    assert!(e.to_string().starts_with(&prefix), "{e}");
    assert_one_line(&e);
}

#[test]
fn error_wrong_type_for_eos_token() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": 42}));
    let e = load_err(&dir);
    assert_eq!(
        e.to_string(),
        format!(
            "{}: eos_token: expected a string or {{\"content\": ...}}, got 42",
            dir.file("tokenizer_config.json").display()
        )
    );
}

#[test]
fn error_wrong_type_for_ids() {
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .generation_config(json!({"eos_token_id": {"id": 2}}));
    let e = load_err(&dir);
    assert_eq!(
        e.to_string(),
        format!(
            "{}: eos_token_id: expected an integer token id or a list of them, got {{\"id\":2}}",
            dir.file("generation_config.json").display()
        )
    );
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"})).config(json!({"pad_token_id": "0"}));
    let e = load_err(&dir);
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("{}: pad_token_id: expected", dir.file("config.json").display())), "{msg}");
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "clean_up_tokenization_spaces": "yes"}));
    let msg = load_err(&dir).to_string();
    assert!(
        msg.contains("tokenizer_config.json: clean_up_tokenization_spaces: expected a boolean, got \"yes\""),
        "{msg}"
    );
}

#[test]
fn error_not_an_object() {
    let dir = ModelDir::new().raw("tokenizer_config.json", "[1, 2]");
    let e = load_err(&dir);
    assert_eq!(
        e.to_string(),
        format!("{}: expected a JSON object at the top level, got [1,2]", dir.file("tokenizer_config.json").display())
    );
}

#[test]
fn error_special_token_not_in_vocab() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "pad_token": "[PAD]"}));
    let e = load_err(&dir);
    assert_eq!(
        e.to_string(),
        format!(
            "{}: pad_token: token \"[PAD]\" is not in the vocabulary of {}",
            dir.file("tokenizer_config.json").display(),
            dir.file("tokenizer.json").display()
        )
    );
    // An eos_token that is overridden by generation_config is not needed, so not checked.
    let dir =
        ModelDir::new().tokenizer_config(json!({"eos_token": "[EOS]"})).generation_config(json!({"eos_token_id": 2}));
    assert_eq!(load(&dir).eos_token_ids(), &[2]);
}

#[test]
fn error_unreadable_file() {
    // A directory where a file is expected.
    let dir = ModelDir::new();
    std::fs::create_dir(dir.file("config.json")).unwrap();
    let e = load_err(&dir);
    assert!(matches!(e, TokenizerError::Read { .. }), "{e:?}");
    assert!(e.to_string().starts_with(&format!("{}: cannot read: ", dir.file("config.json").display())), "{e}");
    // Not UTF-8.
    let dir = ModelDir::new();
    std::fs::write(dir.file("tokenizer_config.json"), [0xff, 0xfe, 0x00]).unwrap();
    let e = load_err(&dir);
    assert!(matches!(e, TokenizerError::Read { .. }), "{e:?}");
    assert_one_line(&e);
}

#[test]
fn byte_order_mark_is_accepted() {
    let dir = ModelDir::new().raw("tokenizer_config.json", "\u{feff}{\"eos_token\": \"</s>\"}");
    assert_eq!(load(&dir).eos_token_ids(), &[id("</s>")]);
}

#[test]
fn ids_must_fit_the_model_vocab() {
    let tok = load(&ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"})));
    let n = (common::SPECIAL.len() + common::WORDS.len()) as i64;
    tok.check_fits_vocab(n).unwrap();
    let e = tok.check_fits_vocab(n - 1).unwrap_err();
    assert!(
        matches!(e, TokenizerError::IdOutOfRange { id, vocab_size, .. } if i64::from(id) == n - 1 && vocab_size == n - 1)
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}: token \"?\" has id {}", tok.dir().join("tokenizer.json").display(), n - 1)),
        "{msg}"
    );
    assert!(msg.contains(&format!("vocab_size (config.json) is {}", n - 1)), "{msg}");
    assert_one_line(&e);
    // A special-token id from the configs counts too.
    let tok = load(&ModelDir::new().tokenizer_config(json!({})).generation_config(json!({"eos_token_id": 99})));
    let e = tok.check_fits_vocab(n).unwrap_err().to_string();
    assert!(e.contains("eos_token_id has id 99"), "{e}");
}

#[test]
fn error_json_that_is_no_tokenizer_json() {
    for text in [r#"{"foo": 1}"#, "[1, 2]", "{}"] {
        let dir = ModelDir::new().raw("tokenizer.json", text);
        let e = load_err(&dir);
        let msg = e.to_string();
        let prefix = format!("{}: not a tokenizer.json", dir.file("tokenizer.json").display());
        assert!(msg.starts_with(&prefix), "{text}: {msg}");
        assert!(!msg.contains("invalid JSON"), "{text}: {msg}");
        assert_one_line(&e);
    }
}
