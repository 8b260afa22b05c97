//! Data saved by Hugging Face `datasets` with `Dataset.save_to_disk(DIR)`: `DIR/state.json` names
//! the Arrow files in order (`data-00000-of-00002.arrow`, ...), each an Arrow IPC stream of
//! record batches (an Arrow IPC file, the random-access format `pyarrow` also writes, is read
//! too), beside `dataset_info.json`. Rows become the JSON object a JSONL line would be
//! (through `arrow-json`: strings, numbers, lists, structs as objects; a null cell an absent
//! field), one batch at a time. A `DatasetDict` (`dataset_dict.json` and a directory per split)
//! is refused with the splits it holds: point the data at one of them.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Result, TrainerError};

/// Whether `spec` is a directory written by `save_to_disk` (a `Dataset` or a `DatasetDict`).
pub fn is_arrow_dir(spec: &str) -> bool {
    let p = Path::new(spec);
    p.is_dir() && (p.join("state.json").is_file() || p.join("dataset_dict.json").is_file())
}

/// The Arrow files of a saved `Dataset`, in the order `state.json` lists them.
pub fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let err = |message: String| TrainerError::Data { path: dir.to_path_buf(), message };
    if dir.join("dataset_dict.json").is_file() {
        let mut splits: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| TrainerError::io(dir, e))?
            .flatten()
            .filter(|e| e.path().join("state.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        splits.sort();
        let Some(first) = splits.first().cloned() else {
            return Err(err(
                "a DatasetDict (dataset_dict.json) with no split directories in it: nothing to read".into()
            ));
        };
        return Err(err(format!(
            "a DatasetDict of splits {}: name one split's directory ({})",
            splits.join(", "),
            dir.join(first).display()
        )));
    }
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(|e| TrainerError::io(&state_path, e))?;
    let state: Value = serde_json::from_str(&text).map_err(|e| err(format!("state.json: not JSON: {e}")))?;
    let listed =
        state.get("_data_files").and_then(Value::as_array).ok_or_else(|| err("state.json: no _data_files".into()))?;
    let files: Vec<PathBuf> = listed
        .iter()
        .map(|f| f.get("filename").and_then(Value::as_str).map(|n| dir.join(n)))
        .collect::<Option<_>>()
        .ok_or_else(|| err("state.json: a _data_files entry without a filename".into()))?;
    if files.is_empty() {
        return Err(err("state.json lists no Arrow files".into()));
    }
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(err(format!("{}: listed in state.json, not found", missing.display())));
    }
    Ok(files)
}

/// The column names of an Arrow file's schema.
pub fn columns(file: &Path) -> Result<Vec<String>> {
    let schema = match open(file)? {
        Reader::Stream(r) => r.schema(),
        Reader::File(r) => r.schema(),
    };
    Ok(schema.fields().iter().map(|f| f.name().clone()).collect())
}

/// An Arrow IPC stream (what `datasets` writes) or an Arrow IPC file (`ARROW1` magic, the
/// random-access format).
enum Reader {
    Stream(arrow_ipc::reader::StreamReader<BufReader<File>>),
    File(arrow_ipc::reader::FileReader<BufReader<File>>),
}

/// The magic bytes an Arrow IPC file starts (and ends) with.
const FILE_MAGIC: &[u8; 6] = b"ARROW1";

fn open(file: &Path) -> Result<Reader> {
    let mut f = File::open(file).map_err(|e| TrainerError::io(file, e))?;
    let mut magic = [0u8; 6];
    let is_file = f.read_exact(&mut magic).is_ok() && &magic == FILE_MAGIC;
    f.seek(SeekFrom::Start(0)).map_err(|e| TrainerError::io(file, e))?;
    let bad = |what: &str, e: String| TrainerError::Data {
        path: file.to_path_buf(),
        message: format!("not a readable {what}: {e}"),
    };
    if is_file {
        let r = arrow_ipc::reader::FileReader::try_new(BufReader::new(f), None)
            .map_err(|e| bad("Arrow IPC file (it starts with ARROW1)", e.to_string()))?;
        return Ok(Reader::File(r));
    }
    let r = arrow_ipc::reader::StreamReader::try_new(BufReader::new(f), None)
        .map_err(|e| bad("Arrow IPC stream (as `datasets` writes them)", e.to_string()))?;
    Ok(Reader::Stream(r))
}

/// Calls `f` with every row of `file` as a JSON object, in order, one record batch at a time.
pub fn for_each_row(file: &Path, mut f: impl FnMut(Map<String, Value>) -> Result<()>) -> Result<()> {
    let err = |message: String| TrainerError::Data { path: file.to_path_buf(), message };
    let batches: Box<dyn Iterator<Item = _>> = match open(file)? {
        Reader::Stream(r) => Box::new(r),
        Reader::File(r) => Box::new(r),
    };
    for batch in batches {
        let batch = batch.map_err(|e| err(format!("cannot read a record batch: {e}")))?;
        let mut out = arrow_json::LineDelimitedWriter::new(Vec::new());
        out.write(&batch).map_err(|e| err(format!("cannot convert a record batch: {e}")))?;
        out.finish().map_err(|e| err(format!("cannot convert a record batch: {e}")))?;
        for line in out.into_inner().split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice(line) {
                Ok(Value::Object(row)) => f(row)?,
                _ => return Err(err("a row that is not a JSON object".into())),
            }
        }
    }
    Ok(())
}
