//! `env-http`: a multi-turn environment whose episodes live on a remote HTTP server. The host
//! runs the turn loop; every `reset` and `step` of a batch is one JSON `POST` to the server, which
//! keeps the episodes' state (in the spirit of verifiers' / OpenEnv's remote environments).
//!
//! # Wire format
//!
//! All bodies are JSON (`Content-Type: application/json`); responses may carry extra fields,
//! which are ignored. The endpoint paths are appended to `url`'s path (`http://h:8000/env` →
//! `http://h:8000/env/reset`).
//!
//! **`POST {url}/reset`** starts a batch of episodes (an id is the episode's row in the whole
//! batch, so every batch reuses the previous batch's ids: a reset ends the earlier episodes). The
//! request carries the prompt as the model saw it (chat template applied), the dataset's `label`
//! (or `null`), the dataset line's other fields as `metadata`, and the prompt's chat messages:
//!
//! ```json
//! {"episodes": [
//!   {"id": 0, "prompt": "<|user|>What is 17*23?<|assistant|>", "label": "391",
//!    "metadata": {"source": "gsm8k"}, "messages": [{"role": "user", "content": "What is 17*23?"}]}
//! ]}
//! ```
//!
//! The response has exactly one first observation per episode, in request order (appended to the
//! prompt; may be empty), and optionally its images (`images`, one list per episode, see below):
//!
//! ```json
//! {"observations": ["You have a calculator: write <calc>EXPR</calc>."]}
//! ```
//!
//! **`POST {url}/step`** sends one turn of the policy per running episode: its `id`, the 0-based
//! `turn`, the sampled `text` (special tokens removed), the sampled `token_ids`, and `ended`
//! (the episode's last turn — the policy sampled EOS, or a turn or token limit is reached: the
//! episode ends whatever `done` says; the step still gives its final reward):
//!
//! ```json
//! {"actions": [{"id": 0, "turn": 0, "text": "<calc>17*23</calc>", "token_ids": [27, 5, 9], "ended": false}]}
//! ```
//!
//! The response has exactly one result per action, in request order:
//!
//! ```json
//! {"results": [{"observation": "<result>391</result>", "reward": 0.0, "done": false,
//!               "metrics": {"tool_calls": 1}, "error": null}]}
//! ```
//!
//! - `observation` (string, default `""`): appended after the action (ignored when `done`);
//! - `reward` (finite number, default `0`): this turn's reward; an episode's reward is the sum;
//! - `done` (bool, default `false`): the episode is over;
//! - `metrics` (object of finite numbers, optional): per-episode counts, summed over turns and
//!   averaged over episodes by the host as `env/<name>/mean`;
//! - `error` (string or `null`, optional): this episode failed — it ends, costs the host's
//!   `environment.error_penalty` and counts in `env/errors`; the batch's other episodes go on;
//! - `images` (list, optional): the observation's images (a screenshot), one per `<image>` marker
//!   of `observation`, in order — each `{"bytes": "<base64>"}`, a `data:image/png;base64,…` URL,
//!   or `{"path": "/abs/file.png"}` (a file on the trainer's machine). A policy that reads images
//!   sees them where the markers are; for one that reads none the episode fails.
//!
//! # Failures
//!
//! A call fails as a whole — `Err(PluginError::external)`, one line naming the endpoint URL and
//! what was wrong, e.g. `http://127.0.0.1:8000/step: HTTP 500 after 3 attempts: <body prefix>`
//! — on a connection failure, a timeout (`timeout_s` covers connecting through the last byte of
//! the response), a non-2xx status, a body over `max_response_bytes`, a body that is not JSON, a
//! missing or ill-typed field, a wrong number of observations/results, or a non-finite reward or
//! metric. The host then penalises every episode of the call and counts them in `env/errors`.
//!
//! Retried, `retries` times with backoff (0.5 s, doubling, at most 8 s; a 429's or 503's
//! `Retry-After` of up to 8 s is honoured): a connection that could not be established, HTTP 5xx,
//! HTTP 429. Not retried: timeouts, other statuses and invalid bodies, because the server may have
//! applied the step already and a repeated `/step` would advance those episodes twice. A server
//! that answers 5xx must therefore not have applied the request.
//!
//! Nothing is checkpointed: the episodes' state is the server's, and a batch never outlives a step
//! of training.
//!
//! # Config
//!
//! ```toml
//! [environment]
//! plugin = "env-http"
//! [environment.config]
//! url = "http://127.0.0.1:8000"     # required; http or https; POSTs go to {url}/reset and {url}/step
//! connect_timeout_s = 5.0           # establishing the connection
//! timeout_s = 60.0                  # per attempt, connect to last byte of the response
//! retries = 2                       # at most retries + 1 attempts (connection failure, 5xx, 429)
//! auth_header = "Authorization"     # header carrying the value of auth_env
//! # auth_env = "ENV_API_KEY"        # env var whose value is sent verbatim, e.g. "Bearer sk-..."
//! stop = []                         # stop strings that end a turn besides EOS, e.g. ["</calc>"]
//! max_response_bytes = 16777216     # 16 MiB
//! ```
//!
//! The secret itself never appears in the config: `auth_env` names a variable of the trainer's
//! environment; an unset or empty variable is a config error naming it.

