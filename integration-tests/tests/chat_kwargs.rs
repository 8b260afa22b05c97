//! `data.chat_template_kwargs`: extra template variables rendered as transformers'
//! `apply_chat_template(..., **kwargs)` renders them, checked on a Qwen3-style template
//! (`enable_thinking`, and earlier turns' `<think>` blocks dropped from the history).

use rlhf_integration_tests::{copy_dir, hf_check, model_dir, python};
use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde_json::json;

/// The parts of Qwen3's chat template that depend on `enable_thinking` and on earlier reasoning.
const TEMPLATE: &str = r#"{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

#[test]
fn template_kwargs_render_as_in_transformers() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("llama"), dir.path());
    let mut config = rlhf_integration_tests::read_json(&dir.path().join("tokenizer_config.json"));
    config.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), TEMPLATE).unwrap();
    let messages = vec![
        ChatMessage::new("user", "What is 2 + 2?"),
        ChatMessage::new("assistant", "<think>\nTwo and two.\n</think>\n\n4"),
        ChatMessage::new("user", "And 3 + 3?"),
    ];
    let kwargs = [json!({}), json!({"enable_thinking": false}), json!({"enable_thinking": true})];
    let cases: Vec<_> =
        kwargs.iter().map(|k| json!({"messages": messages, "add_generation_prompt": true, "kwargs": k})).collect();
    let want =
        hf_check(&python, &["render", "--model", dir.path().to_str().unwrap(), "--cases", &json!(cases).to_string()]);
    let mut tok = HfTokenizer::from_dir(dir.path()).unwrap();
    for (k, want) in kwargs.iter().zip(want["texts"].as_array().unwrap()) {
        tok.set_chat_template_kwargs(k.as_object().unwrap()).unwrap();
        let ours = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(ours, want.as_str().unwrap(), "kwargs {k}");
    }
    assert!(want["texts"][1].as_str().unwrap().ends_with("<think>\n\n</think>\n\n"));
    assert!(!want["texts"][0].as_str().unwrap().contains("Two and two"), "earlier reasoning is dropped");
    let e = tok.set_chat_template_kwargs(json!({"messages": 1}).as_object().unwrap()).unwrap_err().to_string();
    assert!(e.contains("chat_template_kwargs: `messages`"), "{e}");
}
