//! [`WandbSink`]: the training-side handle and its background thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::error::WandbError;
use crate::protocol::{self, Record, RunInfo};
use crate::settings::{generate_run_id, WandbSettings};
use crate::transport::{later, Transport, TransportState};

/// Counters of a sink, from [`WandbSink::stats`] or [`WandbSink::finish`].
///
/// After a `finish` that did not time out, `lines_logged == lines_sent + lines_dropped`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WandbStats {
    /// `log` calls.
    pub lines_logged: u64,
    /// History lines the server acknowledged.
    pub lines_sent: u64,
    /// History lines given up on: queue full, retries exhausted, sink disabled, deadline passed.
    pub lines_dropped: u64,
    /// Lines neither sent nor dropped yet (queued or in flight).
    pub lines_pending: u64,
    /// Of `lines_dropped`, those `log` dropped because the queue was full.
    pub queue_full_drops: u64,
    /// History requests given up on after their retries.
    pub batches_dropped: u64,
    /// HTTP attempts made, retries and the GraphQL request included.
    pub requests: u64,
    /// Attempts that failed (no answer or a non-2xx status).
    pub failed_requests: u64,
    /// The sink stopped sending: run creation failed or the key was rejected.
    pub disabled: bool,
    /// The summary was acknowledged.
    pub summary_sent: bool,
    /// The final `complete` request was acknowledged.
    pub completed: bool,
    /// `finish` (or drop) returned at its deadline with the background thread still working.
    pub timed_out: bool,
    /// The last error, as text.
    pub last_error: Option<String>,
}

/// What `finish` hands the background thread.
struct Finish {
    summary: Map<String, Value>,
    exit_code: i32,
}

#[derive(Default)]
struct Control {
    /// Set by `finish`/drop: nothing may wait past it.
    deadline: Option<Instant>,
    finish: Option<Finish>,
    /// The background thread has returned.
    done: bool,
}

/// State shared by the sink handle and its thread.
pub(crate) struct Shared {
    start: Instant,
    lines_logged: AtomicU64,
    lines_sent: AtomicU64,
    lines_dropped: AtomicU64,
    queue_full_drops: AtomicU64,
    batches_dropped: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) failed_requests: AtomicU64,
    disabled: AtomicBool,
    summary_sent: AtomicBool,
    completed: AtomicBool,
    warned_queue_full: AtomicBool,
    warned_delivery: AtomicBool,
    warned_disabled: AtomicBool,
    run: OnceLock<RunInfo>,
    last_error: Mutex<Option<String>>,
    control: Mutex<Control>,
    changed: Condvar,
}

impl Shared {
    fn new() -> Self {
        Shared {
            start: Instant::now(),
            lines_logged: AtomicU64::new(0),
            lines_sent: AtomicU64::new(0),
            lines_dropped: AtomicU64::new(0),
            queue_full_drops: AtomicU64::new(0),
            batches_dropped: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            failed_requests: AtomicU64::new(0),
            disabled: AtomicBool::new(false),
            summary_sent: AtomicBool::new(false),
            completed: AtomicBool::new(false),
            warned_queue_full: AtomicBool::new(false),
            warned_delivery: AtomicBool::new(false),
            warned_disabled: AtomicBool::new(false),
            run: OnceLock::new(),
            last_error: Mutex::new(None),
            control: Mutex::new(Control::default()),
            changed: Condvar::new(),
        }
    }

    fn control(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_error(&self, error: &WandbError) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
    }