pub mod client;
pub mod config;
pub mod wire;

use reqwest::Url;
use rlhf_plugin_api::prelude::*;

use crate::client::Client;
use crate::config::Settings;
use crate::wire::Invalid;

/// The environment: a client of the episode server; see the crate docs for the protocol.
#[derive(Debug)]
pub struct HttpEnv {
    client: Client,
    /// Single-threaded: one request at a time, I/O-bound.
    runtime: tokio::runtime::Runtime,
    reset_url: Url,
    step_url: Url,
}

impl HttpEnv {
    /// An environment with already validated settings.
    pub fn from_settings(settings: Settings) -> Result<Self, PluginError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PluginError::external(format!("cannot start the tokio runtime: {e}")))?;
        let (reset_url, step_url) = (settings.endpoint("reset"), settings.endpoint("step"));
        let client =
            Client::new(settings).map_err(|e| PluginError::external(format!("cannot build the HTTP client: {e}")))?;
        Ok(HttpEnv { client, runtime, reset_url, step_url })
    }

    /// The settings in use.
    pub fn settings(&self) -> &Settings {
        &self.client.settings
    }

    /// POSTs `body` to `url`, blocking, and parses the reply; every failure is one external error.
    fn call<T>(
        &self,
        url: &Url,
        body: &serde_json::Value,
        parse: impl Fn(&[u8]) -> Result<T, Invalid>,
    ) -> Result<T, PluginError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| PluginError::compute(format!("{url}: cannot serialize the request: {e}")))?;
        self.runtime.block_on(self.client.request(url, body, parse)).map_err(|f| PluginError::external(f.to_string()))
    }
}

impl Environment for HttpEnv {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let this = HttpEnv::from_settings(Settings::parse(config)?)?;
        let s = this.settings();
        tracing::info!(
            "env-http: server {}, timeout {} s, {} retries, auth {}",
            s.url,
            s.timeout.as_secs_f64(),
            s.retries,
            s.auth.as_ref().map_or("none".to_string(), |(name, _)| format!("header {name}"))
        );
        Ok(this)
    }

    fn stop_strings(&self) -> Vec<String> {
        self.settings().stop.clone()
    }

    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError> {
        Ok(self.reset_observations(episodes)?.into_iter().map(|o| o.text).collect())
    }

    fn reset_observations(&mut self, episodes: &[Episode]) -> Result<Vec<Observation>, PluginError> {
        if episodes.is_empty() {
            return Ok(Vec::new());
        }
        let n = episodes.len();
        self.call(&self.reset_url, &wire::reset_body(episodes), |body| wire::parse_reset(body, n))
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError> {
        if actions.is_empty() {
            return Ok(Vec::new());
        }
        let n = actions.len();
        let outcomes = self.call(&self.step_url, &wire::step_body(actions), |body| wire::parse_step(body, n))?;
        for (action, outcome) in actions.iter().zip(&outcomes) {
            if let Some(error) = &outcome.error {
                tracing::debug!("env-http: episode {} failed at turn {}: {error}", action.id, action.turn);
            }
        }
        Ok(outcomes)
    }
}

export_environment!(
    HttpEnv,
    name: "env-http",
    description: "multi-turn episodes served by a remote HTTP server (POST /reset, POST /step)",
);
