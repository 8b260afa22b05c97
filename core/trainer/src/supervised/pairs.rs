//! Preference pairs for reward-model training (and DPO) and the pairwise losses.
//!
//! A line is DeepSpeed-Chat's `{"prompt": "...", "chosen": "...", "rejected": "..."}` (the responses
//! carry their own leading space, as DSC writes them) or chat lists: `chosen`/`rejected` as message
//! lists (whole conversations, or the assistant reply after a `prompt` that is a string or a message
//! list). Each side becomes the text the reward model judges at RL time, built exactly as the
//! `reward-model` plugin and `rlhf serve-reward` build it (`RewardModelScorer::render` and `encode`):
//! with a chat template (and `data.apply_chat_template`), the conversation plus the reply rendered
//! with `add_generation_prompt = false`; without one, `prompt + response` as plain text. The text is
//! tokenized with the tokenizer's special tokens (a doubled leading BOS dropped once). No EOS is
//! appended by default (`data.append_eos`), since the scorer reads the text as is.
//!
//! Bad lines (a missing field, an empty response, chosen == rejected, ...) are counted per reason.
//! A pair longer than `max_len` is cut to its first `max_len` tokens (DSC) or dropped; a pair whose
//! two sides become identical through truncation is skipped.
//!
//! For DPO, [`build_split_pairs`] reads lines the same way and also finds where each side's
//! response starts (after its common prefix with the prompt's own tokens).
//!
//! Losses ([`pairwise_loss`]):
//! - `dsc` (default, DeepSpeed-Chat phase 2): per pair, from the first position where chosen and
//!   rejected differ (token or padding) to the end of the longer one, the mean of
//!   `−log σ(v_c[t] − v_r[t])` over that segment; the batch loss is the mean over pairs. The score
//!   of a sequence is the value at its last real token.
//! - `last_token` (TRL / OpenRLHF): `−log σ(score_c − score_r)`, averaged over pairs.

use rlhf_tokenizer::{ChatMessage, HfTokenizer};
use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

use super::phase::{DataReport, Overlong, SourceLines, Splits};
use super::sft_data::messages_field;
pub use crate::config::RmLoss;
use crate::error::Result;

/// How lines become pairs.
#[derive(Debug, Clone)]
pub struct PairOptions {
    pub max_len: usize,
    pub apply_chat_template: bool,
    pub append_eos: bool,
    pub overlong: Overlong,
}

impl PairOptions {
    /// The options of a `[data]` section of `rlhf rm` / `rlhf dpo`.
    pub fn of(d: &crate::config::RmDataConfig) -> Self {
        PairOptions {
            max_len: d.max_len,
            apply_chat_template: d.apply_chat_template,
            append_eos: d.append_eos,
            overlong: d.overlong,
        }
    }
}

/// The train and eval pairs of `splits`, each source built by `build` with its bad lines reported
/// (a source with no usable line is an error naming it); no eval source gives no eval pairs.
pub fn pair_sets<T>(
    splits: &Splits,
    build: impl Fn(&SourceLines, &mut DataReport) -> Vec<T>,
) -> Result<(Vec<T>, Vec<T>)> {
    let of = |src: &SourceLines| -> Result<Vec<T>> {
        let mut report = DataReport::default();
        let pairs = build(src, &mut report);
        report.warn(&src.label);
        if pairs.is_empty() {
            return Err(report.all_bad(&src.label, src.lines.len()));
        }
        Ok(pairs)
    };
    let train = of(&splits.train)?;
    let eval = match &splits.eval {
        Some(e) => of(e)?,
        None => Vec::new(),
    };
    Ok((train, eval))
}

/// One tokenized pair.
#[derive(Debug, Clone, PartialEq)]
pub struct PairExample {
    pub chosen: Vec<i64>,
    pub rejected: Vec<i64>,
    pub line: usize,
}

/// A prompt or response field: text or chat messages.
enum Field {
    Text(String),
    Chat(Vec<ChatMessage>),
}

fn field(obj: &Map<String, Value>, key: &str) -> std::result::Result<Option<Field>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(Field::Text(s.clone()))),
        Some(v @ Value::Array(_)) => Ok(Some(Field::Chat(messages_field(v, key)?))),
        Some(_) => Err(format!("`{key}` is not a string or a message list")),
    }
}

