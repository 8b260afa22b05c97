//! The training engine of one trained model (the way DeepSpeed's engine hides its ZeRO stages
//! behind `engine.backward` / `engine.step`): its optimizer and how its training state is laid
//! out over the data-parallel ranks. The RL host (actor and critic) and the supervised phases
//! (SFT, RM, DPO) drive every optimizer step through it, so a layout of the state is a strategy
//! here, not a branch in their loops. `[distributed] zero_stage` picks it:
//!
//! - **0, replicated** (DDP): every rank holds the whole state (f32 masters of reduced-precision
//!   weights, Adam moments, gradients, weights); gradients are summed over the ranks in flat
//!   buckets and every rank takes the same AdamW step ([`Optim`]).
//! - **1, optimizer state sharded** ([`sharded`]): each rank keeps the masters and moments of
//!   its `1/W` slice of the flat trained variables, receives only that slice's summed gradient
//!   (reduce-scatter), updates it, and the slices are all-gathered back into the weights.
//! - **2, gradients sharded too**: as 1, but each micro-batch's gradients are reduce-scattered
//!   as soon as its backward pass ends ([`TrainEngine::micro_done`]) and freed, so a rank keeps
//!   only its f32 shard of the step's summed gradient between micro-batches and during the step.
//! - **3, parameters sharded too** ([`stage3`]): as 2, and while training the variables hold no
//!   storage: the model's checkpointed layer loop gathers each layer just before it runs and
//!   frees it after ([`TrainEngine::shard_params`]); generation, evaluation, checkpoints and export
//!   run on whole weights gathered once per phase ([`TrainEngine::gather_params`]).

pub mod sharded;
pub mod stage3;

use std::collections::HashMap;

use rlhf_collective::World;
use tch::nn::VarStore;
use tch::Tensor;

use crate::checkpoint::Loaded;
use crate::dist;
use crate::error::Result;
use crate::optim::{Optim, OptimConfig, StepInfo};
use crate::shard_files;
use sharded::ShardedAdam;
use stage3::Params;

/// How a model's training state is laid out over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every rank holds everything; gradients are all-reduced (ZeRO stage 0).
    Replicated,
    /// Masters and moments partitioned over the ranks (ZeRO stage 1).
    ShardedOptimizer,
    /// As [`Strategy::ShardedOptimizer`], with the gradients partitioned too (ZeRO stage 2).
    ShardedGradients,
    /// As [`Strategy::ShardedGradients`], with the parameters partitioned too (ZeRO stage 3).
    ShardedParams,
}

impl Strategy {
    /// The strategy of `[distributed] zero_stage` (validated to 0 to 3 by the config).
    pub fn of_stage(stage: u8) -> Strategy {
        match stage {
            0 => Strategy::Replicated,
            1 => Strategy::ShardedOptimizer,
            2 => Strategy::ShardedGradients,
            _ => Strategy::ShardedParams,
        }
    }

    /// The ZeRO stage of the strategy.
    pub fn stage(self) -> u8 {
        match self {
            Strategy::Replicated => 0,
            Strategy::ShardedOptimizer => 1,
            Strategy::ShardedGradients => 2,
            Strategy::ShardedParams => 3,
        }
    }
}

enum Inner {
    Replicated(Optim),
    Sharded(ShardedAdam),
}

/// One trained model's optimizer under its [`Strategy`].
pub struct TrainEngine {
    inner: Inner,
    strategy: Strategy,
}

impl TrainEngine {
    /// AdamW over the trainable variables of `vs` (name order) for `total` optimizer steps, laid
    /// out over the ranks of `world` as `strategy` says.
    pub fn new(vs: &VarStore, settings: &OptimConfig, total: usize, strategy: Strategy, world: &World) -> Result<Self> {
        let inner = match strategy {
            Strategy::Replicated => Inner::Replicated(Optim::new(vs, settings, total)?),
            Strategy::ShardedOptimizer => Inner::Sharded(ShardedAdam::new(vs, settings, total, world, false, false)?),
            Strategy::ShardedGradients => Inner::Sharded(ShardedAdam::new(vs, settings, total, world, true, false)?),
            Strategy::ShardedParams => Inner::Sharded(ShardedAdam::new(vs, settings, total, world, true, true)?),
        };
        Ok(TrainEngine { inner, strategy })
    }

