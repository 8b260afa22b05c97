//! Perplexity over a set of token sequences: `exp(mean NLL)` over every predicted token of every
//! sequence (a sequence of n tokens predicts n − 1), the way transformers' `labels=ids` loss counts.

use tch::Kind;

use rlhf_models::CausalLm;

use crate::batch::right_pad;
use crate::error::{GenerationError, Result};
use crate::logprobs::{masked_nll_sum, token_logprobs, LogProbOptions};

/// Perplexity, mean negative log-likelihood and the number of predicted tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    pub nll: f64,
    pub tokens: i64,
}

/// Scores `sequences` in batches of `batch_size`; sequences shorter than 2 tokens add nothing.
pub fn perplexity(model: &CausalLm, sequences: &[Vec<i64>], batch_size: usize, pad_id: i64) -> Result<Perplexity> {
    let usable: Vec<&Vec<i64>> = sequences.iter().filter(|s| s.len() >= 2).collect();
    if usable.is_empty() {
        return Err(GenerationError::Input("no sequence has at least 2 tokens: nothing to predict".into()));
    }
    let mut total_nll = 0f64;
    let mut tokens = 0i64;
    tch::no_grad(|| -> Result<()> {
        for chunk in usable.chunks(batch_size.max(1)) {
            let seqs: Vec<Vec<i64>> = chunk.iter().map(|s| (*s).clone()).collect();
            let b = right_pad(&seqs, pad_id, model.device())?;
            let lp = token_logprobs(model, &b.input_ids, &b.attention_mask, 1, LogProbOptions::default())?;
            let seq = b.attention_mask.size()[1];
            let target_mask = b.attention_mask.f_narrow(1, 1, seq - 1)?.f_to_kind(Kind::Double)?;
            let nll = masked_nll_sum(&lp.logprobs, &target_mask, Kind::Double)?;
            total_nll += f64::try_from(nll)?;
            tokens += i64::try_from(target_mask.f_sum(Kind::Int64)?)?;
        }
        Ok(())
    })?;
    let nll = total_nll / tokens as f64;
    Ok(Perplexity { ppl: nll.exp(), nll, tokens })
}
