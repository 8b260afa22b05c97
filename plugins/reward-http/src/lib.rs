//! `reward-http`: scores samples with remote reward servers, speaking OpenRLHF's remote reward
//! model protocol (`--remote_rm_url`) or LLaMA-Factory's score API (`/v1/score/evaluation`).
//!
//! A batch is split into requests of at most `max_samples_per_request` samples, sent round-robin
//! to the configured URLs with at most `concurrency` in flight. Each request has a hard deadline
//! (`timeout_s`, connect to last byte) and is retried `retries` times with exponential backoff on
//! any failure: connection error, timeout, non-2xx status, a body that is not JSON, a missing
//! field, the wrong number of scores, a value that is not a finite number. After the last retry,
//! `on_error = "fail"` fails the step with one line naming the URL and the problem;
//! `on_error = "skip"` gives that request's samples NaN scores, which the host drops and counts.
//!
//! The text scored is `prompt + response` (the prompt as the policy saw it, template applied).
//! Wire formats ([`wire`]) and the config ([`config::Config`]) are described for users in
//! `docs/rewards.md`, section "reward-http".
//!
//! Metrics: `reward_http/requests` (requests of the batch), `reward_http/retries` (attempts after
//! the first), `reward_http/latency_s` (mean wall time of an attempt), with `on_error = "skip"`
//! also `reward_http/skipped_requests` and `reward_http/skipped_samples`, and for each OpenRLHF
//! `extra_logs` entry `reward_http/<name>` (mean over the samples of the batch).
//!
//! # Config
//!
//! ```toml
//! [[rewards]]
//! plugin = "reward-http"
//! [rewards.config]
//! url = "http://127.0.0.1:5000/get_reward"   # or urls = ["http://a:5000/get_reward", ...]
//! format = "openrlhf"              # openrlhf | llamafactory
//! # model = "reward-model"         # llamafactory: the request's `model`
//! use_scores = false               # openrlhf: use the response's `scores` instead of `rewards`
//! # token_env = "REWARD_API_KEY"   # sends `Authorization: Bearer $REWARD_API_KEY`
//! timeout_s = 30.0                 # per request, connect to last byte
//! retries = 3                      # at most retries + 1 attempts per request
//! backoff_s = 0.5                  # before the 1st retry; doubles, at most 8 s
//! max_samples_per_request = 64
//! concurrency = 4                  # requests in flight
//! on_error = "fail"                # fail | skip (NaN scores: the host drops those samples)
//! ```

pub mod client;
pub mod config;
pub mod wire;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use rlhf_plugin_api::prelude::*;

use crate::client::{Client, Job};
use crate::config::{OnError, Settings};
use crate::wire::ExtraLog;

/// The reward source.
#[derive(Debug)]
pub struct RewardHttp {
    client: Arc<Client>,
    /// Single-threaded: requests are I/O-bound and run as tasks on it.
    runtime: tokio::runtime::Runtime,
    /// Round-robin position: the URL of the next request, carried across batches.
    next_url: usize,
}

impl RewardHttp {
    /// A source with already validated settings.
    pub fn from_settings(settings: Settings) -> Result<Self, PluginError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PluginError::external(format!("cannot start the tokio runtime: {e}")))?;
        let client =
            Client::new(settings).map_err(|e| PluginError::external(format!("cannot build the HTTP client: {e}")))?;
        Ok(RewardHttp { client: Arc::new(client), runtime, next_url: 0 })
    }

    /// The settings in use.
    pub fn settings(&self) -> &Settings {
        &self.client.settings
    }
}

/// Running mean of one `extra_logs` entry over samples.
#[derive(Debug, Default, Clone, Copy)]
struct Mean {
    sum: f64,
    count: f64,
}

impl RewardSource for RewardHttp {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let this = RewardHttp::from_settings(Settings::parse(config)?)?;
        let s = this.settings();
        let urls: Vec<&str> = s.urls.iter().map(|u| u.as_str()).collect();
        tracing::info!("reward-http: {} endpoint(s) {urls:?}, format {:?}", urls.len(), s.format);
        Ok(this)
    }

    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError> {
        if samples.is_empty() {
            return Ok(Scores::default());
        }
        let t0 = Instant::now();
        let s = &self.client.settings;
        let per_request = s.max_samples_per_request;
        let mut jobs = Vec::new();
        for (k, chunk) in samples.chunks(per_request).enumerate() {
            let body = serde_json::to_vec(&wire::request_body(&s.format, chunk))
                .map_err(|e| PluginError::compute(format!("cannot serialize the request: {e}")))?;
            let url = (self.next_url + k) % s.urls.len();
            jobs.push(Job { url, start: k * per_request, len: chunk.len(), body });
        }
        self.next_url = (self.next_url + jobs.len()) % s.urls.len();
        let spans: Vec<(usize, usize)> = jobs.iter().map(|j| (j.start, j.len)).collect();
        let on_error = s.on_error;
        let outcomes = self.runtime.block_on(self.client.run(jobs, on_error == OnError::Fail));

        let mut scores = vec![f64::NAN; samples.len()];
        let (mut retries, mut latencies) = (0u64, Vec::new());
        let (mut skipped_requests, mut skipped_samples) = (0usize, 0usize);
        let mut extra: BTreeMap<String, Mean> = BTreeMap::new();
        let mut failure = None;
        for (&(start, len), outcome) in spans.iter().zip(outcomes) {
            retries += u64::from(outcome.attempts.saturating_sub(1));
            latencies.extend(outcome.latencies);
            match outcome.result {
                Ok(reply) => {
                    scores[start..start + len].copy_from_slice(&reply.scores);
                    for (name, log) in reply.extra_logs {
                        let m = extra.entry(name).or_default();
                        match log {
                            ExtraLog::PerSample(values) => {
                                m.sum += values.iter().sum::<f64>();
                                m.count += values.len() as f64;
                            }
                            ExtraLog::Scalar(v) => {
                                m.sum += v * len as f64;
                                m.count += len as f64;
                            }
                        }
                    }
                }
                // The first failure that was actually attempted (later jobs may be unsent).
                Err(f) if on_error == OnError::Fail => {
                    if failure.is_none() && f.attempts > 0 {
                        failure = Some(f);
                    }
                }
                Err(f) => {
                    tracing::warn!("{f}; scoring its {len} sample(s) NaN (on_error = \"skip\")");
                    skipped_requests += 1;
                    skipped_samples += len;
                }
            }
        }
        if let Some(f) = failure {
            return Err(PluginError::external(f.to_string()));
        }
        let mut metrics = vec![
            ("reward_http/requests".to_string(), spans.len() as f64),
            ("reward_http/retries".to_string(), retries as f64),
            ("reward_http/latency_s".to_string(), latencies.iter().sum::<f64>() / latencies.len().max(1) as f64),
        ];
        if on_error == OnError::Skip {
            metrics.push(("reward_http/skipped_requests".to_string(), skipped_requests as f64));
            metrics.push(("reward_http/skipped_samples".to_string(), skipped_samples as f64));
        }
        for (name, m) in extra {
            if m.count > 0.0 {
                metrics.push((format!("reward_http/{name}"), m.sum / m.count));
            }
        }
        tracing::debug!(
            "reward-http: {} samples in {} request(s), {retries} retries, {:.3} s",
            samples.len(),
            spans.len(),
            t0.elapsed().as_secs_f64()
        );
        Ok(Scores { scores, metrics })
    }
}

export_reward!(
    RewardHttp,
    name: "reward-http",
    description: "remote reward servers over HTTP (OpenRLHF remote RM / LLaMA-Factory score API)",
);
