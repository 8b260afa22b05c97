//! ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
//! Parameter Models", P_os): the AdamW state — f32 masters and both moments — partitioned over
//! the W ranks. As in FSDP2, every trained variable is sharded on its own: its `n` elements,
//! padded to `W·c` with `c = ⌈n / W⌉`, are cut into W chunks of `c` and rank r owns chunk r of
//! every variable. A rank's shard is its chunks laid end to end in name order (`Σ c ≈ n_total / W`
//! elements), with both moments (8 bytes per element) and for bf16/f16 variables their f32 master
//! (4 more), instead of 8–12 bytes per element of the whole model. f32 variables are their own
//! masters: each step reads their chunks afresh, bucket by bucket. Variables are grouped in
//! buckets of at most 25 MiB (DDP's default), so no buffer is larger than a bucket plus this
//! rank's shard. One step:
//!
//! 1. bucket by bucket, the gradients are copied rank-major into a buffer (chunk r of each
//!    variable in the r-th `1/W` of it) and freed, and the buffer is **reduce-scattered**: rank r
//!    receives the sum over ranks of its own chunks only. At stage 1 this happens once per step,
//!    on the gradients the micro-batches accumulated in the variables. At **stage 2** (P_os+g) it
//!    happens after every micro-batch's backward pass ([`ShardedAdam::micro_done`]) and the
//!    results are summed into a gradient shard in the variables' dtype, so the whole gradients
//!    never outlive one backward pass (`2Ψ/W` bytes of bf16 gradients kept instead of `2Ψ`);
//! 2. the global gradient norm is `√(Σ_ranks ‖g_r‖²)` (one all-reduce of a number), clipped as
//!    `clip_grad_norm_` does; a non-finite norm skips the step on every rank;
//! 3. AdamW updates the shard with the very element-wise operations of [`Optim::step`]
//!    (decoupled weight decay on the chunks of 2-D and larger variables);
//! 4. bucket by bucket, the updated chunks, rounded to the variables' dtype, are **all-gathered**
//!    and copied back, so every rank again holds the whole weights.
//!
//! Every variable takes part in every step (one missing a gradient on a rank gets zeros, as the
//! replicated all-reduce gives it), so one step count `t` serves all. In a checkpoint every rank
//! writes its own shard ([`crate::shard_files`]), which a run at any stage and world size reads back.
//!
//! [`Optim::step`]: crate::optim::Optim::step

use std::collections::HashMap;
use std::path::PathBuf;

use rlhf_collective::World;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::stage3::Params;
use crate::adamw::{adam_update_all, clip_coef};
use crate::dist;
use crate::error::{Result, TrainerError};
use crate::optim::{lr_factor, OptimConfig, StepInfo};
use crate::shard_files::{read_ranges, ShardLayout, VarLayout, Want};

/// One trained variable and its chunk.
struct Slot {
    name: String,
    var: Tensor,
    shape: Vec<i64>,
    /// Elements of the variable, and of each rank's chunk (`⌈numel / W⌉`).
    numel: i64,
    chunk: i64,
    /// Where this rank's chunk starts in its shard.
    local: i64,
    decay: bool,
}

/// Consecutive slots whose gradients travel in one collective.
struct Bucket {
    slots: std::ops::Range<usize>,
    /// Where the bucket's chunks start in the shard, and how many elements they hold.
    local: i64,
    len: i64,
}

