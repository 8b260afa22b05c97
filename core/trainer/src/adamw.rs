//! The element-wise arithmetic of one AdamW step (Loshchilov & Hutter 2019, decoupled weight
//! decay), shared by the replicated optimizer ([`crate::optim::Optim`]) and the sharded one
//! ([`crate::train_engine::sharded`]) so both run the very same operations.

use tch::Tensor;

use crate::error::Result;

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
