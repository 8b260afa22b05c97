//! `reward-python` against reward functions that misbehave: processes they start outlive nothing
//! (the worker's whole process group ends with it), a flood on stdout without a newline costs
//! the trainer no memory, a metric of 1e308 does not overflow, an exception message of 50 MB or
//! with a lone surrogate is one short error (not a dead worker), and two sources whose files
//! share a stem keep their metrics apart.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rlhf_plugin_api::{ChatMessage, Context, PluginError, RewardSource, Sample};
use rlhf_plugin_reward_python::RewardPython;
use serde_json::{json, Value};

fn sample(response: &str) -> Sample {
    Sample {
        prompt: "p".into(),
        response: response.into(),
        prompt_ids: vec![1],
        response_ids: vec![2],
        label: Some("7".into()),
        metadata: json!({}),
        messages: vec![ChatMessage { role: "user".into(), content: "p".into() }],
    }
}

fn source_at(file: &Path, code: &str, config: Value) -> Result<RewardPython, PluginError> {
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(file, code).unwrap();
    let mut config = config;
    config["file"] = json!(file);
    if std::env::var_os("RLHF_PYTHON").is_none() {
        config["python"] = json!("python3");
    }
    RewardPython::new(&config.to_string(), &Context::default())
}

/// Whether `pid` runs (a zombie waiting for a reaper that never comes does not).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

fn pids(file: &Path) -> Vec<u32> {
    std::fs::read_to_string(file).unwrap_or_default().split_whitespace().map(|p| p.parse().unwrap()).collect()
}

/// Waits up to 20 s for every process of `pids` to end; the ones still running.
fn survivors(pids: &[u32]) -> Vec<u32> {
    let t0 = Instant::now();
    while pids.iter().any(|p| alive(*p)) && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    pids.iter().copied().filter(|p| alive(*p)).collect()
}

/// A function that starts a `subprocess.Popen`, a forked child and (when asked) hangs past the
/// timeout: after the worker is replaced, and after the source is dropped, none of them runs.
#[test]
fn processes_the_function_started_end_with_its_worker() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("pids");
    let code = format!(
        r#"
import os, subprocess, time
def reward_func(completions, **kw):
    p = subprocess.Popen(["sleep", "300"])
    child = os.fork()
    if child == 0:
        time.sleep(300)
        os._exit(0)
    with open({log:?}, "a") as f:
        f.write(f"{{p.pid}} {{child}} ")
    if completions[0] == "hang":
        time.sleep(300)
    return [1.0] * len(completions)
"#,
        log = log.display().to_string()
    );
    let mut r = source_at(&dir.path().join("r.py"), &code, json!({"timeout_s": 2.0, "on_error": 0.0})).unwrap();
    let out = r.score(&[sample("hang")]).unwrap();
    assert_eq!(out.scores, [0.0], "the hanging call times out");
    let first = pids(&log);
    assert_eq!(first.len(), 2);
    assert_eq!(survivors(&first), Vec::<u32>::new(), "left running by the worker that timed out");
    assert_eq!(r.score(&[sample("7")]).unwrap().scores, [1.0]);
    let all = pids(&log);
    assert_eq!(all.len(), 4);
    drop(r);
    assert_eq!(survivors(&all), Vec::<u32>::new(), "left running after the run ended");
}

/// The largest amount of memory this process has held, from `/proc/self/status`.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// 200 MB written to stdout without a newline: the call scores, and the forwarder (a thread of
/// this process) holds a line of at most a few kilobytes, never the flood.
#[test]
fn a_flood_without_newlines_is_cut_not_held() {
    let dir = tempfile::tempdir().unwrap();
    let code = r#"
import sys
def reward_func(completions, **kw):
    chunk = "x" * (1 << 20)
    for _ in range(200):
        sys.stdout.write(chunk)
    sys.stdout.write("\nafter the flood\n")
    sys.stdout.flush()
    return [1.0] * len(completions)
"#;
    let mut r = source_at(&dir.path().join("r.py"), code, json!({"timeout_s": 120.0})).unwrap();
    let before = peak_rss_bytes();
    assert_eq!(r.score(&[sample("7")]).unwrap().scores, [1.0]);
    let grown = peak_rss_bytes().saturating_sub(before);
    assert!(grown < 64 << 20, "the trainer's peak memory grew by {} MB", grown >> 20);
}

fn prefixes(metrics: &[(String, f64)]) -> Vec<String> {
    let mut p: Vec<String> =
        metrics.iter().filter_map(|(k, _)| k.strip_suffix("/latency_s")).map(str::to_string).collect();
    p.sort();
    p
}

/// A verl dict whose extra number is 1e308 in every sample: its mean is 1e308, not an overflow
/// that kills the worker. Two sources whose files share a stem report under two prefixes.
#[test]
fn large_metrics_average_and_sources_sharing_a_stem_stay_apart() {
    let dir = tempfile::tempdir().unwrap();
    let code = r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "big": 1e308}
"#;
    let config = json!({"signature": "verl"});
    let mut a = source_at(&dir.path().join("a/reward.py"), code, config.clone()).unwrap();
    let mut b = source_at(&dir.path().join("b/reward.py"), code, config).unwrap();
    let out = a.score(&[sample("1"), sample("2"), sample("3")]).unwrap();
    assert_eq!(out.scores, [1.0, 1.0, 1.0]);
    let big = out.metrics.iter().find(|(k, _)| k.ends_with("/big")).map(|(_, v)| *v);
    assert_eq!(big, Some(1e308), "{:?}", out.metrics);
    let restarts = out.metrics.iter().find(|(k, _)| k.ends_with("/restarts")).map(|(_, v)| *v);
    assert_eq!(restarts, Some(0.0));
    let other = b.score(&[sample("1")]).unwrap();
    assert_eq!(prefixes(&out.metrics), ["reward_python/reward.compute_score"]);
    assert_eq!(prefixes(&other.metrics), ["reward_python/reward-2.compute_score"]);
}

/// An exception whose message is 50 MB, or holds a lone surrogate, is the function's error (its
/// message cut to a line), not a worker that wrote something that is not a reply.
#[test]
fn huge_and_malformed_exception_messages_are_short_errors() {
    let dir = tempfile::tempdir().unwrap();
    let code = r#"
def reward_func(completions, **kw):
    if completions[0] == "huge":
        raise ValueError("y" * (50 << 20))
    raise ValueError("bad \udc80 byte")
"#;
    let file: PathBuf = dir.path().join("r.py");
    let mut r = source_at(&file, code, json!({"on_error": "fail"})).unwrap();
    let e = r.score(&[sample("huge")]).unwrap_err().to_string();
    assert!(e.contains("the function raised ValueError: yyy") && e.contains("more "), "{}", &e[..200.min(e.len())]);
    assert!(e.len() < 3000, "an error line of {} bytes", e.len());
    let e = r.score(&[sample("surrogate")]).unwrap_err().to_string();
    assert!(e.contains(r"the function raised ValueError: bad \udc80 byte"), "{e}");
    let mut r = source_at(&file, code, json!({"on_error": 0.0})).unwrap();
    let out = r.score(&[sample("surrogate")]).unwrap();
    let restarts = out.metrics.iter().find(|(k, _)| k.ends_with("/restarts")).map(|(_, v)| *v);
    assert_eq!(restarts, Some(0.0), "the worker was replaced");
}
