//! `env-template-guess`: "guess the number" — the template for writing a new **environment**
//! plugin in one file against `rlhf-plugin-api` alone, as `plugins/template` is for algorithms.
//! Copy `plugins/env-template/`, rename the package in `Cargo.toml` and the plugin in
//! [`export_environment!`] at the bottom, then change the methods of [`Environment`]: `new`,
//! `reset` and `step` always; `stop_strings`, `state` and `load_state` when yours needs them.
//! `docs/environments.md` explains the episode loop this file plugs into.
//!
//! # The game
//!
//! Each episode has a secret integer in `[low, high]`: the episode's `label` (`secret = "label"`,
//! the default; the dataset decides), or a number drawn from the run's seed, the batch and the
//! prompt text (`secret = "seeded"`: the samples of one prompt share their secret, as GRPO's
//! comparison within a group needs, and every batch plays a new game). Each policy turn is one
//! guess, the **last** integer of the turn's text (`-?digits`; a `-` counts when it does not follow
//! a letter or digit; a number too large for `i64` counts as `i64::MAX` / `i64::MIN`):
//!
//! ```text
//! guess == secret  → the episode ends with reward correct_reward      metrics guesses 1, correct 1
//! guess <  secret  → observation `higher`, reward wrong_reward        metrics guesses 1
//! guess >  secret  → observation `lower`,  reward wrong_reward        metrics guesses 1
//! no integer       → observation `no_number`, reward wrong_reward     metrics invalid 1
//! ```
//!
//! The episode's environment reward is the sum of its turns' rewards: `correct_reward` plus
//! `wrong_reward` per wrong or missing guess (set `wrong_reward < 0` to pay for every guess). A
//! turn that the host sends with `ended = true` (the policy sampled EOS, or `environment.max_turns`
//! / `max_total_tokens` was reached) ends the episode whatever the answer; a wrong last guess just
//! earns `wrong_reward` (and `done` stays false, so the host counts a cut in `env/truncated`). An episode whose secret cannot be known (no label, a label that is not an
//! integer in `[low, high]`) fails on its first step with a per-episode `error`.
//!
//! Metrics (per episode, summed over its turns; the host logs their mean over the batch's
//! episodes as `env/<name>/mean`, an episode that never reports one counting 0): `guesses`,
//! `correct`, `invalid`.
//!
//! # Config
//!
//! Every key is optional; these are the defaults.
//!
//! ```toml
//! [environment]
//! plugin = "env-template-guess"
//!
//! [environment.config]
//! secret = "label"          # "label" (an integer in [low, high]) or "seeded" (run.seed, batch, prompt)
//! low = 1                   # the secret's range, inclusive (low <= high)
//! high = 100
//! instructions = ""         # first observation of every episode, appended to its prompt
//! higher = "higher"         # the observations; appended verbatim after the turn's tokens, so
//! lower = "lower"           # add the spaces, newlines or chat-template tags your model expects
//! no_number = "say a number"
//! stop = []                 # strings that end a turn besides EOS (each non-empty), e.g. ["\n"]
//! correct_reward = 1.0
//! wrong_reward = 0.0        # per wrong or missing guess
//! ```

// The prelude brings the trait (`Environment`), its data (`Episode`, `Action`, `StepOutcome`),
// `Context`, `PluginError`, `parse_config` and the export macros. Nothing else from the host is
// needed: the host owns the model, the tokenizer and the loop; the plugin sees text and token ids.
use std::cmp::Ordering;
use std::collections::HashMap;

use rlhf_plugin_api::prelude::*;
use serde::Deserialize;

/// Where an episode's secret comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Secret {
    /// The episode's `label` (the dataset line's `label` field), an integer in `[low, high]`.
    Label,
    /// Drawn from `run.seed`, the batch number and the prompt text.
    Seeded,
}

