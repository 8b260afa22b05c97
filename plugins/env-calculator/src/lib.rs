//! `env-calculator`: a multi-turn environment with a calculator tool, for arithmetic word problems
//! with numeric labels (GSM8K-style), in the spirit of verifiers' `ToolEnv` / verl's tool agent loop.
//!
//! # Protocol
//!
//! Each episode starts with the observation `instructions` (default empty). In a turn the policy
//! may call the tool by writing `<calc>EXPR</calc>`; `</calc>` is a stop string, so the host ends
//! the turn right after it. Then:
//!
//! - the turn holds a complete call (the **last** `call_open … call_close` pair of its text) and
//!   the policy did not sample EOS: `EXPR` is evaluated by a safe arithmetic evaluator
//!   ([`eval::evaluate`]: numbers, `+ - * / %`, `**` or `^`, signs, parentheses; nothing else) and
//!   the observation is `<result>VALUE</result>` ([`eval::format_value`]: `1776`, `3.5`,
//!   `0.333333`) or `<result>error: MESSAGE</result>`. Reward 0, the episode goes on. After
//!   `max_calls` calls every further call is answered `error: too many calls`.
//! - otherwise (no call, or EOS): the episode ends with reward
//!
//!   ```text
//!   reward = correct_reward   if |answer − label| <= 1e-9 · max(1, |label|)
//!            wrong_reward     otherwise (also when the turn holds no number)
//!   ```
//!
//!   where `answer` is the last number (`-?digits(.digits)?`; the `-` counts when it does not
//!   follow a letter or digit) of the final turn's text after every `call_open … call_close` span
//!   and every `<result>…</result>` span (the tags of `result_format`) is removed, and `label` is
//!   the episode's `label` read as a number (commas ignored, so `1,776` works).
//!
//! Errors of a call (syntax, division by zero, limits) are answers to the model, not failures. An
//! episode without a label, or whose label is not a number, fails: its outcome carries `error`.
//!
//! Metrics (per episode, summed over turns): `tool_calls` (calls made, errors included),
//! `tool_errors` (calls answered with an error), `correct` (1 if the final answer is right).
//!
//! # Config
//!
//! Every key is optional; these are the defaults.
//!
//! ```toml
//! [environment.config]
//! instructions = ""                      # first observation of every episode
//! call_open = "<calc>"                   # tool-call tags (non-empty, different)
//! call_close = "</calc>"                 # also the stop string that ends a turn
//! result_format = "<result>{}</result>"  # `{}` (exactly once) = the value or `error: <message>`
//! max_calls = 4                          # calls per episode (>= 1)
//! correct_reward = 1.0
//! wrong_reward = 0.0
//! # Evaluator limits:
//! max_chars = 200                        # expression length in characters (>= 1)
//! max_depth = 32                         # nesting of parentheses (1..=256)
//! max_exponent = 64                      # largest |exponent| of `**`
//! max_abs = 1e15                         # largest |value| of any literal, intermediate or result
//! ```

pub mod config;
pub mod eval;

use std::collections::HashMap;

use rlhf_plugin_api::prelude::*;

use crate::config::Config;
use crate::eval::{evaluate, format_value, Limits};

/// The environment; see the crate docs for the protocol.
#[derive(Debug)]
pub struct Calculator {
    config: Config,
    limits: Limits,
    /// The episodes of the current batch, by id.
    episodes: HashMap<u64, EpisodeState>,
}

#[derive(Debug, Clone)]
struct EpisodeState {
    label: Option<String>,
    calls: u32,
}

impl Calculator {
    /// Builds the environment from its config section (JSON text).
    pub fn from_config(json: &str) -> Result<Self, PluginError> {
        let config = Config::parse(json)?;
        Ok(Calculator { limits: config.limits(), config, episodes: HashMap::new() })
    }

