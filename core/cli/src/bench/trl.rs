//! `rlhf bench --vs-trl`: runs TRL's `GRPOTrainer` through the Python driver
//! `xtask/scripts/trl_grpo_bench.py` (embedded here, so the binary needs no checkout) and reads its
//! median step time.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

/// The driver script, written next to the other temporary files of a run.
const SCRIPT: &str = include_str!("../../../../xtask/scripts/trl_grpo_bench.py");

/// What the TRL side runs: the same model, prompts and step shape as ours.
pub struct TrlSetup<'a> {
    pub python: &'a Path,
    /// A script to use instead of the embedded copy.
    pub script: Option<&'a Path>,
    pub work_dir: &'a Path,
    pub model_dir: &'a Path,
    /// JSONL of `{prompt, label}`.
    pub prompts: &'a Path,
    pub device: &'a str,
    pub dtype: &'a str,
    pub batch: i64,
    pub group: i64,
    pub new_tokens: i64,
    pub repeats: usize,
    /// TRL's `gradient_checkpointing` (off unless asked, like ours).
    pub gradient_checkpointing: bool,
    pub lr: f64,
    pub beta: f64,
    pub epsilon: f64,
    pub adam_beta2: f64,
    pub max_grad_norm: f64,
    pub seed: u64,
}

/// The driver's answer.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
pub struct TrlResult {
    /// Median step time in seconds, warm-up excluded.
    pub step_s: f64,
    pub step_times: Vec<f64>,
    pub mean_completion_length: Option<f64>,
    /// Peak resident memory over the timed steps, in GB (absent from older drivers).
    #[serde(default)]
    pub peak_rss_gb: Option<f64>,
    pub trl: String,
    pub transformers: String,
    pub torch: String,
}

/// The Python to run: `--python`, else `$RLHF_PYTHON` (set by `cargo xtask`), else `python3`.
pub fn python(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os("RLHF_PYTHON").filter(|v| !v.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"))
}

fn script_path(setup_script: Option<&Path>, work_dir: &Path) -> anyhow::Result<PathBuf> {
    if let Some(p) = setup_script {
        return Ok(p.to_path_buf());
    }
    let path = work_dir.join("trl_grpo_bench.py");
    std::fs::write(&path, SCRIPT).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The last non-empty line of `text`.
fn last_line(text: &str) -> &str {
    text.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or("")
}

/// The message of a failed driver run: its own `error: ...` line without the prefix, else its last
/// line.
fn failure_message(stderr: &str) -> String {
    let line = stderr.lines().rev().map(str::trim).find(|l| l.starts_with("error: ")).unwrap_or(last_line(stderr));
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// Checks that trl imports; returns the versions of trl, transformers and torch. Fails with the driver's one-line message
/// (which names the `pip install` command) when it does not.
pub fn check(python: &Path, script: Option<&Path>, work_dir: &Path) -> anyhow::Result<String> {
    let script = script_path(script, work_dir)?;
    let timeout = crate::deadline::probe_timeout()?;
    let out = crate::deadline::output_within(Command::new(python).arg(&script).arg("--check"), timeout)
        .with_context(|| format!("--vs-trl: cannot start {} (pass --python PATH)", python.display()))?;
    let Some(out) = out else {
        bail!(
            "--vs-trl: {} did not answer within {:.0} s (RLHF_PROBE_TIMEOUT) whether TRL imports",
            python.display(),
            timeout.as_secs_f64()
        );
    };
    if !out.status.success() {
        bail!("--vs-trl: {}", failure_message(&String::from_utf8_lossy(&out.stderr)));
    }
    let line = last_line(&String::from_utf8_lossy(&out.stdout)).to_string();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
    let version = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("?").to_string();
    Ok(format!("trl {}, transformers {}, torch {}", version("trl"), version("transformers"), version("torch")))
}

/// Runs the TRL benchmark; its log goes to `<work_dir>/trl.log` and is copied to the system temp
/// directory when it fails.
pub fn run(s: &TrlSetup<'_>) -> anyhow::Result<TrlResult> {
    let script = script_path(s.script, s.work_dir)?;
    let log_path = s.work_dir.join("trl.log");
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = Command::new(s.python);
    cmd.arg(&script)
        .args(["--model", &s.model_dir.display().to_string()])
        .args(["--prompts", &s.prompts.display().to_string()])
        .args(["--batch", &s.batch.to_string(), "--group", &s.group.to_string()])
        .args(["--new-tokens", &s.new_tokens.to_string()])
        .args(["--warmup", "1", "--repeats", &s.repeats.to_string()])
        .args(["--dtype", s.dtype, "--lr", &s.lr.to_string(), "--beta", &s.beta.to_string()])
        .args(["--epsilon", &s.epsilon.to_string(), "--adam-beta2", &s.adam_beta2.to_string()])
        .args(["--max-grad-norm", &s.max_grad_norm.to_string(), "--seed", &s.seed.to_string()])
        .args(["--output-dir", &s.work_dir.join("trl-out").display().to_string()])
        .args(s.gradient_checkpointing.then_some("--gradient-checkpointing"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log);
    match s.device.split_once(':') {
        Some(("cuda", index)) => {
            cmd.env("CUDA_VISIBLE_DEVICES", index).args(["--device", "cuda"]);
        }
        _ => {
            cmd.args(["--device", s.device]);
        }
    }
    let out = cmd.output().with_context(|| format!("--vs-trl: cannot start {}", s.python.display()))?;
    if !out.status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let kept = std::env::temp_dir().join("rlhf-bench-trl.log");
        let _ = std::fs::copy(&log_path, &kept);
        bail!("--vs-trl: TRL run failed ({}): {} (full log: {})", out.status, failure_message(&text), kept.display());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().map(str::trim).find(|l| l.starts_with('{')).unwrap_or("");
    serde_json::from_str(line).with_context(|| format!("--vs-trl: no result line from the driver (stdout: {line:?})"))
}

/// Prints the median step time and every timed step's.
pub fn print(r: &TrlResult) {
    use super::report::fmt_secs;
    println!(
        "trl:   {} s/step (median of {} steps after 1 warm-up; mean completion {} tokens)",
        fmt_secs(r.step_s),
        r.step_times.len().saturating_sub(1),
        r.mean_completion_length.map_or("?".into(), |x| format!("{x:.1}"))
    );
    let times: Vec<String> = r.step_times.iter().skip(1).map(|t| fmt_secs(*t)).collect();
    println!("       step times (s): {}", times.join(", "));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_lines() {
        let stderr = "Traceback ...\nwarning\nerror: trl is not importable (No module named 'trl'); install it with: \
                      /v/bin/python -m pip install trl\n\n";
        assert_eq!(
            failure_message(stderr),
            "trl is not importable (No module named 'trl'); install it with: /v/bin/python -m pip install trl"
        );
        assert_eq!(failure_message("a\nRuntimeError: boom\n"), "RuntimeError: boom");
        assert_eq!(last_line("x\n  y  \n\n"), "y");
    }

    #[test]
    fn result_parses() {
        let r: TrlResult = serde_json::from_str(
            r#"{"step_s": 1.5, "step_times": [3.0, 1.5], "warmup": 1, "mean_completion_length": null,
                "device": "cpu", "trl": "1.0", "transformers": "5.0", "torch": "2.11"}"#,
        )
        .unwrap();
        assert_eq!(r.step_s, 1.5);
        assert_eq!(r.mean_completion_length, None);
    }
}
