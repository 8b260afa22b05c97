//! `env-script`: a scripted environment for the host's multi-turn tests.
//!
//! Every episode answers each action with `observation` until `turns` actions were taken, then
//! ends with reward `final_reward` (+1 when the last action's text contains the label). Each turn
//! also earns `turn_reward` and counts 1 in the `tool_calls` metric. With `log` set, every action's
//! `(id, turn, token_ids, ended)` is appended to that file as a JSON line (token-in-token-out tests).
//! Faults from the `fail_from`-th step call on (0-based, counted over the run): `error` (the call
//! fails), `panic`, `garbage` (one outcome too few), `episode` (a per-episode error on even ids),
//! `nan` (a NaN reward). `metrics` names more metrics (value 7) each action reports, and
//! `fresh_metrics` that many metrics of names never reported before (`fresh-<call>-<i>`). With
//! `image` (a file) every observation carries that file's bytes once per `<image>` marker of its
//! text; with `image_path` it names `image` by its path instead.

use std::io::Write;

use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    turns: u32,
    first_observation: String,
    observation: String,
    turn_reward: f64,
    final_reward: f64,
    fail: String,
    fail_from: u64,
    log: Option<String>,
    metrics: Vec<String>,
    fresh_metrics: u32,
    image: Option<String>,
    image_path: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            turns: 2,
            first_observation: String::new(),
            observation: "the answer is".into(),
            turn_reward: 0.0,
            final_reward: 0.0,
            fail: "none".into(),
            fail_from: 0,
            log: None,
            metrics: Vec::new(),
            fresh_metrics: 0,
            image: None,
            image_path: false,
        }
    }
}

struct Script {
    cfg: Config,
    /// `image`'s bytes.
    image: Vec<u8>,
    labels: std::collections::HashMap<u64, Option<String>>,
    calls: u64,
}

impl Environment for Script {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let cfg: Config = parse_config(config)?;
        if !["none", "error", "panic", "garbage", "episode", "nan"].contains(&cfg.fail.as_str()) {
            return Err(PluginError::config("fail", format!("unknown fault `{}`", cfg.fail)));
        }
        let image = match &cfg.image {
            Some(p) => std::fs::read(p).map_err(|e| PluginError::config("image", format!("{p}: {e}")))?,
            None => Vec::new(),
        };
        Ok(Script { cfg, image, labels: Default::default(), calls: 0 })
    }

    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError> {
        self.labels = episodes.iter().map(|e| (e.id, e.label.clone())).collect();
        Ok(episodes.iter().map(|_| self.cfg.first_observation.clone()).collect())
    }

    fn reset_observations(&mut self, episodes: &[Episode]) -> Result<Vec<Observation>, PluginError> {
        let texts = self.reset(episodes)?;
        Ok(texts.into_iter().map(|text| Observation { images: self.images(&text), text }).collect())
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError> {
        let call = self.calls;
        self.calls += 1;
        if let Some(path) = &self.cfg.log {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| PluginError::external(e.to_string()))?;
            for a in actions {
                let line = serde_json::json!({"id": a.id, "turn": a.turn, "ids": a.token_ids, "ended": a.ended});
                writeln!(f, "{line}").map_err(|e| PluginError::external(e.to_string()))?;
            }
        }
        let failing = call >= self.cfg.fail_from;
        match self.cfg.fail.as_str() {
            "error" if failing => return Err(PluginError::external("scripted failure")),
            "panic" if failing => panic!("scripted panic"),
            _ => {}
        }
        let mut out: Vec<StepOutcome> = actions
            .iter()
            .map(|a| {
                let mut o = if a.turn + 1 >= self.cfg.turns {
                    let label = self.labels.get(&a.id).cloned().flatten().unwrap_or_default();
                    let hit = !label.is_empty() && a.text.contains(&label);
                    StepOutcome::finish(self.cfg.final_reward + f64::from(u8::from(hit)))
                } else {
                    let o = StepOutcome::observe(self.cfg.observation.clone());
                    StepOutcome { images: self.images(&o.observation), ..o }
                };
                o.reward += self.cfg.turn_reward;
                if failing && self.cfg.fail == "episode" && a.id % 2 == 0 {
                    o.error = Some(format!("scripted failure of episode {}", a.id));
                }
                if failing && self.cfg.fail == "nan" {
                    o.reward = f64::NAN;
                }
                let mut o = o.metric("tool_calls", 1.0);
                for name in &self.cfg.metrics {
                    o = o.metric(name, 7.0);
                }
                for i in 0..self.cfg.fresh_metrics {
                    o = o.metric(&format!("fresh-{call}-{i}"), 1.0);
                }
                o
            })
            .collect();
        if failing && self.cfg.fail == "garbage" {
            out.pop();
        }
        Ok(out)
    }
}

impl Script {
    /// `image` once per `<image>` marker of `text`.
    fn images(&self, text: &str) -> Vec<ObservationImage> {
        let Some(path) = &self.cfg.image else { return Vec::new() };
        let one = match self.cfg.image_path {
            true => ObservationImage::Path(path.into()),
            false => ObservationImage::Bytes(self.image.clone()),
        };
        vec![one; text.matches("<image>").count()]
    }
}

rlhf_plugin_api::export_environment!(Script, name: "env-script", description: "test fixture: a scripted environment");
