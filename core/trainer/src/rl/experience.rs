//! Stage 4, **experience** (no gradients): for the scored samples, the old policy's log-probs
//! (and entropy, for the metrics), the reference model's log-probs and the critic's values of the
//! state before each response token — everything the algorithm's `prepare` and the minibatch
//! losses compare against.

use rlhf_generation::{
    token_logprobs, token_logprobs_pass, token_logprobs_pass_with_images, token_logprobs_with_images, ImageInputs,
    LogProbOptions, LogProbPass, TokenLogProbs,
};
use rlhf_models::multimodal::Slots;
use rlhf_models::{CausalLm, Images, ScalarHeadModel};

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::rl::phase::{PhaseClock, PhaseCost};
use crate::rl::rollout::Rollout;
use crate::rl::score::Scored;
use crate::rl::visual::{self, RowImages};
use crate::train_engine::TrainEngine;

/// One generation batch after scoring, on the training device.
///
/// # Shapes
/// `B` scored samples, prompt length `P`, `R` response slots:
/// `sequences`, `attention_mask` `[B, P + R]` (i64); `action_mask`, `old_logprobs`,
/// `ref_logprobs`, `values`, `behavior_logprobs` `[B, R]` f32; `rewards [B]` f32; `group_ids`,
/// `records` `[B]` i64.
pub struct Batch {
    pub sequences: Tensor,
    pub attention_mask: Tensor,
    pub action_mask: Tensor,
    pub prompt_len: i64,
    pub old_logprobs: Tensor,
    pub ref_logprobs: Option<Tensor>,
    pub values: Option<Tensor>,
    pub rewards: Tensor,
    pub group_ids: Tensor,
    /// Each row's prompt, as its index into the run's prompt records.
    pub records: Tensor,
    /// Each row's images, when the policy reads images and the rows hold some.
    pub images: Option<RowImages>,
    /// An external engine's log-probs of the sampled tokens (see [`crate::rl::rollout::Rollout`]).
    pub behavior_logprobs: Option<Tensor>,
    /// The actor's log-probs (and entropy) of the batch **with** their autograd graph, when the
    /// step's only minibatch reuses them instead of a second forward pass ([`compute`]'s
    /// `reuse`); `old_logprobs` are then these, detached.
    pub policy: Option<TokenLogProbs>,
    /// With gradient checkpointing, the checkpointed pass behind `policy`: after the loss has
    /// been backpropagated, [`LogProbPass::backward`] takes it.
    pub policy_checkpoint: Option<LogProbPass>,
    /// The rows `[offset, offset + count)` of the batch that `policy` covers, when it is one data-
    /// parallel rank's own pass over its part of a gathered batch; `None`: the whole batch.
    pub policy_rows: Option<(i64, i64)>,
}

impl Batch {
    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.rewards.size()[0] as usize
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Response slots `R`.
    pub fn response_len(&self) -> i64 {
        self.action_mask.size()[1]
    }
}

/// The models that see the experience.
pub struct Models<'a> {
    pub actor: &'a CausalLm,
    pub reference: Option<&'a CausalLm>,
    pub critic: Option<&'a ScalarHeadModel>,
    /// The reference's vision tower is the actor's: it takes the image features the actor's
    /// frozen tower made ([`rlhf_models::Images::features`]); else it runs its own.
    pub ref_shares_vision: bool,
    /// The same for the critic's tower.
    pub critic_shares_vision: bool,
}

/// Time and peak memory per model.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExperienceTimes {
    pub old_logprobs: PhaseCost,
    pub reference: PhaseCost,
    pub values: PhaseCost,
}

