//! What data parallelism means for the trainer, over a [`World`] of ranks (libtorch's c10d via
//! `rlhf-collective`): every rank holds the models and takes the same optimizer steps on
//! gradients summed over ranks; rank 0 alone writes the run's files. Shared by the RL host and
//! the supervised phases. In a world of one every function here is the identity.

use std::path::{Path, PathBuf};

use rlhf_collective::{ReduceOp, World};
use tch::{nn::VarStore, Tensor};

use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::optim::Optim;

pub use rlhf_collective::shard;

/// Bucket size of the gradient all-reduce (DDP's default, 25 MiB).
pub const BUCKET_BYTES: usize = 25 << 20;

/// The device of `spec` for this rank: plain `cuda` means this rank's own GPU, `cuda:LOCAL_RANK`
/// (torchrun's convention); `cpu` and an explicit `cuda:N` are taken as written.
pub fn device(world: &World, spec: &str) -> Result<tch::Device> {
    let spec = if spec.trim() == "cuda" && world.is_distributed() {
        format!("cuda:{}", world.local_rank())
    } else {
        spec.to_string()
    };
    Ok(rlhf_models::parse_device(&spec)?)
}

/// Sets `time/comm` (seconds in collectives), `comm/bytes` (bytes sent into them) and
/// `comm/calls` (how many) since
/// `before`, on a data-parallel run.
pub fn comm_metrics(world: &World, before: rlhf_collective::CommStats, m: &mut StepMetrics) {
    if world.is_distributed() {
        let now = world.stats();
        m.set("time/comm", now.seconds - before.seconds);
        m.set("comm/bytes", (now.bytes - before.bytes) as f64);
        m.set("comm/calls", (now.calls - before.calls) as f64);
    }
}

/// A collective's error as the trainer's.
pub fn err(e: rlhf_collective::CollectiveError) -> TrainerError {
    TrainerError::Distributed(e.to_string())
}

/// Makes every rank learn whether every rank got here without an error: a rank that failed
/// returns its own error; the others return one naming the ranks that failed. Called after each
/// phase that can fail on one rank only (setup), so no rank waits forever on one that quit. Every
/// call is the same collective, so a rank that failed early (and agrees at the end of its setup)
/// meets its peers at their next agreement point.
pub fn agree<T>(world: &World, what: &str, result: Result<T>) -> Result<T> {
    if !world.is_distributed() {
        return result;
    }
    let failed = match world.all_gather_bytes(&[u8::from(result.is_err())]) {
        Ok(f) => f,
        // This rank's own error says more than the broken collective.
        Err(e) => return result.and(Err(err(e))),
    };
    let bad: Vec<String> =
        failed.iter().enumerate().filter(|(_, f)| f.first() == Some(&1)).map(|(r, _)| r.to_string()).collect();
    match result {
        Err(e) => Err(e),
        Ok(_) if !bad.is_empty() => Err(TrainerError::Distributed(format!(
            "rank {}: stopping: {what} failed on rank(s) {} (see their error)",
            world.rank(),
            bad.join(", ")
        ))),
        ok => ok,
    }
}

/// Every variable of `vs` in name order.
fn all_vars(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut vars = vs.variables().into_iter().collect::<Vec<_>>();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Copies rank 0's variables into every rank's (ranks start from identical weights, as DDP's
/// constructor does). Call it before building the optimizer, whose f32 masters copy the weights.
pub fn broadcast_weights(world: &World, vs: &VarStore) -> Result<()> {
    let vars: Vec<Tensor> = all_vars(vs).into_iter().map(|(_, t)| t).collect();
    world.broadcast_all(&vars, 0).map_err(err)
}

/// Sums the gradients of the optimizer's variables over ranks (each rank's loss is already
/// scaled by its share of the global batch, so the sum is the whole batch's gradient).
pub fn all_reduce_grads(world: &World, opt: &Optim) -> Result<()> {
    world.all_reduce_grads(&opt.params(), BUCKET_BYTES).map_err(err)
}

/// FNV-1a over the bytes of `tensors`.
pub fn digest(tensors: &[Tensor]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for t in tensors {
        let t = t.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let n = t.numel();
        let mut buf = vec![0u8; n * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut buf, n)?;
        eat(&buf);
    }
    Ok(h)
}

/// Checks that every rank holds bit-identical trained variables `params` and logs their digest.
pub fn check_identical(world: &World, params: &[Tensor], what: &str) -> Result<()> {
    if !world.is_distributed() {
        return Ok(());
    }
    let d = digest(params)?;
    world.check_same(d, &format!("{what} parameters")).map_err(err)?;
    tracing::info!("{what} parameters identical on {} ranks (fnv1a {d:016x})", world.size());
    Ok(())
}

/// Whether every rank's flag holds.
pub fn all(world: &World, flag: bool) -> Result<bool> {
    Ok(world.all_reduce_f64(&[f64::from(u8::from(flag))], ReduceOp::Min).map_err(err)?[0] == 1.0)
}

/// The largest of the ranks' `x`.
pub fn max(world: &World, x: f64) -> Result<f64> {
    Ok(world.all_reduce_f64(&[x], ReduceOp::Max).map_err(err)?[0])
}

/// Sums `xs` element-wise over ranks.
pub fn sum(world: &World, xs: &[f64]) -> Result<Vec<f64>> {
    world.all_reduce_f64(xs, ReduceOp::Sum).map_err(err)
}

/// Every rank's `xs`, concatenated in rank order.
pub fn concat_f64(world: &World, xs: &[f64]) -> Result<Vec<f64>> {
    if !world.is_distributed() {
        return Ok(xs.to_vec());
    }
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let parts = world.all_gather_bytes(&bytes).map_err(err)?;
    Ok(parts
        .iter()
        .flat_map(|p| p.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))))
        .collect())
}

