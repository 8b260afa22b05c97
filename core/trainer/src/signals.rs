//! SIGTERM and SIGINT end a run cleanly: the first one asks the training loop to stop at the end
//! of the step in flight, checkpoint that step on every rank and release the run directory (a
//! scheduler such as SLURM or Kubernetes sends SIGTERM before it preempts; Ctrl-C is SIGINT). A
//! second signal ends the process at once, unless it follows the first within
//! [`SAME_REQUEST_MS`]: a scheduler that signals every process of a job and a launcher that
//! forwards the signal to its ranks deliver it twice within milliseconds, and that is one request.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// The first signal received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// When it came, milliseconds on the monotonic clock.
static FIRST_MS: AtomicU64 = AtomicU64::new(0);

/// Signals this close to the first count as the same request.
pub const SAME_REQUEST_MS: u64 = 2000;

fn now_ms() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec it is given; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only async-signal-safe work here: atomics, clock_gettime, _exit.
    if SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        FIRST_MS.store(now_ms(), Ordering::SeqCst);
        return;
    }
    if now_ms().saturating_sub(FIRST_MS.load(Ordering::SeqCst)) > SAME_REQUEST_MS {
        // SAFETY: _exit ends the process without running anything else.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Installs the handlers for SIGTERM and SIGINT (once per process; later calls do nothing new).
pub fn install() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the handler
        // only touches atomics and async-signal-safe calls.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// The signal that asked the run to stop, if one came.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `SIGTERM` / `SIGINT` for messages.
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "a signal",
    }
}

/// The exit status of a run stopped by `sig`: 128 + the signal, as a shell reports it.
pub fn exit_code(sig: i32) -> u8 {
    (128 + sig).clamp(0, 255) as u8
}

/// A run that ended because of a signal, with the one line that says what was kept.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Stopped {
    pub signal: i32,
    pub message: String,
}
