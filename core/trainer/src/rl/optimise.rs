//! Stages 6–7, **minibatch loss → optimizer step**: `ppo_epochs` passes over the generation batch
//! in shuffled minibatches (DeepSpeed-Chat's MiniDataset). Per minibatch: fresh log-probs (and
//! values, entropy) with gradients → the plugin's loss (+ the ptx loss) → backward. Every
//! `gradient_accumulation_steps` minibatches (and at the end of an epoch): grad-norm clip → AdamW
//! steps of actor and critic → EMA. With accumulation each minibatch's loss is divided by the
//! number of minibatches in its step, as TRL/accelerate do. A non-finite loss or gradient skips
//! the whole optimizer step and is logged.

use rlhf_generation::{ImageInputs, LogProbOptions, LogProbPass, TokenLogProbs};
use rlhf_models::multimodal::Slots;
use rlhf_models::{CausalLm, Checkpointed, ScalarHeadModel};
use rlhf_plugin_api::{Minibatch, Prepared, Requirements};
use tch::{Device, Tensor};

use rlhf_collective::World;

use crate::config::TrainConfig;
use crate::data::SplitMix;
use crate::dist;
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::optim::ema_update;
use crate::plugins::AlgorithmHandle;
use crate::progress::RunProgress;
use crate::rl::experience::{logprobs_pass, Batch};
use crate::rl::micro::{self, MicroPlan};
use crate::rl::ptx::PtxData;
use crate::rl::visual;
use crate::router_aux::with_router_aux_loss;
use crate::train_engine::{self, TrainEngine};

/// What the optimisation stage trains.
pub struct Learner<'a> {
    pub actor: &'a CausalLm,
    pub actor_opt: &'a mut TrainEngine,
    pub critic: Option<(&'a ScalarHeadModel, &'a mut TrainEngine)>,
    /// The EMA copy of the actor and its decay.
    pub ema: Option<(&'a CausalLm, f64)>,
    pub ptx: Option<&'a PtxData>,
    pub world: &'a World,
    /// Compute each prompt once for the rows of a minibatch that hold it (`train.share_prompts`).
    pub share_prompts: bool,
    /// The critic's vision tower is the actor's (it takes the actor's frozen tower's features).
    pub critic_shares_vision: bool,
}

/// A minibatch's checkpointed passes (`train.gradient_checkpointing`), to backpropagate through
/// once its loss has been.
#[derive(Default)]
struct Passes {
    actor: Option<LogProbPass>,
    /// The actor's pass is the experience pass kept in [`Batch::policy_checkpoint`].
    reused_actor: bool,
    critic: Option<Checkpointed>,
}

/// The rows `idx` of `t` (dim 0).
fn pick(t: &Tensor, idx: &Tensor) -> Result<Tensor> {
    Ok(t.f_index_select(0, idx)?)
}

fn pick_opt(t: &Option<Tensor>, idx: &Tensor) -> Result<Option<Tensor>> {
    t.as_ref().map(|t| pick(t, idx)).transpose()
}

/// Ends a micro-batch's backward pass for the actor's and the critic's engines (see
/// [`TrainEngine::micro_done`]; every rank calls it once per micro-batch of a step).
fn micro_done(
    world: &World,
    actor: &mut TrainEngine,
    critic: &mut Option<(&ScalarHeadModel, &mut TrainEngine)>,
) -> Result<()> {
    actor.micro_done(world)?;
    match critic {
        Some((_, c)) => c.micro_done(world),
        None => Ok(()),
    }
}

/// Stage 3: trains the next micro-batch on sharded parameters (`sharded`, gathered layer by layer
/// in the checkpointed passes) or on whole ones (a collective either way, the same on every rank;
/// nothing at stages 0 to 2).
fn set_sharded(
    actor: &mut TrainEngine,
    critic: &mut Option<(&ScalarHeadModel, &mut TrainEngine)>,
    sharded: bool,
) -> Result<()> {
    let mut engines: Vec<&mut TrainEngine> = vec![actor];
    engines.extend(critic.as_mut().map(|(_, o)| &mut **o));
    engines.into_iter().try_for_each(|e| e.set_sharded(sharded))
}