/// The plugin's config section: the `[environment.config]` table of the run config, handed over
/// as JSON.
///
/// `deny_unknown_fields` turns a typo into an error naming the key (`hihg: unknown field`), which
/// the host prefixes with the section (`environment.config.hihg: ...`); `default` makes every key
/// optional, taking its value from [`Default`] below. An enum field refuses other values with an
/// error naming the key (`secret: unknown variant "random", expected "label" or "seeded"`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where each episode's secret comes from.
    pub secret: Secret,
    /// Smallest secret.
    pub low: i64,
    /// Largest secret (>= `low`).
    pub high: i64,
    /// First observation of every episode, appended to its prompt (may be empty).
    pub instructions: String,
    /// The answer to a guess below the secret.
    pub higher: String,
    /// The answer to a guess above the secret.
    pub lower: String,
    /// The answer to a turn without an integer.
    pub no_number: String,
    /// Strings that end a policy turn besides EOS, added to `environment.stop`.
    pub stop: Vec<String>,
    /// Reward of the turn that finds the secret (finite).
    pub correct_reward: f64,
    /// Reward of every other turn (finite).
    pub wrong_reward: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            secret: Secret::Label,
            low: 1,
            high: 100,
            instructions: String::new(),
            higher: "higher".into(),
            lower: "lower".into(),
            no_number: "say a number".into(),
            stop: Vec::new(),
            correct_reward: 1.0,
            wrong_reward: 0.0,
        }
    }
}

impl Config {
    /// Parses and validates the section (JSON text); every error names its key.
    pub fn parse(json: &str) -> Result<Config, PluginError> {
        // Syntax and types: `parse_config` reports `key.path: message` errors.
        let config: Config = parse_config(json)?;
        // Semantics: check values yourself and name the key the same way.
        if config.low > config.high {
            return Err(PluginError::config("high", format!("must be >= low ({}), got {}", config.low, config.high)));
        }
        if let Some(i) = config.stop.iter().position(String::is_empty) {
            return Err(PluginError::config(format!("stop[{i}]"), "must not be empty"));
        }
        for (key, reward) in [("correct_reward", config.correct_reward), ("wrong_reward", config.wrong_reward)] {
            // The host refuses non-finite rewards too, but as a failure of the whole step call.
            if !reward.is_finite() {
                return Err(PluginError::config(key, format!("must be a finite number, got {reward}")));
            }
        }
        Ok(config)
    }
}

/// The environment: its config, and the secrets of the current batch's episodes.
///
/// The host owns one instance per rank and calls it from one thread, in order: `new`, then per
/// training step one `reset` with the batch's episodes followed by up to `environment.max_turns`
/// `step` calls, each with one action per episode still running. `load_state` comes right after
/// `new` on `rlhf train --resume`; `state` whenever a checkpoint is written.
#[derive(Debug)]
pub struct GuessTheNumber {
    config: Config,
    /// `run.seed`, for `secret = "seeded"`.
    seed: u64,
    /// Batches started so far: part of the seeded secrets, so it is checkpointed (`state`).
    batches: u64,
    /// Per episode id of the current batch: its secret, or why it has none.
    secrets: HashMap<u64, Result<i64, String>>,
}

impl GuessTheNumber {
    /// The secret of `episode` in batch `self.batches`, or the reason it has none.
    fn secret_of(&self, episode: &Episode) -> Result<i64, String> {
        let (low, high) = (self.config.low, self.config.high);
        match self.config.secret {
            Secret::Label => {
                let label = episode.label.as_deref().ok_or_else(|| format!("episode {} has no label", episode.id))?;
                let n: i64 = label
                    .trim()
                    .parse()
                    .map_err(|_| format!("episode {}: label {label:?} is not an integer", episode.id))?;
                if !(low..=high).contains(&n) {
                    return Err(format!("episode {}: label {n} is outside [{low}, {high}]", episode.id));
                }
                Ok(n)
            }
            Secret::Seeded => {
                let x = mix(self.seed ^ mix(self.batches ^ mix(fnv1a(&episode.prompt))));
                // `high - low + 1` values; i128 so that the full i64 range does not overflow.
                let span = (i128::from(high) - i128::from(low) + 1) as u128;
                Ok((i128::from(low) + (u128::from(x) % span) as i128) as i64)
            }
        }
    }

    /// The outcome of one action.
    fn step_one(&self, action: &Action) -> StepOutcome {
        let secret = match self.secrets.get(&action.id) {
            Some(Ok(secret)) => *secret,
            Some(Err(why)) => return failed(why.clone()),
            None => return failed(format!("episode {} was not started by reset", action.id)),
        };
        // `action.text` is the turn's decoded text, special tokens (EOS) removed; `token_ids` has
        // the exact sampled ids if you would rather read those.
        let mut outcome = match last_integer(&action.text) {
            None => StepOutcome::observe(&self.config.no_number).metric("invalid", 1.0),
            Some(guess) => match guess.cmp(&secret) {
                Ordering::Equal => {
                    return StepOutcome::finish(self.config.correct_reward)
                        .metric("guesses", 1.0)
                        .metric("correct", 1.0)
                }
                Ordering::Less => StepOutcome::observe(&self.config.higher).metric("guesses", 1.0),
                Ordering::Greater => StepOutcome::observe(&self.config.lower).metric("guesses", 1.0),
            },
        };
        outcome.reward = self.config.wrong_reward;
        // `done` stays false: the game goes on. When `action.ended` is set the episode is over
        // anyway (the host ignores the observation); answering `done = true` then would tell the
        // host that the game ended it, and a turn-limit cut would not count in `env/truncated`.
        outcome
    }
}

