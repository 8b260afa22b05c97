//! AdamW with warm-up + constant/linear/cosine schedules, gradient-norm clipping, skipping of
//! non-finite steps, and the EMA copy of the actor.
//!
//! Mixed precision: a bf16 (or f16) parameter gets an f32 master copy and f32 moments. Its gradient
//! is cast to f32, the update is applied to the master and the master is rounded back into the
//! parameter, so updates far below bf16's resolution (lr 1e-6 on weights near 1) accumulate
//! instead of being lost. f32 parameters are updated in place exactly as without this.

use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

use crate::adamw::{adam_update_all, clip_coef};
use crate::error::{Result, TrainerError};

/// Learning-rate schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

/// The settings of one AdamW optimizer and its schedule, shared by RL (actor and critic), SFT, RM
/// and the warm-up; each config section says which of its keys fill it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub schedule: Schedule,
    /// Optimizer steps of linear warm-up.
    pub warmup_steps: usize,
    /// Gradient-norm clip (0 disables).
    pub max_grad_norm: f64,
}

impl OptimConfig {
    /// Range checks shared by every command: `Err((setting, message))` for the first setting out
    /// of range, named as here (`lr`, `betas`, `eps`, `weight_decay`, `max_grad_norm`); the caller
    /// names the key of its own section.
    pub fn check(&self) -> std::result::Result<(), (&'static str, &'static str)> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(("lr", "must be a finite number > 0"));
        }
        let (b1, b2) = self.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return Err(("betas", "must be two numbers in [0, 1)"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(("eps", "must be a finite number > 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(("weight_decay", "must be a finite number >= 0"));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(("max_grad_norm", "must be >= 0"));
        }
        Ok(())
    }
}

/// Whether a parameter of this dtype trains through an f32 master copy: the reduced-precision
/// float dtypes, whose resolution swallows small updates.
fn needs_master(kind: Kind) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half)
}

