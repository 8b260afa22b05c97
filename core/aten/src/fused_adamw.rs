//! libtorch's fused AdamW (`torch.optim.AdamW(fused=True)`, `at::_fused_adamw_`): one kernel for
//! a whole list of parameters on CUDA, one fused loop per parameter on the CPU, instead of the
//! dozen elementwise operations per parameter of the written-out update.
//!
//! The update (Loshchilov & Hutter 2019, PyTorch's `_fused_adamw`): with step count `t`,
//! `θ ← θ(1 − lr·λ)`, `m ← β₁m + (1 − β₁)g`, `v ← β₂v + (1 − β₂)g²`,
//! `θ ← θ − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)`.

use std::ffi::{c_char, c_void};

use tch::Tensor;

use crate::{one_line, take_string, AtenError, Result};

extern "C" {
    fn rlhf_aten_free_string(s: *mut c_char);
    #[allow(clippy::too_many_arguments)]
    fn rlhf_aten_fused_adamw(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        steps: *const *mut c_void,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut *mut c_char,
    ) -> i32;
}

/// The hyper-parameters of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One AdamW step, in place, over parameters with their gradients, moments and step counts
/// (f32 scalars on the parameters' device, incremented by this call). Every list has the same
/// length; each parameter's tensors share its shape, dtype and device.
pub fn step(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    steps: &[Tensor],
    h: AdamW,
) -> Result<()> {
    let n = params.len();
    if [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().any(|&l| l != n) {
        return Err(AtenError::Input(format!(
            "fused AdamW: {n} parameters but {} gradients, {} and {} moments, {} step counts",
            grads.len(),
            exp_avgs.len(),
            exp_avg_sqs.len(),
            steps.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let ptrs = |ts: &[Tensor]| ts.iter().map(|t| t.as_ptr() as *mut c_void).collect::<Vec<_>>();
    let (p, g, m, v, s) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs), ptrs(steps));
    let mut err = std::ptr::null_mut();
    // SAFETY: every pointer is a live `at::Tensor*` owned by the slices above, which outlive the call.
    let rc = unsafe {
        rlhf_aten_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n as i64,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            &mut err,
        )
    };
    if rc != 0 {
        // SAFETY: written by the callee.
        return Err(AtenError::Torch(one_line(&unsafe { take_string(err, rlhf_aten_free_string) })));
    }
    Ok(())
}