    fn drop_lines(&self, n: u64) {
        self.lines_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// Stops all sending; warns once per sink.
    fn disable(&self, what: &str, error: &WandbError) {
        self.set_error(error);
        self.disabled.store(true, Ordering::SeqCst);
        if !self.warned_disabled.swap(true, Ordering::SeqCst) {
            tracing::warn!("wandb: {what}: {error}; metrics will not be sent to W&B for the rest of this run");
        }
    }

    /// A request was given up on; warns once per sink.
    fn delivery_failed(&self, what: &str, error: &WandbError) {
        self.set_error(error);
        if !self.warned_delivery.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                "wandb: gave up on {what}: {error}; further failures are only counted (see the stats `finish` returns)"
            );
        }
    }

    fn stats(&self) -> WandbStats {
        let logged = self.lines_logged.load(Ordering::SeqCst);
        let sent = self.lines_sent.load(Ordering::SeqCst);
        let dropped = self.lines_dropped.load(Ordering::SeqCst);
        WandbStats {
            lines_logged: logged,
            lines_sent: sent,
            lines_dropped: dropped,
            lines_pending: logged.saturating_sub(sent + dropped),
            queue_full_drops: self.queue_full_drops.load(Ordering::SeqCst),
            batches_dropped: self.batches_dropped.load(Ordering::SeqCst),
            requests: self.requests.load(Ordering::SeqCst),
            failed_requests: self.failed_requests.load(Ordering::SeqCst),
            disabled: self.disabled.load(Ordering::SeqCst),
            summary_sent: self.summary_sent.load(Ordering::SeqCst),
            completed: self.completed.load(Ordering::SeqCst),
            timed_out: false,
            last_error: self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}

impl TransportState for Shared {
    /// Time until the finish deadline; `None` while there is none.
    fn time_left(&self) -> Option<Duration> {
        self.control().deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Sleeps `d`; `false` (at once) if that would pass the finish deadline, including one set
    /// while sleeping.
    fn sleep(&self, d: Duration) -> bool {
        let wake = later(Instant::now(), d);
        let mut control = self.control();
        loop {
            if control.deadline.is_some_and(|deadline| wake > deadline) {
                return false;
            }
            let now = Instant::now();
            if now >= wake {
                return true;
            }
            control = self.changed.wait_timeout(control, wake - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn count_request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn count_failure(&self) {
        self.failed_requests.fetch_add(1, Ordering::Relaxed);
    }
}

/// Marks the thread done however it ends (a panic included), waking `finish`.
struct DoneGuard(Arc<Shared>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        self.0.control().done = true;
        self.0.changed.notify_all();
    }
}

/// A W&B run fed from training code.
///
/// [`WandbSink::start`] returns at once; a background thread creates the run and uploads what
/// [`WandbSink::log`] queues. Nothing here blocks training or returns an error to it: network
/// trouble is retried, then counted ([`WandbStats`]) with at most one `tracing` warning per kind
/// of trouble (queue full, data given up on, sink disabled). [`WandbSink::finish`] (or dropping
/// the sink) uploads the rest, the summary and the exit code, waiting at most
/// [`WandbSettings::finish_timeout`].
///
/// A sink dropped without `finish` ends the run with exit code 1 (W&B shows it as failed) and the
/// automatic summary (the last value of every metric).
pub struct WandbSink {
    shared: Arc<Shared>,
    run_id: String,
    finish_timeout: Duration,
    tx: Option<SyncSender<Record>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for WandbSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WandbSink").field("run_id", &self.run_id).field("stats", &self.stats()).finish()
    }
}

impl WandbSink {
    /// Starts the background thread, which creates the run with `config` (any JSON; an object's
    /// top-level keys become the run's config keys) and then streams. Never blocks, never fails:
    /// if the thread cannot even be spawned the sink is disabled with a warning.
    pub fn start(settings: WandbSettings, config: Value) -> WandbSink {
        let shared = Arc::new(Shared::new());
        let run_id = settings.run_id.clone().unwrap_or_else(generate_run_id);
        let (tx, rx) = sync_channel(settings.queue_capacity.max(1));
        let finish_timeout = settings.finish_timeout;
        // The thread reports through the caller's subscriber, scoped ones included.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let thread_shared = Arc::clone(&shared);
        let thread_run_id = run_id.clone();
        let spawned = std::thread::Builder::new().name("wandb-sink".into()).spawn(move || {
            tracing::dispatcher::with_default(&dispatch, || {
                let _done = DoneGuard(Arc::clone(&thread_shared));
                Worker { settings, run_id: thread_run_id, shared: thread_shared, rx }.run(config);
            })
        });
        let (tx, thread) = match spawned {
            Ok(handle) => (Some(tx), Some(handle)),
            Err(e) => {
                shared.disable("could not start the upload thread", &WandbError::invalid("thread", e.to_string()));
                shared.control().done = true;
                (None, None)
            }
        };
        WandbSink { shared, run_id, finish_timeout, tx, thread }
    }

    /// Queues one history line: `metrics` plus `_step = step`, `_timestamp` (now, Unix seconds)
    /// and `_runtime` (seconds since `start`). Never blocks: when the queue is full, or the sink
    /// is disabled, the line is dropped and counted. W&B expects `step` not to decrease.
    pub fn log(&self, step: u64, metrics: Map<String, Value>) {
        let shared = &*self.shared;
        shared.lines_logged.fetch_add(1, Ordering::SeqCst);
        let Some(tx) = &self.tx else {
            shared.drop_lines(1);
            return;
        };
        if shared.disabled.load(Ordering::Relaxed) {
            shared.drop_lines(1);
            return;
        }
        let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let record = Record { step, timestamp, runtime: shared.start.elapsed().as_secs_f64(), metrics };
        match tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                shared.queue_full_drops.fetch_add(1, Ordering::Relaxed);
                shared.drop_lines(1);
                if !shared.warned_queue_full.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        "wandb: upload queue full, dropping history lines (uploads are falling behind); \
                         further drops are only counted"
                    );
                }
            }
            Err(TrySendError::Disconnected(_)) => shared.drop_lines(1),
        }
    }

    /// The counters now.
    pub fn stats(&self) -> WandbStats {
        self.shared.stats()
    }

    /// Where the run lives, once the server has created it.
    pub fn run_info(&self) -> Option<RunInfo> {
        self.shared.run.get().cloned()
    }

    /// The run id asked for (settings or generated); the server normally keeps it.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The sink gave up for good (run creation failed or the key was rejected).
    pub fn is_disabled(&self) -> bool {
        self.shared.disabled.load(Ordering::SeqCst)
    }

    /// Uploads what is queued, then `summary` (over the automatic one: the last value of every
    /// metric) and `exit_code`, waiting at most [`WandbSettings::finish_timeout`]. Returns the
    /// final counters; a timeout is reported there (`timed_out`), not as an error.
    pub fn finish(mut self, summary: Map<String, Value>, exit_code: i32) -> WandbStats {
        self.shutdown(summary, exit_code)
    }

    fn shutdown(&mut self, summary: Map<String, Value>, exit_code: i32) -> WandbStats {
        let deadline = later(Instant::now(), self.finish_timeout);
        {
            let mut control = self.shared.control();
            control.deadline = Some(deadline);
            control.finish = Some(Finish { summary, exit_code });
        }
        self.shared.changed.notify_all();
        // Disconnecting is the thread's signal to finish, once it has read what is queued.
        self.tx = None;
        let done = {
            let mut control = self.shared.control();
            loop {
                if control.done {
                    break true;
                }
                let now = Instant::now();
                if now >= deadline {
                    break false;
                }
                control =
                    self.shared.changed.wait_timeout(control, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
        };
        if let Some(thread) = self.thread.take() {
            if done {
                let _ = thread.join();
            }
            // Otherwise the thread is left to end on its own: it gives up at the deadline.
        }
        let mut stats = self.shared.stats();
        stats.timed_out = !done;
        if !done && !self.shared.warned_delivery.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                "wandb: finish gave up after {:?} with {} history lines unconfirmed",
                self.finish_timeout,
                stats.lines_pending
            );
        }
        stats
    }
}

