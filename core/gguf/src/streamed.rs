//! `model.safetensors` written one tensor at a time, so that an import holds one tensor (and the
//! pending half of a two-part one) in memory instead of the whole model (a 7B model is 28 GB as
//! f32). safetensors' layout is an 8-byte little-endian header length, the JSON header (names,
//! dtypes, shapes, byte ranges), then the bytes: the bytes are written after room reserved for the
//! header (`header_room`, a bound the caller computes from the tensors it will write), and the
//! header, once every range is known, into that room, padded with spaces as safetensors pads it.
//! On an error (or a drop before [`Streamed::finish`]) the unfinished file is removed.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::error::{GgufError, Result};

/// A safetensors file being written.
pub(crate) struct Streamed {
    path: PathBuf,
    file: Option<BufWriter<File>>,
    /// safetensors' name of the dtype (`F32`, `BF16`).
    dtype: &'static str,
    /// Bytes reserved for the header (a multiple of 8).
    room: usize,
    /// Per tensor in the order written: name, shape, byte range after the header.
    entries: Vec<(String, Vec<usize>, [u64; 2])>,
    finished: bool,
}

impl Streamed {
    /// Starts `path` (its directory must exist) for tensors of `dtype` (`F32` or `BF16`), with at
    /// least `header_room` bytes for the header.
    pub(crate) fn create(path: &Path, dtype: &'static str, header_room: usize) -> Result<Self> {
        let room = header_room.div_ceil(8) * 8;
        let io = |e| GgufError::io(path, e);
        let mut file = BufWriter::new(File::create(path).map_err(io)?);
        file.seek(SeekFrom::Start(8 + room as u64)).map_err(io)?;
        let file = Some(file);
        Ok(Streamed { path: path.to_owned(), file, dtype, room, entries: Vec::new(), finished: false })
    }

    /// Appends a tensor: its name, shape and bytes (little-endian, of the file's dtype).
    pub(crate) fn push(&mut self, name: String, shape: Vec<usize>, bytes: &[u8]) -> Result<()> {
        let start = self.entries.last().map_or(0, |(_, _, [_, end])| *end);
        let file = self.file.as_mut().expect("the file is open until finish");
        file.write_all(bytes).map_err(|e| GgufError::io(&self.path, e))?;
        self.entries.push((name, shape, [start, start + bytes.len() as u64]));
        Ok(())
    }

    /// Writes the header with `metadata` (safetensors' `__metadata__`) into its room; returns how
    /// many tensors the file holds.
    pub(crate) fn finish(mut self, metadata: &[(&str, &str)]) -> Result<usize> {
        let mut header = Map::new();
        let meta: Map<String, Value> = metadata.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
        header.insert("__metadata__".into(), Value::Object(meta));
        for (name, shape, offsets) in &self.entries {
            header.insert(name.clone(), json!({"dtype": self.dtype, "shape": shape, "data_offsets": offsets}));
        }
        let mut text = serde_json::to_string(&Value::Object(header)).expect("JSON values serialise");
        if text.len() > self.room {
            return Err(GgufError::io(
                &self.path,
                std::io::Error::other(format!("a header of {} bytes exceeds the {} reserved", text.len(), self.room)),
            ));
        }
        text.push_str(&" ".repeat(self.room - text.len()));
        let io = |e| GgufError::io(&self.path, e);
        let mut file = self.file.take().expect("the file is open until finish");
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&(self.room as u64).to_le_bytes()).map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.into_inner().map_err(|e| io(e.into_error()))?;
        self.finished = true;
        Ok(self.entries.len())
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        if !self.finished {
            self.file = None;
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tensors written one by one read back with safetensors' own parser; an unfinished file
    /// and one whose header outgrew its room are removed.
    #[test]
    fn tensors_written_one_by_one_read_back_and_unfinished_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut file = Streamed::create(&path, "F32", 400).unwrap();
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        file.push("b.weight".into(), vec![2, 3], &a).unwrap();
        file.push("a.bias".into(), vec![1], &7.0f32.to_le_bytes()).unwrap();
        assert_eq!(file.finish(&[("format", "pt")]).unwrap(), 2);
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        let b = st.tensor("b.weight").unwrap();
        assert_eq!((b.shape(), b.data()), (&[2usize, 3][..], &a[..]));
        assert_eq!(st.tensor("a.bias").unwrap().data(), &7.0f32.to_le_bytes()[..]);

        let unfinished = Streamed::create(&path, "F32", 100).unwrap();
        drop(unfinished);
        assert!(!path.exists());
        let mut cramped = Streamed::create(&path, "F32", 8).unwrap();
        cramped.push("c".into(), vec![1], &0.0f32.to_le_bytes()).unwrap();
        assert!(cramped.finish(&[]).unwrap_err().to_string().contains("reserved"));
        assert!(!path.exists());
    }
}