/// Selects the scored rows of the rollout and computes their rewards and group ids as tensors.
///
/// # Shapes
/// `rollout.generated.sequences [N, P + R]` → `sequences [B, P + R]` etc. with `B = scored.rows.len()`.
/// `records` are the rows' records for their images ([`crate::rl::visual`]).
pub fn select(
    rollout: &Rollout,
    scored: &Scored,
    group_of_row: &[(usize, i64)],
    records: &[usize],
    device: Device,
) -> Result<Selected> {
    let rows: Vec<i64> = scored.rows.iter().map(|&r| r as i64).collect();
    let rewards =
        Tensor::f_from_slice(&scored.rewards.iter().map(|&x| x as f32).collect::<Vec<_>>())?.f_to_device(device)?;
    let group_ids: Vec<i64> = scored.rows.iter().map(|&r| group_of_row[r].1).collect();
    let group_ids = Tensor::f_from_slice(&group_ids)?.f_to_device(device)?;
    let records: Vec<i64> = scored.rows.iter().map(|&r| records[r] as i64).collect();
    let records = Tensor::f_from_slice(&records)?.f_to_device(device)?;
    let index = Tensor::f_from_slice(&rows)?.f_to_device(device)?;
    let gen = &rollout.generated;
    Ok(Selected {
        sequences: gen.sequences.f_index_select(0, &index)?,
        attention_mask: gen.attention_mask.f_index_select(0, &index)?,
        action_mask: gen.response_mask.f_index_select(0, &index)?.f_to_kind(Kind::Float)?,
        prompt_len: gen.prompt_len,
        rewards,
        group_ids,
        records,
        images: None,
        behavior_logprobs: rollout.behavior_logprobs.as_ref().map(|t| t.f_index_select(0, &index)).transpose()?,
    })
}

/// How [`compute`] runs the actor's pass.
pub struct Passes<'a> {
    /// Keep the actor's pass, with gradients, for the loss (see [`compute`]).
    pub reuse: bool,
    /// Make that pass a checkpointed one (`train.gradient_checkpointing`).
    pub checkpointing: bool,
    /// ZeRO stage 3: the actor's engine, to shard the weights before the kept pass.
    pub shard_actor: Option<&'a mut TrainEngine>,
}

/// The scored rows before the models have seen them (see [`Batch`] for shapes).
pub struct Selected {
    pub sequences: Tensor,
    pub attention_mask: Tensor,
    pub action_mask: Tensor,
    pub prompt_len: i64,
    pub rewards: Tensor,
    pub group_ids: Tensor,
    /// Each row's prompt record (i64), and its images once [`crate::rl::visual`] found them.
    pub records: Tensor,
    pub images: Option<RowImages>,
    pub behavior_logprobs: Option<Tensor>,
}

