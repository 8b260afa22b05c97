//! The training engine of one trained model (the way DeepSpeed's engine hides its ZeRO stages
//! behind `engine.backward` / `engine.step`): its optimizer and how its training state is laid
//! out over the data-parallel ranks. The RL host (actor and critic) and the supervised phases
//! (SFT, RM, DPO) drive every optimizer step through it, so a new layout of the state (sharded
//! moments, gradients, parameters) is a strategy here, not a branch in their loops.
//!
//! The one strategy today is **replicated** (ZeRO stage 0, DDP): every rank holds the whole state
//! (f32 masters and Adam moments, gradients, weights), gradients are summed over the ranks in flat
//! buckets, and every rank takes the same AdamW step.

use rlhf_collective::World;
use tch::nn::VarStore;
use tch::Tensor;

use crate::dist;
use crate::error::Result;
use crate::optim::{Optim, OptimConfig, StepInfo};

/// How a model's training state is laid out over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every rank holds everything; gradients are all-reduced (ZeRO stage 0).
    Replicated,
}

/// One trained model's optimizer under its [`Strategy`].
pub struct TrainEngine {
    opt: Optim,
    strategy: Strategy,
}

impl TrainEngine {
    /// AdamW over the trainable variables of `vs` (see [`Optim::new`]) for `total` optimizer steps.
    pub fn new(vs: &VarStore, settings: &OptimConfig, total: usize) -> Result<Self> {
        Ok(TrainEngine { opt: Optim::new(vs, settings, total)?, strategy: Strategy::Replicated })
    }

    /// The layout of the training state.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Optimizer steps taken (skipped ones not counted).
    pub fn steps(&self) -> usize {
        self.opt.steps
    }

    /// The optimizer (its trained variables, learning rate, state).
    pub fn optim(&self) -> &Optim {
        &self.opt
    }

    /// The optimizer state a checkpoint holds (see [`Optim::state_tensors`]).
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.opt.state_tensors()
    }

    /// Restores what [`TrainEngine::state_tensors`] saved, and the step count.
    pub fn load_state(&mut self, tensors: &std::collections::HashMap<String, Tensor>, steps: usize) -> Result<()> {
        self.opt.load_state(tensors, steps)
    }

    /// Checks that every rank holds bit-identical trained variables (see [`dist::check_identical`]).
    pub fn check_identical(&self, world: &World, what: &str) -> Result<()> {
        dist::check_identical(world, &self.opt, what)
    }

    /// Combines this rank's gradients with the other ranks' (the replicated strategy: every
    /// rank gets the sum).
    fn reduce_grads(&self, world: &World) -> Result<()> {
        match self.strategy {
            Strategy::Replicated => dist::all_reduce_grads(world, &self.opt),
        }
    }
}

/// Ends one optimizer step of `engines` (the models trained together: the actor and a critic),
/// once every rank has backpropagated its micro-batches. Every rank learns whether all were
/// `finite`; if so the gradients are combined over the ranks and every engine steps (grad-norm
/// clip, AdamW; a non-finite gradient skips inside [`Optim::step`]); if not, the gradients are
/// dropped and `None` says the step was skipped.
pub fn finish_step(world: &World, engines: &mut [&mut TrainEngine], finite: bool) -> Result<Option<Vec<StepInfo>>> {
    let mut finite = finite;
    if world.is_distributed() {
        // The same decision on every rank; the gradient of the whole step on every rank.
        finite = dist::all(world, finite)?;
        if finite {
            for e in engines.iter() {
                e.reduce_grads(world)?;
            }
        }
    }
    if !finite {
        // Drop what the step's earlier micro-batches accumulated.
        for e in engines.iter_mut() {
            e.opt.zero_grad()?;
        }
        return Ok(None);
    }
    engines.iter_mut().map(|e| e.opt.step()).collect::<Result<Vec<_>>>().map(Some)
}