impl Drop for WandbSink {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.shutdown(Map::new(), 1);
        }
    }
}

/// The background thread.
struct Worker {
    settings: WandbSettings,
    run_id: String,
    shared: Arc<Shared>,
    rx: Receiver<Record>,
}

impl Worker {
    fn run(self, config: Value) {
        let mut transport = match Transport::new(&self.settings, Arc::clone(&self.shared) as Arc<dyn TransportState>) {
            Ok(t) => t,
            Err(e) => {
                self.shared.disable("could not start", &e);
                return self.drain();
            }
        };
        let run = match self.create_run(&mut transport, &config) {
            Ok(run) => run,
            Err(e) => {
                let what = format!("could not create the run in {}/{}", self.settings.base_url, self.settings.project);
                self.shared.disable(&what, &e);
                return self.drain();
            }
        };
        tracing::info!(url = %run.url, "wandb: logging to {}", run.url);
        let _ = self.shared.run.set(run.clone());
        self.stream(&mut transport, &run);
    }

    /// Counts whatever is still queued or still arrives as dropped, until `finish` disconnects.
    fn drain(&self) {
        while self.rx.recv().is_ok() {
            self.shared.drop_lines(1);
        }
    }

    fn create_run(&self, transport: &mut Transport, config: &Value) -> Result<RunInfo, WandbError> {
        let s = &self.settings;
        let url = endpoint(&s.base_url, &["graphql"])?;
        let body = protocol::upsert_bucket_body(
            &self.run_id,
            &s.project,
            s.entity.as_deref(),
            s.run_name.as_deref(),
            s.group.as_deref(),
            &s.tags,
            config,
        );
        let reply = transport.post(&url, &body)?;
        protocol::parse_upsert_reply(url.as_str(), &reply, &self.run_id, &s.project, s.entity.as_deref(), &s.base_url)
    }

