//! Parity with transformers' own output on the committed fixtures in
//! `integration-tests/fixtures/` (written by `make_fixtures.py` with transformers 5.23):
//! `chat_reference.json` holds, per case, the `messages`, `add_generation_prompt`, the text
//! of `tokenizer.apply_chat_template(messages, tokenize=False, ...)` and the ids of
//! `tokenizer(text, add_special_tokens=False)`, for the tokenizer in `models/llama/`.
//!
//! These tests fail (they do not skip) when the fixtures are missing.

use std::path::{Path, PathBuf};

use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde::Deserialize;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("fixture {} is missing or unreadable: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

#[derive(Debug, Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

fn chat_cases() -> Vec<ChatCase> {
    let path = fixtures().join("chat_reference.json");
    let cases: Vec<ChatCase> = serde_json::from_value(read_json(&path))
        .unwrap_or_else(|e| panic!("fixture {}: unexpected shape: {e}", path.display()));
    assert!(!cases.is_empty(), "{} has no cases", path.display());
    cases
}

fn load(name: &str) -> HfTokenizer {
    let dir = fixtures().join("models").join(name);
    HfTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("loading fixture model {name}: {e}"))
}

#[test]
fn chat_template_text_and_ids_match_transformers() {
    let tok = load("llama");
    assert!(tok.has_chat_template());
    let cases = chat_cases();
    for (i, case) in cases.iter().enumerate() {
        let text = tok
            .apply_chat_template(&case.messages, case.add_generation_prompt)
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        assert_eq!(text, case.text, "case {i}: rendered text");
        let ids = tok.encode(&case.text, false).unwrap();
        assert_eq!(ids, case.ids, "case {i}: ids of the text");
        // The ByteLevel decoder round-trips; clean_up_tokenization_spaces is false here.
        assert_eq!(tok.decode(&case.ids, false).unwrap(), case.text, "case {i}: decode");
    }
    let texts: Vec<String> = cases.iter().map(|c| c.text.clone()).collect();
    let batch = tok.encode_batch(&texts, false).unwrap();
    let want: Vec<Vec<u32>> = cases.iter().map(|c| c.ids.clone()).collect();
    assert_eq!(batch, want, "encode_batch");
}

#[test]
fn special_ids_match_the_recorded_configs() {
    let dir = fixtures().join("models/llama");
    let tok = load("llama");
    let gen = read_json(&dir.join("generation_config.json"));
    let tc = read_json(&dir.join("tokenizer_config.json"));
    let config = read_json(&dir.join("config.json"));

    // Stop ids: generation_config.json's eos_token_id list, as transformers' generate() uses.
    let want_eos: Vec<u32> = gen["eos_token_id"]
        .as_array()
        .expect("generation_config eos_token_id is a list")
        .iter()
        .map(|v| v.as_u64().expect("integer id") as u32)
        .collect();
    assert_eq!(tok.eos_token_ids(), want_eos.as_slice());
    assert_eq!(want_eos, [2, 0]);

    // Pad: tokenizer_config.json's pad_token (transformers' tokenizer.pad_token_id), which
    // the fixture also records as generation_config.json's pad_token_id.
    let pad_token = tc["pad_token"].as_str().expect("pad_token is a string");
    assert_eq!(tok.token_to_id(pad_token), Some(tok.pad_token_id()));
    assert_eq!(u64::from(tok.pad_token_id()), gen["pad_token_id"].as_u64().unwrap());

    // eos_token of tokenizer_config is among the stop ids; its id is the one the recorded
    // chat ids use after every message.
    let eos_token = tc["eos_token"].as_str().expect("eos_token is a string");
    let eos_id = tok.token_to_id(eos_token).unwrap();
    assert!(tok.eos_token_ids().contains(&eos_id));
    assert!(chat_cases()[0].ids.contains(&eos_id));

    // bos_token is null in tokenizer_config.json: transformers' bos_token_id is None.
    assert!(tc["bos_token"].is_null());
    assert_eq!(tok.bos_token_id(), None);

    // len(tokenizer) is what the fixture generator used as the model's vocab_size.
    assert_eq!(tok.vocab_size() as u64, config["vocab_size"].as_u64().unwrap());
}

#[test]
fn every_fixture_model_dir_loads_and_renders_alike() {
    let models = fixtures().join("models");
    let entries =
        std::fs::read_dir(&models).unwrap_or_else(|e| panic!("fixture dir {} missing: {e}", models.display()));
    let cases = chat_cases();
    let mut n = 0;
    for entry in entries {
        let dir = entry.unwrap().path();
        if !dir.join("tokenizer.json").exists() {
            continue;
        }
        let tok = HfTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()));
        for case in &cases {
            let text = tok.apply_chat_template(&case.messages, case.add_generation_prompt).unwrap();
            assert_eq!(text, case.text, "{}", dir.display());
            assert_eq!(tok.encode(&text, false).unwrap(), case.ids, "{}", dir.display());
        }
        assert!(!tok.eos_token_ids().is_empty(), "{}", dir.display());
        n += 1;
    }
    assert!(n >= 1, "no model dirs with tokenizer.json under {}", models.display());
}
