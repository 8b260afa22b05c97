//! A Weights & Biases metrics sink speaking wandb's own HTTP protocol (no Python, no wandb
//! binary): the run is created with the GraphQL `upsertBucket` mutation, history lines, the summary
//! and the exit code go over the `file_stream` API, from a background thread, with HTTP basic auth
//! (user `api`, password the API key). See [`protocol`] for the wire format.
//!
//! Training never waits on the network and never fails because of it: [`WandbSink::log`] is a
//! non-blocking enqueue, failures are retried with backoff and then counted ([`WandbStats`]) with at
//! most one warning per kind, and [`WandbSink::finish`] waits a bounded time.
//!
//! ```no_run
//! use rlhf_wandb::{WandbConfig, WandbSettings, WandbSink};
//! use serde_json::{json, Map};
//!
//! // `None` when no API key is set (WANDB_API_KEY or ~/.netrc): run without the sink.
//! let sink = WandbSettings::from_env(&WandbConfig::default())
//!     .expect("valid [wandb] settings")
//!     .map(|settings| WandbSink::start(settings, json!({"lr": 1e-6, "algo": "grpo"})));
//! for step in 0..10u64 {
//!     let mut metrics = Map::new();
//!     metrics.insert("loss".into(), json!(1.0 / (step + 1) as f64));
//!     if let Some(sink) = &sink {
//!         sink.log(step, metrics);
//!     }
//! }
//! if let Some(sink) = sink {
//!     let stats = sink.finish(Map::new(), 0);
//!     println!("{} lines sent, {} dropped", stats.lines_sent, stats.lines_dropped);
//! }
//! ```

mod error;
pub mod protocol;
mod settings;
mod sink;
mod transport;

pub use error::WandbError;
pub use protocol::RunInfo;
pub use settings::{generate_run_id, WandbConfig, WandbSettings, DEFAULT_BASE_URL, DEFAULT_PROJECT};
pub use sink::{WandbSink, WandbStats};
