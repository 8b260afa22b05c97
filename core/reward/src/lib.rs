//! Reward-model scoring: one scalar per text from a `*ForSequenceClassification` checkpoint with
//! `num_labels = 1` (the layout of OpenRLHF / TRL reward models), read at the last token of the text
//! like transformers' `AutoModelForSequenceClassification`.
//!
//! [`RewardModelScorer`] owns the model and its tokenizer. It is used by the `reward-model` plugin
//! (in process, during RL) and by `rlhf serve-reward` (over HTTP), so both score a text the same way:
//!
//! 1. tokenize the text as it is, with the tokenizer's own special tokens (`add_special_tokens`,
//!    like transformers' `tokenizer(text)`); a BOS doubled because the text already starts with it
//!    (a chat template that writes `{{ bos_token }}`) is dropped once;
//! 2. keep the last `max_len` tokens (truncation from the left: the response, at the end, is what
//!    is being judged);
//! 3. sort the token sequences (a prompt's samples become neighbours), take them `batch_size` at a
//!    time, compute the prefixes each chunk's rows share once, padding-free where that costs
//!    least ([`ScalarHeadModel::scores_sharing`]), and read the value at each row's last token,
//!    without gradients (right-padded chunks of similar lengths for a model with LongRoPE or
//!    dynamic NTK rotary, whose frequencies follow the longest position).
//!
//! Padding, packing and batching do not change a score beyond float rounding (positions come
//! from the attention mask). [`RewardModelScorer::render`] builds the text of a (conversation,
//! response) pair with the reward model's own chat template.
//!
//! ```no_run
//! use rlhf_reward::RewardModelScorer;
//! use tch::{Device, Kind};
//!
//! let rm = RewardModelScorer::from_dir("models/rm".as_ref(), Device::Cpu, Kind::Float, 16, 1024)?;
//! let scores = rm.score_texts(&["Q: 2 + 2? A: 4".to_string()])?;
//! # let _ = scores;
//! # Ok::<(), rlhf_reward::RewardError>(())
//! ```

mod error;
mod layout;

use std::path::Path;

use rlhf_models::ScalarHeadModel;
use rlhf_tokenizer::HfTokenizer;
use tch::{Device, Kind, Tensor};

pub use error::{Result, RewardError};
pub use rlhf_tokenizer::ChatMessage;

/// A reward model with its tokenizer and batching settings.
#[derive(Debug)]
pub struct RewardModelScorer {
    model: ScalarHeadModel,
    tokenizer: HfTokenizer,
    batch_size: usize,
    max_len: usize,
}

