//! Data parallelism in the RL step. Every rank draws the same global generation batch and samples
//! its own whole prompt groups (the sampling noise is drawn for the whole batch, so the ranks
//! together sample the tokens one process would); scores its samples; computes their old-policy,
//! reference and critic values; then the ranks **gather** the experience so `prepare` runs on
//! the whole batch on every rank — group statistics, advantage whitening, the adaptive KL and the
//! batch metrics are those of one process. Each minibatch is split across ranks for the losses,
//! and the gradients are summed before clipping. In a world of one every function here returns
//! its input.

use rlhf_collective::World;
use rlhf_generation::{PaddedBatch, RowWindow};
use tch::Tensor;

use crate::dist::{self, err};
use crate::error::{Result, TrainerError};
use crate::rl::experience::Batch;
use crate::rl::prompts::PromptBatch;
use crate::rl::score::{Scored, SourceScores};

/// Where this rank's rows sit in the global generation batch.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    /// First global row.
    pub offset: usize,
    /// This rank's rows.
    pub rows: usize,
    /// Rows of the global batch.
    pub total: usize,
}

impl Part {
    /// The sampling window, or `None` for the whole batch (one process).
    pub fn window(&self) -> Option<RowWindow> {
        (self.rows != self.total).then_some(RowWindow { offset: self.offset as i64, total: self.total as i64 })
    }
}

/// This rank's whole prompt groups of the global batch of `prompts × g` rows (padded to the
/// global longest prompt, so every rank's prompt block has the same width).
///
/// # Shapes
/// `global.padded`: `[prompts·g, P]` → `[rows, P]`.
pub fn prompts(global: PromptBatch, prompts: usize, g: usize, world: &World) -> Result<(PromptBatch, Part)> {
    let total = prompts * g;
    if !world.is_distributed() {
        return Ok((global, Part { offset: 0, rows: total, total }));
    }
    let mine = dist::shard(prompts, world.rank(), world.size());
    let (offset, rows) = (mine.start * g, mine.len() * g);
    let narrow = |t: &Tensor| t.f_narrow(0, offset as i64, rows as i64);
    let padded = PaddedBatch {
        input_ids: narrow(&global.padded.input_ids)?,
        attention_mask: narrow(&global.padded.attention_mask)?,
    };
    let group_of_row = global.group_of_row[offset..offset + rows].to_vec();
    Ok((PromptBatch { padded, group_of_row }, Part { offset, rows, total }))
}

/// Every rank's source scores and kept rows, in rank order: the kept rows become global row
/// indices, each source's scores and metrics are concatenated.
pub fn gather_scores(
    world: &World,
    part: Part,
    kept_rows: &[usize],
    scores: Vec<SourceScores>,
) -> Result<(Vec<usize>, Vec<SourceScores>)> {
    if !world.is_distributed() {
        return Ok((kept_rows.to_vec(), scores));
    }
    let rows: Vec<f64> = kept_rows.iter().map(|&r| (r + part.offset) as f64).collect();
    let rows = dist::concat_f64(world, &rows)?.into_iter().map(|r| r as usize).collect();
    let mut all = Vec::with_capacity(scores.len());
    for s in scores {
        let values = dist::concat_f64(world, &s.scores)?;
        // Metric values travel as bits, so NaN survives.
        let local: Vec<(String, u64)> = s.metrics.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect();
        let bytes =
            serde_json::to_vec(&local).map_err(|e| TrainerError::Distributed(format!("reward metrics: {e}")))?;
        let mut metrics = Vec::new();
        for part in world.all_gather_bytes(&bytes).map_err(err)? {
            let got: Vec<(String, u64)> =
                serde_json::from_slice(&part).map_err(|e| TrainerError::Distributed(format!("reward metrics: {e}")))?;
            metrics.extend(got.into_iter().map(|(k, b)| (k, f64::from_bits(b))));
        }
        all.push(SourceScores { scores: values, metrics });
    }
    Ok((rows, all))
}

