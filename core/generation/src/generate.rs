//! Batched generation with a preallocated KV cache.
//!
//! Prompts are left-padded; positions come from the mask, so a prompt's continuation does not depend
//! on how much padding its batch needed. The prompts are prefilled in one pass, then decoded one
//! token per step ([`crate::decode`]: a capture-safe step, replayed as a CUDA graph on CUDA). Each
//! sequence stops at its first EOS; later slots hold the pad id and are masked out. On CUDA the
//! "all finished?" test — a device→host sync — runs only every [`GenerateConfig::sync_every`]
//! steps so the decode loop does not stall the GPU. Logits that are not finite (NaN weights, a
//! broken config) are noted on the device at every step, zeroed so sampling cannot trip over them,
//! and reported as [`GenerationError::NonFiniteLogits`] at the next such check.

use tch::{Kind, Tensor};

use rlhf_models::multimodal::{shifted_positions, Slots};
use rlhf_models::{position_ids_from_mask, CausalLm, Images, KvCache};

pub use crate::config::{GenerateConfig, StopCheck};
use crate::decode::{decode, Decoded, Start};
use crate::error::{GenerationError, Result};

/// The result of [`generate`].
#[derive(Debug)]
pub struct Generated {
    /// Prompt and response ids, `[batch, prompt_len + steps]`.
    pub sequences: Tensor,
    /// 1 on real prompt tokens and on response tokens up to and including EOS, `[batch, prompt_len + steps]`.
    pub attention_mask: Tensor,
    /// 1 on response (action) tokens, `[batch, steps]`.
    pub response_mask: Tensor,
    /// Length of the (left-padded) prompt block.
    pub prompt_len: i64,
    /// With [`GenerateConfig::logprobs`]: the sampled tokens' log-probs, f32 `[batch, steps]`, 0
    /// after a sequence ended.
    pub logprobs: Option<Tensor>,
}

impl Generated {
    /// Response ids, `[batch, steps]`.
    pub fn responses(&self) -> Result<Tensor> {
        let total = self.sequences.size()[1];
        Ok(self.sequences.f_narrow(1, self.prompt_len, total - self.prompt_len)?)
    }

    /// Response lengths, `[batch]`.
    pub fn response_lengths(&self) -> Result<Tensor> {
        Ok(self.response_mask.f_sum_dim_intlist(-1, false, Kind::Int64)?)
    }
}

/// Generates continuations of left-padded prompts.
///
/// # Shapes
/// - `prompt_ids`, `prompt_mask`: `[batch, prompt_len]` (int64, left-padded)
/// - returns [`Generated`] with `steps <= max_new_tokens`
pub fn generate(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    cfg: &GenerateConfig,
) -> Result<Generated> {
    generate_until(model, prompt_ids, prompt_mask, cfg, None)
}

/// [`generate`], with rows also stopping where `stop` says so.
///
/// # Shapes
/// As [`generate`].
pub fn generate_until(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    cfg: &GenerateConfig,
    stop: Option<StopCheck<'_>>,
) -> Result<Generated> {
    generate_from(model, prompt_ids, prompt_mask, None, cfg, stop)
}

/// [`generate`] for prompts with images (a vision-language model): `images` holds every row's
/// images in the order of their placeholders. The prompts are prefilled with the images' features
/// and multimodal positions — with [`GenerateConfig::prefill_group`], each run's images go through
/// the vision tower once — and each row decodes on from its position plus its delta.
///
/// # Shapes
/// As [`generate`].
pub fn generate_with_images(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    images: &Images,
    cfg: &GenerateConfig,
) -> Result<Generated> {
    generate_from(model, prompt_ids, prompt_mask, Some((images, None)), cfg, None)
}

/// [`generate_until`] for prompts that may hold images ([`generate_with_images`] with `images`,
/// [`generate_until`] without): a multi-turn episode's context — its prompt's images, its text,
/// the turns sampled so far and the observations with their images — prefilled again each turn.
/// `slots` (`[batch, prompt_len]`, non-zero where an image placeholder may be: the prompt's and
/// the observations' tokens) keeps an image token an earlier turn sampled text; `None`: every
/// column may hold one.
///
/// # Shapes
/// As [`generate`].
pub fn generate_until_with_images(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    images: Option<(&Images, Option<&Tensor>)>,
    cfg: &GenerateConfig,
    stop: Option<StopCheck<'_>>,
) -> Result<Generated> {
    generate_from(model, prompt_ids, prompt_mask, images, cfg, stop)
}

