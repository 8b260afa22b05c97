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

/// Tokenised ptx texts (each at least 2 tokens).
pub struct PtxData {
    pub texts: Vec<Vec<i64>>,
    pub pad: i64,
}

impl PtxData {
    /// Reads a JSONL file with a string `text` per line (blank lines skipped).
    pub fn read(path: &Path, tok: &HfTokenizer) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainerError::io(path, e))?;
        let bad = |message: String| TrainerError::Data { path: path.to_path_buf(), message };
        let mut texts = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(format!("line {}: not valid JSON: {e}", i + 1)))?;
            let Some(s) = v.get("text").and_then(|s| s.as_str()) else {
                return Err(bad(format!("line {}: missing string `text`", i + 1)));
            };
            let ids = ids_i64(&tok.encode(s, true)?);
            if ids.len() >= 2 {
                texts.push(ids);
            }
        }
        if texts.is_empty() {
            return Err(bad("no line with at least 2 tokens".into()));
        }
        Ok(PtxData { texts, pad: i64::from(tok.pad_token_id()) })
    }

    /// Mean NLL of `n` texts drawn with `rng`, under `actor` (with gradients).
    ///
    /// # Shapes
    /// Returns a scalar f32.
    pub fn loss(&self, actor: &CausalLm, rng: &mut SplitMix, n: usize) -> Result<Tensor> {
        let batch: Vec<Vec<i64>> =
            (0..n.max(1)).map(|_| self.texts[(rng.next_u64() % self.texts.len() as u64) as usize].clone()).collect();
        let padded = right_pad(&batch, self.pad, actor.device())?;
        let t = padded.input_ids.size()[1];
        let lp = token_logprobs(actor, &padded.input_ids, &padded.attention_mask, 1, LogProbOptions::default())?;
        let mask = padded.attention_mask.f_narrow(1, 1, t - 1)?.f_to_kind(Kind::Float)?; // [n, t - 1]
        Ok(masked_nll_mean(&lp.logprobs, &mask)?)
    }
}