/// Learning-rate multiplier at optimizer step `step` (0-based) of `total`.
pub fn lr_factor(schedule: Schedule, step: usize, warmup: usize, total: usize) -> f64 {
    if warmup > 0 && step < warmup {
        return (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step.saturating_sub(warmup)) as f64 / span).clamp(0.0, 1.0);
    match schedule {
        Schedule::Constant => 1.0,
        Schedule::Linear => 1.0 - progress,
        Schedule::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// The step was skipped because the gradient was not finite.
    pub skipped: bool,
    /// Learning rate used.
    pub lr: f64,
}

/// Adam moments of one parameter.
struct ParamState {
    name: String,
    var: Tensor,
    /// f32 master copy of a reduced-precision (bf16/f16) parameter, same shape; `None` for f32
    /// (and f64) parameters, which are updated in place.
    master: Option<Tensor>,
    /// First moment (`exp_avg`), same shape as the parameter; f32 for reduced-precision
    /// parameters, else the parameter's dtype.
    m: Tensor,
    /// Second moment (`exp_avg_sq`), same shape and dtype as `m`.
    v: Tensor,
    /// Updates this parameter received (torch keeps a per-parameter step for bias correction).
    t: i64,
    decay: bool,
}

/// AdamW (torch.optim.AdamW's update, decoupled weight decay) over the trainable variables of one
/// var store, with its schedule. Written here rather than taken from libtorch so its state can be
/// checkpointed and restored bit-exactly. Weight decay skips 1-D parameters (biases and norm
/// weights), as Hugging Face's Trainer does.
///
/// Reduced-precision parameters train through f32 masters (see the module docs). The masters are
/// taken when the optimizer is built and restored by [`Optim::load_state`]: a parameter changed
/// by anything else afterwards would be overwritten by the next step.
pub struct Optim {
    params: Vec<ParamState>,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    base_lr: f64,
    schedule: Schedule,
    warmup: usize,
    total: usize,
    max_grad_norm: f64,
    /// Optimizer steps taken (not counting skipped ones).
    pub steps: usize,
}

impl Optim {
    /// Builds AdamW over the variables of `vs` that require gradients (all of them, or only the
    /// LoRA adapters and heads after `apply_lora`), in name order; bf16/f16 ones get f32 masters
    /// and moments.
    pub fn new(vs: &nn::VarStore, c: &OptimConfig, total: usize) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut params = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let master = if needs_master(var.kind()) {
                Some(tch::no_grad(|| var.f_detach()?.f_to_kind(Kind::Float)?.f_contiguous())?)
            } else {
                None
            };
            let moments_of = master.as_ref().unwrap_or(&var);
            let m = moments_of.f_zeros_like()?;
            let v = moments_of.f_zeros_like()?;
            let decay = var.dim() >= 2;
            params.push(ParamState { name, var, master, m, v, t: 0, decay });
        }
        Ok(Optim {
            params,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            base_lr: c.lr,
            schedule: c.schedule,
            warmup: c.warmup_steps,
            total,
            max_grad_norm: c.max_grad_norm,
            steps: 0,
        })
    }

    /// The trained variables, in name order (the order every data-parallel rank reduces their
    /// gradients in).
    pub fn params(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.var.shallow_clone()).collect()
    }

    /// The trained variables' names and shapes, in name order.
    pub fn params_named(&self) -> Vec<(String, Vec<i64>)> {
        self.params.iter().map(|p| (p.name.clone(), p.var.size())).collect()
    }

    /// Bytes of optimizer state: the moments, and the f32 masters of reduced-precision variables.
    pub fn state_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        self.params.iter().map(|p| bytes(&p.m) + bytes(&p.v) + p.master.as_ref().map_or(0, bytes)).sum()
    }

    /// The learning rate of the next step.
    pub fn current_lr(&self) -> f64 {
        self.base_lr * lr_factor(self.schedule, self.steps, self.warmup, self.total)
    }

    /// Clears gradients by dropping them, as PyTorch's `zero_grad()` does by default
    /// (`set_to_none=True`): the next backward allocates each while the activations it consumes
    /// are freed, rather than a zeroed buffer of every parameter's size being held through the
    /// forward (SmolLM2 GRPO step: peak RSS 5.25 → 5.02 GB). A parameter that then gets no
    /// gradient is skipped by [`Optim::step`], as torch's AdamW skips one whose `grad` is `None`.
    pub fn zero_grad(&mut self) -> Result<()> {
        for p in &self.params {
            rlhf_collective::release_grad(&p.var).map_err(|e| TrainerError::Distributed(e.to_string()))?;
        }
        Ok(())
    }

    /// L2 norm of all gradients (0 when none exist yet), as `clip_grad_norm_` computes it: each
    /// parameter's norm on its device (in f32 for bf16 gradients too, without a full-size copy),
    /// then the norm of those norms in f64 — one host synchronisation per step, not one per
    /// parameter.
    pub fn grad_norm(&self) -> Result<f64> {
        let mut norms = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let g = p.var.grad();
            if g.defined() {
                // flatten: a view for contiguous gradients; linalg_norm of a 1-D tensor is the L2 norm.
                norms.push(g.f_flatten(0, -1)?.f_linalg_norm(2.0, None::<&[i64]>, false, Kind::Float)?);
                // []
            }
        }
        if norms.is_empty() {
            return Ok(0.0);
        }
        let total = Tensor::f_stack(&norms, 0)?.f_linalg_norm(2.0, None::<&[i64]>, false, Kind::Double)?;
        Ok(total.f_double_value(&[])?)
    }

    /// Clips, steps and advances the schedule — or, when the gradient is not finite, skips the step
    /// and clears the gradients.
    pub fn step(&mut self) -> Result<StepInfo> {
        let grad_norm = self.grad_norm()?;
        let lr = self.current_lr();
        if !grad_norm.is_finite() {
            self.zero_grad()?;
            return Ok(StepInfo { grad_norm, skipped: true, lr });
        }
        let clip = clip_coef(self.max_grad_norm, grad_norm);
        let (betas, eps, wd) = (self.betas, self.eps, self.weight_decay);
        tch::no_grad(|| -> Result<()> {
            // (θ, m, v, g, t) of every parameter with a gradient, updated together.
            let mut items = Vec::with_capacity(self.params.len());
            for p in &mut self.params {
                let g = p.var.grad();
                if !g.defined() {
                    continue;
                }
                // The gradient in the moments' dtype (f32 for a bf16 parameter), then clipped.
                let g = if g.kind() != p.m.kind() { g.f_to_kind(p.m.kind())? } else { g };
                let g = if clip != 1.0 { g.f_mul_scalar(clip)? } else { g };
                p.t += 1;
                // θ: the f32 master when there is one, else the parameter itself.
                let mut theta = p.master.as_ref().unwrap_or(&p.var).shallow_clone();
                if p.decay && wd != 0.0 {
                    let _ = theta.f_mul_(&Tensor::from(1.0 - lr * wd))?;
                }
                items.push((theta, p.m.shallow_clone(), p.v.shallow_clone(), g, p.t));
            }
            // One list per device (the fused kernel takes one device; a model lives on one).
            while let Some(d) = items.first().map(|i| i.0.device()) {
                let (mut same, rest): (Vec<_>, Vec<_>) = items.into_iter().partition(|i| i.0.device() == d);
                adam_update_all(&mut same, lr, betas, eps)?;
                items = rest;
            }
            // Round the updated masters back into the bf16 parameters.
            for p in self.params.iter_mut().filter(|p| p.master.is_some() && p.var.grad().defined()) {
                p.var.f_copy_(p.master.as_ref().expect("filtered"))?;
            }
            Ok(())
        })?;
        self.zero_grad()?;
        self.steps += 1;
        Ok(StepInfo { grad_norm, skipped: false, lr })
    }

    /// The optimizer state as named tensors (`<param>.exp_avg`, `<param>.exp_avg_sq`,
    /// `<param>.step`, and `<param>.master` — the f32 master — for bf16/f16 parameters) for a
    /// checkpoint; `steps` (the schedule position) is kept by the caller. The tensors share storage
    /// with the live state: copy them to keep a snapshot across later steps.
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.params.len() * 3);
        for p in &self.params {
            out.push((format!("{}.exp_avg", p.name), p.m.shallow_clone()));
            out.push((format!("{}.exp_avg_sq", p.name), p.v.shallow_clone()));
            out.push((format!("{}.step", p.name), Tensor::f_from_slice(&[p.t])?));
            if let Some(master) = &p.master {
                out.push((format!("{}.master", p.name), master.shallow_clone()));
            }
        }
        Ok(out)
    }

    /// Restores [`Optim::state_tensors`] and the schedule position; every parameter must be present
    /// with its shape. Moments are cast to this optimizer's dtypes; a bf16/f16 parameter without a
    /// saved master (a checkpoint from before masters existed) takes its master from the
    /// parameter's current value, so restore the weights first. A saved master is also copied
    /// into the parameter, which keeps the two consistent.
    pub fn load_state(&mut self, state: &std::collections::HashMap<String, Tensor>, steps: usize) -> Result<()> {
        let missing = |k: &str| TrainerError::Checkpoint(format!("optimizer state: missing `{k}`"));
        let bad_shape = |name: &str, what: &str, saved: &[i64], model: &[i64]| {
            TrainerError::Checkpoint(format!(
                "optimizer state: `{name}{what}` has shape {saved:?}, the model {model:?}"
            ))
        };
        tch::no_grad(|| -> Result<()> {
            for p in &mut self.params {
                let (km, kv, kt) =
                    (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name), format!("{}.step", p.name));
                let m = state.get(&km).ok_or_else(|| missing(&km))?;
                let v = state.get(&kv).ok_or_else(|| missing(&kv))?;
                let t = state.get(&kt).ok_or_else(|| missing(&kt))?;
                if m.size() != p.m.size() || v.size() != p.v.size() {
                    let saved = if m.size() != p.m.size() { m.size() } else { v.size() };
                    return Err(bad_shape(&p.name, "", &saved, &p.m.size()));
                }
                let t = crate::shard_files::step_count(t, &format!("optimizer state `{kt}`"))?;
                if let Some(master) = &mut p.master {
                    match state.get(&format!("{}.master", p.name)) {
                        Some(saved) if saved.size() != master.size() => {
                            return Err(bad_shape(&p.name, ".master", &saved.size(), &master.size()));
                        }
                        Some(saved) => {
                            master.f_copy_(saved)?;
                            p.var.f_copy_(master)?;
                        }
                        None => {
                            master.f_copy_(&p.var)?;
                        }
                    }
                }
                p.m.f_copy_(m)?;
                p.v.f_copy_(v)?;
                p.t = t;
            }
            Ok(())
        })?;
        self.steps = steps;
        Ok(())
    }
}

