//! Perplexity over a set of token sequences: `exp(mean NLL)` over every predicted token of every
//! sequence (a sequence of n tokens predicts n − 1), the way transformers' `labels=ids` loss counts.

use tch::Kind;

use rlhf_models::{CausalLm, Images};

use crate::batch::right_pad;
use crate::error::{GenerationError, Result};
use crate::logprobs::{masked_nll_sum, token_logprobs, token_logprobs_with_images, ImageInputs, LogProbOptions};

/// Perplexity, mean negative log-likelihood and the number of predicted tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    pub nll: f64,
    pub tokens: i64,
}

/// Scores `sequences` in batches of `batch_size`; sequences shorter than 2 tokens add nothing.
pub fn perplexity(model: &CausalLm, sequences: &[Vec<i64>], batch_size: usize, pad_id: i64) -> Result<Perplexity> {
    perplexity_with_images(model, sequences, None, batch_size, pad_id)
}

/// [`perplexity`] of sequences that hold images (`images[i]` are sequence `i`'s, in placeholder
/// order; a vision-language model): the features in place of the placeholders, every token at its
/// multimodal position; the placeholders themselves are not predicted (as TRL's vision-language
/// collator masks them out of the labels).
pub fn perplexity_with_images(
    model: &CausalLm,
    sequences: &[Vec<i64>],
    images: Option<&[Images]>,
    batch_size: usize,
    pad_id: i64,
) -> Result<Perplexity> {
    let usable: Vec<usize> = (0..sequences.len()).filter(|&i| sequences[i].len() >= 2).collect();
    if usable.is_empty() {
        return Err(GenerationError::Input("no sequence has at least 2 tokens: nothing to predict".into()));
    }
    let image_token = images.and(model.vision()).map(|v| v.config().image_token_id);
    let mut total_nll = 0f64;
    let mut tokens = 0i64;
    tch::no_grad(|| -> Result<()> {
        for chunk in usable.chunks(batch_size.max(1)) {
            let seqs: Vec<Vec<i64>> = chunk.iter().map(|&i| sequences[i].clone()).collect();
            let b = right_pad(&seqs, pad_id, model.device())?;
            let opts = LogProbOptions::default();
            let picked = match images {
                Some(all) => Images::concat(&chunk.iter().map(|&i| &all[i]).collect::<Vec<_>>())?,
                None => None,
            };
            let lp = match &picked {
                Some(imgs) => {
                    let width = b.input_ids.size()[1];
                    let inputs = ImageInputs::prompt(imgs, width);
                    token_logprobs_with_images(model, &b.input_ids, &b.attention_mask, inputs, 1, opts)?
                }
                _ => token_logprobs(model, &b.input_ids, &b.attention_mask, 1, opts)?,
            };
            let seq = b.attention_mask.size()[1];
            let mut target_mask = b.attention_mask.f_narrow(1, 1, seq - 1)?.f_to_kind(Kind::Double)?;
            if let Some(token) = image_token {
                let text = b.input_ids.f_narrow(1, 1, seq - 1)?.f_ne(token)?.f_to_kind(Kind::Double)?;
                target_mask = target_mask.f_mul(&text)?;
            }
            let nll = masked_nll_sum(&lp.logprobs, &target_mask, Kind::Double)?;
            total_nll += f64::try_from(nll)?;
            tokens += i64::try_from(target_mask.f_sum(Kind::Int64)?)?;
        }
        Ok(())
    })?;
    let nll = total_nll / tokens as f64;
    Ok(Perplexity { ppl: nll.exp(), nll, tokens })
}