/// What every micro-batch of one optimizer step shares.
struct MicroCtx<'a> {
    batch: &'a Batch,
    prepared: &'a Prepared,
    cfg: &'a TrainConfig,
    req: Requirements,
    opts: LogProbOptions,
    /// Valid response tokens and samples of the step's minibatches over all ranks (when `k > 1`).
    step_tokens: f64,
    step_rows: f64,
    /// Micro-batches in the step (over the accumulated minibatches and the ranks), and the epoch.
    k: usize,
    epoch: usize,
    /// Optimizer steps taken so far.
    steps: usize,
    critic_shares_vision: bool,
}

/// This rank's rows of one micro-batch.
struct MicroPart<'a> {
    rows: &'a [i64],
    /// The experience pass to reuse instead of a fresh one, and the first batch row it covers.
    reuse: Option<(&'a TokenLogProbs, i64)>,
    /// The minibatch's rows over all ranks, this rank's share of them (for ptx's split), and the
    /// weight of the minibatch's ptx loss (`None` in its micro-batches after the first).
    minibatch_len: usize,
    mine: std::ops::Range<usize>,
    ptx_scale: Option<f64>,
}

/// One micro-batch's loss on this rank: the actor's log-probs (a fresh pass, or the reused
/// experience pass right-padded to the batch's response slots), the critic's values, the
/// plugin's loss, plus `ptx_coef` × the ptx loss; the plugin's and ptx metrics go into `local`.
/// Returns the loss and the checkpointed passes to backpropagate after it.
///
/// # Shapes
/// `part.rows` = n rows: log-probs, values and masks `[n, R]`, rewards `[n]`; the loss is a scalar.
#[allow(clippy::too_many_arguments)]
fn micro_loss(
    ctx: &MicroCtx,
    actor: &CausalLm,
    critic: Option<&ScalarHeadModel>,
    algo: &mut AlgorithmHandle,
    ptx: Option<&PtxData>,
    rng: &mut SplitMix,
    part: &MicroPart,
    local: &mut StepMetrics,
) -> Result<(Tensor, Passes)> {
    let MicroCtx { batch, prepared, cfg, req, opts, .. } = *ctx;
    let (p_len, r_len) = (batch.prompt_len, batch.response_len());
    let idx = Tensor::f_from_slice(part.rows)?.f_to_device(actor.device())?;
    let (seq, attn) = (pick(&batch.sequences, &idx)?, pick(&batch.attention_mask, &idx)?);
    // With gradient checkpointing the passes keep only layer inputs; `passes` backpropagates
    // through them after the loss.
    let mut passes = Passes::default();
    let images = batch.images.as_ref().map(|rows| rows.cat(Some(part.rows))).transpose()?.flatten();
    let observed = batch
        .images
        .as_ref()
        .map(|rows| rows.observed(Some(part.rows), p_len, seq.size()[1], seq.device()))
        .transpose()?
        .flatten();
    let lp = match part.reuse {
        Some((p, offset)) => {
            passes.reused_actor = batch.policy_checkpoint.is_some();
            // The pass's rows, right-padded to the gathered batch's response slots.
            let local = idx.f_sub_scalar(offset)?;
            let own = |t: &Tensor| -> Result<Tensor> {
                let t = pick(t, &local)?;
                let pad = r_len - t.size()[1];
                Ok(if pad > 0 { t.f_constant_pad_nd([0, pad])? } else { t })
            };
            TokenLogProbs {
                logprobs: own(&p.logprobs)?,
                entropy: match &p.entropy {
                    Some(e) if req.entropy => Some(own(e)?),
                    _ => None,
                },
                // The reused pass is the step's one micro-batch: its load-balancing loss is this one's.
                aux_loss: p.aux_loss.as_ref().map(Tensor::shallow_clone),
            }
        }
        None => {
            let images =
                images.as_ref().map(|images| ImageInputs { images, prompt_len: p_len, observed: observed.as_ref() });
            let (lp, ck) = logprobs_pass(actor, &seq, &attn, images, p_len, opts, cfg.gradient_checkpointing)?;
            passes.actor = Some(ck);
            lp // [n, R], grad
        }
    };
    let values = match critic {
        Some(c) => {
            let checkpointed = cfg.gradient_checkpointing;
            let (v, ck) = match visual::critic_images(c, images.as_ref(), ctx.critic_shares_vision) {
                Some(own) => {
                    let slots = Slots { prompt_len: p_len, observed: observed.as_ref().map(Tensor::shallow_clone) };
                    c.values_pass_with_images(&seq, &attn, &own, slots, checkpointed)?
                }
                None if cfg.padding_free => {
                    c.values_pass_packed(&seq, &attn, checkpointed, opts.share_prefix.then_some(p_len))?
                }
                None => c.values_pass(&seq, &attn, checkpointed)?,
            };
            passes.critic = ck;
            Some(v.f_narrow(1, p_len - 1, r_len)?) // [n, R], grad
        }
        None => None,
    };
    let action_mask = pick(&batch.action_mask, &idx)?;
    let aux = lp.aux_loss;
    let mb = Minibatch {
        logprobs: lp.logprobs,
        old_logprobs: pick(&batch.old_logprobs, &idx)?,
        ref_logprobs: pick_opt(&batch.ref_logprobs, &idx)?,
        values,
        old_values: pick_opt(&batch.values, &idx)?,
        advantages: pick(&prepared.advantages, &idx)?,
        returns: pick_opt(&prepared.returns, &idx)?,
        step_tokens: if ctx.k > 1 { ctx.step_tokens } else { action_mask.f_sum(tch::Kind::Float)?.double_value(&[]) },
        step_rows: if ctx.k > 1 { ctx.step_rows } else { part.rows.len() as f64 },
        action_mask,
        entropy: lp.entropy,
        rewards: pick(&batch.rewards, &idx)?,
        step: ctx.steps as u64,
        epoch: ctx.epoch as u64,
        accumulation_steps: ctx.k as u64,
        behavior_logprobs: pick_opt(&batch.behavior_logprobs, &idx)?,
    };
    let out = algo.loss(&mb)?;
    // Divided by the step's micro-batches with the plugin's loss (TRL's `aux / accumulation steps`).
    let mut loss = with_router_aux_loss(out.loss, aux.as_ref(), actor, 1.0, local)?;
    if let (Some(p), Some(scale)) = (ptx, part.ptx_scale) {
        if let Some(ptx_loss) = p.loss(actor, rng, part.minibatch_len, part.mine.clone())? {
            local.add("loss/ptx", ptx_loss.double_value(&[]));
            loss = loss.f_add(&ptx_loss.f_mul_scalar(cfg.ptx_coef * scale)?)?;
        }
    }
    for (name, value) in &out.metrics {
        local.add(name, *value);
    }
    Ok((loss, passes))
}

