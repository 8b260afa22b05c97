//! Running the decode step: eagerly, or on CUDA as a captured CUDA graph.
//!
//! A decode step issues a few hundred small kernels; launched one by one from the host, the GPU
//! waits on the host at small batches (about a millisecond per layer and step whatever the
//! batch). Captured once as a CUDA graph (libtorch's `at::cuda::CUDAGraph`, through
//! [`rlhf_aten::cuda_graph`]) and replayed, a step is one launch. Per batch size (the decode
//! compacts finished rows into fewer, [`crate::decode`]) the first step runs eagerly on the
//! capture stream (a warm-up that is a real step: lazy initialisation happens outside the
//! capture), the second is captured and replayed, and every later step replays it. The graphs
//! of a decode share one memory pool and are freed together when the decode ends.
//!
//! Capture is impossible where a step reads a value back to the host: the model says why
//! ([`CausalLm::capture_blocker`]), and then, and off CUDA, steps run eagerly — the same
//! kernels, so the same tokens.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rlhf_aten::cuda_graph::{self, Graph, Pool, SideStream};
use rlhf_models::CausalLm;

use crate::config::GenerateConfig;
use crate::error::{GenerationError, Result};

/// Graph replays in this process (every decode step that ran as a graph).
static REPLAYS: AtomicU64 = AtomicU64::new(0);
/// Captures that failed (their decodes went on eagerly).
static FAILED: AtomicU64 = AtomicU64::new(0);

/// How many decode steps this process ran as CUDA graph replays.
pub fn graph_replays() -> u64 {
    REPLAYS.load(Ordering::Relaxed)
}

/// How many captures of a decode step failed in this process (each decode went on eagerly and
/// logged why).
pub fn graph_failures() -> u64 {
    FAILED.load(Ordering::Relaxed)
}

/// Logs `line` once per process.
fn log_once(line: String) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(line.clone()) {
        tracing::info!("{line}");
    }
}

/// How decode steps run.
pub(crate) enum Runner {
    Eager,
    Graphs(Graphs),
}

/// The CUDA graph of the current batch size, captured on first use.
pub(crate) struct Graphs {
    device: usize,
    pool: Pool,
    graph: Option<Graph>,
    /// The graphs of earlier batch sizes, kept until the decode ends: graphs sharing a pool are
    /// freed together (freeing one lets the allocator release the pool under the next capture).
    retired: Vec<Graph>,
    /// The warm-up step of this batch size has run.
    warm: bool,
}

fn graph_error(e: cuda_graph::Error) -> GenerationError {
    GenerationError::Input(format!("CUDA graph: {e}"))
}

impl Runner {
    /// Graphs when `cfg.cuda_graphs`, the model is on CUDA, its step can be captured and the
    /// CUDA graph library loads; else eager (saying why once, when graphs were asked for).
    pub(crate) fn new(model: &CausalLm, cfg: &GenerateConfig) -> Result<Runner> {
        let tch::Device::Cuda(device) = model.device() else { return Ok(Runner::Eager) };
        if !cfg.cuda_graphs {
            return Ok(Runner::Eager);
        }
        if let Some(why) = model.capture_blocker() {
            log_once(format!("decoding without CUDA graphs: {why}"));
            return Ok(Runner::Eager);
        }
        match Pool::new() {
            Ok(pool) => {
                log_once(format!("decoding with CUDA graphs on cuda:{device} (one per batch size)"));
                Ok(Runner::Graphs(Graphs { device, pool, graph: None, retired: Vec::new(), warm: false }))
            }
            Err(e) => {
                log_once(format!("decoding without CUDA graphs: {e}"));
                Ok(Runner::Eager)
            }
        }
    }

    /// Runs one decode step: `unit` eagerly, or the graph of this batch size (capturing it
    /// from `unit` first). `unit` must be capture-safe and touch no host state.
    pub(crate) fn run(&mut self, unit: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let Runner::Graphs(g) = self else { return unit() };
        if let Some(graph) = &g.graph {
            REPLAYS.fetch_add(1, Ordering::Relaxed);
            return graph.replay().map_err(graph_error);
        }
        let side = SideStream::enter(g.device).map_err(graph_error)?;
        if !g.warm {
            g.warm = true;
            let r = unit();
            side.exit().map_err(graph_error)?;
            return r;
        }
        // Capturing records the step without running it; a failed capture ran nothing either.
        let captured = Graph::capture(&g.pool, &mut || unit().map_err(|e| e.to_string()));
        side.exit().map_err(graph_error)?;
        match captured {
            Ok(graph) => {
                REPLAYS.fetch_add(1, Ordering::Relaxed);
                graph.replay().map_err(graph_error)?;
                g.graph = Some(graph);
                Ok(())
            }
            Err(e) => {
                FAILED.fetch_add(1, Ordering::Relaxed);
                log_once(format!("decoding without CUDA graphs: the step could not be captured ({e})"));
                *self = Runner::Eager;
                unit()
            }
        }
    }

    /// Stops replaying the graph: the batch changed size (its buffers are new).
    pub(crate) fn reset(&mut self) {
        if let Runner::Graphs(g) = self {
            g.retired.extend(g.graph.take());
            g.warm = false;
        }
    }
}
