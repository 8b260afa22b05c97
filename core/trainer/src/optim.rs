//! AdamW with warm-up + constant/linear/cosine schedules, gradient-norm clipping, skipping of
//! non-finite steps, and the EMA copy of the actor.

use tch::{nn, Kind, Tensor};

use crate::config::Schedule;
use crate::error::Result;

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
    /// First moment (`exp_avg`), same shape and dtype as the parameter.
    m: Tensor,
    /// Second moment (`exp_avg_sq`).
    v: Tensor,
    /// Updates this parameter received (torch keeps a per-parameter step for bias correction).
    t: i64,
    decay: bool,
}

/// AdamW (torch.optim.AdamW's update, decoupled weight decay) over the trainable variables of one
/// var store, with its schedule. Written here rather than taken from libtorch so its state can be
/// checkpointed and restored bit-exactly. Weight decay skips 1-D parameters (biases and norm
/// weights), as Hugging Face's Trainer does.
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
    /// LoRA adapters and heads after `apply_lora`), in name order.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        vs: &nn::VarStore,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        schedule: Schedule,
        warmup: usize,
        total: usize,
        max_grad_norm: f64,
    ) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut params = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let m = var.f_zeros_like()?;
            let v = var.f_zeros_like()?;
            let decay = var.dim() >= 2;
            params.push(ParamState { name, var, m, v, t: 0, decay });
        }
        Ok(Optim { params, betas, eps, weight_decay, base_lr: lr, schedule, warmup, total, max_grad_norm, steps: 0 })
    }

    /// The learning rate of the next step.
    pub fn current_lr(&self) -> f64 {
        self.base_lr * lr_factor(self.schedule, self.steps, self.warmup, self.total)
    }

    /// Clears gradients.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            let mut g = p.var.grad();
            if g.defined() {
                let _ = g.detach_();
                let _ = g.zero_();
            }
        }
    }

    /// L2 norm of all gradients (0 when none exist yet), as `clip_grad_norm_` computes it: each
    /// parameter's norm on its device (accumulated in f32 without a full-size copy), then the norm
    /// of those norms — one host synchronisation per step, not one per parameter.
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
            self.zero_grad();
            return Ok(StepInfo { grad_norm, skipped: true, lr });
        }
        let clip = if self.max_grad_norm > 0.0 && grad_norm > self.max_grad_norm {
            self.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        let (b1, b2) = self.betas;
        let (eps, wd) = (self.eps, self.weight_decay);
        tch::no_grad(|| -> Result<()> {
            for p in &mut self.params {
                let g = p.var.grad();
                if !g.defined() {
                    continue;
                }
                let g = if clip != 1.0 { g.f_mul_scalar(clip)? } else { g };
                p.t += 1;
                if p.decay && wd != 0.0 {
                    let _ = p.var.f_mul_(&Tensor::from(1.0 - lr * wd))?;
                }
                // m ← β1 m + (1 − β1) g;  v ← β2 v + (1 − β2) g²
                let _ = p.m.f_lerp_(&g, 1.0 - b1)?;
                let _ = p.v.f_mul_(&Tensor::from(b2))?.f_addcmul_(&g, &g.f_mul_scalar(1.0 - b2)?)?;
                let bc1 = 1.0 - b1.powi(p.t as i32);
                let bc2 = 1.0 - b2.powi(p.t as i32);
                // θ ← θ − lr/bc1 · m / (√v / √bc2 + ε)
                let denom = p.v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
                let _ = p.var.f_addcdiv_(&p.m.f_mul_scalar(-lr / bc1)?, &denom)?;
            }
            Ok(())
        })?;
        self.zero_grad();
        self.steps += 1;
        Ok(StepInfo { grad_norm, skipped: false, lr })
    }

    /// The optimizer state as named tensors (`<param>.exp_avg`, `<param>.exp_avg_sq`,
    /// `<param>.step`) for a checkpoint; `steps` (the schedule position) is kept by the caller.
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.params.len() * 3);
        for p in &self.params {
            out.push((format!("{}.exp_avg", p.name), p.m.shallow_clone()));
            out.push((format!("{}.exp_avg_sq", p.name), p.v.shallow_clone()));
            out.push((format!("{}.step", p.name), Tensor::f_from_slice(&[p.t])?));
        }
        Ok(out)
    }

    /// Restores [`Optim::state_tensors`] and the schedule position; every parameter must be present
    /// with its shape.
    pub fn load_state(&mut self, state: &std::collections::HashMap<String, Tensor>, steps: usize) -> Result<()> {
        let missing = |k: &str| crate::error::TrainerError::Checkpoint(format!("optimizer state: missing `{k}`"));
        tch::no_grad(|| -> Result<()> {
            for p in &mut self.params {
                let (km, kv, kt) =
                    (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name), format!("{}.step", p.name));
                let m = state.get(&km).ok_or_else(|| missing(&km))?;
                let v = state.get(&kv).ok_or_else(|| missing(&kv))?;
                let t = state.get(&kt).ok_or_else(|| missing(&kt))?;
                if m.size() != p.m.size() || v.size() != p.v.size() {
                    return Err(crate::error::TrainerError::Checkpoint(format!(
                        "optimizer state: `{}` has shape {:?}, the model {:?}",
                        p.name,
                        m.size(),
                        p.m.size()
                    )));
                }
                p.m.f_copy_(m)?;
                p.v.f_copy_(v)?;
                p.t = t.int64_value(&[0]);
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

#[cfg(test)]
mod tests {
    use super::*;

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
            let mut opt = Optim::new(&vs, 0.01, (0.9, 0.99), 1e-8, 0.1, Schedule::Constant, 0, 10, 0.0).unwrap();
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

    #[test]
    fn clips_and_skips_non_finite() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().f_zeros("w", &[2]).unwrap();
        let mut opt = Optim::new(&vs, 0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 10, 1.0).unwrap();
        let loss = (&w * Tensor::from_slice(&[3f32, 4.])).sum(Kind::Float);
        loss.backward();
        let info = opt.step().unwrap();
        assert!((info.grad_norm - 5.0).abs() < 1e-6 && !info.skipped);
        // Over several parameters, 2-D included: ‖(3, 4)‖ and ‖[[12]]‖ → √(9 + 16 + 144) = 13.
        let m = vs.root().f_zeros("m", &[1, 1]).unwrap();
        let mut opt2 = Optim::new(&vs, 0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 10, 0.0).unwrap();
        ((&w * Tensor::from_slice(&[3f32, 4.])).sum(Kind::Float) + (&m * 12.0).sum(Kind::Float)).backward();
        assert!((opt2.grad_norm().unwrap() - 13.0).abs() < 1e-6);
        opt2.zero_grad();
        let loss = (&w * Tensor::from_slice(&[f32::NAN, 1.])).sum(Kind::Float);
        loss.backward();
        let before = Vec::<f32>::try_from(&w).unwrap();
        let info = opt.step().unwrap();
        assert!(info.skipped);
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), before);
        assert_eq!(opt.steps, 1);
    }
}
