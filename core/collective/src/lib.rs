//! Data-parallel plumbing on libtorch's own c10d (the engine under `torch.distributed` and DDP):
//! a TCPStore rendezvous from torchrun's environment ([`Launch`]), a Gloo process group for CPU
//! tensors and NCCL for CUDA tensors ([`nccl`], loaded on first use), and the collectives the
//! trainer needs — all-reduce (sum/mean/max/min), broadcast, all-gather, reduce-scatter and
//! all-gather into one flat tensor (ZeRO's pair), barrier — each bounded by the group's timeout.
//!
//! A [`World`] of one (no launcher) needs no rendezvous and every collective is the identity, so
//! single-process runs do exactly what they did before.

mod error;
mod ffi;
mod launch;
pub mod nccl;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

pub use error::{CollectiveError, Result};
pub use launch::{free_port, Launch};

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size (Gloo has no average; the division is local).
    Mean,
    Max,
    Min,
}

/// How to join a world.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// Rendezvous and every collective fail after this long (a dead or stuck peer).
    pub timeout: Duration,
    /// Gloo's worker threads per group.
    pub threads: usize,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions { timeout: Duration::from_secs(600), threads: 1 }
    }
}

/// Bytes and seconds spent in collectives so far (for the benchmark and the step metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    pub calls: u64,
    pub bytes: u64,
    pub seconds: f64,
}

struct Inner {
    // Field order: the groups go before the store they use.
    cpu: ffi::Group,
    cuda: Mutex<Option<std::sync::Arc<ffi::Group>>>,
    store: ffi::Store,
    addr: String,
    timeout_ms: i64,
}

/// This process's place in the run and its process groups. Cloning gives another handle to the
/// same groups and statistics (a sharded model's gate keeps one).
#[derive(Clone)]
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    inner: Option<std::sync::Arc<Inner>>,
    stats: std::sync::Arc<Mutex<CommStats>>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "World {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

impl World {
    /// One process, no peers.
    pub fn single() -> World {
        World { rank: 0, size: 1, local_rank: 0, inner: None, stats: Default::default() }
    }

    /// Joins the world the launcher's environment describes, or [`World::single`] without one.
    pub fn from_env(opts: &InitOptions) -> Result<World> {
        match Launch::from_env()? {
            Some(l) => World::join(&l, opts),
            None => Ok(World::single()),
        }
    }

