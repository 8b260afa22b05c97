//! The arithmetic of one AdamW step (Loshchilov & Hutter 2019, decoupled weight decay), shared by
//! the replicated optimizer ([`crate::optim::Optim`]) and the sharded one
//! ([`crate::train_engine::sharded`]) so both run the very same operations: element by element
//! ([`adam_update`]), or on CUDA through libtorch's fused multi-tensor kernel
//! ([`adam_update_all`]: `torch.optim.AdamW(fused=True)`, one launch for every parameter instead
//! of about ten per parameter; the same formula, its own rounding order).

use tch::Tensor;

use crate::error::{Result, TrainerError};

/// `clip_grad_norm_`'s coefficient: `max / (norm + 1e-6)` when the norm exceeds `max > 0`, else 1.
pub fn clip_coef(max_grad_norm: f64, grad_norm: f64) -> f64 {
    if max_grad_norm > 0.0 && grad_norm > max_grad_norm {
        max_grad_norm / (grad_norm + 1e-6)
    } else {
        1.0
    }
}

/// AdamW's moment update and step of `theta` (decoupled weight decay is the caller's), element
/// by element, at update `t` (1-based), shared by both optimizers so that both
/// run the very same operations:
/// `m ← β1 m + (1 − β1) g;  v ← β2 v + (1 − β2) g²;  θ ← θ − lr/bc1 · m / (√v / √bc2 + ε)`
/// with `bc_i = 1 − β_i^t`.
///
/// # Shapes
/// `theta`, `m`, `v`, `g`: one shape; `m`, `v`, `g` of one dtype.
#[allow(clippy::too_many_arguments)]
pub fn adam_update(
    theta: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    g: &Tensor,
    lr: f64,
    (b1, b2): (f64, f64),
    eps: f64,
    t: i64,
) -> Result<()> {
    let _ = m.f_lerp_(g, 1.0 - b1)?;
    let _ = v.f_mul_(&Tensor::from(b2))?.f_addcmul_(g, &g.f_mul_scalar(1.0 - b2)?)?;
    let (bc1, bc2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
    let denom = v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
    let _ = theta.f_addcdiv_(&m.f_mul_scalar(-lr / bc1)?, &denom)?;
    Ok(())
}

/// One Adam update of tensors that share a device, as a list: `(θ, m, v, g, t)` per tensor, with
/// [`adam_update`]'s formula (decay is the caller's, before). On CUDA, libtorch's fused kernel
/// updates the whole list in one launch (`at::_fused_adamw_`); elsewhere each goes through
/// [`adam_update`] (libtorch's fused CPU kernel measured slower than the element-wise ops on
/// small parameters).
///
/// # Shapes
/// each tuple as [`adam_update`]'s arguments; every `θ, m, v, g` of one dtype on CUDA.
pub fn adam_update_all(
    items: &mut [(Tensor, Tensor, Tensor, Tensor, i64)],
    lr: f64,
    (b1, b2): (f64, f64),
    eps: f64,
) -> Result<()> {
    let Some(first) = items.first() else { return Ok(()) };
    let device = first.0.device();
    let fused = device.is_cuda()
        && items.iter().all(|(th, m, v, g, _)| {
            let k = th.kind();
            m.kind() == k && v.kind() == k && g.kind() == k && th.device() == device
        });
    if !fused {
        for (theta, m, v, g, t) in items.iter_mut() {
            adam_update(theta, m, v, g, lr, (b1, b2), eps, *t)?;
        }
        return Ok(());
    }
    let take = |f: fn(&(Tensor, Tensor, Tensor, Tensor, i64)) -> &Tensor| {
        items.iter().map(|i| f(i).shallow_clone()).collect::<Vec<_>>()
    };
    let (thetas, ms, vs, gs) = (take(|i| &i.0), take(|i| &i.1), take(|i| &i.2), take(|i| &i.3));
    let steps = items
        .iter()
        .map(|i| Tensor::f_full([], i.4 as f64, (tch::Kind::Float, device)))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let h = rlhf_aten::fused_adamw::AdamW { lr, beta1: b1, beta2: b2, weight_decay: 0.0, eps };
    rlhf_aten::fused_adamw::step(&thetas, &gs, &ms, &vs, &steps, h)
        .map_err(|e| TrainerError::Run(format!("fused AdamW: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// libtorch's fused AdamW (its CPU kernel here; the CUDA one runs the same formula) takes
    /// the element-wise update's steps to within a few f32 roundings over ten steps, with bias
    /// correction and per-tensor step counts.
    #[test]
    fn fused_kernel_equals_the_element_wise_update() {
        tch::manual_seed(0);
        let shapes: [&[i64]; 3] = [&[64, 32], &[100], &[3, 5, 7]];
        let init: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect();
        let grads: Vec<Vec<Tensor>> =
            (0..10).map(|_| shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu))).collect()).collect();
        let (lr, betas, eps) = (1e-3, (0.9, 0.95), 1e-8);
        let mut a: Vec<(Tensor, Tensor, Tensor)> =
            init.iter().map(|p| (p.copy(), p.zeros_like(), p.zeros_like())).collect();
        let b: Vec<(Tensor, Tensor, Tensor)> =
            init.iter().map(|p| (p.copy(), p.zeros_like(), p.zeros_like())).collect();
        for (step, gs) in grads.iter().enumerate() {
            for ((th, m, v), g) in a.iter_mut().zip(gs) {
                adam_update(th, m, v, g, lr, betas, eps, step as i64 + 1).unwrap();
            }
            let steps: Vec<Tensor> = b.iter().map(|_| Tensor::from((step + 1) as f32)).collect();
            let col = |f: fn(&(Tensor, Tensor, Tensor)) -> &Tensor| {
                b.iter().map(|x| f(x).shallow_clone()).collect::<Vec<_>>()
            };
            let h = rlhf_aten::fused_adamw::AdamW { lr, beta1: betas.0, beta2: betas.1, weight_decay: 0.0, eps };
            rlhf_aten::fused_adamw::step(&col(|x| &x.0), gs, &col(|x| &x.1), &col(|x| &x.2), &steps, h).unwrap();
        }
        for (((pa, ma, va), (pb, mb, vb)), p0) in a.iter().zip(&b).zip(&init) {
            let rel = |x: &Tensor, y: &Tensor| {
                (x - y).abs().max().double_value(&[]) / y.abs().max().double_value(&[]).max(1e-30)
            };
            // Parameters move by ~1e-2 over ten steps of lr 1e-3; f32 rounding of the two orders.
            assert!(rel(pa, pb) < 1e-6, "θ {}", rel(pa, pb));
            assert!(rel(ma, mb) < 1e-6 && rel(va, vb) < 1e-6, "moments {} {}", rel(ma, mb), rel(va, vb));
            assert!((pa - p0).abs().max().double_value(&[]) > 1e-3, "the parameters moved");
        }
    }
}
