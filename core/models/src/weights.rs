//! Reading and writing safetensors checkpoints, single-file or sharded with
//! `model.safetensors.index.json`, and [`WeightLoader`]: the scoped, shape-checked way every layer
//! fetches its tensors (after candle's `VarBuilder`). Loaded tensors become variables of a
//! `tch::nn::VarStore` under their Hugging Face names, so optimizers and saving see the same names.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::Deserialize;
use tch::{nn, Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Every tensor of a checkpoint, on CPU in its stored dtype, with the file it came from, and
/// the names a model has taken from it ([`Checkpoint::check_all_used`]).
pub struct Checkpoint {
    tensors: HashMap<String, (Tensor, PathBuf)>,
    files: Vec<PathBuf>,
    used: std::cell::RefCell<HashSet<String>>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::BOOL => Kind::Bool,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Bool => Dtype::BOOL,
        _ => return None,
    })
}

impl Checkpoint {
    /// Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let files: Vec<PathBuf> = if index_path.exists() {
            let index: Index = crate::config::read_json(&index_path)?;
            let mut seen = HashSet::new();
            let mut files = Vec::new();
            for shard in index.weight_map.values() {
                // A shard is a file of this directory, never a path out of it.
                let plain =
                    std::path::Path::new(shard).components().all(|c| matches!(c, std::path::Component::Normal(_)));
                if !plain || shard.is_empty() {
                    return Err(ModelError::Json {
                        path: index_path,
                        message: format!("weight_map: the shard `{shard}` is not a file name inside the directory"),
                    });
                }
                if seen.insert(shard.clone()) {
                    files.push(dir.join(shard));
                }
            }
            if files.is_empty() {
                return Err(ModelError::Json { path: index_path, message: "weight_map: empty".into() });
            }
            files
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::MissingFile { path: single });
        };
        let mut tensors = HashMap::new();
        for file in &files {
            read_file(file, &mut tensors)?;
        }
        Ok(Checkpoint { tensors, files, used: Default::default() })
    }

    /// The tensors whose names start with `prefix`, as stored (on the CPU, in their dtype),
    /// counted as used: parts of a checkpoint a model carries through unchanged.
    pub fn passthrough(&self, prefix: &str) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .tensors
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(n, (t, _))| (n.clone(), t.shallow_clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        self.used.borrow_mut().extend(out.iter().map(|(n, _)| n.clone()));
        out
    }

    /// Refuses a checkpoint holding tensors no layer of the model took (nor `ignorable` allows),
    /// naming the first few: a config with fewer layers than its checkpoint, or a checkpoint of
    /// another architecture, would otherwise load and compute something else without a word.
    pub fn check_all_used(&self, ignorable: impl Fn(&str) -> bool) -> Result<()> {
        let used = self.used.borrow();
        let mut unused: Vec<&String> =
            self.tensors.keys().filter(|n| !used.contains(n.as_str()) && !ignorable(n.as_str())).collect();
        if unused.is_empty() {
            return Ok(());
        }
        unused.sort();
        let n = unused.len();
        let shown: Vec<String> = unused.iter().take(4).map(|u| format!("`{u}`")).collect();
        let more = if n > 4 { format!(" and {} more", n - 4) } else { String::new() };
        let file = self.tensors[unused[0].as_str()].1.clone();
        Err(ModelError::Safetensors {
            path: file,
            message: format!(
                "{n} tensor(s) the model does not use: {}{more} (does config.json describe this checkpoint? its \
                 num_hidden_layers, tie_word_embeddings, architecture)",
                shown.join(", ")
            ),
        })
    }

    /// Names of all stored tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Whether a tensor is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored tensor and its file, with a shape check. `expected` uses -1 for "any".
    pub fn get(&self, name: &str, expected: &[i64]) -> Result<&Tensor> {
        let (t, file) = self.tensors.get(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            files: self.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "),
        })?;
        self.used.borrow_mut().insert(name.to_string());
        let actual = t.size();
        let ok = actual.len() == expected.len() && actual.iter().zip(expected).all(|(a, e)| *e < 0 || a == e);
        if !ok {
            return Err(ModelError::ShapeMismatch {
                path: file.clone(),
                name: name.to_string(),
                expected: expected.to_vec(),
                actual,
            });
        }
        Ok(t)
    }
}

