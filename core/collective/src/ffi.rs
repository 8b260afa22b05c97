//! The C ABI of `shim.cpp`, and safe wrappers that turn its error strings into Rust strings.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use tch::Tensor;

extern "C" {
    fn rlhf_c10d_free_string(s: *mut c_char);
    fn rlhf_c10d_store_new(
        host: *const c_char,
        port: c_int,
        rank: c_int,
        size: c_int,
        host_store: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_store_free(store: *mut c_void);
    fn rlhf_c10d_gloo_new(
        store: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        size: c_int,
        iface: *const c_char,
        hostname: *const c_char,
        threads: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    pub(crate) fn rlhf_c10d_group_from_backend(
        store: *mut c_void,
        backend: *mut c_void,
        timeout_ms: i64,
    ) -> *mut c_void;
    fn rlhf_c10d_group_free(group: *mut c_void);
    fn rlhf_c10d_allreduce(group: *mut c_void, tensor: *mut c_void, op: c_int, err: *mut *mut c_char) -> c_int;
    fn rlhf_c10d_broadcast(group: *mut c_void, tensor: *mut c_void, root: c_int, err: *mut *mut c_char) -> c_int;
    fn rlhf_c10d_allgather(
        group: *mut c_void,
        outputs: *mut *mut c_void,
        n: c_int,
        input: *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_reduce_scatter(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_allgather_into(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_allgather_into_async(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        work: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_reduce_scatter_async(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        work: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> c_int;
    fn rlhf_c10d_work_wait(group: *mut c_void, work: *mut c_void, what: *const c_char, err: *mut *mut c_char) -> c_int;
    fn rlhf_c10d_work_free(work: *mut c_void);
    fn rlhf_c10d_barrier(group: *mut c_void, err: *mut *mut c_char) -> c_int;
    fn rlhf_c10d_quiet_logs();
    fn rlhf_c10d_ensure_grad(tensor: *mut c_void, err: *mut *mut c_char) -> c_int;
    fn rlhf_c10d_release_grad(tensor: *mut c_void, err: *mut *mut c_char) -> c_int;
}

/// Takes a malloc'd error string from the shim (or the NCCL library, same allocator) and frees it.
pub(crate) fn take_string(err: *mut c_char) -> String {
    if err.is_null() {
        return "failed (no message)".into();
    }
    // SAFETY: a NUL-terminated malloc'd string, freed here once.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { rlhf_c10d_free_string(err) };
    msg
}

/// Runs a shim call and returns its error message, if any.
fn call(f: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<(), String> {
    let mut err: *mut c_char = std::ptr::null_mut();
    let rc = f(&mut err);
    if rc == 0 {
        return Ok(());
    }
    Err(take_string(err))
}

fn tensor_ptr(t: &Tensor) -> *mut c_void {
    t.as_ptr() as *mut c_void
}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "")).expect("no NUL left")
}

/// A c10d store (`intrusive_ptr<Store>` on the C++ side).
pub(crate) struct Store(*mut c_void);

// SAFETY: c10d stores are thread-safe; the pointer is only freed on drop.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Connects to (or, for rank 0 with `host`, hosts) the TCPStore at `addr:port`.
    pub(crate) fn tcp(
        addr: &str,
        port: u16,
        rank: usize,
        size: usize,
        host: bool,
        timeout_ms: i64,
    ) -> Result<Self, String> {
        let mut out = std::ptr::null_mut();
        let a = cstring(addr);
        call(|err| unsafe {
            rlhf_c10d_store_new(
                a.as_ptr(),
                c_int::from(port),
                rank as c_int,
                size as c_int,
                c_int::from(host),
                timeout_ms,
                &mut out,
                err,
            )
        })?;
        Ok(Store(out))
    }

    pub(crate) fn raw(&self) -> *mut c_void {
        self.0
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: created by rlhf_c10d_store_new, freed once.
        unsafe { rlhf_c10d_store_free(self.0) }
    }
}

/// A process group (a c10d backend and its timeout).
pub(crate) struct Group(*mut c_void);

// SAFETY: the trainer calls collectives from one thread at a time; c10d backends are thread-safe.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl Group {
    /// A Gloo group over `store`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gloo(
        store: &Store,
        prefix: &str,
        rank: usize,
        size: usize,
        iface: Option<&str>,
        hostname: Option<&str>,
        threads: usize,
        timeout_ms: i64,
    ) -> Result<Self, String> {
        let (p, i, h) = (cstring(prefix), cstring(iface.unwrap_or("")), cstring(hostname.unwrap_or("")));
        let mut out = std::ptr::null_mut();
        call(|err| unsafe {
            rlhf_c10d_gloo_new(
                store.raw(),
                p.as_ptr(),
                rank as c_int,
                size as c_int,
                i.as_ptr(),
                h.as_ptr(),
                threads as c_int,
                timeout_ms,
                &mut out,
                err,
            )
        })?;
        Ok(Group(out))
    }

    /// Wraps a raw group pointer made by [`rlhf_c10d_group_from_backend`].
    pub(crate) fn from_raw(raw: *mut c_void) -> Self {
        Group(raw)
    }

    pub(crate) fn all_reduce(&self, t: &Tensor, op: c_int) -> Result<(), String> {
        call(|err| unsafe { rlhf_c10d_allreduce(self.0, tensor_ptr(t), op, err) })
    }

    pub(crate) fn broadcast(&self, t: &Tensor, root: usize) -> Result<(), String> {
        call(|err| unsafe { rlhf_c10d_broadcast(self.0, tensor_ptr(t), root as c_int, err) })
    }

    pub(crate) fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<(), String> {
        let mut ptrs: Vec<*mut c_void> = outputs.iter().map(tensor_ptr).collect();
        call(|err| unsafe {
            rlhf_c10d_allgather(self.0, ptrs.as_mut_ptr(), ptrs.len() as c_int, tensor_ptr(input), err)
        })
    }

    pub(crate) fn reduce_scatter(&self, output: &Tensor, input: &Tensor) -> Result<(), String> {
        call(|err| unsafe { rlhf_c10d_reduce_scatter(self.0, tensor_ptr(output), tensor_ptr(input), err) })
    }

    pub(crate) fn all_gather_into(&self, output: &Tensor, input: &Tensor) -> Result<(), String> {
        call(|err| unsafe { rlhf_c10d_allgather_into(self.0, tensor_ptr(output), tensor_ptr(input), err) })
    }

    /// Starts `all_gather_into` without waiting; the tensors must live until [`Group::wait`].
    pub(crate) fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, String> {
        let mut work = std::ptr::null_mut();
        call(|err| unsafe {
            rlhf_c10d_allgather_into_async(self.0, tensor_ptr(output), tensor_ptr(input), &mut work, err)
        })?;
        Ok(Work(work))
    }

    /// Starts `reduce_scatter` without waiting; the tensors must live until [`Group::wait`].
    pub(crate) fn reduce_scatter_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, String> {
        let mut work = std::ptr::null_mut();
        call(|err| unsafe {
            rlhf_c10d_reduce_scatter_async(self.0, tensor_ptr(output), tensor_ptr(input), &mut work, err)
        })?;
        Ok(Work(work))
    }

    /// Waits for `work` (the collective `what`, started on this group) within the group's timeout.
    pub(crate) fn wait(&self, work: &Work, what: &str) -> Result<(), String> {
        let what = cstring(what);
        call(|err| unsafe { rlhf_c10d_work_wait(self.0, work.0, what.as_ptr(), err) })
    }

    pub(crate) fn barrier(&self) -> Result<(), String> {
        call(|err| unsafe { rlhf_c10d_barrier(self.0, err) })
    }
}

/// A collective in flight (a c10d work handle).
pub(crate) struct Work(*mut c_void);

// SAFETY: a c10d work handle may be waited on from any thread; it is used from one at a time.
unsafe impl Send for Work {}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: created by the shim, freed once.
        unsafe { rlhf_c10d_work_free(self.0) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: created by the shim, freed once.
        unsafe { rlhf_c10d_group_free(self.0) }
    }
}

/// Gives `param` a zero gradient when it has none (a rank whose share of a minibatch was empty
/// still takes part in the gradient all-reduce).
pub(crate) fn ensure_grad(param: &Tensor) -> Result<(), String> {
    call(|err| unsafe { rlhf_c10d_ensure_grad(tensor_ptr(param), err) })
}

/// Drops `param`'s gradient (it becomes undefined), as `zero_grad(set_to_none=True)` does.
pub(crate) fn release_grad(param: &Tensor) -> Result<(), String> {
    call(|err| unsafe { rlhf_c10d_release_grad(tensor_ptr(param), err) })
}

/// Silences c10's own log of the failures the shim returns as errors.
pub(crate) fn quiet_logs() {
    // SAFETY: sets a logging flag.
    unsafe { rlhf_c10d_quiet_logs() }
}
