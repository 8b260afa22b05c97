//! The generation worker of asynchronous rollouts: a thread with its own copy of the policy
//! (in the policy's dtype, or bf16 with `rollout.decode_dtype = "bf16"`) and its own share of the
//! CPU's intra-op threads. It takes jobs in order, brings its copy to the job's weight snapshot,
//! and samples the job's batch — single responses, or multi-turn episodes against the shared
//! environment — with noise keyed by the job ([`rlhf_generation::noise`]),
//! never touching libtorch's process-wide generator, which the trainer keeps using.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rlhf_models::CausalLm;
use rlhf_plugin_api::Episode;
use rlhf_tokenizer::HfTokenizer;
use tch::{Device, Kind, Tensor};

use crate::config::{EnvironmentConfig, RolloutConfig, VllmConfig};
use crate::error::{Result, TrainerError};
use crate::plugins::EnvHandle;
use crate::rl::engine::vllm::VllmEngine;
use crate::rl::env_stage::EnvOutcome;
use crate::rl::episode::{self, Decoder, EpisodeSettings};
use crate::rl::observed::ObservationImages;
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::{self, Rollout};
use crate::rl::shard::Part;

/// The policy's weights after `version` steps, copied out of the trainer's actor.
pub struct Snapshot {
    pub version: usize,
    tensors: HashMap<String, Tensor>,
    /// The output head in the policy's dtype, for a bf16 copy (which samples from an f32 head).
    head: Option<Tensor>,
}

impl Snapshot {
    /// Copies every variable of `actor` (and its output head when `head`).
    pub fn of(actor: &CausalLm, version: usize, head: bool) -> Result<Snapshot> {
        tch::no_grad(|| -> Result<Snapshot> {
            let mut tensors = HashMap::new();
            for (name, t) in actor.vs.variables() {
                tensors.insert(name, t.f_detach()?.copy());
            }
            let head = if head { Some(actor.lm_head_weight().f_detach()?.copy()) } else { None };
            Ok(Snapshot { version, tensors, head })
        })
    }
}

/// The worker's seconds spent sampling, readable while a batch is in progress (so a batch that
/// spans two steps counts in each for the part it ran there).
pub struct BusyClock {
    origin: Instant,
    /// Nanoseconds of finished batches.
    done: AtomicU64,
    /// When the current batch started (nanoseconds after `origin`), `u64::MAX` when idle.
    since: AtomicU64,
}

impl BusyClock {
    pub fn new() -> BusyClock {
        BusyClock { origin: Instant::now(), done: AtomicU64::new(0), since: AtomicU64::new(u64::MAX) }
    }