/// Runs the old policy, the reference and the critic over the batch without gradients (log-probs
/// with `opts`: its chunk size and prompt sharing; entropy is always computed). Returns
/// the batch and the old policy's per-token entropy `[B, R]` (for [`metrics`]). A batch without
/// rows (a data-parallel rank whose samples were all dropped) runs no model.
///
/// With `reuse` — the step is one epoch of one minibatch holding the whole batch, so the
/// minibatch's fresh log-probs are the old ones (TRL skips the old pass then) — the actor runs
/// once, with gradients: `old_logprobs` are that pass detached, and the pass itself is kept in
/// [`Batch::policy`] for the minibatch loss (without LoRA dropout, training mode changes nothing);
/// with `checkpointing` it is a checkpointed pass ([`Batch::policy_checkpoint`]); its entropy is
/// kept with its graph only when `entropy_grad` (the algorithm's loss uses it).
///
/// # Shapes
/// See [`Batch`].
pub fn compute(
    models: &Models<'_>,
    s: Selected,
    opts: LogProbOptions,
    device: Device,
    passes: Passes<'_>,
    entropy_grad: bool,
) -> Result<(Batch, Option<Tensor>, ExperienceTimes)> {
    let Passes { reuse, checkpointing, shard_actor } = passes;
    let opts = LogProbOptions { entropy: true, ..opts };
    let (seq, attn, p_len) = (&s.sequences, &s.attention_mask, s.prompt_len);
    let (b, r_len) = (s.action_mask.size()[0], s.action_mask.size()[1]);
    let mut times = ExperienceTimes::default();
    if b == 0 {
        let zeros = || s.action_mask.f_zeros_like();
        let reference = models.reference.map(|_| zeros()).transpose()?;
        let values = models.critic.map(|_| zeros()).transpose()?;
        let (old, entropy) = (zeros()?, zeros()?);
        return Ok((s.into_batch(old, reference, values, None), Some(entropy), times));
    }
    let images = s.images.as_ref().map(|rows| rows.cat(None)).transpose()?.flatten();
    let width = seq.size()[1];
    let observed = s.images.as_ref().map(|rows| rows.observed(None, p_len, width, device)).transpose()?.flatten();
    let images = images.as_ref().map(|images| ImageInputs { images, prompt_len: p_len, observed: observed.as_ref() });
    let t = PhaseClock::start(device);
    let ref_logprobs = match models.reference {
        Some(r) => {
            let no_entropy = LogProbOptions { entropy: false, ..opts };
            let own = images.filter(|_| !models.ref_shares_vision).map(|i| i.images.without_features());
            let images = match (&own, images) {
                (Some(own), Some(rows)) => Some(ImageInputs { images: own, ..rows }),
                _ => images,
            };
            Some(tch::no_grad(|| logprobs(r, seq, attn, images, p_len, no_entropy))?.logprobs)
        }
        None => None,
    };
    times.reference = t.stop();
    let t = PhaseClock::start(device);
    // The value of the state before each response token: positions P−1 .. P+R−2.
    let values = match models.critic {
        Some(c) => {
            let own = visual::critic_images(c, images.map(|i| i.images), models.critic_shares_vision);
            let v = tch::no_grad(|| match &own {
                Some(own) => {
                    let slots = images.map(|i| i.slots()).unwrap_or_else(|| Slots::prompt(p_len));
                    c.values_pass_with_images(seq, attn, own, slots, false).map(|(v, _)| v)
                }
                None if opts.pack => {
                    c.values_pass_packed(seq, attn, false, opts.share_prefix.then_some(p_len)).map(|(v, _)| v)
                }
                None => c.values(seq, attn),
            })?;
            Some(v.f_narrow(1, p_len - 1, r_len)?) // [B, R]
        }
        None => None,
    };
    times.values = t.stop();
    // The actor last: with `reuse` its pass keeps an autograd graph, which the reference and
    // critic passes need not share memory with.
    let t = PhaseClock::start(device);
    let (old, policy, policy_checkpoint) = if reuse {
        if let Some(engine) = shard_actor {
            // ZeRO stage 3: the kept pass gathers layer by layer, as the training passes do.
            engine.shard_params()?;
        }
        let (lp, ck) = logprobs_pass(models.actor, seq, attn, images, p_len, opts, checkpointing)?; // with grad
        let detached = TokenLogProbs {
            logprobs: lp.logprobs.f_detach()?,
            entropy: lp.entropy.as_ref().map(Tensor::f_detach).transpose()?,
            aux_loss: None,
        };
        // An entropy the loss does not use would keep its part of the graph (the `[rows, vocab]`
        // probabilities) alive until the step ends.
        let policy = TokenLogProbs {
            logprobs: lp.logprobs,
            entropy: lp.entropy.filter(|_| entropy_grad),
            aux_loss: lp.aux_loss,
        };
        (detached, Some(policy), Some(ck))
    } else {
        (tch::no_grad(|| logprobs(models.actor, seq, attn, images, p_len, opts))?, None, None)
    };
    times.old_logprobs = t.stop();
    let kept = policy.map(|p| (p, policy_checkpoint));
    let batch = s.into_batch(old.logprobs, ref_logprobs, values, kept);
    Ok((batch, old.entropy, times))
}