/// Backpropagates `loss` (already scaled for accumulation) through the graph and then through
/// the micro-batch's checkpointed passes; without a loss only the passes' backward runs, which
/// then only makes a sharded model's collective calls (stage 3).
fn backprop(
    loss: Option<Tensor>,
    passes: &Passes,
    batch: &Batch,
    actor: &CausalLm,
    critic: Option<&ScalarHeadModel>,
) -> Result<()> {
    if let Some(loss) = &loss {
        loss.f_backward()?;
    }
    let reused = batch.policy_checkpoint.as_ref().filter(|_| passes.reused_actor);
    for ck in passes.actor.iter().chain(reused) {
        ck.backward(actor)?;
    }
    if let (Some(ck), Some(c)) = (&passes.critic, critic) {
        c.backward_checkpointed(ck)?;
    }
    Ok(())
}

/// Ends one optimizer step once every micro-batch is backpropagated
/// ([`train_engine::finish_step`]): grad norms into `local`, learning rates into `m`.
/// `None`: a loss was not finite on some rank and nothing stepped; `Some(false)`: a gradient was
/// not finite and the optimizers skipped; `Some(true)`: the models stepped.
fn end_step(
    world: &World,
    actor_opt: &mut TrainEngine,
    critic: &mut Option<(&ScalarHeadModel, &mut TrainEngine)>,
    finite: bool,
    step: usize,
    local: &mut StepMetrics,
    m: &mut StepMetrics,
) -> Result<Option<bool>> {
    let mut engines: Vec<&mut TrainEngine> = vec![actor_opt];
    engines.extend(critic.as_mut().map(|(_, o)| &mut **o));
    let Some(infos) = train_engine::finish_step(world, &mut engines, finite)? else {
        return Ok(None);
    };
    let a = infos[0];
    local.add("grad_norm/actor", a.grad_norm);
    m.set("lr", a.lr);
    let mut skip = a.skipped;
    if let Some(c) = infos.get(1) {
        local.add("grad_norm/critic", c.grad_norm);
        m.set("lr/critic", c.lr);
        skip |= c.skipped;
    }
    if skip {
        tracing::warn!("step {step}: non-finite gradient; optimizer step skipped");
    }
    Ok(Some(!skip))
}

