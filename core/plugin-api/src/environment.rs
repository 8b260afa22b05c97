//! The environment side of the ABI as plain Rust: implement [`Environment`] and export it with
//! [`export_environment!`](crate::export_environment).
//!
//! An environment turns one prompt into a multi-turn episode. The host runs the loop (verl's agent
//! loop, verifiers' `MultiTurnEnv`): the policy samples a turn until EOS or a stop string
//! ([`Environment::stop_strings`] plus the configured `environment.stop`), the host calls
//! [`Environment::step`] with the turn's text, appends the tokenized observation and samples again,
//! until the environment says `done`, the policy samples EOS, or `max_turns` / `max_total_tokens`
//! is reached. Only the sampled tokens are trained on; observation tokens are context.
//!
//! An observation may carry images (a tool's screenshot): [`StepOutcome::images`] and
//! [`Environment::reset_observations`], one `<image>` marker in the text per image, in order. A
//! policy that reads images (see the host's `docs/vision.md`) sees them where the markers are;
//! the host decodes, resizes and patches them as it does a prompt's.

use abi_stable::std_types::{RResult, RStr, RString, RVec};

use crate::abi::{ActionAbi, EnvObj, EpisodeAbi, ImageAbi, StepAbi};
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

/// An image in an observation.
#[derive(Debug, Clone, PartialEq)]
pub enum ObservationImage {
    /// An encoded image (PNG, JPEG, WebP, …).
    Bytes(Vec<u8>),
    /// An image file the host can read.
    Path(std::path::PathBuf),
}

impl From<ObservationImage> for ImageAbi {
    fn from(i: ObservationImage) -> Self {
        match i {
            ObservationImage::Bytes(b) => ImageAbi { bytes: b.into(), path: RString::new() },
            ObservationImage::Path(p) => ImageAbi { bytes: RVec::new(), path: p.display().to_string().into() },
        }
    }
}

impl From<ImageAbi> for ObservationImage {
    fn from(i: ImageAbi) -> Self {
        match i.bytes.is_empty() {
            true => ObservationImage::Path(i.path.as_str().into()),
            false => ObservationImage::Bytes(i.bytes.into()),
        }
    }
}

/// A first observation ([`Environment::reset_observations`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observation {
    pub text: String,
    /// One per `<image>` marker of `text`, in order.
    pub images: Vec<ObservationImage>,
}

impl From<String> for Observation {
    fn from(text: String) -> Self {
        Observation { text, images: Vec::new() }
    }
}

/// The environment's answer to one action.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    /// Appended after the action and tokenized by the host (ignored when `done`).
    pub observation: String,
    /// The observation's images, one per `<image>` marker of `observation`, in order (since the
    /// environment interface 1.1; read for a policy that reads images, an error for one that
    /// reads none).
    pub images: Vec<ObservationImage>,
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

    /// Adds an image to the observation (its `<image>` marker is in the text).
    pub fn image(mut self, image: ObservationImage) -> Self {
        self.images.push(image);
        self
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
    /// [`Environment::reset`] for first observations with images (default: `reset`'s texts).
    fn reset_observations(&mut self, episodes: &[Episode]) -> Result<Vec<Observation>, PluginError> {
        Ok(self.reset(episodes)?.into_iter().map(Observation::from).collect())
    }
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
            images: Vec::new(),
        }
    }
}

/// Adapts an [`Environment`] to the ABI object; keeps the images of the last call's observations
/// for [`EnvObj::take_images`].
#[doc(hidden)]
pub struct EnvAdapter<E: Environment>(pub E, pub Vec<Vec<ImageAbi>>);

/// The observations' images as the ABI returns them: empty when none has any.
fn images_abi(images: Vec<Vec<ObservationImage>>) -> Vec<Vec<ImageAbi>> {
    if images.iter().all(Vec::is_empty) {
        return Vec::new();
    }
    images.into_iter().map(|i| i.into_iter().map(ImageAbi::from).collect()).collect()
}

impl<E: Environment> EnvObj for EnvAdapter<E> {
    fn reset(&mut self, episodes: RVec<EpisodeAbi>) -> RResult<RVec<RString>, PluginError> {
        self.1.clear();
        guard(|| {
            let episodes: Vec<Episode> = episodes.into_iter().map(Episode::from).collect();
            let observations = self.0.reset_observations(&episodes)?;
            let (texts, images): (Vec<String>, Vec<_>) = observations.into_iter().map(|o| (o.text, o.images)).unzip();
            self.1 = images_abi(images);
            Ok(texts.into_iter().map(RString::from).collect())
        })
    }

    fn step(&mut self, actions: RVec<ActionAbi>) -> RResult<RVec<StepAbi>, PluginError> {
        self.1.clear();
        guard(|| {
            let actions: Vec<Action> = actions.into_iter().map(Action::from).collect();
            let mut outcomes = self.0.step(&actions)?;
            self.1 = images_abi(outcomes.iter_mut().map(|o| std::mem::take(&mut o.images)).collect());
            Ok(outcomes.into_iter().map(StepAbi::from).collect())
        })
    }

    fn take_images(&mut self) -> RVec<RVec<ImageAbi>> {
        std::mem::take(&mut self.1).into_iter().map(RVec::from).collect()
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
