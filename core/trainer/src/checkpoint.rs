//! Checkpoints of an RL run: `<run_dir>/checkpoints/step-NNNNNN/` holding the models' variables
//! (actor, critic, EMA; LoRA adapters unmerged), the optimizers' moments, `state.json` (step, data
//! position, schedule positions, plugin states, reward history, seed) and the resolved
//! `config.toml`, sealed by `manifest.json` (sizes and FNV-1a checksums of every file).
//!
//! Writing is atomic: everything goes into `checkpoints/.tmp-step-NNNNNN-<pid>/`, each file and the
//! directory are fsynced, `manifest.json` is written last, then the directory is renamed into place
//! and the parent fsynced. A crash (even `kill -9`) mid-write leaves at most a `.tmp-*` directory,
//! which [`latest`] ignores; older checkpoints are pruned only after a new one is complete.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tch::{nn, Tensor};

use crate::error::{Result, TrainerError};
use crate::shard_files::{layout_file, shard_file, ShardLayout};

/// Format version of the layout above.
pub const FORMAT: u64 = 1;

fn err(msg: String) -> TrainerError {
    TrainerError::Checkpoint(msg)
}

fn io(path: &Path, e: std::io::Error) -> TrainerError {
    err(format!("{}: {e}", path.display()))
}

/// The directory holding a run's checkpoints.
pub fn checkpoints_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// The directory of the checkpoint of `step` (`<run_dir>/checkpoints/step-NNNNNN`).
pub fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    checkpoints_dir(run_dir).join(step_dir_name(step))
}

fn parse_step(name: &str) -> Option<usize> {
    name.strip_prefix("step-").and_then(|s| s.parse().ok())
}

/// 64-bit FNV-1a of a file's bytes (detects truncation and corruption; not cryptographic).
pub(crate) fn fnv1a(path: &Path) -> Result<(u64, u64)> {
    let mut f = File::open(path).map_err(|e| io(path, e))?;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut len = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        len += n as u64;
        for &b in &buf[..n] {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok((len, hash))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| io(dir, e))
}

