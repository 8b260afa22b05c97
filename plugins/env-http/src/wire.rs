//! The wire format: request bodies of `/reset` and `/step`, and strict validation of their
//! response bodies. No I/O here; the crate docs describe the format as users see it.

use base64::Engine as _;
use rlhf_plugin_api::{Action, Episode, Observation, ObservationImage, StepOutcome};
use serde_json::{json, Map, Value};

/// Why a 2xx response was rejected: `Json` (the body does not parse) or `Shape` (the JSON does
/// not have the expected shape or values). The shared client's type, which it turns into its
/// `invalid JSON` / `invalid response` errors.
pub use rlhf_http_client::Invalid;

/// The body of `POST {url}/reset`.
pub fn reset_body(episodes: &[Episode]) -> Value {
    let episodes: Vec<Value> = episodes
        .iter()
        .map(|e| {
            json!({
                "id": e.id,
                "prompt": e.prompt,
                "label": e.label,
                "metadata": e.metadata,
                "messages": e.messages,
            })
        })
        .collect();
    json!({ "episodes": episodes })
}

/// The body of `POST {url}/step`.
pub fn step_body(actions: &[Action]) -> Value {
    let actions: Vec<Value> = actions
        .iter()
        .map(|a| json!({"id": a.id, "turn": a.turn, "text": a.text, "token_ids": a.token_ids, "ended": a.ended}))
        .collect();
    json!({ "actions": actions })
}

/// Parses a `/reset` response: `{"observations": [string; n], "images": [[image]; n]?}`.
pub fn parse_reset(body: &[u8], n: usize) -> Result<Vec<Observation>, Invalid> {
    let obj = object(body)?;
    let items = list(&obj, "observations", n, "episodes")?;
    let images = match obj.get("images").filter(|v| !v.is_null()) {
        Some(_) => list(&obj, "images", n, "episodes")?.iter().collect(),
        None => vec![&Value::Null; n],
    };
    items
        .iter()
        .zip(images)
        .enumerate()
        .map(|(i, (v, imgs))| match v {
            Value::String(s) => Ok(Observation { text: s.clone(), images: images_of(imgs, &format!("images[{i}]"))? }),
            _ => Err(Invalid::Shape(format!("`observations[{i}]` must be a string, got {}", kind(v)))),
        })
        .collect()
}

/// An observation's images: a list whose entries are `{"bytes": base64}`, a
/// `data:image/…;base64,…` URL, or `{"path": str}` / a path string (a file the trainer can read).
fn images_of(value: &Value, what: &str) -> Result<Vec<ObservationImage>, Invalid> {
    let items = match value {
        Value::Null => return Ok(Vec::new()),
        Value::Array(items) => items,
        v => return Err(Invalid::Shape(format!("`{what}` must be a list of images, got {}", kind(v)))),
    };
    let decode = |text: &str, at: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map(ObservationImage::Bytes)
            .map_err(|e| Invalid::Shape(format!("`{at}` is not base64: {e}")))
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let at = format!("{what}[{i}]");
            match v {
                Value::String(s) if s.starts_with("data:") => match s.split_once(";base64,") {
                    Some((_, data)) => decode(data, &at),
                    None => Err(Invalid::Shape(format!("`{at}`: a data URL must be base64 (`;base64,`)"))),
                },
                Value::String(s) => Ok(ObservationImage::Path(s.into())),
                Value::Object(o) => match (o.get("bytes"), o.get("path")) {
                    (Some(Value::String(b)), _) => decode(b, &format!("{at}.bytes")),
                    (_, Some(Value::String(p))) => Ok(ObservationImage::Path(p.into())),
                    _ => Err(Invalid::Shape(format!("`{at}` must have a string `bytes` (base64) or `path`"))),
                },
                v => Err(Invalid::Shape(format!("`{at}` must be a string or an object, got {}", kind(v)))),
            }
        })
        .collect()
}

/// Parses a `/step` response: `{"results": [result; n]}`.
pub fn parse_step(body: &[u8], n: usize) -> Result<Vec<StepOutcome>, Invalid> {
    let obj = object(body)?;
    let items = list(&obj, "results", n, "actions")?;
    items.iter().enumerate().map(|(i, v)| outcome(v, &format!("results[{i}]"))).collect()
}

