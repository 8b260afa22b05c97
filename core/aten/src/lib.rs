//! libtorch entry points that tch does not bind, behind safe Rust:
//!
//! - [`op_count`]: how many ATen operators a closure dispatches, and which (a kernel-count budget
//!   that a test can hold on any device);
//! - [`fused_adamw`]: libtorch's fused AdamW step (`torch.optim.AdamW(fused=True)`);
//! - [`profile`]: libtorch's Kineto profiler (`torch.profiler`): a Chrome trace and the time per
//!   operator and per kernel;
//! - [`cuda_graph`]: capturing and replaying CUDA graphs (`at::cuda::CUDAGraph`), from a library
//!   loaded at run time so a CPU-only run never needs `libtorch_cuda.so`.

pub mod cuda_graph;
pub mod fused_adamw;
pub mod op_count;
pub mod profile;

use std::ffi::{c_char, CStr};

/// Errors of these entry points: libtorch's message, one line.
#[derive(Debug, thiserror::Error)]
pub enum AtenError {
    #[error("{0}")]
    Torch(String),
    #[error("{0}")]
    Input(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, AtenError>;

/// The first non-empty line of a C++ message (libtorch appends context and backtraces).
pub(crate) fn one_line(message: &str) -> String {
    message.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("(no message)").to_string()
}

/// Takes a malloc'd message from the C side (null: no message) and frees it with `free`.
///
/// # Safety
/// `s` is null or a string allocated by the C side's `dup`, not yet freed.
pub(crate) unsafe fn take_string(s: *mut c_char, free: unsafe extern "C" fn(*mut c_char)) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string from `dup`.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    // SAFETY: allocated by `dup` with malloc.
    unsafe { free(s) };
    text
}
