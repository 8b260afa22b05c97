//! A sharded optimizer state on disk: at ZeRO stages ≥ 1 every rank writes its own shard
//! (`optimizer-<model>.rank-RRRRR-of-WWWWW.safetensors`: the flat `exp_avg`, `exp_avg_sq`, f32
//! `master` for reduced-precision variables, and `step`), and the main rank writes the layout they
//! share (`optimizer-<model>.layout.json`: stage, world size, and per variable in name order its
//! name, shape, elements and chunk), as DeepSpeed writes one `zero_pp_rank_R_*_optim_states.pt`
//! per rank. No rank ever holds the whole state to save it.
//!
//! Reading re-shards: a destination asks for the element range `[lo, hi)` of a variable, and
//! only the files whose chunks overlap it are read, one at a time. At the same world size each
//! rank reads exactly its own file (bit-exact resume); at another world size or stage (or stage 0,
//! which asks for whole variables) the ranges are cut from whichever old shards hold them.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};

fn err(msg: String) -> TrainerError {
    TrainerError::Checkpoint(msg)
}

/// The shard file of `what` (e.g. `optimizer-actor`) written by `rank` of `world`.
pub fn shard_file(what: &str, rank: usize, world: usize) -> String {
    format!("{what}.rank-{rank:05}-of-{world:05}.safetensors")
}

/// The layout file of `what`.
pub fn layout_file(what: &str) -> String {
    format!("{what}.layout.json")
}

/// One variable of a sharded state: rank r holds its elements `[r·chunk, min((r+1)·chunk, numel))`.
#[derive(Debug, Clone, PartialEq)]
pub struct VarLayout {
    pub name: String,
    pub shape: Vec<i64>,
    pub numel: i64,
    pub chunk: i64,
}

/// How a sharded state was cut: the same for every rank's file.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLayout {
    pub stage: u8,
    pub world: usize,
    /// Whether the shards hold f32 masters (reduced-precision variables).
    pub masters: bool,
    /// In name order, as laid end to end in each shard.
    pub vars: Vec<VarLayout>,
}

impl ShardLayout {
    pub fn to_json(&self) -> Value {
        let vars: Vec<Value> = self
            .vars
            .iter()
            .map(|v| json!({"name": v.name, "shape": v.shape, "numel": v.numel, "chunk": v.chunk}))
            .collect();
        json!({"format": 1, "zero_stage": self.stage, "world_size": self.world, "masters": self.masters, "variables": vars})
    }

    /// Parses a layout file, checking that it is self-consistent (`file` names it in errors).
    pub fn from_json(v: &Value, file: &Path) -> Result<ShardLayout> {
        let bad = |what: &str| err(format!("{}: {what}", file.display()));
        let world =
            v.get("world_size").and_then(Value::as_u64).filter(|&w| w > 0).ok_or_else(|| bad("no world_size"))?;
        let stage = v.get("zero_stage").and_then(Value::as_u64).ok_or_else(|| bad("no zero_stage"))?;
        let masters = v.get("masters").and_then(Value::as_bool).ok_or_else(|| bad("no masters"))?;
        let mut vars = Vec::new();
        for x in v.get("variables").and_then(Value::as_array).ok_or_else(|| bad("no variables"))? {
            let name = x.get("name").and_then(Value::as_str).ok_or_else(|| bad("a variable without a name"))?;
            let int = |k: &str| x.get(k).and_then(Value::as_i64).ok_or_else(|| bad(&format!("`{name}` has no {k}")));
            let shape: Vec<i64> = x
                .get("shape")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_i64).collect())
                .ok_or_else(|| bad(&format!("`{name}` has no shape")))?;
            let (numel, chunk) = (int("numel")?, int("chunk")?);
            if shape.iter().product::<i64>() != numel || chunk != (numel + world as i64 - 1) / world as i64 {
                return Err(bad(&format!("`{name}`: shape {shape:?}, numel {numel} and chunk {chunk} disagree")));
            }
            vars.push(VarLayout { name: name.to_string(), shape, numel, chunk });
        }
        Ok(ShardLayout { stage: stage as u8, world: world as usize, masters, vars })
    }

    /// Checks that the layout holds exactly the variables `names_numels` (any order).
    pub fn check_vars(&self, what: &str, names_numels: &[(&str, i64)]) -> Result<()> {
        for (name, numel) in names_numels {
            match self.vars.iter().find(|v| v.name == *name) {
                None => return Err(err(format!("{what}: the checkpoint has no state for `{name}` (another model?)"))),
                Some(v) if v.numel != *numel => {
                    return Err(err(format!(
                        "{what}: `{name}` has {} elements in the checkpoint, {numel} in the model",
                        v.numel
                    )))
                }
                Some(_) => {}
            }
        }
        if let Some(v) = self.vars.iter().find(|v| !names_numels.iter().any(|(n, _)| *n == v.name)) {
            return Err(err(format!(
                "{what}: the checkpoint holds state for `{}`, which the model does not train",
                v.name
            )));
        }
        Ok(())
    }
}

