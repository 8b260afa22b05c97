//! The requests the worker gets for each signature (the arguments the user's function is called
//! with) and the replies it sends back.

use std::collections::BTreeMap;

use rlhf_plugin_api::Sample;
use serde_json::{json, Map, Value};

use crate::config::Signature;

/// What the request needs besides the samples.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    pub signature: Signature,
    /// trl: messages instead of text (`None`: per sample, when a chat template was applied).
    pub conversational: Option<bool>,
}

/// The dataset's prompt text of a sample whose prompt was not templated: the single user message
/// it was made from. `None` when a chat template was applied.
fn raw_prompt(s: &Sample) -> Option<&str> {
    match s.messages.as_slice() {
        [m] if m.role == "user" && m.content == s.prompt => Some(m.content.as_str()),
        _ => None,
    }
}

/// The request for `samples`.
pub fn request(samples: &[Sample], o: &RequestOptions) -> Value {
    match o.signature {
        Signature::Trl => trl_request(samples, o),
        Signature::Verl => {
            let rows: Vec<Value> = samples
                .iter()
                .map(|s| {
                    // verl keeps the answer nested (`reward_model.ground_truth`) with its own type.
                    let ground_truth = s
                        .metadata
                        .get("reward_model")
                        .and_then(|r| r.get("ground_truth"))
                        .cloned()
                        .unwrap_or_else(|| s.label.clone().map_or(Value::Null, Value::String));
                    json!({
                        "data_source": s.metadata.get("data_source").cloned().unwrap_or(Value::Null),
                        "solution_str": s.response,
                        "ground_truth": ground_truth,
                        "extra_info": s.metadata.get("extra_info").cloned().unwrap_or(Value::Null),
                    })
                })
                .collect();
            json!({"samples": rows})
        }
        Signature::OpenRlhf => json!({
            "queries": samples.iter().map(|s| format!("{}{}", s.prompt, s.response)).collect::<Vec<_>>(),
            "prompts": samples.iter().map(|s| s.prompt.as_str()).collect::<Vec<_>>(),
            "labels": samples.iter().map(|s| s.label.as_deref()).collect::<Vec<_>>(),
        }),
    }
}

/// TRL's call: `prompts`, `completions`, `completion_ids` and every dataset column as a list.
fn trl_request(samples: &[Sample], o: &RequestOptions) -> Value {
    let (mut prompts, mut completions) = (Vec::new(), Vec::new());
    for s in samples {
        let raw = raw_prompt(s);
        if o.conversational.unwrap_or(raw.is_none()) {
            prompts.push(serde_json::to_value(&s.messages).unwrap_or(Value::Null));
            completions.push(json!([{"role": "assistant", "content": s.response}]));
        } else {
            // TRL's standard format: the dataset's prompt text, before any template.
            let text = match s.messages.as_slice() {
                [m] if m.role == "user" => m.content.as_str(),
                _ => s.prompt.as_str(),
            };
            prompts.push(Value::String(text.to_string()));
            completions.push(Value::String(s.response.clone()));
        }
    }
    // Every column of any sample; a sample without it gets None, as a missing dict key would.
    let mut names: Vec<String> = Vec::new();
    for s in samples {
        if let Value::Object(m) = &s.metadata {
            names.extend(m.keys().filter(|k| !names.contains(k)).cloned().collect::<Vec<_>>());
        }
    }
    let reserved = ["prompts", "completions", "completion_ids"];
    let mut columns = Map::new();
    for name in names.iter().filter(|n| !reserved.contains(&n.as_str())) {
        let col: Vec<Value> = samples.iter().map(|s| s.metadata.get(name).cloned().unwrap_or(Value::Null)).collect();
        columns.insert(name.clone(), Value::Array(col));
    }
    // A renamed label column is in the metadata under its dataset name (`solution`); an
    // unrenamed one is `label`.
    if !columns.contains_key("label") {
        let labels: Vec<Value> = samples.iter().map(|s| s.label.clone().map_or(Value::Null, Value::String)).collect();
        columns.insert("label".into(), Value::Array(labels));
    }
    json!({
        "prompts": prompts,
        "completions": completions,
        "completion_ids": samples.iter().map(|s| s.response_ids.clone()).collect::<Vec<_>>(),
        "columns": columns,
    })
}

/// A successful reply: a score or `None` per sample, failures by sample, metric sums.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub scores: Vec<Option<f64>>,
    pub errors: BTreeMap<usize, String>,
    /// name → (mean, count).
    pub metrics: BTreeMap<String, (f64, f64)>,
}

/// The longest exception message kept (the worker cuts them too): a 50 MB message would
/// otherwise become a 50 MB error line.
pub const MAX_MESSAGE: usize = 2000;

