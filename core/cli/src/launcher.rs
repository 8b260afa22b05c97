//! `--nproc N`: the one-machine launcher for data-parallel runs (`rlhf train`, `sft`, `rm`, `dpo`).
//!
//! It does on one machine what `torchrun --standalone --nproc-per-node N` does: it starts this same
//! executable N times with the same arguments less `--nproc`, each with the environment torchrun
//! gives its workers (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), which `rlhf_collective::World::from_env` reads to join the process group (rank 0
//! hosts the TCPStore at `MASTER_ADDR:MASTER_PORT`). `MASTER_ADDR` defaults to 127.0.0.1 and
//! `MASTER_PORT` to a free port; the caller's values win. `OMP_NUM_THREADS` is the cores divided
//! among the ranks, unless the caller set it.
//!
//! For several machines use torchrun itself, which sets the same variables:
//! `torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --no-python
//! rlhf train ...` (without `--nproc`: a process started by a launcher refuses it).
//!
//! Every rank's output comes through the launcher line by line: stderr (logs) as `[rank i] ...`,
//! stdout of rank 0 unchanged (the run summary that scripts parse), stdout of the other ranks as
//! `[rank i] ...`. The ranks' stderr is a pipe, so they draw no progress bars.
//!
//! The first rank that fails (non-zero exit or a signal) stops the others: SIGTERM, then SIGKILL
//! after 10 s; the launcher then fails naming that rank and its status. On Linux each rank also
//! gets `PR_SET_PDEATHSIG` = SIGTERM, so the ranks die with the launcher even when it is killed
//! with SIGKILL. (The kernel sends that signal when the *thread* that forked the rank exits, so
//! the ranks are started from the calling thread, which lives until the launcher returns.)

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How often the launcher looks at its ranks.
const POLL: Duration = Duration::from_millis(100);
/// How long the ranks get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(10);

/// What `--nproc` asks of a command. `Ok(false)`: go on in this process (no `--nproc`, or
/// `--nproc 1`). `Ok(true)`: the ranks were started here and all finished well; the command
/// returns. Errors: `--nproc 0`, `--nproc` under torchrun, or a rank that failed.
pub fn launched(nproc: Option<usize>) -> anyhow::Result<bool> {
    match plan(nproc, env_var)? {
        None => Ok(false),
        Some(n) => launch(n).map(|()| true),
    }
}

/// A variable of this process's environment (lossily decoded).
fn env_var(key: &str) -> Option<String> {
    std::env::var_os(key).map(|v| v.to_string_lossy().into_owned())
}

/// `None`: run in this process; `Some(n)`: start n ranks. `var` reads the environment.
fn plan(nproc: Option<usize>, var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<usize>> {
    let Some(n) = nproc else { return Ok(None) };
    if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
        bail!("--nproc {n} cannot be combined with a launcher's RANK/WORLD_SIZE (torchrun already started the ranks)");
    }
    match n {
        0 => bail!("--nproc 0: a run needs at least one rank"),
        1 => Ok(None),
        n => Ok(Some(n)),
    }
}

/// `args` (the arguments after the program name) without `--nproc N` and `--nproc=N`. Like clap,
/// it looks at whole arguments only (`--set a=--nproc` stays) and at nothing after `--`.
pub(crate) fn strip_nproc<S: AsRef<OsStr> + Clone>(args: &[S]) -> Vec<S> {
    let mut out = Vec::with_capacity(args.len());
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let s = arg.as_ref();
        if s == "--" {
            out.push(arg.clone());
            out.extend(rest.cloned());
            break;
        }
        if s == "--nproc" {
            rest.next(); // its value
            continue;
        }
        if s.to_str().is_some_and(|t| t.starts_with("--nproc=")) {
            continue;
        }
        out.push(arg.clone());
    }
    out
}

