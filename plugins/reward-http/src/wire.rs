//! The two wire formats: request bodies from samples, and strict validation of response bodies.
//! No I/O here; see `docs/rewards.md` for the formats as users see them.
//!
//! - openrlhf (OpenRLHF's `remote_rm_fn`): `{"query": [...], "prompts": [...], "labels": [...]}` →
//!   `{"rewards": [...], "scores": [...]?, "extra_logs": {name: [...] | number}?}`.
//! - llamafactory (LLaMA-Factory's `/v1/score/evaluation`): `{"model": ..., "messages": [...]}` →
//!   `{"scores": [...]}`.
//!
//! The text scored is `prompt + response`: the prompt as the policy saw it (chat template
//! applied) followed by the response, as OpenRLHF's remote reward model receives it.

use rlhf_plugin_api::Sample;
use serde_json::{json, Map, Value};

use crate::config::Format;

/// Why a 2xx response was rejected: `Json` (the body does not parse) or `Shape` (the JSON does
/// not have the expected shape or values). The shared client's type, which it turns into its
/// `invalid JSON` / `invalid response` errors.
pub use rlhf_http_client::Invalid;

/// A validated response.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// One finite score per sample of the request, in request order.
    pub scores: Vec<f64>,
    /// OpenRLHF's `extra_logs`, in the server's key order.
    pub extra_logs: Vec<(String, ExtraLog)>,
}

/// One `extra_logs` entry.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraLog {
    /// One value per sample.
    PerSample(Vec<f64>),
    /// One value for the whole request (counts once per sample when averaged).
    Scalar(f64),
}

/// The JSON body of a request scoring `samples`.
pub fn request_body(format: &Format, samples: &[Sample]) -> Value {
    let texts: Vec<String> = samples.iter().map(|s| format!("{}{}", s.prompt, s.response)).collect();
    match format {
        Format::OpenRlhf { .. } => json!({
            "query": texts,
            "prompts": samples.iter().map(|s| s.prompt.as_str()).collect::<Vec<_>>(),
            "labels": samples.iter().map(|s| s.label.as_deref()).collect::<Vec<_>>(),
        }),
        Format::LlamaFactory { model } => json!({ "model": model, "messages": texts }),
    }
}

/// Parses and validates a 2xx response body for a request of `n` samples.
pub fn parse_reply(format: &Format, body: &[u8], n: usize) -> Result<Reply, Invalid> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        let mut msg = e.to_string();
        let text = String::from_utf8_lossy(body);
        if ["NaN", "Infinity"].iter().any(|w| text.contains(w)) {
            msg.push_str(" (NaN and Infinity are not JSON numbers)");
        }
        Invalid::Json(msg)
    })?;
    let Value::Object(obj) = value else {
        return Err(Invalid::Shape(format!("expected a JSON object, got {}", kind(&value))));
    };
    match format {
        Format::OpenRlhf { use_scores } => {
            let rewards = numbers(&obj, "rewards", n)?;
            let scores = if obj.contains_key("scores") { Some(numbers(&obj, "scores", n)?) } else { None };
            let scores = match (use_scores, scores) {
                (false, _) => rewards,
                (true, Some(scores)) => scores,
                (true, None) => return Err(Invalid::Shape("missing field `scores` (use_scores = true)".into())),
            };
            Ok(Reply { scores, extra_logs: extra_logs(&obj, n)? })
        }
        Format::LlamaFactory { .. } => Ok(Reply { scores: numbers(&obj, "scores", n)?, extra_logs: Vec::new() }),
    }
}

/// `obj[field]`: a list of exactly `n` finite numbers.
fn numbers(obj: &Map<String, Value>, field: &str, n: usize) -> Result<Vec<f64>, Invalid> {
    let value = obj.get(field).ok_or_else(|| Invalid::Shape(format!("missing field `{field}`")))?;
    number_list(value, field, n)
}

fn number_list(value: &Value, what: &str, n: usize) -> Result<Vec<f64>, Invalid> {
    let Value::Array(items) = value else {
        return Err(Invalid::Shape(format!("`{what}` must be a list, got {}", kind(value))));
    };
    if items.len() != n {
        return Err(Invalid::Shape(format!("`{what}` has {} values for {n} samples", items.len())));
    }
    items.iter().enumerate().map(|(i, v)| number(v, &format!("{what}[{i}]"))).collect()
}

fn number(value: &Value, what: &str) -> Result<f64, Invalid> {
    match value.as_f64() {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(Invalid::Shape(format!("`{what}` is not a finite number: {}", short(value)))),
    }
}

