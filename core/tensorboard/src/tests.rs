//! Round trips through the writer and the test reader.

use std::fs;

use crate::reader::{read_events, read_records, DecodedEvent};
use crate::writer::frame_record;
use crate::{Error, EventWriter};

fn write_sample(dir: &std::path::Path) -> EventWriter {
    let mut writer = EventWriter::create(dir).unwrap();
    writer.session_start(0, 1000.0).unwrap();
    writer.add_scalars(1, 1001.0, &[("loss", 0.5), ("reward/mean", -1.25)]).unwrap();
    writer.add_scalars(2, 1002.0, &[("loss", 0.1), ("reward/mean", 3.0e40), ("kl", f64::NAN)]).unwrap();
    writer.add_scalars(300, 1003.5, &[("loss", 1.0 / 3.0)]).unwrap();
    writer.flush().unwrap();
    writer
}

#[test]
fn written_file_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let writer = write_sample(&dir.path().join("nested/run"));
    let events = read_events(writer.path()).unwrap();
    assert_eq!(events.len(), 5);

    let first = &events[0];
    assert_eq!(first.file_version.as_deref(), Some("brain.Event:2"));
    assert!(first.wall_time > 1.6e9, "file-version wall time is now: {}", first.wall_time);
    assert_eq!(events[1], DecodedEvent { wall_time: 1000.0, session_status: Some(1), ..Default::default() });

    let steps: Vec<i64> = events[2..].iter().map(|e| e.step).collect();
    assert_eq!(steps, [1, 2, 300]);
    assert_eq!(events[4].wall_time, 1003.5);
    assert_eq!(events[2].scalars, [("loss".to_string(), 0.5f32), ("reward/mean".to_string(), -1.25f32)]);
    let step2 = &events[3].scalars;
    assert_eq!(step2[0], ("loss".to_string(), 0.1f64 as f32));
    assert_eq!(step2[1], ("reward/mean".to_string(), f32::INFINITY), "out of f32 range");
    assert_eq!(step2[2].0, "kl");
    assert!(step2[2].1.is_nan());
    assert_eq!(events[4].scalars, [("loss".to_string(), (1.0f64 / 3.0) as f32)]);
    assert!(events[2..].iter().all(|e| e.file_version.is_none() && e.session_status.is_none()));
}

#[test]
fn file_name_and_unique_per_writer() {
    let dir = tempfile::tempdir().unwrap();
    let a = EventWriter::create(dir.path()).unwrap();
    let b = EventWriter::create(dir.path()).unwrap();
    assert_ne!(a.path(), b.path());
    for writer in [&a, &b] {
        assert_eq!(writer.path().parent(), Some(dir.path()));
        let name = writer.path().file_name().unwrap().to_str().unwrap();
        let rest = name.strip_prefix("events.out.tfevents.").unwrap();
        let secs = rest.split('.').next().unwrap();
        assert!(secs.parse::<u64>().unwrap() > 1_600_000_000, "{name}");
        let mut tail = rest.rsplit('.');
        let (counter, pid) = (tail.next().unwrap(), tail.next().unwrap());
        counter.parse::<u64>().unwrap();
        assert_eq!(pid, std::process::id().to_string(), "{name}");
    }
}

#[test]
fn corrupted_bytes_fail_the_crc_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_sample(dir.path()).path().to_path_buf();
    let good = fs::read(&path).unwrap();
    assert_eq!(read_records(&path).unwrap().len(), 5);

    let first_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let second = first_len + 16; // offset of the second record
    for (offset, expected) in [(second + 20, "data CRC mismatch"), (second + 1, "length CRC mismatch")] {
        let mut bad = good.clone();
        bad[offset] ^= 0x04;
        fs::write(&path, &bad).unwrap();
        match read_records(&path) {
            Err(Error::Corrupt { path: p, offset: at, what }) => {
                assert_eq!(p, path);
                assert_eq!(at, second as u64);
                assert_eq!(what, expected);
            }
            other => panic!("byte {offset} flipped: expected a CRC error, got {other:?}"),
        }
    }
    fs::write(&path, &good[..good.len() - 2]).unwrap();
    let err = read_records(&path).unwrap_err();
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    assert!(err.to_string().contains("truncated data CRC"), "{err}");
}

#[test]
fn record_framing_layout() {
    let record = frame_record(b"abc");
    assert_eq!(record.len(), 3 + 16);
    assert_eq!(&record[..8], 3u64.to_le_bytes());
    assert_eq!(&record[8..12], crate::crc::masked_crc32c(&3u64.to_le_bytes()).to_le_bytes());
    assert_eq!(&record[12..15], b"abc");
    assert_eq!(&record[15..], crate::crc::masked_crc32c(b"abc").to_le_bytes());
}

#[test]
fn create_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    fs::write(&file, b"").unwrap();
    let err = EventWriter::create(&file.join("run")).unwrap_err();
    assert!(matches!(err, Error::CreateDir { .. }), "{err:?}");
    assert!(err.to_string().contains(&file.join("run").display().to_string()), "{err}");
}