fn is_empty(f: &Field) -> bool {
    match f {
        Field::Text(s) => s.trim().is_empty(),
        Field::Chat(m) => m.last().is_none_or(|m| m.content.trim().is_empty()),
    }
}

fn same(a: &Field, b: &Field) -> bool {
    match (a, b) {
        (Field::Text(x), Field::Text(y)) => x == y,
        (Field::Chat(x), Field::Chat(y)) => x == y,
        _ => false,
    }
}

/// The text the reward model judges for one side of a pair.
fn render(
    tok: &HfTokenizer,
    prompt: &Option<Field>,
    response: &Field,
    templated: bool,
) -> std::result::Result<String, String> {
    let no_template = || "chat messages but the tokenizer has no chat template".to_string();
    let chat =
        |m: Vec<ChatMessage>| tok.apply_chat_template(&m, false).map_err(|e| format!("chat template failed: {e}"));
    match (prompt, response) {
        (Some(Field::Text(p)), Field::Text(r)) if !templated => Ok(format!("{p}{r}")),
        (None, Field::Text(_)) => Err("missing field `prompt`".into()),
        (_, Field::Chat(_)) | (Some(Field::Chat(_)), _) if !tok.has_chat_template() => Err(no_template()),
        (p, r) => {
            let mut conv = match p {
                Some(Field::Text(p)) => vec![ChatMessage::new("user", p.as_str())],
                Some(Field::Chat(m)) => m.clone(),
                None => Vec::new(),
            };
            match r {
                Field::Text(r) => conv.push(ChatMessage::new("assistant", r.as_str())),
                Field::Chat(m) => conv.extend(m.iter().cloned()),
            }
            chat(conv)
        }
    }
}

/// Token ids of a text as the reward-model scorer makes them (special tokens, doubled BOS dropped).
fn encode(tok: &HfTokenizer, text: &str) -> std::result::Result<Vec<i64>, String> {
    let ids = tok.encode(text, true).map_err(|e| format!("cannot tokenize: {e}"))?;
    let mut ids: &[u32] = &ids;
    if let (Some(b), [first, second, ..]) = (tok.bos_token_id(), ids) {
        if *first == b && *second == b {
            ids = &ids[1..];
        }
    }
    Ok(ids.iter().map(|&t| i64::from(t)).collect())
}

fn pair_of_line(
    tok: &HfTokenizer,
    obj: &Map<String, Value>,
    opts: &PairOptions,
    eos: Option<i64>,
) -> std::result::Result<(Vec<i64>, Vec<i64>, bool), String> {
    let prompt = field(obj, "prompt")?;
    let chosen = field(obj, "chosen")?.ok_or("missing field `chosen`")?;
    let rejected = field(obj, "rejected")?.ok_or("missing field `rejected`")?;
    if is_empty(&chosen) || is_empty(&rejected) {
        return Err("empty response".into());
    }
    if same(&chosen, &rejected) {
        return Err("chosen == rejected".into());
    }
    let templated = opts.apply_chat_template && tok.has_chat_template();
    let mut sides = Vec::with_capacity(2);
    for r in [&chosen, &rejected] {
        let mut ids = encode(tok, &render(tok, &prompt, r, templated)?)?;
        if opts.append_eos {
            if let Some(e) = eos {
                ids.push(e);
            }
        }
        sides.push(ids);
    }
    let (mut c, mut r) = (sides.remove(0), sides.remove(0));
    if c.is_empty() || r.is_empty() {
        return Err("empty response".into());
    }
    let mut truncated = false;
    if c.len() > opts.max_len || r.len() > opts.max_len {
        match opts.overlong {
            Overlong::Drop => return Err(format!("longer than max_len = {} tokens", opts.max_len)),
            Overlong::Truncate => {
                c.truncate(opts.max_len);
                r.truncate(opts.max_len);
                truncated = true;
            }
        }
    }
    if c == r {
        return Err(if truncated {
            format!("chosen == rejected within max_len = {} tokens", opts.max_len)
        } else {
            "chosen == rejected after tokenization".into()
        });
    }
    Ok((c, r, truncated))
}

/// Tokenizes every line of `src`; bad lines are counted in `report`.
pub fn build_pairs(
    src: &SourceLines,
    tok: &HfTokenizer,
    opts: &PairOptions,
    report: &mut DataReport,
) -> Vec<PairExample> {
    let eos = tok.eos_token_ids().first().map(|&i| i64::from(i));
    let mut out = Vec::new();
    for (line, obj) in src.objects(report) {
        match pair_of_line(tok, &obj, opts, eos) {
            Ok((chosen, rejected, truncated)) => {
                if truncated {
                    report.truncate(line, &format!("longer than max_len = {} tokens", opts.max_len));
                }
                out.push(PairExample { chosen, rejected, line });
            }
            Err(reason) => report.skip(line, &reason),
        }
    }
    out
}

