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
    Ok((PromptBatch { padded, group_of_row, images: None, image_files: None }, Part { offset, rows, total }))
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

/// One tensor of [`gather_rows_fused`]: its rows are padded to a common count, its columns (2-D
/// tensors) to `width`, with `value`.
struct RowsOf<'a> {
    t: &'a Tensor,
    width: Option<i64>,
    value: f64,
}

/// Every rank's rows of each tensor, in rank order, cut back to each rank's `counts[r]` rows.
/// The tensors of one dtype travel in one all-gather (flattened end to end after padding to a
/// common shape) instead of one each: a step's experience is ~10 tensors but 2–3 dtypes, and on
/// loopback a collective's latency, not its bytes, is what a small batch pays for.
fn gather_rows_fused(world: &World, items: &[RowsOf], counts: &[i64]) -> Result<Vec<Tensor>> {
    let most = counts.iter().copied().max().unwrap_or(0).max(1);
    let padded: Vec<Tensor> = items.iter().map(|i| pad_to(i.t, most, i.width, i.value)).collect::<Result<_>>()?;
    let mut out: Vec<Option<Tensor>> = items.iter().map(|_| None).collect();
    let mut kinds: Vec<tch::Kind> = Vec::new();
    for p in &padded {
        if !kinds.contains(&p.kind()) {
            kinds.push(p.kind());
        }
    }
    for kind in kinds {
        let of_kind: Vec<usize> = (0..padded.len()).filter(|&i| padded[i].kind() == kind).collect();
        let flat: Vec<Tensor> =
            of_kind.iter().map(|&i| padded[i].f_reshape([-1])).collect::<std::result::Result<_, _>>()?;
        let parts = world.all_gather(&Tensor::f_cat(&flat, 0)?).map_err(err)?;
        let mut at = 0;
        for &i in &of_kind {
            let (n, shape) = (padded[i].numel() as i64, padded[i].size());
            let kept: Vec<Tensor> = parts
                .iter()
                .zip(counts)
                .map(|(p, &rows)| p.f_narrow(0, at, n)?.f_view(shape.as_slice())?.f_narrow(0, 0, rows))
                .collect::<std::result::Result<_, _>>()?;
            out[i] = Some(Tensor::f_cat(&kept, 0)?);
            at += n;
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// The whole batch on every rank: every tensor of every rank's [`Batch`] (and entropy) gathered
/// in rank order, responses right-padded to the longest (`pad` ids, zero masks and values); the
/// rows' images are left for the caller to find from their records.
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
    // Every tensor of the batch, the optional ones where present, in one fused gather.
    let token = |t| RowsOf { t, width: Some(r), value: 0.0 };
    let row = |t| RowsOf { t, width: None, value: 0.0 };
    let mut items = vec![
        RowsOf { t: &b.sequences, width: Some(w), value: pad as f64 },
        RowsOf { t: &b.attention_mask, width: Some(w), value: 0.0 },
        token(&b.action_mask),
        token(&b.old_logprobs),
        row(&b.rewards),
        row(&b.group_ids),
        row(&b.records),
    ];
    let optional = [&b.ref_logprobs, &b.values, &b.behavior_logprobs, &entropy];
    items.extend(optional.iter().filter_map(|t| t.as_ref()).map(token));
    let mut all = gather_rows_fused(world, &items, &counts)?.into_iter();
    let mut next = || all.next().ok_or_else(|| TrainerError::Distributed("gather_batch: a tensor went missing".into()));
    let (sequences, attention_mask, action_mask, old_logprobs, rewards, group_ids, records) =
        (next()?, next()?, next()?, next()?, next()?, next()?, next()?);
    let mut opt = |t: &Option<Tensor>| t.as_ref().map(|_| next()).transpose();
    let (ref_logprobs, values, behavior_logprobs, entropy) =
        (opt(&b.ref_logprobs)?, opt(&b.values)?, opt(&b.behavior_logprobs)?, opt(&entropy)?);
    // Each rank keeps its own experience pass (with its graph) for the step's only minibatch, which
    // it then trains on its own rows: only when every rank has as many rows, so that each rank's
    // loss, a mean over its rows divided by the ranks, weighs every row as one process does.
    let even = counts.iter().all(|&n| n == counts[0]);
    let rank = world.rank();
    let offset: i64 = counts[..rank].iter().sum();
    let (policy, policy_checkpoint, policy_rows) = match b.policy {
        Some(p) if even => (Some(p), b.policy_checkpoint, Some((offset, counts[rank]))),
        _ => (None, None, None),
    };
    let batch = Batch {
        sequences,
        attention_mask,
        action_mask,
        prompt_len: b.prompt_len,
        old_logprobs,
        ref_logprobs,
        values,
        rewards,
        group_ids,
        records,
        // Every rank finds the gathered rows' images from `records` ([`crate::rl::visual`]).
        images: None,
        behavior_logprobs,
        policy,
        policy_checkpoint,
        policy_rows,
    };
    Ok((batch, entropy))
}