/// Test hook: a pause after each file so a test can kill the process mid-write.
fn test_delay() {
    if let Some(ms) = std::env::var("RLHFRS_TEST_CHECKPOINT_DELAY_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// What goes into one checkpoint.
pub struct CheckpointData {
    pub step: usize,
    /// Resolved configuration (TOML).
    pub config_toml: String,
    /// `state.json`.
    pub state: Value,
    /// Tensor files: (`actor`, named tensors) → `actor.safetensors`.
    pub tensors: Vec<(&'static str, Vec<(String, Tensor)>)>,
    /// Other JSON files (file name, contents), e.g. the layout of sharded optimizer states.
    pub json: Vec<(String, Value)>,
}

/// The variables of `vs` by name, for [`CheckpointData::tensors`].
pub fn var_store_tensors(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Writes a checkpoint atomically and prunes to the last `keep`; returns its directory.
pub fn write(run_dir: &Path, data: &CheckpointData, keep: usize) -> Result<PathBuf> {
    let tmp = begin(run_dir, data.step, std::process::id())?;
    finish(run_dir, &tmp, data, &[], keep)
}

/// The temporary directory a checkpoint of `step` is written into by the process (or, with data
/// parallelism, the main rank's process) `pid` before it is published.
pub fn tmp_dir(run_dir: &Path, step: usize, pid: u32) -> PathBuf {
    checkpoints_dir(run_dir).join(format!(".tmp-{}-{pid}", step_dir_name(step)))
}

/// Starts a checkpoint of `step`: removes what interrupted writes left and creates
/// [`tmp_dir`]`(run_dir, step, pid)` (one writer per run dir).
pub fn begin(run_dir: &Path, step: usize, pid: u32) -> Result<PathBuf> {
    let parent = checkpoints_dir(run_dir);
    std::fs::create_dir_all(&parent).map_err(|e| io(&parent, e))?;
    // Leftovers of an interrupted write are incomplete by construction; a replaced checkpoint
    // set aside (`.old-step-N`) goes once its successor is in place.
    for entry in std::fs::read_dir(&parent).map_err(|e| io(&parent, e))?.flatten() {
        let file = entry.file_name().to_string_lossy().to_string();
        let replaced = file.strip_prefix(OLD_PREFIX).is_some_and(|n| parent.join(n).join("manifest.json").is_file());
        if file.starts_with(".tmp-") || replaced {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let tmp = tmp_dir(run_dir, step, pid);
    std::fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
    Ok(tmp)
}

/// Writes named tensors to `dir/file` (safetensors) and fsyncs it.
pub fn write_tensors(dir: &Path, file: &str, tensors: &[(String, Tensor)]) -> Result<()> {
    let path = dir.join(file);
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, &path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    File::open(&path).and_then(|f| f.sync_all()).map_err(|e| io(&path, e))
}

/// Completes a checkpoint begun with [`begin`]: writes `data` into `tmp`, seals it and the files
/// other ranks already wrote there (`written`) in `manifest.json`, publishes the directory and
/// prunes to the last `keep`; returns its directory.
pub fn finish(run_dir: &Path, tmp: &Path, data: &CheckpointData, written: &[String], keep: usize) -> Result<PathBuf> {
    let parent = checkpoints_dir(run_dir);
    let name = step_dir_name(data.step);
    let mut files = serde_json::Map::new();
    let mut seal = |file: &str| -> Result<()> {
        let path = tmp.join(file);
        if !path.is_file() {
            return Err(err(format!(
                "{}: {file} is missing: with sharded optimizer states every rank writes its shard there, so \
                 the run directory must be on a filesystem all ranks share",
                tmp.display()
            )));
        }
        File::open(&path).and_then(|f| f.sync_all()).map_err(|e| io(&path, e))?;
        let (bytes, fnv) = fnv1a(&path)?;
        files.insert(file.to_string(), json!({"bytes": bytes, "fnv1a64": format!("{fnv:016x}")}));
        test_delay();
        Ok(())
    };
    for file in written {
        seal(file)?;
    }
    for (what, tensors) in &data.tensors {
        let file = format!("{what}.safetensors");
        write_tensors(tmp, &file, tensors)?;
        seal(&file)?;
    }
    let write_text = |file: &str, text: &str| -> Result<()> {
        let path = tmp.join(file);
        let mut f = File::create(&path).map_err(|e| io(&path, e))?;
        f.write_all(text.as_bytes()).map_err(|e| io(&path, e))
    };
    for (file, value) in &data.json {
        write_text(file, &serde_json::to_string_pretty(value).unwrap_or_default())?;
        seal(file)?;
    }
    write_text("state.json", &serde_json::to_string_pretty(&data.state).unwrap_or_default())?;
    seal("state.json")?;
    write_text("config.toml", &data.config_toml)?;
    seal("config.toml")?;
    let manifest = json!({"format": FORMAT, "step": data.step, "files": files});
    write_text("manifest.json", &serde_json::to_string_pretty(&manifest).unwrap_or_default())?;
    let mpath = tmp.join("manifest.json");
    File::open(&mpath).and_then(|f| f.sync_all()).map_err(|e| io(&mpath, e))?;
    fsync_dir(tmp)?;

    let dest = parent.join(&name);
    let old = parent.join(format!("{OLD_PREFIX}{name}"));
    if dest.exists() {
        // The same step written again (e.g. a resumed run's final step): set the old one aside
        // first, so a crash between the two renames still leaves a complete checkpoint of this
        // step (`.old-step-N`, which `list` counts while `step-N` is missing).
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&dest, &old).map_err(|e| io(&dest, e))?;
    }
    std::fs::rename(tmp, &dest).map_err(|e| io(&dest, e))?;
    fsync_dir(&parent)?;
    if old.exists() {
        let _ = std::fs::remove_dir_all(&old);
    }
    // The new checkpoint is published: failing to delete an old one must not fail the run.
    if let Err(e) = prune(&parent, keep) {
        tracing::warn!("old checkpoints not pruned: {e}");
    }
    Ok(dest)
}

/// Prefix of a complete checkpoint set aside while its step is written again.
const OLD_PREFIX: &str = ".old-";

/// Deletes all but the newest `keep` complete checkpoints, and stale temp dirs of this process.
fn prune(parent: &Path, keep: usize) -> Result<()> {
    let mut steps = list(parent)?;
    steps.sort();
    let n = steps.len();
    for (_, dir) in steps.into_iter().take(n.saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
    }
    Ok(())
}

/// Complete checkpoints (with a manifest) under `parent`, as (step, dir).
fn list(parent: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(parent) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(parent, e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| io(parent, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        // A set-aside checkpoint counts only while the one that replaces it is not in place.
        let step = match name.strip_prefix(OLD_PREFIX) {
            Some(n) if parent.join(n).join("manifest.json").is_file() => None,
            Some(n) => parse_step(n),
            None => parse_step(&name),
        };
        if let Some(step) = step {
            if entry.path().join("manifest.json").is_file() {
                out.push((step, entry.path()));
            }
        }
    }
    Ok(out)
}

/// The newest complete checkpoint of a run, if any.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>> {
    if !run_dir.is_dir() {
        return Err(err(format!("{}: run directory not found", run_dir.display())));
    }
    let mut steps = list(&checkpoints_dir(run_dir))?;
    steps.sort();
    Ok(steps.pop().map(|(_, d)| d))
}

/// Resolves `--resume` (a checkpoint dir, a run dir, or `latest` = the newest in `run_dir`) to a
/// checkpoint directory.
pub fn resolve(spec: &Path, run_dir: Option<&Path>) -> Result<PathBuf> {
    let run = if spec == Path::new("latest") {
        run_dir.ok_or_else(|| err("--resume latest: the config sets no run.run_dir to look in".into()))?.to_path_buf()
    } else if spec.join("manifest.json").is_file()
        || parse_step(&spec.file_name().unwrap_or_default().to_string_lossy()).is_some()
    {
        return Ok(spec.to_path_buf());
    } else {
        spec.to_path_buf()
    };
    latest(&run)?.ok_or_else(|| match crate::metrics::logged_steps(&run) {
        // It logged steps but wrote no checkpoint: nothing to continue from, and a fresh run
        // into it is refused too (it would mix with those steps), so say what is left to do.
        Some(step) => err(format!(
            "{}: the run stopped before its first checkpoint (metrics.jsonl ends at step {step}), so it cannot be \
             resumed; remove the directory or choose another --run-dir",
            run.display()
        )),
        None => err(format!("{}: no complete checkpoint in {}", run.display(), checkpoints_dir(&run).display())),
    })
}

/// A verified checkpoint, loaded.
pub struct Loaded {
    pub dir: PathBuf,
    pub step: usize,
    pub state: Value,
    pub config_toml: String,
    /// Resume even if the prompt files changed since the checkpoint (`--allow-data-change`).
    pub allow_data_change: bool,
    tensors: HashMap<String, HashMap<String, Tensor>>,
    /// Every file the manifest seals, with its size and checksum.
    files: serde_json::Map<String, Value>,
}

/// Refuses to resume `ckpt` into a run that ends at step `last` or before it (`what` says where
/// `last` comes from): there is nothing to train, and going on would rewrite the finished run's
/// model, summary and config with nothing learnt. A run is extended, never shrunk. Every phase
/// (`rlhf train`, `sft`, `rm`, `dpo`) asks this before it rewrites anything of the run.
pub fn refuse_nothing_to_train(resume: Option<&Loaded>, last: usize, what: &str) -> Result<()> {
    match resume {
        Some(ckpt) if ckpt.step >= last => Err(TrainerError::Config(format!(
            "{}: the checkpoint is at step {} and {what} ends the run at step {last}: nothing to train; a resume \
             extends a run, never shrinks it: raise train.steps above {} (e.g. --set train.steps={}) to continue, \
             or train with another --run-dir",
            ckpt.dir.display(),
            ckpt.step,
            ckpt.step,
            ckpt.step + 1,
        ))),
        _ => Ok(()),
    }
}

/// Reads and verifies a checkpoint: manifest present, every file with its size and checksum.
pub fn load(dir: &Path) -> Result<Loaded> {
    let mpath = dir.join("manifest.json");
    let text = std::fs::read_to_string(&mpath)
        .map_err(|e| err(format!("{}: not a complete checkpoint (manifest.json: {e})", dir.display())))?;
    let manifest: Value = serde_json::from_str(&text)
        .map_err(|e| err(format!("{}: corrupt checkpoint manifest: {e}", mpath.display())))?;
    if manifest.get("format").and_then(Value::as_u64) != Some(FORMAT) {
        return Err(err(format!("{}: unsupported checkpoint format {:?}", mpath.display(), manifest.get("format"))));
    }
    let step =
        manifest.get("step").and_then(Value::as_u64).ok_or_else(|| err(format!("{}: no step", mpath.display())))?
            as usize;
    let files = manifest.get("files").and_then(Value::as_object).cloned().unwrap_or_default();
    let mut tensors = HashMap::new();
    for (file, meta) in &files {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(err(format!("{}: corrupt checkpoint: {file} is missing", dir.display())));
        }
        // A rank's shard of an optimizer state is read, and its checksum verified, by the ranks
        // that need it when they need it ([`Loaded::verified`]): here only its size, so that N
        // ranks do not each read every rank's shard.
        let shard = file.contains(".rank-");
        if shard {
            let bytes = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
            check_sealed(dir, file, meta, bytes, None)?;
            continue;
        }
        let (bytes, fnv) = fnv1a(&path)?;
        check_sealed(dir, file, meta, bytes, Some(fnv))?;
        if let Some(what) = file.strip_suffix(".safetensors") {
            let list = Tensor::read_safetensors(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
            tensors.insert(what.to_string(), list.into_iter().collect());
        }
    }
    let read = |file: &str| -> Result<String> {
        if !files.contains_key(file) {
            return Err(err(format!("{}: corrupt checkpoint: {file} is not in the manifest", dir.display())));
        }
        std::fs::read_to_string(dir.join(file)).map_err(|e| io(&dir.join(file), e))
    };
    let state: Value = serde_json::from_str(&read("state.json")?)
        .map_err(|e| err(format!("{}: corrupt state.json: {e}", dir.display())))?;
    // The manifest is not sealed itself: its step must agree with the sealed state.json's (and
    // with the directory's name), or the checkpoint is refused rather than read at either step.
    let state_step = state.get("step").and_then(Value::as_u64).map(|s| s as usize);
    let named_step = dir.file_name().and_then(|n| n.to_str()).and_then(parse_step);
    if state_step != Some(step) || named_step.is_some_and(|n| n != step) {
        return Err(err(format!(
            "{}: corrupt checkpoint: manifest.json says step {step}, state.json {}{}",
            dir.display(),
            state_step.map(|s| s.to_string()).unwrap_or_else(|| "none".into()),
            named_step.map(|n| format!(", the directory {n}")).unwrap_or_default()
        )));
    }
    let config_toml = read("config.toml")?;
    Ok(Loaded { dir: dir.to_path_buf(), step, state, config_toml, allow_data_change: false, tensors, files })
}

/// Checks a file's size (and checksum, when given) against its manifest entry `meta`.
fn check_sealed(dir: &Path, file: &str, meta: &Value, bytes: u64, fnv: Option<u64>) -> Result<()> {
    let want_bytes = meta.get("bytes").and_then(Value::as_u64).unwrap_or(u64::MAX);
    let want_fnv = meta.get("fnv1a64").and_then(Value::as_str).unwrap_or("");
    let fnv_ok = fnv.is_none_or(|f| format!("{f:016x}") == want_fnv);
    if bytes != want_bytes || !fnv_ok {
        let got = fnv.map_or_else(|| "(not read)".to_string(), |f| format!("{f:016x}"));
        return Err(err(format!(
            "{}: corrupt checkpoint: {file} has {bytes} bytes / checksum {got}, the manifest says {want_bytes} / {want_fnv}",
            dir.display()
        )));
    }
    Ok(())
}

impl Loaded {
    /// The named tensors of `<what>.safetensors`.
    pub fn tensors(&self, what: &str) -> Result<&HashMap<String, Tensor>> {
        self.tensors.get(what).ok_or_else(|| err(format!("{}: checkpoint holds no {what}", self.dir.display())))
    }

    /// The layout of the sharded optimizer state `what`, if the checkpoint holds it as shards
    /// (each sealed by the manifest, so verified by [`load`]).
    pub fn shard_layout(&self, what: &str) -> Result<Option<ShardLayout>> {
        let file = layout_file(what);
        if !self.files.contains_key(&file) {
            return Ok(None);
        }
        let path = self.dir.join(&file);
        let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| err(format!("{}: {e}", path.display())))?;
        let layout = ShardLayout::from_json(&value, &path)?;
        if let Some(r) = (0..layout.world).find(|&r| !self.files.contains_key(&shard_file(what, r, layout.world))) {
            return Err(err(format!(
                "{}: corrupt checkpoint: {} is not in the manifest",
                self.dir.display(),
                shard_file(what, r, layout.world)
            )));
        }
        Ok(Some(layout))
    }

    /// The path of `file`, a rank's optimizer shard, once its checksum matches the manifest's
    /// ([`load`] checked only its size).
    pub fn verified(&self, file: &str) -> Result<PathBuf> {
        let path = self.dir.join(file);
        let meta = self
            .files
            .get(file)
            .ok_or_else(|| err(format!("{}: corrupt checkpoint: {file} is not in the manifest", self.dir.display())))?;
        let (bytes, fnv) = fnv1a(&path)?;
        check_sealed(&self.dir, file, meta, bytes, Some(fnv))?;
        Ok(path)
    }

    /// Copies `<what>.safetensors` into the variables of `vs` (every variable must be there, with its shape).
    pub fn restore_vars(&self, what: &str, vs: &nn::VarStore) -> Result<()> {
        let saved = self.tensors(what)?;
        tch::no_grad(|| -> Result<()> {
            for (name, mut var) in vs.variables() {
                let t = saved.get(&name).ok_or_else(|| {
                    err(format!("{}: {what} has no `{name}` (a checkpoint of another model?)", self.dir.display()))
                })?;
                if t.size() != var.size() {
                    return Err(err(format!(
                        "{}: {what}.{name} has shape {:?}, the model {:?}",
                        self.dir.display(),
                        t.size(),
                        var.size()
                    )));
                }
                var.f_copy_(t).map_err(|e| err(format!("{}: {what}.{name}: {e}", self.dir.display())))?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(step: usize) -> CheckpointData {
        CheckpointData {
            step,
            config_toml: "x = 1\n".into(),
            state: json!({"step": step}),
            tensors: vec![("actor", vec![("w".into(), Tensor::from_slice(&[1f32, 2., 3.]) * step as f64)])],
            json: Vec::new(),
        }
    }

    #[test]
    fn writes_prunes_and_finds_latest() {
        let run = tempfile::tempdir().unwrap();
        for s in [2, 4, 6] {
            write(run.path(), &data(s), 2).unwrap();
        }
        let names: Vec<usize> = list(&checkpoints_dir(run.path())).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(
            {
                let mut n = names;
                n.sort();
                n
            },
            vec![4, 6]
        );
        // An incomplete temp dir and a dir without manifest are ignored.
        std::fs::create_dir_all(checkpoints_dir(run.path()).join(".tmp-step-000008-1")).unwrap();
        std::fs::create_dir_all(checkpoints_dir(run.path()).join("step-000010")).unwrap();
        let latest = latest(run.path()).unwrap().unwrap();
        assert!(latest.ends_with("step-000006"));
        let l = load(&latest).unwrap();
        assert_eq!(l.step, 6);
        assert_eq!(Vec::<f32>::try_from(&l.tensors("actor").unwrap()["w"]).unwrap(), vec![6., 12., 18.]);
        assert_eq!(resolve(Path::new("latest"), Some(run.path())).unwrap(), latest);
        assert_eq!(resolve(run.path(), None).unwrap(), latest);
    }

    #[test]
    fn the_same_step_is_replaced_without_a_moment_with_none() {
        let run = tempfile::tempdir().unwrap();
        let parent = checkpoints_dir(run.path());
        write(run.path(), &data(6), 1).unwrap();
        let mut again = data(6);
        again.state = json!({"step": 6, "again": true});
        let dir = write(run.path(), &again, 1).unwrap();
        assert_eq!(load(&dir).unwrap().state["again"], json!(true), "the step was rewritten");
        assert!(!parent.join(".old-step-000006").exists(), "the set-aside copy is gone");

        // A crash between the two renames: the old copy is set aside, the new one not yet in place.
        std::fs::rename(&dir, parent.join(".old-step-000006")).unwrap();
        let found = latest(run.path()).unwrap().expect("the set-aside checkpoint still counts");
        assert!(found.ends_with(".old-step-000006"), "{}", found.display());
        assert_eq!(load(&found).unwrap().step, 6);
        // The next write of that step replaces it and cleans up.
        let dir = write(run.path(), &data(6), 1).unwrap();
        assert_eq!(latest(run.path()).unwrap().unwrap(), dir);
        assert!(!parent.join(".old-step-000006").exists());
        let names: Vec<String> =
            std::fs::read_dir(&parent).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, ["step-000006"]);
    }

    #[test]
    fn corruption_is_detected() {
        let run = tempfile::tempdir().unwrap();
        let dir = write(run.path(), &data(3), 2).unwrap();
        let f = dir.join("actor.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 0xff;
        std::fs::write(&f, &bytes).unwrap();
        let e = load(&dir).err().unwrap().to_string();
        assert!(e.contains("corrupt checkpoint: actor.safetensors"), "{e}");
        std::fs::remove_file(dir.join("manifest.json")).unwrap();
        let e = load(&dir).err().unwrap().to_string();
        assert!(e.contains("not a complete checkpoint"), "{e}");
        let e = latest(&run.path().join("nope")).err().unwrap().to_string();
        assert!(e.contains("run directory not found"), "{e}");
    }
}
