//! Hand-written protobuf encoding of the few `Event` shapes this crate writes
//! (tensorflow/core/util/event.proto and tensorflow/core/framework/summary.proto).

/// `Event.wall_time`: double, seconds since the Unix epoch.
pub(crate) const EVENT_WALL_TIME: u32 = 1;
/// `Event.step`: int64.
pub(crate) const EVENT_STEP: u32 = 2;
/// `Event.file_version`: string (oneof `what`).
pub(crate) const EVENT_FILE_VERSION: u32 = 3;
/// `Event.summary`: `Summary` (oneof `what`).
pub(crate) const EVENT_SUMMARY: u32 = 5;
/// `Event.session_log`: `SessionLog` (oneof `what`). Field 6 is the deprecated `log_message`.
pub(crate) const EVENT_SESSION_LOG: u32 = 7;
/// `Summary.value`: repeated `Summary.Value`.
pub(crate) const SUMMARY_VALUE: u32 = 1;
/// `Summary.Value.tag`: string.
pub(crate) const VALUE_TAG: u32 = 1;
/// `Summary.Value.simple_value`: float (oneof `value`).
pub(crate) const VALUE_SIMPLE_VALUE: u32 = 2;
/// `SessionLog.status`: enum `SessionStatus`.
pub(crate) const SESSION_LOG_STATUS: u32 = 1;

/// Wire type of varints (int64, enums).
pub(crate) const WIRE_VARINT: u8 = 0;
/// Wire type of 8-byte little-endian values (double).
pub(crate) const WIRE_FIXED64: u8 = 1;
/// Wire type of length-delimited values (strings, messages).
pub(crate) const WIRE_LEN: u8 = 2;
/// Wire type of 4-byte little-endian values (float).
pub(crate) const WIRE_FIXED32: u8 = 5;

/// The `file_version` of the first event of every file; TensorBoard reads the number after the
/// colon and, at 2 or more, purges on `SessionLog.START` instead of on out-of-order steps.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `SessionLog.SessionStatus.START`.
pub const SESSION_STATUS_START: i32 = 1;

/// Appends `value` as a base-128 varint (1 to 10 bytes, least significant group first).
pub fn put_varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push((value as u8) | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

fn put_key(buf: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(buf, u64::from(field) << 3 | u64::from(wire));
}

fn put_len_delimited(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(buf, field, WIRE_LEN);
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// Starts an `Event` with its `wall_time` (seconds) and `step` fields.
fn event_header(step: i64, wall_time: f64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64);
    put_key(&mut buf, EVENT_WALL_TIME, WIRE_FIXED64);
    buf.extend_from_slice(&wall_time.to_le_bytes());
    put_key(&mut buf, EVENT_STEP, WIRE_VARINT);
    // Negative int64s are sign-extended to 64 bits: always 10 bytes.
    put_varint(&mut buf, step as u64);
    buf
}

/// The first event of a file: `wall_time` and `file_version = "brain.Event:2"` (step 0).
pub(crate) fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut buf = event_header(0, wall_time);
    put_len_delimited(&mut buf, EVENT_FILE_VERSION, FILE_VERSION.as_bytes());
    buf
}

/// An event holding one `Summary` with one `simple_value` per `(tag, value)`; values are
/// narrowed to f32 (`as f32`: NaN stays NaN, out-of-range values become ±inf).
pub(crate) fn scalars_event(step: i64, wall_time: f64, scalars: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::with_capacity(scalars.iter().map(|(tag, _)| tag.len() + 10).sum());
    let mut value = Vec::new();
    for (tag, v) in scalars {
        value.clear();
        put_len_delimited(&mut value, VALUE_TAG, tag.as_bytes());
        put_key(&mut value, VALUE_SIMPLE_VALUE, WIRE_FIXED32);
        value.extend_from_slice(&(*v as f32).to_le_bytes());
        put_len_delimited(&mut summary, SUMMARY_VALUE, &value);
    }
    let mut buf = event_header(step, wall_time);
    put_len_delimited(&mut buf, EVENT_SUMMARY, &summary);
    buf
}

/// An event holding a `SessionLog` with `status = START`.
pub(crate) fn session_start_event(step: i64, wall_time: f64) -> Vec<u8> {
    let mut session_log = Vec::with_capacity(2);
    put_key(&mut session_log, SESSION_LOG_STATUS, WIRE_VARINT);
    put_varint(&mut session_log, SESSION_STATUS_START as u64);
    let mut buf = event_header(step, wall_time);
    put_len_delimited(&mut buf, EVENT_SESSION_LOG, &session_log);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(value: u64) -> Vec<u8> {
        let mut buf = Vec::new();
        put_varint(&mut buf, value);
        buf
    }

    #[test]
    fn varint_encoding() {
        assert_eq!(varint(0), [0x00]);
        assert_eq!(varint(1), [0x01]);
        assert_eq!(varint(127), [0x7f]);
        assert_eq!(varint(128), [0x80, 0x01]);
        assert_eq!(varint(300), [0xac, 0x02]);
        assert_eq!(varint(-1i64 as u64), [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert_eq!(varint(u64::MAX).len(), 10);
    }

    #[test]
    fn scalar_event_bytes() {
        let bytes = scalars_event(3, 1.5, &[("a", 2.0)]);
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 0x03, 0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15]);
        expected.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(bytes, expected);
    }

    #[test]
    fn session_start_event_bytes() {
        let bytes = session_start_event(7, 0.0);
        // Field 7, wire type 2: key 0x3a (0x32 would be field 6, the deprecated `log_message`).
        assert_eq!(&bytes[9..], [0x10, 0x07, 0x3a, 0x02, 0x08, 0x01]);
    }
}
