//! `reward-python`: scores samples with the user's Python function, called the way TRL
//! (`reward_funcs`), verl (`compute_score`) or OpenRLHF (`reward_func`) call it.
//!
//! A pool of `workers` long-lived processes each imports the user's file once ([`worker`]); a batch
//! is split into one contiguous chunk per worker and sent as a JSON line over the worker's stdin
//! ([`wire`]). Every call has a deadline (`timeout_s`); a worker that times out, dies or writes
//! something that is not a reply is killed and replaced, and its samples get `on_error` (fail the
//! step, skip them, or a fixed score), as do samples the function raised for (verl calls the
//! function per sample, so one sample's exception costs only that sample). A `None` score is
//! `on_none` (TRL sums the other functions' rewards: 0.0 by default). Scores are put back in
//! batch order, so the pool size never changes them.
//!
//! Metrics (prefix `reward_python/<file stem>.<function>/`; a second source of this process whose
//! file stem and function are the same gets `<file stem>-2`, then `-3`, ...): `latency_s` (wall time of the batch), `none`,
//! `errors` (samples given `on_error`), `restarts` (workers replaced), and the function's own:
//! a verl dict's other numbers and OpenRLHF's `extra_logs`, each the mean over the samples.
//!
//! # Config
//!
//! ```toml
//! [[rewards]]
//! plugin = "reward-python"
//! [rewards.config]
//! file = "examples/rewards/math_verify_reward.py"
//! signature = "trl"            # trl | verl | openrlhf
//! # function = "reward_func"   # default: reward_func (trl, openrlhf), compute_score (verl)
//! # python = "/opt/venv/bin/python"   # or venv = "/opt/venv"; default $RLHF_PYTHON, else python3
//! workers = 1
//! timeout_s = 60.0             # per call
//! on_error = "fail"            # fail | skip | a number
//! on_none = 0.0                # a number | skip
//! # conversational = true      # trl: messages instead of text (default: when a chat template was applied)
//! ```

pub mod config;
pub mod wire;
pub mod worker;

use std::collections::BTreeMap;
use std::time::Instant;

use rlhf_plugin_api::prelude::*;

use crate::config::{Fallback, Settings};
use crate::wire::{Reply, RequestOptions};
use crate::worker::{Launch, Worker};

/// The reward source.
#[derive(Debug)]
pub struct RewardPython {
    settings: Settings,
    launch: Launch,
    options: RequestOptions,
    /// `None` only between a failed worker's death and its replacement.
    workers: Vec<Option<Worker>>,
    /// `reward_python/<file stem>.<function>`, unique in this process ([`claim_prefix`]).
    prefix: String,
}

/// Metric prefixes handed out in this process, with the settings of the source that has each.
static PREFIXES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// The metric prefix of a source with `settings`: `reward_python/<file stem>.<function>`, or
/// `<file stem>-N` when another source of this process (other settings: `a/reward.py` and
/// `b/reward.py`) already has that one, so two sources never share a metric. The same settings
/// get the same prefix again (an evaluation's copy of a training source). Sources are made in
/// config order, so every rank and every resume gives the same names.
fn claim_prefix(settings: &Settings) -> String {
    let key = format!("{settings:?}");
    let stem = settings.file.file_stem().map_or("reward".into(), |s| s.to_string_lossy());
    let mut taken = PREFIXES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, prefix)) = taken.iter().find(|(k, _)| *k == key) {
        return prefix.clone();
    }
    let name = |n: usize| match n {
        1 => format!("reward_python/{stem}.{}", settings.function),
        n => format!("reward_python/{stem}-{n}.{}", settings.function),
    };
    let n = (1..).find(|n| !taken.iter().any(|(_, p)| *p == name(*n))).unwrap_or(1);
    taken.push((key, name(n)));
    name(n)
}

impl RewardPython {
    /// Starts the pool; an import error of the user's file is a config error naming `file`.
    pub fn start(settings: Settings) -> Result<Self, PluginError> {
        let launch = Launch {
            python: settings.python.clone(),
            file: settings.file.clone(),
            function: settings.function.clone(),
            signature: settings.signature.as_str(),
            startup_timeout: settings.startup_timeout,
        };
        let options = RequestOptions { signature: settings.signature, conversational: settings.conversational };
        // Started in parallel: each imports the file (math-verify takes a while).
        let started: Vec<Result<Worker, String>> = std::thread::scope(|s| {
            let launch = &launch;
            let handles: Vec<_> = (0..settings.workers).map(|i| s.spawn(move || Worker::spawn(launch, i))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("panicked".into()))).collect()
        });
        let mut workers = Vec::new();
        for w in started {
            let w = w.map_err(|e| PluginError::config("file", format!("{}: {e}", settings.file.display())))?;
            workers.push(Some(w));
        }
        let prefix = claim_prefix(&settings);
        Ok(RewardPython { settings, launch, options, workers, prefix })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// `reward_python/<file stem>.<function>` (see [`claim_prefix`]): two sources never share a
    /// metric.
    pub fn metric_prefix(&self) -> String {
        self.prefix.clone()
    }