    fn stream(&self, transport: &mut Transport, run: &RunInfo) {
        let url = match endpoint(
            &self.settings.base_url,
            &["files", &run.entity, &run.project, &run.run_id, "file_stream"],
        ) {
            Ok(url) => url,
            Err(e) => {
                self.shared.disable("bad file-stream URL", &e);
                return self.drain();
            }
        };
        let mut stream = Stream {
            transport,
            shared: &self.shared,
            url,
            offset: run.history_line_count,
            pending: Vec::new(),
            max_lines: self.settings.max_lines_per_request.max(1),
            summary: Map::new(),
            max_retries: self.settings.max_retries,
        };
        let mut flush_due = Instant::now();
        let mut last_request = Instant::now();
        loop {
            if self.shared.disabled.load(Ordering::SeqCst) {
                return self.drain();
            }
            let now = Instant::now();
            let wake = if stream.pending.is_empty() {
                later(last_request, self.settings.heartbeat_interval)
            } else {
                flush_due
            };
            match self.rx.recv_timeout(wake.saturating_duration_since(now)) {
                Ok(record) => {
                    if stream.pending.is_empty() {
                        flush_due = later(Instant::now(), self.settings.flush_interval);
                    }
                    stream.push(record);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let now = Instant::now();
            if !stream.pending.is_empty() {
                if stream.pending.len() >= stream.max_lines || now >= flush_due {
                    stream.send_history_chunk();
                    last_request = Instant::now();
                }
            } else if now >= later(last_request, self.settings.heartbeat_interval) {
                stream.heartbeat();
                last_request = Instant::now();
            }
        }

        // `finish` or drop: the queue is empty and disconnected.
        let finish = self.shared.control().finish.take().unwrap_or(Finish { summary: Map::new(), exit_code: 1 });
        while !stream.pending.is_empty() && !self.shared.disabled.load(Ordering::SeqCst) {
            stream.send_history_chunk();
        }
        if self.shared.disabled.load(Ordering::SeqCst) {
            self.shared.drop_lines(stream.pending.len() as u64);
            return;
        }
        stream.finish(finish);
        let stats = self.shared.stats();
        tracing::info!(
            "wandb: run {} finished: {} history lines sent, {} dropped",
            run.url,
            stats.lines_sent,
            stats.lines_dropped
        );
    }
}

/// The file-stream side of a created run.
struct Stream<'a> {
    transport: &'a mut Transport,
    shared: &'a Shared,
    url: reqwest::Url,
    /// History lines the server holds: the next offset.
    offset: u64,
    pending: Vec<String>,
    max_lines: usize,
    /// The automatic summary: the last value of every key.
    summary: Map<String, Value>,
    max_retries: u32,
}

impl Stream<'_> {
    fn push(&mut self, record: Record) {
        let (line, fields) = protocol::history_line(record);
        self.summary.extend(fields);
        self.pending.push(line);
    }

