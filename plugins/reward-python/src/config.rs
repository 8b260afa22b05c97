//! The `reward-python` config section ([`Config`], as written by the user) and the validated
//! [`Settings`] the pool runs with. Every validation error names its key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rlhf_plugin_api::{parse_config, PluginError};
use serde::Deserialize;

/// The whole section; every key but `file` is optional.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The Python file defining the function (relative paths from the working directory).
    pub file: Option<String>,
    /// The function's name (default: `reward_func` for trl and openrlhf, `compute_score` for verl).
    pub function: Option<String>,
    /// How the function is called: `trl`, `verl` or `openrlhf`.
    pub signature: Signature,
    /// The interpreter (default: `<venv>/bin/python` with `venv`, else `$RLHF_PYTHON`, else `python3`).
    pub python: Option<String>,
    /// A virtual environment whose `bin/python` runs the workers.
    pub venv: Option<String>,
    /// Worker processes; a batch is split over them.
    pub workers: usize,
    /// Most seconds one call may take before its worker is killed and replaced.
    pub timeout_s: f64,
    /// Most seconds a worker may take to start (import the file).
    pub startup_timeout_s: f64,
    /// A sample whose call failed: `"fail"` the step, `"skip"` the sample, or a number as its score.
    pub on_error: ScoreOr,
    /// A sample the function scored `None` (TRL: "does not apply"): a number as its score (TRL
    /// sums the other functions' rewards, so 0.0 is TRL's behaviour) or `"skip"` the sample.
    pub on_none: ScoreOr,
    /// trl: pass prompts and completions as chat messages. Default: when the prompt went through
    /// a chat template (as TRL does for conversational datasets).
    pub conversational: Option<bool>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            file: None,
            function: None,
            signature: Signature::Trl,
            python: None,
            venv: None,
            workers: 1,
            timeout_s: 60.0,
            startup_timeout_s: 120.0,
            on_error: ScoreOr::Word("fail".into()),
            on_none: ScoreOr::Value(0.0),
            conversational: None,
        }
    }
}

/// `signature`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Signature {
    /// TRL's `reward_funcs`: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`.
    Trl,
    /// verl's `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict`.
    Verl,
    /// OpenRLHF's `reward_func(queries, prompts, labels) -> tensor | dict`.
    #[serde(rename = "openrlhf")]
    OpenRlhf,
}

impl Signature {
    /// The name the worker script knows it by.
    pub fn as_str(self) -> &'static str {
        match self {
            Signature::Trl => "trl",
            Signature::Verl => "verl",
            Signature::OpenRlhf => "openrlhf",
        }
    }

    fn default_function(self) -> &'static str {
        match self {
            Signature::Verl => "compute_score",
            Signature::Trl | Signature::OpenRlhf => "reward_func",
        }
    }
}

/// A word or a number, as `on_error` and `on_none` take.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum ScoreOr {
    Value(f64),
    Word(String),
}

/// What happens to a sample without a usable score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fallback {
    /// The step fails with the error (on_error only).
    Fail,
    /// The sample is scored NaN, which the host drops and counts.
    Skip,
    /// The sample gets this score.
    Score(f64),
}

impl Fallback {
    /// The score a sample gets (NaN: dropped by the host); `None` for `Fail`.
    pub fn score(self) -> Option<f64> {
        match self {
            Fallback::Fail => None,
            Fallback::Skip => Some(f64::NAN),
            Fallback::Score(v) => Some(v),
        }
    }
}

/// A validated config.
#[derive(Debug, Clone)]
pub struct Settings {
    pub file: PathBuf,
    pub function: String,
    pub signature: Signature,
    pub python: PathBuf,
    /// ≥ 1.
    pub workers: usize,
    pub timeout: Duration,
    pub startup_timeout: Duration,
    pub on_error: Fallback,
    /// Never `Fail`.
    pub on_none: Fallback,
    pub conversational: Option<bool>,
}

fn seconds(key: &str, v: f64) -> Result<Duration, PluginError> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        return Err(PluginError::config(key, format!("must be a number of seconds in (0, 86400], got {v}")));
    }
    Ok(Duration::from_secs_f64(v))
}

fn fallback(key: &str, v: &ScoreOr, allow_fail: bool) -> Result<Fallback, PluginError> {
    match v {
        ScoreOr::Value(x) if x.is_finite() => Ok(Fallback::Score(*x)),
        ScoreOr::Value(x) => Err(PluginError::config(key, format!("must be a finite number, got {x}"))),
        ScoreOr::Word(w) if w == "skip" => Ok(Fallback::Skip),
        ScoreOr::Word(w) if w == "fail" && allow_fail => Ok(Fallback::Fail),
        ScoreOr::Word(w) => {
            let words = if allow_fail { "\"fail\", \"skip\"" } else { "\"skip\"" };
            Err(PluginError::config(key, format!("expected {words} or a number, got {w:?}")))
        }
    }
}