/// Sets in `m` every metric of `local` to the mean of all ranks' observations of it (replacing
/// what `m` held under that name).
pub fn merge_metrics(world: &World, local: &StepMetrics, m: &mut StepMetrics) -> Result<()> {
    if !world.is_distributed() {
        for (k, s, n) in local.observations() {
            m.set_observations(k, s, n);
        }
        return Ok(());
    }
    // Sums travel as bits, so a NaN survives.
    let obs: Vec<(String, u64, usize)> =
        local.observations().map(|(k, s, n)| (k.to_string(), s.to_bits(), n)).collect();
    let bytes = serde_json::to_vec(&obs).map_err(|e| TrainerError::Distributed(format!("metrics: {e}")))?;
    let mut merged: std::collections::BTreeMap<String, (f64, usize)> = std::collections::BTreeMap::new();
    for part in world.all_gather_bytes(&bytes).map_err(err)? {
        let obs: Vec<(String, u64, usize)> =
            serde_json::from_slice(&part).map_err(|e| TrainerError::Distributed(format!("metrics: {e}")))?;
        for (k, s, n) in obs {
            let e = merged.entry(k).or_insert((0.0, 0));
            e.0 += f64::from_bits(s);
            e.1 += n;
        }
    }
    for (k, (s, n)) in merged {
        m.set_observations(&k, s, n);
    }
    Ok(())
}

/// Where a rank other than 0 puts what it must write (a built-in model, a warm-up model): a
/// private directory under the system's temp dir, removed when the guard drops.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(world: &World) -> Result<Scratch> {
        let dir = scratch_path(world);
        std::fs::create_dir_all(&dir).map_err(|e| TrainerError::io(&dir, e))?;
        Ok(Scratch(dir))
    }

    pub fn dir(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// This rank's scratch directory: `<tmp>/rlhf-rank<R>-<pid>`.
pub fn scratch_path(world: &World) -> PathBuf {
    std::env::temp_dir().join(format!("rlhf-rank{}-{}", world.rank(), std::process::id()))
}

/// The signal that asks the run to stop (SIGTERM, SIGINT), as every rank sees it: the largest
/// signal any rank received (one all-reduce), so all ranks stop after the same step.
pub fn stop_signal(world: &World) -> Result<Option<i32>> {
    let local = f64::from(crate::signals::requested().unwrap_or(0));
    let sig =
        if world.is_distributed() { world.all_reduce_f64(&[local], ReduceOp::Max).map_err(err)?[0] } else { local };
    Ok((sig > 0.0).then_some(sig as i32))
}

/// The routing of a mixture-of-experts model's trained passes since the last call, summed over
/// the ranks: `moe/load_max` and `moe/load_min`, the largest and smallest share of tokens any
/// expert of any sparse layer received, in units of the balanced share (1 = perfectly even,
/// `experts` = one expert took every token), and `moe/experts_idle`, the (layer, expert) pairs
/// that received none. Tokens are never dropped (no capacity limit). Nothing for a dense model.
pub fn expert_load_metrics(
    world: &World,
    model: &rlhf_models::CausalLm,
    m: &mut crate::metrics::StepMetrics,
) -> Result<()> {
    let loads = model.take_expert_load();
    if loads.is_empty() {
        return Ok(());
    }
    let mut flat: Vec<f64> = loads.iter().flat_map(|(_, l)| l.iter().map(|&c| c as f64)).collect();
    if world.is_distributed() {
        flat = world.all_reduce_f64(&flat, rlhf_collective::ReduceOp::Sum).map_err(err)?;
    }
    let (mut max, mut min, mut idle, mut at) = (0.0f64, f64::INFINITY, 0usize, 0usize);
    for (_, layer) in &loads {
        let counts = &flat[at..at + layer.len()];
        at += layer.len();
        let total: f64 = counts.iter().sum();
        if total == 0.0 {
            continue;
        }
        let balanced = total / counts.len() as f64;
        for &c in counts {
            max = max.max(c / balanced);
            min = min.min(c / balanced);
            idle += usize::from(c == 0.0);
        }
    }
    if min.is_finite() {
        m.set("moe/load_max", max);
        m.set("moe/load_min", min);
        m.set("moe/experts_idle", idle as f64);
    }
    Ok(())
}
