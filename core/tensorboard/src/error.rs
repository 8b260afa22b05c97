//! The crate's error type.

use std::path::PathBuf;

/// Why an event file could not be created, written or (for the test reader) read back. Every
/// message is one line and names the path concerned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The log directory could not be created.
    #[error("cannot create the TensorBoard log directory {}: {source}", .path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The event file could not be created (it is opened with `create_new`, so an existing file
    /// of the same name is an error too).
    #[error("cannot create the TensorBoard event file {}: {source}", .path.display())]
    CreateFile {
        /// The event file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Writing or flushing a record failed; the writer refuses further events (see
    /// [`Error::Poisoned`]).
    #[error("cannot write to the TensorBoard event file {}: {source}", .path.display())]
    Write {
        /// The event file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An earlier write failed, so the file may end in a partial record; appending after it
    /// would make readers stop there, so nothing more is written.
    #[error("TensorBoard event file {} is no longer written: an earlier write failed", .path.display())]
    Poisoned {
        /// The event file.
        path: PathBuf,
    },
    /// The event file could not be read (test reader only).
    #[error("cannot read the TensorBoard event file {}: {source}", .path.display())]
    Read {
        /// The event file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A record's framing, checksum or protobuf content is invalid (test reader only).
    #[error("corrupt TensorBoard event file {} at byte {offset}: {what}", .path.display())]
    Corrupt {
        /// The event file.
        path: PathBuf,
        /// Byte offset of the record's start in the file.
        offset: u64,
        /// What was wrong.
        what: String,
    },
}
