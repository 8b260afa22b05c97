//! `[eval]`: held-out evaluation during an RL run (verl's `data.val_files` and `trainer.test_freq`,
//! OpenRLHF's `--eval_dataset` and `--eval_steps`, TRL's `eval_dataset`): which prompts, how
//! often, how many samples per prompt and how they are sampled, which reward sources score them,
//! and which score makes a sample correct (for pass@k and maj@n).

use serde::{Deserialize, Serialize};

use super::KeySource;
use crate::error::Result;

/// Held-out evaluation; off while `data` is empty.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Held-out prompts, read like `data.prompts` (JSONL, Parquet) with `[data]`'s column keys.
    /// Empty: no evaluation.
    pub data: String,
    /// Evaluate after every this many steps (0: only before training and at the end).
    pub every_steps: usize,
    /// Evaluate the starting policy (as step 0) before the first step of a fresh run.
    pub before_train: bool,
    /// Evaluate after the last step.
    pub at_end: bool,
    /// Samples per prompt (n of pass@k and maj@n).
    pub samples_per_prompt: usize,
    /// Sampling temperature; unset: greedy when `samples_per_prompt` is 1, else
    /// `rollout.temperature`. 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling; unset: `rollout.top_p`.
    pub top_p: Option<f64>,
    /// Unset: `rollout.max_new_tokens`.
    pub max_new_tokens: Option<i64>,
    /// Evaluate only the first this many prompts of `data` (0: all).
    pub max_prompts: usize,
    /// Names of the `[[rewards]]` that score evaluation samples; empty: all of them.
    pub rewards: Vec<String>,
    /// The answer maj@n votes on: `last_number` (the last number of the completion) or `full`
    /// (the whole completion, trimmed).
    pub answer: String,
    /// When a sample counts as correct: `<source> <op> <number>`, with `<source>` a reward name of
    /// `rewards` or `reward` (their weighted sum) and `<op>` one of `>=`, `>`, `<=`, `<`, `==`.
    pub correct_if: String,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            data: String::new(),
            every_steps: 0,
            before_train: true,
            at_end: true,
            samples_per_prompt: 1,
            temperature: None,
            top_p: None,
            max_new_tokens: None,
            max_prompts: 0,
            rewards: Vec::new(),
            answer: "last_number".into(),
            correct_if: "reward >= 1.0".into(),
        }
    }
}

/// A comparison of `correct_if`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Ge,
    Gt,
    Le,
    Lt,
    Eq,
}

/// `correct_if`, parsed: a sample is correct when `score(source) op threshold`.
#[derive(Debug, Clone, PartialEq)]
pub struct CorrectIf {
    /// A reward source's name, or `reward` for the weighted sum.
    pub source: String,
    pub op: Cmp,
    pub threshold: f64,
}

impl CorrectIf {
    /// Parses `<source> <op> <number>`.
    pub fn parse(text: &str) -> std::result::Result<CorrectIf, String> {
        let ops = [(">=", Cmp::Ge), ("<=", Cmp::Le), ("==", Cmp::Eq), (">", Cmp::Gt), ("<", Cmp::Lt)];
        let (at, sym, op) = ops
            .iter()
            .filter_map(|&(sym, op)| text.find(sym).map(|at| (at, sym, op)))
            .min_by_key(|&(at, sym, _)| (at, std::cmp::Reverse(sym.len())))
            .ok_or_else(|| format!("{text:?}: expected `<reward name> <op> <number>` with op >=, >, <=, < or =="))?;
        let source = text[..at].trim();
        let number = text[at + sym.len()..].trim();
        if source.is_empty() || source.contains(char::is_whitespace) {
            return Err(format!("{text:?}: expected a reward name before `{sym}`"));
        }
        let threshold: f64 = number
            .parse()
            .ok()
            .filter(|x: &f64| x.is_finite())
            .ok_or_else(|| format!("{text:?}: `{number}` is not a finite number"))?;
        Ok(CorrectIf { source: source.to_string(), op, threshold })
    }

    /// Whether `score` passes.
    pub fn holds(&self, score: f64) -> bool {
        match self.op {
            Cmp::Ge => score >= self.threshold,
            Cmp::Gt => score > self.threshold,
            Cmp::Le => score <= self.threshold,
            Cmp::Lt => score < self.threshold,
            Cmp::Eq => score == self.threshold,
        }
    }
}

impl EvalConfig {
    /// Whether evaluation is on.
    pub fn enabled(&self) -> bool {
        !self.data.trim().is_empty()
    }

    /// Checks the section; `reward_names` are the names of `[[rewards]]`.
    pub(crate) fn validate(&self, reward_names: &[&str], src: &KeySource) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        let bad = |key: &str, msg: &str| Err(src.error(key, msg));
        if self.samples_per_prompt == 0 {
            return bad("eval.samples_per_prompt", "must be >= 1");
        }
        if self.temperature.is_some_and(|t| !t.is_finite() || t < 0.0) {
            return bad("eval.temperature", "must be a finite number >= 0 (0 is greedy)");
        }
        if self.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
            return bad("eval.top_p", "must be in (0, 1]");
        }
        if !["last_number", "full"].contains(&self.answer.as_str()) {
            return bad("eval.answer", "must be \"last_number\" or \"full\"");
        }
        if self.max_new_tokens.is_some_and(|n| n < 1) {
            return bad("eval.max_new_tokens", "must be >= 1");
        }
        for (i, name) in self.rewards.iter().enumerate() {
            if !reward_names.contains(&name.as_str()) {
                return bad(
                    &format!("eval.rewards[{i}]"),
                    &format!("`{name}` is not the name of a [[rewards]] entry (known: {})", reward_names.join(", ")),
                );
            }
        }
        let correct = CorrectIf::parse(&self.correct_if).map_err(|e| src.error("eval.correct_if", &e))?;
        let scored: Vec<&str> = if self.rewards.is_empty() {
            reward_names.to_vec()
        } else {
            self.rewards.iter().map(String::as_str).collect()
        };
        if correct.source != "reward" && !scored.contains(&correct.source.as_str()) {
            return bad(
                "eval.correct_if",
                &format!(
                    "`{}` is not `reward` nor a reward source that scores evaluation samples ({})",
                    correct.source,
                    scored.join(", ")
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correct_if_parses_and_holds() {
        let c = CorrectIf::parse("accuracy >= 1.0").unwrap();
        assert_eq!(c, CorrectIf { source: "accuracy".into(), op: Cmp::Ge, threshold: 1.0 });
        assert!(c.holds(1.0) && !c.holds(0.999));
        let c = CorrectIf::parse("reward>0.5").unwrap();
        assert_eq!((c.source.as_str(), c.op, c.threshold), ("reward", Cmp::Gt, 0.5));
        assert!(c.holds(0.6) && !c.holds(0.5));
        assert_eq!(CorrectIf::parse(" score <= -2 ").unwrap().op, Cmp::Le);
        assert_eq!(CorrectIf::parse("score < 3").unwrap().op, Cmp::Lt);
        assert!(CorrectIf::parse("score == 1").unwrap().holds(1.0));
        for bad in ["accuracy", ">= 1", "accuracy >= x", "accuracy >= inf", "my acc >= 1", ""] {
            assert!(CorrectIf::parse(bad).is_err(), "{bad}");
        }
    }
}
