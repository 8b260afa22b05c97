//! The reward side of the ABI as plain Rust: implement [`RewardSource`] and export it with
//! [`export_reward!`](crate::export_reward).

use abi_stable::std_types::{RResult, RStr, RString, RVec};

use crate::abi::{RewardObj, SampleAbi, ScoresAbi};
use crate::algorithm::{guard, metrics_abi, Context};
use crate::error::PluginError;

/// One (prompt, response) to score. Every non-empty response is scored: one that is only EOS
/// arrives with an empty `response` and `response_ids` holding the EOS token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The prompt as the model saw it (chat template applied).
    pub prompt: String,
    /// The generated text, special tokens (EOS) removed.
    pub response: String,
    pub prompt_ids: Vec<u32>,
    /// The generated token ids, the EOS token included when one was generated.
    pub response_ids: Vec<u32>,
    /// The dataset's `label`, if present.
    pub label: Option<String>,
    /// The dataset line's other fields.
    pub metadata: serde_json::Value,
    /// The prompt as chat messages before any template (a plain prompt is one user message).
    pub messages: Vec<ChatMessage>,
}

/// One chat message of a prompt.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl From<SampleAbi> for Sample {
    fn from(s: SampleAbi) -> Self {
        Sample {
            prompt: s.prompt.into(),
            response: s.response.into(),
            prompt_ids: s.prompt_ids.into(),
            response_ids: s.response_ids.into(),
            label: s.label.map(|l| l.into()).into_option(),
            metadata: serde_json::from_str(&s.metadata_json).unwrap_or(serde_json::Value::Null),
            messages: serde_json::from_str(&s.messages_json).unwrap_or_default(),
        }
    }
}

/// Scores and metrics for a batch; `scores.len()` must equal the number of samples.
#[derive(Debug, Clone, Default)]
pub struct Scores {
    pub scores: Vec<f64>,
    pub metrics: Vec<(String, f64)>,
}

/// A reward source.
pub trait RewardSource: Send + Sized + 'static {
    /// Builds the source from its config section (JSON text).
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError>;
    /// One score per sample.
    fn score(&mut self, samples: &[Sample]) -> Result<Scores, PluginError>;
    /// State to checkpoint, as a JSON value (default: none), e.g. running normalisation statistics.
    fn state(&self) -> Result<serde_json::Value, PluginError> {
        Ok(serde_json::Value::Null)
    }
    /// Restores [`RewardSource::state`] (called on resume, after [`RewardSource::new`]).
    fn load_state(&mut self, _state: serde_json::Value) -> Result<(), PluginError> {
        Ok(())
    }
}

/// Adapts a [`RewardSource`] to the ABI object.
#[doc(hidden)]
pub struct RewardAdapter<R: RewardSource>(pub R);

impl<R: RewardSource> RewardObj for RewardAdapter<R> {
    fn score(&mut self, samples: RVec<SampleAbi>) -> RResult<ScoresAbi, PluginError> {
        guard(|| {
            let samples: Vec<Sample> = samples.into_iter().map(Sample::from).collect();
            let out = self.0.score(&samples)?;
            Ok(ScoresAbi { scores: out.scores.into(), metrics: metrics_abi(out.metrics) })
        })
    }

    fn state(&self) -> RResult<RString, PluginError> {
        guard(|| Ok(self.0.state()?.to_string().into()))
    }

    fn load_state(&mut self, state: RStr<'_>) -> RResult<(), PluginError> {
        guard(|| {
            let v = serde_json::from_str(state.as_str())
                .map_err(|e| PluginError::config("state", format!("not JSON: {e}")))?;
            self.0.load_state(v)
        })
    }
}