    /// The layout of the training state.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> usize {
        match &self.inner {
            Inner::Replicated(o) => o.steps,
            Inner::Sharded(s) => s.steps,
        }
    }

    /// The gate of the sharded parameters (stage 3), for the model's checkpointed passes
    /// (`model.set_gate(engine.gate())`); `None` at stages 0 to 2.
    pub fn gate(&self) -> rlhf_models::gate::Gate {
        self.params().map(Params::gate)
    }

    fn params(&self) -> Option<&Params> {
        match &self.inner {
            Inner::Sharded(s) => s.params.as_ref(),
            Inner::Replicated(_) => None,
        }
    }

    /// Stage 3: frees the whole variables for training (no collective; call it on every rank
    /// between optimizer steps, with no gradients pending). Nothing at stages 0 to 2.
    pub fn shard_params(&mut self) -> Result<()> {
        match self.params() {
            Some(p) => p.shard(),
            None => Ok(()),
        }
    }

    /// Stage 3: gathers the whole variables again (a collective: every rank calls it) for
    /// generation, evaluation, checkpoints or export. Nothing at stages 0 to 2.
    pub fn gather_params(&mut self) -> Result<()> {
        match self.params() {
            Some(p) => p.gather_all(),
            None => Ok(()),
        }
    }

    /// [`TrainEngine::shard_params`] when `sharded`, else [`TrainEngine::gather_params`].
    pub fn set_sharded(&mut self, sharded: bool) -> Result<()> {
        if sharded {
            self.shard_params()
        } else {
            self.gather_params()
        }
    }

    /// Whether the ranks must run every micro-batch's forward and backward in step, whatever
    /// their losses (stage 3 while sharded: the passes gather and reduce collectively).
    pub fn lockstep(&self) -> bool {
        self.params().is_some_and(|p| !p.is_whole())
    }

    /// Bytes of the trained variables this rank holds while training (all of them at stages 0 to
    /// 2, its chunks at stage 3).
    pub fn param_bytes(&self) -> usize {
        if let Some(p) = self.params() {
            return p.trained_bytes();
        }
        let params = match &self.inner {
            Inner::Replicated(o) => o.params(),
            Inner::Sharded(s) => s.params(),
        };
        params.iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Bytes of gradients this rank keeps between backward passes: as many as the variables at
    /// stages 0 and 1, its f32 shard of them at stage 2.
    pub fn grad_bytes(&self) -> usize {
        match &self.inner {
            Inner::Replicated(_) => self.param_bytes(),
            Inner::Sharded(s) => s.grad_bytes(),
        }
    }

    /// Ends one micro-batch's backward pass: at stage 2 its gradients are reduce-scattered and
    /// freed (a collective: every rank calls it once per micro-batch of the step, also for one it
    /// had no rows of or skipped); nothing at stages 0 and 1.
    pub fn micro_done(&mut self, world: &World) -> Result<()> {
        match &mut self.inner {
            Inner::Replicated(_) => Ok(()),
            Inner::Sharded(s) => s.micro_done(world),
        }
    }

    /// Bytes of optimizer state (f32 masters and moments) this rank holds.
    pub fn state_bytes(&self) -> usize {
        match &self.inner {
            Inner::Replicated(o) => o.state_bytes(),
            Inner::Sharded(s) => s.state_bytes(),
        }
    }

    /// What this rank puts into a checkpoint of the optimizer state: the whole state in
    /// [`Optim::state_tensors`]'s layout when replicated (only the main rank writes it), or this
    /// rank's shard and the layout of all of them when sharded (every rank writes its shard).
    pub fn checkpoint_part(&self) -> Result<CheckpointPart> {
        Ok(match &self.inner {
            Inner::Replicated(o) => CheckpointPart::Whole(o.state_tensors()?),
            Inner::Sharded(s) => {
                CheckpointPart::Shard { layout: s.layout(self.strategy.stage()), tensors: s.shard_tensors()? }
            }
        })
    }

    /// Restores the optimizer state `what` (e.g. `optimizer-actor`) of a checkpoint written under
    /// any strategy and world size, and the step count: whole (a stage-0 checkpoint) or from the
    /// ranks' shards, re-sharded when the world size or stage changed. Restore the weights first.
    pub fn restore(&mut self, ckpt: &Loaded, what: &str, steps: usize) -> Result<()> {
        let Some(layout) = ckpt.shard_layout(what)? else {
            let tensors = ckpt.tensors(what)?;
            return match &mut self.inner {
                Inner::Replicated(o) => o.load_state(tensors, steps),
                Inner::Sharded(s) => s.load_state(tensors, steps),
            };
        };
        let path = |r: usize| ckpt.verified(&shard_files::shard_file(what, r, layout.world));
        match &mut self.inner {
            Inner::Sharded(s) => s.load_shards(what, &layout, path, steps),
            Inner::Replicated(o) => {
                // Whole variables, cut from every shard.
                let whole = whole_state(what, &layout, &o.params_named(), path)?;
                o.load_state(&whole, steps)
            }
        }
    }

    /// Checks that every rank holds bit-identical trained variables (see [`dist::check_identical`]).
    pub fn check_identical(&self, world: &World, what: &str) -> Result<()> {
        let params = match &self.inner {
            Inner::Replicated(o) => o.params(),
            Inner::Sharded(s) => s.params(),
        };
        dist::check_identical(world, &params, what)
    }

    fn zero_grad(&mut self) -> Result<()> {
        match &mut self.inner {
            Inner::Replicated(o) => o.zero_grad(),
            Inner::Sharded(s) => s.zero_grad(),
        }
    }

    /// Combines this rank's gradients with the other ranks' and steps.
    fn step(&mut self, world: &World) -> Result<StepInfo> {
        match &mut self.inner {
            Inner::Replicated(o) => {
                if world.is_distributed() {
                    dist::all_reduce_grads(world, o)?;
                }
                o.step()
            }
            Inner::Sharded(s) => s.step(world),
        }
    }
}