impl Settings {
    /// Parses and validates the section (JSON text); the interpreter default reads `RLHF_PYTHON`.
    pub fn parse(json: &str) -> Result<Settings, PluginError> {
        Settings::from_config(parse_config(json)?, std::env::var_os("RLHF_PYTHON").map(PathBuf::from))
    }

    /// Validates `c`; `env_python` is `$RLHF_PYTHON`.
    pub fn from_config(c: Config, env_python: Option<PathBuf>) -> Result<Settings, PluginError> {
        let file = c.file.as_deref().filter(|f| !f.trim().is_empty());
        let file =
            file.ok_or_else(|| PluginError::config("file", "missing: the Python file defining the reward function"))?;
        let file = PathBuf::from(file);
        if !file.is_file() {
            return Err(PluginError::config("file", format!("{}: no such file", file.display())));
        }
        let function = c.function.unwrap_or_else(|| c.signature.default_function().to_string());
        if function.is_empty() || !function.chars().all(|ch| ch.is_alphanumeric() || ch == '_') {
            return Err(PluginError::config("function", format!("{function:?} is not a Python function name")));
        }
        let python = match (&c.python, &c.venv) {
            (Some(_), Some(_)) => return Err(PluginError::config("venv", "give `python` or `venv`, not both")),
            (Some(p), None) => PathBuf::from(p),
            (None, Some(v)) => {
                let p = Path::new(v).join("bin").join("python");
                if !p.is_file() {
                    return Err(PluginError::config("venv", format!("{}: no such interpreter", p.display())));
                }
                p
            }
            (None, None) => env_python.filter(|p| !p.as_os_str().is_empty()).unwrap_or_else(|| "python3".into()),
        };
        if c.workers == 0 || c.workers > 256 {
            return Err(PluginError::config("workers", format!("must be in 1..=256, got {}", c.workers)));
        }
        Ok(Settings {
            file,
            function,
            signature: c.signature,
            python,
            workers: c.workers,
            timeout: seconds("timeout_s", c.timeout_s)?,
            startup_timeout: seconds("startup_timeout_s", c.startup_timeout_s)?,
            on_error: fallback("on_error", &c.on_error, true)?,
            on_none: fallback("on_none", &c.on_none, false)?,
            conversational: c.conversational,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, env: Option<&str>) -> Result<Settings, String> {
        let c: Config = parse_config(json).map_err(|e| e.to_string())?;
        Settings::from_config(c, env.map(PathBuf::from)).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_and_errors_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.py");
        std::fs::write(&f, "def reward_func(**kw): return []\n").unwrap();
        let file = f.display().to_string();
        let s = parse(&format!(r#"{{"file": "{file}"}}"#), Some("/v/bin/python")).unwrap();
        assert_eq!((s.function.as_str(), s.signature, s.workers), ("reward_func", Signature::Trl, 1));
        assert_eq!((s.on_error, s.on_none), (Fallback::Fail, Fallback::Score(0.0)));
        assert_eq!(s.python, PathBuf::from("/v/bin/python"));
        let s = parse(&format!(r#"{{"file": "{file}", "signature": "verl", "on_error": -1}}"#), None).unwrap();
        assert_eq!((s.function.as_str(), s.python.to_str().unwrap()), ("compute_score", "python3"));
        assert_eq!(s.on_error, Fallback::Score(-1.0));
        for (json, want) in [
            ("{}".to_string(), "file: missing"),
            (r#"{"file": "/nonexistent.py"}"#.into(), "file: /nonexistent.py: no such file"),
            (format!(r#"{{"file": "{file}", "workers": 0}}"#), "workers: must be in 1..=256"),
            (format!(r#"{{"file": "{file}", "timeout_s": 0}}"#), "timeout_s: must be a number of seconds"),
            (
                format!(r#"{{"file": "{file}", "on_error": "retry"}}"#),
                "on_error: expected \"fail\", \"skip\" or a number",
            ),
            (format!(r#"{{"file": "{file}", "on_none": "fail"}}"#), "on_none: expected \"skip\" or a number"),
            (format!(r#"{{"file": "{file}", "signature": "grpo"}}"#), "signature: unknown variant `grpo`"),
            (format!(r#"{{"file": "{file}", "function": "a.b"}}"#), "function: \"a.b\" is not a Python function name"),
            (format!(r#"{{"file": "{file}", "python": "p", "venv": "v"}}"#), "venv: give `python` or `venv`"),
            (format!(r#"{{"file": "{file}", "venv": "/nonexistent"}}"#), "venv: /nonexistent/bin/python: no such"),
            (format!(r#"{{"file": "{file}", "worker": 2}}"#), "worker: unknown field"),
        ] {
            let e = parse(&json, None).unwrap_err();
            assert!(e.starts_with(want), "{json}: {e}");
        }
    }
}