impl RewardModelScorer {
    /// Loads the reward model of `dir` (config, safetensors, tokenizer files; or a Hugging Face
    /// Hub id, `org/name[@revision]`, resolved through the cache) onto `device` in `kind`, frozen. `batch_size` texts are scored per forward pass; texts longer than `max_len`
    /// tokens keep their last `max_len` tokens. Both must be at least 1.
    pub fn from_dir(dir: &Path, device: Device, kind: Kind, batch_size: usize, max_len: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(RewardError::Setting { key: "batch_size", message: "must be at least 1".into() });
        }
        if max_len == 0 {
            return Err(RewardError::Setting { key: "max_len", message: "must be at least 1".into() });
        }
        let dir = &rlhf_hub::resolve_model(&dir.to_string_lossy())?;
        if !dir.is_dir() {
            return Err(RewardError::NoModelDir { dir: dir.to_path_buf() });
        }
        let tokenizer = HfTokenizer::from_dir(dir)?;
        let mut model = ScalarHeadModel::from_dir(dir, device, kind)?;
        tokenizer.check_fits_vocab(model.arch().vocab_size)?;
        model.freeze();
        Ok(RewardModelScorer { model, tokenizer, batch_size, max_len })
    }

    /// The reward model.
    pub fn model(&self) -> &ScalarHeadModel {
        &self.model
    }

    /// The reward model's tokenizer.
    pub fn tokenizer(&self) -> &HfTokenizer {
        &self.tokenizer
    }

    /// Texts per forward pass.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Tokens kept per text (the last ones).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The text the reward model judges for a conversation and a response: with a chat template,
    /// `messages` followed by `{"role": "assistant", "content": response}` rendered with
    /// `add_generation_prompt = false`; without one (or without messages), `prompt + response`.
    /// `prompt` is the prompt as the policy saw it.
    pub fn render(&self, messages: &[ChatMessage], prompt: &str, response: &str) -> Result<String> {
        if !self.tokenizer.has_chat_template() || messages.is_empty() {
            return Ok(format!("{prompt}{response}"));
        }
        let mut conversation = messages.to_vec();
        conversation.push(ChatMessage::new("assistant", response));
        Ok(self.tokenizer.apply_chat_template(&conversation, false)?)
    }

    /// Token ids of each text as the model sees them: special tokens added, a doubled leading BOS
    /// removed once, then the last `max_len` tokens. Fails on a text without any token.
    pub fn encode(&self, texts: &[String], max_len: usize) -> Result<Vec<Vec<i64>>> {
        let max_len = max_len.max(1);
        let bos = self.tokenizer.bos_token_id();
        let encoded = self.tokenizer.encode_batch(texts, true)?;
        encoded
            .into_iter()
            .enumerate()
            .map(|(index, ids)| {
                let mut ids: &[u32] = &ids;
                if let (Some(b), [first, second, ..]) = (bos, ids) {
                    if *first == b && *second == b {
                        ids = &ids[1..];
                    }
                }
                if ids.is_empty() {
                    return Err(RewardError::EmptyText { index });
                }
                let start = ids.len().saturating_sub(max_len);
                Ok(ids[start..].iter().map(|&t| i64::from(t)).collect())
            })
            .collect()
    }

    /// One score per text, in order (see the crate docs for how a text is scored).
    pub fn score_texts(&self, texts: &[String]) -> Result<Vec<f64>> {
        self.score_texts_max_len(texts, self.max_len)
    }

    /// [`RewardModelScorer::score_texts`] keeping at most `min(max_len, self.max_len())` tokens per
    /// text.
    pub fn score_texts_max_len(&self, texts: &[String], max_len: usize) -> Result<Vec<f64>> {
        let seqs = self.encode(texts, max_len.min(self.max_len))?;
        self.score_ids(&seqs)
    }

    /// Scores token-id sequences (each non-empty, already truncated), in order. The sequences are
    /// sorted, so that texts beginning alike (a prompt's samples) share a chunk of `batch_size`,
    /// and each chunk runs padding-free with the prefixes its rows share laid once
    /// ([`ScalarHeadModel::scores_sharing`]): a score is the padded batch's within
    /// float rounding. A model whose rotary frequencies depend on the longest position (LongRoPE,
    /// dynamic NTK: a layout would change them) scores right-padded chunks of sequences of
    /// similar length instead.
    pub fn score_ids(&self, seqs: &[Vec<i64>]) -> Result<Vec<f64>> {
        if let Some(index) = seqs.iter().position(Vec::is_empty) {
            return Err(RewardError::EmptyText { index });
        }
        let padded = self.model.arch().rotary_reads_longest_position();
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        if padded {
            order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].len()));
        } else {
            order.sort_by(|&a, &b| seqs[a].cmp(&seqs[b]));
        }
        let mut scores = vec![0f64; seqs.len()];
        for chunk in order.chunks(self.batch_size) {
            let rows: Vec<&[i64]> = chunk.iter().map(|&i| seqs[i].as_slice()).collect();
            // [chunk]
            let out = tch::no_grad(|| self.score_chunk(&rows, padded))?;
            let out = Vec::<f64>::try_from(&out.f_to_kind(Kind::Double)?.f_to_device(Device::Cpu)?)?;
            for (&i, s) in chunk.iter().zip(out) {
                scores[i] = s;
            }
        }
        Ok(scores)
    }

    /// The value at each row's last token, the rows right-padded (`padded`) or split at the
    /// prefixes they share and packed.
    ///
    /// # Shapes
    /// - returns `[rows.len()]`
    fn score_chunk(&self, rows: &[&[i64]], padded: bool) -> Result<Tensor> {
        let pad = i64::from(self.tokenizer.pad_token_id());
        let laid = if padded { layout::right_padded(rows, pad) } else { layout::split_at_shared(rows, pad) };
        let shape = [laid.rows as i64, laid.cols as i64];
        let device = self.model.device();
        let ids = Tensor::f_from_slice(&laid.ids)?.f_view(shape)?.f_to_device(device)?;
        let mask = Tensor::f_from_slice(&laid.mask)?.f_view(shape)?.f_to_device(device)?;
        if padded {
            return Ok(self.model.scores(&ids, &mask)?);
        }
        let shared = (laid.prefix_cols > 0).then_some(laid.prefix_cols as i64);
        Ok(self.model.scores_sharing(&ids, &mask, shared)?)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use super::*;

    fn rm_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models/llama-rm")
    }

    fn scorer(batch_size: usize, max_len: usize) -> RewardModelScorer {
        RewardModelScorer::from_dir(&rm_dir(), Device::Cpu, Kind::Float, batch_size, max_len).unwrap()
    }

    fn reference() -> (HashMap<String, Tensor>, Vec<String>) {
        let tensors = Tensor::read_safetensors(rm_dir().join("reference.safetensors")).unwrap().into_iter().collect();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(rm_dir().join("reference.json")).unwrap()).unwrap();
        let prompts = json["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect();
        (tensors, prompts)
    }

    fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    #[test]
    fn scores_of_texts_are_the_scores_of_their_ids() {
        let (r, prompts) = reference();
        let rm = scorer(16, 1024);
        // Our tokenization of the prompts is the one transformers used for the reference.
        let ids = rm.encode(&prompts, 1024).unwrap();
        let mask = Vec::<Vec<i64>>::try_from(&r["attention_mask"]).unwrap();
        let ref_ids = Vec::<Vec<i64>>::try_from(&r["input_ids"]).unwrap();
        for (k, (ours, (row, m))) in ids.iter().zip(ref_ids.iter().zip(&mask)).enumerate() {
            let theirs: Vec<i64> = row.iter().zip(m).filter(|(_, &m)| m == 1).map(|(&t, _)| t).collect();
            assert_eq!(ours, &theirs, "prompt {k}");
        }
        let got = rm.score_texts(&prompts).unwrap();
        let from_ids = tch::no_grad(|| rm.model().scores(&r["input_ids"], &r["attention_mask"])).unwrap();
        let from_ids = Vec::<f64>::try_from(&from_ids.to_kind(Kind::Double)).unwrap();
        let transformers = Vec::<f64>::try_from(&r["scores"].to_kind(Kind::Double)).unwrap();
        println!("ours {got:?}, same ids {from_ids:?}, transformers {transformers:?}");
        assert!(max_abs_diff(&got, &from_ids) < 1e-5, "{got:?} vs {from_ids:?}");
        assert!(max_abs_diff(&got, &transformers) < 1e-4, "{got:?} vs {transformers:?}");
    }

    #[test]
    fn batching_and_padding_do_not_change_a_score() {
        let (_, prompts) = reference();
        let mut texts = prompts.clone();
        texts.extend(["a", "The fox jumps over the lazy dog again and again.", "7"].map(String::from));
        texts.extend(prompts.iter().map(|p| format!("{p} {p}")));
        let one = scorer(1, 1024).score_texts(&texts).unwrap();
        let three = scorer(3, 1024).score_texts(&texts).unwrap();
        assert_eq!(one.len(), texts.len());
        assert!(max_abs_diff(&one, &three) < 1e-5, "{one:?} vs {three:?}");
        assert!(scorer(3, 1024).score_texts(&[]).unwrap().is_empty());
    }

    #[test]
    fn a_prompts_samples_are_laid_after_one_shared_prompt() {
        let rm = scorer(8, 1024);
        let prompt = "Tom has 3 apples and buys 5 more. How many apples does Tom have now?";
        let mut texts: Vec<String> =
            ["8", "Eight apples.", "He has 8.", "7"].iter().map(|r| format!("{prompt} {r}")).collect();
        texts.push("An unrelated text.".into());
        let seqs = rm.encode(&texts, 1024).unwrap();
        let mut sorted: Vec<&[i64]> = seqs.iter().map(Vec::as_slice).collect();
        sorted.sort();
        let laid = layout::split_at_shared(&sorted, 0);
        let prompt_tokens = rm.encode(&[prompt.to_string()], 1024).unwrap()[0].len();
        assert!(laid.prefix_cols >= prompt_tokens, "{} < {prompt_tokens}", laid.prefix_cols);
        let heads: std::collections::HashSet<&[i64]> =
            laid.ids.chunks(laid.cols).map(|row| &row[..laid.prefix_cols]).collect();
        assert_eq!(heads.len(), 2, "the four samples share one head, the other text has its own");
        // Scores as each text's alone.
        let got = rm.score_texts(&texts).unwrap();
        let alone: Vec<f64> = texts.iter().flat_map(|t| rm.score_texts(std::slice::from_ref(t)).unwrap()).collect();
        assert!(max_abs_diff(&got, &alone) < 1e-5, "{got:?} vs {alone:?}");
    }

    #[test]
    fn long_texts_keep_their_end() {
        let rm = scorer(4, 6);
        let text = "Tom has 3 apples and buys 5 more. How many apples?".to_string();
        let full = rm.encode(std::slice::from_ref(&text), 1024).unwrap().remove(0);
        let cut = rm.encode(std::slice::from_ref(&text), 6).unwrap().remove(0);
        assert!(full.len() > 6);
        assert_eq!(cut, full[full.len() - 6..]);
        let by_text = rm.score_texts(std::slice::from_ref(&text)).unwrap();
        let by_ids = rm.score_ids(&[full[full.len() - 6..].to_vec()]).unwrap();
        assert!(max_abs_diff(&by_text, &by_ids) < 1e-6);
        assert_eq!(rm.score_texts_max_len(std::slice::from_ref(&text), 100).unwrap(), by_text);
    }

    #[test]
    fn render_uses_the_models_chat_template() {
        let rm = scorer(4, 1024);
        assert!(rm.tokenizer().has_chat_template());
        let messages = [ChatMessage::new("user", "2 + 2 =")];
        let text = rm.render(&messages, "ignored", "4").unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2 + 2 =<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n"
        );
        assert_eq!(rm.render(&[], "2 + 2 = ", "4").unwrap(), "2 + 2 = 4");
    }

    #[test]
    fn errors_are_clear() {
        let e = RewardModelScorer::from_dir(Path::new("/no/such/rm"), Device::Cpu, Kind::Float, 1, 8).unwrap_err();
        assert_eq!(e.to_string(), "/no/such/rm: model directory not found");
        let e = RewardModelScorer::from_dir(&rm_dir(), Device::Cpu, Kind::Float, 0, 8).unwrap_err();
        assert_eq!(e.to_string(), "batch_size: must be at least 1");
        let e = scorer(2, 8).score_texts(&["ok".into(), String::new()]).unwrap_err();
        assert_eq!(e.to_string(), "text 1 has no tokens (an empty text without special tokens)");
    }
}