/// [`compute`] in micro-batches of this rank's rows (`micro`, from
/// [`crate::rl::micro::experience_plan`]; `None`: the whole batch at once), their log-probs,
/// entropy and values put back in row order. The old log-probs are not the training pass's
/// (`passes.reuse` must be off with micro-batches).
///
/// # Shapes
/// See [`Batch`].
pub fn compute_in_micro_batches(
    models: &Models<'_>,
    s: Selected,
    opts: LogProbOptions,
    device: Device,
    passes: Passes<'_>,
    entropy_grad: bool,
    micro: Option<Vec<Vec<i64>>>,
) -> Result<(Batch, Option<Tensor>, ExperienceTimes)> {
    let Some(micro) = micro.filter(|_| !passes.reuse && s.action_mask.size()[0] > 0) else {
        return compute(models, s, opts, device, passes, entropy_grad);
    };
    // Each micro-batch's outputs in its rows' order, then the rows back in the batch's order.
    let order: Vec<i64> = micro.concat();
    let mut back = vec![0i64; order.len()];
    for (i, &row) in order.iter().enumerate() {
        back[row as usize] = i as i64;
    }
    let back = Tensor::f_from_slice(&back)?.f_to_device(device)?;
    let (mut old, mut entropy, mut reference, mut values) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut times = ExperienceTimes::default();
    for rows in micro.iter().filter(|rows| !rows.is_empty()) {
        let idx = Tensor::f_from_slice(rows)?.f_to_device(device)?;
        let part = s.pick(rows, &idx)?;
        let passes = Passes { reuse: false, checkpointing: passes.checkpointing, shard_actor: None };
        let (batch, ent, t) = compute(models, part, opts, device, passes, entropy_grad)?;
        old.push(batch.old_logprobs);
        entropy.extend(ent);
        reference.extend(batch.ref_logprobs);
        values.extend(batch.values);
        times.old_logprobs.add(&t.old_logprobs);
        times.reference.add(&t.reference);
        times.values.add(&t.values);
    }
    // [B, R] each, in row order; `None` where no micro-batch gave one.
    let rejoin = |parts: Vec<Tensor>| -> Result<Option<Tensor>> {
        if parts.is_empty() {
            return Ok(None);
        }
        Ok(Some(Tensor::f_cat(&parts, 0)?.f_index_select(0, &back)?))
    };
    let old = rejoin(old)?.ok_or_else(|| TrainerError::Run("experience: no micro-batch had rows".into()))?;
    let entropy = rejoin(entropy)?;
    let (reference, values) = (rejoin(reference)?, rejoin(values)?);
    let batch = s.into_batch(old, reference, values, None);
    Ok((batch, entropy, times))
}

impl Selected {
    /// The batch of these rows with the models' outputs: old log-probs, reference log-probs,
    /// values, and the kept training pass (see [`Batch::policy`]).
    fn into_batch(
        self,
        old_logprobs: Tensor,
        ref_logprobs: Option<Tensor>,
        values: Option<Tensor>,
        kept: Option<(TokenLogProbs, Option<LogProbPass>)>,
    ) -> Batch {
        let (policy, policy_checkpoint) = match kept {
            Some((p, ck)) => (Some(p), ck),
            None => (None, None),
        };
        Batch {
            sequences: self.sequences,
            attention_mask: self.attention_mask,
            action_mask: self.action_mask,
            prompt_len: self.prompt_len,
            old_logprobs,
            ref_logprobs,
            values,
            rewards: self.rewards,
            group_ids: self.group_ids,
            records: self.records,
            images: self.images,
            behavior_logprobs: self.behavior_logprobs,
            policy,
            policy_checkpoint,
            policy_rows: None,
        }
    }