/// An outcome that fails one episode: it ends, its environment reward becomes
/// `environment.error_penalty`, and it counts in `env/errors`. The batch's other episodes go on.
/// (Returning `Err` from `step` instead fails every episode of the call.)
fn failed(message: String) -> StepOutcome {
    StepOutcome { done: true, error: Some(message), ..Default::default() }
}

/// The last integer of `text`: digits, negative when preceded by a `-` that does not follow a
/// letter or digit (`x = -3` → -3, `5-3` → 3); saturated to `i64::MIN..=i64::MAX`.
pub fn last_integer(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let mut last = None;
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let negative = i > 0 && b[i - 1] == b'-' && (i < 2 || !b[i - 2].is_ascii_alphanumeric());
        let start = if negative { i - 1 } else { i };
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        // Only too many digits can fail to parse here.
        last = Some(text[start..i].parse::<i64>().unwrap_or(if negative { i64::MIN } else { i64::MAX }));
    }
    last
}

/// FNV-1a of `text`: a hash that is the same on every build and platform. (`std`'s
/// `DefaultHasher` may change between Rust releases, which would change the secrets of a resumed
/// run built with another compiler.)
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

/// SplitMix64's finaliser: a well-mixed 64-bit function of `x`.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Environment for GuessTheNumber {
    /// Called once when the run starts (on every data-parallel rank), with the
    /// `[environment.config]` section as JSON text. A config error stops the run before it starts,
    /// reported as `environment.config.<key>: <message>`.
    fn new(config: &str, ctx: &Context) -> Result<Self, PluginError> {
        let config = Config::parse(config)?;
        // `tracing` events reach the host's log with the plugin's name as target
        // (`RUST_LOG=info,env-template-guess=debug` filters them).
        tracing::info!(secret = ?config.secret, low = config.low, high = config.high, "env-template-guess ready");
        Ok(GuessTheNumber { config, seed: ctx.seed, batches: 0, secrets: HashMap::new() })
    }

    /// Asked once, right after `new`: the host ends a policy turn as soon as its decoded text
    /// contains one of these (or `environment.stop`), the token that completed it included.
    fn stop_strings(&self) -> Vec<String> {
        self.config.stop.clone()
    }

    /// Starts a batch: one first observation per episode, in order. The ids are the episodes'
    /// rows in the whole batch and repeat from batch to batch, so forget the previous batch here.
    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError> {
        // A problem with one episode is not a reason to fail the call (which would fail every
        // episode): remember it, and report it from that episode's first `step`.
        self.secrets = episodes.iter().map(|e| (e.id, self.secret_of(e))).collect();
        self.batches += 1;
        tracing::debug!(batch = self.batches, episodes = episodes.len(), "new games");
        Ok(vec![self.config.instructions.clone(); episodes.len()])
    }

    /// One outcome per action, in the actions' order (the host checks the count). Actions come
    /// only for episodes still running, so their ids are a subset of `reset`'s.
    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError> {
        Ok(actions.iter().map(|a| self.step_one(a)).collect())
    }

    /// What must survive a checkpoint, as JSON: the batch counter (the seeded secrets depend on
    /// it, so a resumed run plays the games an uninterrupted one would have played). Environments
    /// with no state across batches leave out `state` and `load_state` (the defaults keep none).
    fn state(&self) -> Result<serde_json::Value, PluginError> {
        Ok(serde_json::json!({ "batches": self.batches }))
    }

    /// Restores [`Environment::state`] on `rlhf train --resume`, right after `new`.
    fn load_state(&mut self, state: serde_json::Value) -> Result<(), PluginError> {
        self.batches = state
            .get("batches")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| PluginError::config("state.batches", "missing from the checkpoint"))?;
        Ok(())
    }
}