fn read_file(path: &Path, out: &mut HashMap<String, (Tensor, PathBuf)>) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| ModelError::Safetensors { path: path.to_path_buf(), message: e.to_string() })?;
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype()).ok_or_else(|| ModelError::UnsupportedDtype {
            path: path.to_path_buf(),
            name: name.clone(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        out.insert(name, (t, path.to_path_buf()));
    }
    Ok(())
}

/// Tensors a checkpoint may hold that no model reads: buffers transformers recomputes (the rotary
/// `inv_freq` of older Llama checkpoints, GPT-2's causal-mask `attn.bias` / `attn.masked_bias`),
/// and Qwen3.5's multi-token-prediction block (`mtp.*`, for speculative decoding; transformers'
/// causal LM does not load it either, so a saved model leaves it out).
pub fn ignorable(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".attn.bias")
        || name.starts_with("mtp.")
}

/// Fetches tensors by scoped path, checks shapes, converts them to the model's device and dtype and
/// registers them as variables of a var store under the same name.
#[derive(Clone)]
pub struct WeightLoader<'a> {
    ckpt: &'a Checkpoint,
    path: nn::Path<'a>,
    prefix: Vec<String>,
    kind: Kind,
}

impl<'a> WeightLoader<'a> {
    /// A loader at the root of `vs`, producing floating tensors of `kind`.
    pub fn new(ckpt: &'a Checkpoint, vs: &'a nn::VarStore, kind: Kind) -> Self {
        WeightLoader { ckpt, path: vs.root(), prefix: Vec::new(), kind }
    }

    /// The loader for a sub-module, e.g. `pp("model").pp("layers").pp(3)`.
    pub fn pp(&self, name: impl ToString) -> Self {
        let name = name.to_string();
        let mut prefix = self.prefix.clone();
        prefix.push(name.clone());
        WeightLoader { ckpt: self.ckpt, path: self.path.sub(name), prefix, kind: self.kind }
    }

    /// Full dotted name of `name` under this loader.
    pub fn full_name(&self, name: &str) -> String {
        let mut parts = self.prefix.clone();
        parts.push(name.to_string());
        parts.join(".")
    }

    /// Whether the checkpoint stores `name` under this loader.
    pub fn contains(&self, name: &str) -> bool {
        self.ckpt.contains(&self.full_name(name))
    }

    /// The stored shape of `name`, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        self.ckpt.tensors.get(&self.full_name(name)).map(|(t, _)| t.size())
    }

    /// Loads a trainable variable `name` of the given shape.
    ///
    /// # Shapes
    /// - returns: `shape`, on the var store's device, in the loader's kind.
    pub fn get(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let full = self.full_name(name);
        let t = self.ckpt.get(&full, shape)?;
        if !t.is_floating_point() {
            // A weight stored as integers (quantised, or written by mistake) would be cast to
            // floats without a word and compute something else.
            let file = self.ckpt.tensors.get(&full).map(|(_, f)| f.clone()).unwrap_or_default();
            return Err(ModelError::UnsupportedDtype {
                path: file,
                name: full,
                dtype: format!("{:?} (a weight must be F32, F16, BF16 or F64)", t.kind()),
            });
        }
        // The var is created in the store's kind and device; `copy_` converts.
        Ok(self.path.f_var_copy(name, t)?)
    }

    /// Loads a trainable variable `name` of the given shape `[experts, in, out]` from its MXFP4
    /// parts `{name}_blocks` and `{name}_scales` ([`dequantize_mxfp4`]).
    pub fn get_mxfp4(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let full = self.full_name(name);
        let blocks = self.ckpt.get(&format!("{full}_blocks"), &[-1, -1, -1, 16])?;
        let scales = self.ckpt.get(&format!("{full}_scales"), &[-1, -1, -1])?;
        let file = self.ckpt.tensors.get(&format!("{full}_blocks")).map(|(_, f)| f.clone()).unwrap_or_default();
        let bad = |message: String| ModelError::Safetensors { path: file.clone(), message };
        // Checked before dequantising (which allocates 8 bytes per stored byte): `[experts, in,
        // out]` is stored as `[experts, out, in / 32, 16]`.
        let [experts, fan_in, fan_out] = *shape else {
            return Err(bad(format!("{full}: an MXFP4 weight is [experts, in, out], asked for {shape:?}")));
        };
        let stored = [experts, fan_out, fan_in / 32, 16];
        if fan_in % 32 != 0 || blocks.size() != stored {
            return Err(bad(format!(
                "{full}: MXFP4 blocks {:?}, expected {stored:?} for a {shape:?} weight",
                blocks.size()
            )));
        }
        if blocks.kind() != Kind::Uint8 || scales.kind() != Kind::Uint8 || blocks.size()[..3] != scales.size()[..] {
            return Err(bad(format!(
                "{full}: MXFP4 blocks {:?} {:?} and scales {:?} {:?} must be U8, blocks [.., groups, 16] over scales [.., groups]",
                blocks.kind(),
                blocks.size(),
                scales.kind(),
                scales.size()
            )));
        }
        Ok(self.path.f_var_copy(name, &dequantize_mxfp4(blocks, scales)?)?)
    }

    /// Loads `name` as a constant (a buffer: not a variable, never trained), converted to the
    /// loader's kind and device, or `None` where the checkpoint lacks it. The model saves it back
    /// as stored (see `model::passthrough`).
    pub fn constant(&self, name: &str, shape: &[i64]) -> Result<Option<Tensor>> {
        if !self.contains(name) {
            return Ok(None);
        }
        let t = self.ckpt.get(&self.full_name(name), shape)?;
        Ok(Some(t.f_to_kind(self.kind)?.f_to_device(self.device())?))
    }

    /// Registers a fresh variable (not in the checkpoint) drawn from N(0, std²), e.g. a new score head.
    pub fn new_normal(&self, name: &str, shape: &[i64], std: f64) -> Result<Tensor> {
        let t = Tensor::f_randn(shape, (Kind::Float, Device::Cpu))?.f_mul_scalar(std)?;
        Ok(self.path.f_var_copy(name, &t)?)
    }

    /// The dtype every loaded floating tensor gets.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The device of the var store.
    pub fn device(&self) -> Device {
        self.path.device()
    }
}