/// This rank's rows of a micro-batch (`rows`, its plan's), and the experience pass to reuse for
/// them with the first batch row it covers. When the step's only micro-batch holds the whole
/// batch (`whole`) the experience pass is reused; on data-parallel ranks that pass covers each
/// rank's own rows (as many on every rank), so a rank trains on those instead of its share of the
/// shuffled minibatch: the ranks still cover every row once.
fn micro_rows<'a>(batch: &'a Batch, rows: &[i64], whole: bool) -> (Vec<i64>, Option<(&'a TokenLogProbs, i64)>) {
    match (batch.policy.as_ref().filter(|_| whole), batch.policy_rows) {
        (Some(p), Some((offset, n))) => ((offset..offset + n).collect(), Some((p, offset))),
        (reuse, _) => (rows.to_vec(), reuse.map(|p| (p, 0))),
    }
}

/// The models one optimizer step trains.
struct Trainees<'a, 'b> {
    actor: &'a CausalLm,
    actor_opt: &'b mut TrainEngine,
    critic: &'b mut Option<(&'a ScalarHeadModel, &'a mut TrainEngine)>,
}

/// What the rest of an optimizer step's micro-batches share: `whole_batch` when the epoch's only
/// minibatch may be the whole batch (one epoch), `step` the generation step (for log lines).
struct StepRun<'a> {
    world: &'a World,
    ptx: Option<&'a PtxData>,
    train_sharded: bool,
    whole_batch: bool,
    step: usize,
}