/// One result: `{"observation": str?, "reward": number?, "done": bool?, "metrics": {str: number}?,
/// "error": str|null?}`; unknown fields are ignored. An `error` ends the episode.
fn outcome(value: &Value, what: &str) -> Result<StepOutcome, Invalid> {
    let Value::Object(obj) = value else {
        return Err(Invalid::Shape(format!("`{what}` must be an object, got {}", kind(value))));
    };
    let field = |name: &str| obj.get(name).filter(|v| !v.is_null() || name == "reward");
    let observation = match field("observation") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(Invalid::Shape(format!("`{what}.observation` must be a string, got {}", kind(v)))),
    };
    let reward = match field("reward") {
        None => 0.0,
        Some(v) => number(v, &format!("{what}.reward"))?,
    };
    let done = match field("done") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(Invalid::Shape(format!("`{what}.done` must be a boolean, got {}", kind(v)))),
    };
    let metrics = match field("metrics") {
        None => Vec::new(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| Ok((k.clone(), number(v, &format!("{what}.metrics.{k}"))?)))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(Invalid::Shape(format!("`{what}.metrics` must be an object, got {}", kind(v)))),
    };
    let error = match field("error") {
        None => None,
        Some(Value::String(s)) if s.trim().is_empty() => Some("the environment server reported an error".to_string()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(Invalid::Shape(format!("`{what}.error` must be a string or null, got {}", kind(v)))),
    };
    let images = images_of(field("images").unwrap_or(&Value::Null), &format!("{what}.images"))?;
    Ok(StepOutcome { observation, images, reward, done: done || error.is_some(), metrics, error })
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        let mut msg = e.to_string();
        let text = String::from_utf8_lossy(body);
        if ["NaN", "Infinity"].iter().any(|w| text.contains(w)) {
            msg.push_str(" (NaN and Infinity are not JSON numbers)");
        }
        Invalid::Json(msg)
    })?;
    match value {
        Value::Object(obj) => Ok(obj),
        other => Err(Invalid::Shape(format!("expected a JSON object, got {}", kind(&other)))),
    }
}

/// `obj[field]`: a list of exactly `n` items (one per request item, `per` naming those).
fn list<'a>(obj: &'a Map<String, Value>, field: &str, n: usize, per: &str) -> Result<&'a Vec<Value>, Invalid> {
    let value = obj.get(field).ok_or_else(|| Invalid::Shape(format!("missing field `{field}`")))?;
    let Value::Array(items) = value else {
        return Err(Invalid::Shape(format!("`{field}` must be a list, got {}", kind(value))));
    };
    if items.len() != n {
        return Err(Invalid::Shape(format!("`{field}` has {} entries for {n} {per}", items.len())));
    }
    Ok(items)
}