/// The values of an FP4 (e2m1) code: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated.
const FP4_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// MXFP4 (OCP Microscaling): each byte of `blocks` holds two FP4 codes (low nibble first), each
/// group of 32 values one power-of-two scale `2^(scale − 127)`. Returns the experts' weights as
/// gpt-oss computes with them, `[experts, in, out]` in f32 (exact: every value is a small
/// integer multiple of a power of two), as transformers' `convert_moe_packed_tensors` does.
///
/// # Shapes
/// - `blocks`: `[experts, out, groups, 16]` u8; `scales`: `[experts, out, groups]` u8 →
///   `[experts, groups · 32, out]`
pub fn dequantize_mxfp4(blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let size = blocks.size();
    let (e, out, groups) = (size[0], size[1], size[2]);
    let lut = Tensor::f_from_slice(&FP4_VALUES)?;
    let b = blocks.f_to_kind(Kind::Int64)?;
    let lo = lut.f_index_select(0, &b.f_bitwise_and(15)?.f_flatten(0, -1)?)?;
    let hi = lut.f_index_select(0, &b.f_bitwise_right_shift_tensor_scalar(4)?.f_flatten(0, -1)?)?;
    // [.., 16, 2] → 32 values per group, low nibble first.
    let values = Tensor::f_stack(&[lo, hi], -1)?.f_view([e, out, groups, 32])?;
    let exp = scales.f_to_kind(Kind::Int)?.f_sub_scalar(127)?.f_unsqueeze(-1)?; // [e, out, groups, 1]
    let w = values.f_ldexp(&exp)?.f_view([e, out, groups * 32])?;
    Ok(w.f_transpose(1, 2)?.f_contiguous()?)
}

/// Copies a tensor's bytes to host memory in its own dtype.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let numel = t.numel();
    let mut buf = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut buf, numel)?;
    Ok(buf)
}

