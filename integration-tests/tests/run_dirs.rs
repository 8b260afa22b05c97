//! Run directories under hostile use: one process owns a run directory (a second run into it is
//! refused, a lock left by a killed run is taken over), a failed start leaves nothing behind, a
//! run that stopped before its first checkpoint says what to do, and a plugin's refusal of its
//! config names the layer that set the key.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use rlhf_integration_tests::rlhf_bin;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn rlhf(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(rlhf_bin());
    cmd.args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The `error: ...` line of a failed run (asserting it failed, once, without a panic).
fn error_line(o: &Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected a failure: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    errors[0].to_string()
}

/// A fast GRPO run on the built-in task.
const FAST: &[&str] = &[
    "train",
    "--algo",
    "grpo",
    // The preset's held-out evaluation is off: these runs test other things, step by step.
    "--set",
    "eval.data=\"\"",
    "--set",
    "warmup.steps=0",
    "--set",
    "rollout.prompts_per_batch=2",
    "--set",
    "rollout.samples_per_prompt=2",
    "--set",
    "rollout.max_new_tokens=4",
    "--set",
    "train.minibatch_size=4",
];

/// A run in the background, killed (SIGKILL) by [`Background::kill`] or when dropped, so a failed
/// assertion leaves no run behind.
struct Background(Child);