    /// Rendezvous at `MASTER_ADDR:MASTER_PORT` (rank 0 hosts the store unless torchrun's agent
    /// does) and builds the Gloo group. The Gloo transport binds `GLOO_SOCKET_IFNAME` when set,
    /// loopback when the master is on this machine's loopback, else this machine's hostname.
    pub fn join(l: &Launch, opts: &InitOptions) -> Result<World> {
        let timeout_ms = opts.timeout.as_millis().min(i64::MAX as u128) as i64;
        let addr = format!("{}:{}", l.master_addr, l.master_port);
        if std::env::var_os("TORCH_CPP_LOG_LEVEL").is_none() {
            ffi::quiet_logs();
        }
        let init_err = |message: String| CollectiveError::Init {
            rank: l.rank,
            addr: addr.clone(),
            message: error::one_line(&message),
        };
        let store = ffi::Store::tcp(&l.master_addr, l.master_port, l.rank, l.world_size, !l.agent_store, timeout_ms)
            .map_err(init_err)?;
        let iface = std::env::var("GLOO_SOCKET_IFNAME").ok().filter(|s| !s.is_empty());
        let loopback = matches!(l.master_addr.as_str(), "127.0.0.1" | "localhost" | "::1");
        let hostname = (iface.is_none() && loopback).then_some("127.0.0.1");
        let cpu = ffi::Group::gloo(
            &store,
            "rlhf/gloo",
            l.rank,
            l.world_size,
            iface.as_deref(),
            hostname,
            opts.threads.max(1),
            timeout_ms,
        )
        .map_err(init_err)?;
        tracing::debug!("rank {}/{}: gloo group ready ({addr})", l.rank, l.world_size);
        Ok(World {
            rank: l.rank,
            size: l.world_size,
            local_rank: l.local_rank,
            inner: Some(std::sync::Arc::new(Inner { cpu, cuda: Mutex::new(None), store, addr, timeout_ms })),
            stats: Default::default(),
        })
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Rank on this machine (selects the CUDA device).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Whether this rank writes the run's files (rank 0).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Whether there are peers.
    pub fn is_distributed(&self) -> bool {
        self.size > 1
    }

    /// Collective traffic so far.
    pub fn stats(&self) -> CommStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn op_err(&self, op: &'static str, message: String) -> CollectiveError {
        CollectiveError::Op { rank: self.rank, op, message: error::one_line(&message) }
    }

    fn torch_err(&self, e: tch::TchError) -> CollectiveError {
        CollectiveError::Torch(e, self.rank)
    }

    /// The group for tensors on `device` (NCCL for CUDA, made on first use by every rank).
    fn group_for(&self, device: Device, op: &'static str) -> Result<GroupRef<'_>> {
        let inner = self.inner.as_ref().expect("distributed world");
        match device {
            Device::Cpu => Ok(GroupRef::Borrowed(&inner.cpu)),
            Device::Cuda(index) => {
                let mut slot = inner.cuda.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    let g =
                        nccl::group(&inner.store, self.rank, self.size, index, inner.timeout_ms).map_err(
                            |e| match e {
                                e @ CollectiveError::Nccl(_) => e,
                                e => self.op_err(op, e.to_string()),
                            },
                        )?;
                    *slot = Some(std::sync::Arc::new(g));
                }
                Ok(GroupRef::Shared(slot.as_ref().expect("set").clone()))
            }
            other => Err(self.op_err(op, format!("tensors on {other:?} have no process group"))),
        }
    }

    fn timed<T>(&self, bytes: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = f()?;
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.calls += 1;
        s.bytes += bytes as u64;
        s.seconds += t.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Reduces `t` over all ranks, in place. `t` must be contiguous.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        let bytes = bytes_of(t);
        self.timed(bytes, || {
            let g = self.group_for(t.device(), "all_reduce")?;
            let code = match op {
                ReduceOp::Sum | ReduceOp::Mean => 0,
                ReduceOp::Max => 1,
                ReduceOp::Min => 2,
            };
            g.get().all_reduce(t, code).map_err(|m| self.op_err("all_reduce", m))?;
            if op == ReduceOp::Mean {
                let _ = t.shallow_clone().f_div_scalar_(self.size as f64).map_err(|e| self.torch_err(e))?;
            }
            Ok(())
        })
    }

    /// Copies rank `root`'s `t` into every rank's `t`, in place.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        self.timed(bytes_of(t), || {
            let g = self.group_for(t.device(), "broadcast")?;
            g.get().broadcast(t, root).map_err(|m| self.op_err("broadcast", m))
        })
    }

    /// Every rank's `t` (all of the same shape), in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let t = t.f_contiguous().map_err(|e| self.torch_err(e))?;
        if !self.is_distributed() {
            return Ok(vec![t]);
        }
        self.timed(bytes_of(&t) * self.size, || {
            let outs: Vec<Tensor> = (0..self.size).map(|_| t.empty_like()).collect();
            let g = self.group_for(t.device(), "all_gather")?;
            g.get().all_gather(&outs, &t).map_err(|m| self.op_err("all_gather", m))?;
            Ok(outs)
        })
    }

    /// Sums `input` (`[size · s]`, contiguous, alike on every rank) over the ranks and leaves
    /// this rank's part of the sum, elements `rank · s .. (rank + 1) · s`, in `output` (`[s]`,
    /// contiguous, same dtype and device) — `torch.distributed.reduce_scatter_tensor`, ZeRO's
    /// gradient reduction: each rank receives only the shard it updates, half an all-reduce's
    /// traffic. In a world of one `output` gets `input`.
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.check_flat("reduce_scatter", output, input)?;
        if !self.is_distributed() {
            return tch::no_grad(|| output.shallow_clone().f_copy_(input).map(|_| ()).map_err(|e| self.torch_err(e)));
        }
        self.timed(bytes_of(input), || {
            let g = self.group_for(input.device(), "reduce_scatter")?;
            g.get().reduce_scatter(output, input).map_err(|m| self.op_err("reduce_scatter", m))
        })
    }

    /// Every rank's `input` (`[s]`, contiguous) laid end to end in rank order into `output`
    /// (`[size · s]`, contiguous, same dtype and device) — `torch.distributed.all_gather_into_tensor`,
    /// how sharded parameters are put back together. In a world of one `output` gets `input`.
    pub fn all_gather_into(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.check_flat("all_gather_into", input, output)?;
        if !self.is_distributed() {
            return tch::no_grad(|| output.shallow_clone().f_copy_(input).map(|_| ()).map_err(|e| self.torch_err(e)));
        }
        self.timed(bytes_of(output), || {
            let g = self.group_for(input.device(), "all_gather_into")?;
            g.get().all_gather_into(output, input).map_err(|m| self.op_err("all_gather_into", m))
        })
    }

    /// [`World::all_gather_into`] without waiting for it: the returned [`Pending`] holds both
    /// tensors until [`Pending::wait`] (or its drop, which waits too). Every rank starts the same
    /// collectives in the same order, as with the blocking ones; others may run meanwhile.
    pub fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending> {
        self.check_flat("all_gather_into", input, output)?;
        self.start("all_gather_into", output, input, bytes_of(output), |g| g.all_gather_into_async(output, input))
    }

    /// [`World::reduce_scatter`] without waiting for it (see [`World::all_gather_into_async`]).
    pub fn reduce_scatter_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending> {
        self.check_flat("reduce_scatter", output, input)?;
        self.start("reduce_scatter", output, input, bytes_of(input), |g| g.reduce_scatter_async(output, input))
    }

    /// Starts the collective `op` (`f`) on the group of the tensors' device; in a world of one
    /// `output` gets `input` at once.
    fn start(
        &self,
        op: &'static str,
        output: &Tensor,
        input: &Tensor,
        bytes: usize,
        f: impl FnOnce(&ffi::Group) -> std::result::Result<ffi::Work, String>,
    ) -> Result<Pending> {
        let hold = (output.shallow_clone(), input.shallow_clone());
        if !self.is_distributed() {
            tch::no_grad(|| output.shallow_clone().f_copy_(input)).map_err(|e| self.torch_err(e))?;
            return Ok(Pending { world: self.clone(), op, work: None, _hold: hold });
        }
        let work = self.timed(bytes, || {
            let g = self.group_for(input.device(), op)?;
            f(g.get()).map_err(|m| self.op_err(op, m))
        })?;
        Ok(Pending { world: self.clone(), op, work: Some(work), _hold: hold })
    }

    /// `shard` and `full` are contiguous, of one dtype and device, and `full` holds `size` shards.
    fn check_flat(&self, op: &'static str, shard: &Tensor, full: &Tensor) -> Result<()> {
        let fits = shard.is_contiguous()
            && full.is_contiguous()
            && shard.kind() == full.kind()
            && shard.device() == full.device()
            && full.numel() == shard.numel() * self.size;
        if fits {
            return Ok(());
        }
        Err(self.op_err(
            op,
            format!(
                "a {:?} {:?} shard of {} elements and a {:?} {:?} whole of {} do not fit {} ranks (both contiguous)",
                shard.kind(),
                shard.device(),
                shard.numel(),
                full.kind(),
                full.device(),
                full.numel(),
                self.size
            ),
        ))
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self) -> Result<()> {
        match &self.inner {
            None => Ok(()),
            Some(inner) => inner.cpu.barrier().map_err(|m| self.op_err("barrier", m)),
        }
    }

    /// Reduces a few numbers over all ranks (f64 on the CPU group).
    pub fn all_reduce_f64(&self, xs: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        if !self.is_distributed() || xs.is_empty() {
            return Ok(xs.to_vec());
        }
        let t = Tensor::f_from_slice(xs).map_err(|e| self.torch_err(e))?;
        self.all_reduce(&t, op)?;
        Vec::<f64>::try_from(&t).map_err(|e| self.torch_err(e))
    }

    /// Every rank's bytes, in rank order (lengths may differ).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        if !self.is_distributed() {
            return Ok(vec![bytes.to_vec()]);
        }
        let lens = self.all_gather(&Tensor::from_slice(&[bytes.len() as i64]))?;
        let lens: Vec<usize> = lens.iter().map(|t| t.int64_value(&[0]) as usize).collect();
        let longest = lens.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = bytes.to_vec();
        padded.resize(longest, 0);
        let parts = self.all_gather(&Tensor::from_slice(&padded))?;
        parts
            .iter()
            .zip(&lens)
            .map(|(t, &n)| {
                let v = Vec::<u8>::try_from(t).map_err(|e| self.torch_err(e))?;
                Ok(v[..n].to_vec())
            })
            .collect()
    }

    /// Broadcasts every tensor of `params` from `root` (ranks start from the same weights).
    pub fn broadcast_all(&self, params: &[Tensor], root: usize) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        tch::no_grad(|| {
            for p in params {
                if p.is_contiguous() {
                    self.broadcast(p, root)?;
                } else {
                    let c = p.contiguous();
                    self.broadcast(&c, root)?;
                    p.shallow_clone().f_copy_(&c).map_err(|e| self.torch_err(e))?;
                }
            }
            Ok(())
        })
    }

    /// Sums the gradients of `params` over all ranks, flattened into buckets of at most
    /// `bucket_bytes` (as DDP does: one collective per bucket, not per tensor). A parameter
    /// without a gradient gets a zero one first, so every rank reduces the same buckets.
    pub fn all_reduce_grads(&self, params: &[Tensor], bucket_bytes: usize) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        tch::no_grad(|| {
            let mut grads = Vec::with_capacity(params.len());
            for p in params {
                ffi::ensure_grad(p).map_err(|m| self.op_err("all_reduce", m))?;
                grads.push(p.grad());
            }
            let mut bucket: Vec<&Tensor> = Vec::new();
            let mut size = 0usize;
            for g in &grads {
                let same = bucket.first().is_none_or(|b| b.kind() == g.kind() && b.device() == g.device());
                if !bucket.is_empty() && (!same || size + bytes_of(g) > bucket_bytes) {
                    self.reduce_bucket(&bucket)?;
                    bucket.clear();
                    size = 0;
                }
                size += bytes_of(g);
                bucket.push(g);
            }
            if !bucket.is_empty() {
                self.reduce_bucket(&bucket)?;
            }
            Ok(())
        })
    }

    fn reduce_bucket(&self, grads: &[&Tensor]) -> Result<()> {
        let flat = Tensor::f_cat(&grads.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(), 0)
            .map_err(|e| self.torch_err(e))?;
        self.all_reduce(&flat, ReduceOp::Sum)?;
        let mut offset = 0;
        for g in grads {
            let n = g.numel() as i64;
            let part = flat.f_narrow(0, offset, n).and_then(|p| p.f_view_as(g)).map_err(|e| self.torch_err(e))?;
            g.shallow_clone().f_copy_(&part).map_err(|e| self.torch_err(e))?;
            offset += n;
        }
        Ok(())
    }

    /// Checks that every rank holds the same `digest` of `what` (parameters after training, the
    /// configuration at start); names the ranks that differ.
    pub fn check_same(&self, digest: u64, what: &str) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        let all = self.all_gather(&Tensor::from_slice(&[digest as i64]))?;
        let all: Vec<u64> = all.iter().map(|t| t.int64_value(&[0]) as u64).collect();
        let differ: Vec<String> =
            all.iter().enumerate().filter(|(_, &d)| d != all[0]).map(|(r, _)| r.to_string()).collect();
        if differ.is_empty() {
            Ok(())
        } else {
            Err(self.op_err("check_same", format!("{what} differ between rank 0 and rank(s) {}", differ.join(", "))))
        }
    }

    /// `host:port` of the rendezvous (None for a single process).
    pub fn master(&self) -> Option<&str> {
        self.inner.as_ref().map(|i| i.addr.as_str())
    }
}

