//! Cross-checks against TensorBoard's own Python readers (through `RLHF_PYTHON`, set by
//! `cargo xtask test`, with `tensorboard` installed; under CI a missing interpreter fails instead
//! of skipping):
//! - every record of every file passes TensorBoard's strict TFRecord reader (both CRCs) and parses
//!   as an `event_pb2.Event` with the step, file version, session status and values written;
//! - `EventAccumulator` reports, per tag, exactly the (step, f32 value) points written;
//! - after a resume (`session_start` in a second file) `EventAccumulator` purges the first file's
//!   points at steps >= the start step and shows the resumed run's values, with no duplicates;
//! - `plugin_event_accumulator` (behind `tensorboard --load_fast=false`) ignores the first START
//!   of a run, and purges at a later one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use rlhf_tensorboard::EventWriter;

/// Reads a log directory with TensorBoard and prints one tab-separated line per item:
/// `RECORD <file> <step> file_version <version>` / `... session_log <status>` /
/// `... summary <tag>=<value>,...` for every record of every file (read with the strict reader,
/// which raises on a CRC mismatch), then `SCALAR <tag> <step> <value>` for every point the chosen
/// accumulator (`legacy` or `plugin`) keeps. Values are Python float reprs of f32s, so exact.
const SCRIPT: &str = r#"
import glob, os, sys
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

mode, logdir = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(os.path.join(logdir, "*tfevents*"))):
    reader = PyRecordReader_New(path)
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        ev = event_pb2.Event.FromString(reader.record())
        what = ev.WhichOneof("what")
        if what == "file_version":
            detail = ev.file_version
        elif what == "session_log":
            detail = str(ev.session_log.status)
        elif what == "summary":
            detail = ",".join(f"{v.tag}={v.simple_value!r}" for v in ev.summary.value)
        else:
            detail = ""
        print("RECORD", os.path.basename(path), ev.step, what, detail, sep="\t")

if mode == "legacy":
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(logdir)
    ea.Reload()
    for tag in sorted(ea.Tags()["scalars"]):
        for s in ea.Scalars(tag):
            print("SCALAR", tag, s.step, repr(s.value), sep="\t")
else:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    ea = EventAccumulator(logdir)
    ea.Reload()
    for tag in sorted(ea.Tags()["tensors"]):
        for t in ea.Tensors(tag):
            print("SCALAR", tag, t.step, repr(float(tensor_util.make_ndarray(t.tensor_proto).item())), sep="\t")
"#;

/// Per tag, the (step, value) points an accumulator keeps, in its order.
type Points = BTreeMap<String, Vec<(i64, f32)>>;

/// What the script printed: the `RECORD` lines (fields after the tag) and the scalar points.
struct Read {
    records: Vec<Vec<String>>,
    scalars: Points,
}

/// The interpreter, or `None` (after a skip line) outside CI when `RLHF_PYTHON` is unset.
fn python() -> Option<PathBuf> {
    match std::env::var_os("RLHF_PYTHON") {
        Some(py) => Some(PathBuf::from(py)),
        None if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false") => {
            panic!("RLHF_PYTHON is not set under CI: run the tests through `cargo xtask test`")
        }
        None => {
            eprintln!("RLHF_PYTHON not set: skipping the TensorBoard reader cross-check (use `cargo xtask test`)");
            None
        }
    }
}

fn read_with_tensorboard(py: &Path, mode: &str, logdir: &Path) -> Read {
    let out = Command::new(py).arg("-c").arg(SCRIPT).arg(mode).arg(logdir).output().expect("running RLHF_PYTHON");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "TensorBoard reader failed ({}):\n{stdout}\n{stderr}", out.status);
    let mut read = Read { records: Vec::new(), scalars: Points::new() };
    for line in stdout.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields.as_slice() {
            ["RECORD", rest @ ..] => read.records.push(rest.iter().map(|s| s.to_string()).collect()),
            ["SCALAR", tag, step, value] => {
                let value: f64 = value.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
                read.scalars.entry(tag.to_string()).or_default().push((step.parse().unwrap(), value as f32));
            }
            _ => panic!("unexpected line from the reader: {line:?}\nstderr:\n{stderr}"),
        }
    }
    read
}

fn f32s(points: &[(i64, f64)]) -> Vec<(i64, f32)> {
    points.iter().map(|&(step, v)| (step, v as f32)).collect()
}