/// `ema ← decay·ema + (1 − decay)·src` for every variable of `src` (matched by name).
pub fn ema_update(ema: &nn::VarStore, src: &nn::VarStore, decay: f64) -> Result<()> {
    let targets = ema.variables();
    tch::no_grad(|| -> Result<()> {
        for (name, s) in src.variables() {
            if let Some(e) = targets.get(&name) {
                let mut e = e.shallow_clone();
                let _ = e.f_mul_(&Tensor::from(decay))?;
                let _ = e.f_add_(&s.f_mul_scalar(1.0 - decay)?)?;
            }
        }
        Ok(())
    })
}

/// Seeds libtorch for step `step` (0-based) of a run (RL and the supervised phases): every random
/// draw of a step (sampling, dropout) follows from (seed, step), so a run resumed at step k
/// repeats the uninterrupted run's steps bit for bit on CPU.
pub fn seed_step(seed: u64, step: usize) {
    tch::manual_seed((seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) as i64 & i64::MAX);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        schedule: Schedule,
        warmup_steps: usize,
        max_grad_norm: f64,
    ) -> OptimConfig {
        OptimConfig { lr, betas, eps, weight_decay, schedule, warmup_steps, max_grad_norm }
    }

    #[test]
    fn schedules() {
        assert_eq!(lr_factor(Schedule::Constant, 5, 0, 10), 1.0);
        assert_eq!(lr_factor(Schedule::Linear, 0, 2, 10), 0.5);
        assert_eq!(lr_factor(Schedule::Linear, 1, 2, 10), 1.0);
        assert!((lr_factor(Schedule::Linear, 6, 2, 10) - 0.5).abs() < 1e-12);
        assert!((lr_factor(Schedule::Cosine, 6, 2, 10) - 0.5).abs() < 1e-12);
        assert!(lr_factor(Schedule::Cosine, 10, 2, 10).abs() < 1e-12);
    }

    /// Our AdamW against libtorch's `torch.optim.AdamW` (via tch) on a matrix parameter.
    #[test]
    fn matches_torch_adamw() {
        tch::manual_seed(3);
        let grads: Vec<Tensor> = (0..6).map(|_| Tensor::randn([3, 4], (Kind::Float, tch::Device::Cpu))).collect();
        let init = Tensor::randn([3, 4], (Kind::Float, tch::Device::Cpu));
        let run_ours = || {
            let vs = nn::VarStore::new(tch::Device::Cpu);
            let w = vs.root().var_copy("w", &init);
            let mut opt =
                Optim::new(&vs, &settings(0.01, (0.9, 0.99), 1e-8, 0.1, Schedule::Constant, 0, 0.0), 10).unwrap();
            for g in &grads {
                (&w * g).sum(Kind::Float).backward();
                opt.step().unwrap();
            }
            w
        };
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var_copy("w", &init);
        let mut torch = nn::OptimizerConfig::build(
            nn::AdamW { beta1: 0.9, beta2: 0.99, wd: 0.1, eps: 1e-8, amsgrad: false },
            &vs,
            0.01,
        )
        .unwrap();
        for g in &grads {
            (&w * g).sum(Kind::Float).backward();
            torch.step();
            torch.zero_grad();
        }
        let d = (run_ours() - &w).abs().max().double_value(&[]);
        assert!(d < 1e-6, "max |Δθ| = {d}");
    }

    /// Gradients are dropped after a step (`set_to_none`), and a parameter that then gets none is
    /// left as it is, moments and all, as torch's AdamW leaves a parameter whose `grad` is `None`.
    #[test]
    fn steps_drop_gradients_and_skip_a_parameter_without_one() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let a = vs.root().f_ones("a", &[2]).unwrap();
        let b = vs.root().f_ones("b", &[2]).unwrap();
        let mut opt = Optim::new(&vs, &settings(0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 0.0), 10).unwrap();
        (&a * &b).sum(Kind::Float).backward();
        opt.step().unwrap();
        assert!(!a.grad().defined() && !b.grad().defined(), "gradients dropped after the step");
        let (a1, b1) = (a.copy(), b.copy());
        (&a * 2.0).sum(Kind::Float).backward(); // no gradient for b
        opt.step().unwrap();
        assert!(b.equal(&b1), "b got no gradient and stays");
        assert!(!a.equal(&a1), "a steps");
    }

    #[test]
    fn clips_and_skips_non_finite() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().f_zeros("w", &[2]).unwrap();
        let mut opt = Optim::new(&vs, &settings(0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 1.0), 10).unwrap();
        let loss = (&w * Tensor::from_slice(&[3f32, 4.])).sum(Kind::Float);
        loss.backward();
        let info = opt.step().unwrap();
        assert!((info.grad_norm - 5.0).abs() < 1e-6 && !info.skipped);
        // Over several parameters, 2-D included: ‖(3, 4)‖ and ‖[[12]]‖ → √(9 + 16 + 144) = 13.
        let m = vs.root().f_zeros("m", &[1, 1]).unwrap();
        let mut opt2 =
            Optim::new(&vs, &settings(0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 0.0), 10).unwrap();
        ((&w * Tensor::from_slice(&[3f32, 4.])).sum(Kind::Float) + (&m * 12.0).sum(Kind::Float)).backward();
        assert!((opt2.grad_norm().unwrap() - 13.0).abs() < 1e-6);
        opt2.zero_grad().unwrap();
        let loss = (&w * Tensor::from_slice(&[f32::NAN, 1.])).sum(Kind::Float);
        loss.backward();
        let before = Vec::<f32>::try_from(&w).unwrap();
        let info = opt.step().unwrap();
        assert!(info.skipped);
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), before);
        assert_eq!(opt.steps, 1);
    }

    /// Values and gradients exactly representable in bf16, so a bf16 run and an f32 run start
    /// from the same numbers. Weights sit in [2⁻⁷, 2⁻⁶), where bf16's spacing is 2⁻¹⁴ ≈ 6e-5: an
    /// lr of 1e-6 is far below half of it.
    fn bf16_case() -> (Tensor, Tensor, Vec<Tensor>) {
        tch::manual_seed(11);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let bf16 = |t: Tensor| t.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        let w = bf16(Tensor::rand([3, 4], cpu) * (1.0 / 256.0) + 1.0 / 128.0); // [3, 4]
        let b = bf16(Tensor::rand([4], cpu) * (1.0 / 256.0) + 1.0 / 128.0); // [4]

        // The same signs every step (Adam then moves each weight by about lr a step), varying sizes.
        let sign = Tensor::randn([3, 4], cpu).sign();
        let grads = (0..4).map(|_| bf16(&sign * (Tensor::rand([3, 4], cpu) + 0.5))).collect(); // [3, 4] each
        (w, b, grads)
    }

    /// A var store with `w` [3, 4] and `b` [4] in `kind` and AdamW (lr 1e-6, weight decay) over it.
    fn bf16_setup(w0: &Tensor, b0: &Tensor, kind: Kind) -> (nn::VarStore, Tensor, Tensor, Optim) {
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var_copy("w", w0);
        let b = vs.root().var_copy("b", b0);
        vs.set_kind(kind); // as models load in bf16
        let opt = Optim::new(&vs, &settings(1e-6, (0.9, 0.999), 1e-8, 0.1, Schedule::Constant, 0, 1.0), 1000).unwrap();
        (vs, w, b, opt)
    }

    /// One step with loss Σ w·g + Σ b·gb, gb = colsum(g) rounded to bf16: gradients `g` [3, 4] and
    /// `gb` [4], the same in a bf16 and an f32 run.
    fn bf16_step(w: &Tensor, b: &Tensor, g: &Tensor, opt: &mut Optim) {
        let gb = g.sum_dim_intlist(0, false, Kind::Float).to_kind(Kind::BFloat16); // [4]
        ((w * g.to_kind(w.kind())).sum(Kind::Float) + (b * gb.to_kind(b.kind())).sum(Kind::Float)).backward();
        opt.step().unwrap();
    }

    fn state_of(opt: &Optim) -> std::collections::HashMap<String, Tensor> {
        opt.state_tensors().unwrap().into_iter().map(|(k, t)| (k, t.copy())).collect()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        ((a - b).abs() / b.abs()).max().double_value(&[])
    }

    /// lr 1e-6 on bf16 weights: each update is lost in bf16 but lands in the f32 master, which
    /// follows the f32 run of the same AdamW; after enough steps the bf16 weights move too.
    #[test]
    fn bf16_trains_through_f32_master() {
        let (w0, b0, grads) = bf16_case();
        let (_vs, w, b, mut opt) = bf16_setup(&w0, &b0, Kind::BFloat16);
        let (_vs32, w32, b32, mut opt32) = bf16_setup(&w0, &b0, Kind::Float);
        let state32 = state_of(&opt32);
        assert!(!state32.keys().any(|k| k.ends_with(".master")), "f32 parameters get no master: {state32:?}");
        assert_eq!(state32.len(), 6);
        bf16_step(&w, &b, &grads[0], &mut opt);
        bf16_step(&w32, &b32, &grads[0], &mut opt32);
        let st = state_of(&opt);
        assert_eq!(st["w.master"].kind(), Kind::Float);
        assert_eq!(st["w.exp_avg"].kind(), Kind::Float);
        assert_eq!(st["b.exp_avg_sq"].kind(), Kind::Float);
        // One step: the master moved by about lr, the bf16 weight not at all.
        let moved = (&st["w.master"] - &w0).abs().min().double_value(&[]);
        assert!(moved > 5e-7 && moved < 2e-6, "master moved by {moved}");
        assert!(w.to_kind(Kind::Float).equal(&w0), "a 1e-6 update is below bf16 resolution");
        assert!(max_rel(&st["w.master"], &w32) < 1e-6 && max_rel(&st["b.master"], &b32) < 1e-6);
        for i in 1..200 {
            bf16_step(&w, &b, &grads[i % grads.len()], &mut opt);
            bf16_step(&w32, &b32, &grads[i % grads.len()], &mut opt32);
        }
        let st = state_of(&opt);
        let (rw, rb) = (max_rel(&st["w.master"], &w32), max_rel(&st["b.master"], &b32));
        assert!(rw < 1e-6 && rb < 1e-6, "master vs f32 run: relative {rw}, {rb}");
        // The bf16 weights are the masters rounded, and ~2e-4 of movement shows in all of them.
        assert!(w.equal(&st["w.master"].to_kind(Kind::BFloat16)) && b.equal(&st["b.master"].to_kind(Kind::BFloat16)));
        let unmoved = w.to_kind(Kind::Float).eq_tensor(&w0).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(unmoved, 0, "bf16 weights that never moved");
        assert!(max_rel(&w.to_kind(Kind::Float), &w32) < 1e-2);
    }

    /// The grad norm of bf16 gradients is computed and returned in f32: √3000 = 54.772…, which
    /// bf16 (spacing 0.25 there) would round to 54.75.
    #[test]
    fn bf16_grad_norm_in_f32() {
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().f_zeros("w", &[3, 1000]).unwrap();
        vs.set_kind(Kind::BFloat16);
        let opt = Optim::new(&vs, &settings(1e-6, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 1.0), 10).unwrap();
        w.sum(Kind::Float).backward();
        assert_eq!(w.grad().kind(), Kind::BFloat16);
        let norm = opt.grad_norm().unwrap();
        assert!((norm - 3000f64.sqrt()).abs() < 1e-4, "grad norm {norm}");
    }

    /// Save the bf16 state mid-run (weights and optimizer), load it into a fresh optimizer, go on:
    /// bit-identical to the uninterrupted run, masters included.
    #[test]
    fn bf16_state_round_trip() {
        let (w0, b0, grads) = bf16_case();
        let (_vs, w, b, mut opt) = bf16_setup(&w0, &b0, Kind::BFloat16);
        for g in &grads[..2] {
            bf16_step(&w, &b, g, &mut opt);
        }
        let saved = state_of(&opt);
        let (saved_w, saved_b) = (w.copy(), b.copy());
        for g in &grads[2..] {
            bf16_step(&w, &b, g, &mut opt);
        }
        // Through safetensors, as a checkpoint stores it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        Tensor::write_safetensors(&saved.iter().map(|(k, t)| (k.as_str(), t)).collect::<Vec<_>>(), &path).unwrap();
        let loaded: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(&path).unwrap().into_iter().collect();
        let (_vs2, w2, b2, mut opt2) =
            bf16_setup(&saved_w.to_kind(Kind::Float), &saved_b.to_kind(Kind::Float), Kind::BFloat16);
        opt2.load_state(&loaded, 2).unwrap();
        assert_eq!(opt2.steps, 2);
        for g in &grads[2..] {
            bf16_step(&w2, &b2, g, &mut opt2);
        }
        assert!(w2.equal(&w) && b2.equal(&b), "bf16 weights differ from the uninterrupted run");
        let (a, z) = (state_of(&opt), state_of(&opt2));
        assert_eq!(a.len(), z.len());
        for (k, t) in &a {
            assert!(t.equal(&z[k]), "`{k}` differs from the uninterrupted run");
        }
        // A state without masters (written before they existed) starts them from the weights.
        let mut old: std::collections::HashMap<String, Tensor> =
            saved.iter().filter(|(k, _)| !k.ends_with(".master")).map(|(k, t)| (k.clone(), t.copy())).collect();
        old.insert("w.exp_avg".into(), saved["w.exp_avg"].to_kind(Kind::BFloat16));
        let (_vs3, _w3, _b3, mut opt3) =
            bf16_setup(&saved_w.to_kind(Kind::Float), &saved_b.to_kind(Kind::Float), Kind::BFloat16);
        opt3.load_state(&old, 2).unwrap();
        assert!(state_of(&opt3)["w.master"].equal(&saved_w.to_kind(Kind::Float)));
        // A master of the wrong shape is refused.
        let mut wrong: std::collections::HashMap<String, Tensor> =
            saved.iter().map(|(k, t)| (k.clone(), t.copy())).collect();
        wrong.insert("w.master".into(), Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)));
        let e = opt3.load_state(&wrong, 2).unwrap_err().to_string();
        assert!(e.contains("w.master"), "{e}");
    }
}
