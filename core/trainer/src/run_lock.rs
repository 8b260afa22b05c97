//! One process per run directory. `<run_dir>/.lock` holds the PID (and, on Linux, the start time)
//! of the process that owns the directory: `rlhf train` (fresh or `--resume`), `rlhf sft` and
//! `rlhf rm` take it before they write anything into the directory, so a second run into the same
//! directory is refused instead of interleaving its metrics, checkpoints and models with the
//! first's.
//!
//! The file is created atomically (`O_CREAT | O_EXCL`) and removed when its [`RunLock`] is
//! dropped: at the end of the run, on an error return and on a panic that unwinds. A process killed
//! outright (SIGKILL, a crash, power loss) leaves it behind; such a lock is stale — no process has
//! its PID any more (`/proc/<pid>` is gone or a zombie), or the PID now belongs to a process that
//! started at another time — and is taken over with a warning. Where `/proc` is not available a
//! lock is always taken as held (the message names the file to remove).
//!
//! Taking over a stale lock re-reads it just before removing it, so two processes that find the
//! same stale lock at the same moment almost never both win; the window left is a few
//! microseconds between that read and the removal.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::error::{Result, TrainerError};

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// Lock files held by this process (a second lock of the same directory in-process is refused,
/// not mistaken for a stale lock left by an earlier process with our PID).
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Ownership of a run directory; dropping it releases the directory.
#[derive(Debug)]
pub struct RunLock {
    dir: PathBuf,
    path: PathBuf,
    /// The lock file's canonical path, as [`HELD`] knows it.
    key: PathBuf,
    /// This process created the directory (it did not exist before [`RunLock::acquire`]).
    created_dir: bool,
    /// What the directory held when the lock was taken (besides the lock itself).
    found: Vec<std::ffi::OsString>,
    /// Still ours to remove on drop.
    held: bool,
}

/// Who holds a lock, as its file says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holder {
    pid: u32,
    /// Start time of the process in clock ticks since boot (`/proc/<pid>/stat` field 22).
    start: Option<u64>,
}

fn parse(text: &str) -> Option<Holder> {
    let mut lines = text.lines();
    let pid = lines.next()?.trim().parse().ok()?;
    let start = lines.next().and_then(|l| l.trim().parse().ok());
    Some(Holder { pid, start })
}

/// `(state, start time)` of a live process from `/proc/<pid>/stat`, `None` when there is none.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ...`: comm may hold spaces and parentheses; fields resume after the last `)`.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// Whether the process named by a lock still runs (see the module docs).
fn alive(h: &Holder) -> bool {
    if h.pid == std::process::id() {
        // Not one of ours (those are in HELD): an earlier process that had our PID.
        return false;
    }
    if !Path::new("/proc/self/stat").exists() {
        return true; // no way to tell: keep it
    }
    match proc_stat(h.pid) {
        None => false,
        Some(('Z', _)) | Some(('X', _)) => false,
        Some((_, start)) => h.start.is_none_or(|s| s == start),
    }
}

fn in_use(dir: &Path, path: &Path, what: &str) -> TrainerError {
    TrainerError::Run(format!(
        "{}: the run directory is in use by {what}, which holds {}; wait for it to end or choose another --run-dir",
        dir.display(),
        path.display()
    ))
}