    /// Sends up to `max_lines` pending lines; on failure they are dropped (offset unchanged, so
    /// the server's history stays contiguous).
    fn send_history_chunk(&mut self) {
        let n = self.pending.len().min(self.max_lines);
        let body = protocol::history_body(self.offset, &self.pending[..n]);
        match self.transport.post(&self.url, &body) {
            Ok(_) => {
                self.offset += n as u64;
                self.shared.lines_sent.fetch_add(n as u64, Ordering::SeqCst);
            }
            Err(e @ WandbError::Unauthorized { .. }) => {
                self.shared.disable("file stream refused", &e);
                self.shared.drop_lines(self.pending.len() as u64);
                self.pending.clear();
                return;
            }
            Err(e) => {
                self.shared.batches_dropped.fetch_add(1, Ordering::SeqCst);
                self.shared.drop_lines(n as u64);
                let what = match e {
                    WandbError::DeadlineExceeded => format!("{n} history lines"),
                    _ => format!("{n} history lines after {} retries", self.max_retries),
                };
                self.shared.delivery_failed(&what, &e);
            }
        }
        self.pending.drain(..n);
    }

    fn heartbeat(&mut self) {
        match self.transport.post(&self.url, &protocol::heartbeat_body()) {
            Ok(_) => {}
            Err(e @ WandbError::Unauthorized { .. }) => self.shared.disable("file stream refused", &e),
            Err(e) => {
                self.shared.set_error(&e);
                tracing::debug!("wandb: heartbeat failed: {e}");
            }
        }
    }

    fn finish(&mut self, finish: Finish) {
        let mut summary = std::mem::take(&mut self.summary);
        let runtime = self.shared.start.elapsed().as_secs_f64();
        summary.insert("_runtime".into(), json!(runtime));
        summary.insert("_wandb".into(), json!({ "runtime": runtime as u64 }));
        summary.extend(finish.summary);
        match self.transport.post(&self.url, &protocol::summary_body(&summary)) {
            Ok(_) => self.shared.summary_sent.store(true, Ordering::SeqCst),
            Err(e @ WandbError::Unauthorized { .. }) => return self.shared.disable("file stream refused", &e),
            Err(e) => self.shared.delivery_failed("the summary", &e),
        }
        match self.transport.post(&self.url, &protocol::complete_body(finish.exit_code)) {
            Ok(_) => self.shared.completed.store(true, Ordering::SeqCst),
            Err(e @ WandbError::Unauthorized { .. }) => self.shared.disable("file stream refused", &e),
            Err(e) => self.shared.delivery_failed("marking the run finished", &e),
        }
    }
}

/// `base` plus percent-encoded path segments.
fn endpoint(base: &str, segments: &[&str]) -> Result<reqwest::Url, WandbError> {
    let mut url = reqwest::Url::parse(base).map_err(|e| WandbError::invalid("base_url", e.to_string()))?;
    url.path_segments_mut()
        .map_err(|_| WandbError::invalid("base_url", format!("{base:?} cannot be a base")))?
        .pop_if_empty()
        .extend(segments);
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let url = endpoint("http://h:1/wandb", &["files", "e", "p", "r 1", "file_stream"]).unwrap();
        assert_eq!(url.as_str(), "http://h:1/wandb/files/e/p/r%201/file_stream");
        assert_eq!(endpoint("https://api.wandb.ai", &["graphql"]).unwrap().as_str(), "https://api.wandb.ai/graphql");
    }
}