    /// The rows `rows` (`idx` on the device), in that order.
    fn pick(&self, rows: &[i64], idx: &Tensor) -> Result<Selected> {
        let pick = |t: &Tensor| -> Result<Tensor> { Ok(t.f_index_select(0, idx)?) };
        Ok(Selected {
            sequences: pick(&self.sequences)?,
            attention_mask: pick(&self.attention_mask)?,
            action_mask: pick(&self.action_mask)?,
            prompt_len: self.prompt_len,
            rewards: pick(&self.rewards)?,
            group_ids: pick(&self.group_ids)?,
            records: pick(&self.records)?,
            images: self.images.as_ref().map(|i| i.pick(rows)),
            behavior_logprobs: self.behavior_logprobs.as_ref().map(pick).transpose()?,
        })
    }
}

/// [`token_logprobs`] of rows holding images (in row order) when there are any.
///
/// # Shapes
/// As [`token_logprobs`].
pub fn logprobs(
    model: &CausalLm,
    seq: &Tensor,
    attn: &Tensor,
    images: Option<ImageInputs<'_>>,
    from: i64,
    opts: LogProbOptions,
) -> Result<TokenLogProbs> {
    Ok(match images {
        Some(images) => token_logprobs_with_images(model, seq, attn, images, from, opts)?,
        None => token_logprobs(model, seq, attn, from, opts)?,
    })
}

/// [`token_logprobs_pass`] of rows holding images (in row order) when there are any.
///
/// # Shapes
/// As [`token_logprobs`].
pub fn logprobs_pass(
    model: &CausalLm,
    seq: &Tensor,
    attn: &Tensor,
    images: Option<ImageInputs<'_>>,
    from: i64,
    opts: LogProbOptions,
    checkpointed: bool,
) -> Result<(TokenLogProbs, LogProbPass)> {
    // Under a parameter gate (ZeRO stage 3) every rank's pass makes the same gate calls: rows
    // without images still take the image path (the tower gathered, run on no image).
    let none = Images::none();
    let gated = model.vision().is_some() && model.is_gated();
    let images = images.or_else(|| gated.then_some(ImageInputs::prompt(&none, seq.size()[1])));
    Ok(match images {
        Some(images) => token_logprobs_pass_with_images(model, seq, attn, images, from, opts, checkpointed)?,
        None => token_logprobs_pass(model, seq, attn, from, opts, checkpointed)?,
    })
}

/// Sets `rollout/entropy`, `entropy`, `completions/mean_length`, `rollout/kl` and `kl` (the
/// sequence sum of `log π_old − log π_ref`, averaged over samples) of the whole batch.
///
/// # Shapes
/// `batch` as [`Batch`]; `entropy`: `[B, R]`.
pub fn metrics(batch: &Batch, entropy: Option<&Tensor>, m: &mut StepMetrics) -> Result<()> {
    if let Some(e) = entropy {
        let ent = masked_mean_value(e, &batch.action_mask)?;
        m.set("rollout/entropy", ent);
        m.set("entropy", ent);
    }
    let lengths = batch.action_mask.f_sum_dim_intlist(1, false, Kind::Float)?; // [B]
    m.set("completions/mean_length", lengths.f_mean(Kind::Float)?.double_value(&[]));
    if let Some(r) = &batch.ref_logprobs {
        let kl = batch.old_logprobs.f_sub(r)?.f_mul(&batch.action_mask)?.f_sum_dim_intlist(1, false, Kind::Float)?; // [B]
        let kl = kl.f_mean(Kind::Float)?.double_value(&[]);
        m.set("rollout/kl", kl);
        m.set("kl", kl);
    }
    Ok(())
}

/// Masked mean of `x` over `mask` as a number (0 when the mask is empty).
///
/// # Shapes
/// `x`, `mask`: the same shape, f32.
pub fn masked_mean_value(x: &Tensor, mask: &Tensor) -> Result<f64> {
    let n = mask.f_sum(Kind::Float)?.double_value(&[]);
    if n == 0.0 {
        return Ok(0.0);
    }
    Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.double_value(&[]) / n)
}