/// One rank's part of a checkpoint of a [`TrainEngine`]'s optimizer state.
pub enum CheckpointPart {
    /// The whole state (replicated: the main rank writes it).
    Whole(Vec<(String, Tensor)>),
    /// This rank's shard (every rank writes its own), and the layout shared by all.
    Shard { layout: shard_files::ShardLayout, tensors: Vec<(String, Tensor)> },
    /// State of this rank alone (every rank writes its own; no layout).
    Rank(Vec<(String, Tensor)>),
}

/// The whole state of the variables `params` (name, shape) in [`Optim::state_tensors`]'s layout,
/// assembled from the shards of a sharded checkpoint.
fn whole_state(
    what: &str,
    layout: &shard_files::ShardLayout,
    params: &[(String, Vec<i64>)],
    path: impl Fn(usize) -> Result<std::path::PathBuf>,
) -> Result<HashMap<String, Tensor>> {
    let numels: Vec<(&str, i64)> = params.iter().map(|(n, s)| (n.as_str(), s.iter().product())).collect();
    layout.check_vars(what, &numels)?;
    let f32 = (tch::Kind::Float, tch::Device::Cpu);
    let mut wants = Vec::with_capacity(params.len());
    for (name, shape) in params {
        let numel: i64 = shape.iter().product();
        let master = if layout.masters { Some(Tensor::f_zeros([numel], f32)?) } else { None };
        let (m, v) = (Tensor::f_zeros([numel], f32)?, Tensor::f_zeros([numel], f32)?);
        wants.push(shard_files::Want { name: name.clone(), lo: 0, hi: numel, m, v, master });
    }
    let t = shard_files::read_ranges(layout, path, &wants)?;
    let mut out = HashMap::with_capacity(wants.len() * 4);
    for (w, (name, shape)) in wants.into_iter().zip(params) {
        out.insert(format!("{name}.exp_avg"), w.m.f_view(shape.as_slice())?);
        out.insert(format!("{name}.exp_avg_sq"), w.v.f_view(shape.as_slice())?);
        out.insert(format!("{name}.step"), Tensor::f_from_slice(&[t])?);
        if let Some(master) = w.master {
            out.insert(format!("{name}.master"), master.f_view(shape.as_slice())?);
        }
    }
    Ok(out)
}

/// Sets the bytes of training state `engines` hold on this rank (the main rank's in the metrics
/// file), GB: `mem/params_gb` (the trained variables), `mem/grads_gb` (the gradients kept between
/// backward passes), `mem/optim_gb` (masters and moments); and on data-parallel runs the largest
/// of each over the ranks (`mem/params_gb_max`, `mem/grads_gb_max`, `mem/optim_gb_max`; one
/// all-reduce).
pub fn memory_metrics(world: &World, engines: &[&TrainEngine], m: &mut crate::metrics::StepMetrics) -> Result<()> {
    let gb = |bytes: fn(&TrainEngine) -> usize| engines.iter().map(|e| bytes(e)).sum::<usize>() as f64 / 1e9;
    let local = [gb(TrainEngine::param_bytes), gb(TrainEngine::grad_bytes), gb(TrainEngine::state_bytes)];
    let names = ["mem/params_gb", "mem/grads_gb", "mem/optim_gb"];
    for (name, v) in names.iter().zip(local) {
        m.set(name, v);
    }
    if world.is_distributed() {
        let max = world.all_reduce_f64(&local, rlhf_collective::ReduceOp::Max).map_err(dist::err)?;
        for (name, v) in names.iter().zip(max) {
            m.set(&format!("{name}_max"), v);
        }
    }
    Ok(())
}

/// Ends one optimizer step of `engines` (the models trained together: the actor and a critic),
/// once every rank has backpropagated its micro-batches. Every rank learns whether all were
/// `finite` (each engine's [`TrainEngine::micro_done`] called after every micro-batch); if so
/// each engine combines the gradients over the ranks and steps (grad-norm clip,
/// AdamW; a non-finite gradient skips the step); if not, the gradients are dropped and `None`
/// says the step was skipped.
pub fn finish_step(world: &World, engines: &mut [&mut TrainEngine], finite: bool) -> Result<Option<Vec<StepInfo>>> {
    // The same decision on every rank.
    let finite = if world.is_distributed() { dist::all(world, finite)? } else { finite };
    if !finite {
        // Drop what the step's earlier micro-batches accumulated.
        for e in engines.iter_mut() {
            e.zero_grad()?;
        }
        return Ok(None);
    }
    engines.iter_mut().map(|e| e.step(world)).collect::<Result<Vec<_>>>().map(Some)
}
