//! CUDA graphs: record the kernels a closure launches on the GPU once, then launch them all again
//! with one call (`at::cuda::CUDAGraph`; PyTorch's `torch.cuda.graph`). The C++ side lives in a
//! library of its own (`cuda_graph.cpp`, built when libtorch has CUDA) that is loaded the first
//! time a graph is asked for, so a CPU-only run never needs `libtorch_cuda.so`;
//! `RLHF_CUDA_GRAPH_LIB` overrides where it is looked for (a bundle sets it to the copy next to
//! the binary).
//!
//! Usage: [`SideStream::enter`] (capture needs a stream other than the default one), run the
//! work once eagerly there as a warm-up, [`Graph::capture`] it, [`SideStream::exit`], then
//! [`Graph::replay`] on the default stream as often as needed. A captured closure must not read
//! values back to the host or allocate tensors it keeps; the tensors it reads and writes must stay
//! alive (and in place) for as long as the graph is replayed.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::{one_line, take_string};

/// Where the build put the library (absent when libtorch had no CUDA headers).
const BUILT: Option<&str> = option_env!("RLHF_CUDA_GRAPH_LIB_BUILT");

/// Why a graph could not be made or run: one line.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

type Result<T> = std::result::Result<T, Error>;

type FreeString = unsafe extern "C" fn(*mut c_char);
type PoolFn = unsafe extern "C" fn(*mut u64, *mut u64, *mut *mut c_char) -> c_int;
type EnterFn = unsafe extern "C" fn(c_int, *mut *mut c_char) -> c_int;
type ExitFn = unsafe extern "C" fn(*mut *mut c_char) -> c_int;
type BeginFn = unsafe extern "C" fn(u64, u64, *mut *mut c_void, *mut *mut c_char) -> c_int;
type GraphFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void);

/// The library's entry points.
struct Api {
    _lib: libloading::Library,
    free_string: FreeString,
    pool: PoolFn,
    enter: EnterFn,
    exit: ExitFn,
    begin: BeginFn,
    end: GraphFn,
    replay: GraphFn,
    free: FreeFn,
}

/// The library's path: `RLHF_CUDA_GRAPH_LIB`, else where the build put it.
pub fn library_path() -> Option<PathBuf> {
    std::env::var_os("RLHF_CUDA_GRAPH_LIB").map(PathBuf::from).or_else(|| BUILT.map(PathBuf::from))
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let path = library_path()
            .ok_or_else(|| "this build has no CUDA graph library (libtorch without CUDA headers)".to_string())?;
        // SAFETY: loading our own shim, whose initialisers register nothing global.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
            format!("{}: cannot load ({e}); it needs libtorch_cuda.so from the CUDA torch wheel", path.display())
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbols have the signatures of cuda_graph.cpp.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(Api {
            free_string: sym!("rlhf_cg_free_string"),
            pool: sym!("rlhf_cg_pool"),
            enter: sym!("rlhf_cg_enter"),
            exit: sym!("rlhf_cg_exit"),
            begin: sym!("rlhf_cg_begin"),
            end: sym!("rlhf_cg_end"),
            replay: sym!("rlhf_cg_replay"),
            free: sym!("rlhf_cg_free"),
            _lib: lib,
        })
    })
    .as_ref()
    .map_err(|m| Error(m.clone()))
}

/// Turns a C status and message into a result.
fn check(api: &Api, rc: c_int, err: *mut c_char) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: `err` was written by the failing call.
    Err(Error(one_line(&unsafe { take_string(err, api.free_string) })))
}

/// Whether the library loads (and so whether graphs can be made on a CUDA device).
pub fn available() -> Result<()> {
    api().map(|_| ())
}

/// A memory pool the graphs captured with it share (their intermediate tensors).
#[derive(Debug, Clone, Copy)]
pub struct Pool(u64, u64);

impl Pool {
    pub fn new() -> Result<Pool> {
        let api = api()?;
        let (mut a, mut b, mut err) = (0u64, 0u64, std::ptr::null_mut());
        // SAFETY: out-pointers to locals.
        check(api, unsafe { (api.pool)(&mut a, &mut b, &mut err) }, err)?;
        Ok(Pool(a, b))
    }
}

/// A side stream of a CUDA device made this thread's current stream once the work queued so far
/// has run; [`SideStream::exit`] restores the previous stream once the side stream's work has
/// run (each a device synchronisation: they happen once per captured graph).
#[must_use = "exit the side stream"]
pub struct SideStream(());

impl SideStream {
    pub fn enter(device: usize) -> Result<SideStream> {
        let api = api()?;
        let mut err = std::ptr::null_mut();
        // SAFETY: plain call.
        check(api, unsafe { (api.enter)(device as c_int, &mut err) }, err)?;
        Ok(SideStream(()))
    }

    pub fn exit(self) -> Result<()> {
        let api = api()?;
        let mut err = std::ptr::null_mut();
        // SAFETY: plain call; a side stream is current (this value exists).
        check(api, unsafe { (api.exit)(&mut err) }, err)
    }
}

/// A captured CUDA graph.
pub struct Graph {
    raw: *mut c_void,
}

// SAFETY: a CUDAGraph may be replayed and freed from any thread.
unsafe impl Send for Graph {}

impl Graph {
    /// Captures the GPU work `f` launches on the current (side) stream, allocating from `pool`.
    /// Nothing runs: replay the graph to run it. An error from `f` or from the capture (an
    /// operation that cannot be captured, such as a copy to the host) leaves no graph.
    pub fn capture(pool: &Pool, f: &mut dyn FnMut() -> std::result::Result<(), String>) -> Result<Graph> {
        let api = api()?;
        let (mut raw, mut err) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: out-pointers to locals.
        check(api, unsafe { (api.begin)(pool.0, pool.1, &mut raw, &mut err) }, err)?;
        let graph = Graph { raw };
        let ran = f();
        let mut err = std::ptr::null_mut();
        // SAFETY: `raw` is capturing; ending it is required whatever `f` did.
        let ended = check(api, unsafe { (api.end)(graph.raw, &mut err) }, err);
        ran.map_err(Error)?;
        ended?;
        Ok(graph)
    }

    /// Launches the graph's kernels on the current stream.
    pub fn replay(&self) -> Result<()> {
        let api = api()?;
        let mut err = std::ptr::null_mut();
        // SAFETY: a captured graph.
        check(api, unsafe { (api.replay)(self.raw, &mut err) }, err)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: owned, freed once.
            unsafe { (api.free)(self.raw) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU nothing can be captured, but the library (when built) loads and a failure
    /// is an error, not a crash.
    #[test]
    fn library_loads_or_says_why() {
        match available() {
            Ok(()) => assert!(library_path().is_some()),
            Err(e) => assert!(!e.0.is_empty()),
        }
    }
}