/// The AdamW state of this rank's chunks of the trained variables.
pub struct ShardedAdam {
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    /// The variables' dtype (one for all) and device.
    kind: Kind,
    device: tch::Device,
    /// Ranks, and this rank.
    world: i64,
    rank: i64,
    /// Elements of the shard.
    s: i64,
    /// f32 master weights of the shard `[s]`, for reduced-precision (bf16, f16) variables only:
    /// f32 variables are their own masters, their chunks read afresh at each step.
    theta: Option<Tensor>,
    /// First and second moments of the shard, `[s]` each.
    m: Tensor,
    v: Tensor,
    /// Updates taken (bias correction), the same for every variable.
    t: i64,
    /// ZeRO stage 2: each micro-batch's gradients are reduce-scattered as soon as its backward
    /// is done ([`ShardedAdam::micro_done`]) and summed into `grads`, so no rank keeps whole
    /// gradients from one micro-batch to the next or during the step.
    shard_grads: bool,
    /// This rank's shard `[s]` of the gradient summed over the ranks and the step's
    /// micro-batches so far, in the variables' dtype as the gradients of stages 0 and 1 are
    /// accumulated (stage 2; `None` before the first micro-batch and after a step).
    grads: Option<Tensor>,
    settings: OptimConfig,
    total: usize,
    pub(super) steps: usize,
    /// ZeRO stage 3: the sharded parameters (every variable's chunk), which the step updates in
    /// place of the variables while the model is sharded.
    pub(super) params: Option<Params>,
}

fn state_err(what: String) -> TrainerError {
    TrainerError::Checkpoint(format!("optimizer state: {what}"))
}

