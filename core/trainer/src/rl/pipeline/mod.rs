//! **Asynchronous rollouts** (`rollout.max_staleness = k > 0`): stages 1–2 run ahead of training.
//!
//! At the start of step `s` the trainer draws the prompts of step `s + k`, snapshots its policy
//! (`s` steps trained: version `s`) and hands both to the generation [`worker`], then takes the
//! batch of step `s` — sampled by version `max(0, s − k)` while the previous steps trained — and
//! scores and trains on it. So every sample is at most `k` steps stale (`rollout/staleness`), and
//! with `k = 1` generation of the next batch overlaps the whole of the current step, as in verl's
//! one-step off-policy trainer; AReaL bounds staleness the same way. The worker records the
//! sampled tokens' log-probs under the policy that sampled them: they are the behaviour
//! log-probs, so `[rollout.is_correction]` weighs each token by `π_old / π_behavior` against
//! the generating policy, and `is/*` measures the gap.
//!
//! Deterministic by construction: which weights sample which batch is fixed by the schedule (not
//! by timing), the worker's noise is keyed by the batch, and the trainer's own random draws never
//! meet the worker's. A checkpoint waits for the batches in flight and stores them
//! ([`saved`]), so a resumed run trains on exactly the batches the uninterrupted run would have.

pub mod saved;
pub mod stage;
pub mod worker;

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use rlhf_models::CausalLm;

use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use worker::{BusyClock, Finished, Job, Snapshot, WorkerSpec};

/// The trainer's side of the worker.
pub struct Pipeline {
    jobs: Option<Sender<Job>>,
    results: Receiver<Result<Finished>>,
    worker: Option<JoinHandle<()>>,
    /// Jobs sent and not yet received.
    in_flight: usize,
    /// Batches received and not yet trained on, oldest first.
    ready: VecDeque<Finished>,
    /// The step whose batch is submitted next.
    pub next: usize,
    /// The version of the policy last sent to the worker (the steps before `k` all sample with
    /// version 0).
    sent_version: Option<usize>,
    /// Whether snapshots carry the output head (a bf16 worker copy).
    head: bool,
    /// The worker's seconds spent sampling (nanoseconds, cumulative).
    busy: Arc<BusyClock>,
    /// The worker's busy seconds and the time at the start of the current step.
    mark: (f64, Instant),
    /// Seconds the trainer waited for this step's batch.
    waited_s: f64,
    /// The intra-op threads before the pipeline started (restored when it stops).
    threads_before: i32,
}

impl Pipeline {
    /// Starts the worker of `spec` (the trainer keeps `trainer_threads` intra-op threads) and
    /// waits until its copy of the policy is built; `next` is the first step to submit.
    pub fn start(spec: WorkerSpec, trainer_threads: i32, next: usize) -> Result<Pipeline> {
        let head = spec.bf16;
        let threads_before = tch::get_num_threads();
        let (jobs, job_rx) = channel();
        let (done_tx, results) = channel();
        let (ready_tx, ready_rx) = channel();
        let busy = Arc::new(BusyClock::new());
        let clock = busy.clone();
        let worker = std::thread::Builder::new()
            .name("rollout-worker".into())
            .spawn(move || worker::serve(spec, job_rx, done_tx, ready_tx, clock))
            .map_err(|e| TrainerError::Run(format!("cannot start the generation worker: {e}")))?;
        let mut p = Pipeline {
            jobs: Some(jobs),
            results,
            worker: Some(worker),
            in_flight: 0,
            ready: VecDeque::new(),
            next,
            sent_version: None,
            head,
            busy,
            mark: (0.0, Instant::now()),
            waited_s: 0.0,
            threads_before,
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(p.stopped()),
        }
        tch::set_num_threads(trainer_threads);
        p.mark = (p.busy.seconds(), Instant::now());
        Ok(p)
    }

    /// A snapshot of `actor` as policy `version`, unless the worker was already sent that version.
    pub fn weights(&mut self, actor: &CausalLm, version: usize) -> Result<Option<Snapshot>> {
        if self.sent_version == Some(version) {
            return Ok(None);
        }
        self.sent_version = Some(version);
        Ok(Some(Snapshot::of(actor, version, self.head)?))
    }

    /// Queues `job` (the worker samples jobs in order).
    pub fn submit(&mut self, job: Job) -> Result<()> {
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        if !sent {
            return Err(self.stopped());
        }
        self.in_flight += 1;
        self.next += 1;
        Ok(())
    }

    /// Waits for the batch of step `index` and hands it over.
    pub fn take(&mut self, index: usize) -> Result<Finished> {
        let t = Instant::now();
        if self.ready.is_empty() {
            self.receive_one()?;
        }
        self.waited_s = t.elapsed().as_secs_f64();
        match self.ready.pop_front() {
            Some(f) if f.index == index => Ok(f),
            Some(f) => Err(TrainerError::Run(format!(
                "generation worker: step {} expected the batch of step {index}, got step {}'s",
                index + 1,
                f.index
            ))),
            None => Err(TrainerError::Run(format!("generation worker: no batch for step {}", index + 1))),
        }
    }

    /// Waits for every batch in flight (before a checkpoint stores them).
    pub fn drain(&mut self) -> Result<()> {
        while self.in_flight > 0 {
            self.receive_one()?;
        }
        Ok(())
    }

    /// The batches sampled ahead, oldest first (all of them after [`Pipeline::drain`]).
    pub fn ahead(&self) -> impl Iterator<Item = &Finished> {
        self.ready.iter()
    }

    /// Puts batches a checkpoint stored back in line.
    pub fn preload(&mut self, batches: Vec<Finished>) {
        self.ready.extend(batches);
    }

    /// The step's overlap timings: how long the trainer waited for its batch
    /// (`time/rollout_wait`), and the share of the step each side sat idle — the "bubbles"
    /// (`time/idle_trainer`, `time/idle_generator`).
    pub fn step_metrics(&mut self, step_s: f64, m: &mut StepMetrics) {
        let busy = self.busy.seconds();
        let wall = self.mark.1.elapsed().as_secs_f64().max(1e-9);
        let worked = busy - self.mark.0;
        m.set("time/rollout_wait", self.waited_s);
        m.set("time/idle_trainer", (self.waited_s / step_s.max(1e-9)).min(1.0));
        m.set("time/idle_generator", (1.0 - worked / wall).clamp(0.0, 1.0));
        self.mark = (busy, Instant::now());
    }

    fn receive_one(&mut self) -> Result<()> {
        match self.results.recv() {
            Ok(Ok(f)) => {
                self.in_flight -= 1;
                self.ready.push_back(f);
                Ok(())
            }
            Ok(Err(e)) => {
                self.in_flight = 0;
                Err(e)
            }
            Err(_) => Err(self.stopped()),
        }
    }

    /// The error when the worker is gone: its panic message, if it panicked.
    fn stopped(&mut self) -> TrainerError {
        self.jobs = None;
        self.in_flight = 0;
        let why = match self.worker.take().map(JoinHandle::join) {
            Some(Err(p)) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "it panicked".into()),
            _ => "it stopped".into(),
        };
        TrainerError::Run(format!("the generation worker failed: {why}"))
    }
}

impl Drop for Pipeline {
    /// Hangs up (the worker ends after its current batch), waits for it, and gives the trainer
    /// its threads back.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        tch::set_num_threads(self.threads_before);
    }
}