/// The variables every rank shares; `omp_threads` is the OMP_NUM_THREADS chosen here (`None`
/// when the caller set it).
#[derive(Debug)]
struct SharedEnv {
    vars: Vec<(&'static str, String)>,
    master: String,
    omp_threads: Option<usize>,
}

/// Threads per rank: the cores shared out, at least one.
fn threads_per_rank(cores: usize, nproc: usize) -> usize {
    (cores / nproc.max(1)).max(1)
}

fn shared_env(
    nproc: usize,
    var: impl Fn(&str) -> Option<String>,
    cores: usize,
    free_port: impl FnOnce() -> std::io::Result<u16>,
) -> anyhow::Result<SharedEnv> {
    let set = |k: &str| var(k).filter(|v| !v.trim().is_empty());
    let addr = set("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
    let port = match set("MASTER_PORT") {
        Some(p) => p,
        None => free_port().context("--nproc: finding a free port for MASTER_PORT (or set MASTER_PORT)")?.to_string(),
    };
    let master = format!("{addr}:{port}");
    let mut vars = vec![
        ("WORLD_SIZE", nproc.to_string()),
        ("LOCAL_WORLD_SIZE", nproc.to_string()),
        ("MASTER_ADDR", addr),
        ("MASTER_PORT", port),
    ];
    let omp_threads = if set("OMP_NUM_THREADS").is_some() { None } else { Some(threads_per_rank(cores, nproc)) };
    if let Some(t) = omp_threads {
        vars.push(("OMP_NUM_THREADS", t.to_string()));
    }
    Ok(SharedEnv { vars, master, omp_threads })
}

/// Starts `nproc` (2 or more) ranks of this executable and waits for them; see the module docs.
pub fn launch(nproc: usize) -> anyhow::Result<()> {
    anyhow::ensure!(nproc >= 2, "--nproc {nproc}: the launcher starts 2 or more ranks");
    let exe = std::env::current_exe().context("--nproc: cannot find the rlhf executable to start the ranks")?;
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let args = strip_nproc(&argv);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let env = shared_env(nproc, env_var, cores, rlhf_collective::free_port)?;
    if let Some(t) = env.omp_threads {
        tracing::info!("OMP_NUM_THREADS={t} for each of the {nproc} ranks ({cores} cores; set it to choose)");
    }
    tracing::info!("starting {nproc} ranks on this machine (rendezvous at {})", env.master);

    let mut ranks: Vec<RankProc> = Vec::with_capacity(nproc);
    let mut readers = Vec::with_capacity(2 * nproc);
    let mut result: anyhow::Result<()> = Ok(());
    for rank in 0..nproc {
        match spawn_rank(&exe, &args, &env.vars, rank, &mut readers) {
            Ok(child) => ranks.push(RankProc { rank, child, exited: None }),
            Err(e) => {
                let stopped = stop(&mut ranks);
                result = Err(e.context(format!("starting rank {rank} of {nproc}{}", stopped_note(stopped))));
                break;
            }
        }
    }
    if result.is_ok() {
        result = match wait_all(&mut ranks) {
            Ok(None) => Ok(()),
            Ok(Some(failure)) => {
                let stopped = stop(&mut ranks);
                Err(anyhow::anyhow!("{failure}{}", stopped_note(stopped)))
            }
            Err(e) => {
                let stopped = stop(&mut ranks);
                Err(e.context(format!("waiting for the ranks{}", stopped_note(stopped))))
            }
        };
    }
    // Every rank has exited: the readers reach the end of their pipes once the last lines are out.
    for r in readers {
        let _ = r.join();
    }
    result
}

fn stopped_note(stopped: usize) -> String {
    if stopped == 0 {
        String::new()
    } else {
        format!("; stopped the other {stopped} rank(s)")
    }
}

/// Starts one rank with its output forwarded by two reader threads (pushed onto `readers`).
fn spawn_rank(
    exe: &Path,
    args: &[OsString],
    vars: &[(&'static str, String)],
    rank: usize,
    readers: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        // The ranks host their own store (rank 0); a stale torchrun variable must not say otherwise.
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(target_os = "linux")]
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().with_context(|| format!("cannot start {}", exe.display()))?;
    let prefix = format!("[rank {rank}] ").into_bytes();
    let out_prefix = if rank == 0 { Vec::new() } else { prefix.clone() };
    let mut spawned = Vec::with_capacity(2);
    let mut failed = None;
    if let Some(pipe) = child.stdout.take() {
        match forward(pipe, Sink::Stdout, out_prefix, format!("rank-{rank}-stdout")) {
            Ok(h) => spawned.push(h),
            Err(e) => failed = Some(e),
        }
    }
    let stderr = if failed.is_none() { child.stderr.take() } else { None };
    if let Some(pipe) = stderr {
        match forward(pipe, Sink::Stderr, prefix, format!("rank-{rank}-stderr")) {
            Ok(h) => spawned.push(h),
            Err(e) => failed = Some(e),
        }
    }
    if let Some(e) = failed {
        let _ = child.kill();
        let _ = child.wait();
        for h in spawned {
            let _ = h.join();
        }
        return Err(anyhow::Error::new(e).context("starting a thread to forward its output"));
    }
    readers.extend(spawned);
    Ok(child)
}

/// Asks the kernel to send the rank SIGTERM when the launcher dies (Linux `PR_SET_PDEATHSIG`).
#[cfg(target_os = "linux")]
pub(crate) fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the hook runs in the forked child before exec; it only makes the async-signal-safe
    // calls prctl(2) and getppid(2) and builds io::Errors from raw OS codes, which allocates nothing.
    unsafe {
        cmd.pre_exec(move || pdeathsig(parent));
    }
}

#[cfg(target_os = "linux")]
fn pdeathsig(parent: u32) -> std::io::Result<()> {
    let zero: libc::c_ulong = 0;
    // SAFETY: prctl(PR_SET_PDEATHSIG, signal) only sets a flag of the calling process.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, zero, zero, zero) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The launcher died between fork and prctl: the signal will never come, so do not start.
    // SAFETY: getppid(2) has no preconditions.
    let ppid = unsafe { libc::getppid() };
    if u32::try_from(ppid).ok() != Some(parent) {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

/// A thread that copies `from` to `to` line by line, each line behind `prefix`, writing a whole
/// line under the stream's lock so that lines of different ranks never mix. Bytes that are not
/// UTF-8 pass through unchanged; a last line without a newline gets one.
fn forward(
    from: impl Read + Send + 'static,
    to: Sink,
    prefix: Vec<u8>,
    name: String,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || {
        let mut from = BufReader::new(from);
        let mut line = prefix.clone();
        loop {
            line.truncate(prefix.len());
            // read_until retries EINTR itself; another error is a pipe gone bad, as good as its end.
            if matches!(from.read_until(b'\n', &mut line), Ok(0) | Err(_)) {
                break;
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            // A closed stdout (`rlhf train --nproc 2 | head`) must not stop the draining: a rank
            // blocked on a full pipe would never exit.
            let _ = match to {
                Sink::Stdout => write_line(&mut std::io::stdout().lock(), &line),
                Sink::Stderr => write_line(&mut std::io::stderr().lock(), &line),
            };
        }
    })
}

fn write_line(out: &mut impl Write, line: &[u8]) -> std::io::Result<()> {
    out.write_all(line)?;
    out.flush()
}

/// One started rank and, once seen, how it ended.
struct RankProc {
    rank: usize,
    child: Child,
    exited: Option<ExitStatus>,
}

impl RankProc {
    /// Its exit status if it has exited (reaping it), `None` while it runs.
    fn poll(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        Ok(self.exited)
    }

    fn running(&mut self) -> bool {
        matches!(self.poll(), Ok(None))
    }
}

/// Polls until every rank has exited (`Ok(None)`) or one has failed. When several are seen failed
/// in one sweep, the one ended by a signal is named first: a rank killed from outside is the cause,
/// and its peers' "connection reset" exits are the consequence (a peer notices within
/// milliseconds, so both are often dead by the time the launcher looks). The others follow.
fn wait_all(ranks: &mut [RankProc]) -> anyhow::Result<Option<Failure>> {
    let mut forwarded = None;
    loop {
        // SIGTERM / SIGINT to the launcher: passed on once to every rank, which checkpoints and
        // exits with 128 + the signal; that exit is the request carried out, not a failure.
        let signal = rlhf_trainer::signals::requested();
        if let (Some(sig), None) = (signal, forwarded) {
            for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
                signal_rank(&mut r.child, sig);
            }
            forwarded = Some(sig);
        }
        let stopped_code = forwarded.map(|s| i32::from(rlhf_trainer::signals::exit_code(s)));
        let mut running = 0;
        let mut failed = Vec::new();
        for r in ranks.iter_mut() {
            match r.poll().with_context(|| format!("rank {}", r.rank))? {
                None => running += 1,
                Some(status) if status.code().is_some() && status.code() == stopped_code => {}
                Some(status) if !status.success() => failed.push((r.rank, status)),
                Some(_) => {}
            }
        }
        if !failed.is_empty() {
            // Stable: ranks ended by a signal first, then by rank.
            failed.sort_by_key(|(_, status)| status.code().is_some());
            return Ok(Some(Failure(failed)));
        }
        if running == 0 {
            if let Some(sig) = forwarded {
                let name = rlhf_trainer::signals::name(sig);
                return Err(rlhf_trainer::signals::Stopped {
                    signal: sig,
                    message: format!("stopped by {name}: every rank ended after its step (see rank 0's line above)"),
                }
                .into());
            }
            return Ok(None);
        }
        std::thread::sleep(POLL);
    }
}

/// The ranks seen failed in one sweep, the likely cause first.
struct Failure(Vec<(usize, ExitStatus)>);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ((rank, status), also) = self.0.split_first().expect("a failure names a rank");
        write!(f, "rank {rank} exited with {status}")?;
        for (rank, status) in also {
            write!(f, "; rank {rank} also exited with {status}")?;
        }
        Ok(())
    }
}

/// Stops every rank still running: SIGTERM, then SIGKILL for those still running after
/// [`GRACE`]; returns how many were running. Every rank is reaped when it returns.
fn stop(ranks: &mut [RankProc]) -> usize {
    let mut stopped = 0;
    for r in ranks.iter_mut() {
        if r.running() {
            terminate(&mut r.child);
            stopped += 1;
        }
    }
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline && ranks.iter_mut().any(RankProc::running) {
        std::thread::sleep(POLL);
    }
    for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
        if r.running() {
            tracing::warn!("rank {} still running {}s after SIGTERM; killing it", r.rank, GRACE.as_secs());
            let _ = r.child.kill();
        }
        if let Ok(status) = r.child.wait() {
            r.exited = Some(status);
        }
    }
    stopped
}