/// Writes named tensors as safetensors into `dir`: one `model.safetensors`, or — when the total size
/// exceeds `max_shard_bytes` — `model-0000i-of-0000n.safetensors` shards plus the index, the way
/// transformers' `save_pretrained` lays them out. Tensors are written in name order.
pub fn save_safetensors(dir: &Path, tensors: &BTreeMap<String, Tensor>, max_shard_bytes: usize) -> Result<()> {
    let mut items: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dtype = dtype_of(t.kind())
            .ok_or_else(|| ModelError::Input(format!("tensor `{name}` has unsupported kind {:?}", t.kind())))?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        items.push((name.clone(), dtype, shape, tensor_bytes(t)?));
    }
    // Greedy sharding in name order.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut current = 0usize;
    for (i, item) in items.iter().enumerate() {
        let size = item.3.len();
        if current > 0 && current + size > max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        shards.last_mut().expect("non-empty").push(i);
        current += size;
    }
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let write = |file: &Path, idx: &[usize]| -> Result<()> {
        let views = idx
            .iter()
            .map(|&i| {
                let (name, dtype, shape, data) = &items[i];
                TensorView::new(*dtype, shape.clone(), data)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| ModelError::Safetensors { path: file.to_path_buf(), message: e.to_string() })
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize_to_file(views, &metadata, file)
            .map_err(|e| ModelError::Safetensors { path: file.to_path_buf(), message: e.to_string() })
    };
    if shards.len() == 1 {
        return write(&dir.join(SINGLE_FILE), &shards[0]);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let total: usize = items.iter().map(|i| i.3.len()).sum();
    for (s, idx) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:05}.safetensors", s + 1, n);
        write(&dir.join(&fname), idx)?;
        for &i in idx {
            weight_map.insert(items[i].0.clone(), fname.clone());
        }
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    write_json(&dir.join(INDEX_FILE), &index)
}

/// Writes named tensors into one safetensors file at `path` (e.g. PEFT's
/// `adapter_model.safetensors`), in name order.
pub fn save_safetensors_file(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut items = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dtype = dtype_of(t.kind())
            .ok_or_else(|| ModelError::Input(format!("tensor `{name}` has unsupported kind {:?}", t.kind())))?;
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        items.push((name.clone(), dtype, shape, tensor_bytes(t)?));
    }
    let bad =
        |e: safetensors::SafeTensorError| ModelError::Safetensors { path: path.to_path_buf(), message: e.to_string() };
    let views = items
        .iter()
        .map(|(name, dtype, shape, data)| {
            TensorView::new(*dtype, shape.clone(), data).map(|v| (name.clone(), v)).map_err(bad)
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(views, &metadata, path).map_err(bad)
}

/// Writes pretty JSON with a trailing newline.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| ModelError::Json { path: path.to_path_buf(), message: e.to_string() })?;
    text.push('\n');
    let mut f = std::fs::File::create(path).map_err(|e| ModelError::io(path, e))?;
    f.write_all(text.as_bytes()).map_err(|e| ModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two FP4 codes per byte, low nibble first, times `2^(scale − 127)`; and blocks of another
    /// shape than the weight asked for are refused, naming the tensor, before anything is
    /// dequantised.
    #[test]
    fn mxfp4_dequantises_by_hand_and_refuses_a_mismatched_shape() {
        // One expert, one output row, one group: bytes 0x21 (codes 1, 2 → 0.5, 1.0) and 0xF8
        // (codes 8, 15 → −0, −6), the other 14 bytes zero; scale 128 → ×2.
        let mut bytes = [0u8; 16];
        bytes[0] = 0x21;
        bytes[1] = 0xF8;
        let blocks = Tensor::from_slice(&bytes).view([1, 1, 1, 16]);
        let scales = Tensor::from_slice(&[128u8]).view([1, 1, 1]);
        let w = dequantize_mxfp4(&blocks, &scales).unwrap(); // [1, 32, 1]
        assert_eq!(w.size(), [1, 32, 1]);
        let v = Vec::<f32>::try_from(w.flatten(0, -1)).unwrap();
        assert_eq!(&v[..4], &[1.0, 2.0, -0.0, -12.0]);
        assert!(v[4..].iter().all(|&x| x == 0.0));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SINGLE_FILE);
        Tensor::write_safetensors(&[("e.w_blocks", &blocks), ("e.w_scales", &scales)], &path).unwrap();
        let ckpt = Checkpoint::from_dir(dir.path()).unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let loader = WeightLoader::new(&ckpt, &vs, Kind::Float).pp("e");
        let t = loader.get_mxfp4("w", &[1, 32, 1]).unwrap();
        assert!(t.equal(&w));
        let e = loader.get_mxfp4("w", &[1, 64, 1]).unwrap_err().to_string();
        assert!(e.contains("e.w: MXFP4 blocks [1, 1, 1, 16], expected [1, 1, 2, 16]"), "{e}");
    }
}
