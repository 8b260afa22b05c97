//! Prompts with images on vLLM: its token-in token-out endpoint `POST /inference/v1/generate`
//! (vLLM 0.32, served with `--enable-scale-out`), which takes a prompt's token ids with its images
//! as `content_parts` — the `multi_modal_data` of vLLM's offline `generate`, sent as data URLs of
//! the image files' own bytes. The completions endpoint takes no images.
//!
//! vLLM expands each image's placeholder itself, from one placeholder token per image to one per
//! merged patch, with the image processor of the checkpoint it serves. So the prompt goes out with
//! each run of placeholder tokens collapsed to one ([`collapse`]), and the prompt ids vLLM answers
//! with (`return_token_ids`) must be the trainer's own: a server whose processor resizes an
//! image to another grid (other `min_pixels`/`max_pixels`) would sample for a prompt the trainer
//! never scores, and is stopped with an error naming the prompt.
//!
//! What vLLM 0.32 answers: `{"prompt_token_ids", "choices": [{"index", "token_ids",
//! "logprobs": {"content": [{"token_id", "logprob", ...}]}, "finish_reason", ...}]}`, one choice
//! per sample; the sampled token's log-prob is the `logprob` of its entry.

use reqwest::Method;
use rlhf_vision::ImageRef;
use serde_json::{json, Value};

use super::client::{clip, kind, Completion, Sampling, VllmClient, VllmError};

/// The endpoint.
const PATH: &str = "/inference/v1/generate";
/// The most placeholder tokens one image expands to, for the bound on an answer's size: Qwen2.5-VL's
/// largest default grid (`max_pixels` 12,845,056 over 28 × 28 pixels a token) is 16,384.
const IMAGE_TOKENS: i64 = 16_384;

/// `ids` with each run of `placeholder` tokens collapsed to one, and the runs' count.
pub fn collapse(ids: &[u32], placeholder: u32) -> (Vec<u32>, usize) {
    let mut out = Vec::with_capacity(ids.len());
    let mut runs = 0;
    for (i, &t) in ids.iter().enumerate() {
        if t == placeholder && i > 0 && ids[i - 1] == placeholder {
            continue;
        }
        runs += usize::from(t == placeholder);
        out.push(t);
    }
    (out, runs)
}

impl VllmClient {
    /// `n` completions of one prompt (token ids, each image's placeholder run collapsed to one
    /// token) with its `images` in order; returns them and the prompt's ids as the server
    /// expanded them. `model` is the served model name.
    pub fn generate(
        &self,
        model: &str,
        prompt: &[u32],
        images: &[ImageRef],
        n: usize,
        s: &Sampling,
    ) -> Result<(Vec<Completion>, Vec<u32>), VllmError> {
        let invalid = |what: String| VllmError::Invalid { url: self.url().to_string(), what };
        let parts = images
            .iter()
            .map(|i| {
                let url = i.data_url().map_err(|e| invalid(format!("image {}: {e}", i.name())))?;
                Ok(json!({"type": "image_url", "url": url}))
            })
            .collect::<Result<Vec<Value>, VllmError>>()?;
        let mut body = json!({
            "model": model,
            "token_ids": prompt,
            "sampling_params": s.to_json(n),
            "return_token_ids": true,
        });
        if let (false, Some(map)) = (parts.is_empty(), body.as_object_mut()) {
            map.insert("content_parts".into(), Value::Array(parts));
        }
        // The answer holds the expanded prompt (its images' placeholder runs) and n samples.
        let limit =
            super::client::body_limit(n + 1, prompt.len() as i64 + images.len() as i64 * IMAGE_TOKENS + s.max_tokens);
        let text = self.send_bounded(Method::POST, PATH, Some(&body), limit)?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| self.malformed(PATH, format!("not JSON ({e}): {}", clip(&text))))?;
        parse(&value, n).map_err(|what| self.malformed(PATH, what))
    }
}

/// The completions (by `index`) and the expanded prompt ids of a generate answer.
fn parse(v: &Value, n: usize) -> Result<(Vec<Completion>, Vec<u32>), String> {
    let prompt = ids(v.get("prompt_token_ids"), "prompt_token_ids (was return_token_ids sent?)")?;
    let choices = v.get("choices").and_then(Value::as_array).ok_or("no `choices` array")?;
    if choices.len() != n {
        return Err(format!("expected {n} choices, got {}", choices.len()));
    }
    let mut slots: Vec<Option<Completion>> = vec![None; n];
    for (i, c) in choices.iter().enumerate() {
        let index = c.get("index").and_then(Value::as_u64).ok_or(format!("choices[{i}]: no index"))?;
        let slot = usize::try_from(index)
            .ok()
            .and_then(|k| slots.get_mut(k))
            .ok_or(format!("choices[{i}]: index {index} out of range 0..{n}"))?;
        if slot.is_some() {
            return Err(format!("choices[{i}]: index {index} appears twice"));
        }
        *slot = Some(choice(c, i)?);
    }
    Ok((slots.into_iter().flatten().collect(), prompt))
}

