//! What the trainer does with a causal LM besides training it: batch padding, batched KV-cache
//! generation with per-sequence EOS stop, sampling (temperature / top-k / top-p), log-probs and
//! entropy of given tokens computed in vocabulary chunks, and perplexity.

pub mod batch;
pub mod config;
pub mod decode;
pub mod error;
pub mod generate;
pub mod graphs;
pub mod logprobs;
pub mod noise;
pub mod perplexity;
pub mod sampling;
pub mod session;

pub use batch::{left_pad, right_pad, PaddedBatch};
pub use decode::compactions;
pub use error::{GenerationError, Result};
pub use generate::{
    generate, generate_until, generate_until_with_images, generate_with_images, GenerateConfig, Generated, StopCheck,
};
pub use graphs::{graph_failures, graph_replays};
pub use logprobs::{
    masked_nll_mean, masked_nll_sum, token_logprobs, token_logprobs_checkpointed, token_logprobs_pass,
    token_logprobs_pass_with_images, token_logprobs_with_images, ImageInputs, LogProbOptions, LogProbPass,
    TokenLogProbs,
};
pub use perplexity::{perplexity, perplexity_with_images, Perplexity};
pub use sampling::{RowWindow, Sampling};
pub use session::{Session, Turn};
