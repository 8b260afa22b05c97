//! NCCL for CUDA tensors. `ProcessGroupNCCL` lives in `libtorch_cuda.so`, which a CPU-only run
//! must not need, so it is reached through a small separate library (`nccl.cpp`, built when the
//! libtorch install has CUDA and NCCL headers) that is loaded the first time a collective sees
//! a CUDA tensor. `RLHF_NCCL_LIB` overrides where it is looked for.

use std::ffi::{c_char, c_int, c_void, CStr};
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

/// An NCCL group for this rank's CUDA device (`LOCAL_RANK` picks it, as torchrun expects).
pub(crate) fn group(store: &ffi::Store, rank: usize, size: usize, timeout_ms: i64) -> Result<ffi::Group> {
    let lib = library()?;
    // SAFETY: the symbol has the `NewBackend` signature (see nccl.cpp).
    let new: libloading::Symbol<'_, NewBackend> = unsafe { lib.get(b"rlhf_nccl_backend_new\0") }
        .map_err(|e| CollectiveError::Nccl(format!("rlhf_nccl_backend_new: {e}")))?;
    let device = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse::<c_int>().ok()).unwrap_or(0);
    let (mut out, mut err): (*mut c_void, *mut c_char) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid store pointer; out/err are written by the callee.
    let rc = unsafe { new(store.raw(), rank as c_int, size as c_int, device, timeout_ms, &mut out, &mut err) };
    if rc != 0 {
        let msg = if err.is_null() {
            "failed (no message)".to_string()
        } else {
            // SAFETY: malloc'd NUL-terminated string from the shim.
            let m = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
            unsafe { libc_free(err) };
            m
        };
        return Err(CollectiveError::Nccl(crate::error::one_line(&msg)));
    }
    // SAFETY: `out` is an `intrusive_ptr<Backend>*`; the group takes ownership.
    Ok(ffi::Group::from_raw(unsafe { ffi::rlhf_c10d_group_from_backend(store.raw(), out, timeout_ms) }))
}

extern "C" {
    #[link_name = "free"]
    fn libc_free(p: *mut c_char);
}