impl Background {
    fn id(&self) -> u32 {
        self.0.id()
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A run of many steps in the background.
fn start_long(run: &Path, extra: &[&str]) -> Background {
    let child = Command::new(rlhf_bin())
        .args([FAST, &["--set", "train.steps=20000", "--run-dir", s(run)], extra].concat())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Background(child)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(120), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        // A line being written (or cut by a kill) is not a step yet.
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect()
}

fn lock_pid(run: &Path) -> u32 {
    std::fs::read_to_string(run.join(".lock")).unwrap().lines().next().unwrap().trim().parse().unwrap()
}

#[test]
fn a_run_directory_has_one_owner_and_a_killed_owner_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut first = start_long(&run, &["--set", "checkpoint.every=1"]);
    wait_for("the first run's lock", || run.join(".lock").is_file() && run.join("metrics.jsonl").is_file());
    assert_eq!(lock_pid(&run), first.id());

    // A second run, a resume and the supervised phases are refused while it runs; none writes.
    let in_use = [format!("{}: the run directory is in use", s(&run)), format!("PID {}", first.id())];
    let second = rlhf(&[FAST, &["--set", "train.steps=8", "--set", "run.seed=7", "--run-dir", s(&run)]].concat(), &[]);
    let e = error_line(&second);
    assert!(in_use.iter().all(|n| e.contains(n.as_str())), "{e}");
    // Any checkpoint: at a few ms per step the first ones are pruned (checkpoint.keep) at once.
    let any_checkpoint = || {
        std::fs::read_dir(run.join("checkpoints"))
            .map(|d| d.filter_map(|e| e.ok()).any(|e| e.path().join("manifest.json").is_file()))
            .unwrap_or(false)
    };
    wait_for("a checkpoint", any_checkpoint);
    for args in
        [vec!["train", "--resume", s(&run)], vec!["sft", "--run-dir", s(&run)], vec!["rm", "--run-dir", s(&run)]]
    {
        let e = error_line(&rlhf(&args, &[]));
        assert!(in_use.iter().all(|n| e.contains(n.as_str())), "{args:?}: {e}");
    }
    let logged = steps(&run);
    assert!(logged.windows(2).all(|w| w[1] == w[0] + 1), "steps of one run only: {logged:?}");

    // Killed outright, it leaves its lock; a resume takes it over (with a warning) and goes on.
    first.kill(); // SIGKILL
    assert!(run.join(".lock").is_file());
    let ckpt = rlhf_trainer::checkpoint::latest(&run).unwrap().unwrap();
    let at: u64 = ckpt.file_name().unwrap().to_str().unwrap().trim_start_matches("step-").parse().unwrap();
    let o = rlhf(&["train", "--resume", s(&run), "--set", &format!("train.steps={}", at + 2)], &[]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("taking over a stale lock") && stderr.contains(&format!("PID {}", first.id())), "{stderr}");
    assert_eq!(steps(&run), (1..=at + 2).collect::<Vec<_>>());
    assert!(!run.join(".lock").exists(), "released at the end");

    // A stale lock of a fresh directory: a new run takes it over too.
    let fresh = tmp.path().join("fresh");
    std::fs::create_dir_all(&fresh).unwrap();
    std::fs::write(fresh.join(".lock"), format!("{}\n", first.id())).unwrap();
    let o = rlhf(&[FAST, &["--set", "train.steps=1", "--run-dir", s(&fresh)]].concat(), &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(steps(&fresh), [1]);
    assert!(!fresh.join(".lock").exists());
}

#[test]
fn a_failed_start_leaves_no_dead_end() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let fails = |sets: &[&str], env: &[(&str, &str)]| {
        let mut args = FAST.to_vec();
        for set in sets {
            args.extend(["--set", set]);
        }
        let e = error_line(&rlhf(&[&args[..], &["--run-dir", s(&run)]].concat(), env));
        assert!(!run.exists(), "{e}: the failed start left {}", run.display());
        e
    };
    // A learning rate that would have died after step 1 is a config error now.
    let e = fails(&["train.lr=nan"], &[]);
    assert!(e.contains("--set train.lr=nan: train.lr: must be a finite number > 0"), "{e}");
    // A plugin's refusal of its section names the layer that set the key.
    let e = fails(&["algorithm.config.beta=-1"], &[]);
    assert!(e.contains("error: --set algorithm.config.beta=-1: algorithm.config.beta: must be >= 0"), "{e}");
    let e = fails(&[], &[("RLHF_ALGORITHM__CONFIG__BETA", "-1")]);
    assert!(e.contains("error: RLHF_ALGORITHM__CONFIG__BETA: algorithm.config.beta: must be >= 0"), "{e}");
    let e = fails(&["rewards=[{ plugin = \"reward-rules\", config = { exact = 1 } }]"], &[]);
    assert!(e.contains("error: --set rewards=") && e.contains(": rewards[0].config.exact: unknown field"), "{e}");
    // Data errors: one before the built-in model is written, one after.
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"no prompt\"}\n").unwrap();
    let e = fails(&[&format!("data.prompts={:?}", s(&bad))], &[]);
    assert!(e.contains("bad.jsonl: line 1"), "{e}");
    let unlabelled = tmp.path().join("unlabelled.jsonl");
    std::fs::write(&unlabelled, "{\"prompt\": \"1 + 1 =\"}\n").unwrap();
    let e = fails(&[&format!("data.prompts={:?}", s(&unlabelled)), "warmup.steps=2"], &[]);
    assert!(e.contains("warmup.steps: the prompts of data.prompts have no `label`"), "{e}");
    // Into a directory that exists, only what the start added goes.
    std::fs::create_dir_all(run.join("notes")).unwrap();
    let o = rlhf(
        &[
            FAST,
            &["--set", &format!("data.prompts={:?}", s(&unlabelled)), "--set", "warmup.steps=2", "--run-dir", s(&run)],
        ]
        .concat(),
        &[],
    );
    error_line(&o);
    let left: Vec<_> = std::fs::read_dir(&run).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, ["notes"]);
    std::fs::remove_dir_all(&run).unwrap();
    // SFT with no usable line: the directory it created goes.
    let e = error_line(&rlhf(&["sft", "--set", &format!("data.train={:?}", s(&bad)), "--run-dir", s(&run)], &[]));
    assert!(e.contains("no usable examples") && !run.exists(), "{e}");

    // A run killed before its first checkpoint can be neither continued nor restarted over: both
    // say what to do instead, and leave its steps alone.
    let mut child = start_long(&run, &["--set", "checkpoint.every=0"]);
    wait_for("two logged steps", || {
        std::fs::read_to_string(run.join("metrics.jsonl")).is_ok_and(|t| t.lines().count() >= 2)
    });
    child.kill();
    let logged = steps(&run);
    let last = logged.last().unwrap();
    let what = format!("stopped before its first checkpoint (metrics.jsonl ends at step {last})");
    let e = error_line(&rlhf(&[FAST, &["--set", "train.steps=8", "--run-dir", s(&run)]].concat(), &[]));
    assert!(e.contains(&what) && e.contains("remove the directory or choose another --run-dir"), "{e}");
    let e = error_line(&rlhf(&["train", "--resume", s(&run)], &[]));
    assert!(e.contains(&what) && e.contains("cannot be resumed"), "{e}");
    assert_eq!(steps(&run), logged);
    assert!(!run.join(".lock").exists(), "the refusals took over the stale lock and released it");
}

