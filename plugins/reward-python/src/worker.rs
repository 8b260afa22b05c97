//! One worker process: `python -c worker.py FILE FUNCTION SIGNATURE`, a JSON line per request on
//! its stdin and a JSON line per reply on its stdout (a private copy: the worker points fd 1 at
//! stderr before importing the user's file). A writer thread feeds stdin and a reader thread reads
//! stdout, so every wait has a deadline; a third thread forwards stderr to the log and keeps its
//! last lines for error messages, each line cut at [`MAX_LINE`] bytes. The process gets its own
//! process group (a Ctrl-C at the terminal reaches only the trainer, which finishes its step); the
//! whole group is killed when the [`Worker`] is replaced or drops, so processes the user's function
//! started (`subprocess.Popen`, `fork`, a `sleep` past the timeout) end with it.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The worker script (the Python side of the protocol).
const SCRIPT: &str = include_str!("worker.py");

/// How many stderr lines a failure message may quote from.
const TAIL_LINES: usize = 20;

/// The longest stderr line forwarded to the log: the rest of a longer line is dropped, so a
/// worker writing hundreds of megabytes without a newline costs the trainer no memory.
pub const MAX_LINE: usize = 4096;

/// What starts a worker.
#[derive(Debug, Clone)]
pub struct Launch {
    pub python: PathBuf,
    pub file: PathBuf,
    pub function: String,
    pub signature: &'static str,
    pub startup_timeout: Duration,
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    /// Position in the pool (log lines say `worker N`).
    pub index: usize,
    pub pid: u32,
    child: Child,
    requests: Option<Sender<Vec<u8>>>,
    replies: Receiver<Result<String, String>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Worker {
    /// Starts a worker and waits for its `ready` line; the error is one line (the Python
    /// exception's last line when the import or lookup failed).
    pub fn spawn(launch: &Launch, index: usize) -> Result<Worker, String> {
        let mut cmd = Command::new(&launch.python);
        cmd.arg("-c")
            .arg(SCRIPT)
            .arg(&launch.file)
            .arg(&launch.function)
            .arg(launch.signature)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", launch.python.display()))?;
        let pid = child.id();
        let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let (Some(stdin), Some(stdout), Some(stderr)) = (stdin, stdout, stderr) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("cannot open the worker's pipes".into());
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        spawn_stderr_forwarder(stderr, index, tail.clone());
        let (replies_tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let line = line.map_err(|e| e.to_string());
                let end = line.is_err();
                if replies_tx.send(line).is_err() || end {
                    return;
                }
            }
            let _ = replies_tx.send(Err("closed its output (the process ended)".into()));
        });
        let requests = spawn_writer(stdin);
        let mut w = Worker { index, pid, child, requests: Some(requests), replies, tail };
        let ready = match w.recv(Instant::now() + launch.startup_timeout) {
            Ok(v) => v,
            Err(Failure::Timeout) => {
                return Err(format!("did not start within {:?} (importing the file)", launch.startup_timeout))
            }
            Err(f) => return Err(w.describe(&f)),
        };
        if let Some(e) = ready.get("startup_error").and_then(Value::as_str) {
            return Err(e.to_string());
        }
        if ready.get("ready") != Some(&Value::Bool(true)) {
            return Err(format!("answered {ready} instead of its ready line"));
        }
        Ok(w)
    }

    /// Queues one request line (a JSON object, no newline).
    pub fn send(&self, request: &Value) -> Result<(), Failure> {
        let mut line = serde_json::to_vec(request).map_err(|e| Failure::Protocol(e.to_string()))?;
        line.push(b'\n');
        let sender = self.requests.as_ref().ok_or(Failure::Died)?;
        sender.send(line).map_err(|_| Failure::Died)
    }

    /// The next reply, waiting until `deadline`.
    pub fn recv(&mut self, deadline: Instant) -> Result<Value, Failure> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.replies.recv_timeout(wait) {
            Ok(Ok(line)) => serde_json::from_str(&line).map_err(|_| {
                let mut shown: String = line.chars().take(120).collect();
                if shown.len() < line.len() {
                    shown.push('…');
                }
                Failure::Protocol(format!("wrote {shown:?}, not a reply"))
            }),
            Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => Err(Failure::Died),
            Err(RecvTimeoutError::Timeout) => Err(Failure::Timeout),
        }
    }

    /// One line about a failure: the exit status and the last stderr line for a death.
    pub fn describe(&mut self, f: &Failure) -> String {
        match f {
            Failure::Timeout => "timed out".into(),
            Failure::Protocol(m) => m.clone(),
            Failure::Died => {
                // Give the process a moment to be reaped so its status is known.
                let t0 = Instant::now();
                let status = loop {
                    match self.child.try_wait() {
                        Ok(Some(s)) => break Some(s),
                        Ok(None) if t0.elapsed() < Duration::from_secs(2) => {
                            std::thread::sleep(Duration::from_millis(20))
                        }
                        _ => break None,
                    }
                };
                let status = status.map_or("is unresponsive".to_string(), |s| format!("ended ({s})"));
                match self.last_stderr() {
                    Some(line) => format!("{status}; its last stderr line: {line}"),
                    None => status,
                }
            }
        }
    }

    /// The last non-empty line the worker wrote to stderr.
    pub fn last_stderr(&self) -> Option<String> {
        // The forwarder may still be reading the final lines of a process that just died.
        std::thread::sleep(Duration::from_millis(50));
        let tail = self.tail.lock().ok()?;
        tail.iter().rev().find(|l| !l.trim().is_empty()).cloned()
    }

    /// Kills the worker's process group (SIGKILL): the worker and whatever it started that did
    /// not leave the group; then reaps the worker.
    pub fn kill(&mut self) {
        self.requests = None;
        if let Ok(group) = libc::pid_t::try_from(self.pid) {
            // SAFETY: kill(2) with a negative pid signals the process group the worker leads
            // (`process_group(0)` at spawn); the worker is not reaped yet, so the group id is
            // still its own.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Why a call got no reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    Timeout,
    /// The process ended or closed its output.
    Died,
    /// It wrote something that is not a reply.
    Protocol(String),
}

fn spawn_writer(mut stdin: ChildStdin) -> Sender<Vec<u8>> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        for line in rx {
            // A dead worker shows as a failed write; its reader reports the death.
            if stdin.write_all(&line).and_then(|_| stdin.flush()).is_err() {
                return;
            }
        }
    });
    tx
}

