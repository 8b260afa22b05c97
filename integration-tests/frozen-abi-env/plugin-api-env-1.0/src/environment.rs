//! The environment side of the ABI as plain Rust: implement [`Environment`] and export it with
//! [`export_environment!`](crate::export_environment).
//!
//! An environment turns one prompt into a multi-turn episode. The host runs the loop (verl's agent
//! loop, verifiers' `MultiTurnEnv`): the policy samples a turn until EOS or a stop string
//! ([`Environment::stop_strings`] plus the configured `environment.stop`), the host calls
//! [`Environment::step`] with the turn's text, appends the tokenized observation and samples again,
//! until the environment says `done`, the policy samples EOS, or `max_turns` / `max_total_tokens`
//! is reached. Only the sampled tokens are trained on; observation tokens are context.

use abi_stable::std_types::{RResult, RStr, RString, RVec};

use crate::abi::{ActionAbi, EnvObj, EpisodeAbi, StepAbi};
use crate::algorithm::{guard, metrics_abi, Context};
use crate::error::PluginError;
use crate::reward::ChatMessage;

/// One episode starting from a prompt row.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    /// The episode's id within the batch; the actions of [`Environment::step`] carry it.
    pub id: u64,
    /// The prompt as the model saw it (chat template applied).
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    /// The dataset's `label`, if present.
    pub label: Option<String>,
    /// The dataset line's other fields.
    pub metadata: serde_json::Value,
    /// The prompt as chat messages before any template.
    pub messages: Vec<ChatMessage>,
}

/// One turn of the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Action {
    pub id: u64,
    /// 0-based turn of the episode.
    pub turn: u32,
    /// The sampled text of the turn, special tokens removed.
    pub text: String,
    /// The sampled ids of the turn, EOS included when sampled.
    pub token_ids: Vec<u32>,
    /// The episode's last turn — the policy sampled EOS, or `max_turns` / `max_total_tokens` is
    /// reached: it ends whatever [`StepOutcome::done`] says (the step still gives the final
    /// reward).
    pub ended: bool,
}

/// The environment's answer to one action.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    /// Appended after the action and tokenized by the host (ignored when `done`).
    pub observation: String,
    /// This turn's reward; the episode's environment reward is the sum over its turns.
    pub reward: f64,
    pub done: bool,
    /// Per-episode counts, summed over turns and averaged over episodes as `env/<name>/mean`.
    pub metrics: Vec<(String, f64)>,
    /// `Some`: this episode failed (it ends, costs `environment.error_penalty`, counts in
    /// `env/errors`); the other episodes of the call go on.
    pub error: Option<String>,
}

impl StepOutcome {
    /// A turn that continues with `observation`.
    pub fn observe(observation: impl Into<String>) -> Self {
        StepOutcome { observation: observation.into(), ..Default::default() }
    }

    /// A turn that ends the episode with `reward`.
    pub fn finish(reward: f64) -> Self {
        StepOutcome { reward, done: true, ..Default::default() }
    }

    /// Adds a per-episode count.
    pub fn metric(mut self, name: &str, value: f64) -> Self {
        self.metrics.push((name.to_string(), value));
        self
    }
}

/// A multi-turn environment.
pub trait Environment: Send + Sized + 'static {
    /// Builds the environment from its config section (`[environment.config]`, JSON text).
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError>;
    /// Strings that end a policy turn besides EOS (e.g. `</calc>`); default none.
    fn stop_strings(&self) -> Vec<String> {
        Vec::new()
    }
    /// Starts a batch of episodes; one first observation per episode (appended to its prompt,
    /// may be empty). An id is the episode's row in the whole batch, so every batch reuses the
    /// ids of the last: a reset ends the earlier batch's episodes.
    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError>;
    /// One outcome per action, in order.
    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError>;
    /// State to checkpoint, as a JSON value (default: none).
    fn state(&self) -> Result<serde_json::Value, PluginError> {
        Ok(serde_json::Value::Null)
    }
    /// Restores [`Environment::state`] on resume.
    fn load_state(&mut self, _state: serde_json::Value) -> Result<(), PluginError> {
        Ok(())
    }
}

impl From<EpisodeAbi> for Episode {
    fn from(e: EpisodeAbi) -> Self {
        Episode {
            id: e.id,
            prompt: e.prompt.into(),
            prompt_ids: e.prompt_ids.into(),
            label: e.label.map(|l| l.into()).into_option(),
            metadata: serde_json::from_str(&e.metadata_json).unwrap_or(serde_json::Value::Null),
            messages: serde_json::from_str(&e.messages_json).unwrap_or_default(),
        }
    }
}

impl From<&Episode> for EpisodeAbi {
    fn from(e: &Episode) -> Self {
        EpisodeAbi {
            id: e.id,
            prompt: e.prompt.as_str().into(),
            prompt_ids: e.prompt_ids.clone().into(),
            label: e.label.as_deref().map(RString::from).into(),
            metadata_json: e.metadata.to_string().into(),
            messages_json: serde_json::to_string(&e.messages).unwrap_or_else(|_| "[]".into()).into(),
        }
    }
}

impl From<ActionAbi> for Action {
    fn from(a: ActionAbi) -> Self {
        Action { id: a.id, turn: a.turn, text: a.text.into(), token_ids: a.token_ids.into(), ended: a.ended }
    }
}

impl From<&Action> for ActionAbi {
    fn from(a: &Action) -> Self {
        ActionAbi {
            id: a.id,
            turn: a.turn,
            text: a.text.as_str().into(),
            token_ids: a.token_ids.clone().into(),
            ended: a.ended,
        }
    }
}

impl From<StepOutcome> for StepAbi {
    fn from(o: StepOutcome) -> Self {
        StepAbi {
            observation: o.observation.into(),
            reward: o.reward,
            done: o.done,
            metrics: metrics_abi(o.metrics),
            error: o.error.unwrap_or_default().into(),
        }
    }
}

impl From<StepAbi> for StepOutcome {
    fn from(s: StepAbi) -> Self {
        StepOutcome {
            observation: s.observation.into(),
            reward: s.reward,
            done: s.done,
            metrics: s.metrics.into_iter().map(|m| (m.name.into(), m.value)).collect(),
            error: (!s.error.is_empty()).then(|| s.error.into()),
        }
    }
}

/// Adapts an [`Environment`] to the ABI object.
#[doc(hidden)]
pub struct EnvAdapter<E: Environment>(pub E);

impl<E: Environment> EnvObj for EnvAdapter<E> {
    fn reset(&mut self, episodes: RVec<EpisodeAbi>) -> RResult<RVec<RString>, PluginError> {
        guard(|| {
            let episodes: Vec<Episode> = episodes.into_iter().map(Episode::from).collect();
            Ok(self.0.reset(&episodes)?.into_iter().map(RString::from).collect())
        })
    }

    fn step(&mut self, actions: RVec<ActionAbi>) -> RResult<RVec<StepAbi>, PluginError> {
        guard(|| {
            let actions: Vec<Action> = actions.into_iter().map(Action::from).collect();
            Ok(self.0.step(&actions)?.into_iter().map(StepAbi::from).collect())
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

    fn stop_strings(&self) -> RVec<RString> {
        match guard(|| Ok(self.0.stop_strings())) {
            RResult::ROk(v) => v.into_iter().map(RString::from).collect(),
            RResult::RErr(e) => {
                // Through the log bridge: the host shows it under the plugin's name.
                tracing::warn!("stop_strings failed, so this environment has no stop strings of its own: {e}");
                RVec::new()
            }
        }
    }
}
