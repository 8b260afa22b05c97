//! An optional supervised warm-up of the actor before RL (the embedded defaults start from a
//! random tiny model): cross-entropy on (prompt, label) pairs, the response tokens and EOS only;
//! prompts with images are read with them.

use rlhf_generation::{left_pad, masked_nll_mean, ImageInputs, LogProbOptions};
use rlhf_models::{CausalLm, Images};
use tch::Tensor;

use crate::config::WarmupConfig;
use crate::data::SplitMix;
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::optim::{Optim, OptimConfig, Schedule};
use crate::rl::experience::logprobs_pass;
use crate::router_aux::with_router_aux_loss;

/// The images of the prompts of some pairs (by index), in order; `None` when they hold none.
pub type PairImages<'a> = &'a dyn Fn(&[usize]) -> Result<Option<Images>>;

/// Trains `actor` for `w.steps` AdamW steps on random batches of `pairs` (their prompts' images
/// from `images`); returns the last loss.
///
/// # Shapes
/// Each pair is (prompt ids, response ids); batches are left-padded `[batch_size, T]`.
pub fn sft_warmup(
    actor: &CausalLm,
    pairs: &[(Vec<i64>, Vec<i64>)],
    eos: i64,
    pad: i64,
    w: &WarmupConfig,
    seed: u64,
    images: Option<PairImages<'_>>,
) -> Result<f64> {
    let settings = OptimConfig {
        lr: w.lr,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.0,
        schedule: Schedule::Constant,
        warmup_steps: 0,
        max_grad_norm: 1.0,
    };
    let mut opt = Optim::new(&actor.vs, &settings, w.steps)?;
    let mut rng = SplitMix(seed ^ 0x5F7);
    let mut last = f64::NAN;
    for _ in 0..w.steps {
        let picked: Vec<usize> =
            (0..w.batch_size.max(1)).map(|_| (rng.next_u64() % pairs.len() as u64) as usize).collect();
        let batch: Vec<&(Vec<i64>, Vec<i64>)> = picked.iter().map(|&i| &pairs[i]).collect();
        let seqs: Vec<Vec<i64>> = batch.iter().map(|(p, r)| [p.as_slice(), r.as_slice(), &[eos]].concat()).collect();
        let padded = left_pad(&seqs, pad, actor.device())?;
        let t = padded.input_ids.size()[1];
        // Target mask in the shifted frame: index j-1 predicts token j; response tokens start after
        // the padding and the prompt.
        let mut mask = vec![0f32; batch.len() * (t as usize - 1)];
        for (i, ((p, _), s)) in batch.iter().zip(&seqs).enumerate() {
            let start = t as usize - s.len() + p.len();
            for j in start..t as usize {
                mask[i * (t as usize - 1) + j - 1] = 1.0;
            }
        }
        let mask = Tensor::f_from_slice(&mask)?.f_view([batch.len() as i64, t - 1])?.f_to_device(actor.device())?;
        let (ids, attn) = (&padded.input_ids, &padded.attention_mask);
        // Prompts and answers interleave in the left-padded rows: every image token is a prompt's.
        let pictures = images.map(|f| f(&picked)).transpose()?.flatten();
        let pictures = pictures.as_ref().map(|images| ImageInputs::prompt(images, t));
        let (lp, pass) = logprobs_pass(actor, ids, attn, pictures, 1, LogProbOptions::default(), false)?;
        let nll = masked_nll_mean(&lp.logprobs, &mask)?;
        last = nll.double_value(&[]);
        let loss = with_router_aux_loss(nll, lp.aux_loss.as_ref(), actor, 1.0, &mut StepMetrics::default())?;
        loss.f_backward()?;
        pass.backward(actor)?;
        opt.step()?;
    }
    Ok(last)
}