impl RunLock {
    /// Creates `dir` if needed and takes its lock; refused, naming the directory and the PID, while
    /// another live process holds it. A stale lock is taken over with a warning.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let created_dir = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| TrainerError::io(dir, e))?;
        let path = dir.join(LOCK_FILE);
        let key = std::fs::canonicalize(dir).map_err(|e| TrainerError::io(dir, e))?.join(LOCK_FILE);
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if held.contains(&key) {
            return Err(in_use(dir, &path, &format!("this process (PID {})", std::process::id())));
        }
        let me = Holder { pid: std::process::id(), start: proc_stat(std::process::id()).map(|(_, s)| s) };
        let deadline = SystemTime::now() + Duration::from_secs(3);
        loop {
            if SystemTime::now() > deadline + Duration::from_secs(2) {
                return Err(in_use(dir, &path, "another run"));
            }
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    let text = match me.start {
                        Some(s) => format!("{}\n{s}\n", me.pid),
                        None => format!("{}\n", me.pid),
                    };
                    if let Err(e) = f.write_all(text.as_bytes()).and_then(|()| f.sync_all()) {
                        let _ = std::fs::remove_file(&path);
                        return Err(TrainerError::io(&path, e));
                    }
                    held.push(key.clone());
                    let found = std::fs::read_dir(dir)
                        .map_err(|e| TrainerError::io(dir, e))?
                        .flatten()
                        .map(|e| e.file_name())
                        .filter(|n| n != LOCK_FILE)
                        .collect();
                    return Ok(RunLock { dir: dir.to_path_buf(), path, key, created_dir, found, held: true });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(TrainerError::io(&path, e)),
            }
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // just released
                Err(e) => return Err(TrainerError::io(&path, e)),
            };
            match parse(&text) {
                Some(h) if alive(&h) => return Err(in_use(dir, &path, &format!("another run (PID {})", h.pid))),
                Some(h) => {
                    // Re-read just before removing: only the stale lock goes, never a new owner's.
                    if std::fs::read_to_string(&path).ok().as_deref() == Some(text.as_str()) {
                        tracing::warn!(
                            "{}: taking over a stale lock of PID {}, which no longer runs",
                            path.display(),
                            h.pid
                        );
                        let _ = std::fs::remove_file(&path);
                    }
                }
                None if SystemTime::now() < deadline => {
                    // Being written by a process that has just created it: look again shortly.
                    std::thread::sleep(Duration::from_millis(50));
                }
                None => {
                    tracing::warn!("{}: taking over an unreadable lock file", path.display());
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }

    /// Refuses, as [`RunLock::acquire`] would, while a live process holds `dir`; takes nothing
    /// (for a clear message before slower work, e.g. reading a checkpoint the owner may prune).
    pub fn check_free(dir: &Path) -> Result<()> {
        let path = dir.join(LOCK_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
        let ours =
            std::fs::canonicalize(&path).is_ok_and(|k| HELD.lock().unwrap_or_else(|e| e.into_inner()).contains(&k));
        match parse(&text) {
            Some(h) if ours || alive(&h) => Err(in_use(dir, &path, &format!("another run (PID {})", h.pid))),
            _ => Ok(()),
        }
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Undoes a start that failed before its run began: the directory goes when this process
    /// created it (everything in it is this start's), else whatever this start added to it. What
    /// the directory held before is left as it was.
    pub fn abandon(mut self) {
        if self.created_dir {
            if std::fs::remove_dir_all(&self.dir).is_ok() {
                self.release_entry();
                self.held = false;
            }
            return;
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name == LOCK_FILE || self.found.contains(&name) {
                continue;
            }
            let p = entry.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }

    fn release_entry(&self) {
        HELD.lock().unwrap_or_else(|e| e.into_inner()).retain(|k| *k != self.key);
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if self.held {
            self.release_entry();
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_owner_at_a_time_and_released_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let lock = RunLock::acquire(&dir).unwrap();
        let text = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert_eq!(parse(&text).unwrap().pid, std::process::id());
        let e = RunLock::acquire(&dir).unwrap_err().to_string();
        assert!(e.contains("in use") && e.contains(&format!("PID {}", std::process::id())), "{e}");
        drop(lock);
        assert!(!dir.join(LOCK_FILE).exists());
        drop(RunLock::acquire(&dir).unwrap());
    }

    #[test]
    fn a_stale_lock_is_taken_over() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir_all(&dir).unwrap();
        // A PID that no longer runs: a child that has exited and been reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        std::fs::write(dir.join(LOCK_FILE), format!("{pid}\n")).unwrap();
        let lock = RunLock::acquire(&dir).unwrap();
        assert_eq!(parse(&std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap()).unwrap().pid, std::process::id());
        drop(lock);
        // A live PID under another start time is a reused PID: stale too.
        std::fs::write(dir.join(LOCK_FILE), "1\n0\n").unwrap();
        if proc_stat(1).is_some_and(|(_, s)| s != 0) {
            drop(RunLock::acquire(&dir).unwrap());
        }
    }

    #[test]
    fn abandon_removes_only_what_the_start_added() {
        let tmp = tempfile::tempdir().unwrap();
        let new_dir = tmp.path().join("new");
        let lock = RunLock::acquire(&new_dir).unwrap();
        std::fs::create_dir_all(new_dir.join("builtin-model")).unwrap();
        lock.abandon();
        assert!(!new_dir.exists());
        let old = tmp.path().join("old");
        std::fs::create_dir_all(old.join("mine")).unwrap();
        let lock = RunLock::acquire(&old).unwrap();
        std::fs::create_dir_all(old.join("builtin-model")).unwrap();
        std::fs::write(old.join("config.toml"), "").unwrap();
        lock.abandon();
        let mut left: Vec<String> =
            std::fs::read_dir(&old).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
        left.sort();
        assert_eq!(left, ["mine"]);
        drop(RunLock::acquire(&old).unwrap());
    }
}
