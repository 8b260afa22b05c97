//! ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
//! Parameter Models", P_os): the AdamW state — f32 masters and both moments — partitioned over
//! the ranks. The trained variables are laid end to end in name order into one flat vector of
//! `n` elements, padded to `n_pad = ⌈n / W⌉·W`; rank r owns elements `[r·s, (r+1)·s)` with
//! `s = n_pad / W` and keeps only their state (12 bytes per owned element instead of 8–12 per
//! element of the whole model). One step:
//!
//! 1. the gradients are copied into a flat buffer (each freed once copied) and
//!    **reduce-scattered**: rank r receives the sum over ranks of its own slice only;
//! 2. the global gradient norm is `√(Σ_ranks ‖g_r‖²)` (one all-reduce of a number), clipped as
//!    `clip_grad_norm_` does; a non-finite norm skips the step on every rank;
//! 3. AdamW updates the owned slice, with the very element-wise operations of [`Optim::step`]
//!    (decoupled weight decay on the 2-D and larger variables only);
//! 4. the updated slices, rounded to the variables' dtype, are **all-gathered** and copied back,
//!    so every rank again holds the whole weights.
//!
//! Every variable takes part in every step (one missing a gradient on a rank gets zeros, as the
//! replicated all-reduce gives it), so one step count `t` serves all. Checkpoints hold the state
//! in [`Optim::state_tensors`]'s layout, gathered from the slices, so a run resumes at any stage
//! and world size.
//!
//! [`Optim::step`]: crate::optim::Optim::step
//! [`Optim::state_tensors`]: crate::optim::Optim::state_tensors

use std::collections::HashMap;

use rlhf_collective::World;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::dist;
use crate::error::{Result, TrainerError};
use crate::optim::{lr_factor, OptimConfig, StepInfo};

/// One trained variable's place in the flat vector.
struct Slot {
    name: String,
    var: Tensor,
    /// First element in the flat vector, and the element count.
    offset: i64,
    numel: i64,
    decay: bool,
}

/// The AdamW state of this rank's slice of the flat trained variables.
pub struct ShardedAdam {
    slots: Vec<Slot>,
    /// The variables' dtype (one for all) and device.
    kind: Kind,
    device: tch::Device,
    /// This rank's slice `[start, start + s)` of the padded flat vector of `n_pad` elements.
    start: i64,
    s: i64,
    n_pad: i64,
    /// f32 master weights, first and second moments of the slice, `[s]` each.
    theta: Tensor,
    m: Tensor,
    v: Tensor,
    /// Updates taken (bias correction), the same for every variable.
    t: i64,
    settings: OptimConfig,
    total: usize,
    pub(super) steps: usize,
}

fn shape_err(what: String) -> TrainerError {
    TrainerError::Checkpoint(format!("optimizer state: {what}"))
}

