//! TensorBoard event files of scalar metrics, written by hand (no protobuf or TensorFlow
//! dependency) and readable by TensorBoard's own readers.
//!
//! [`EventWriter::create`] opens `<dir>/events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>`;
//! [`EventWriter::add_scalars`] appends one `Event` per step holding one `Summary.Value`
//! (`simple_value`, f32) per metric; [`EventWriter::session_start`] marks where a run starts
//! (again, after a resume), so that TensorBoard hides the steps a resumed run repeats.
//!
//! On disk each `Event` protobuf (tensorflow/core/util/event.proto) is one TFRecord: u64 LE
//! length, masked CRC32C of the length, the bytes, masked CRC32C of the bytes.

#![warn(missing_docs)]

mod crc;
mod error;
mod proto;
mod writer;

#[doc(hidden)]
pub mod reader;

#[cfg(test)]
mod tests;

pub use error::Error;
pub use writer::EventWriter;