/// A group borrowed from the world or shared with its lazily made CUDA slot.
/// A collective in flight ([`World::all_gather_into_async`], [`World::reduce_scatter_async`]).
pub struct Pending {
    world: World,
    op: &'static str,
    work: Option<ffi::Work>,
    /// The output and input, alive while the collective writes and reads them.
    _hold: (Tensor, Tensor),
}

impl Pending {
    /// Waits until the output holds the result (the time waited counts as collective time).
    pub fn wait(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        let Some(work) = self.work.take() else { return Ok(()) };
        let (w, t) = (&self.world, Instant::now());
        let g = w.group_for(self._hold.0.device(), self.op)?;
        g.get().wait(&work, self.op).map_err(|m| w.op_err(self.op, m))?;
        w.stats.lock().unwrap_or_else(|e| e.into_inner()).seconds += t.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // The buffers must outlive the transfer; an error here was (or will be) reported by the
        // rank's next collective.
        let _ = self.finish();
    }
}

enum GroupRef<'a> {
    Borrowed(&'a ffi::Group),
    Shared(std::sync::Arc<ffi::Group>),
}

impl GroupRef<'_> {
    fn get(&self) -> &ffi::Group {
        match self {
            GroupRef::Borrowed(g) => g,
            GroupRef::Shared(g) => g,
        }
    }
}

