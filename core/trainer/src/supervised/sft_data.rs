//! Supervised fine-tuning examples: JSONL lines → token ids with a per-token loss mask.
//!
//! A line is `{"prompt": "...", "response": "..."}`, `{"messages": [{"role", "content"}, ...]}`, or
//! TRL's conversational prompt-completion: `prompt` a list of messages and `response` (TRL's
//! `completion`, with `data.response_key = "completion"`) one assistant message, trained on alone.
//!
//! - **prompt/response**: when the tokenizer has a chat template (and `data.apply_chat_template`),
//!   the prompt becomes a user turn and the response an assistant turn, rendered like `messages`;
//!   otherwise the prompt is raw text, tokenized with the tokenizer's special tokens (as `rlhf
//!   train` tokenizes prompts), the response is tokenized on its own and EOS is appended — so the
//!   ids are exactly what the policy sees at rollout: prompt ids, then generated ids, then EOS.
//! - **messages**: the conversation (up to its last assistant turn) is rendered with the chat
//!   template. Assistant turn k spans from the end of `render(messages[..k], add_generation_prompt)`
//!   to the end of `render(messages[..=k])`; the rendered text is cut at these boundaries and each
//!   piece tokenized on its own (no special tokens added: the template writes them), so every
//!   piece is whole tokens. The loss covers every assistant turn (`assistant_turns = "all"`) or the
//!   last one (`"last"`); a template that does not render a conversation's prefix as a prefix of the
//!   whole (e.g. one that drops earlier reasoning) trains on the last turn only. When the final
//!   reply holds no EOS id (a template without an end-of-turn token that is also EOS), EOS is
//!   appended and counted, so the model learns to stop.
//!
//! Labels: a token is a target when it lies in a counted assistant span or is the appended EOS
//! (`loss_on_prompt = true`: every token but the first). Sequences longer than `max_len` are cut to
//! their first `max_len` tokens (DeepSpeed-Chat's truncation) or dropped (`overlong = "drop"`);
//! both are counted. Bad lines are counted per reason (see [`super::phase::DataReport`]).
//!
//! Packing ([`pack`]): whole examples are concatenated, in a seeded order, into rows of at most
//! `max_len` tokens, each example ending in its EOS. The row's attention mask numbers the examples
//! (1, 2, 3...; 0 = padding), which the models read as a block-diagonal causal mask with position
//! ids restarting at every example — transformers' padding-free packing — so each example's logits
//! are exactly those it gets alone. The first token of every example is never a target.

use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

use super::phase::{DataReport, Overlong, SourceLines};
pub use crate::config::AssistantTurns;
use crate::data::SplitMix;
use crate::error::Result;

/// How lines become examples.
#[derive(Debug, Clone)]
pub struct SftTokenizeOptions {
    /// Tokens per example (after rendering).
    pub max_len: usize,
    /// Render prompt/response lines through the chat template when the tokenizer has one.
    pub apply_chat_template: bool,
    /// Train on every token, not only the response.
    pub loss_on_prompt: bool,
    pub assistant_turns: AssistantTurns,
    pub overlong: Overlong,
}

/// One tokenized example (or packed row).
#[derive(Debug, Clone, PartialEq)]
pub struct SftExample {
    /// Token ids.
    pub ids: Vec<i64>,
    /// `targets[t]`: token `t` is predicted (from `ids[..t]`) in the loss; `targets[0]` is false.
    pub targets: Vec<bool>,
    /// Source line (the first example's, for a packed row).
    pub line: usize,
    /// Where each example of a packed row begins (`[0]` for a single example).
    pub starts: Vec<usize>,
}

impl SftExample {
    /// Tokens counted by the loss.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t).count()
    }
}

