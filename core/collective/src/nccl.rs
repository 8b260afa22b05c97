//! NCCL for CUDA tensors. `ProcessGroupNCCL` lives in `libtorch_cuda.so`, which a CPU-only run
//! must not need, so it is reached through a small separate library (`nccl.cpp`, built when the
//! libtorch install has CUDA and NCCL headers) that is loaded the first time a collective sees
//! a CUDA tensor. `RLHF_NCCL_LIB` overrides where it is looked for.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{CollectiveError, Result};
use crate::ffi;

/// Where the build put the NCCL library (absent when libtorch had no CUDA/NCCL headers).
const BUILT: Option<&str> = option_env!("RLHF_NCCL_LIB_BUILT");

type NewBackend = unsafe extern "C" fn(
    store: *mut c_void,
    rank: c_int,
    size: c_int,
    device: c_int,
    timeout_ms: i64,
    out: *mut *mut c_void,
    err: *mut *mut c_char,
) -> c_int;

fn library() -> Result<&'static libloading::Library> {
    static LIB: OnceLock<std::result::Result<libloading::Library, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = std::env::var_os("RLHF_NCCL_LIB")
            .map(PathBuf::from)
            .or_else(|| BUILT.map(PathBuf::from))
            .ok_or_else(|| {
                "this build has no NCCL library (libtorch without CUDA or NCCL headers); CUDA tensors cannot be reduced"
                    .to_string()
            })?;
        // SAFETY: loading our own shim, whose initialisers only register nothing global.
        unsafe { libloading::Library::new(&path) }.map_err(|e| {
            format!(
                "{}: cannot load ({e}); it needs libtorch_cuda.so and libnccl.so.2 from the CUDA torch wheel",
                path.display()
            )
        })
    })
    .as_ref()
    .map_err(|m| CollectiveError::Nccl(m.clone()))
}

/// Loads the NCCL library and resolves its entry point (what the first CUDA collective does),
/// without making a group. Returns the library's path.
pub fn check_library() -> Result<std::path::PathBuf> {
    let lib = library()?;
    // SAFETY: only resolves the symbol.
    unsafe { lib.get::<NewBackend>(b"rlhf_nccl_backend_new\0") }
        .map_err(|e| CollectiveError::Nccl(format!("rlhf_nccl_backend_new: {e}")))?;
    Ok(std::env::var_os("RLHF_NCCL_LIB")
        .map(std::path::PathBuf::from)
        .or_else(|| BUILT.map(std::path::PathBuf::from))
        .unwrap_or_default())
}

/// Whether this build compiled the NCCL library.
pub fn built() -> bool {
    BUILT.is_some()
}

/// An NCCL group bound to CUDA device `device` (the device of the first tensor reduced: each
/// rank's own, `cuda:LOCAL_RANK` with torchrun's convention, or `cuda:0` when every rank sees
/// one GPU).
pub(crate) fn group(
    store: &ffi::Store,
    rank: usize,
    size: usize,
    device: usize,
    timeout_ms: i64,
) -> Result<ffi::Group> {
    let lib = library()?;
    // SAFETY: the symbol has the `NewBackend` signature (see nccl.cpp).
    let new: libloading::Symbol<'_, NewBackend> = unsafe { lib.get(b"rlhf_nccl_backend_new\0") }
        .map_err(|e| CollectiveError::Nccl(format!("rlhf_nccl_backend_new: {e}")))?;
    let device = device as c_int;
    let (mut out, mut err): (*mut c_void, *mut c_char) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid store pointer; out/err are written by the callee.
    let rc = unsafe { new(store.raw(), rank as c_int, size as c_int, device, timeout_ms, &mut out, &mut err) };
    if rc != 0 {
        return Err(CollectiveError::Nccl(crate::error::one_line(&ffi::take_string(err))));
    }
    // SAFETY: `out` is an `intrusive_ptr<Backend>*`; the group takes ownership.
    Ok(ffi::Group::from_raw(unsafe { ffi::rlhf_c10d_group_from_backend(store.raw(), out, timeout_ms) }))
}
