//! SIGTERM and SIGINT end a run cleanly: the step in flight finishes, the last finished step is
//! checkpointed (on every rank), the run directory's lock is released, and the process exits with
//! 128 + the signal and one line saying where to continue; resuming then trains every step
//! exactly once, as an uninterrupted run does. A second signal (past the moment a scheduler's
//! duplicate would come) ends the process at once.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rlhf_integration_tests::{behaviour_metrics, metrics, rlhf_bin};

fn start(args: &[&str]) -> Child {
    Command::new(rlhf_bin())
        .args(args)
        .arg("--no-progress")
        .env("RLHF_DIST_TIMEOUT", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rlhf")
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig} failed");
}

/// Waits until `run`'s metrics.jsonl has at least `lines` lines.
fn wait_for_steps(run: &Path, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < lines {
        assert!(Instant::now() < deadline, "the run did not reach {lines} logged steps");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The step numbers logged, in order.
fn steps(run: &Path) -> Vec<u64> {
    metrics(run).iter().map(|l| l["step"].as_u64().unwrap()).collect()
}

/// Signals a run of 200 steps after its second step, checks the clean stop, resumes it to
/// `stopped + 3` steps and returns (the stopping step, the resumed run's stderr).
fn stop_and_resume(run: &Path, sig: &str, code: i32, nproc: Option<&str>) -> usize {
    let rd = run.to_str().unwrap();
    let mut args =
        vec!["train", "--algo", "grpo", "--set", "eval.data=\"\"", "--set", "train.steps=200", "--run-dir", rd];
    if let Some(n) = nproc {
        args.extend(["--nproc", n]);
    }
    let child = start(&args);
    wait_for_steps(run, 2);
    signal(&child, sig);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{err}");
    let last = err.lines().last().unwrap_or("");
    let name = if sig == "-TERM" { "SIGTERM" } else { "SIGINT" };
    assert!(last.contains(&format!("stopped by {name}")) && !err.contains("panicked"), "{err}");
    let stopped = *steps(run).last().unwrap() as usize;
    assert!(err.contains(&format!("stopped by {name} after step {stopped} of 200")), "{err}");
    let ckpt = run.join(format!("checkpoints/step-{stopped:06}"));
    assert!(ckpt.join("manifest.json").is_file(), "no checkpoint of step {stopped}: {err}");
    assert!(!run.join(".lock").exists(), "the run directory is still locked");
    let total = format!("train.steps={}", stopped + 3);
    let mut resume = vec!["train", "--resume", rd, "--set", &total];
    if let Some(n) = nproc {
        resume.extend(["--nproc", n]);
    }
    let out = start(&resume).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<u64> = (1..=stopped as u64 + 3).collect();
    assert_eq!(steps(run), want, "every step exactly once");
    stopped
}

#[test]
fn sigterm_checkpoints_the_last_step_and_the_run_resumes_as_if_uninterrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let stopped = stop_and_resume(&run, "-TERM", 143, None);
    // The same run without a stop: the same metrics and weights.
    let plain = tmp.path().join("plain");
    let total = format!("train.steps={}", stopped + 3);
    let args =
        ["train", "--algo", "grpo", "--set", "eval.data=\"\"", "--set", &total, "--run-dir", plain.to_str().unwrap()];
    let out = start(&args).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(behaviour_metrics(&run), behaviour_metrics(&plain));
    let weights = |d: &Path| std::fs::read(d.join("actor/model.safetensors")).unwrap();
    assert!(weights(&run) == weights(&plain), "weights differ from the uninterrupted run");
}

#[test]
fn sigint_to_the_launcher_stops_both_ranks_after_the_same_step() {
    let tmp = tempfile::tempdir().unwrap();
    stop_and_resume(&tmp.path().join("run"), "-INT", 130, Some("2"));
}

/// A reward server that never answers within the test: every step waits on it.
fn silent_server() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    port
}

#[test]
fn a_second_signal_ends_the_run_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    // Scoring waits (up to 60 s) on a server that does not answer: the first signal waits for the
    // step in flight, the second does not.
    let preset = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/grpo-http.toml")).unwrap();
    let url = format!("url = \"http://127.0.0.1:{}/get_reward\"\ntimeout_s = 60.0", silent_server());
    let config = tmp.path().join("slow.toml");
    std::fs::write(&config, preset.replace("url = \"http://127.0.0.1:8000/get_reward\"", &url)).unwrap();
    let args = [
        "train",
        "--config",
        config.to_str().unwrap(),
        "--set",
        "eval.data=\"\"",
        "--set",
        "warmup.steps=0",
        "--run-dir",
        run.to_str().unwrap(),
    ];
    let child = start(&args);
    std::thread::sleep(Duration::from_secs(4));
    signal(&child, "-TERM");
    std::thread::sleep(Duration::from_millis(2500));
    let t = Instant::now();
    signal(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "the second signal did not end the run at once");
    assert!(!err.contains("stopped by SIGTERM"), "{err}");
}