/// A pair with where each side's response starts (DPO scores the response tokens only).
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPair {
    pub pair: PairExample,
    /// Index of the first response token of `pair.chosen` / `pair.rejected` (>= 1).
    pub chosen_start: usize,
    pub rejected_start: usize,
}

/// The token ids of a line's prompt alone, rendered as [`render`] renders its sides: the prompt
/// text as is, or through the chat template the conversation before the reply with
/// `add_generation_prompt = true` (without a `prompt`, the chosen conversation minus its last
/// message).
fn prompt_ids(
    tok: &HfTokenizer,
    obj: &Map<String, Value>,
    opts: &PairOptions,
) -> std::result::Result<Vec<i64>, String> {
    let templated = opts.apply_chat_template && tok.has_chat_template();
    let prompt = field(obj, "prompt")?;
    let chosen = field(obj, "chosen")?.ok_or("missing field `chosen`")?;
    let conv = match (&prompt, &chosen) {
        (Some(Field::Text(p)), Field::Text(_)) if !templated => return encode(tok, p),
        (Some(Field::Text(p)), _) => vec![ChatMessage::new("user", p.as_str())],
        (Some(Field::Chat(m)), _) => m.clone(),
        (None, Field::Chat(m)) if m.len() > 1 => m[..m.len() - 1].to_vec(),
        (None, _) => return Err("no prompt to split the response from".into()),
    };
    let text = tok.apply_chat_template(&conv, true).map_err(|e| format!("chat template failed: {e}"))?;
    encode(tok, &text)
}

/// Where the response of `side` starts: after its longest common prefix with the prompt's own
/// tokens (at least 1, the first token has no prediction); an error when no response token is left.
fn response_start(prompt: &[i64], side: &[i64], max_len: usize) -> std::result::Result<usize, String> {
    let common = prompt.iter().zip(side).take_while(|(a, b)| a == b).count();
    let start = common.max(1);
    if start >= side.len() {
        return Err(format!("no response tokens within max_len = {max_len} tokens"));
    }
    Ok(start)
}

/// [`build_pairs`] with each side's prompt/response split ([`SplitPair`]), for DPO. Lines are read,
/// rendered and truncated exactly as for the reward model.
pub fn build_split_pairs(
    src: &SourceLines,
    tok: &HfTokenizer,
    opts: &PairOptions,
    report: &mut DataReport,
) -> Vec<SplitPair> {
    let eos = tok.eos_token_ids().first().map(|&i| i64::from(i));
    let mut out = Vec::new();
    for (line, obj) in src.objects(report) {
        let split = pair_of_line(tok, &obj, opts, eos).and_then(|(chosen, rejected, truncated)| {
            let p = prompt_ids(tok, &obj, opts)?;
            let chosen_start = response_start(&p, &chosen, opts.max_len)?;
            let rejected_start = response_start(&p, &rejected, opts.max_len)?;
            Ok((PairExample { chosen, rejected, line }, chosen_start, rejected_start, truncated))
        });
        match split {
            Ok((pair, chosen_start, rejected_start, truncated)) => {
                if truncated {
                    report.truncate(line, &format!("longer than max_len = {} tokens", opts.max_len));
                }
                out.push(SplitPair { pair, chosen_start, rejected_start });
            }
            Err(reason) => report.skip(line, &reason),
        }
    }
    out
}

/// DeepSpeed-Chat's divergent segment of one pair: `(divergence, end)` with `end` the length of
/// the longer side and `divergence` the first position where the sides differ (a token, or one side
/// already padded). Identical sides give `(end − 1, end)`, the last token of the pair, where DSC
/// takes the last slot of the padded row (`T − 1, T`); such pairs are skipped when read, so
/// neither reaches the loss.
pub fn dsc_segment(chosen: &[i64], rejected: &[i64]) -> (usize, usize) {
    let end = chosen.len().max(rejected.len());
    let div = (0..end).find(|&t| chosen.get(t) != rejected.get(t)).unwrap_or(end.saturating_sub(1));
    (div, end)
}

