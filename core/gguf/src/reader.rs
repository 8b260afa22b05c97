//! Reading a GGUF file: header, metadata, tensor infos, and the tensor data.
//!
//! Layout (little-endian, versions 2 and 3; version 1 used 32-bit lengths and is not read):
//!
//! ```text
//! "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//! kv_count × (string key | u32 value_type | value)
//! tensor_count × (string name | u32 n_dims | n_dims × u64 dim | u32 ggml_type | u64 offset)
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset, offsets aligned
//! ```
//!
//! A string is `u64 length | UTF-8 bytes`; an array is `u32 element_type | u64 count | elements`.
//! Dimensions are listed innermost first: a `[rows, cols]` matrix is stored as `dims = [cols, rows]`.
//! Every length is checked against the bytes left before anything is allocated, so a corrupt or
//! truncated file gives an error naming the file, never a panic or a huge allocation.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::types::{GgmlType, Value, ValueType, ALL_TYPES};

/// The magic bytes at the start of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the tensor data when `general.alignment` is not set.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted (the format allows arrays of arrays).
const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's entry in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions as stored: innermost (contiguous) first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The row-major shape (`dims` reversed): `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of data.
    pub fn n_bytes(&self) -> u64 {
        self.n_elements() / self.ggml_type.block_size() * self.ggml_type.block_bytes()
    }
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; tensor data stays in the (memory-mapped) file until asked for.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of every tensor offset.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let meta = file.metadata().map_err(|e| GgufError::io(path, e))?;
        if !meta.is_file() {
            // Mapping a directory fails with "No such device", which names nothing useful.
            let what = if meta.is_dir() { "a directory" } else { "not a regular file" };
            return Err(GgufError::invalid(path, format!("is {what}, not a GGUF file")));
        }
        let len = meta.len();
        let bytes = if len == 0 {
            Bytes::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only; as with any mapped file, another process truncating
            // it while we read would be undefined behaviour, which we accept for model files.
            Bytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?)
        };
        Self::parse(path.to_path_buf(), bytes)
    }

    /// Parses a file already in memory; `path` only names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path.to_path_buf(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let data = bytes.as_slice();
        let mut c = Cursor { data, pos: 0, path: &path };
        let magic = c.take(4, "the magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { path: path.clone(), found: format!("\"{}\"", magic.escape_ascii()) });
        }
        let version = c.u32("the version")?;
        if version != 2 && version != 3 {
            // A big-endian file reads as a huge number here.
            if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                return Err(GgufError::unsupported(
                    &path,
                    format!("big-endian GGUF (version {}) is not supported", version.swap_bytes()),
                ));
            }
            return Err(GgufError::UnsupportedVersion { path: path.clone(), version });
        }
        let tensor_count = c.u64("the tensor count")?;
        let kv_count = c.u64("the metadata count")?;
        // Each entry takes at least 8 (key/name length) + 4 (type) bytes.
        c.check_count(kv_count, 12, "metadata entries")?;
        c.check_count(tensor_count, 8 + 4 + 4 + 8, "tensor infos")?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut keys = HashSet::new();
        for i in 0..kv_count {
            let key = c.string(&format!("the key of metadata entry {i}"))?;
            let what = format!("metadata `{key}`");
            let type_id = c.u32(&what)?;
            let value_type = ValueType::from_id(type_id)
                .ok_or_else(|| GgufError::invalid(&path, format!("{what}: unknown value type {type_id}")))?;
            let value = c.value(value_type, &what, 0)?;
            if !keys.insert(key.clone()) {
                return Err(GgufError::invalid(&path, format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::metadata(
                        &path,
                        "general.alignment",
                        format!("expected a power of two, got {v:?}"),
                    ))
                }
            },
        };

        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut names = HashSet::new();
        for i in 0..tensor_count {
            let info = tensor_info(&mut c, i, alignment)?;
            if !names.insert(info.name.clone()) {
                return Err(GgufError::invalid(&path, format!("tensor `{}` appears twice", info.name)));
            }
            tensors.push(info);
        }

        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let len = data.len() as u64;
        check_no_overlap(&path, &tensors)?;
        for t in &tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes()));
            match (start, end) {
                (Some(_), Some(end)) if end <= len => {}
                (start, end) => {
                    return Err(GgufError::Truncated {
                        path: path.clone(),
                        what: format!("the data of tensor `{}` ({} {:?})", t.name, t.ggml_type, t.dims),
                        offset: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        len,
                    })
                }
            }
        }
        Ok(GgufFile { path, bytes, version, metadata, tensors, alignment, data_offset })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file's bytes.
    pub fn file_bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A tensor info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (still quantised) bytes of a tensor of this file.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + tensor.offset) as usize;
        &self.bytes.as_slice()[start..start + tensor.n_bytes() as usize]
    }

    /// A tensor's elements as `f32`, in storage order (row-major for [`TensorInfo::shape`]).
    pub fn dequantize(&self, tensor: &TensorInfo) -> Result<Vec<f32>> {
        crate::dequant::dequantize(tensor.ggml_type, self.tensor_data(tensor), tensor.n_elements() as usize)
            .map_err(|message| GgufError::unsupported(&self.path, format!("tensor `{}`: {message}", tensor.name)))
    }
}
/// Tensor info `i` at the cursor: name, dimensions, type and data offset, checked (1 to
/// `MAX_DIMS` dimensions that do not overflow, a known type whose block size divides the first
/// dimension, an offset on the `alignment`).
fn tensor_info(c: &mut Cursor, i: u64, alignment: u64) -> Result<TensorInfo> {
    let path = c.path;
    let name = c.string(&format!("the name of tensor {i}"))?;
    let what = format!("tensor `{name}`");
    let n_dims = c.u32(&what)?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(GgufError::invalid(path, format!("{what}: {n_dims} dimensions (expected 1 to {MAX_DIMS})")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(&what)?);
    }
    let type_id = c.u32(&what)?;
    let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
        path: path.to_path_buf(),
        tensor: name.clone(),
        type_id,
        known: ALL_TYPES.iter().map(|t| format!("{t} ({})", t.id())).collect::<Vec<_>>().join(", "),
    })?;
    let offset = c.u64(&what)?;
    let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n < (1 << 60));
    if n_elements.is_none() {
        return Err(GgufError::invalid(path, format!("{what}: dimensions {dims:?} overflow")));
    }
    if dims[0] % ggml_type.block_size() != 0 {
        return Err(GgufError::invalid(
            path,
            format!(
                "{what}: its first dimension {} is not a multiple of the {ggml_type} block size {}",
                dims[0],
                ggml_type.block_size()
            ),
        ));
    }
    if offset % alignment != 0 {
        return Err(GgufError::invalid(
            path,
            format!("{what}: data offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(TensorInfo { name, dims, ggml_type, offset })
}

/// Refuses tensors whose data ranges overlap: each tensor must end at or before the next one (in
/// offset order) starts, as llama.cpp lays them out. Overlapping data would import one tensor's
/// bytes as another's.
fn check_no_overlap(path: &Path, tensors: &[TensorInfo]) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes() > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let end = a.offset.saturating_add(a.n_bytes());
        if end > b.offset {
            return Err(GgufError::invalid(
                path,
                format!(
                    "the data of tensors `{}` (bytes {}..{end} of the data section) and `{}` (from byte {}) overlap",
                    a.name, a.offset, b.name, b.offset
                ),
            ));
        }
    }
    Ok(())
}

/// Bounds-checked little-endian reading.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let len = self.data.len() as u64;
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= len).ok_or_else(|| GgufError::Truncated {
            path: self.path.to_path_buf(),
            what: what.to_owned(),
            offset: self.pos as u64,
            end: (self.pos as u64).saturating_add(n),
            len,
        })?;
        let slice = &self.data[self.pos..end as usize];
        self.pos = end as usize;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Fails (as truncation) when `count` items of at least `min_size` bytes cannot fit in the
    /// rest of the file, before anything is allocated for them.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<()> {
        let len = self.data.len() as u64;
        let need = count.checked_mul(min_size).and_then(|n| n.checked_add(self.pos as u64));
        match need {
            Some(end) if end <= len => Ok(()),
            end => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: format!("{count} {what}"),
                offset: self.pos as u64,
                end: end.unwrap_or(u64::MAX),
                len,
            }),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| GgufError::invalid(self.path, format!("{what}: the string at byte {start} is not UTF-8: {e}")))
    }

    fn value(&mut self, t: ValueType, what: &str, depth: usize) -> Result<Value> {
        Ok(match t {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::invalid(self.path, format!("{what}: bool byte {b} (expected 0 or 1)"))),
            },
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::invalid(
                        self.path,
                        format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let type_id = self.u32(what)?;
                let elem = ValueType::from_id(type_id).ok_or_else(|| {
                    GgufError::invalid(self.path, format!("{what}: unknown array element type {type_id}"))
                })?;
                let count = self.u64(what)?;
                self.check_count(count, elem.min_size(), &format!("array elements of {what}"))?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