    /// Kills worker `k` and starts its replacement.
    fn replace(&mut self, k: usize) -> Result<(), PluginError> {
        if let Some(mut w) = self.workers[k].take() {
            w.kill();
        }
        let w = Worker::spawn(&self.launch, k)
            .map_err(|e| PluginError::external(format!("reward-python: cannot restart worker {k}: {e}")))?;
        self.workers[k] = Some(w);
        Ok(())
    }

    /// Sends each chunk to its worker and collects the replies; a failed chunk is
    /// `Err(message)` and its worker has been replaced.
    fn call(&mut self, chunks: &[&[Sample]]) -> Result<(Vec<Result<Reply, String>>, usize), PluginError> {
        let mut sent = Vec::with_capacity(chunks.len());
        for (k, chunk) in chunks.iter().enumerate() {
            let w = self.workers[k].as_ref().expect("every worker is running between calls");
            sent.push(w.send(&wire::request(chunk, &self.options)));
        }
        let deadline = Instant::now() + self.settings.timeout;
        let mut out = Vec::with_capacity(chunks.len());
        let mut restarts = 0;
        for (k, (chunk, sent)) in chunks.iter().zip(sent).enumerate() {
            let w = self.workers[k].as_mut().expect("every worker is running between calls");
            let got = sent.and_then(|()| w.recv(deadline));
            let reply = got.map_err(|f| (w.describe(&f), f)).and_then(|v| {
                wire::parse_reply(&v, chunk.len()).map_err(|m| (m.clone(), worker::Failure::Protocol(m)))
            });
            match reply {
                Ok(Ok(r)) => out.push(Ok(r)),
                Ok(Err(raised)) => out.push(Err(format!("the function raised {raised}"))),
                Err((message, failure)) => {
                    let what = match failure {
                        worker::Failure::Timeout => format!("timed out after {:?}", self.settings.timeout),
                        _ => message,
                    };
                    out.push(Err(format!("worker {k} (pid {}) {what}", w.pid)));
                    self.replace(k)?;
                    restarts += 1;
                }
            }
        }
        Ok((out, restarts))
    }
}

impl RewardSource for RewardPython {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let this = RewardPython::start(Settings::parse(config)?)?;
        let s = this.settings();
        tracing::info!(
            "reward-python: {}:{} ({} signature), {} worker(s) on {}",
            s.file.display(),
            s.function,
            s.signature.as_str(),
            s.workers,
            s.python.display()
        );
        Ok(this)
    }

    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError> {
        if samples.is_empty() {
            return Ok(Scores::default());
        }
        let t0 = Instant::now();
        let per = samples.len().div_ceil(self.workers.len());
        let chunks: Vec<&[Sample]> = samples.chunks(per).collect();
        let (replies, restarts) = self.call(&chunks)?;

        let (on_error, on_none) = (self.settings.on_error, self.settings.on_none);
        let mut scores = Vec::with_capacity(samples.len());
        let (mut nones, mut errors) = (0usize, 0usize);
        let mut means: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        let mut first_error = None;
        let mut fail = |start: usize, len: usize, message: String, scores: &mut Vec<f64>| {
            errors += len;
            let sample = if len == 1 { format!("sample {start}") } else { format!("samples {start}..{}", start + len) };
            if on_error != Fallback::Fail {
                tracing::warn!("reward-python: {sample}: {message}; scored {:?}", on_error);
            }
            first_error.get_or_insert_with(|| format!("reward-python: {sample}: {message}"));
            scores.extend(std::iter::repeat_n(on_error.score().unwrap_or(f64::NAN), len));
        };
        for ((k, chunk), reply) in chunks.iter().enumerate().zip(replies) {
            let start = k * per;
            match reply {
                Err(message) => fail(start, chunk.len(), message, &mut scores),
                Ok(r) => {
                    for (i, s) in r.scores.iter().enumerate() {
                        match (r.errors.get(&i), s) {
                            (Some(e), _) => fail(start + i, 1, format!("the function failed: {e}"), &mut scores),
                            (None, Some(v)) => scores.push(*v),
                            (None, None) => {
                                nones += 1;
                                scores.push(on_none.score().unwrap_or(f64::NAN));
                            }
                        }
                    }
                    for (name, (mean, count)) in r.metrics {
                        let e = means.entry(name).or_default();
                        let total = e.1 + count;
                        if total > 0.0 {
                            // Weighted means, never a sum: a sum of large finite values overflows.
                            e.0 = e.0 * (e.1 / total) + mean * (count / total);
                            e.1 = total;
                        }
                    }
                }
            }
        }
        if on_error == Fallback::Fail {
            if let Some(e) = first_error {
                return Err(PluginError::external(e));
            }
        }
        let prefix = self.metric_prefix();
        let mut metrics = vec![
            (format!("{prefix}/latency_s"), t0.elapsed().as_secs_f64()),
            (format!("{prefix}/none"), nones as f64),
            (format!("{prefix}/errors"), errors as f64),
            (format!("{prefix}/restarts"), restarts as f64),
        ];
        for (name, (mean, count)) in means {
            if count > 0.0 && mean.is_finite() {
                metrics.push((format!("{prefix}/{name}"), mean));
            }
        }
        Ok(Scores { scores, metrics })
    }
}

export_reward!(
    RewardPython,
    name: "reward-python",
    description: "the user's Python reward function (TRL reward_funcs, verl compute_score, OpenRLHF reward_func)",
);
