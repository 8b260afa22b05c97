//! InstructGPT's PPO-ptx: a language-modelling loss on pre-training text mixed into every
//! minibatch, `loss += ptx_coef · NLL(ptx batch)` (Ouyang et al. 2022, eq. 2).

use std::path::Path;

use rlhf_generation::{masked_nll_mean, right_pad, token_logprobs, LogProbOptions};
use rlhf_models::CausalLm;
use rlhf_tokenizer::HfTokenizer;
use tch::{Kind, Tensor};

use crate::data::SplitMix;
use crate::error::{Result, TrainerError};
use crate::rl::prompts::ids_i64;
use crate::tabular::{self, Columns};

/// Tokenised ptx texts (each at least 2 tokens).
pub struct PtxData {
    pub texts: Vec<Vec<i64>>,
    pub pad: i64,
}

impl PtxData {
    /// Reads the `text` of every JSONL line (blank lines skipped) or Parquet row (a `.parquet`
    /// file, a directory of shards or a glob; a `text` column).
    pub fn read(path: &Path, tok: &HfTokenizer) -> Result<Self> {
        let bad = |path: &Path, message: String| TrainerError::Data { path: path.to_path_buf(), message };
        let mut texts = Vec::new();
        let mut push = |path: &Path, at: String, obj: Option<&serde_json::Value>| -> Result<()> {
            let Some(s) = obj.and_then(|v| v.get("text")).and_then(|s| s.as_str()) else {
                return Err(bad(path, format!("{at}: missing string `text`")));
            };
            let ids = ids_i64(&tok.encode(s, true)?);
            if ids.len() >= 2 {
                texts.push(ids);
            }
            Ok(())
        };
        let spec = path.to_string_lossy();
        if tabular::is_tabular(&spec) {
            let cols = Columns::new(&[("text", "train.ptx_data", "")]).requiring(&[&["text"]]);
            tabular::for_each_row(&spec, &cols, |n, file, row| {
                let obj = row.map_err(|reason| bad(file, format!("row {n}: {reason}")))?;
                push(file, format!("row {n}"), Some(&serde_json::Value::Object(obj)))
            })?;
        } else {
            let text = std::fs::read_to_string(path).map_err(|e| TrainerError::io(path, e))?;
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| bad(path, format!("line {}: not valid JSON: {e}", i + 1)))?;
                push(path, format!("line {}", i + 1), Some(&v))?;
            }
        }
        if texts.is_empty() {
            return Err(bad(path, "no line with at least 2 tokens".into()));
        }
        Ok(PtxData { texts, pad: i64::from(tok.pad_token_id()) })
    }

    /// Mean NLL, under `actor` (with gradients), of the texts `keep` of `n` drawn with `rng` (all
    /// `n` are drawn, so every data-parallel rank's `rng` stays in step; one process keeps
    /// `0..n`). `None` when `keep` is empty.
    ///
    /// # Shapes
    /// Returns a scalar f32.
    pub fn loss(
        &self,
        actor: &CausalLm,
        rng: &mut SplitMix,
        n: usize,
        keep: std::ops::Range<usize>,
    ) -> Result<Option<Tensor>> {
        let drawn: Vec<Vec<i64>> =
            (0..n.max(1)).map(|_| self.texts[(rng.next_u64() % self.texts.len() as u64) as usize].clone()).collect();
        let batch = &drawn[keep.start.min(drawn.len())..keep.end.min(drawn.len())];
        if batch.is_empty() {
            return Ok(None);
        }
        let padded = right_pad(batch, self.pad, actor.device())?;
        let t = padded.input_ids.size()[1];
        let lp = token_logprobs(actor, &padded.input_ids, &padded.attention_mask, 1, LogProbOptions::default())?;
        let mask = padded.attention_mask.f_narrow(1, 1, t - 1)?.f_to_kind(Kind::Float)?; // [n, t - 1]
        Ok(Some(masked_nll_mean(&lp.logprobs, &mask)?))
    }
}