/// Computes and backpropagates the loss of every micro-batch of one optimizer step: each of the
/// accumulated minibatches (`step_chunks`) as its plan splits it. Every micro-batch but the
/// step's last is ended with [`micro_done`] here; the caller ends the last one. Returns whether
/// every loss was finite (after a non-finite one only lockstep engines run the rest's passes).
#[allow(clippy::too_many_arguments)]
fn accumulate(
    ctx: &MicroCtx,
    run: &StepRun,
    t: &mut Trainees,
    algo: &mut AlgorithmHandle,
    rng: &mut SplitMix,
    step_chunks: &[&[i64]],
    plans: &[MicroPlan],
    local: &mut StepMetrics,
) -> Result<bool> {
    let (world, k) = (run.world, ctx.k);
    // The ptx loss weighs each minibatch as `1 / (minibatches × ranks)`, once per minibatch.
    let micros = k / world.size();
    let ptx_scale = micros as f64 / step_chunks.len() as f64;
    let mut finite = true;
    // This rank's share of the step's loss: its micro-batches' losses over their number.
    let mut step_loss = 0.0;
    let mut first = true;
    for (minibatch, plan) in step_chunks.iter().zip(plans) {
        let mine = dist::shard(minibatch.len(), world.rank(), world.size());
        let whole = run.whole_batch && minibatch.len() == ctx.batch.len() && plan.micro_batches() == 1;
        for j in 0..plan.micro_batches() {
            if !first {
                // The previous micro-batch's backward is done (and the last one's after the loop).
                micro_done(world, t.actor_opt, t.critic)?;
            }
            first = false;
            // A micro-batch some rank has no rows of runs on whole weights at stage 3: the
            // sharded passes are collectives every rank must join.
            set_sharded(t.actor_opt, t.critic, run.train_sharded && plan.every_rank_has(j))?;
            let lockstep = t.actor_opt.lockstep() || t.critic.as_ref().is_some_and(|(_, o)| o.lockstep());
            let (chunk, reuse) = micro_rows(ctx.batch, plan.rows(world.rank(), j), whole);
            if chunk.is_empty() || (!finite && !lockstep) {
                continue;
            }
            let part = MicroPart {
                rows: &chunk,
                reuse,
                minibatch_len: minibatch.len(),
                mine: mine.clone(),
                ptx_scale: (j == 0).then_some(ptx_scale),
            };
            let c = t.critic.as_ref().map(|(c, _)| *c);
            let (loss, passes) = micro_loss(ctx, t.actor, c, algo, run.ptx, rng, &part, local)?;
            let loss_value = loss.double_value(&[]);
            if loss_value.is_finite() {
                step_loss += loss_value;
                let loss = if k > 1 { loss.f_div_scalar(k as f64)? } else { loss };
                backprop(Some(loss), &passes, ctx.batch, t.actor, c)?;
            } else {
                tracing::warn!("step {}: non-finite loss ({loss_value}); optimizer step skipped", run.step);
                finite = false;
                if lockstep {
                    // No loss to backpropagate, but the passes' gathers and reductions still run.
                    backprop(None, &passes, ctx.batch, t.actor, c)?;
                }
            }
        }
    }
    if finite {
        // One figure per optimizer step: steps of more micro-batches do not weigh more.
        local.add("loss/total", step_loss / micros as f64);
    }
    Ok(finite)
}

pub fn steps_per_epoch(batch: usize, cfg: &TrainConfig) -> usize {
    batch.div_ceil(cfg.minibatch_size).div_ceil(cfg.gradient_accumulation_steps.max(1))
}

