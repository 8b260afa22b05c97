//! Reward throughput of `reward-python` (`cargo xtask bench reward-python`): samples per second
//! of a trivial TRL reward function and of the shipped math-verify checker, through the plugin
//! with 1..N workers, against the same function called in-process from Python on the same
//! batches, measured side by side in one run.
//!
//! Usage: throughput [--samples N] [--batch B] [--workers 1,2] (the interpreter is
//! `$RLHF_PYTHON`, else `python3`; math-verify must be importable).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use rlhf_plugin_api::{ChatMessage, Context, RewardSource, Sample};
use rlhf_plugin_reward_python::RewardPython;
use serde_json::json;

const TRIVIAL: &str = "def reward_func(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n";

/// The benchmark's batch, as both sides build it: sample `i` answers `i % 97` to the gold
/// `i % 97` (every third one wrong), in LaTeX half of the time.
fn batch(n: usize) -> Vec<Sample> {
    (0..n)
        .map(|i| {
            let gold = i % 97;
            let answer = if i % 3 == 0 { gold + 1 } else { gold };
            let response = if i % 2 == 0 { format!("The answer is \\boxed{{{answer}}}.") } else { format!("{answer}") };
            let prompt = format!("What is {} + {}?", gold / 2, gold - gold / 2);
            Sample {
                prompt: prompt.clone(),
                response,
                prompt_ids: vec![1, 2, 3],
                response_ids: vec![4, 5, 6],
                label: Some(gold.to_string()),
                metadata: json!({}),
                messages: vec![ChatMessage { role: "user".into(), content: prompt }],
            }
        })
        .collect()
}

/// The same batches, timed in-process in Python.
const IN_PROCESS: &str = r#"
import importlib.util, sys, time
path, n, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = importlib.util.spec_from_file_location("m", path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
rows = []
for i in range(n):
    gold = i % 97
    answer = gold + 1 if i % 3 == 0 else gold
    rows.append(("What is %d + %d?" % (gold // 2, gold - gold // 2), ("The answer is \\boxed{%d}." % answer) if i % 2 == 0 else str(answer), str(gold)))
def call(chunk):
    return m.reward_func(prompts=[r[0] for r in chunk], completions=[r[1] for r in chunk], completion_ids=[[4, 5, 6]] * len(chunk), label=[r[2] for r in chunk])
call(rows[:8])
t = time.perf_counter()
for k in range(0, n, b):
    call(rows[k:k + b])
print(n / (time.perf_counter() - t))
"#;

fn python() -> PathBuf {
    std::env::var_os("RLHF_PYTHON").map(PathBuf::from).unwrap_or_else(|| "python3".into())
}

fn in_process(file: &Path, n: usize, b: usize) -> f64 {
    let o = Command::new(python()).args(["-c", IN_PROCESS]).arg(file).arg(n.to_string()).arg(b.to_string()).output();
    let o = o.expect("run python");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().parse().expect("samples/s")
}

fn through_plugin(file: &Path, workers: usize, samples: &[Sample], b: usize) -> f64 {
    let config = json!({"file": file, "workers": workers, "python": python()});
    let mut r = RewardPython::new(&config.to_string(), &Context::default()).expect("start the pool");
    r.score(&samples[..8]).expect("warm-up");
    let t = Instant::now();
    for chunk in samples.chunks(b) {
        r.score(chunk).expect("score");
    }
    samples.len() as f64 / t.elapsed().as_secs_f64()
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = arg(&args, "--samples").map_or(4096, |v| v.parse().expect("--samples N"));
    let b: usize = arg(&args, "--batch").map_or(256, |v| v.parse().expect("--batch B"));
    let workers: Vec<usize> = arg(&args, "--workers")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .map(|w| w.parse().expect("--workers 1,2"))
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let trivial = dir.path().join("trivial.py");
    std::fs::write(&trivial, TRIVIAL).expect("write");
    let math = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/rewards/math_verify_reward.py");
    let samples = batch(n);
    println!("reward-python throughput: {n} samples in batches of {b}, {} cores", num_cpus());
    println!(
        "| function | in-process Python | {} |",
        workers.iter().map(|w| format!("{w} worker(s)")).collect::<Vec<_>>().join(" | ")
    );
    println!("|---|---|{}", "---|".repeat(workers.len()));
    for (name, file) in [("trivial", trivial.as_path()), ("math-verify", math.as_path())] {
        let base = in_process(file, n, b);
        let cells: Vec<String> = workers
            .iter()
            .map(|&w| {
                let r = through_plugin(file, w, &samples, b);
                format!("{r:.0}/s ({:.2}x)", r / base)
            })
            .collect();
        println!("| {name} | {base:.0}/s | {} |", cells.join(" | "));
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