fn extra_logs(obj: &Map<String, Value>, n: usize) -> Result<Vec<(String, ExtraLog)>, Invalid> {
    let Some(logs) = obj.get("extra_logs") else { return Ok(Vec::new()) };
    let Value::Object(logs) = logs else {
        return Err(Invalid::Shape(format!("`extra_logs` must be an object, got {}", kind(logs))));
    };
    logs.iter()
        .map(|(name, v)| {
            let what = format!("extra_logs.{name}");
            let log = match v {
                Value::Array(_) => ExtraLog::PerSample(number_list(v, &what, n)?),
                _ => ExtraLog::Scalar(number(v, &what)?),
            };
            Ok((name.clone(), log))
        })
        .collect()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt: &str, response: &str, label: Option<&str>) -> Sample {
        Sample {
            prompt: prompt.into(),
            response: response.into(),
            prompt_ids: vec![],
            response_ids: vec![],
            label: label.map(String::from),
            metadata: Value::Null,
            messages: vec![],
        }
    }

    const OPENRLHF: Format = Format::OpenRlhf { use_scores: false };

    fn parse(format: &Format, body: &str, n: usize) -> Result<Reply, Invalid> {
        parse_reply(format, body.as_bytes(), n)
    }

    fn shape(format: &Format, body: &str, n: usize) -> String {
        match parse(format, body, n) {
            Err(Invalid::Shape(m)) => m,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn request_bodies() {
        let samples = [sample("<user>2+2?<bot>", "4", Some("4")), sample("Hi", " there", None)];
        assert_eq!(
            request_body(&OPENRLHF, &samples),
            json!({
                "query": ["<user>2+2?<bot>4", "Hi there"],
                "prompts": ["<user>2+2?<bot>", "Hi"],
                "labels": ["4", null],
            })
        );
        let lf = Format::LlamaFactory { model: "rm".into() };
        assert_eq!(request_body(&lf, &samples), json!({"model": "rm", "messages": ["<user>2+2?<bot>4", "Hi there"]}));
    }

    #[test]
    fn openrlhf_replies() {
        let r =
            parse(&OPENRLHF, r#"{"rewards": [1, -0.5], "scores": [0, 1], "extra_logs": {"acc": [1, 0], "t": 3}}"#, 2)
                .unwrap();
        assert_eq!(r.scores, vec![1.0, -0.5]);
        assert_eq!(
            r.extra_logs,
            vec![("acc".into(), ExtraLog::PerSample(vec![1.0, 0.0])), ("t".into(), ExtraLog::Scalar(3.0))]
        );
        let use_scores = Format::OpenRlhf { use_scores: true };
        assert_eq!(parse(&use_scores, r#"{"rewards": [1, 2], "scores": [0, 1]}"#, 2).unwrap().scores, vec![0.0, 1.0]);
        assert_eq!(shape(&use_scores, r#"{"rewards": [1, 2]}"#, 2), "missing field `scores` (use_scores = true)");
        // `scores` is validated even when unused; unknown fields are fine.
        assert_eq!(shape(&OPENRLHF, r#"{"rewards": [1, 2], "scores": [1]}"#, 2), "`scores` has 1 values for 2 samples");
        assert_eq!(parse(&OPENRLHF, r#"{"rewards": [], "id": "x"}"#, 0).unwrap().scores, Vec::<f64>::new());
    }

    #[test]
    fn llamafactory_replies() {
        let lf = Format::LlamaFactory { model: "rm".into() };
        let body = r#"{"id": "scoreval-1", "object": "score.evaluation", "model": "rm", "scores": [0.25, 3]}"#;
        assert_eq!(parse(&lf, body, 2).unwrap(), Reply { scores: vec![0.25, 3.0], extra_logs: vec![] });
        assert_eq!(shape(&lf, r#"{"rewards": [1, 2]}"#, 2), "missing field `scores`");
    }

    #[test]
    fn invalid_replies() {
        assert_eq!(shape(&OPENRLHF, r#"{"reward": [1]}"#, 1), "missing field `rewards`");
        assert_eq!(shape(&OPENRLHF, r#"[1, 2]"#, 2), "expected a JSON object, got a list");
        assert_eq!(shape(&OPENRLHF, r#"{"rewards": 1}"#, 1), "`rewards` must be a list, got a number");
        assert_eq!(shape(&OPENRLHF, r#"{"rewards": [1, 2, 3]}"#, 2), "`rewards` has 3 values for 2 samples");
        assert_eq!(shape(&OPENRLHF, r#"{"rewards": [1, "NaN"]}"#, 2), "`rewards[1]` is not a finite number: \"NaN\"");
        assert_eq!(shape(&OPENRLHF, r#"{"rewards": [null]}"#, 1), "`rewards[0]` is not a finite number: null");
        assert_eq!(
            shape(&OPENRLHF, r#"{"rewards": [1], "extra_logs": {"acc": [1, 2]}}"#, 1),
            "`extra_logs.acc` has 2 values for 1 samples"
        );
        assert_eq!(
            shape(&OPENRLHF, r#"{"rewards": [1], "extra_logs": {"acc": "high"}}"#, 1),
            "`extra_logs.acc` is not a finite number: \"high\""
        );
        assert_eq!(
            shape(&OPENRLHF, r#"{"rewards": [1], "extra_logs": []}"#, 1),
            "`extra_logs` must be an object, got a list"
        );
        match parse(&OPENRLHF, r#"{"rewards": [1.0, NaN]}"#, 2) {
            Err(Invalid::Json(m)) => assert!(m.ends_with("(NaN and Infinity are not JSON numbers)"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Too large for an f64.
        assert!(matches!(parse(&OPENRLHF, r#"{"rewards": [1e400]}"#, 1), Err(Invalid::Json(_))));
        match parse(&OPENRLHF, "<html>oops</html>", 1) {
            Err(Invalid::Json(m)) => assert!(m.starts_with("expected value"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
