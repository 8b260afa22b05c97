//! [`EventWriter`]: one event file, TFRecord-framed `Event` records.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::crc::masked_crc32c;
use crate::{proto, Error};

/// Process-wide file counter: two writers of one process never share a file name, even when
/// created in the same second.
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes scalar metrics to one new TensorBoard event file.
///
/// The file is `<dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid>.<counter>` and starts
/// with an `Event` holding the creation wall time and `file_version = "brain.Event:2"`. TensorBoard
/// reads every `*tfevents*` file of a directory as one run, in file-name order.
///
/// Every event is flushed to the operating system as soon as it is written, so a killed process
/// loses at most the event being written. After a failed write the writer is poisoned: later
/// calls return [`Error::Poisoned`] rather than append after a possibly partial record.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
    poisoned: bool,
}

impl EventWriter {
    /// Creates `dir` (and its parents) if needed and a new event file in it, and writes the
    /// file-version event. Fails with [`Error::CreateDir`], [`Error::CreateFile`] or
    /// [`Error::Write`].
    pub fn create(dir: &Path) -> Result<EventWriter, Error> {
        fs::create_dir_all(dir).map_err(|source| Error::CreateDir { path: dir.to_path_buf(), source })?;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let counter = FILE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("events.out.tfevents.{}.{}.{}.{counter}", now.as_secs(), hostname(), std::process::id());
        let path = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|source| Error::CreateFile { path: path.clone(), source })?;
        let mut writer = EventWriter { path, out: BufWriter::new(file), poisoned: false };
        writer.write_event(&proto::file_version_event(now.as_secs_f64()))?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one `Event` at `step` (the x axis TensorBoard plots against) and `wall_time`
    /// (seconds since the Unix epoch) holding one `Summary` with one `simple_value` per
    /// `(tag, value)` pair, then flushes.
    ///
    /// Values are stored as f32, TensorBoard's scalar type (`value as f32`); NaN and ±inf are
    /// written as they are (TensorBoard accepts them). An empty `scalars` writes an event with an
    /// empty summary.
    pub fn add_scalars(&mut self, step: i64, wall_time: f64, scalars: &[(&str, f64)]) -> Result<(), Error> {
        self.write_event(&proto::scalars_event(step, wall_time, scalars))
    }

    /// Writes an `Event` at `step` with `session_log.status = START`, then flushes.
    ///
    /// Call it at the start of every run: a fresh run with its first step, a resumed run with
    /// the first step it will log again (the checkpoint's step + 1 when the checkpoint's own step
    /// was logged). What TensorBoard 2.21 does with it depends on the reader:
    ///
    /// - Python `EventAccumulator` (`purge_orphaned_data`, on by default): on reading a START it
    ///   discards every scalar read so far (earlier files of the run and earlier events of this
    ///   file, all tags) whose step is `>= step`, so the steps the crashed run logged past its
    ///   checkpoint disappear and the resumed run's values replace them, with no duplicates.
    /// - `plugin_event_accumulator` (`tensorboard --load_fast=false`): the same, except that it
    ///   ignores the first START of a run; without a START from the original run, the resumed
    ///   run's steps appear twice. Hence a START at the start of every run.
    /// - The Rust data server (`tensorboard`'s default when `tensorboard-data-server` is
    ///   installed) ignores SessionLog: per tag, a point at step `s` drops the points already
    ///   read at steps `>= s`. The repeated steps are replaced just the same, but a step logged
    ///   before the crash and not logged again stays; with `step` = the first step logged again
    ///   there is no such step and all three readers show the same curve.
    pub fn session_start(&mut self, step: i64, wall_time: f64) -> Result<(), Error> {
        self.write_event(&proto::session_start_event(step, wall_time))
    }

    /// Flushes buffered bytes to the operating system (every event is already flushed when
    /// written; this is for callers that want to be explicit).
    pub fn flush(&mut self) -> Result<(), Error> {
        self.check_poisoned()?;
        let result = self.out.flush();
        self.poison_on_error(result)
    }

    /// Frames `event` as one TFRecord, writes it and flushes.
    fn write_event(&mut self, event: &[u8]) -> Result<(), Error> {
        self.check_poisoned()?;
        let record = frame_record(event);
        let result = self.out.write_all(&record).and_then(|()| self.out.flush());
        self.poison_on_error(result)
    }

    fn check_poisoned(&self) -> Result<(), Error> {
        if self.poisoned {
            return Err(Error::Poisoned { path: self.path.clone() });
        }
        Ok(())
    }

    fn poison_on_error(&mut self, result: std::io::Result<()>) -> Result<(), Error> {
        result.map_err(|source| {
            self.poisoned = true;
            Error::Write { path: self.path.clone(), source }
        })
    }
}

/// One TFRecord: u64 LE length, masked CRC32C of those 8 bytes (u32 LE), the data, masked
/// CRC32C of the data (u32 LE).
pub(crate) fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&len);
    record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    record
}

/// The host name for the file name: /proc/sys/kernel/hostname, else `$HOSTNAME`, else
/// `localhost`; characters other than ASCII alphanumerics, `.`, `-` and `_` become `_` (a `/`
/// would otherwise name a subdirectory).
fn hostname() -> String {
    let raw = fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "localhost".to_string());
    raw.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect()
}