// The plugin's header: the name users address it by (`[environment] plugin = "env-template-guess"`)
// and a one-line description for `rlhf plugins`. One export macro per cdylib; an environment's
// exports its own root module, so the loader tells the kinds apart before calling anything.
export_environment!(
    GuessTheNumber,
    name: "env-template-guess",
    description: "guess the number: `higher` / `lower` until the guess is the secret (the template for environments)",
);

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(seed: u64) -> Context {
        Context { seed, ..Context::default() }
    }

    fn episode(id: u64, prompt: &str, label: Option<&str>) -> Episode {
        Episode {
            id,
            prompt: prompt.into(),
            prompt_ids: vec![1, 2],
            label: label.map(String::from),
            metadata: serde_json::Value::Null,
            messages: vec![],
        }
    }

    fn action(id: u64, turn: u32, text: &str, ended: bool) -> Action {
        Action { id, turn, text: text.into(), token_ids: vec![7], ended }
    }

    fn metric(o: &StepOutcome, name: &str) -> Option<f64> {
        o.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    /// An environment with `config`, after a reset with one episode per label (ids 0, 1, ...).
    fn env(config: &str, labels: &[Option<&str>]) -> GuessTheNumber {
        let mut env = GuessTheNumber::new(config, &ctx(0)).unwrap();
        let episodes: Vec<Episode> = labels.iter().enumerate().map(|(i, l)| episode(i as u64, "guess", *l)).collect();
        assert_eq!(env.reset(&episodes).unwrap(), vec![String::new(); labels.len()]);
        env
    }

    #[test]
    fn higher_lower_then_found() {
        let mut env = env(r#"{"wrong_reward": -0.1, "stop": ["\n"]}"#, &[Some("42"), Some(" 7 ")]);
        assert_eq!(env.stop_strings(), vec!["\n".to_string()]);
        // Both episodes guess at once; the last integer of a turn is the guess.
        let out = env.step(&[action(0, 0, "maybe 10, no: 50", false), action(1, 0, "I say 3", false)]).unwrap();
        assert_eq!((out[0].observation.as_str(), out[1].observation.as_str()), ("lower", "higher"));
        assert!(out.iter().all(|o| !o.done && o.error.is_none() && o.reward == -0.1));
        assert_eq!(metric(&out[0], "guesses"), Some(1.0));
        // Episode 1 finds its secret; episode 0 says no number.
        let out = env.step(&[action(0, 1, "hmm", false), action(1, 1, "7", false)]).unwrap();
        assert_eq!(out[0].observation, "say a number");
        assert_eq!((metric(&out[0], "invalid"), metric(&out[0], "guesses")), (Some(1.0), None));
        assert!(!out[0].done);
        assert!(out[1].done && out[1].error.is_none());
        assert_eq!(out[1].reward, 1.0);
        assert_eq!((metric(&out[1], "guesses"), metric(&out[1], "correct")), (Some(1.0), Some(1.0)));
        // The host says episode 0's turn is its last: it ends with a wrong guess.
        let o = env.step(&[action(0, 2, "41", true)]).unwrap().remove(0);
        assert!(!o.done && o.error.is_none());
        assert_eq!((o.reward, metric(&o, "correct")), (-0.1, None));
    }

    #[test]
    fn reset_starts_new_games_with_instructions() {
        let mut env = env(r#"{"instructions": "Guess from 1 to 100.\n"}"#, &[]);
        let first = env.reset(&[episode(0, "a", Some("5")), episode(1, "b", Some("6"))]).unwrap();
        assert_eq!(first, vec!["Guess from 1 to 100.\n".to_string(); 2]);
        assert!(env.step(&[action(1, 0, "6", true)]).unwrap()[0].done);
        // A new batch reuses the ids with new secrets; ids it does not hold are errors.
        env.reset(&[episode(1, "a", Some("9"))]).unwrap();
        let out = env.step(&[action(1, 0, "6", false), action(0, 0, "5", false)]).unwrap();
        assert_eq!(out[0].observation, "higher");
        assert_eq!(out[1].error.as_deref(), Some("episode 0 was not started by reset"));
        assert!(out[1].done);
    }

    #[test]
    fn label_problems_fail_one_episode() {
        let mut env = env("{}", &[Some("5"), None, Some("five"), Some("101")]);
        let actions: Vec<Action> = (0..4).map(|id| action(id, 0, "5", false)).collect();
        let out = env.step(&actions).unwrap();
        assert!(out[0].done && out[0].error.is_none());
        assert_eq!(out[1].error.as_deref(), Some("episode 1 has no label"));
        assert_eq!(out[2].error.as_deref(), Some("episode 2: label \"five\" is not an integer"));
        assert_eq!(out[3].error.as_deref(), Some("episode 3: label 101 is outside [1, 100]"));
        assert!(out.iter().all(|o| o.done));
    }

    #[test]
    fn seeded_secrets_follow_seed_batch_and_prompt() {
        let config = r#"{"secret": "seeded", "low": -3, "high": 3}"#;
        let secrets = |seed: u64, batches: u64, prompts: &[&str]| -> Vec<i64> {
            let mut env = GuessTheNumber::new(config, &ctx(seed)).unwrap();
            env.load_state(serde_json::json!({ "batches": batches })).unwrap();
            let episodes: Vec<Episode> = prompts.iter().enumerate().map(|(i, p)| episode(i as u64, p, None)).collect();
            env.reset(&episodes).unwrap();
            (0..prompts.len() as u64).map(|id| env.secrets[&id].clone().unwrap()).collect()
        };
        let prompts: Vec<String> = (0..200).map(|i| format!("game {}", i / 2)).collect();
        let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
        let a = secrets(1, 0, &prompts);
        // Equal prompts (a GRPO group) share their secret; all secrets lie in [low, high] and
        // cover it; the same seed, batch and prompts give the same secrets.
        assert!(a.chunks(2).all(|g| g[0] == g[1]), "{a:?}");
        assert!(a.iter().all(|s| (-3..=3).contains(s)), "{a:?}");
        assert!((-3..=3).all(|s| a.contains(&s)), "{a:?}");
        assert_eq!(a, secrets(1, 0, &prompts));
        assert_ne!(a, secrets(2, 0, &prompts));
        assert_ne!(a, secrets(1, 1, &prompts));
    }

    #[test]
    fn state_round_trips() {
        let mut env = env(r#"{"secret": "seeded"}"#, &[None, None]);
        assert_eq!(env.state().unwrap(), serde_json::json!({ "batches": 1 }));
        let mut resumed = GuessTheNumber::new(r#"{"secret": "seeded"}"#, &ctx(0)).unwrap();
        resumed.load_state(env.state().unwrap()).unwrap();
        let next = [episode(0, "guess", None)];
        env.reset(&next).unwrap();
        resumed.reset(&next).unwrap();
        assert_eq!(env.secrets[&0], resumed.secrets[&0]);
        let e = resumed.load_state(serde_json::Value::Null).unwrap_err();
        assert_eq!(e.to_string(), "state.batches: missing from the checkpoint");
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |json: &str| GuessTheNumber::new(json, &ctx(0)).unwrap_err();
        let e = err(r#"{"hihg": 5}"#);
        assert_eq!(e.kind, rlhf_plugin_api::ErrorKind::Config);
        assert!(e.to_string().starts_with("hihg: unknown field `hihg`"), "{e}");
        let e = err(r#"{"secret": "random"}"#).to_string();
        assert!(e.starts_with("secret: unknown variant `random`, expected `label` or `seeded`"), "{e}");
        let e = err(r#"{"low": "1"}"#).to_string();
        assert!(e.starts_with("low: invalid type: string \"1\""), "{e}");
        assert_eq!(err(r#"{"low": 5, "high": 4}"#).to_string(), "high: must be >= low (5), got 4");
        assert_eq!(err(r#"{"stop": ["\n", ""]}"#).to_string(), "stop[1]: must not be empty");
        let e = err(r#"{"correct_reward": null}"#).to_string();
        assert!(e.starts_with("correct_reward: invalid type: null"), "{e}");
        // An empty section is the defaults.
        assert_eq!(GuessTheNumber::new("", &ctx(0)).unwrap().config, Config::default());
    }

    #[test]
    fn integers_in_text() {
        assert_eq!(last_integer("a 1 b 22."), Some(22));
        assert_eq!(last_integer("x = -3"), Some(-3));
        assert_eq!(last_integer("5-3"), Some(3));
        assert_eq!(last_integer("1.5"), Some(5));
        assert_eq!(last_integer("none"), None);
        assert_eq!(last_integer("99999999999999999999"), Some(i64::MAX));
        assert_eq!(last_integer("(-99999999999999999999)"), Some(i64::MIN));
    }
}
