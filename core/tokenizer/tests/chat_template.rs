//! Chat templates: parity with jinja2 in transformers' environment, template sources and
//! template errors.

mod common;

use common::ModelDir;
use rlhf_tokenizer::{ChatMessage, HfTokenizer, TokenizerError};
use serde::Deserialize;
use serde_json::{json, Value};

fn load(dir: &ModelDir) -> HfTokenizer {
    match HfTokenizer::from_dir(dir.path()) {
        Ok(t) => t,
        Err(e) => panic!("load failed: {e}"),
    }
}

fn with_template(template: &str) -> HfTokenizer {
    let dir = ModelDir::new().tokenizer_config(json!({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": template,
    }));
    load(&dir)
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
    pairs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
}

#[derive(Deserialize)]
struct ReferenceCase {
    name: String,
    template: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    special: serde_json::Map<String, Value>,
    expected: String,
}

/// Every case of `tests/data/jinja_reference.json` (rendered by jinja2 with transformers'
/// chat-template environment, see `gen_jinja_reference.py`) renders identically.
#[test]
fn renders_like_jinja2_in_transformers_environment() {
    let text = include_str!("data/jinja_reference.json");
    let cases: Vec<ReferenceCase> = serde_json::from_str(text).expect("reference JSON");
    assert!(cases.len() >= 9);
    for case in cases {
        let mut config = case.special.clone();
        config.insert("chat_template".into(), Value::String(case.template.clone()));
        let dir = ModelDir::new().tokenizer_config(Value::Object(config)).generation_config(json!({"eos_token_id": 2}));
        let tok = load(&dir);
        assert!(tok.has_chat_template());
        let got = tok
            .apply_chat_template(&case.messages, case.add_generation_prompt)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(got, case.expected, "case {}", case.name);
    }
}

#[test]
fn raise_exception_fails_with_its_message() {
    let template = "{% for m in messages %}{% if m.role == 'user' and loop.index0 % 2 == 1 %}\n\
                    {{ raise_exception('Conversation roles must alternate user/assistant') }}\n\
                    {% endif %}{{ m.content }}{% endfor %}";
    let dir = ModelDir::new().tokenizer_config(json!({
        "eos_token": "</s>", "chat_template": template,
    }));
    let tok = load(&dir);
    let ok = tok.apply_chat_template(&msgs(&[("user", "a"), ("assistant", "b")]), false);
    assert_eq!(ok.unwrap(), "ab");
    let e = tok.apply_chat_template(&msgs(&[("user", "a"), ("user", "b")]), false).unwrap_err();
    assert!(matches!(e, TokenizerError::TemplateRender { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "chat template of {}: render error: template raised an exception: \
             Conversation roles must alternate user/assistant (in chat_template:2)",
            dir.file("tokenizer_config.json").display()
        )
    );
}

#[test]
fn missing_template() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>"}));
    let tok = load(&dir);
    assert!(!tok.has_chat_template());
    let e = tok.apply_chat_template(&msgs(&[("user", "hi")]), true).unwrap_err();
    assert!(matches!(e, TokenizerError::NoChatTemplate { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "{}: no chat_template (the model has no chat template; use a plain prompt)",
            dir.file("tokenizer_config.json").display()
        )
    );
    // Also when tokenizer_config.json does not exist, or chat_template is null.
    let dir = ModelDir::new().generation_config(json!({"eos_token_id": 2}));
    assert!(!load(&dir).has_chat_template());
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "chat_template": null}));
    let e = load(&dir).apply_chat_template(&[], false).unwrap_err();
    assert!(matches!(e, TokenizerError::NoChatTemplate { .. }), "{e:?}");
}

#[test]
fn template_list_uses_default() {
    let dir = ModelDir::new().tokenizer_config(json!({
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
        ],
    }));
    let tok = load(&dir);
    assert!(tok.has_chat_template());
    let out = tok.apply_chat_template(&msgs(&[("user", "hi")]), false).unwrap();
    assert_eq!(out, "[user]hi");

    let dir = ModelDir::new().tokenizer_config(json!({
        "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "rag", "template": "RAG"}],
    }));
    let tok = load(&dir);
    assert!(!tok.has_chat_template());
    let e = tok.apply_chat_template(&[], false).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: chat_template: no template named \"default\" (found [\"tool_use\", \"rag\"])",
            dir.file("tokenizer_config.json").display()
        )
    );
}