#[test]
fn duplicate_reward_names_and_warnings() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[algorithm]\nname = \"grpo\"\n[[rewards]]\nplugin = \"reward-rules\"\nname = \"accuracy\"\n\
         [[rewards]]\nplugin = \"reward-rules\"\n[[rewards]]\nplugin = \"reward-rules\"\nname = \"accuracy\"\n",
    )
    .unwrap();
    let e = error_line(&rlhf(&["train", "--config", s(&cfg), "--run-dir", s(&tmp.path().join("r"))], &[]));
    assert!(e.contains("rewards[2].name: rewards[0] and rewards[2] are both named `accuracy`"), "{e}");

    // More prompts per batch than the data has, a minibatch larger than the batch: warnings.
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"1 + 1 =\", \"label\": \"2\"}\n").unwrap();
    let o = rlhf(
        &[
            FAST,
            &[
                "--set",
                "train.steps=1",
                "--set",
                "train.minibatch_size=64",
                "--set",
                &format!("data.prompts={:?}", s(&prompts)),
                "--run-dir",
                s(&tmp.path().join("w")),
            ],
        ]
        .concat(),
        &[],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("train.minibatch_size = 64 is more than a generation batch"), "{stderr}");
    assert!(stderr.contains("rollout.prompts_per_batch = 2 is more than the 1 prompts"), "{stderr}");
}

/// `run.save_rollouts` writes every scored sample of every step — its group, the prompt, the
/// completion decoded from exactly the sampled ids, and its reward, which average to the step's
/// `reward` — and changes no number of the run (metrics and final weights bit for bit).
#[test]
fn saved_rollouts_hold_every_sample_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (with, without) = (dir.path().join("with"), dir.path().join("without"));
    let env = [("OMP_NUM_THREADS", "1")];
    for (run, save) in [(&with, "true"), (&without, "false")] {
        let set = format!("run.save_rollouts={save}");
        let o = rlhf(&[FAST, &["--set", "train.steps=3", "--set", &set, "--run-dir", s(run)]].concat(), &env);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(!without.join("rollouts").exists());
    let metrics = rlhf_integration_tests::behaviour_metrics(&with);
    assert_eq!(metrics, rlhf_integration_tests::behaviour_metrics(&without));
    let weights = |run: &Path| std::fs::read(run.join("actor").join("model.safetensors")).unwrap();
    assert!(weights(&with) == weights(&without), "the final weights differ");
    for row in &metrics {
        let step = row["step"].as_u64().unwrap();
        let path = with.join("rollouts").join(format!("step-{step}.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let samples: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(samples.len() as f64, row["completions/count"].as_f64().unwrap(), "step {step}");
        let mean = samples.iter().map(|v| v["reward"].as_f64().unwrap()).sum::<f64>() / samples.len() as f64;
        assert!((mean - row["reward"].as_f64().unwrap()).abs() < 1e-12, "step {step}: mean reward {mean}");
        let tokens: f64 = samples.iter().map(|v| v["completion_ids"].as_array().unwrap().len() as f64).sum();
        let mean_len = row["completions/mean_length"].as_f64().unwrap();
        assert!((tokens / samples.len() as f64 - mean_len).abs() < 1e-12, "step {step}: lengths");
        for v in &samples {
            assert_eq!(v["step"].as_u64(), Some(step));
            assert!(v["group"].as_i64().is_some_and(|g| g >= 0), "{v}");
            assert!(v["prompt"].as_str().is_some_and(|p| p.contains('+')), "{v}");
            assert!(v["completion"].is_string(), "{v}");
        }
    }
}