fn generate_from(
    model: &CausalLm,
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    images: Option<(&Images, Option<&Tensor>)>,
    cfg: &GenerateConfig,
    stop: Option<StopCheck<'_>>,
) -> Result<Generated> {
    cfg.check()?;
    let size = prompt_ids.size();
    if size.len() != 2 || prompt_mask.size() != size || size[1] == 0 {
        return Err(GenerationError::Input(format!(
            "prompt ids {size:?} and mask {:?} must both be [batch, prompt_len > 0]",
            prompt_mask.size()
        )));
    }
    let (batch, prompt_len) = (size[0], size[1]);
    if cfg.prefill_group < 1 || batch % cfg.prefill_group != 0 {
        return Err(GenerationError::Input(format!(
            "prefill_group {} must be >= 1 and divide the batch of {batch} rows",
            cfg.prefill_group
        )));
    }
    let device = model.device();
    if let Some(seed) = cfg.seed {
        tch::manual_seed(seed as i64);
    }
    tch::no_grad(|| -> Result<Generated> {
        let prompt_ids = prompt_ids.f_to_device(device)?;
        let prompt_mask = prompt_mask.f_to_device(device)?.f_to_kind(Kind::Int64)?;
        let total = prompt_len + cfg.max_new_tokens;
        let group = cfg.prefill_group.max(1);
        let mut cache = model.new_cache(batch / group, total)?;
        // Running key mask over prompt + generated slots; slots are switched on as they are filled.
        let key_mask = Tensor::f_zeros([batch, total], (Kind::Int64, device))?;
        key_mask.f_narrow(1, 0, prompt_len)?.f_copy_(&prompt_mask)?;
        let positions = position_ids_from_mask(&prompt_mask)?;
        let mut next_pos = positions.f_narrow(1, prompt_len - 1, 1)?.f_add_scalar(1)?; // [b, 1]
        let logits = match images {
            None => prefill(model, &prompt_ids, &prompt_mask, &positions, &mut cache, cfg.prefill_group)?,
            Some((images, slots)) => {
                let (ids, mask) = (&prompt_ids, &prompt_mask);
                let (logits, deltas) = prefill_images(model, ids, mask, images, slots, &mut cache, group)?;
                next_pos = shifted_positions(&next_pos, &deltas)?;
                logits
            }
        }; // [b, vocab]
        let finished = Tensor::f_zeros([batch], (Kind::Bool, device))?;
        let start = Start { cache, key_mask, base: prompt_len, next_pos, logits, finished, compact: true };
        let Decoded { tokens: responses, alive, logprobs, .. } = decode(model, start, cfg, stop)?;
        let response_mask = alive.f_to_kind(Kind::Int64)?; // [b, steps]
        Ok(Generated {
            sequences: Tensor::f_cat(&[&prompt_ids, &responses], 1)?,
            attention_mask: Tensor::f_cat(&[&prompt_mask, &response_mask], 1)?,
            response_mask,
            prompt_len,
            logprobs: if cfg.logprobs { logprobs } else { None },
        })
    })
}

/// Runs the prompts through the model into `cache` and returns the logits of their last position.
/// With `group > 1` the rows come in runs of `group` identical prompts: one row of each run is
/// prefilled into a cache of `batch / group` rows, which is then repeated to `batch` rows in place
/// of `cache`, as are the logits.
///
/// # Shapes
/// - `ids`, `mask`, `positions`: `[batch, prompt_len]`; `cache`: `batch / group` rows on entry,
///   `batch` rows on return; returns `[batch, vocab]`
pub(crate) fn prefill(
    model: &CausalLm,
    ids: &Tensor,
    mask: &Tensor,
    positions: &Tensor,
    cache: &mut KvCache,
    group: i64,
) -> Result<Tensor> {
    let last = ids.size()[1] - 1;
    if group == 1 {
        let hidden = model.hidden_states(ids, mask, positions, Some(cache))?;
        return Ok(model.logits_from_hidden(&hidden.f_select(1, last)?)?);
    }
    let firsts = run_firsts(ids, mask, group)?;
    let pick = |t: &Tensor| t.f_index_select(0, &firsts);
    let hidden = model.hidden_states(&pick(ids)?, &pick(mask)?, &pick(positions)?, Some(cache))?;
    let logits = model.logits_from_hidden(&hidden.f_select(1, last)?)?; // [runs, vocab]
    cache.repeat_rows(group)?;
    Ok(logits.f_repeat_interleave_self_int(group, 0, None)?)
}

