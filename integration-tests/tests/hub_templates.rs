//! The chat templates the Hub's checkpoints of the newer families ship — gpt-oss's harmony
//! template, Gemma 4's current one, Qwen3.5's and Qwen3-VL's — render as transformers' `jinja2`
//! renders them, with the keyword arguments each reads (`reasoning_effort`, `enable_thinking`).
//! The templates are read at test time from TRL's copies (it stores each checkpoint's template
//! verbatim to recognise the model), not kept in this repository.

use std::path::PathBuf;
use std::process::Command;

use rlhf_integration_tests::{copy_dir, hf_check, model_dir, python};
use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde_json::{json, Value};

/// TRL's directory of stored chat templates, from the Python the tests use.
fn trl_templates(python: &std::path::Path) -> PathBuf {
    let out = Command::new(python)
        .args(["-c", "import os, trl; print(os.path.join(os.path.dirname(trl.__file__), 'chat_templates'))"])
        .output()
        .expect("spawn python");
    assert!(out.status.success(), "trl not importable: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[test]
fn hub_chat_templates_render_as_in_transformers() {
    let Some(python) = python() else { return };
    let templates = trl_templates(&python);
    let single = vec![ChatMessage::new("user", "What is 7 * 6?")];
    let with_system = vec![ChatMessage::new("system", "Answer with a number."), ChatMessage::new("user", "7 * 6?")];
    let turns = vec![
        ChatMessage::new("user", "What is 2 + 2?"),
        ChatMessage::new("assistant", "4"),
        ChatMessage::new("user", "And 3 + 3?"),
    ];
    let cases: [(&str, Vec<Value>); 4] = [
        ("gptoss.jinja", vec![json!({}), json!({"reasoning_effort": "high"})]),
        ("gemma4_v5.jinja", vec![json!({}), json!({"enable_thinking": true})]),
        ("qwen3_5_think.jinja", vec![json!({}), json!({"enable_thinking": false})]),
        ("qwen3_vl.jinja", vec![json!({})]),
    ];
    for (file, kwargs) in cases {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(&model_dir("llama"), dir.path());
        let mut config = rlhf_integration_tests::read_json(&dir.path().join("tokenizer_config.json"));
        config.as_object_mut().unwrap().remove("chat_template");
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::copy(templates.join(file), dir.path().join("chat_template.jinja")).unwrap();
        let mut all = Vec::new();
        for messages in [&single, &with_system, &turns] {
            for k in &kwargs {
                for generation in [true, false] {
                    all.push((messages, k, generation));
                }
            }
        }
        let payload: Vec<Value> =
            all.iter().map(|(m, k, g)| json!({"messages": m, "add_generation_prompt": g, "kwargs": k})).collect();
        let want = hf_check(
            &python,
            &["render", "--model", dir.path().to_str().unwrap(), "--cases", &json!(payload).to_string()],
        );
        let mut tok = HfTokenizer::from_dir(dir.path()).unwrap();
        for ((messages, k, generation), want) in all.iter().zip(want["texts"].as_array().unwrap()) {
            tok.set_chat_template_kwargs(k.as_object().unwrap()).unwrap();
            let ours = tok.apply_chat_template(messages, *generation).unwrap();
            assert_eq!(ours, want.as_str().unwrap(), "{file}: kwargs {k}, generation prompt {generation}");
        }
        println!("{file}: {} renderings equal", all.len());
    }
}