    /// The outcome of one action.
    fn step_one(&mut self, action: &Action) -> StepOutcome {
        let Some(state) = self.episodes.get_mut(&action.id) else {
            return failed(format!("episode {} was not started by reset", action.id));
        };
        let Some(label) = state.label.as_deref() else {
            return failed(format!("episode {} has no label", action.id));
        };
        let Some(label) = parse_label(label) else {
            return failed(format!("episode {} has a label that is not a number: {label:?}", action.id));
        };
        let call =
            if action.ended { None } else { find_call(&action.text, &self.config.call_open, &self.config.call_close) };
        match call {
            Some(expr) => {
                state.calls += 1;
                let answer = if state.calls > self.config.max_calls {
                    Err("too many calls".to_string())
                } else {
                    evaluate(expr, &self.limits).map(format_value).map_err(|e| e.to_string())
                };
                tracing::trace!(id = action.id, expr, ?answer, "calculator call");
                match answer {
                    Ok(value) => StepOutcome::observe(self.config.result(&value)).metric("tool_calls", 1.0),
                    Err(message) => StepOutcome::observe(self.config.result(&format!("error: {message}")))
                        .metric("tool_calls", 1.0)
                        .metric("tool_errors", 1.0),
                }
            }
            None => {
                let (result_open, result_close) = self.config.result_tags();
                let text = strip_spans(&action.text, &self.config.call_open, &self.config.call_close);
                let text = strip_spans(&text, result_open, result_close);
                let correct = last_number(&text).is_some_and(|answer| same_number(answer, label));
                let reward = if correct { self.config.correct_reward } else { self.config.wrong_reward };
                StepOutcome::finish(reward).metric("correct", if correct { 1.0 } else { 0.0 })
            }
        }
    }
}

/// An outcome that ends a failed episode.
fn failed(message: String) -> StepOutcome {
    StepOutcome { done: true, error: Some(message), ..Default::default() }
}

/// The expression of the last complete `open … close` pair of `text`.
pub fn find_call<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let end = text.rfind(close)?;
    let start = text[..end].rfind(open)? + open.len();
    Some(&text[start..end])
}

/// `text` with every `open … close` span replaced by a space (an `open` without a later `close`
/// is kept). Returns `text` unchanged when either tag is empty.
pub fn strip_spans(text: &str, open: &str, close: &str) -> String {
    if open.is_empty() || close.is_empty() {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let Some(len) = rest[start + open.len()..].find(close) else { break };
        out.push_str(&rest[..start]);
        out.push(' ');
        rest = &rest[start + open.len() + len + close.len()..];
    }
    out.push_str(rest);
    out
}

/// The last number of `text`: digits with an optional `.digits` part, negative when preceded by a
/// `-` that does not follow a letter or digit (`x = -3` → -3, `5-3` → 3).
pub fn last_number(text: &str) -> Option<f64> {
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
        if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
        }
        last = text[start..i].parse::<f64>().ok().or(last);
    }
    last
}

