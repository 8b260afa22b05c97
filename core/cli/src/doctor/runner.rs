//! Running one check's `rlhf` command as a child process with a deadline: its output goes to the
//! check's log file, a crash or a hang ends that check only, and the doctor goes on.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::deadline::Waited;

/// How a child ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    /// Exit status 0.
    Ok,
    /// Another exit status, or a signal (`None`).
    Failed(Option<i32>),
    /// Killed at its deadline.
    TimedOut,
    /// Could not be started at all.
    NotStarted(String),
    /// This process was asked to stop (SIGTERM, SIGINT): the child got the signal and ended.
    Stopped(i32),
}

/// A finished child: how it ended and how long it ran.
#[derive(Debug, Clone)]
pub struct Finished {
    pub exit: Exit,
    pub seconds: f64,
}

/// Runs this executable with `args` (plus `--no-progress`), stdout and stderr appended to `log`,
/// in a process group of its own that is killed after `timeout`. A SIGTERM or SIGINT to the
/// doctor is passed on to the group, which gets a grace period to end (a training run checkpoints
/// its step), then SIGKILL; the child also gets SIGTERM should the doctor die.
pub fn run_rlhf(args: &[String], log: &Path, timeout: Duration) -> Finished {
    let start = Instant::now();
    let done = |exit| Finished { exit, seconds: start.elapsed().as_secs_f64() };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return done(Exit::NotStarted(format!("cannot find the rlhf executable: {e}"))),
    };
    let file = match std::fs::OpenOptions::new().create(true).append(true).open(log) {
        Ok(f) => f,
        Err(e) => return done(Exit::NotStarted(format!("{}: {e}", log.display()))),
    };
    let err = match file.try_clone() {
        Ok(f) => f,
        Err(e) => return done(Exit::NotStarted(format!("{}: {e}", log.display()))),
    };
    let mut cmd = Command::new(exe);
    cmd.args(args).arg("--no-progress").stdin(Stdio::null()).stdout(file).stderr(err);
    crate::deadline::own_group(&mut cmd);
    crate::launcher::die_with_parent(&mut cmd);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return done(Exit::NotStarted(format!("cannot start rlhf: {e}"))),
    };
    match crate::deadline::wait(&mut child, timeout) {
        Ok(Waited::Exited(status)) if status.success() => done(Exit::Ok),
        Ok(Waited::Exited(status)) => done(Exit::Failed(status.code())),
        Ok(Waited::TimedOut) => done(Exit::TimedOut),
        Ok(Waited::Stopped(sig)) => done(Exit::Stopped(sig)),
        Err(e) => {
            crate::deadline::signal_group(&child, libc::SIGKILL);
            let _ = child.wait();
            done(Exit::NotStarted(format!("waiting for rlhf: {e}")))
        }
    }
}

/// The line a failed `rlhf` command ended with: its `error: ...` line, else the last non-empty
/// line of the log (a crash's last words), cut to 300 characters.
pub fn last_error(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let line = lines.iter().rev().find(|l| l.starts_with("error:")).or(lines.last()).copied().unwrap_or("(no output)");
    line.chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_line_wins_over_later_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x.log");
        std::fs::write(&log, "INFO start\nerror: model.safetensors: truncated\n\nbye\n").unwrap();
        assert_eq!(last_error(&log), "error: model.safetensors: truncated");
        std::fs::write(&log, "INFO start\nSegmentation fault\n").unwrap();
        assert_eq!(last_error(&log), "Segmentation fault");
        assert_eq!(last_error(&dir.path().join("missing.log")), "(no output)");
    }
}