#[test]
fn tensorboard_reads_what_was_written() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut writer = EventWriter::create(dir.path()).unwrap();
    writer.session_start(0, 100.0).unwrap();
    let steps: [(i64, &[(&str, f64)]); 3] = [
        (1, &[("loss", 0.693), ("reward/mean", -0.25), ("lr", 1e-6)]),
        (2, &[("loss", 0.5), ("reward/mean", 0.125)]),
        (3, &[("loss", 1.0 / 3.0), ("reward/mean", 1e10), ("lr", 3e-7)]),
    ];
    for (step, scalars) in steps {
        writer.add_scalars(step, 100.0 + step as f64, scalars).unwrap();
    }
    let name = writer.path().file_name().unwrap().to_str().unwrap().to_string();
    drop(writer);

    let read = read_with_tensorboard(&py, "legacy", dir.path());
    let record = |step: &str, what: &str, detail: &str| vec![name.clone(), step.into(), what.into(), detail.into()];
    assert_eq!(read.records[0], record("0", "file_version", "brain.Event:2"));
    assert_eq!(read.records[1], record("0", "session_log", "1"));
    assert_eq!(read.records.len(), 2 + steps.len());
    for (record, (step, scalars)) in read.records[2..].iter().zip(steps) {
        assert_eq!(record[..3], [name.clone(), step.to_string(), "summary".into()]);
        let values: Vec<(&str, f32)> = record[3]
            .split(',')
            .map(|kv| kv.split_once('=').unwrap())
            .map(|(tag, v)| (tag, v.parse::<f64>().unwrap() as f32))
            .collect();
        let written: Vec<(&str, f32)> = scalars.iter().map(|&(tag, v)| (tag, v as f32)).collect();
        assert_eq!(values, written, "record at step {step}");
    }

    let mut expected = Points::new();
    for (step, scalars) in steps {
        for &(tag, value) in scalars {
            expected.entry(tag.to_string()).or_default().push((step, value as f32));
        }
    }
    assert_eq!(read.scalars, expected);
}

/// Writes the interrupted run (steps 1..=4, `first` values) and the resumed one (START at 2,
/// steps 3..=4, `second` values) into `dir`, as two files in name order.
fn write_resumed_run(dir: &Path, start_first_run: bool) {
    let mut first = EventWriter::create(dir).unwrap();
    if start_first_run {
        first.session_start(0, 1000.0).unwrap();
    }
    for step in 1..=4 {
        first.add_scalars(step, 1000.0 + step as f64, &[("loss", step as f64), ("kl", -(step as f64))]).unwrap();
    }
    let mut second = EventWriter::create(dir).unwrap();
    assert!(second.path() > first.path(), "the resumed run's file must sort after the first");
    second.session_start(2, 2000.0).unwrap();
    for step in 3..=4 {
        second.add_scalars(step, 2000.0 + step as f64, &[("loss", 10.0 * step as f64), ("kl", 0.5)]).unwrap();
    }
}

#[test]
fn session_start_purges_the_steps_a_resumed_run_repeats() {
    let Some(py) = python() else { return };
    // Step 2 of the first run is gone too: the START purges steps >= its own step, and the
    // resumed run only wrote 3 and 4 again.
    let mut expected = Points::new();
    expected.insert("loss".into(), f32s(&[(1, 1.0), (3, 30.0), (4, 40.0)]));
    expected.insert("kl".into(), f32s(&[(1, -1.0), (3, 0.5), (4, 0.5)]));
    // The same whether or not the first run began with a START of its own.
    for start_first_run in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write_resumed_run(dir.path(), start_first_run);
        let read = read_with_tensorboard(&py, "legacy", dir.path());
        assert_eq!(read.scalars, expected, "first run with a START: {start_first_run}");
        assert_eq!(read.records.iter().filter(|r| r[2] == "session_log").count(), 1 + usize::from(start_first_run));
    }
}

#[test]
fn plugin_accumulator_purges_only_at_a_second_start() {
    let Some(py) = python() else { return };
    // Without a START in the first run, the resumed run's START is the run's first: no purge,
    // steps 3 and 4 appear twice.
    let dir = tempfile::tempdir().unwrap();
    write_resumed_run(dir.path(), false);
    let loss = &read_with_tensorboard(&py, "plugin", dir.path()).scalars["loss"];
    assert_eq!(*loss, f32s(&[(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (3, 30.0), (4, 40.0)]));

    // With a START at the beginning of every run, the resume purges as in the legacy reader.
    let dir = tempfile::tempdir().unwrap();
    write_resumed_run(dir.path(), true);
    let read = read_with_tensorboard(&py, "plugin", dir.path());
    assert_eq!(read.scalars["loss"], f32s(&[(1, 1.0), (3, 30.0), (4, 40.0)]));
    assert_eq!(read.scalars["kl"], f32s(&[(1, -1.0), (3, 0.5), (4, 0.5)]));
}