/// A padded batch of pairs: chosen rows first, then rejected rows, padded to one length.
#[derive(Debug)]
pub struct PairBatch {
    /// `[2B, T]` int64.
    pub input_ids: Tensor,
    /// `[2B, T]` int64.
    pub attention_mask: Tensor,
    /// `[B, T]` f32: 1 on each pair's divergent segment.
    pub segment: Tensor,
    /// `[B]` int64: index of the last chosen / rejected token.
    pub chosen_last: Tensor,
    pub rejected_last: Tensor,
    /// Real tokens in the batch.
    pub tokens: usize,
}

/// Right-pads the chosen and rejected sides of `pairs` together.
///
/// # Shapes
/// - returns `input_ids`, `attention_mask`: `[2B, T]`; `segment`: `[B, T]`; `chosen_last`,
///   `rejected_last`: `[B]`
pub fn collate_pairs(pairs: &[&PairExample], pad: i64, device: Device) -> Result<PairBatch> {
    let b = pairs.len();
    let t = pairs.iter().map(|p| p.chosen.len().max(p.rejected.len())).max().unwrap_or(1).max(1);
    let mut ids = vec![pad; 2 * b * t];
    let mut mask = vec![0i64; 2 * b * t];
    let mut seg = vec![0f32; b * t];
    let (mut cl, mut rl) = (Vec::with_capacity(b), Vec::with_capacity(b));
    let mut tokens = 0;
    for (i, p) in pairs.iter().enumerate() {
        for (row, side) in [(i, &p.chosen), (b + i, &p.rejected)] {
            ids[row * t..row * t + side.len()].copy_from_slice(side);
            mask[row * t..row * t + side.len()].iter_mut().for_each(|m| *m = 1);
            tokens += side.len();
        }
        let (div, end) = dsc_segment(&p.chosen, &p.rejected);
        seg[i * t + div..i * t + end].iter_mut().for_each(|s| *s = 1.0);
        cl.push(p.chosen.len() as i64 - 1);
        rl.push(p.rejected.len() as i64 - 1);
    }
    let (b2, t) = ((2 * b) as i64, t as i64);
    Ok(PairBatch {
        input_ids: Tensor::f_from_slice(&ids)?.f_view([b2, t])?.f_to_device(device)?,
        attention_mask: Tensor::f_from_slice(&mask)?.f_view([b2, t])?.f_to_device(device)?,
        segment: Tensor::f_from_slice(&seg)?.f_view([b as i64, t])?.f_to_device(device)?,
        chosen_last: Tensor::f_from_slice(&cl)?.f_to_device(device)?,
        rejected_last: Tensor::f_from_slice(&rl)?.f_to_device(device)?,
        tokens,
    })
}

/// Per-pair losses and scores of a batch.
#[derive(Debug)]
pub struct PairLoss {
    /// `[B]` f32: each pair's loss (the batch loss is their mean).
    pub per_pair: Tensor,
    /// `[B]` f32: value at the last chosen / rejected token.
    pub chosen_scores: Tensor,
    pub rejected_scores: Tensor,
}

