//! Counting the ATen operators a closure dispatches on this thread, through a thread-local
//! `RecordFunction` callback (the hook `torch.profiler` records with): every operator, nested
//! ones too (`linear` and the `addmm` it calls, the views a kernel takes), and apart the
//! operators the closure dispatched itself — what the host issues one by one, the measure of a
//! piece of model code's launches that does not depend on how a device implements an operator.

use std::ffi::c_char;

use crate::{one_line, take_string, AtenError, Result};

extern "C" {
    fn rlhf_aten_free_string(s: *mut c_char);
    fn rlhf_aten_count_start(err: *mut *mut c_char) -> i32;
    fn rlhf_aten_count_stop(all: *mut *mut c_char, outer: *mut *mut c_char) -> i64;
}

/// The operators a closure dispatched, in order (`aten::mm`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpCount {
    /// Every operator, nested ones included.
    pub names: Vec<String>,
    /// The operators the closure dispatched itself (not from inside another operator).
    pub outer: Vec<String>,
}

impl OpCount {
    /// How many operators were dispatched, nested ones included.
    pub fn total(&self) -> usize {
        self.names.len()
    }
}

/// Runs `f` and counts the ATen operators it dispatches on this thread.
pub fn count<T>(f: impl FnOnce() -> T) -> Result<(T, OpCount)> {
    let mut err = std::ptr::null_mut();
    // SAFETY: plain C call; `err` is written on failure only.
    if unsafe { rlhf_aten_count_start(&mut err) } != 0 {
        // SAFETY: written by the callee.
        return Err(AtenError::Torch(one_line(&unsafe { take_string(err, rlhf_aten_free_string) })));
    }
    let value = f();
    let (mut all, mut outer) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: stops the count started above; both receive a malloc'd list.
    unsafe { rlhf_aten_count_stop(&mut all, &mut outer) };
    // SAFETY: written by the callee.
    let (all, outer) = unsafe { (take_string(all, rlhf_aten_free_string), take_string(outer, rlhf_aten_free_string)) };
    let lines = |s: &str| s.lines().map(str::to_owned).collect();
    Ok((value, OpCount { names: lines(&all), outer: lines(&outer) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn counts_what_a_closure_dispatches() {
        let a = Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu));
        let (_, none) = count(|| 1 + 1).unwrap();
        assert_eq!(none.total(), 0);
        let (y, ops) = count(|| a.matmul(&a).relu()).unwrap();
        assert!(ops.names.iter().any(|n| n == "aten::relu"), "{:?}", ops.names);
        assert!(ops.names.iter().any(|n| n.contains("mm")), "{:?}", ops.names);
        // `matmul` dispatches `mm` from inside itself: two operators of the closure's own.
        assert_eq!(ops.outer, ["aten::matmul", "aten::relu"]);
        assert_eq!(y.double_value(&[0, 0]), 4.0);
        // Nothing is counted once the closure returned.
        let (_, again) = count(|| a.relu()).unwrap();
        assert!(again.total() < ops.total());
    }
}