/// Runs every minibatch of every epoch. `rng` shuffles the minibatches and draws ptx texts;
/// `step` is the 1-based generation step (for log lines). Sets `loss/total` (the optimizer
/// steps' losses, averaged), `loss/ptx`, `grad_norm/actor`, `grad_norm/critic`, `lr`,
/// `lr/critic`, `skipped_steps` and the plugin's metrics (averaged over micro-batches).
///
/// # Shapes
/// `batch` as [`crate::rl::experience::Batch`]; `prepared.advantages`, `prepared.returns`: `[B, R]`.
#[allow(clippy::too_many_arguments)]
pub fn optimise(
    learner: Learner<'_>,
    algo: &mut AlgorithmHandle,
    req: Requirements,
    batch: &Batch,
    prepared: &Prepared,
    cfg: &TrainConfig,
    mut rng: SplitMix,
    step: usize,
    progress: Option<&RunProgress>,
    m: &mut StepMetrics,
) -> Result<()> {
    let Learner { actor, actor_opt, mut critic, ema, ptx, world, share_prompts, critic_shares_vision } = learner;
    let device: Device = actor.device();
    let b = batch.len();
    let opts = LogProbOptions {
        max_chunk_elements: cfg.logprob_chunk_elements,
        entropy: req.entropy,
        share_prefix: share_prompts,
        pack: cfg.padding_free,
        pack_width: 0,
    };
    let mut skipped = 0usize;
    // This rank's minibatch metrics (the plugin's, losses, grad norms): averaged over the step's
    // minibatches and the ranks.
    let mut local = StepMetrics::default();
    if let Some(p) = progress {
        p.phase("optimise", (cfg.ppo_epochs * steps_per_epoch(b, cfg)) as u64);
    }
    actor.set_training(true);
    if let Some((c, _)) = &critic {
        c.set_training(true);
    }
    let accumulation = cfg.gradient_accumulation_steps.max(1);
    // Stage 3 trains on sharded parameters, except with ptx, whose pass is not checkpointed.
    let train_sharded = ptx.is_none();
    let lengths = micro::row_lengths(&batch.attention_mask, cfg.micro_batch_tokens)?;
    let groups = micro::Groups::of(
        &batch.group_ids,
        &batch.attention_mask,
        batch.prompt_len,
        cfg.micro_batch_tokens,
        share_prompts,
    )?;
    for epoch in 0..cfg.ppo_epochs {
        let mut order: Vec<i64> = (0..b as i64).collect();
        rng.shuffle(&mut order);
        let minibatches: Vec<&[i64]> = order.chunks(cfg.minibatch_size).collect();
        for step_chunks in minibatches.chunks(accumulation) {
            let plans: Vec<MicroPlan> = step_chunks
                .iter()
                .map(|mb| MicroPlan::new(mb, &lengths, &groups, cfg.micro_batch_tokens, world.size()))
                .collect();
            let k = plans.iter().map(MicroPlan::micro_batches).sum::<usize>() * world.size();
            // Valid response tokens and samples in the whole accumulated batch, on every rank
            // (the normalisers of dapo's token mean and of a per-sample mean).
            let (step_tokens, step_rows) = if k > 1 {
                let rows: Vec<i64> = step_chunks.concat();
                let idx = Tensor::f_from_slice(&rows)?.f_to_device(device)?;
                (pick(&batch.action_mask, &idx)?.f_sum(tch::Kind::Float)?.double_value(&[]), rows.len() as f64)
            } else {
                (0.0, 0.0) // unused: the micro-batch is the whole step
            };
            let steps = actor_opt.steps();
            let ctx = MicroCtx {
                batch,
                prepared,
                cfg,
                req,
                opts,
                step_tokens,
                step_rows,
                k,
                epoch,
                steps,
                critic_shares_vision,
            };
            let mut trainees = Trainees { actor, actor_opt: &mut *actor_opt, critic: &mut critic };
            let whole_batch = cfg.ppo_epochs == 1 && minibatches.len() == 1;
            let run = StepRun { world, ptx, train_sharded, whole_batch, step };
            let finite = accumulate(&ctx, &run, &mut trainees, algo, &mut rng, step_chunks, &plans, &mut local)?;
            micro_done(world, actor_opt, &mut critic)?;
            let stepped = end_step(world, actor_opt, &mut critic, finite, step, &mut local, m)?;
            match stepped {
                None => {
                    skipped += 1;
                    continue;
                }
                Some(false) => skipped += 1,
                Some(true) => {}
            }
            if let Some((e, decay)) = ema {
                // Stage 3: the EMA reads the whole actor (gathered for it).
                let sharded = actor_opt.lockstep();
                actor_opt.gather_params()?;
                ema_update(&e.vs, &actor.vs, decay)?;
                if sharded {
                    actor_opt.shard_params()?;
                }
            }
            if let Some(p) = progress {
                p.advance(1);
            }
        }
    }
    actor.set_training(false);
    if let Some((c, _)) = &critic {
        c.set_training(false);
    }
    // Whole weights again for the next rollout (stage 3).
    set_sharded(actor_opt, &mut critic, false)?;
    dist::merge_metrics(world, &local, m)?;
    m.set("skipped_steps", skipped as f64);
    let mut engines: Vec<&TrainEngine> = vec![&*actor_opt];
    engines.extend(critic.as_ref().map(|(_, o)| &**o));
    train_engine::memory_metrics(world, &engines, m)?;
    Ok(())
}
