//! Child processes with a deadline: a probe of the machine (a Python that says whether TRL
//! imports) or a check of the doctor may hang, and the command that started it must not. The
//! child gets its own process group, so what it started ends with it.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// Seconds a probe of the machine may take unless `RLHF_PROBE_TIMEOUT` says otherwise.
pub const PROBE_SECS: f64 = 120.0;

/// The deadline of a probe: `RLHF_PROBE_TIMEOUT` seconds, else [`PROBE_SECS`].
pub fn probe_timeout() -> anyhow::Result<Duration> {
    match std::env::var("RLHF_PROBE_TIMEOUT") {
        Err(_) => Ok(Duration::from_secs_f64(PROBE_SECS)),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            _ => anyhow::bail!("RLHF_PROBE_TIMEOUT `{v}`: expected a number of seconds > 0"),
        },
    }
}

/// Puts the command's process in a process group of its own (its id is the child's pid).
pub fn own_group(cmd: &mut Command) -> &mut Command {
    cmd.process_group(0)
}

/// Sends `sig` to the process group `child` leads.
pub fn signal_group(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) with a negative pid signals the group the (unreaped) child leads.
        unsafe { libc::kill(-pid, sig) };
    }
}

/// How a wait ended.
pub enum Waited {
    Exited(ExitStatus),
    /// The deadline passed; the group was killed.
    TimedOut,
    /// SIGTERM or SIGINT reached this process; the group got it too and then, after a grace
    /// period, SIGKILL.
    Stopped(i32),
}

/// Waits for `child` (the leader of its own group) until `timeout`; a signal to this process is
/// passed on to the group. Whatever way it ends, the child is reaped and its group is gone.
pub fn wait(child: &mut Child, timeout: Duration) -> std::io::Result<Waited> {
    let start = Instant::now();
    let grace = Duration::from_secs(30);
    let mut stopping: Option<(i32, Instant)> = None;
    loop {
        if let Some(status) = child.try_wait()? {
            // The leader is gone: its group may still hold what it started.
            signal_group(child, libc::SIGKILL);
            return Ok(match stopping {
                Some((sig, _)) => Waited::Stopped(sig),
                None => Waited::Exited(status),
            });
        }
        match (stopping, rlhf_trainer::signals::requested()) {
            (None, Some(sig)) => {
                signal_group(child, sig);
                stopping = Some((sig, Instant::now()));
            }
            (Some((sig, since)), _) if since.elapsed() >= grace => {
                signal_group(child, libc::SIGKILL);
                child.wait()?;
                return Ok(Waited::Stopped(sig));
            }
            (None, None) if start.elapsed() >= timeout => {
                signal_group(child, libc::SIGKILL);
                child.wait()?;
                return Ok(Waited::TimedOut);
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Runs `cmd` (stdin closed) and collects its output, within `timeout`; `None` when it did not
/// finish in time (it was killed) or this process was asked to stop.
pub fn output_within(cmd: &mut Command, timeout: Duration) -> std::io::Result<Option<Output>> {
    own_group(cmd).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = read(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = read(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let waited = wait(&mut child, timeout)?;
    let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    Ok(match waited {
        Waited::Exited(status) => Some(Output { status, stdout, stderr }),
        Waited::TimedOut | Waited::Stopped(_) => None,
    })
}