impl ShardedAdam {
    /// This rank's chunks of the trainable variables of `vs` (name order).
    /// With `shard_grads` (stage 2) the gradients are reduce-scattered micro-batch by micro-batch;
    /// with `shard_params` (stage 3, implies `shard_grads`) every variable of `vs` is sharded too
    /// ([`super::stage3`]).
    pub fn new(
        vs: &VarStore,
        settings: &OptimConfig,
        total: usize,
        world: &World,
        shard_grads: bool,
        shard_params: bool,
    ) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let Some((first_name, first)) = vars.first() else {
            return Err(TrainerError::Config("distributed.zero_stage: the model has no trained variables".into()));
        };
        let (kind, device) = (first.kind(), first.device());
        if let Some((name, t)) = vars.iter().find(|(_, t)| t.kind() != kind || t.device() != device) {
            return Err(TrainerError::Config(format!(
                "distributed.zero_stage: the trained variables must share one dtype and device to be sharded \
                 (`{name}` is {:?} on {:?}, `{first_name}` {kind:?} on {device:?})",
                t.kind(),
                t.device(),
            )));
        }
        let (w, rank) = (world.size() as i64, world.rank() as i64);
        let elt = kind.elt_size_in_bytes() as i64;
        let (mut slots, mut buckets) = (Vec::with_capacity(vars.len()), Vec::new());
        let mut local = 0i64;
        for (i, (name, var)) in vars.into_iter().enumerate() {
            let numel = var.numel() as i64;
            let chunk = (numel + w - 1) / w;
            let open = buckets.last().is_some_and(|b: &Bucket| (b.len + chunk) * w * elt <= dist::BUCKET_BYTES as i64);
            match buckets.last_mut() {
                Some(b) if open => {
                    b.slots.end = i + 1;
                    b.len += chunk;
                }
                _ => buckets.push(Bucket { slots: i..i + 1, local, len: chunk }),
            }
            slots.push(Slot { name, decay: var.dim() >= 2, shape: var.size(), var, numel, chunk, local });
            local += chunk;
        }
        let params = if shard_params {
            let at = slots.iter().map(|s: &Slot| (s.name.clone(), s.local)).collect();
            Some(Params::new(vs, world, &at, local)?)
        } else {
            None
        };
        let engine = ShardedAdam {
            slots,
            buckets,
            kind,
            device,
            world: w,
            rank,
            s: local,
            theta: if matches!(kind, Kind::BFloat16 | Kind::Half) {
                Some(Tensor::f_zeros([local], (Kind::Float, device))?)
            } else {
                None
            },
            m: Tensor::f_zeros([local], (Kind::Float, device))?,
            v: Tensor::f_zeros([local], (Kind::Float, device))?,
            t: 0,
            shard_grads: shard_grads || shard_params,
            grads: None,
            settings: *settings,
            total,
            steps: 0,
            params,
        };
        if let Some(theta) = &engine.theta {
            tch::no_grad(|| -> Result<()> {
                for slot in &engine.slots {
                    let mine = engine.chunk_of(slot, &slot.var.f_detach()?.f_to_kind(Kind::Float)?)?;
                    theta.f_narrow(0, slot.local, slot.chunk)?.f_copy_(&mine)?;
                }
                Ok(())
            })?;
        }
        Ok(engine)
    }

    /// `whole` (a tensor of `slot`'s shape) flat, zero-padded to `W · chunk`, viewed `[W, chunk]`.
    fn padded(&self, slot: &Slot, whole: &Tensor) -> Result<Tensor> {
        let flat = whole.f_reshape([-1])?;
        let pad = self.world * slot.chunk - slot.numel;
        let flat = if pad > 0 { flat.f_constant_pad_nd([0, pad])? } else { flat };
        Ok(flat.f_view([self.world, slot.chunk])?)
    }

    /// This rank's chunk `[chunk]` of `whole` (a tensor of `slot`'s shape).
    fn chunk_of(&self, slot: &Slot, whole: &Tensor) -> Result<Tensor> {
        Ok(self.padded(slot, whole)?.f_select(0, self.rank)?)
    }

    /// The learning rate of the next step.
    fn current_lr(&self) -> f64 {
        self.settings.lr * lr_factor(self.settings.schedule, self.steps, self.settings.warmup_steps, self.total)
    }

    /// Bytes of optimizer state on this rank (moments, and masters, of the shard).
    pub fn state_bytes(&self) -> usize {
        (2 + usize::from(self.theta.is_some())) * self.s as usize * 4
    }

    /// The f32 weights of bucket `b`'s chunks, `[len]`: a view of the masters (updated in place),
    /// or for f32 variables a copy of their chunks.
    fn bucket_theta(&self, b: &Bucket) -> Result<Tensor> {
        if let Some(theta) = &self.theta {
            return Ok(theta.f_narrow(0, b.local, b.len)?);
        }
        let out = Tensor::f_zeros([b.len], (Kind::Float, self.device))?;
        for slot in &self.slots[b.slots.clone()] {
            let mine = match &self.params {
                Some(p) => p.chunk_f32(&slot.name)?,
                None => self.chunk_of(slot, &slot.var.f_detach()?)?,
            };
            out.f_narrow(0, slot.local - b.local, slot.chunk)?.f_copy_(&mine)?;
        }
        Ok(out)
    }

    /// The trained variables, in name order.
    pub fn params(&self) -> Vec<Tensor> {
        self.slots.iter().map(|s| s.var.shallow_clone()).collect()
    }

    /// Bytes of gradients this rank keeps between backward passes (in the variables' dtype): the
    /// whole gradients, or at stage 2 its shard of them.
    pub fn grad_bytes(&self) -> usize {
        if self.shard_grads || self.params.is_some() {
            self.s as usize * self.kind.elt_size_in_bytes()
        } else {
            self.params().iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
        }
    }

    /// Drops every variable's gradient, and at stage 2 the summed shard.
    pub fn zero_grad(&mut self) -> Result<()> {
        for s in &self.slots {
            release(&s.var)?;
        }
        self.grads = None;
        match &self.params {
            Some(p) => p.clear_grads(),
            None => Ok(()),
        }
    }

    /// Ends one micro-batch's backward pass. At stage 2 (a collective: every rank calls it once
    /// per micro-batch of a step, also for a micro-batch it had no rows of) the gradients it left
    /// are reduce-scattered, added to this rank's shard and freed; at stage 1 nothing happens
    /// (the gradients accumulate in the variables until the step).
    pub fn micro_done(&mut self, world: &World) -> Result<()> {
        // Sharded parameters: the gate reduced each unit's gradients after its backward.
        if !self.shard_grads || self.params.as_ref().is_some_and(|p| !p.is_whole()) {
            return Ok(());
        }
        tch::no_grad(|| {
            let first = self.grads.is_none();
            let shard = match self.grads.take() {
                Some(g) => g,
                None => Tensor::f_zeros([self.s], (self.kind, self.device))?,
            };
            self.reduce_scatter_into(world, &shard, !first)?;
            self.grads = Some(shard);
            Ok(())
        })
    }

    /// Reduce-scatters the variables' gradients into this rank's shard `[s]` of their sum
    /// over the ranks (copied, or with `add` added to what `shard` holds); every variable's
    /// gradient is freed once copied into its bucket.
    fn reduce_scatter_into(&self, world: &World, shard: &Tensor, add: bool) -> Result<()> {
        for b in &self.buckets {
            // Rank-major: row r holds chunk r of every variable of the bucket.
            let input = Tensor::f_zeros([self.world, b.len], (self.kind, self.device))?;
            for slot in &self.slots[b.slots.clone()] {
                let g = slot.var.grad();
                if g.defined() {
                    input.f_narrow(1, slot.local - b.local, slot.chunk)?.f_copy_(&self.padded(slot, &g)?)?;
                }
                release(&slot.var)?;
            }
            let mine = Tensor::f_empty([b.len], (self.kind, self.device))?;
            world.reduce_scatter(&mine, &input.f_view([-1])?).map_err(dist::err)?;
            let mut dst = shard.f_narrow(0, b.local, b.len)?;
            if add {
                let _ = dst.f_add_(&mine)?;
            } else {
                dst.f_copy_(&mine)?;
            }
        }
        Ok(())
    }

    /// This rank's gradient shard `[s]`, f32, for the step: what the micro-batches reduce-scattered
    /// (stage 2), or the variables' accumulated gradients reduce-scattered now (stage 1).
    fn step_grads(&mut self, world: &World) -> Result<Tensor> {
        if !self.shard_grads {
            let shard = Tensor::f_zeros([self.s], (Kind::Float, self.device))?;
            self.reduce_scatter_into(world, &shard, false)?;
            return Ok(shard);
        }
        if let Some(slot) = self.slots.iter().find(|s| s.var.grad().defined()) {
            return Err(TrainerError::Distributed(format!(
                "zero stage 2: `{}` has a gradient that no micro-batch reduce-scattered (a backward pass after the \
                 last `micro_done`)",
                slot.name
            )));
        }
        // What the micro-batches reduced while the variables were whole, and at stage 3 what
        // the gate reduced while they were sharded.
        let whole = self.grads.take().map(|g| g.f_to_kind(Kind::Float)).transpose()?;
        let gated = match &self.params {
            Some(p) => p.take_grads()?,
            None => None,
        };
        match (whole, gated) {
            (Some(a), Some(b)) => Ok(a.f_add(&b)?),
            (Some(g), None) | (None, Some(g)) => Ok(g),
            (None, None) => Ok(Tensor::f_zeros([self.s], (Kind::Float, self.device))?),
        }
    }

    /// One optimizer step over the ranks' gradients (see the module docs).
    pub fn step(&mut self, world: &World) -> Result<StepInfo> {
        tch::no_grad(|| self.step_inner(world))
    }

    fn step_inner(&mut self, world: &World) -> Result<StepInfo> {
        let g = self.step_grads(world)?;
        // ‖g‖² of the shard, bucket by bucket: a whole-shard square summed in f64 would cast it
        // to an f64 copy, three times the shard's f32 bytes at once.
        let mut local = 0.0;
        for b in &self.buckets {
            local += g.f_narrow(0, b.local, b.len)?.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?;
        }
        let grad_norm = dist::sum(world, &[local])?[0].sqrt();
        let lr = self.current_lr();
        if !grad_norm.is_finite() {
            return Ok(StepInfo { grad_norm, skipped: true, lr });
        }
        let c = &self.settings;
        let clip = clip_coef(c.max_grad_norm, grad_norm);
        let (betas, eps, wd) = (c.betas, c.eps, c.weight_decay);
        self.t += 1;
        let decay = Tensor::from(1.0 - lr * wd);
        // Bucket by bucket, so the update's temporaries stay bucket-sized.
        for b in &self.buckets {
            let part = |t: &Tensor| t.f_narrow(0, b.local, b.len);
            let g = part(&g)?;
            let g = if clip != 1.0 { g.f_mul_scalar(clip)? } else { g };
            let (theta, m, v) = (self.bucket_theta(b)?, part(&self.m)?, part(&self.v)?);
            if wd != 0.0 {
                // Decoupled weight decay on the chunks of 2-D (or larger) variables.
                for slot in self.slots[b.slots.clone()].iter().filter(|s| s.decay) {
                    let _ = theta.f_narrow(0, slot.local - b.local, slot.chunk)?.f_mul_(&decay)?;
                }
            }
            let mut bucket = [(theta.shallow_clone(), m.shallow_clone(), v.shallow_clone(), g.shallow_clone(), self.t)];
            adam_update_all(&mut bucket, lr, betas, eps)?;
            if let Some(p) = &self.params {
                // Stage 3: the updated chunks are the parameters; whole variables only while whole.
                for slot in &self.slots[b.slots.clone()] {
                    p.set_chunk(&slot.name, &theta.f_narrow(0, slot.local - b.local, slot.chunk)?)?;
                }
                if !p.is_whole() {
                    continue;
                }
            }
            // Every rank's updated chunks, rounded to the variables' dtype, back into them.
            let full = self.gather_bucket(world, b, &theta, self.kind)?;
            for slot in &self.slots[b.slots.clone()] {
                slot.var.shallow_clone().f_copy_(&self.whole_of(slot, b, &full)?)?;
            }
        }
        self.steps += 1;
        Ok(StepInfo { grad_norm, skipped: false, lr })
    }

    /// Every rank's `mine` (its bucket `b`, `[len]`, rounded to `kind`), as `[W, len]`.
    fn gather_bucket(&self, world: &World, b: &Bucket, mine: &Tensor, kind: Kind) -> Result<Tensor> {
        let full = Tensor::f_empty([self.world, b.len], (kind, self.device))?;
        let mine = mine.f_to_kind(kind)?.f_contiguous()?;
        world.all_gather_into(&full.f_view([-1])?, &mine).map_err(dist::err)?;
        Ok(full)
    }

    /// `slot`'s whole tensor out of its bucket's gathered `[W, len]`.
    fn whole_of(&self, slot: &Slot, b: &Bucket, gathered: &Tensor) -> Result<Tensor> {
        let chunks = gathered.f_narrow(1, slot.local - b.local, slot.chunk)?.f_contiguous()?;
        Ok(chunks.f_view([-1])?.f_narrow(0, 0, slot.numel)?.f_view(slot.shape.as_slice())?)
    }

    /// How the state is cut over the ranks (the same on every rank), for a checkpoint.
    pub fn layout(&self, stage: u8) -> ShardLayout {
        ShardLayout {
            stage,
            world: self.world as usize,
            masters: self.theta.is_some(),
            vars: self
                .slots
                .iter()
                .map(|s| VarLayout { name: s.name.clone(), shape: s.shape.clone(), numel: s.numel, chunk: s.chunk })
                .collect(),
        }
    }

    /// This rank's shard of the state for a checkpoint: `exp_avg`, `exp_avg_sq` (and `master`)
    /// `[s]` f32, and `step` (sharing storage with the live state: write them before the next step).
    pub fn shard_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![
            ("exp_avg".to_string(), self.m.shallow_clone()),
            ("exp_avg_sq".to_string(), self.v.shallow_clone()),
            ("step".to_string(), Tensor::f_from_slice(&[self.t])?),
        ];
        if let Some(theta) = &self.theta {
            out.push(("master".to_string(), theta.shallow_clone()));
        }
        Ok(out)
    }

    /// Restores this rank's chunks from the shards of a checkpoint cut as `layout` (any stage ≥ 1
    /// and world size; `path(r)` is rank r's file), reading only the files that overlap them.
    /// Without saved masters, reduced-precision variables take theirs from the restored weights.
    pub fn load_shards(
        &mut self,
        what: &str,
        layout: &ShardLayout,
        path: impl Fn(usize) -> Result<PathBuf>,
        steps: usize,
    ) -> Result<()> {
        let names: Vec<(&str, i64)> = self.slots.iter().map(|s| (s.name.as_str(), s.numel)).collect();
        layout.check_vars(what, &names)?;
        let mut wants = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let (lo, hi) = (self.rank * slot.chunk, ((self.rank + 1) * slot.chunk).min(slot.numel));
            if lo >= hi {
                continue;
            }
            let part = |t: &Tensor| t.f_narrow(0, slot.local, hi - lo);
            let master = match &self.theta {
                Some(theta) if layout.masters => Some(part(theta)?),
                Some(theta) => {
                    let mine = self.chunk_of(slot, &slot.var.f_detach()?.f_to_kind(Kind::Float)?)?;
                    tch::no_grad(|| theta.f_narrow(0, slot.local, slot.chunk)?.f_copy_(&mine))?;
                    None
                }
                None => None,
            };
            wants.push(Want { name: slot.name.clone(), lo, hi, m: part(&self.m)?, v: part(&self.v)?, master });
        }
        self.t = read_ranges(layout, path, &wants)?;
        self.steps = steps;
        Ok(())
    }

    /// Restores this rank's chunks from the whole state of a checkpoint (written at any stage
    /// and world size); a saved master also goes into the variable. Restore the weights first.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>, steps: usize) -> Result<()> {
        let get = |key: &str, slot: &Slot| -> Result<Option<Tensor>> {
            match state.get(key) {
                Some(t) if t.size() != slot.shape => {
                    Err(state_err(format!("`{key}` has shape {:?}, the model {:?}", t.size(), slot.shape)))
                }
                Some(t) => Ok(Some(t.f_to_kind(Kind::Float)?)),
                None => Ok(None),
            }
        };
        let need = |key: String, slot: &Slot| get(&key, slot)?.ok_or_else(|| state_err(format!("missing `{key}`")));
        let mut steps_seen = Vec::with_capacity(self.slots.len());
        tch::no_grad(|| -> Result<()> {
            for slot in &self.slots {
                let m = need(format!("{}.exp_avg", slot.name), slot)?;
                let v = need(format!("{}.exp_avg_sq", slot.name), slot)?;
                if let Some(theta) = &self.theta {
                    // The master where saved, else the restored reduced-precision weights.
                    let master = match get(&format!("{}.master", slot.name), slot)? {
                        Some(master) => {
                            slot.var.shallow_clone().f_copy_(&master)?;
                            master
                        }
                        None => slot.var.f_detach()?.f_to_kind(Kind::Float)?,
                    };
                    theta.f_narrow(0, slot.local, slot.chunk)?.f_copy_(&self.chunk_of(slot, &master)?)?;
                }
                let key = format!("{}.step", slot.name);
                let saved = state.get(&key).ok_or_else(|| state_err(format!("missing `{key}`")))?;
                steps_seen.push(crate::shard_files::step_count(saved, &format!("optimizer state `{key}`"))?);
                for (dst, src) in [(&self.m, &m), (&self.v, &v)] {
                    dst.f_narrow(0, slot.local, slot.chunk)?.f_copy_(&self.chunk_of(slot, src)?)?;
                }
            }
            Ok(())
        })?;
        let t = steps_seen.iter().copied().max().unwrap_or(0);
        if steps_seen.iter().any(|&x| x != t) {
            tracing::info!(
                "optimizer state: per-variable step counts {}..{t} become {t} (sharded AdamW keeps one)",
                steps_seen.iter().min().unwrap_or(&0)
            );
        }
        self.t = t;
        self.steps = steps;
        Ok(())
    }
}

fn release(var: &Tensor) -> Result<()> {
    rlhf_collective::release_grad(var).map_err(|e| TrainerError::Distributed(e.to_string()))
}