/// A label read as a number: trimmed, commas ignored; `None` unless finite.
pub fn parse_label(label: &str) -> Option<f64> {
    let label: String = label.trim().chars().filter(|&c| c != ',').collect();
    label.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// `|answer − label| <= 1e-9 · max(1, |label|)`.
pub fn same_number(answer: f64, label: f64) -> bool {
    (answer - label).abs() <= 1e-9 * label.abs().max(1.0)
}

impl Environment for Calculator {
    fn new(config: &str, _ctx: &Context) -> Result<Self, PluginError> {
        let this = Calculator::from_config(config)?;
        tracing::debug!(config = ?this.config, "env-calculator ready");
        Ok(this)
    }

    fn stop_strings(&self) -> Vec<String> {
        vec![self.config.call_close.clone()]
    }

    fn reset(&mut self, episodes: &[Episode]) -> Result<Vec<String>, PluginError> {
        self.episodes = episodes.iter().map(|e| (e.id, EpisodeState { label: e.label.clone(), calls: 0 })).collect();
        Ok(vec![self.config.instructions.clone(); episodes.len()])
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<StepOutcome>, PluginError> {
        Ok(actions.iter().map(|a| self.step_one(a)).collect())
    }
}

export_environment!(
    Calculator,
    name: "env-calculator",
    description: "calculator tool (<calc>EXPR</calc> -> <result>VALUE</result>); reward: final number == `label`",
);

#[cfg(test)]
mod tests {
    use super::*;

    fn episode(id: u64, label: Option<&str>) -> Episode {
        Episode {
            id,
            prompt: "Q".into(),
            prompt_ids: vec![1],
            label: label.map(String::from),
            metadata: serde_json::Value::Null,
            messages: vec![],
        }
    }

    fn action(id: u64, turn: u32, text: &str, ended: bool) -> Action {
        Action { id, turn, text: text.into(), token_ids: vec![7], ended }
    }

    fn env(config: &str, labels: &[Option<&str>]) -> Calculator {
        let mut env = Calculator::new(config, &Context::default()).unwrap();
        let episodes: Vec<Episode> = labels.iter().enumerate().map(|(i, l)| episode(i as u64, *l)).collect();
        let first = env.reset(&episodes).unwrap();
        assert_eq!(first.len(), labels.len());
        env
    }

    fn step(env: &mut Calculator, id: u64, text: &str, ended: bool) -> StepOutcome {
        let mut out = env.step(&[action(id, 0, text, ended)]).unwrap();
        assert_eq!(out.len(), 1);
        out.remove(0)
    }

    fn metric(o: &StepOutcome, name: &str) -> Option<f64> {
        o.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    #[test]
    fn call_then_answer() {
        let mut env = env("{}", &[Some("1776")]);
        assert_eq!(env.stop_strings(), vec!["</calc>".to_string()]);
        let o = step(&mut env, 0, "I need 37*48. <calc>37*48</calc>", false);
        assert_eq!(o.observation, "<result>1776</result>");
        assert!(!o.done && o.error.is_none());
        assert_eq!(o.reward, 0.0);
        assert_eq!(metric(&o, "tool_calls"), Some(1.0));
        assert_eq!(metric(&o, "tool_errors"), None);
        let o = step(&mut env, 0, " So the answer is 1776.", true);
        assert!(o.done && o.error.is_none());
        assert_eq!(o.reward, 1.0);
        assert_eq!(metric(&o, "correct"), Some(1.0));
    }

    #[test]
    fn wrong_and_missing_answers() {
        let mut env = env(r#"{"correct_reward": 2, "wrong_reward": -0.5}"#, &[Some("42"), Some("42"), Some("-3")]);
        let out = env
            .step(&[
                action(0, 0, "The answer is 41", false),
                action(1, 0, "I don't know", true),
                action(2, 0, "x = -3", false),
            ])
            .unwrap();
        assert_eq!(out.iter().map(|o| o.reward).collect::<Vec<_>>(), vec![-0.5, -0.5, 2.0]);
        assert!(out.iter().all(|o| o.done && o.error.is_none()));
        assert_eq!(out.iter().map(|o| metric(o, "correct")).collect::<Vec<_>>(), vec![Some(0.0), Some(0.0), Some(1.0)]);
    }

    #[test]
    fn call_and_result_spans_are_not_answers() {
        let mut env = env("{}", &[Some("7"), Some("6")]);
        // The final turn (EOS) quotes a call and its result before answering.
        let o = step(&mut env, 0, "<calc>2*3</calc> <result>6</result> the answer is 7", true);
        assert!(o.done);
        assert_eq!(o.reward, 1.0);
        // A call inside a turn that ended with EOS is not evaluated; its numbers are not the answer.
        let o = step(&mut env, 1, "the answer is 6 <calc>6*1000</calc>", true);
        assert!(o.done);
        assert_eq!(o.observation, "");
        assert_eq!(metric(&o, "tool_calls"), None);
        assert_eq!(o.reward, 1.0);
    }

    #[test]
    fn the_last_call_of_a_turn_is_evaluated() {
        let mut env = env("{}", &[Some("1")]);
        let o = step(&mut env, 0, "<calc>1+1</calc> hmm, rather <calc> (1 + 2) * 3 </calc>", false);
        assert_eq!(o.observation, "<result>9</result>");
        let o = step(&mut env, 0, "<calc>7/2</calc>", false);
        assert_eq!(o.observation, "<result>3.5</result>");
    }

    #[test]
    fn call_errors_are_observations() {
        let mut env = env("{}", &[Some("1")]);
        for (expr, message) in [
            ("1/0", "division by zero"),
            ("__import__('os')", "unexpected character '_' at position 1"),
            ("3×4", "non-ASCII character '×' at position 2"),
        ] {
            let o = step(&mut env, 0, &format!("<calc>{expr}</calc>"), false);
            assert_eq!(o.observation, format!("<result>error: {message}</result>"));
            assert!(!o.done && o.error.is_none());
            assert_eq!((metric(&o, "tool_calls"), metric(&o, "tool_errors")), (Some(1.0), Some(1.0)));
        }
    }

    #[test]
    fn max_calls_is_per_episode() {
        let mut env = env(r#"{"max_calls": 2}"#, &[Some("1"), Some("1")]);
        for _ in 0..2 {
            assert_eq!(step(&mut env, 0, "<calc>1+1</calc>", false).observation, "<result>2</result>");
        }
        let o = step(&mut env, 0, "<calc>1+1</calc>", false);
        assert_eq!(o.observation, "<result>error: too many calls</result>");
        assert!(!o.done);
        assert_eq!((metric(&o, "tool_calls"), metric(&o, "tool_errors")), (Some(1.0), Some(1.0)));
        assert_eq!(step(&mut env, 1, "<calc>1+1</calc>", false).observation, "<result>2</result>");
        // A new batch starts from zero.
        env.reset(&[episode(0, Some("1"))]).unwrap();
        assert_eq!(step(&mut env, 0, "<calc>1+1</calc>", false).observation, "<result>2</result>");
        assert!(step(&mut env, 1, "1", true).error.is_some());
    }

    #[test]
    fn label_problems_are_per_episode_errors() {
        let mut env = env("{}", &[Some("5"), None, Some("five"), Some("1,776")]);
        let out = env
            .step(&[
                action(0, 0, "5", true),
                action(1, 0, "5", true),
                action(2, 0, "5", true),
                action(3, 0, "1776", true),
                action(9, 0, "5", true),
            ])
            .unwrap();
        assert_eq!(out[0].error, None);
        assert_eq!(out[1].error.as_deref(), Some("episode 1 has no label"));
        assert_eq!(out[2].error.as_deref(), Some("episode 2 has a label that is not a number: \"five\""));
        assert_eq!(out[3].reward, 1.0);
        assert_eq!(out[4].error.as_deref(), Some("episode 9 was not started by reset"));
        assert!(out.iter().all(|o| o.done));
    }

    #[test]
    fn custom_tags_and_instructions() {
        let config =
            r#"{"instructions": "Use [[expr]].", "call_open": "[[", "call_close": "]]", "result_format": "= {}\n"}"#;
        let mut env = Calculator::new(config, &Context::default()).unwrap();
        assert_eq!(env.reset(&[episode(4, Some("0.5"))]).unwrap(), vec!["Use [[expr]].".to_string()]);
        assert_eq!(env.stop_strings(), vec!["]]".to_string()]);
        assert_eq!(step(&mut env, 4, "[[1/2]]", false).observation, "= 0.5\n");
        assert_eq!(step(&mut env, 4, "[[10*10]] so 0.50", false).observation, "= 100\n");
        assert_eq!(step(&mut env, 4, "so 0.50", false).reward, 1.0);
    }

    #[test]
    fn config_errors_name_the_key() {
        let e = Calculator::new(r#"{"max_calls": 2, "temperature": 1}"#, &Context::default()).unwrap_err();
        assert_eq!(e.kind, rlhf_plugin_api::ErrorKind::Config);
        assert!(e.to_string().starts_with("temperature: unknown field `temperature`"), "{e}");
        let e = Calculator::new(r#"{"result_format": "<result></result>"}"#, &Context::default()).unwrap_err();
        assert!(e.to_string().starts_with("result_format: must contain `{}` exactly once"), "{e}");
    }

    #[test]
    fn text_helpers() {
        assert_eq!(find_call("a <calc>1</calc> b <calc>2</calc>", "<calc>", "</calc>"), Some("2"));
        assert_eq!(find_call("<calc>1</calc> <calc>2", "<calc>", "</calc>"), Some("1"));
        assert_eq!(find_call("no call </calc>", "<calc>", "</calc>"), None);
        assert_eq!(strip_spans("1<c>2</c>3<c>4", "<c>", "</c>"), "1 3<c>4");
        assert_eq!(last_number("a 1.5 b 2.25."), Some(2.25));
        assert_eq!(last_number("5-3"), Some(3.0));
        assert_eq!(last_number("(-3)"), Some(-3.0));
        assert_eq!(last_number("1.2.3"), Some(3.0));
        assert_eq!(last_number("none"), None);
        assert_eq!(parse_label(" 1,000 "), Some(1000.0));
        assert!(same_number(1776.0, 1776.0) && same_number(0.1 + 0.2, 0.3) && !same_number(1.0, 1.001));
    }
}