fn ids(v: Option<&Value>, what: &str) -> Result<Vec<u32>, String> {
    let list = match v {
        Some(Value::Array(list)) => list,
        Some(Value::Null) | None => return Err(format!("no {what}")),
        Some(other) => return Err(format!("{what} is {}, not an array", kind(other))),
    };
    list.iter()
        .enumerate()
        .map(|(j, t)| {
            t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or(format!("{what}[{j}]: {t} is not a token id"))
        })
        .collect()
}

/// One choice: its token ids, the sampled tokens' log-probs (each entry's `token_id` must be the
/// token it stands for) and finish reason.
fn choice(c: &Value, i: usize) -> Result<Completion, String> {
    let token_ids = ids(c.get("token_ids"), &format!("choices[{i}].token_ids"))?;
    let content = c
        .get("logprobs")
        .and_then(|l| l.get("content"))
        .and_then(Value::as_array)
        .ok_or(format!("choices[{i}]: no logprobs.content (were logprobs asked for?)"))?;
    if content.len() != token_ids.len() {
        return Err(format!("choices[{i}]: {} log-probs for {} token ids", content.len(), token_ids.len()));
    }
    let logprobs = content
        .iter()
        .zip(&token_ids)
        .enumerate()
        .map(|(j, (e, &t))| {
            if e.get("token_id").and_then(Value::as_u64) != Some(u64::from(t)) {
                return Err(format!("choices[{i}].logprobs.content[{j}] is not of token {t}"));
            }
            match e.get("logprob").and_then(Value::as_f64) {
                Some(x) if x.is_finite() => Ok(x),
                _ => Err(format!("choices[{i}].logprobs.content[{j}].logprob is not a finite number")),
            }
        })
        .collect::<Result<Vec<f64>, String>>()?;
    let finish_reason = match c.get("finish_reason") {
        Some(Value::String(r)) => r.clone(),
        _ => return Err(format!("choices[{i}]: no finish_reason")),
    };
    Ok(Completion { token_ids, logprobs, finish_reason })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_placeholder_run_collapses_to_one_token() {
        assert_eq!(collapse(&[5, 9, 9, 9, 6, 7, 9, 9, 6], 9), (vec![5, 9, 6, 7, 9, 6], 2));
        assert_eq!(collapse(&[1, 2, 3], 9), (vec![1, 2, 3], 0));
        assert_eq!(collapse(&[9], 9), (vec![9], 1));
    }

    fn answer(choices: Vec<Value>) -> Value {
        json!({"prompt_token_ids": [1, 9, 9, 2], "choices": choices})
    }

    fn ch(index: u64, ids: &[u32]) -> Value {
        let content: Vec<Value> =
            ids.iter().map(|&t| json!({"token_id": t, "logprob": -f64::from(t), "rank": 1})).collect();
        json!({"index": index, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length"})
    }

    #[test]
    fn choices_are_read_by_index_with_the_expanded_prompt() {
        let (c, prompt) = parse(&answer(vec![ch(1, &[4, 5]), ch(0, &[3])]), 2).unwrap();
        assert_eq!(prompt, [1, 9, 9, 2]);
        assert_eq!(c[0].token_ids, [3]);
        assert_eq!(c[1].logprobs, [-4.0, -5.0]);
    }

    #[test]
    fn bad_answers_are_named() {
        let e = parse(&answer(vec![ch(0, &[3])]), 2).unwrap_err();
        assert_eq!(e, "expected 2 choices, got 1");
        let e = parse(&answer(vec![ch(0, &[3]), ch(0, &[4])]), 2).unwrap_err();
        assert_eq!(e, "choices[1]: index 0 appears twice");
        let mut c = ch(0, &[3, 4]);
        c["logprobs"]["content"][1]["token_id"] = json!(7);
        assert_eq!(parse(&answer(vec![c]), 1).unwrap_err(), "choices[0].logprobs.content[1] is not of token 4");
        let mut c = ch(0, &[3]);
        c["logprobs"] = Value::Null;
        assert!(parse(&answer(vec![c]), 1).unwrap_err().contains("no logprobs.content"));
        let e = parse(&json!({"choices": [ch(0, &[3])]}), 1).unwrap_err();
        assert!(e.contains("no prompt_token_ids"), "{e}");
    }
}