/// An exception message of a reply, cut at [`MAX_MESSAGE`] characters.
fn message(v: &Value) -> String {
    let text = v.as_str().unwrap_or("error");
    match text.char_indices().nth(MAX_MESSAGE) {
        Some((at, _)) => format!("{}… ({} more bytes)", &text[..at], text.len() - at),
        None => text.to_string(),
    }
}

/// Reads a reply for `n` samples: `Ok(Err(message))` when the function raised for the whole call,
/// `Err` when the reply is malformed.
pub fn parse_reply(v: &Value, n: usize) -> Result<Result<Reply, String>, String> {
    if let Some(e) = v.get("error") {
        return Ok(Err(message(e)));
    }
    let scores = v.get("scores").and_then(Value::as_array).ok_or("a reply without `scores`")?;
    if scores.len() != n {
        return Err(format!("a reply with {} scores for {n} samples", scores.len()));
    }
    let scores = scores
        .iter()
        .map(|s| match s {
            Value::Null => Ok(None),
            other => other.as_f64().map(Some).ok_or("a score that is not a number"),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut errors = BTreeMap::new();
    if let Some(Value::Object(m)) = v.get("errors") {
        for (k, e) in m {
            let i: usize = k.parse().map_err(|_| "an error for no sample")?;
            if i >= n {
                return Err("an error for no sample".into());
            }
            errors.insert(i, message(e));
        }
    }
    let mut metrics = BTreeMap::new();
    if let Some(Value::Object(m)) = v.get("metrics") {
        for (k, sc) in m {
            let pair = sc.as_array().and_then(|a| Some((a.first()?.as_f64()?, a.get(1)?.as_f64()?)));
            metrics.insert(k.clone(), pair.ok_or("a malformed metric")?);
        }
    }
    Ok(Ok(Reply { scores, errors, metrics }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlhf_plugin_api::ChatMessage;

    fn sample(prompt: &str, messages: &[(&str, &str)], metadata: Value) -> Sample {
        Sample {
            prompt: prompt.into(),
            response: "42".into(),
            prompt_ids: vec![1],
            response_ids: vec![5, 2],
            label: Some("42".into()),
            metadata,
            messages: messages.iter().map(|(r, c)| ChatMessage { role: (*r).into(), content: (*c).into() }).collect(),
        }
    }

    #[test]
    fn trl_passes_text_or_messages_and_every_column() {
        let plain = sample("6*7=", &[("user", "6*7=")], json!({"id": 1, "solution": "42"}));
        let templated = sample("<u>6*7=</u><a>", &[("user", "6*7=")], json!({"id": 2, "level": "easy"}));
        let o = RequestOptions { signature: Signature::Trl, conversational: None };
        let r = request(&[plain.clone(), templated.clone()], &o);
        assert_eq!(r["prompts"], json!(["6*7=", [{"role": "user", "content": "6*7="}]]));
        assert_eq!(r["completions"], json!(["42", [{"role": "assistant", "content": "42"}]]));
        assert_eq!(r["completion_ids"], json!([[5, 2], [5, 2]]));
        assert_eq!(
            r["columns"],
            json!({"id": [1, 2], "solution": ["42", null], "level": [null, "easy"], "label": ["42", "42"]})
        );
        let o = RequestOptions { conversational: Some(false), ..o };
        assert_eq!(request(&[templated], &o)["prompts"], json!(["6*7="]));
    }

    #[test]
    fn verl_reads_nested_ground_truth_and_extra_info() {
        let meta = json!({"data_source": "gsm8k", "reward_model": {"ground_truth": 72}, "extra_info": {"idx": 3}});
        let s = sample("q", &[("user", "q")], meta);
        let o = RequestOptions { signature: Signature::Verl, conversational: None };
        let r = request(&[s], &o);
        assert_eq!(
            r["samples"][0],
            json!({"data_source": "gsm8k", "solution_str": "42", "ground_truth": 72, "extra_info": {"idx": 3}})
        );
    }

    #[test]
    fn replies_are_checked() {
        let ok = json!({"scores": [1.0, null], "errors": {"1": "ValueError: x"}, "metrics": {"acc": [1.0, 2.0]}});
        let r = parse_reply(&ok, 2).unwrap().unwrap();
        assert_eq!(r.scores, vec![Some(1.0), None]);
        assert_eq!(r.errors.get(&1).map(String::as_str), Some("ValueError: x"));
        assert_eq!(r.metrics["acc"], (1.0, 2.0));
        assert_eq!(parse_reply(&json!({"error": "KeyError: 'a'"}), 2).unwrap(), Err("KeyError: 'a'".into()));
        assert!(parse_reply(&json!({"scores": [1.0]}), 2).unwrap_err().contains("1 scores for 2"));
        assert!(parse_reply(&json!({"scores": ["a", 1]}), 2).is_err());
        assert!(parse_reply(&json!({"scores": [1, 1], "errors": {"5": "x"}}), 2).is_err());
    }
}
