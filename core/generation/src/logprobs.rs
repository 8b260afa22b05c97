//! Log-probabilities and entropy of given tokens.
//!
//! The LM head and the fp32 log-softmax are applied to a bounded number of rows at a time, so the
//! `[tokens, vocab]` fp32 tensor never exists for the whole batch. Gradients flow when called
//! outside `no_grad`.

use tch::{Kind, Tensor};

use rlhf_models::{position_ids_from_mask, CausalLm, Checkpointed, SharedPrefixes};

use crate::error::{GenerationError, Result};

/// Options of [`token_logprobs`].
#[derive(Debug, Clone, Copy)]
pub struct LogProbOptions {
    /// Upper bound on `rows × vocab` fp32 logits materialised at once.
    pub max_chunk_elements: i64,
    /// Also compute the entropy of each predictive distribution.
    pub entropy: bool,
    /// Compute a prompt (the first `from` tokens) that several rows share once for all of them
    /// ([`CausalLm::hidden_states_after_prefix`]): GRPO's G samples of a prompt. Equal to the
    /// plain pass within float rounding; without shared prompts it is the plain pass.
    pub share_prefix: bool,
}

impl Default for LogProbOptions {
    fn default() -> Self {
        LogProbOptions { max_chunk_elements: 1 << 26, entropy: false, share_prefix: false }
    }
}

/// Output of [`token_logprobs`].
#[derive(Debug)]
pub struct TokenLogProbs {
    /// `log p(ids[t] | ids[..t])` for `t` in `from..seq`, fp32, `[batch, seq - from]`.
    pub logprobs: Tensor,
    /// Entropy of the same distributions, fp32, `[batch, seq - from]`.
    pub entropy: Option<Tensor>,
}

/// Log-probs of the tokens at positions `from..seq`, each predicted from its prefix.
///
/// # Shapes
/// - `input_ids`, `attention_mask`: `[batch, seq]`; `1 <= from < seq`
/// - returns `[batch, seq - from]` (fp32)
pub fn token_logprobs(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    check_from(input_ids, from)?;
    if let Some(prefix) = shared_prefix(input_ids, attention_mask, from, opts)? {
        let hidden = model.hidden_states_after_prefix(input_ids, attention_mask, &prefix)?; // [b, seq − from + 1, h]
        return from_hidden(model, &hidden, &after_prefix(input_ids, from)?, 1, opts);
    }
    let positions = position_ids_from_mask(attention_mask)?;
    let hidden = model.hidden_states(input_ids, attention_mask, &positions, None)?; // [b, seq, h]
    from_hidden(model, &hidden, input_ids, from, opts)
}