fn spawn_stderr_forwarder(stderr: std::process::ChildStderr, index: usize, tail: Arc<Mutex<VecDeque<String>>>) {
    std::thread::spawn(move || {
        forward_lines(stderr, MAX_LINE, |line| {
            tracing::info!("reward-python worker {index}: {line}");
            if let Ok(mut t) = tail.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line.to_string());
            }
        });
    });
}

/// Reads `input` to its end and hands `emit` one line at a time, holding at most `max` bytes: a
/// line longer than that is emitted cut (saying so) and the rest of it is dropped. A carriage
/// return starts the line over, as on a terminal, so a progress bar (`\r 10%|█ |`) is logged once,
/// as it last stood, when its line ends.
pub fn forward_lines(mut input: impl Read, max: usize, mut emit: impl FnMut(&str)) {
    let mut line: Vec<u8> = Vec::with_capacity(max.min(1 << 16));
    // `dropping`: past `max` bytes of this line; `cr`: a `\r` came last (a `\n` then ends the
    // line as usual, anything else overwrites it).
    let (mut dropping, mut cr) = (false, false);
    let mut chunk = vec![0u8; 1 << 16];
    let mut flush = |line: &mut Vec<u8>, cut: bool| {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end();
        if cut {
            emit(&format!("{text}… (line cut at {max} bytes)"));
        } else {
            emit(text);
        }
        line.clear();
    };
    loop {
        let n = match input.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &chunk[..n] {
            if b != b'\n' && std::mem::take(&mut cr) {
                line.clear();
                dropping = false;
            }
            match b {
                b'\n' => {
                    if !dropping {
                        flush(&mut line, false);
                    }
                    dropping = false;
                }
                b'\r' => cr = true,
                _ if dropping => {}
                _ if line.len() >= max => {
                    flush(&mut line, true);
                    dropping = true;
                }
                _ => line.push(b),
            }
        }
    }
    if !line.is_empty() && !dropping {
        flush(&mut line, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 200 MB without a newline.
    struct Flood(usize);

    impl Read for Flood {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.0);
            buf[..n].fill(b'x');
            self.0 -= n;
            Ok(n)
        }
    }

    #[test]
    fn lines_are_bounded_and_carriage_returns_start_them_over() {
        let mut lines: Vec<String> = Vec::new();
        let input = Flood(200 << 20).chain(&b"\nafter\n"[..]);
        forward_lines(input, MAX_LINE, |l| lines.push(l.to_string()));
        assert_eq!(lines.len(), 2, "{:?}", lines.iter().map(String::len).collect::<Vec<_>>());
        assert!(lines[0].starts_with("xxx") && lines[0].ends_with("… (line cut at 4096 bytes)"));
        assert!(lines[0].len() < MAX_LINE + 64);
        assert_eq!(lines[1], "after");

        let mut lines: Vec<String> = Vec::new();
        forward_lines(&b"start\n 10%|#  |\r 50%|### |\r100%|#####|\nlast"[..], MAX_LINE, |l| lines.push(l.into()));
        assert_eq!(lines, ["start", "100%|#####|", "last"]);
        let mut lines: Vec<String> = Vec::new();
        forward_lines(&b"a\r\nb\n\n"[..], MAX_LINE, |l| lines.push(l.into()));
        assert_eq!(lines, ["a", "b", ""]);
    }
}