/// The pairwise ranking loss of [`RmLoss`] (see the module docs).
///
/// # Shapes
/// - `chosen_values`, `rejected_values`: `[B, T]` per-token values; `segment`: `[B, T]` f32 mask;
///   `chosen_last`, `rejected_last`: `[B]` int64 → per-pair losses and scores, each `[B]`
pub fn pairwise_loss(
    kind: RmLoss,
    chosen_values: &Tensor,
    rejected_values: &Tensor,
    segment: &Tensor,
    chosen_last: &Tensor,
    rejected_last: &Tensor,
) -> Result<PairLoss> {
    let at = |v: &Tensor, idx: &Tensor| -> Result<Tensor> {
        Ok(v.f_gather(1, &idx.f_unsqueeze(1)?, false)?.f_squeeze_dim(1)?)
    };
    let chosen_scores = at(chosen_values, chosen_last)?; // [B]
    let rejected_scores = at(rejected_values, rejected_last)?; // [B]
    let per_pair = match kind {
        RmLoss::Dsc => {
            // −log σ(x) = softplus(−x), stable for large |x|.
            let terms = chosen_values.f_sub(rejected_values)?.f_neg()?.f_softplus()?; // [B, T]
            let n = segment.f_sum_dim_intlist(1, false, Kind::Float)?.f_clamp_min(1.0)?; // [B]
            terms.f_mul(segment)?.f_sum_dim_intlist(1, false, Kind::Float)?.f_div(&n)?
        }
        RmLoss::LastToken => chosen_scores.f_sub(&rejected_scores)?.f_neg()?.f_softplus()?,
    };
    Ok(PairLoss { per_pair, chosen_scores, rejected_scores })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervised::phase::RawLine;

    #[test]
    fn dsc_segment_is_the_divergent_span() {
        // DeepSpeed-Chat's pairwise loss: chosen [11 22 33 44 55 66], rejected [11 22 33 40 50]
        // first differ at 3; the segment ends at the longer one's end, 6.
        assert_eq!(dsc_segment(&[11, 22, 33, 44, 55, 66], &[11, 22, 33, 40, 50]), (3, 6));
        // One side a prefix of the other: the segment starts where the shorter one ends.
        assert_eq!(dsc_segment(&[1, 2, 3], &[1, 2, 3, 4, 5]), (3, 5));
        assert_eq!(dsc_segment(&[1, 2], &[1, 2]), (1, 2));
        assert_eq!(dsc_segment(&[7, 2], &[8, 2, 3]), (0, 3));
    }

    #[test]
    fn dsc_loss_by_hand() {
        // Two pairs, T = 4.
        // Pair 0: chosen [5 6 7 _], rejected [5 6 8 9] -> segment [2, 4).
        //   v_c = [0.1, 0.2, 1.0, 0.5], v_r = [0.1, 0.2, 0.0, 0.5]
        //   terms: t=2: −log σ(1.0) = 0.313262; t=3: −log σ(0.0) = ln 2 = 0.693147
        //   loss_0 = (0.313262 + 0.693147) / 2 = 0.503204
        //   score_c = v_c[2] = 1.0, score_r = v_r[3] = 0.5
        // Pair 1: chosen [5 6 7 8], rejected [5 6 _ _] -> segment [2, 4).
        //   v_c = [0, 0, 2.0, −1.0], v_r = [0, 0, 0.0, 1.0]
        //   terms: −log σ(2) = 0.126928, −log σ(−2) = 2.126928 -> loss_1 = 1.126928
        //   score_c = v_c[3] = −1.0, score_r = v_r[1] = 0.0
        // Batch loss = (0.503204 + 1.126928) / 2 = 0.815066.
        let p0 = PairExample { chosen: vec![5, 6, 7], rejected: vec![5, 6, 8, 9], line: 1 };
        let p1 = PairExample { chosen: vec![5, 6, 7, 8], rejected: vec![5, 6], line: 2 };
        let b = collate_pairs(&[&p0, &p1], 0, Device::Cpu).unwrap();
        assert_eq!(Vec::<f32>::try_from(b.segment.view(-1)).unwrap(), vec![0., 0., 1., 1., 0., 0., 1., 1.]);
        let vc = Tensor::from_slice(&[0.1f32, 0.2, 1.0, 0.5, 0., 0., 2.0, -1.0]).view([2, 4]);
        let vr = Tensor::from_slice(&[0.1f32, 0.2, 0.0, 0.5, 0., 0., 0.0, 1.0]).view([2, 4]);
        let l = pairwise_loss(RmLoss::Dsc, &vc, &vr, &b.segment, &b.chosen_last, &b.rejected_last).unwrap();
        let per = Vec::<f32>::try_from(&l.per_pair).unwrap();
        assert!((per[0] - 0.503204).abs() < 1e-5 && (per[1] - 1.126928).abs() < 1e-5, "{per:?}");
        assert!((l.per_pair.mean(Kind::Float).double_value(&[]) - 0.815066).abs() < 1e-5);
        assert_eq!(Vec::<f32>::try_from(&l.chosen_scores).unwrap(), vec![1.0, -1.0]);
        assert_eq!(Vec::<f32>::try_from(&l.rejected_scores).unwrap(), vec![0.5, 0.0]);
        // last_token: −log σ(1.0 − 0.5) = 0.474077, −log σ(−1.0 − 0.0) = 1.313262.
        let l = pairwise_loss(RmLoss::LastToken, &vc, &vr, &b.segment, &b.chosen_last, &b.rejected_last).unwrap();
        let per = Vec::<f32>::try_from(&l.per_pair).unwrap();
        assert!((per[0] - 0.474077).abs() < 1e-5 && (per[1] - 1.313262).abs() < 1e-5, "{per:?}");
    }

    #[test]
    fn pairs_are_rendered_like_the_scorer_and_bad_lines_counted() {
        let dir = tempfile::tempdir().unwrap();
        crate::builtin_models::write_tiny_model(dir.path(), 1).unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        let opts =
            PairOptions { max_len: 8, apply_chat_template: true, append_eos: false, overlong: Overlong::Truncate };
        let lines = [
            r#"{"prompt": "3 + 4 =", "chosen": " 7", "rejected": " 5"}"#,
            r#"{"prompt": "3 + 4 =", "chosen": " 7", "rejected": " 7"}"#,
            r#"{"prompt": "3 + 4 =", "chosen": " 7"}"#,
            r#"{"prompt": "3 + 4 =", "chosen": "", "rejected": " 5"}"#,
            r#"{"chosen": " 7", "rejected": " 5"}"#,
            r#"{"prompt": "3 + 4 =", "chosen": [{"role": "assistant", "content": "7"}], "rejected": " 5"}"#,
            r#"{"prompt": "3 + 4 =", "chosen": " 7 7 7 7 7", "rejected": " 7 7 7 7 7 7"}"#,
            "{",
        ];
        let src = SourceLines {
            label: "p.jsonl".into(),
            lines: lines.iter().enumerate().map(|(i, l)| (i + 1, RawLine::Text(l.to_string()))).collect(),
        };
        let mut r = DataReport::default();
        let pairs = build_pairs(&src, &tok, &opts, &mut r);
        assert_eq!(pairs.len(), 1);
        // "3 + 4 =" + " 7" -> [6, 13, 7, 14, 10]; no EOS appended.
        assert_eq!(pairs[0].chosen, vec![6, 13, 7, 14, 10]);
        assert_eq!(pairs[0].rejected, vec![6, 13, 7, 14, 8]);
        assert_eq!(
            r.messages("p.jsonl"),
            vec![
                "p.jsonl: skipped 1 line (chosen == rejected), first at line 2",
                "p.jsonl: skipped 1 line (missing field `rejected`), first at line 3",
                "p.jsonl: skipped 1 line (empty response), first at line 4",
                "p.jsonl: skipped 1 line (missing field `prompt`), first at line 5",
                "p.jsonl: skipped 1 line (chat messages but the tokenizer has no chat template), first at line 6",
                "p.jsonl: skipped 1 line (chosen == rejected within max_len = 8 tokens), first at line 7",
                "p.jsonl: skipped 1 line (not valid JSON), first at line 8",
            ]
        );
        let opts = PairOptions { append_eos: true, ..opts };
        let mut r = DataReport::default();
        let pairs = build_pairs(&src, &tok, &opts, &mut r);
        assert_eq!(pairs[0].chosen, vec![6, 13, 7, 14, 10, 1]);
    }

    #[test]
    fn split_pairs_start_at_the_response() {
        let dir = tempfile::tempdir().unwrap();
        crate::builtin_models::write_tiny_model(dir.path(), 1).unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        let opts =
            PairOptions { max_len: 8, apply_chat_template: true, append_eos: true, overlong: Overlong::Truncate };
        let lines =
            [r#"{"prompt": "3 + 4 =", "chosen": " 7", "rejected": " 5 5"}"#, r#"{"chosen": " 7", "rejected": " 5"}"#];
        let src = SourceLines {
            label: "p.jsonl".into(),
            lines: lines.iter().enumerate().map(|(i, l)| (i + 1, RawLine::Text(l.to_string()))).collect(),
        };
        let mut r = DataReport::default();
        let pairs = build_split_pairs(&src, &tok, &opts, &mut r);
        assert_eq!(pairs.len(), 1);
        // "3 + 4 =" -> [6, 13, 7, 14]: both responses start at 4.
        assert_eq!(pairs[0].pair.chosen, vec![6, 13, 7, 14, 10, 1]);
        assert_eq!((pairs[0].chosen_start, pairs[0].rejected_start), (4, 4));
        assert_eq!(pairs[0].pair.rejected.len(), 7);
        assert_eq!(r.skipped(), 1);
        assert_eq!(
            response_start(&[1, 2, 3], &[1, 2, 3], 3).unwrap_err(),
            "no response tokens within max_len = 3 tokens"
        );
        assert_eq!(response_start(&[], &[4, 5], 3), Ok(1));
    }
}
