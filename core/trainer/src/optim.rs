//! AdamW with warm-up + constant/linear/cosine schedules, gradient-norm clipping, skipping of
//! non-finite steps, and the EMA copy of the actor.

use tch::{nn, nn::OptimizerConfig, Kind, Tensor};

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

/// An AdamW optimizer over one var store, with its schedule.
pub struct Optim {
    opt: nn::Optimizer,
    vars: Vec<Tensor>,
    base_lr: f64,
    schedule: Schedule,
    warmup: usize,
    total: usize,
    max_grad_norm: f64,
    /// Optimizer steps taken (not counting skipped ones).
    pub steps: usize,
}

impl Optim {
    /// Builds AdamW over the trainable variables of `vs`.
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
        let cfg = nn::AdamW { beta1: betas.0, beta2: betas.1, wd: weight_decay, eps, amsgrad: false };
        let opt = cfg.build(vs, lr)?;
        let mut o = Optim {
            opt,
            vars: vs.trainable_variables(),
            base_lr: lr,
            schedule,
            warmup,
            total,
            max_grad_norm,
            steps: 0,
        };
        o.opt.set_lr(o.current_lr());
        Ok(o)
    }

    /// The learning rate of the next step.
    pub fn current_lr(&self) -> f64 {
        self.base_lr * lr_factor(self.schedule, self.steps, self.warmup, self.total)
    }

    /// Clears gradients.
    pub fn zero_grad(&mut self) {
        self.opt.zero_grad();
    }

    /// L2 norm of all gradients (0 when none exist yet).
    pub fn grad_norm(&self) -> Result<f64> {
        let mut sq = 0f64;
        for v in &self.vars {
            let g = v.grad();
            if g.defined() {
                sq += g.f_to_kind(Kind::Double)?.f_pow_tensor_scalar(2)?.f_sum(Kind::Double)?.double_value(&[]);
            }
        }
        Ok(sq.sqrt())
    }

    /// Clips, steps and advances the schedule — or, when the gradient is not finite, skips the step
    /// and clears the gradients.
    pub fn step(&mut self) -> Result<StepInfo> {
        let grad_norm = self.grad_norm()?;
        let lr = self.current_lr();
        if !grad_norm.is_finite() {
            self.opt.zero_grad();
            return Ok(StepInfo { grad_norm, skipped: true, lr });
        }
        if self.max_grad_norm > 0.0 && grad_norm > self.max_grad_norm {
            let scale = self.max_grad_norm / (grad_norm + 1e-6);
            tch::no_grad(|| -> Result<()> {
                for v in &self.vars {
                    let mut g = v.grad();
                    if g.defined() {
                        let _ = g.f_mul_(&Tensor::from(scale))?;
                    }
                }
                Ok(())
            })?;
        }
        self.opt.set_lr(lr);
        self.opt.step();
        self.opt.zero_grad();
        self.steps += 1;
        self.opt.set_lr(self.current_lr());
        Ok(StepInfo { grad_norm, skipped: false, lr })
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

    #[test]
    fn clips_and_skips_non_finite() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().f_zeros("w", &[2]).unwrap();
        let mut opt = Optim::new(&vs, 0.1, (0.9, 0.999), 1e-8, 0.0, Schedule::Constant, 0, 10, 1.0).unwrap();
        let loss = (&w * Tensor::from_slice(&[3f32, 4.])).sum(Kind::Float);
        loss.backward();
        let info = opt.step().unwrap();
        assert!((info.grad_norm - 5.0).abs() < 1e-6 && !info.skipped);
        let loss = (&w * Tensor::from_slice(&[f32::NAN, 1.])).sum(Kind::Float);
        loss.backward();
        let before = Vec::<f32>::try_from(&w).unwrap();
        let info = opt.step().unwrap();
        assert!(info.skipped);
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), before);
        assert_eq!(opt.steps, 1);
    }
}