/// Sends `sig` to a rank still running.
#[cfg(unix)]
fn signal_rank(child: &mut Child, sig: i32) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on our own child, not reaped yet, so its pid is still ours.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

#[cfg(not(unix))]
fn signal_rank(child: &mut Child, _sig: i32) {
    let _ = child.kill();
}

/// SIGTERM, so that a rank can end the way it does on Ctrl-C.
#[cfg(unix)]
fn terminate(child: &mut Child) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        let _ = child.kill();
        return;
    };
    // SAFETY: kill(2) on our own child, which has not been reaped (it was just seen running), so
    // its pid cannot have been reused by another process.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

#[cfg(not(unix))]
fn terminate(child: &mut Child) {
    let _ = child.kill();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn strip(args: &[&str]) -> Vec<String> {
        let v: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        strip_nproc(&v)
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| map.get(k).cloned()
    }

    /// Rank 0 exits 1 because its peer went away; rank 1 was killed: rank 1 is named first even
    /// though the sweep meets rank 0 first.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_rank_killed_by_a_signal_is_named_before_its_peers() {
        let spawn = |rank, script: &str| RankProc {
            rank,
            child: Command::new("sh").args(["-c", script]).spawn().unwrap(),
            exited: None,
        };
        let mut ranks = [spawn(0, "exit 1"), spawn(1, "kill -9 $$")];
        // Both are zombies (ended, not yet reaped) before the launcher looks.
        let zombie = |r: &RankProc| {
            std::fs::read_to_string(format!("/proc/{}/stat", r.child.id()))
                .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
        };
        let t0 = Instant::now();
        while !ranks.iter().all(zombie) {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(5));
        }
        let failure = wait_all(&mut ranks).unwrap().expect("two ranks failed");
        assert_eq!(
            failure.to_string(),
            "rank 1 exited with signal: 9 (SIGKILL); rank 0 also exited with exit status: 1"
        );
    }

    #[test]
    fn nproc_is_stripped_in_both_forms() {
        assert_eq!(strip(&["train", "--nproc", "2", "--algo", "grpo"]), ["train", "--algo", "grpo"]);
        assert_eq!(strip(&["train", "--nproc=4", "--algo", "grpo"]), ["train", "--algo", "grpo"]);
        assert_eq!(strip(&["--log-level", "debug", "sft", "--nproc", "2"]), ["--log-level", "debug", "sft"]);
        assert_eq!(strip(&["dpo", "--nproc=2", "--nproc", "3"]), ["dpo"]);
        assert_eq!(strip(&["rm", "--nproc"]), ["rm"]);
    }

    #[test]
    fn other_arguments_stay_even_when_they_mention_nproc() {
        let args = ["train", "--set", "a=--nproc", "--set=b=--nproc=2", "--run-dir", "runs/--nproc", "--nprocs"];
        assert_eq!(strip(&args), args);
        assert_eq!(strip(&["train", "--nproc", "2", "--", "--nproc", "3"]), ["train", "--", "--nproc", "3"]);
        assert!(strip(&[]).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn non_utf8_arguments_pass_through() {
        use std::os::unix::ffi::OsStringExt;
        let odd = OsString::from_vec(vec![b'r', 0xff, b'n']);
        let args = [OsString::from("train"), OsString::from("--nproc=2"), OsString::from("--run-dir"), odd.clone()];
        assert_eq!(strip_nproc(&args), [OsString::from("train"), OsString::from("--run-dir"), odd]);
    }

    #[test]
    fn nproc_is_refused_under_a_launcher() {
        let msg = |pairs: &[(&str, &str)]| plan(Some(2), vars(pairs)).unwrap_err().to_string();
        let want =
            "--nproc 2 cannot be combined with a launcher's RANK/WORLD_SIZE (torchrun already started the ranks)";
        assert_eq!(msg(&[("RANK", "0"), ("WORLD_SIZE", "2")]), want);
        assert_eq!(msg(&[("RANK", "1")]), want);
        assert_eq!(msg(&[("WORLD_SIZE", "4")]), want);
        assert!(plan(Some(1), vars(&[("RANK", "0")])).is_err());
        // Without --nproc a rank started by torchrun just runs.
        assert_eq!(plan(None, vars(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap(), None);
    }

    #[test]
    fn nproc_zero_fails_one_runs_here_more_launch() {
        let none = vars(&[("MASTER_PORT", "29500")]);
        assert!(plan(Some(0), &none).unwrap_err().to_string().contains("--nproc 0"));
        assert_eq!(plan(Some(1), &none).unwrap(), None);
        assert_eq!(plan(Some(4), &none).unwrap(), Some(4));
        assert_eq!(plan(None, &none).unwrap(), None);
    }

    #[test]
    fn shared_env_defaults_and_callers_values() {
        let env = shared_env(2, vars(&[]), 16, || Ok(41234)).unwrap();
        let get = |e: &SharedEnv, k: &str| e.vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(&env, "MASTER_ADDR").as_deref(), Some("127.0.0.1"));
        assert_eq!(get(&env, "MASTER_PORT").as_deref(), Some("41234"));
        assert_eq!(get(&env, "WORLD_SIZE").as_deref(), Some("2"));
        assert_eq!(get(&env, "LOCAL_WORLD_SIZE").as_deref(), Some("2"));
        assert_eq!(get(&env, "OMP_NUM_THREADS").as_deref(), Some("8"));
        assert_eq!((env.master.as_str(), env.omp_threads), ("127.0.0.1:41234", Some(8)));

        let caller = vars(&[("MASTER_ADDR", "10.0.0.5"), ("MASTER_PORT", "29500"), ("OMP_NUM_THREADS", "3")]);
        let env = shared_env(4, caller, 16, || panic!("no port search when MASTER_PORT is set")).unwrap();
        assert_eq!(get(&env, "MASTER_ADDR").as_deref(), Some("10.0.0.5"));
        assert_eq!(get(&env, "MASTER_PORT").as_deref(), Some("29500"));
        assert_eq!((get(&env, "OMP_NUM_THREADS"), env.omp_threads), (None, None));

        let err = shared_env(2, vars(&[]), 4, || Err(std::io::Error::other("no sockets"))).unwrap_err();
        assert!(format!("{err:#}").contains("MASTER_PORT"), "{err:#}");
    }

    #[test]
    fn threads_are_shared_out_at_least_one_each() {
        assert_eq!(threads_per_rank(16, 2), 8);
        assert_eq!(threads_per_rank(16, 3), 5);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(1, 8), 1);
    }
}