/// The first row of each run of `group` rows, after checking that every row of a run equals its
/// first (one host sync for both checks).
///
/// # Shapes
/// - `ids`, `mask`: `[batch, len]` → `[batch / group]` int64
fn run_firsts(ids: &Tensor, mask: &Tensor, group: i64) -> Result<Tensor> {
    let (batch, len) = (ids.size()[0], ids.size()[1]);
    let runs = batch / group;
    // [runs, group, len]
    let same = |t: &Tensor| -> Result<Tensor> {
        let t = t.f_view([runs, group, len])?;
        Ok(t.f_eq_tensor(&t.f_narrow(1, 0, 1)?)?.f_all()?)
    };
    if !bool::try_from(same(ids)?.f_logical_and(&same(mask)?)?)? {
        return Err(GenerationError::Input(format!(
            "prefill_group {group}: the {batch} prompt rows are not runs of {group} identical prompts"
        )));
    }
    Ok(Tensor::f_arange_start_step(0, batch, group, (Kind::Int64, ids.device()))?)
}

/// [`prefill`] of prompts with images: their features in place of the placeholders (where
/// `slots` allows, everywhere without), at the multimodal positions; with `group > 1` only the
/// first row of each run (and its images) goes through the model. Returns the last position's
/// logits and each row's position delta.
///
/// # Shapes
/// - `ids`, `mask`, `slots`: `[batch, prompt_len]` → `[batch, vocab]` and `[batch]`
fn prefill_images(
    model: &CausalLm,
    ids: &Tensor,
    mask: &Tensor,
    images: &Images,
    slots: Option<&Tensor>,
    cache: &mut KvCache,
    group: i64,
) -> Result<(Tensor, Tensor)> {
    let last = ids.size()[1] - 1;
    let seq = ids.size()[1];
    if let Some(observed) = slots {
        if group != 1 {
            return Err(GenerationError::Input(format!(
                "prefill_group {group} with image slots: a context with observations' images is prefilled row by row"
            )));
        }
        let slots = Slots { prompt_len: 0, observed: Some(observed.shallow_clone()) };
        let (positions, deltas) = model.image_positions(ids, mask, &images.grids, &slots)?;
        let visual = model.visual(images, slots)?;
        let hidden = model.hidden_states_with_images(ids, mask, &positions, &visual, Some(cache))?;
        return Ok((model.logits_from_hidden(&hidden.f_select(1, last)?)?, deltas));
    }
    let (ids_p, mask_p, images_p);
    let (ids, mask, images) = if group == 1 {
        (ids, mask, images)
    } else {
        let firsts = run_firsts(ids, mask, group)?;
        let rows = model.images_per_row(ids, images)?;
        let which: Vec<usize> = rows.iter().step_by(group as usize).flat_map(|r| r.clone()).collect();
        (ids_p, mask_p, images_p) =
            (ids.f_index_select(0, &firsts)?, mask.f_index_select(0, &firsts)?, images.select(&which)?);
        (&ids_p, &mask_p, &images_p)
    };
    let (positions, deltas) = model.image_positions(ids, mask, &images.grids, &Slots::prompt(seq))?;
    let visual = model.visual(images, Slots::prompt(seq))?;
    let hidden = model.hidden_states_with_images(ids, mask, &positions, &visual, Some(cache))?;
    let logits = model.logits_from_hidden(&hidden.f_select(1, last)?)?;
    if group == 1 {
        return Ok((logits, deltas));
    }
    cache.repeat_rows(group)?;
    Ok((logits.f_repeat_interleave_self_int(group, 0, None)?, deltas.f_repeat_interleave_self_int(group, 0, None)?))
}
