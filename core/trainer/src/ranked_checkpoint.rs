//! Writing one checkpoint from every rank of a run (RL and the supervised phases alike). With
//! replicated optimizer states the main rank writes everything. With sharded ones (ZeRO stages
//! ≥ 1) the main rank opens the temporary directory, every rank writes its own shards into it,
//! and once all have (one agreement over the ranks) the main rank writes the rest, seals the
//! shards with it and publishes the checkpoint ([`crate::checkpoint`]: atomic, checksummed).

use std::path::{Path, PathBuf};

use rlhf_collective::World;

use crate::checkpoint::{write_tensors, CheckpointData};
use crate::dist;
use crate::error::{Result, TrainerError};
use crate::shard_files::shard_file;
use crate::train_engine::CheckpointPart;

/// The optimizer states' parts, by name (`optimizer-actor`, ...).
pub type Parts = Vec<(&'static str, CheckpointPart)>;

/// Writes the checkpoint of `step`; every rank calls it. `data` builds what the main rank writes
/// besides the shards from the parts (the whole states, or the shards' layout). Returns the
/// checkpoint's directory on the main rank.
pub fn save(
    world: &World,
    run_dir: &Path,
    step: usize,
    keep: usize,
    parts: Parts,
    data: impl FnOnce(Parts) -> Result<CheckpointData>,
) -> Result<Option<PathBuf>> {
    let main = world.is_main();
    let shards: Vec<&str> =
        parts.iter().filter(|(_, p)| !matches!(p, CheckpointPart::Whole(_))).map(|(w, _)| *w).collect();
    if shards.is_empty() {
        if !main {
            return Ok(None);
        }
        return Ok(Some(crate::checkpoint::write(run_dir, &data(parts)?, keep)?));
    }
    // Every rank learns the directory: the main rank's pid names it (0: it failed).
    let begun = main.then(|| crate::checkpoint::begin(run_dir, step, std::process::id()));
    let pid = if matches!(begun, Some(Ok(_))) { f64::from(std::process::id()) } else { 0.0 };
    let pid = dist::sum(world, &[pid])?[0] as u32;
    if let Some(Err(e)) = begun {
        return Err(e);
    }
    if pid == 0 {
        return Err(TrainerError::Checkpoint("the main rank could not start the checkpoint".into()));
    }
    let tmp = crate::checkpoint::tmp_dir(run_dir, step, pid);
    let (rank, size) = (world.rank(), world.size());
    let mine = parts.iter().try_for_each(|(what, part)| match part {
        CheckpointPart::Shard { tensors, .. } | CheckpointPart::Rank(tensors) => {
            write_tensors(&tmp, &shard_file(what, rank, size), tensors)
        }
        CheckpointPart::Whole(_) => Ok(()),
    });
    if !dist::all(world, mine.is_ok())? {
        if main {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        mine?;
        return Err(TrainerError::Checkpoint("another rank could not write its optimizer shard".into()));
    }
    if !main {
        return Ok(None);
    }
    let written: Vec<String> =
        shards.iter().flat_map(|what| (0..size).map(move |r| shard_file(what, r, size))).collect();
    Ok(Some(crate::checkpoint::finish(run_dir, &tmp, &data(parts)?, &written, keep)?))
}
