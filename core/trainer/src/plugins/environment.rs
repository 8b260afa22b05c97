//! The host's handle on an environment instance: plain [`Episode`] / [`Action`] /
//! [`StepOutcome`] values in and out, ABI values only here, answer counts checked.

use abi_stable::std_types::{RResult, RStr, RVec};
use rlhf_plugin_api::abi::{ActionAbi, EnvBox, EpisodeAbi, HostContext};
use rlhf_plugin_api::{Action, Episode, Observation, ObservationImage, PluginError, StepOutcome};

use super::loader::LoadedEnv;
use crate::error::{Result, TrainerError};

/// An environment instance and where it came from.
pub struct EnvHandle {
    pub name: String,
    pub path: std::path::PathBuf,
    obj: EnvBox,
}

impl EnvHandle {
    /// Builds the environment; `section` names its config section in errors
    /// (`environment.config`).
    pub fn new(p: &LoadedEnv, config_json: &str, ctx: HostContext, section: &str) -> Result<Self> {
        match (p.module.new_environment())(RStr::from_str(config_json), ctx) {
            RResult::ROk(obj) => Ok(EnvHandle { name: p.name.clone(), path: p.path.clone(), obj }),
            RResult::RErr(e) => Err(super::handles::plugin_call_err(&p.name, &p.path, e, section)),
        }
    }

    fn err(&self, message: String) -> TrainerError {
        TrainerError::PluginCall { name: self.name.clone(), path: self.path.clone(), message }
    }

    fn call_err(&self, call: &str, e: PluginError) -> TrainerError {
        self.err(format!("{call}: {e}"))
    }

    /// The plugin's own stop strings.
    pub fn stop_strings(&self) -> Vec<String> {
        self.obj.stop_strings().into_iter().map(Into::into).collect()
    }

    /// One first observation per episode, with its images (the counts are checked).
    pub fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<Observation>> {
        let abi: RVec<EpisodeAbi> = episodes.iter().map(EpisodeAbi::from).collect();
        let out = self.obj.reset(abi).into_result().map_err(|e| self.call_err("reset", e))?;
        if out.len() != episodes.len() {
            return Err(self.err(format!("reset returned {} observations for {} episodes", out.len(), episodes.len())));
        }
        let mut images = self.take_images("reset", out.len())?.into_iter();
        Ok(out
            .into_iter()
            .map(|text| Observation { text: text.into(), images: images.next().unwrap_or_default() })
            .collect())
    }

    /// The images of the last call's `n` observations (none each from a plugin that returns none,
    /// or predates ABI 4.4).
    fn take_images(&mut self, call: &str, n: usize) -> Result<Vec<Vec<ObservationImage>>> {
        let images = self.obj.take_images();
        if images.is_empty() {
            return Ok(vec![Vec::new(); n]);
        }
        if images.len() != n {
            return Err(self.err(format!("{call} returned images for {} observations of {n}", images.len())));
        }
        Ok(images.into_iter().map(|i| i.into_iter().map(ObservationImage::from).collect()).collect())
    }

    /// One outcome per action (the count is checked; a non-finite reward is an error).
    pub fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>> {
        let abi: RVec<ActionAbi> = actions.iter().map(ActionAbi::from).collect();
        let out = self.obj.step(abi).into_result().map_err(|e| self.call_err("step", e))?;
        if out.len() != actions.len() {
            return Err(self.err(format!("step returned {} outcomes for {} actions", out.len(), actions.len())));
        }
        let images = self.take_images("step", out.len())?;
        let out: Vec<StepOutcome> =
            out.into_iter().zip(images).map(|(o, images)| StepOutcome { images, ..StepOutcome::from(o) }).collect();
        if let Some((o, a)) = out.iter().zip(actions).find(|(o, _)| !o.reward.is_finite()) {
            return Err(self.err(format!("step returned a non-finite reward ({}) for episode {}", o.reward, a.id)));
        }
        Ok(out)
    }

    /// The plugin's checkpoint state (JSON).
    pub fn state(&self) -> Result<serde_json::Value> {
        let text = self.obj.state().into_result().map_err(|e| self.call_err("state", e))?;
        serde_json::from_str(text.as_str()).map_err(|e| self.err(format!("state is not JSON: {e}")))
    }

    /// Restores the plugin's checkpoint state.
    pub fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let text = state.to_string();
        self.obj.load_state(RStr::from_str(&text)).into_result().map_err(|e| self.call_err("load_state", e))
    }
}