/// The scored samples of this rank: `scored` (global rows) restricted to `part`, as local rows.
pub fn local_scored(scored: &Scored, part: Part) -> Scored {
    let range = part.offset..part.offset + part.rows;
    let (rows, rewards) = scored
        .rows
        .iter()
        .zip(&scored.rewards)
        .filter(|(r, _)| range.contains(r))
        .map(|(&r, &x)| (r - part.offset, x))
        .unzip();
    Scored { rows, rewards }
}

/// `t` padded with `value` to `rows` rows and (for 2-D tensors) `width` columns.
fn pad_to(t: &Tensor, rows: i64, width: Option<i64>, value: f64) -> Result<Tensor> {
    let size = t.size();
    let mut target = size.clone();
    target[0] = rows;
    if let Some(w) = width {
        target[1] = w;
    }
    if target == size {
        return Ok(t.f_contiguous()?);
    }
    let out = Tensor::f_full(&target, value, (t.kind(), t.device()))?;
    let mut view = out.f_narrow(0, 0, size[0])?;
    if size.len() > 1 {
        view = view.f_narrow(1, 0, size[1])?;
    }
    view.f_copy_(t)?;
    Ok(out)
}

/// Every rank's rows of `t`, in rank order: padded to a common shape for the all-gather and cut
/// back to each rank's `counts[r]` rows.
fn gather_rows(world: &World, t: &Tensor, counts: &[i64], width: Option<i64>, value: f64) -> Result<Tensor> {
    let most = counts.iter().copied().max().unwrap_or(0).max(1);
    let parts = world.all_gather(&pad_to(t, most, width, value)?).map_err(err)?;
    let kept: Vec<Tensor> =
        parts.iter().zip(counts).map(|(p, &n)| p.f_narrow(0, 0, n)).collect::<std::result::Result<_, _>>()?;
    Ok(Tensor::f_cat(&kept, 0)?)
}

/// The whole batch on every rank: every tensor of every rank's [`Batch`] (and entropy) gathered
/// in rank order, responses right-padded to the longest (`pad` ids, zero masks and values).
///
/// # Shapes
/// Per rank `[B_r, P + R_r]`, `[B_r, R_r]`, `[B_r]` → `[ΣB_r, P + max R_r]`, `[ΣB_r, max R_r]`, `[ΣB_r]`.
pub fn gather_batch(world: &World, b: Batch, entropy: Option<Tensor>, pad: i64) -> Result<(Batch, Option<Tensor>)> {
    if !world.is_distributed() {
        return Ok((b, entropy));
    }
    let local = [b.len() as f64, b.response_len() as f64];
    let all = dist::concat_f64(world, &local)?;
    let counts: Vec<i64> = all.chunks(2).map(|c| c[0] as i64).collect();
    let r = all.chunks(2).map(|c| c[1] as i64).max().unwrap_or(0);
    let w = b.prompt_len + r;
    let per_token = |t: &Tensor| gather_rows(world, t, &counts, Some(r), 0.0);
    let opt = |t: &Option<Tensor>| t.as_ref().map(per_token).transpose();
    let batch = Batch {
        sequences: gather_rows(world, &b.sequences, &counts, Some(w), pad as f64)?,
        attention_mask: gather_rows(world, &b.attention_mask, &counts, Some(w), 0.0)?,
        action_mask: per_token(&b.action_mask)?,
        prompt_len: b.prompt_len,
        old_logprobs: per_token(&b.old_logprobs)?,
        ref_logprobs: opt(&b.ref_logprobs)?,
        values: opt(&b.values)?,
        rewards: gather_rows(world, &b.rewards, &counts, None, 0.0)?,
        group_ids: gather_rows(world, &b.group_ids, &counts, None, 0.0)?,
        behavior_logprobs: opt(&b.behavior_logprobs)?,
        // A data-parallel step never reuses the old pass (each rank's share is a sub-batch).
        policy: None,
        policy_checkpoint: None,
    };
    Ok((batch, opt(&entropy)?))
}
