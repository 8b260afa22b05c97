//! `reward-python` in real runs, on data as verl and TRL users keep it: verl's Parquet layout
//! (chat messages in `prompt`, the answer in `reward_model.ground_truth`, `data_source` and
//! `extra_info`) scored by a verl `compute_score` on 2 workers, with held-out evaluation, on one
//! process and 2 ranks (the same rewards) and resumed from a checkpoint (the same metrics and
//! weights); and TRL's conversational JSONL with a `solution` column scored by a TRL reward
//! function that checks what it is called with. The data is written here with the project's
//! Python (pyarrow); the model is the fixture Llama (it has a chat template).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rlhf_integration_tests::{copy_dir, metrics, model_dir, python, rlhf_bin};
use serde_json::{Map, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const VERL_SCORE: &str = r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "arith", data_source
    assert extra_info["split"] == "train" and isinstance(extra_info["index"], int), extra_info
    hit = str(ground_truth) in solution_str
    return {"score": float(hit) + (len(solution_str) % 4) / 4, "length_bucket": len(solution_str) % 4}
"#;

/// verl's layout, as its `examples/data_preprocess/gsm8k.py` writes it, for 8 addition prompts.
const MAKE_VERL_PARQUET: &str = r#"
import sys
import pyarrow as pa, pyarrow.parquet as pq
rows = []
for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (7, 2), (3, 3), (5, 4)]):
    rows.append({
        "data_source": "arith",
        "prompt": [{"role": "user", "content": f"{a} + {b} ="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": "train", "index": i},
    })
pq.write_table(pa.Table.from_pylist(rows), sys.argv[1])
"#;

/// Writes the verl data, the scoring file and the run config into `dir`; returns the config.
fn verl_setup(dir: &Path, python: &Path) -> PathBuf {
    let data = dir.join("train.parquet");
    let o = Command::new(python).args(["-c", MAKE_VERL_PARQUET, s(&data)]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(dir.join("verl_score.py"), VERL_SCORE).unwrap();
    let config = format!(
        r#"
[run]
seed = 7
[model]
actor = "{model}"
[data]
prompts = "{data}"
label_key = "reward_model.ground_truth"
max_prompt_len = 64
[rollout]
prompts_per_batch = 4
samples_per_prompt = 4
max_new_tokens = 6
[train]
steps = 4
minibatch_size = 16
lr = 1e-4
[algorithm]
name = "grpo"
[[rewards]]
plugin = "reward-python"
name = "verl"
[rewards.config]
file = "{score}"
signature = "verl"
workers = 2
python = "{python}"
[checkpoint]
every = 2
keep = 3
[eval]
data = "{data}"
every_steps = 2
samples_per_prompt = 2
correct_if = "verl >= 1.0"
"#,
        model = s(&model_dir("llama")),
        data = s(&data),
        score = s(&dir.join("verl_score.py")),
        python = s(python),
    );
    let path = dir.join("verl.toml");
    std::fs::write(&path, config).unwrap();
    path
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn train(args: &[&str]) -> Output {
    Command::new(rlhf_bin())
        .arg("train")
        .args(["--no-progress"])
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

/// Metrics without timings (the pool's latency included).
fn behaviour(run: &Path) -> Vec<Map<String, Value>> {
    rlhf_integration_tests::behaviour_metrics(run)
        .into_iter()
        .map(|mut m| {
            m.retain(|k, _| !k.ends_with("latency_s"));
            m
        })
        .collect()
}

#[test]
fn verl_layout_and_compute_score_on_two_ranks_and_resumed() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let config = verl_setup(dir.path(), &python);
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    ok(&train(&["--config", s(&config), "--run-dir", s(&one)]));
    ok(&train(&["--config", s(&config), "--run-dir", s(&two), "--nproc", "2"]));

    let m = metrics(&one);
    let steps: Vec<&Value> = m.iter().filter(|l| l["step"] != 0).collect();
    assert_eq!(steps.len(), 4);
    let prefix = "reward_python/verl_score.compute_score";
    for l in &steps {
        assert_eq!(l[format!("{prefix}/errors").as_str()], 0.0, "{l}");
        let bucket = l[format!("{prefix}/length_bucket").as_str()].as_f64().unwrap();
        assert!((0.0..=3.0).contains(&bucket), "{l}");
        assert_eq!(l["rewards/verl/skipped"], 0.0);
    }
    assert!(m.iter().any(|l| l.get("eval/pass@1").is_some()), "no held-out evaluation in {m:?}");
    for (a, b) in m.iter().zip(metrics(&two).iter()) {
        for k in ["reward", "rewards/verl/mean", "eval/pass@1", "completions/mean_length"] {
            assert_eq!(a.get(k), b.get(k), "step {}: `{k}` differs between 1 process and 2 ranks", a["step"]);
        }
    }

    let resumed = dir.path().join("resumed");
    copy_dir(&one, &resumed);
    std::fs::remove_dir_all(resumed.join("checkpoints/step-000004")).unwrap();
    std::fs::remove_dir_all(resumed.join("actor")).unwrap();
    ok(&train(&["--resume", s(&resumed.join("checkpoints/step-000002")), "--run-dir", s(&resumed)]));
    assert_eq!(behaviour(&one), behaviour(&resumed));
    let w = |d: &Path| std::fs::read(d.join("actor/model.safetensors")).unwrap();
    assert!(w(&one) == w(&resumed), "the resumed run's weights differ");
}

/// TRL's conversational format, checked from inside the reward function: prompts and completions
/// are message lists, every column arrives as a keyword, `solution` included.
const TRL_FUNC: &str = r#"
def reward_func(prompts, completions, completion_ids, solution, level, **kwargs):
    n = len(prompts)
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions), completions
    assert len(completion_ids) == len(solution) == len(level) == n and "label" in kwargs
    assert all(isinstance(s, str) and s.isdigit() for s in solution), solution
    return [None if lv == "skip" else float(s in c[0]["content"]) + 0.5 * (len(ids) % 2) for c, s, lv, ids in zip(completions, solution, level, completion_ids)]
"#;

#[test]
fn trl_conversational_jsonl_with_a_solution_column() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("train.jsonl");
    let mut lines = String::new();
    for (i, (a, b)) in [(1, 2), (3, 4), (2, 5), (6, 1)].iter().enumerate() {
        let level = if i == 3 { "skip" } else { "easy" };
        lines += &format!(
            "{{\"prompt\": [{{\"role\": \"user\", \"content\": \"{a} + {b} =\"}}], \"solution\": \"{}\", \"level\": \"{level}\"}}\n",
            a + b
        );
    }
    std::fs::write(&data, lines).unwrap();
    std::fs::write(dir.path().join("trl_reward.py"), TRL_FUNC).unwrap();
    let run = dir.path().join("run");
    let reward = format!(
        r#"rewards=[{{plugin = "reward-python", name = "trl", config = {{file = "{}", python = "{}"}}}}]"#,
        s(&dir.path().join("trl_reward.py")),
        s(&python)
    );
    let model = format!("model.actor=\"{}\"", s(&model_dir("llama")));
    let prompts = format!("data.prompts=\"{}\"", s(&data));
    let o = train(&[
        "--algo",
        "grpo",
        "--run-dir",
        s(&run),
        "--set",
        &model,
        "--set",
        &prompts,
        "--set",
        "data.label_key=\"solution\"",
        "--set",
        "eval.data=\"\"",
        "--set",
        "warmup.steps=0",
        "--set",
        "train.steps=2",
        "--set",
        "rollout.prompts_per_batch=4",
        "--set",
        "rollout.samples_per_prompt=2",
        "--set",
        "data.max_prompt_len=64",
        "--set",
        &reward,
    ]);
    ok(&o);
    let m = metrics(&run);
    let last = m.last().unwrap();
    // One prompt in four is `None` (scored 0.0, TRL's nansum), 2 samples each.
    assert_eq!(last["reward_python/trl_reward.reward_func/none"], 2.0, "{last}");
    assert_eq!(last["rewards/trl/skipped"], 0.0);
}

/// With an environment (`environment.reward = "sum"`), the Python function scores the whole
/// trajectory text (tool results included) beside the environment's own reward.
const TRAJECTORY_FUNC: &str = r#"
def reward_func(completions, **kwargs):
    return [0.5 if "<result>" in c else 0.0 for c in completions]
"#;

#[test]
fn scores_multi_turn_episodes_beside_the_environment() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("traj.py"), TRAJECTORY_FUNC).unwrap();
    let run = dir.path().join("run");
    let preset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-calculator.toml");
    let reward = format!(
        r#"rewards=[{{plugin = "reward-python", name = "py", config = {{file = "{}", python = "{}", conversational = false}}}}]"#,
        s(&dir.path().join("traj.py")),
        s(&python)
    );
    let o = train(&[
        "--config",
        s(&preset),
        "--run-dir",
        s(&run),
        "--set",
        "train.steps=2",
        "--set",
        "warmup.steps=0",
        "--set",
        "eval.data=\"\"",
        "--set",
        "environment.reward=\"sum\"",
        "--set",
        &reward,
    ]);
    ok(&o);
    for l in metrics(&run).iter().filter(|l| l["step"] != 0) {
        let mean = l["rewards/py/mean"].as_f64().unwrap();
        assert!((0.0..=0.5).contains(&mean) && l.get("env/turns/mean").is_some(), "{l}");
        assert_eq!(l["reward_python/traj.reward_func/errors"], 0.0, "{l}");
    }
}