fn bytes_of(t: &Tensor) -> usize {
    let per = match t.kind() {
        Kind::Double | Kind::Int64 => 8,
        Kind::Float | Kind::Int => 4,
        Kind::Half | Kind::BFloat16 | Kind::Int16 => 2,
        _ => 1,
    };
    t.numel() * per
}

/// Drops the gradient of `param` — PyTorch's `zero_grad(set_to_none=True)`, which tch does not
/// expose — so the next backward allocates it while the activations it consumes are freed. The
/// one entry of the shim that is not a collective: it needs the same libtorch C++ API.
pub fn release_grad(param: &Tensor) -> Result<()> {
    ffi::release_grad(param).map_err(|message| CollectiveError::Torch(tch::TchError::Torch(message), 0))
}

/// Slices `0..n` into `size` contiguous parts whose lengths differ by at most one, and returns
/// part `rank` (the first `n % size` parts get the extra item).
pub fn shard(n: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_range_in_order() {
        for n in 0..9 {
            for size in 1..4 {
                let parts: Vec<_> = (0..size).map(|r| shard(n, r, size)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[size - 1].end, n);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{lens:?}");
            }
        }
    }

    #[test]
    fn a_world_of_one_is_the_identity() {
        let w = World::single();
        let t = Tensor::from_slice(&[1.0f32, 2.0]);
        w.all_reduce(&t, ReduceOp::Mean).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.0, 2.0]);
        assert_eq!(w.all_gather(&t).unwrap().len(), 1);
        assert_eq!(w.all_gather_bytes(b"abc").unwrap(), vec![b"abc".to_vec()]);
        w.barrier().unwrap();
        w.check_same(7, "parameters").unwrap();
        assert_eq!(w.stats(), CommStats::default());
    }
}