#[test]
fn template_wrong_types() {
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "chat_template": 5}));
    let e = HfTokenizer::from_dir(dir.path()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: chat_template: expected a string or a list of {{\"name\": ..., \"template\": ...}}, got 5",
            dir.file("tokenizer_config.json").display()
        )
    );
    let dir = ModelDir::new().tokenizer_config(json!({
        "eos_token": "</s>", "chat_template": [{"name": "default", "template": ["x"]}],
    }));
    let e = HfTokenizer::from_dir(dir.path()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: chat_template[0].template: expected a string, got [\"x\"]",
            dir.file("tokenizer_config.json").display()
        )
    );
    let dir = ModelDir::new().tokenizer_config(json!({"eos_token": "</s>", "chat_template": ["x"]}));
    let e = HfTokenizer::from_dir(dir.path()).unwrap_err();
    assert!(e.to_string().contains("chat_template[0]: expected"), "{e}");
}

#[test]
fn chat_template_jinja_file() {
    // Only the separate file.
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .raw("chat_template.jinja", "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\n");
    let tok = load(&dir);
    assert!(tok.has_chat_template());
    assert_eq!(
        tok.apply_chat_template(&msgs(&[("user", "a"), ("assistant", "b")]), false).unwrap(),
        "<user>a\n<assistant>b\n"
    );
    // Both: like transformers, the separate file wins over tokenizer_config.json.
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>", "chat_template": "CONFIG"}))
        .raw("chat_template.jinja", "FILE");
    let one = msgs(&[("user", "x")]);
    assert_eq!(load(&dir).apply_chat_template(&one, false).unwrap(), "FILE");
    // Without tokenizer_config.json at all.
    let dir = ModelDir::new()
        .generation_config(json!({"eos_token_id": 2}))
        .raw("chat_template.jinja", "{{ messages | length }}");
    let e = load(&dir).apply_chat_template(&[], true).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "chat template of {}: cannot apply a chat template to an empty conversation \
             (provide at least one message)",
            dir.file("chat_template.jinja").display()
        )
    );
    assert_eq!(load(&dir).apply_chat_template(&msgs(&[("user", "x")]), true).unwrap(), "1");
}

#[test]
fn syntax_error_reported_on_use() {
    let dir = ModelDir::new().tokenizer_config(json!({
        "eos_token": "</s>", "chat_template": "{% for m in messages %}\n{{ m.content }",
    }));
    // Loading succeeds (plain prompts still work) ...
    let tok = load(&dir);
    assert!(tok.has_chat_template());
    assert_eq!(tok.encode("hello", false).unwrap().len(), 1);
    // ... applying the template reports the syntax error.
    let e = tok.apply_chat_template(&msgs(&[("user", "x")]), false).unwrap_err();
    assert!(matches!(e, TokenizerError::TemplateSyntax { .. }), "{e:?}");
    let msg = e.to_string();
    let prefix = format!("chat template of {}: syntax error: ", dir.file("tokenizer_config.json").display());
    assert!(msg.starts_with(&prefix), "{msg}");
    assert!(msg.contains("chat_template:2"), "{msg}");
    assert!(!msg.contains('\n'), "{msg:?}");
}

#[test]
fn render_errors_are_one_line() {
    let dir = ModelDir::new()
        .tokenizer_config(json!({"eos_token": "</s>"}))
        .raw("chat_template.jinja", "x\n{{ undefined_thing | tojson }}");
    let e = load(&dir).apply_chat_template(&msgs(&[("user", "x")]), false).unwrap_err();
    let msg = e.to_string();
    let prefix = format!("chat template of {}: render error: ", dir.file("chat_template.jinja").display());
    assert!(msg.starts_with(&prefix), "{msg}");
    assert!(msg.contains("not JSON serializable"), "{msg}");
    assert!(!msg.contains('\n'), "{msg:?}");

    let tok = with_template("{{ messages[0].content.no_such_method() }}");
    let e = tok.apply_chat_template(&msgs(&[("user", "x")]), false).unwrap_err();
    assert!(matches!(e, TokenizerError::TemplateRender { .. }), "{e:?}");
    assert!(!e.to_string().contains('\n'));
}

#[test]
fn strftime_now_and_context() {
    let tok = with_template("{{ strftime_now('%Y-%m-%d') }}|{{ bos_token }}|{{ unk_token is defined }}|{{ tools }}");
    let out = tok.apply_chat_template(&msgs(&[("user", "x")]), false).unwrap();
    let (date, rest) = out.split_once('|').unwrap();
    assert_eq!(date.len(), 10, "{out}");
    let year: i32 = date[..4].parse().unwrap();
    assert!(year >= 2024, "{out}");
    assert_eq!(rest, "<s>|False|None");
}

#[test]
fn tojson_does_not_escape_html() {
    let tok = with_template("{{ messages[0] | tojson }}");
    let out = tok.apply_chat_template(&msgs(&[("user", "<a href='x'>&</a> é")]), false).unwrap();
    assert_eq!(out, r#"{"role": "user", "content": "<a href='x'>&</a> é"}"#);
}

#[test]
fn chat_message_serde() {
    let m: ChatMessage = serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
    assert_eq!(m, ChatMessage::new("user", "hi"));
    assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"user","content":"hi"}"#);
}