fn string_field(obj: &Map<String, Value>, key: &str) -> std::result::Result<Option<String>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{key}` is not a string")),
    }
}

/// Parses a `[{"role", "content"}]` list.
pub(crate) fn messages_field(v: &Value, key: &str) -> std::result::Result<Vec<ChatMessage>, String> {
    serde_json::from_value::<Vec<ChatMessage>>(v.clone())
        .map_err(|_| format!("`{key}` is not a list of {{\"role\", \"content\"}} messages"))
}

/// A piece of the rendered text and whether it is trained on.
type Piece = (String, bool);

/// Splits a templated conversation into prompt / assistant pieces (see the module docs).
fn chat_pieces(
    tok: &HfTokenizer,
    messages: &[ChatMessage],
    turns: AssistantTurns,
) -> std::result::Result<Vec<Piece>, String> {
    let Some(last) = messages.iter().rposition(|m| m.role == "assistant") else {
        return Err("no assistant message".into());
    };
    if messages[last].content.trim().is_empty() {
        return Err("empty response".into());
    }
    let msgs = &messages[..=last];
    let render = |m: &[ChatMessage], gen: bool| -> std::result::Result<String, String> {
        if m.is_empty() {
            return Ok(String::new());
        }
        tok.apply_chat_template(m, gen).map_err(|e| format!("chat template failed: {e}"))
    };
    let full = render(msgs, false)?;
    let assistant: Vec<usize> = match turns {
        AssistantTurns::All => (0..=last).filter(|&k| msgs[k].role == "assistant").collect(),
        AssistantTurns::Last => vec![last],
    };
    // Byte spans of the assistant replies in `full`.
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for &k in &assistant {
        let (p, q) = (render(&msgs[..k], true)?, render(&msgs[..=k], false)?);
        let ok = full.starts_with(&p) && full.starts_with(&q) && p.len() <= q.len();
        let after_previous = spans.last().is_none_or(|&(_, e)| e <= p.len());
        if ok && after_previous {
            spans.push((p.len(), q.len()));
        } else if k == last {
            // Keep only the final reply when an earlier one could not be placed.
            spans.clear();
            if ok {
                spans.push((p.len(), q.len()));
            } else {
                return Err("chat template does not render the conversation's prefix as a prefix".into());
            }
        }
    }
    let mut pieces = Vec::new();
    let mut pos = 0;
    for (s, e) in spans {
        if s > pos {
            pieces.push((full[pos..s].to_string(), false));
        }
        if e > s {
            pieces.push((full[s..e].to_string(), true));
        }
        pos = e;
    }
    if pos < full.len() {
        pieces.push((full[pos..].to_string(), false));
    }
    Ok(pieces)
}

/// Tokenizes one line; `Err(reason)` when it is skipped. `Ok((example, truncated))`.
fn tokenize_line(
    tok: &HfTokenizer,
    obj: &Map<String, Value>,
    opts: &SftTokenizeOptions,
    eos: &[i64],
    line: usize,
) -> std::result::Result<(SftExample, bool), String> {
    let templated_ok = opts.apply_chat_template && tok.has_chat_template();
    // (pieces, special tokens added by the tokenizer to the first piece?)
    let (pieces, raw) = if let Some(m) = obj.get("messages") {
        let messages = messages_field(m, "messages")?;
        if !tok.has_chat_template() {
            return Err("chat `messages` but the tokenizer has no chat template".into());
        }
        (chat_pieces(tok, &messages, opts.assistant_turns)?, false)
    } else if let (Some(p @ Value::Array(_)), Some(c)) = (obj.get("prompt"), obj.get("response")) {
        // TRL's conversational prompt-completion: the prompt's messages, then one assistant reply.
        let mut messages = messages_field(p, "prompt")?;
        let completion = messages_field(c, "response")?;
        if !matches!(completion.as_slice(), [m] if m.role == "assistant") {
            return Err("`response`: a conversational completion must be one assistant message".into());
        }
        if !tok.has_chat_template() {
            return Err("chat messages but the tokenizer has no chat template".into());
        }
        messages.extend(completion);
        (chat_pieces(tok, &messages, AssistantTurns::Last)?, false)
    } else {
        let prompt = string_field(obj, "prompt")?;
        let response = string_field(obj, "response")?;
        let (prompt, response) = match (prompt, response) {
            (Some(p), Some(r)) => (p, r),
            (None, Some(_)) => return Err("missing field `prompt`".into()),
            (Some(_), None) => return Err("missing field `response`".into()),
            (None, None) => return Err("missing fields (`prompt` and `response`, or `messages`)".into()),
        };
        if response.trim().is_empty() {
            return Err("empty response".into());
        }
        if templated_ok {
            let msgs = [ChatMessage::new("user", prompt), ChatMessage::new("assistant", response)];
            (chat_pieces(tok, &msgs, AssistantTurns::Last)?, false)
        } else {
            (vec![(prompt, false), (response, true)], true)
        }
    };
    let mut ids: Vec<i64> = Vec::new();
    let mut targets: Vec<bool> = Vec::new();
    for (i, (text, counted)) in pieces.iter().enumerate() {
        if text.is_empty() {
            continue;
        }
        let add_special = raw && i == 0;
        let piece = tok.encode(text, add_special).map_err(|e| format!("cannot tokenize: {e}"))?;
        ids.extend(piece.iter().map(|&t| i64::from(t)));
        targets.extend(std::iter::repeat_n(*counted, piece.len()));
    }
    // EOS after the final reply unless the reply already holds one.
    let last_span_has_eos = {
        let mut t = targets.len();
        while t > 0 && !targets[t - 1] {
            t -= 1;
        }
        let mut s = t;
        while s > 0 && targets[s - 1] {
            s -= 1;
        }
        ids[s..t].iter().any(|i| eos.contains(i))
    };
    if let Some(&e) = eos.first() {
        if !last_span_has_eos && targets.iter().any(|&t| t) {
            ids.push(e);
            targets.push(true);
        }
    }
    if opts.loss_on_prompt {
        targets.iter_mut().for_each(|t| *t = true);
    }
    if let Some(t) = targets.first_mut() {
        *t = false;
    }
    let mut truncated = false;
    if ids.len() > opts.max_len {
        match opts.overlong {
            Overlong::Drop => return Err(format!("longer than max_len = {} tokens", opts.max_len)),
            Overlong::Truncate => {
                ids.truncate(opts.max_len);
                targets.truncate(opts.max_len);
                truncated = true;
            }
        }
    }
    if ids.len() < 2 || !targets.iter().any(|&t| t) {
        return Err(if truncated {
            format!("no response token within max_len = {} tokens", opts.max_len)
        } else {
            "no token to train on".into()
        });
    }
    Ok((SftExample { ids, targets, line, starts: vec![0] }, truncated))
}

/// Tokenizes every line of `src`; bad lines are counted in `report` (never an error here).
pub fn build_sft_examples(
    src: &SourceLines,
    tok: &HfTokenizer,
    opts: &SftTokenizeOptions,
    report: &mut DataReport,
) -> Vec<SftExample> {
    let eos: Vec<i64> = tok.eos_token_ids().iter().map(|&i| i64::from(i)).collect();
    let mut out = Vec::new();
    for (line, obj) in src.objects(report) {
        match tokenize_line(tok, &obj, opts, &eos, line) {
            Ok((ex, truncated)) => {
                if truncated {
                    report.truncate(line, &format!("longer than max_len = {} tokens", opts.max_len));
                }
                out.push(ex);
            }
            Err(reason) => report.skip(line, &reason),
        }
    }
    out
}

/// Packs whole examples, in a seeded order, into rows of at most `max_len` tokens (see the module
/// docs). The first token of every example after a row's first is not a target.
pub fn pack(examples: &[SftExample], max_len: usize, seed: u64) -> Vec<SftExample> {
    let mut order: Vec<usize> = (0..examples.len()).collect();
    SplitMix(seed ^ 0x9ACC).shuffle(&mut order);
    let mut rows: Vec<SftExample> = Vec::new();
    let mut cur: Option<SftExample> = None;
    for i in order {
        let ex = &examples[i];
        match &mut cur {
            Some(row) if row.ids.len() + ex.ids.len() <= max_len => {
                row.starts.push(row.ids.len());
                row.ids.extend_from_slice(&ex.ids);
                row.targets.push(false);
                row.targets.extend_from_slice(&ex.targets[1..]);
            }
            _ => {
                if let Some(row) = cur.take() {
                    rows.push(row);
                }
                cur = Some(ex.clone());
            }
        }
    }
    rows.extend(cur);
    rows
}

/// A right-padded batch of examples.
#[derive(Debug)]
pub struct SftBatch {
    /// `[B, T]` int64.
    pub input_ids: Tensor,
    /// `[B, T]` int64: 0 on padding, else the token's example number within its row (1 for an
    /// unpacked row; 1, 2, 3... along a packed one — see [`rlhf_models::position_ids_from_mask`]).
    pub attention_mask: Tensor,
    /// `[B, T - 1]` f32: 1 where token `t + 1` is a target (the frame of
    /// `token_logprobs(.., from = 1)`).
    pub target_mask: Tensor,
    /// Targets in the batch.
    pub targets: usize,
    /// Real (non-pad) tokens in the batch.
    pub tokens: usize,
}

/// Right-pads `examples` with `pad`.
///
/// # Shapes
/// - returns `input_ids`, `attention_mask`: `[B, T]`, `target_mask`: `[B, T - 1]` with
///   `T = max(len) >= 2`.
pub fn collate(examples: &[&SftExample], pad: i64, device: Device) -> Result<SftBatch> {
    let b = examples.len();
    let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0).max(2);
    let mut ids = vec![pad; b * t];
    let mut mask = vec![0i64; b * t];
    let mut tm = vec![0f32; b * (t - 1)];
    let (mut targets, mut tokens) = (0, 0);
    for (i, e) in examples.iter().enumerate() {
        for (j, (&id, &target)) in e.ids.iter().zip(&e.targets).enumerate() {
            ids[i * t + j] = id;
            mask[i * t + j] = e.starts.iter().filter(|&&s| s <= j).count().max(1) as i64;
            if target && j > 0 {
                tm[i * (t - 1) + j - 1] = 1.0;
                targets += 1;
            }
        }
        tokens += e.ids.len();
    }
    let (b, t) = (b as i64, t as i64);
    Ok(SftBatch {
        input_ids: Tensor::f_from_slice(&ids)?.f_view([b, t])?.f_to_device(device)?,
        attention_mask: Tensor::f_from_slice(&mask)?.f_view([b, t])?.f_to_device(device)?,
        target_mask: Tensor::f_from_slice(&tm)?.f_view([b, t - 1])?.f_to_device(device)?,
        targets,
        tokens,
    })
}

/// `−Σ logprobs · target_mask` in f32 ([`rlhf_generation::masked_nll_sum`]).
///
/// # Shapes
/// `logprobs`, `target_mask`: `[batch, seq]`; returns a scalar.
pub fn masked_nll_sum(logprobs: &Tensor, target_mask: &Tensor) -> Result<Tensor> {
    Ok(rlhf_generation::masked_nll_sum(logprobs, target_mask, Kind::Float)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervised::phase::RawLine;
    use serde_json::json;
    use std::path::Path;

    fn opts() -> SftTokenizeOptions {
        SftTokenizeOptions {
            max_len: 64,
            apply_chat_template: true,
            loss_on_prompt: false,
            assistant_turns: AssistantTurns::All,
            overlong: Overlong::Truncate,
        }
    }

    fn src(values: Vec<Value>) -> SourceLines {
        SourceLines {
            label: "t.jsonl".into(),
            lines: values.into_iter().enumerate().map(|(i, v)| (i + 1, RawLine::Json(v))).collect(),
        }
    }

    fn tiny_tok() -> (tempfile::TempDir, HfTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        crate::builtin_models::write_tiny_model(dir.path(), 1).unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    #[test]
    fn raw_prompt_is_masked_and_response_plus_eos_count() {
        // Vocabulary: <pad>=0 <eos>=1 <unk>=2, digits "0".."9" = 3..12, "+"=13, "="=14.
        // "3 + 4 =" -> [6, 13, 7, 14], response "7" -> [10], then EOS 1.
        let (_d, tok) = tiny_tok();
        let mut r = DataReport::default();
        let ex = build_sft_examples(&src(vec![json!({"prompt": "3 + 4 =", "response": "7"})]), &tok, &opts(), &mut r);
        assert_eq!(ex[0].ids, vec![6, 13, 7, 14, 10, 1]);
        assert_eq!(ex[0].targets, vec![false, false, false, false, true, true]);
        // loss_on_prompt: everything but the first token.
        let o = SftTokenizeOptions { loss_on_prompt: true, ..opts() };
        let ex = build_sft_examples(&src(vec![json!({"prompt": "3 + 4 =", "response": "7"})]), &tok, &o, &mut r);
        assert_eq!(ex[0].targets, vec![false, true, true, true, true, true]);
        // Truncation to 5 keeps the response token but cuts EOS; to 4 leaves no target: skipped.
        let o = SftTokenizeOptions { max_len: 5, ..opts() };
        let ex = build_sft_examples(&src(vec![json!({"prompt": "3 + 4 =", "response": "7"})]), &tok, &o, &mut r);
        assert_eq!((ex[0].ids.len(), ex[0].target_count()), (5, 1));
        let o = SftTokenizeOptions { max_len: 4, ..opts() };
        assert!(
            build_sft_examples(&src(vec![json!({"prompt": "3 + 4 =", "response": "7"})]), &tok, &o, &mut r).is_empty()
        );
        assert_eq!(r.count("no response token within max_len = 4 tokens"), 1);
        assert_eq!(r.count("longer than max_len = 5 tokens"), 1);

        // The batch's target mask is the targets shifted into the `from = 1` frame.
        let a =
            SftExample { ids: vec![6, 13, 10, 1], targets: vec![false, false, true, true], line: 1, starts: vec![0] };
        let b = SftExample { ids: vec![5, 1], targets: vec![false, true], line: 2, starts: vec![0] };
        let batch = collate(&[&a, &b], 0, Device::Cpu).unwrap();
        assert_eq!(Vec::<f32>::try_from(batch.target_mask.view(-1)).unwrap(), vec![0., 1., 1., 1., 0., 0.]);
        assert_eq!(Vec::<i64>::try_from(batch.input_ids.view(-1)).unwrap(), vec![6, 13, 10, 1, 5, 1, 0, 0]);
        assert_eq!((batch.targets, batch.tokens), (3, 6));
        // NLL sum over targets: logprobs -1, -2, -3 at the three targets = 6.
        let lp = Tensor::from_slice(&[-9f32, -1., -2., -3., -9., -9.]).view([2, 3]);
        assert_eq!(masked_nll_sum(&lp, &batch.target_mask).unwrap().double_value(&[]), 6.0);
    }

    #[test]
    fn chat_turns_are_masked_by_role() {
        // The fixture's ChatML template: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        // then "<|im_start|>{role}\n{content}<|im_end|>\n" per message.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models/llama");
        let tok = HfTokenizer::from_dir(&dir).unwrap();
        let conv = json!({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]});
        let mut r = DataReport::default();
        let ex = &build_sft_examples(&src(vec![conv.clone()]), &tok, &opts(), &mut r)[0];
        let text_of = |want: bool| -> String {
            let ids: Vec<u32> =
                ex.ids.iter().zip(&ex.targets).filter(|(_, &t)| t == want).map(|(&i, _)| i as u32).collect();
            tok.decode(&ids, false).unwrap()
        };
        assert_eq!(text_of(true), "hello there<|im_end|>\nsee you<|im_end|>\n");
        let full = tok
            .apply_chat_template(&serde_json::from_value::<Vec<ChatMessage>>(conv["messages"].clone()).unwrap(), false)
            .unwrap();
        assert_eq!(tok.decode(&ex.ids.iter().map(|&i| i as u32).collect::<Vec<_>>(), false).unwrap(), full);
        // <|im_end|> is EOS here, so nothing was appended after the template's text.
        assert!(tok.eos_token_ids().contains(&tok.token_to_id("<|im_end|>").unwrap()));
        let last = SftTokenizeOptions { assistant_turns: AssistantTurns::Last, ..opts() };
        let ex = &build_sft_examples(&src(vec![conv]), &tok, &last, &mut r)[0];
        let ids: Vec<u32> = ex.ids.iter().zip(&ex.targets).filter(|(_, &t)| t).map(|(&i, _)| i as u32).collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "see you<|im_end|>\n");
        // prompt/response with a template: a user turn and an assistant turn.
        let ex = &build_sft_examples(&src(vec![json!({"prompt": "hi", "response": "yo"})]), &tok, &opts(), &mut r)[0];
        let ids: Vec<u32> = ex.ids.iter().zip(&ex.targets).filter(|(_, &t)| t).map(|(&i, _)| i as u32).collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "yo<|im_end|>\n");
        assert_eq!(r.skipped(), 0);
        // TRL's conversational prompt-completion: the context is not trained on, the reply is.
        let line = json!({
            "prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                       {"role": "user", "content": "bye"}],
            "response": [{"role": "assistant", "content": "see you"}]});
        let ex = &build_sft_examples(&src(vec![line]), &tok, &opts(), &mut r)[0];
        let ids: Vec<u32> = ex.ids.iter().zip(&ex.targets).filter(|(_, &t)| t).map(|(&i, _)| i as u32).collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "see you<|im_end|>\n");
        let two = json!({"prompt": [{"role": "user", "content": "hi"}],
                         "response": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]});
        assert!(build_sft_examples(&src(vec![two]), &tok, &opts(), &mut r).is_empty());
        assert_eq!(r.count("`response`: a conversational completion must be one assistant message"), 1);
    }

    #[test]
    fn bad_lines_are_counted_by_reason() {
        let (_d, tok) = tiny_tok();
        let s = SourceLines {
            label: "t.jsonl".into(),
            lines: vec![
                (1, RawLine::Text("nope".into())),
                (2, RawLine::Text("[1]".into())),
                (3, RawLine::Text("{\"prompt\": \"1 + 1 =\"}".into())),
                (4, RawLine::Text("{\"prompt\": \"1 + 1 =\", \"response\": \"  \"}".into())),
                (5, RawLine::Text("{\"prompt\": \"1 + 1 =\", \"response\": 2}".into())),
                (6, RawLine::Text("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}".into())),
                (7, RawLine::Text("{\"prompt\": \"1 + 1 =\", \"response\": \"2\"}".into())),
                (8, RawLine::Text("{\"prompt\": \"1 + 2 =\", \"response\": \"\"}".into())),
            ],
        };
        let mut r = DataReport::default();
        let ex = build_sft_examples(&s, &tok, &opts(), &mut r);
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].line, 7);
        let m = r.messages("t.jsonl");
        assert_eq!(
            m,
            vec![
                "t.jsonl: skipped 1 line (not valid JSON), first at line 1",
                "t.jsonl: skipped 1 line (not a JSON object), first at line 2",
                "t.jsonl: skipped 1 line (missing field `response`), first at line 3",
                "t.jsonl: skipped 2 lines (empty response), first at line 4",
                "t.jsonl: skipped 1 line (`response` is not a string), first at line 5",
                "t.jsonl: skipped 1 line (chat `messages` but the tokenizer has no chat template), first at line 6",
            ]
        );
    }

    #[test]
    fn packing_keeps_examples_whole_and_masks_boundaries() {
        let ex = |n: usize, line| SftExample {
            ids: (0..n as i64).map(|i| 10 + i).collect(),
            targets: (0..n).map(|i| i > 0).collect(),
            line,
            starts: vec![0],
        };
        let examples = vec![ex(3, 1), ex(4, 2), ex(2, 3), ex(5, 4)];
        let rows = pack(&examples, 7, 0);
        let total: usize = rows.iter().map(|r| r.ids.len()).sum();
        assert_eq!(total, 14);
        for r in &rows {
            assert!(r.ids.len() <= 7);
            assert_eq!(r.ids.len(), r.targets.len());
            // Every example starts with id 10, which is never a target, and is recorded as a start.
            for (i, &id) in r.ids.iter().enumerate() {
                assert_eq!(r.targets[i], id != 10, "row {r:?}");
                assert_eq!(r.starts.contains(&i), id == 10, "row {r:?}");
            }
        }
        // The attention mask numbers the examples of each row.
        let two = rows.iter().find(|r| r.starts.len() == 2).unwrap();
        let batch = collate(&[two], 0, Device::Cpu).unwrap();
        let s = two.starts[1];
        let want: Vec<i64> = (0..two.ids.len()).map(|j| if j < s { 1 } else { 2 }).collect();
        assert_eq!(Vec::<i64>::try_from(batch.attention_mask.view(-1)).unwrap(), want);
    }
}