fn number(value: &Value, what: &str) -> Result<f64, Invalid> {
    match value.as_f64() {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(Invalid::Shape(format!("`{what}` is not a finite number: {}", short(value)))),
    }
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
    use rlhf_plugin_api::reward::ChatMessage;

    fn shape(result: Result<impl std::fmt::Debug, Invalid>) -> String {
        match result {
            Err(Invalid::Shape(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    fn step(body: &str, n: usize) -> Result<Vec<StepOutcome>, Invalid> {
        parse_step(body.as_bytes(), n)
    }

    #[test]
    fn request_bodies() {
        let e = Episode {
            id: 7,
            prompt: "<user>hi<bot>".into(),
            prompt_ids: vec![1, 2],
            label: None,
            metadata: json!({"level": 3}),
            messages: vec![ChatMessage { role: "user".into(), content: "hi".into() }],
        };
        assert_eq!(
            reset_body(&[e]),
            json!({"episodes": [{"id": 7, "prompt": "<user>hi<bot>", "label": null, "metadata": {"level": 3},
                "messages": [{"role": "user", "content": "hi"}]}]})
        );
        let a = Action { id: 7, turn: 1, text: "go".into(), token_ids: vec![5, 6], ended: true };
        assert_eq!(
            step_body(&[a]),
            json!({"actions": [{"id": 7, "turn": 1, "text": "go", "token_ids": [5, 6], "ended": true}]})
        );
    }

    #[test]
    fn step_results() {
        let body = r#"{"results": [
            {"observation": "o", "reward": 0.5, "done": false, "metrics": {"calls": 1}, "error": null, "x": 1},
            {"reward": 2, "done": true},
            {},
            {"error": "boom", "metrics": null}
        ]}"#;
        let out = step(body, 4).unwrap();
        assert_eq!(out[0], StepOutcome { reward: 0.5, ..StepOutcome::observe("o").metric("calls", 1.0) });
        assert_eq!(out[1], StepOutcome::finish(2.0));
        assert_eq!(out[2], StepOutcome::default());
        assert_eq!(out[3], StepOutcome { done: true, error: Some("boom".into()), ..Default::default() });
        let out = step(r#"{"results": [{"error": ""}]}"#, 1).unwrap();
        assert_eq!(out[0].error.as_deref(), Some("the environment server reported an error"));
    }

    #[test]
    fn reset_observations() {
        let texts = |o: Vec<Observation>| o.into_iter().map(|o| o.text).collect::<Vec<_>>();
        assert_eq!(texts(parse_reset(br#"{"observations": ["a", ""]}"#, 2).unwrap()), ["a", ""]);
        assert_eq!(shape(parse_reset(br#"{"observations": ["a"]}"#, 2)), "`observations` has 1 entries for 2 episodes");
        assert_eq!(
            shape(parse_reset(br#"{"observations": [1]}"#, 1)),
            "`observations[0]` must be a string, got a number"
        );
        assert_eq!(shape(parse_reset(br#"{"obs": []}"#, 0)), "missing field `observations`");
    }

    #[test]
    fn invalid_step_results() {
        assert_eq!(shape(step(r#"{"results": [{}, {}]}"#, 3)), "`results` has 2 entries for 3 actions");
        assert_eq!(shape(step(r#"[]"#, 0)), "expected a JSON object, got a list");
        assert_eq!(shape(step(r#"{"results": {}}"#, 0)), "`results` must be a list, got an object");
        assert_eq!(shape(step(r#"{"results": [3]}"#, 1)), "`results[0]` must be an object, got a number");
        assert_eq!(
            shape(step(r#"{"results": [{"reward": null}]}"#, 1)),
            "`results[0].reward` is not a finite number: null"
        );
        assert_eq!(
            shape(step(r#"{"results": [{}, {"reward": "NaN"}]}"#, 2)),
            "`results[1].reward` is not a finite number: \"NaN\""
        );
        assert_eq!(
            shape(step(r#"{"results": [{"done": 1}]}"#, 1)),
            "`results[0].done` must be a boolean, got a number"
        );
        assert_eq!(
            shape(step(r#"{"results": [{"metrics": {"a": "x"}}]}"#, 1)),
            "`results[0].metrics.a` is not a finite number: \"x\""
        );
        assert_eq!(
            shape(step(r#"{"results": [{"error": 5}]}"#, 1)),
            "`results[0].error` must be a string or null, got a number"
        );
        match step(r#"{"results": [{"reward": NaN}]}"#, 1) {
            Err(Invalid::Json(m)) => assert!(m.ends_with("(NaN and Infinity are not JSON numbers)"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(step(r#"{"results": [{"reward": 1e400}]}"#, 1), Err(Invalid::Json(_))));
        assert!(matches!(step("<html>", 1), Err(Invalid::Json(m)) if m.starts_with("expected value")));
    }

    #[test]
    fn observation_images() {
        use ObservationImage::{Bytes, Path};
        let body = br#"{"results": [{"observation": "<image><image><image><image>", "images": [{"bytes": "iVBO"},
            "data:image/png;base64,AAEC", {"path": "/a.png"}, "/b.png"]}, {"observation": "x"}]}"#;
        let out = parse_step(body, 2).unwrap();
        let want = [Bytes(vec![0x89, 0x50, 0x4E]), Bytes(vec![0, 1, 2]), Path("/a.png".into()), Path("/b.png".into())];
        assert_eq!(out[0].images, want);
        assert!(out[1].images.is_empty());
        let step =
            |images: &str| shape(parse_step(format!(r#"{{"results": [{{"images": {images}}}]}}"#).as_bytes(), 1));
        assert!(step(r#"[{"bytes": "!!"}]"#).starts_with("`results[0].images[0].bytes` is not base64"));
        assert_eq!(step("[1]"), "`results[0].images[0]` must be a string or an object, got a number");
        assert_eq!(step(r#""x""#), "`results[0].images` must be a list of images, got a string");
        assert_eq!(step(r#"["data:image/png,abc"]"#), "`results[0].images[0]`: a data URL must be base64 (`;base64,`)");
        assert_eq!(step(r#"[{"url": 1}]"#), "`results[0].images[0]` must have a string `bytes` (base64) or `path`");
        let reset = parse_reset(br#"{"observations": ["<image>", "b"], "images": [[{"path": "/c.png"}], []]}"#, 2);
        let reset = reset.unwrap();
        assert_eq!((reset[0].images.as_slice(), reset[1].images.len()), (&[Path("/c.png".into())][..], 0));
        assert_eq!(
            shape(parse_reset(br#"{"observations": ["a"], "images": []}"#, 1)),
            "`images` has 0 entries for 1 episodes"
        );
    }
}