/// Where the elements `[lo, hi)` of variable `name` go: flat f32 views of `hi − lo` elements.
pub struct Want {
    pub name: String,
    pub lo: i64,
    pub hi: i64,
    pub m: Tensor,
    pub v: Tensor,
    /// Filled only when the shards hold masters.
    pub master: Option<Tensor>,
}

/// Fills every [`Want`] from the shard files (`path(rank)`, which may verify the file first),
/// reading only those that hold part of one, one at a time. Returns the step count the shards
/// agree on.
pub fn read_ranges(layout: &ShardLayout, path: impl Fn(usize) -> Result<PathBuf>, wants: &[Want]) -> Result<i64> {
    // Where each variable starts in a shard.
    let mut offset = std::collections::HashMap::new();
    let mut at = 0i64;
    for v in &layout.vars {
        offset.insert(v.name.as_str(), (at, v));
        at += v.chunk;
    }
    let mut step = None;
    for r in 0..layout.world as i64 {
        // (want, its element range in the variable) for every overlap with rank r's chunks.
        let mut parts = Vec::new();
        for w in wants {
            let (_, var) = offset.get(w.name.as_str()).ok_or_else(|| err(format!("no state for `{}`", w.name)))?;
            let (a, b) = ((r * var.chunk).max(w.lo), ((r + 1) * var.chunk).min(var.numel).min(w.hi));
            if a < b {
                parts.push((w, a, b));
            }
        }
        if parts.is_empty() {
            continue;
        }
        let file = path(r as usize)?;
        let tensors: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(&file).map_err(|e| err(format!("{}: {e}", file.display())))?.into_iter().collect();
        let get = |k: &str| tensors.get(k).ok_or_else(|| err(format!("{}: no `{k}`", file.display())));
        let t = step_count(get("step")?, &format!("{}: `step`", file.display()))?;
        if step.is_some_and(|s| s != t) {
            return Err(err(format!("{}: step {t}, the other shards {}", file.display(), step.unwrap_or(0))));
        }
        step = Some(t);
        let (m, v) = (get("exp_avg")?, get("exp_avg_sq")?);
        let master = if layout.masters { Some(get("master")?) } else { None };
        if m.size() != [at] || v.size() != [at] {
            return Err(err(format!("{}: {} elements, the layout says {at}", file.display(), m.size()[0])));
        }
        tch::no_grad(|| -> Result<()> {
            for (w, a, b) in parts {
                let (start, var) = offset[w.name.as_str()];
                let src = start + a - r * var.chunk;
                w.m.f_narrow(0, a - w.lo, b - a)?.f_copy_(&m.f_narrow(0, src, b - a)?)?;
                w.v.f_narrow(0, a - w.lo, b - a)?.f_copy_(&v.f_narrow(0, src, b - a)?)?;
                if let (Some(dst), Some(saved)) = (&w.master, &master) {
                    dst.f_narrow(0, a - w.lo, b - a)?.f_copy_(&saved.f_to_kind(Kind::Float)?.f_narrow(
                        0,
                        src,
                        b - a,
                    )?)?;
                }
            }
            Ok(())
        })?;
    }
    Ok(step.unwrap_or(0))
}

