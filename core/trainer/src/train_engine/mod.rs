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

pub mod sharded;

use std::collections::HashMap;

use rlhf_collective::World;
use tch::nn::VarStore;
use tch::Tensor;

use crate::dist;
use crate::error::Result;
use crate::optim::{Optim, OptimConfig, StepInfo};
use sharded::ShardedAdam;

/// How a model's training state is laid out over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every rank holds everything; gradients are all-reduced (ZeRO stage 0).
    Replicated,
    /// Masters and moments partitioned over the ranks (ZeRO stage 1).
    ShardedOptimizer,
}

impl Strategy {
    /// The strategy of `[distributed] zero_stage` (validated to 0 or 1 by the config).
    pub fn of_stage(stage: u8) -> Strategy {
        if stage == 0 {
            Strategy::Replicated
        } else {
            Strategy::ShardedOptimizer
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
}

impl TrainEngine {
    /// AdamW over the trainable variables of `vs` (name order) for `total` optimizer steps, laid
    /// out over the ranks of `world` as `strategy` says.
    pub fn new(vs: &VarStore, settings: &OptimConfig, total: usize, strategy: Strategy, world: &World) -> Result<Self> {
        let inner = match strategy {
            Strategy::Replicated => Inner::Replicated(Optim::new(vs, settings, total)?),
            Strategy::ShardedOptimizer => Inner::Sharded(ShardedAdam::new(vs, settings, total, world)?),
        };
        Ok(TrainEngine { inner })
    }

    /// The layout of the training state.
    pub fn strategy(&self) -> Strategy {
        match self.inner {
            Inner::Replicated(_) => Strategy::Replicated,
            Inner::Sharded(_) => Strategy::ShardedOptimizer,
        }
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> usize {
        match &self.inner {
            Inner::Replicated(o) => o.steps,
            Inner::Sharded(s) => s.steps,
        }
    }

    /// Bytes of the trained variables this rank holds (all of them at stages 0 and 1), which is
    /// also what their gradients take after a backward pass (in the variables' dtype).
    pub fn param_bytes(&self) -> usize {
        let params = match &self.inner {
            Inner::Replicated(o) => o.params(),
            Inner::Sharded(s) => s.params(),
        };
        params.iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Bytes of optimizer state (f32 masters and moments) this rank holds.
    pub fn state_bytes(&self) -> usize {
        match &self.inner {
            Inner::Replicated(o) => o.state_bytes(),
            Inner::Sharded(s) => s.state_bytes(),
        }
    }

    /// The optimizer state a checkpoint holds, whole, in [`Optim::state_tensors`]'s layout
    /// whatever the strategy (a collective under sharding: every rank calls it, and only the main
    /// rank, which writes checkpoints, gets the tensors).
    pub fn state_tensors(&self, world: &World) -> Result<Vec<(String, Tensor)>> {
        match &self.inner {
            Inner::Replicated(o) => o.state_tensors(),
            Inner::Sharded(s) => s.state_tensors(world),
        }
    }

    /// Restores what [`TrainEngine::state_tensors`] saved (under any strategy and world size),
    /// and the step count. Restore the weights first.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, steps: usize) -> Result<()> {
        match &mut self.inner {
            Inner::Replicated(o) => o.load_state(tensors, steps),
            Inner::Sharded(s) => s.load_state(tensors, steps),
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

/// Sets the bytes of training state `engines` hold on this rank (the main rank's in the metrics
/// file), GB: `mem/params_gb` (the trained variables), `mem/grads_gb` (their gradients after
/// backward), `mem/optim_gb` (masters and moments); and on data-parallel runs `mem/optim_gb_max`,
/// the largest optimizer state over the ranks.
pub fn memory_metrics(world: &World, engines: &[&TrainEngine], m: &mut crate::metrics::StepMetrics) -> Result<()> {
    let params = engines.iter().map(|e| e.param_bytes()).sum::<usize>() as f64 / 1e9;
    m.set("mem/params_gb", params);
    m.set("mem/grads_gb", params);
    let gb = engines.iter().map(|e| e.state_bytes()).sum::<usize>() as f64 / 1e9;
    m.set("mem/optim_gb", gb);
    if world.is_distributed() {
        let max = world.all_reduce_f64(&[gb], rlhf_collective::ReduceOp::Max).map_err(dist::err)?[0];
        m.set("mem/optim_gb_max", max);
    }
    Ok(())
}

/// Ends one optimizer step of `engines` (the models trained together: the actor and a critic),
/// once every rank has backpropagated its micro-batches. Every rank learns whether all were
/// `finite`; if so each engine combines the gradients over the ranks and steps (grad-norm clip,
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