impl ShardedAdam {
    /// The slice of the trainable variables of `vs` (name order) this rank of `world` owns.
    pub fn new(vs: &VarStore, settings: &OptimConfig, total: usize, world: &World) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let Some((_, first)) = vars.first() else {
            return Err(TrainerError::Config("distributed.zero_stage: the model has no trained variables".into()));
        };
        let (kind, device) = (first.kind(), first.device());
        if let Some((name, t)) = vars.iter().find(|(_, t)| t.kind() != kind || t.device() != device) {
            return Err(TrainerError::Config(format!(
                "distributed.zero_stage: the trained variables must share one dtype and device to be sharded \
                 (`{name}` is {:?} on {:?}, `{}` {kind:?} on {device:?})",
                t.kind(),
                t.device(),
                vars[0].0
            )));
        }
        let mut slots = Vec::with_capacity(vars.len());
        let mut offset = 0i64;
        for (name, var) in vars {
            let numel = var.numel() as i64;
            slots.push(Slot { name, decay: var.dim() >= 2, var, offset, numel });
            offset += numel;
        }
        let w = world.size() as i64;
        let n_pad = (offset + w - 1) / w * w;
        let s = n_pad / w;
        let start = world.rank() as i64 * s;
        let theta = tch::no_grad(|| -> Result<Tensor> {
            let flat = Tensor::f_zeros([n_pad], (Kind::Float, device))?;
            for slot in &slots {
                flat.f_narrow(0, slot.offset, slot.numel)?.f_copy_(&slot.var.f_reshape([-1])?)?;
            }
            Ok(flat.f_narrow(0, start, s)?.f_contiguous()?)
        })?;
        let (m, v) = (theta.f_zeros_like()?, theta.f_zeros_like()?);
        Ok(ShardedAdam {
            slots,
            kind,
            device,
            start,
            s,
            n_pad,
            theta,
            m,
            v,
            t: 0,
            settings: *settings,
            total,
            steps: 0,
        })
    }

    /// The learning rate of the next step.
    fn current_lr(&self) -> f64 {
        self.settings.lr * lr_factor(self.settings.schedule, self.steps, self.settings.warmup_steps, self.total)
    }

    /// Bytes of optimizer state on this rank (masters and moments of the slice).
    pub fn state_bytes(&self) -> usize {
        3 * self.s as usize * 4
    }

    /// The trained variables, in name order.
    pub fn params(&self) -> Vec<Tensor> {
        self.slots.iter().map(|s| s.var.shallow_clone()).collect()
    }

    /// Drops every variable's gradient.
    pub fn zero_grad(&self) -> Result<()> {
        for s in &self.slots {
            rlhf_collective::release_grad(&s.var).map_err(|e| TrainerError::Distributed(e.to_string()))?;
        }
        Ok(())
    }

    /// This rank's slice of the gradient summed over the ranks, `[s]` in f32; every variable's
    /// gradient is freed once copied into the flat buffer.
    fn reduce_scatter_grads(&self, world: &World) -> Result<Tensor> {
        let flat = Tensor::f_zeros([self.n_pad], (self.kind, self.device))?;
        for slot in &self.slots {
            let g = slot.var.grad();
            if g.defined() {
                flat.f_narrow(0, slot.offset, slot.numel)?.f_copy_(&g.f_reshape([-1])?)?;
            }
            rlhf_collective::release_grad(&slot.var).map_err(|e| TrainerError::Distributed(e.to_string()))?;
        }
        let mine = Tensor::f_empty([self.s], (self.kind, self.device))?;
        world.reduce_scatter(&mine, &flat).map_err(dist::err)?;
        Ok(mine.f_to_kind(Kind::Float)?)
    }

    /// One optimizer step over the ranks' gradients (see the module docs).
    pub fn step(&mut self, world: &World) -> Result<StepInfo> {
        tch::no_grad(|| self.step_inner(world))
    }

    fn step_inner(&mut self, world: &World) -> Result<StepInfo> {
        let g = self.reduce_scatter_grads(world)?;
        let local = g.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?;
        let grad_norm = dist::sum(world, &[local])?[0].sqrt();
        let lr = self.current_lr();
        if !grad_norm.is_finite() {
            return Ok(StepInfo { grad_norm, skipped: true, lr });
        }
        let c = &self.settings;
        let clip = if c.max_grad_norm > 0.0 && grad_norm > c.max_grad_norm {
            c.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let g = if clip != 1.0 { g.f_mul_scalar(clip)? } else { g };
        let (b1, b2) = c.betas;
        let (eps, wd) = (c.eps, c.weight_decay);
        self.t += 1;
        if wd != 0.0 {
            // Decoupled weight decay on the owned part of each 2-D (or larger) variable.
            let factor = Tensor::from(1.0 - lr * wd);
            for slot in self.slots.iter().filter(|s| s.decay) {
                let (a, b) = (slot.offset.max(self.start), (slot.offset + slot.numel).min(self.start + self.s));
                if a < b {
                    let _ = self.theta.f_narrow(0, a - self.start, b - a)?.f_mul_(&factor)?;
                }
            }
        }
        // m ← β1 m + (1 − β1) g;  v ← β2 v + (1 − β2) g²;  θ ← θ − lr/bc1 · m / (√v / √bc2 + ε)
        let _ = self.m.f_lerp_(&g, 1.0 - b1)?;
        let _ = self.v.f_mul_(&Tensor::from(b2))?.f_addcmul_(&g, &g.f_mul_scalar(1.0 - b2)?)?;
        let (bc1, bc2) = (1.0 - b1.powi(self.t as i32), 1.0 - b2.powi(self.t as i32));
        let denom = self.v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
        let _ = self.theta.f_addcdiv_(&self.m.f_mul_scalar(-lr / bc1)?, &denom)?;
        self.gather_weights(world)?;
        self.steps += 1;
        Ok(StepInfo { grad_norm, skipped: false, lr })
    }

    /// Every rank's updated slice, rounded to the variables' dtype, back into the variables.
    fn gather_weights(&self, world: &World) -> Result<()> {
        let full = Tensor::f_empty([self.n_pad], (self.kind, self.device))?;
        world.all_gather_into(&full, &self.theta.f_to_kind(self.kind)?).map_err(dist::err)?;
        for slot in &self.slots {
            slot.var.shallow_clone().f_copy_(&full.f_narrow(0, slot.offset, slot.numel)?.f_view_as(&slot.var)?)?;
        }
        Ok(())
    }

    /// A state tensor `[s]` of every rank, whole: `[n_pad]`.
    fn gather(&self, world: &World, t: &Tensor) -> Result<Tensor> {
        let full = Tensor::f_empty([self.n_pad], (Kind::Float, self.device))?;
        world.all_gather_into(&full, t).map_err(dist::err)?;
        Ok(full)
    }

    /// The whole state in [`crate::optim::Optim::state_tensors`]'s names and shapes (a
    /// collective: every rank calls it; each briefly holds the whole moments).
    pub fn state_tensors(&self, world: &World) -> Result<Vec<(String, Tensor)>> {
        tch::no_grad(|| {
            let (m, v) = (self.gather(world, &self.m)?, self.gather(world, &self.v)?);
            let master = if matches!(self.kind, Kind::BFloat16 | Kind::Half) {
                Some(self.gather(world, &self.theta)?)
            } else {
                None
            };
            let mut out = Vec::with_capacity(self.slots.len() * 3);
            for slot in &self.slots {
                let part = |t: &Tensor| -> Result<Tensor> {
                    Ok(t.f_narrow(0, slot.offset, slot.numel)?.f_view_as(&slot.var)?.f_to_kind(Kind::Float)?)
                };
                out.push((format!("{}.exp_avg", slot.name), part(&m)?));
                out.push((format!("{}.exp_avg_sq", slot.name), part(&v)?));
                out.push((format!("{}.step", slot.name), Tensor::f_from_slice(&[self.t])?));
                if let Some(master) = &master {
                    out.push((format!("{}.master", slot.name), part(master)?));
                }
            }
            Ok(out)
        })
    }

    /// Restores this rank's slice from the whole state of a checkpoint (written at any stage and
    /// world size); a saved master also goes into the variable. Restore the weights first.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>, steps: usize) -> Result<()> {
        let missing = |k: &str| shape_err(format!("missing `{k}`"));
        tch::no_grad(|| -> Result<()> {
            let flat = |suffix: &str, fallback: bool| -> Result<Tensor> {
                let out = Tensor::f_zeros([self.n_pad], (Kind::Float, self.device))?;
                for slot in &self.slots {
                    let key = format!("{}.{suffix}", slot.name);
                    let saved = match state.get(&key) {
                        Some(t) => t.shallow_clone(),
                        None if fallback => slot.var.shallow_clone(),
                        None => return Err(missing(&key)),
                    };
                    if saved.size() != slot.var.size() {
                        return Err(shape_err(format!(
                            "`{key}` has shape {:?}, the model {:?}",
                            saved.size(),
                            slot.var.size()
                        )));
                    }
                    if fallback && state.contains_key(&key) {
                        slot.var.shallow_clone().f_copy_(&saved)?;
                    }
                    out.f_narrow(0, slot.offset, slot.numel)?.f_copy_(&saved.f_reshape([-1])?)?;
                }
                Ok(out.f_narrow(0, self.start, self.s)?)
            };
            self.m.f_copy_(&flat("exp_avg", false)?)?;
            self.v.f_copy_(&flat("exp_avg_sq", false)?)?;
            // The master where saved (reduced-precision weights), else the restored weights.
            self.theta.f_copy_(&flat("master", true)?)?;
            let mut ts = Vec::with_capacity(self.slots.len());
            for slot in &self.slots {
                let key = format!("{}.step", slot.name);
                ts.push(state.get(&key).ok_or_else(|| missing(&key))?.f_int64_value(&[0])?);
            }
            let t = ts.iter().copied().max().unwrap_or(0);
            if ts.iter().any(|&x| x != t) {
                tracing::info!(
                    "optimizer state: per-variable step counts {}..{t} become {t} (sharded AdamW keeps one)",
                    ts.iter().min().unwrap_or(&0)
                );
            }
            self.t = t;
            Ok(())
        })?;
        self.steps = steps;
        Ok(())
    }
}