/// [`token_logprobs`] from a checkpointed pass of the model (activation checkpointing, see
/// [`rlhf_models::checkpointing`]): the log-probs carry gradients back to the pass's output;
/// backpropagate the loss, then hand the pass to [`CausalLm::backward_checkpointed`].
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_checkpointed(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<(TokenLogProbs, Checkpointed)> {
    check_from(input_ids, from)?;
    if let Some(prefix) = shared_prefix(input_ids, attention_mask, from, opts)? {
        let ck = model.hidden_states_checkpointed_after_prefix(input_ids, attention_mask, &prefix)?;
        let lp = from_hidden(model, ck.hidden(), &after_prefix(input_ids, from)?, 1, opts)?;
        return Ok((lp, ck));
    }
    let positions = position_ids_from_mask(attention_mask)?;
    let ck = model.hidden_states_checkpointed(input_ids, attention_mask, &positions)?;
    let lp = from_hidden(model, ck.hidden(), input_ids, from, opts)?;
    Ok((lp, ck))
}

/// [`token_logprobs_checkpointed`] when `checkpointed`, else [`token_logprobs`] (with no pass to
/// hand back): what a training step calls under `train.gradient_checkpointing`.
///
/// # Shapes
/// As [`token_logprobs`].
pub fn token_logprobs_pass(
    model: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
    checkpointed: bool,
) -> Result<(TokenLogProbs, Option<Checkpointed>)> {
    if checkpointed {
        let (lp, ck) = token_logprobs_checkpointed(model, input_ids, attention_mask, from, opts)?;
        return Ok((lp, Some(ck)));
    }
    Ok((token_logprobs(model, input_ids, attention_mask, from, opts)?, None))
}

/// With [`LogProbOptions::share_prefix`], the rows' shared first `from` tokens — `None` when
/// sharing is off or no prompt is held by more than one row (then the plain pass runs).
fn shared_prefix(
    input_ids: &Tensor,
    attention_mask: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<Option<SharedPrefixes>> {
    if !opts.share_prefix {
        return Ok(None);
    }
    let prefix = SharedPrefixes::find(input_ids, attention_mask, from)?;
    Ok(prefix.any_shared().then_some(prefix))
}

/// The ids from position `from − 1` on, aligned with the hidden states a shared-prefix pass
/// returns: `[batch, seq]` → `[batch, seq − from + 1]`.
fn after_prefix(input_ids: &Tensor, from: i64) -> Result<Tensor> {
    let seq = input_ids.size()[1];
    Ok(input_ids.f_narrow(1, from - 1, seq - from + 1)?)
}

fn check_from(input_ids: &Tensor, from: i64) -> Result<()> {
    let size = input_ids.size();
    if size.len() != 2 || from < 1 || from >= size[1] {
        return Err(GenerationError::Input(format!(
            "token_logprobs: ids {size:?}, from = {from}: need 1 <= from < seq"
        )));
    }
    Ok(())
}

/// The LM head, log-softmax and gather over positions `from - 1 .. seq - 1` of `hidden`, in
/// chunks of at most `opts.max_chunk_elements` logits.
///
/// # Shapes
/// - `hidden`: `[batch, seq, hidden]`; `input_ids`: `[batch, seq]` → `[batch, seq - from]`
fn from_hidden(
    model: &CausalLm,
    hidden: &Tensor,
    input_ids: &Tensor,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
    let n = seq - from;
    let h = hidden.f_narrow(1, from - 1, n)?.f_reshape([batch * n, -1])?; // [b*n, h]
    let targets = input_ids.f_narrow(1, from, n)?.f_reshape([batch * n, 1])?; // [b*n, 1]
    let vocab = model.arch().vocab_size;
    let rows = (opts.max_chunk_elements / vocab).max(1);
    let mut lps = Vec::new();
    let mut ents = Vec::new();
    let mut start = 0;
    while start < batch * n {
        let len = rows.min(batch * n - start);
        let logits = model.logits_from_hidden(&h.f_narrow(0, start, len)?)?.f_to_kind(Kind::Float)?; // [c, v]
        let lse = logits.f_logsumexp([-1], true)?; // [c, 1]
        let picked = logits.f_gather(1, &targets.f_narrow(0, start, len)?, false)?; // [c, 1]
        lps.push(picked.f_sub(&lse)?.f_squeeze_dim(1)?);
        if opts.entropy {
            let p = logits.f_sub(&lse)?.f_exp()?;
            let ent = lse.f_squeeze_dim(1)?.f_sub(&p.f_mul(&logits)?.f_sum_dim_intlist(-1, false, Kind::Float)?)?;
            ents.push(ent);
        }
        start += len;
    }
    let logprobs = Tensor::f_cat(&lps, 0)?.f_view([batch, n])?;
    let entropy = if opts.entropy { Some(Tensor::f_cat(&ents, 0)?.f_view([batch, n])?) } else { None };
    Ok(TokenLogProbs { logprobs, entropy })
}

/// The negative log-likelihood of the target tokens, `−Σ logprobs · mask`, summed in `kind`
/// (`Float` for losses, `Double` for perplexity over many batches). The one masked NLL of the
/// project: SFT, the RL warm-up, the ptx loss and perplexity all reduce through it.
///
/// # Shapes
/// `logprobs`, `mask`: `[batch, seq]` (the mask 1.0 on targets); returns a scalar of `kind`.
pub fn masked_nll_sum(logprobs: &Tensor, mask: &Tensor, kind: Kind) -> Result<Tensor> {
    Ok(logprobs.f_to_kind(kind)?.f_mul(mask)?.f_sum(kind)?.f_neg()?)
}

/// The mean NLL per target token (f32): [`masked_nll_sum`] over the number of targets.
///
/// # Shapes
/// `logprobs`, `mask`: `[batch, seq]` f32; returns a scalar.
pub fn masked_nll_mean(logprobs: &Tensor, mask: &Tensor) -> Result<Tensor> {
    Ok(masked_nll_sum(logprobs, mask, Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?)?)
}
