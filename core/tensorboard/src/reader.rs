//! A minimal event-file reader for tests: TFRecord framing with both CRCs checked, and the
//! `Event` fields this crate writes. Unknown fields are skipped.

use std::path::{Path, PathBuf};

use crate::crc::masked_crc32c;
use crate::proto::{
    EVENT_FILE_VERSION, EVENT_SESSION_LOG, EVENT_STEP, EVENT_SUMMARY, EVENT_WALL_TIME, SESSION_LOG_STATUS,
    SUMMARY_VALUE, VALUE_SIMPLE_VALUE, VALUE_TAG, WIRE_FIXED32, WIRE_FIXED64, WIRE_LEN, WIRE_VARINT,
};
use crate::Error;

/// One decoded `Event`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecodedEvent {
    /// `wall_time`, seconds since the Unix epoch.
    pub wall_time: f64,
    /// `step`.
    pub step: i64,
    /// `file_version`, when the event holds one.
    pub file_version: Option<String>,
    /// `(tag, simple_value)` of each `summary.value`, in order.
    pub scalars: Vec<(String, f32)>,
    /// `session_log.status`, when the event holds a session log (1 = START).
    pub session_status: Option<i32>,
}

/// The data of every record of the file at `path`, both masked CRCs checked.
pub fn read_records(path: &Path) -> Result<Vec<Vec<u8>>, Error> {
    Ok(read_framed(path)?.into_iter().map(|(_, data)| data).collect())
}

/// Every record of the file at `path`, decoded as an `Event`.
pub fn read_events(path: &Path) -> Result<Vec<DecodedEvent>, Error> {
    let records = read_framed(path)?;
    records
        .iter()
        .map(|(offset, data)| {
            decode_event(data).map_err(|what| Error::Corrupt { path: PathBuf::from(path), offset: *offset, what })
        })
        .collect()
}

/// `(byte offset of the record, data)` of every record, both masked CRCs checked.
fn read_framed(path: &Path) -> Result<Vec<(u64, Vec<u8>)>, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Read { path: path.to_path_buf(), source })?;
    let corrupt =
        |offset: usize, what: String| Error::Corrupt { path: path.to_path_buf(), offset: offset as u64, what };
    let mut records = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let header = bytes.get(pos..pos + 12).ok_or_else(|| corrupt(pos, "truncated record header".into()))?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes) != u32_le(len_crc) {
            return Err(corrupt(pos, "length CRC mismatch".into()));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        let end = usize::try_from(len).ok().and_then(|len| (pos + 12).checked_add(len)).filter(|&e| e <= bytes.len());
        let end = end.ok_or_else(|| corrupt(pos, format!("record of {len} bytes runs past the end")))?;
        let data = &bytes[pos + 12..end];
        let data_crc = bytes.get(end..end + 4).ok_or_else(|| corrupt(pos, "truncated data CRC".into()))?;
        if masked_crc32c(data) != u32_le(data_crc) {
            return Err(corrupt(pos, "data CRC mismatch".into()));
        }
        records.push((pos as u64, data.to_vec()));
        pos = end + 4;
    }
    Ok(records)
}

/// Decodes one `Event` message.
pub fn decode_event(data: &[u8]) -> Result<DecodedEvent, String> {
    let mut event = DecodedEvent::default();
    for field in Fields::new(data) {
        match field? {
            (EVENT_WALL_TIME, Value::Fixed64(bits)) => event.wall_time = f64::from_bits(bits),
            (EVENT_STEP, Value::Varint(v)) => event.step = v as i64,
            (EVENT_FILE_VERSION, Value::Len(s)) => event.file_version = Some(utf8(s)?),
            (EVENT_SUMMARY, Value::Len(summary)) => decode_summary(summary, &mut event.scalars)?,
            (EVENT_SESSION_LOG, Value::Len(log)) => {
                let mut status = 0; // proto3 default: STATUS_UNSPECIFIED
                for field in Fields::new(log) {
                    if let (SESSION_LOG_STATUS, Value::Varint(v)) = field? {
                        status = v as i32;
                    }
                }
                event.session_status = Some(status);
            }
            _ => {}
        }
    }
    Ok(event)
}

fn decode_summary(summary: &[u8], scalars: &mut Vec<(String, f32)>) -> Result<(), String> {
    for field in Fields::new(summary) {
        let (SUMMARY_VALUE, Value::Len(value)) = field? else { continue };
        let (mut tag, mut simple) = (String::new(), None);
        for field in Fields::new(value) {
            match field? {
                (VALUE_TAG, Value::Len(s)) => tag = utf8(s)?,
                (VALUE_SIMPLE_VALUE, Value::Fixed32(bits)) => simple = Some(f32::from_bits(bits)),
                _ => {}
            }
        }
        scalars.push((tag, simple.ok_or("summary value without simple_value")?));
    }
    Ok(())
}

fn utf8(bytes: &[u8]) -> Result<String, String> {
    String::from_utf8(bytes.to_vec()).map_err(|e| format!("string field is not UTF-8: {e}"))
}

fn u32_le(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes.try_into().expect("4 bytes"))
}

/// A field's payload by wire type.
enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Len(&'a [u8]),
    Fixed32(u32),
}

/// Iterates over the `(field number, value)` pairs of one message.
struct Fields<'a> {
    data: &'a [u8],
    failed: bool,
}

impl<'a> Fields<'a> {
    fn new(data: &'a [u8]) -> Self {
        Fields { data, failed: false }
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for (i, &byte) in self.data.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.data = &self.data[i + 1..];
                return Ok(value);
            }
        }
        Err("truncated or overlong varint".into())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.data.len() {
            return Err(format!("field of {n} bytes runs past the end of its message"));
        }
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        Ok(head)
    }

    fn field(&mut self) -> Result<(u32, Value<'a>), String> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).map_err(|_| format!("field number {} too large", key >> 3))?;
        let value = match (key & 7) as u8 {
            WIRE_VARINT => Value::Varint(self.varint()?),
            WIRE_FIXED64 => Value::Fixed64(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"))),
            WIRE_LEN => {
                let len = usize::try_from(self.varint()?).map_err(|_| "length overflows usize".to_string())?;
                Value::Len(self.take(len)?)
            }
            WIRE_FIXED32 => Value::Fixed32(u32_le(self.take(4)?)),
            wire => return Err(format!("unsupported wire type {wire} for field {number}")),
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.data.is_empty() || self.failed {
            return None;
        }
        let field = self.field();
        self.failed = field.is_err();
        Some(field)
    }
}