/// The one integer a saved step counter holds (AdamW's `step`), or an error saying what `what`
/// (the file and key) holds instead; never libtorch's own error about an empty tensor.
pub fn step_count(t: &Tensor, what: &str) -> Result<i64> {
    let integral =
        matches!(t.kind(), tch::Kind::Int64 | tch::Kind::Int | tch::Kind::Int16 | tch::Kind::Int8 | tch::Kind::Uint8);
    if t.numel() != 1 || !integral {
        return Err(TrainerError::Checkpoint(format!(
            "{what}: a step counter holds one integer, this tensor {:?} values of {:?}",
            t.size(),
            t.kind()
        )));
    }
    Ok(t.f_reshape([1])?.f_int64_value(&[0])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `full` (one variable per entry) sharded over `world` ranks as [`ShardedAdam`] lays
    /// it out, with m = the values and v = their doubles.
    fn write_shards(dir: &Path, full: &[(&str, Vec<f32>)], world: usize) -> ShardLayout {
        let vars: Vec<VarLayout> = full
            .iter()
            .map(|(n, x)| {
                let numel = x.len() as i64;
                VarLayout {
                    name: n.to_string(),
                    shape: vec![numel],
                    numel,
                    chunk: (numel + world as i64 - 1) / world as i64,
                }
            })
            .collect();
        for r in 0..world as i64 {
            let mut flat = Vec::new();
            for (v, (_, x)) in vars.iter().zip(full) {
                for i in r * v.chunk..(r + 1) * v.chunk {
                    flat.push(if i < v.numel { x[i as usize] } else { 0.0 });
                }
            }
            let m = Tensor::from_slice(&flat);
            let v2 = &m * 2.0;
            let step = Tensor::from_slice(&[7i64]);
            let file = dir.join(shard_file("opt", r as usize, world));
            Tensor::write_safetensors(&[("exp_avg", &m), ("exp_avg_sq", &v2), ("step", &step)], file).unwrap();
        }
        ShardLayout { stage: 1, world, masters: false, vars }
    }

    #[test]
    fn ranges_are_cut_from_any_number_of_shards() {
        let dir = tempfile::tempdir().unwrap();
        let full = [("a", (0..7).map(|i| i as f32).collect::<Vec<_>>()), ("b", vec![10.0, 11.0])];
        let layout = write_shards(dir.path(), &full, 3);
        let back = ShardLayout::from_json(&layout.to_json(), Path::new("x")).unwrap();
        assert_eq!(back, layout);
        back.check_vars("opt", &[("a", 7), ("b", 2)]).unwrap();
        assert!(back.check_vars("opt", &[("a", 7)]).unwrap_err().to_string().contains("`b`"));
        assert!(back.check_vars("opt", &[("a", 6), ("b", 2)]).unwrap_err().to_string().contains("7 elements"));
        // Rank 1 of 2 wants a[4..7] and b[1..2]; a whole-variable (stage 0) read wants all of a.
        for (lo, hi, name, want) in
            [(4, 7, "a", vec![4.0, 5.0, 6.0]), (1, 2, "b", vec![11.0]), (0, 7, "a", full[0].1.clone())]
        {
            let n = hi - lo;
            let w = Want {
                name: name.into(),
                lo,
                hi,
                m: Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)),
                v: Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)),
                master: None,
            };
            let t = read_ranges(&layout, |r| Ok(dir.path().join(shard_file("opt", r, 3))), std::slice::from_ref(&w))
                .unwrap();
            assert_eq!(t, 7);
            assert_eq!(Vec::<f32>::try_from(&w.m).unwrap(), want);
            assert_eq!(Vec::<f32>::try_from(&w.v).unwrap(), want.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
        }
    }
}