    fn now(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    fn start(&self) {
        self.since.store(self.now(), Ordering::Relaxed);
    }

    fn stop(&self) {
        let since = self.since.swap(u64::MAX, Ordering::Relaxed);
        if since != u64::MAX {
            self.done.fetch_add(self.now().saturating_sub(since), Ordering::Relaxed);
        }
    }

    /// Seconds spent sampling so far, the running batch included.
    pub fn seconds(&self) -> f64 {
        let since = self.since.load(Ordering::Relaxed);
        let running = if since == u64::MAX { 0 } else { self.now().saturating_sub(since) };
        (self.done.load(Ordering::Relaxed) + running) as f64 * 1e-9
    }
}

impl Default for BusyClock {
    fn default() -> Self {
        BusyClock::new()
    }
}

/// One batch to sample.
pub struct Job {
    /// The step that trains on it (0-based).
    pub index: usize,
    /// The steps the sampling policy has trained.
    pub version: usize,
    /// The policy of `version`, when the worker does not hold it yet.
    pub weights: Option<Snapshot>,
    pub batch: PromptBatch,
    pub part: Part,
    /// With an environment: one episode per row.
    pub episodes: Option<Vec<Episode>>,
    /// Keys the sampling noise (see the module docs).
    pub noise_key: u64,
}

/// A sampled batch.
pub struct Finished {
    pub index: usize,
    /// The steps the sampling policy had trained.
    pub version: usize,
    pub rollout: Rollout,
    pub env: Option<EnvOutcome>,
    pub group_of_row: Vec<(usize, i64)>,
    pub part: Part,
    /// Seconds the worker spent on it.
    pub gen_s: f64,
}

/// What the worker is built from.
pub struct WorkerSpec {
    pub source_dir: PathBuf,
    pub device: Device,
    pub kind: Kind,
    pub bf16: bool,
    pub threads: i32,
    pub rollout: RolloutConfig,
    pub env_cfg: EnvironmentConfig,
    pub stops: Vec<String>,
    pub env: Option<Arc<Mutex<EnvHandle>>>,
    /// How observations' images are read (a policy that reads images).
    pub observation_images: Option<crate::prompt_images::PromptImages>,
    pub tok: HfTokenizer,
    pub eos_ids: Vec<i64>,
    pub pad: i64,
    /// On the vLLM engine: its settings and the run directory. The worker then holds no policy:
    /// it sends the batch to the servers, which the trainer syncs between batches.
    pub vllm: Option<(VllmConfig, PathBuf)>,
}

/// Who samples in the worker.
enum Sampler {
    /// A copy of the policy; `head` is the f32 output head a bf16 copy samples from; `version`
    /// the policy it holds.
    Local { model: Box<CausalLm>, head: Option<Tensor>, version: Option<usize> },
    /// The vLLM servers (each batch at the version the trainer synced before sending it).
    Vllm(Box<VllmEngine>),
}

/// The worker's state.
struct Worker {
    spec: WorkerSpec,
    sampler: Sampler,
}

/// The worker thread's body: builds the copy (reporting on `ready`), then serves `jobs` until
/// the trainer hangs up; `busy` times the sampling.
pub fn serve(
    spec: WorkerSpec,
    jobs: Receiver<Job>,
    done: Sender<Result<Finished>>,
    ready: Sender<Result<()>>,
    busy: Arc<BusyClock>,
) {
    // The thread's own intra-op pool size (libtorch sizes it per thread once initialised).
    let _ = tch::get_num_threads();
    tch::set_num_threads(spec.threads);
    let mut worker = match Worker::new(spec) {
        Ok(w) => {
            let _ = ready.send(Ok(()));
            w
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    while let Ok(job) = jobs.recv() {
        let t = Instant::now();
        busy.start();
        let out = worker.run(job, t);
        busy.stop();
        let failed = out.is_err();
        if done.send(out).is_err() || failed {
            return;
        }
    }
}

impl Worker {
    fn new(spec: WorkerSpec) -> Result<Worker> {
        if let Some((cfg, run_dir)) = &spec.vllm {
            let engine = Box::new(VllmEngine::new(cfg, run_dir)?);
            return Ok(Worker { spec, sampler: Sampler::Vllm(engine) });
        }
        let kind = if spec.bf16 { Kind::BFloat16 } else { spec.kind };
        let mut model = CausalLm::from_dir(&spec.source_dir, spec.device, kind)?;
        model.freeze();
        let head = if spec.bf16 {
            let h = model.lm_head_weight().f_to_kind(spec.kind)?;
            model.set_output_head(h.shallow_clone())?;
            Some(h)
        } else {
            None
        };
        Ok(Worker { spec, sampler: Sampler::Local { model: Box::new(model), head, version: None } })
    }

    /// Brings the local copy to `w` (once per version).
    fn sync(&mut self, w: &Snapshot) -> Result<()> {
        let Sampler::Local { model, head, version } = &mut self.sampler else { return Ok(()) };
        if *version == Some(w.version) {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for (name, mut t) in model.vs.variables() {
                let src = w.tensors.get(&name).ok_or_else(|| {
                    TrainerError::Run(format!("generation worker: the policy has no variable `{name}`"))
                })?;
                t.f_copy_(src)?;
            }
            if let (Some(h), Some(src)) = (head, &w.head) {
                h.f_copy_(src)?;
            }
            Ok(())
        })?;
        *version = Some(w.version);
        Ok(())
    }

    fn run(&mut self, job: Job, t0: Instant) -> Result<Finished> {
        if let Some(w) = &job.weights {
            self.sync(w)?;
        }
        if let Sampler::Local { version, .. } = &self.sampler {
            if *version != Some(job.version) {
                return Err(TrainerError::Run(format!(
                    "generation worker: step {} needs the policy of version {}, the worker holds {version:?}",
                    job.index + 1,
                    job.version,
                )));
            }
        }
        let s = &self.spec;
        let (rollout, env) = match (&job.episodes, &s.env) {
            (Some(episodes), Some(env)) => {
                let settings = EpisodeSettings {
                    rollout: &s.rollout,
                    env: &s.env_cfg,
                    stops: &s.stops,
                    tok: &s.tok,
                    eos_ids: &s.eos_ids,
                    pad: s.pad,
                    rows: job.part.window(),
                    turn_seed: job.noise_key,
                    keyed: true,
                    observation_images: ObservationImages::of(s.observation_images.as_ref()),
                };
                let decoder = match &self.sampler {
                    Sampler::Local { model, .. } => Decoder::Local { model, behavior: true },
                    Sampler::Vllm(e) => Decoder::Vllm(e),
                };
                let mut handle = env.lock().unwrap_or_else(|e| e.into_inner());
                let (rollout, outcome) = episode::run(&decoder, &mut handle, &job.batch, episodes, &settings)?.into();
                (rollout, Some(outcome))
            }
            _ => match &mut self.sampler {
                Sampler::Local { model, .. } => {
                    let g = s.rollout.samples_per_prompt as i64;
                    let mut cfg = rollout::generate_config(&s.rollout, &s.eos_ids, s.pad, job.part.window(), g, true);
                    cfg.noise_key = Some(job.noise_key);
                    (rollout::sample_with(model, &job.batch, &cfg)?, None)
                }
                Sampler::Vllm(e) => (e.sample(&job.batch, &s.rollout, &s.eos_ids, s.pad)?, None),
            },
        };
        Ok(Finished {
            index: job.index,
            version: job.version,
            rollout,
            env,
            group_of_row: job.batch.group_of_row,
            part: job.part,
            gen_s: t0.elapsed().as_secs_f64(),
        })
    }
}
