//! `frozen-env`: an environment plugin compiled against the **frozen plugin-api of the environment
//! interface 1.0** (`../plugin-api-env-1.0`), standing for every environment built before the
//! interface grew. It never sees what later minors appended (`take_images`), and
//! `integration-tests/tests/abi_growth.rs` checks that the current host still loads it and runs its
//! episodes, falling back to the defaults of the methods it lacks.
//!
//! Every episode starts with the first observation `first`; each action is answered with
//! `observation` until `turns` actions were taken, and the last one earns 1 per action that
//! contained `target` (0 without a target). Every action counts 1 in the `calls` metric; the stop
//! string `stop` (if any) ends a turn.
//!
//! ```toml
//! [environment]
//! plugin = "frozen-env"
//! config = { turns = 2, first = " go:", observation = " again:", target = "", stop = "" }
//! ```

use std::collections::HashMap;

use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    turns: u32,
    first: String,
    observation: String,
    target: String,
    stop: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            turns: 2,
            first: " go:".into(),
            observation: " again:".into(),
            target: String::new(),
            stop: String::new(),
        }
    }
}

struct FrozenEnv {
    cfg: Config,
    /// Per episode: actions that contained the target so far.
    hits: HashMap<u64, u32>,
}

impl Environment for FrozenEnv {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let cfg: Config = parse_config(config)?;
        if cfg.turns == 0 {
            return Err(PluginError::config("turns", "must be >= 1"));
        }
        Ok(FrozenEnv { cfg, hits: HashMap::new() })
    }

    fn stop_strings(&self) -> Vec<String> {
        [self.cfg.stop.clone()].into_iter().filter(|s| !s.is_empty()).collect()
    }

    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError> {
        self.hits = episodes.iter().map(|e| (e.id, 0)).collect();
        Ok(episodes.iter().map(|_| self.cfg.first.clone()).collect())
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError> {
        Ok(actions
            .iter()
            .map(|a| {
                let hit = !self.cfg.target.is_empty() && a.text.contains(&self.cfg.target);
                let hits = self.hits.entry(a.id).or_insert(0);
                *hits += u32::from(hit);
                let o = if a.turn + 1 >= self.cfg.turns {
                    StepOutcome::finish(f64::from(*hits))
                } else {
                    StepOutcome::observe(self.cfg.observation.clone())
                };
                o.metric("calls", 1.0)
            })
            .collect())
    }
}

rlhf_plugin_api::export_environment!(
    FrozenEnv,
    name: "frozen-env",
    description: "test fixture: an environment built against the frozen environment interface 1.0"
);
