//! GRPO on prompts with images, with the tiny random Qwen2.5-VL of `fixtures/make_vl.py` and its
//! three prompt rows (one image; two images in chat content parts; text alone): the run trains,
//! every pass over a row sees that row's images — the minibatches' fresh log-probs equal the old
//! policy's (an importance ratio off by 1e-4 would be clipped), also after 2 ranks gathered the
//! batch —, the reward function receives each row's image paths as the `images` column (as TRL
//! passes dataset columns), 2 ranks sample what one process samples, the vision tower stays as
//! loaded unless `model.freeze_vision = false`, ZeRO stage 3 gathers the tower for its passes, a
//! resumed run continues bit for bit, `rlhf eval` reads the rows with their images, multi-turn
//! episodes sample every turn with them, and what is not supported yet is refused by name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rlhf_integration_tests::{metrics, python, rlhf, vl_fixture};
use tch::Tensor;

/// Writes the run's config and reward function into `dir`; returns the config's path.
fn setup(dir: &Path) -> PathBuf {
    let fx = vl_fixture();
    let seen = dir.join("seen.jsonl");
    let reward = dir.join("reward.py");
    // The completion's length as the reward (the samples differ, so the groups' advantages do),
    // and every call's `images` column logged.
    std::fs::write(
        &reward,
        format!(
            "import json\n\ndef reward_func(completions, images=None, **kwargs):\n    with open({seen:?}, 'a') as f:\n        \
             f.write(json.dumps(images) + '\\n')\n    return [float(len(str(c))) for c in completions]\n",
            seen = seen.display().to_string()
        ),
    )
    .unwrap();
    let config = format!(
        r#"
[run]
seed = 7
device = "cpu"
dtype = "f32"

[model]
actor = "{model}"

[data]
prompts = "{prompts}"
max_prompt_len = 256

[rollout]
prompts_per_batch = 3
samples_per_prompt = 2
max_new_tokens = 4
temperature = 1.0

[train]
steps = 2
ppo_epochs = 1
minibatch_size = 2
gradient_accumulation_steps = 3
lr = 1e-3

[algorithm]
name = "grpo"

[algorithm.config]
beta = 0.04
epsilon = 1e-4

[[rewards]]
plugin = "reward-python"
name = "length"

[rewards.config]
file = "{reward}"
workers = 1
"#,
        model = fx.join("model").display(),
        prompts = fx.join("prompts.jsonl").display(),
        reward = reward.display(),
    );
    let path = dir.join("grpo-vl.toml");
    std::fs::write(&path, config).unwrap();
    path
}

fn train(config: &Path, run: &Path, extra: &[&str]) -> std::process::Output {
    let args = ["train", "--config", config.to_str().unwrap(), "--run-dir", run.to_str().unwrap(), "--no-progress"];
    rlhf(&[&args[..], extra].concat())
}

fn trained(config: &Path, run: &Path, extra: &[&str]) -> Vec<serde_json::Value> {
    let out = train(config, run, extra);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    metrics(run).into_iter().filter(|l| l["step"] != 0).collect()
}

fn weights(dir: &Path) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            out.extend(Tensor::read_safetensors(&p).unwrap());
        }
    }
    out
}

/// Whether every tensor whose name starts with `prefix` is the same in both.
fn same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, prefix: &str) -> bool {
    let names: Vec<&String> = a.keys().filter(|k| k.starts_with(prefix)).collect();
    assert!(!names.is_empty(), "no tensor named {prefix}*");
    names.iter().all(|k| a[*k].equal(&b[*k]))
}

fn value(line: &serde_json::Value, key: &str) -> f64 {
    line[key].as_f64().unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn grpo_trains_on_prompts_with_images_on_one_process_and_two_ranks() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let one = trained(&config, &dir.path().join("one"), &["--set", "checkpoint.every=1"]);
    assert_eq!(one.len(), 2);
    for l in &one {
        // Three shuffled micro-batches of two rows, one optimizer step: every fresh pass saw its
        // rows' images (their log-probs are the old ones).
        assert_eq!(value(l, "clip_ratio/low_mean") + value(l, "clip_ratio/high_mean"), 0.0, "{l}");
        assert!(value(l, "approx_kl").abs() < 1e-9, "{l}");
        assert!(value(l, "loss/total").is_finite());
    }
    assert_eq!(value(&one[0], "kl"), 0.0);

    // The reward function got each row's images by path (none for the text row).
    let fx = vl_fixture();
    let img = |n: &str| serde_json::json!(fx.join("images").join(n).display().to_string());
    let calls = std::fs::read_to_string(dir.path().join("seen.jsonl")).unwrap();
    let mut seen: Vec<serde_json::Value> = Vec::new();
    for line in calls.lines() {
        seen.extend(serde_json::from_str::<Vec<serde_json::Value>>(line).unwrap());
    }
    assert_eq!(seen.len(), 12, "2 steps of 6 samples");
    for want in
        [serde_json::json!([img("a.png")]), serde_json::json!([img("b.png"), img("c.png")]), serde_json::Value::Null]
    {
        assert_eq!(seen.iter().filter(|s| **s == want).count(), 4, "{want} in {seen:?}");
    }

    // The frozen tower (the default) is saved as loaded; the language model trained.
    let (before, after) = (weights(&fx.join("model")), weights(&dir.path().join("one/actor")));
    assert!(same(&before, &after, "visual."));
    assert!(!same(&before, &after, "model.layers."));

    // `rlhf eval` of the trained actor reads the same rows, images included.
    let summary = dir.path().join("eval.json");
    let (actor, prompts) = (dir.path().join("one/actor"), fx.join("prompts.jsonl"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out =
        rlhf(&["eval", "--model", &s(&actor), "--config", &s(&config), "--data", &s(&prompts), "--out", &s(&summary)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(summary["metrics"]["eval/prompts"], 3.0, "{summary}");

    // Padding-free micro-batches of at most 64 tokens (about a row each: the image rows hold
    // their placeholders), for the experience passes and the minibatches: each pass picks its
    // rows' images, so the fresh log-probs are still the old ones, and the loss is one process's.
    let budget = ["--set", "train.padding_free=true", "--set", "train.micro_batch_tokens=64"];
    let split = trained(&config, &dir.path().join("split"), &budget);
    assert_eq!(one[0]["reward"], split[0]["reward"]);
    assert_eq!(value(&split[0], "clip_ratio/low_mean") + value(&split[0], "clip_ratio/high_mean"), 0.0);
    assert!(value(&split[0], "approx_kl").abs() < 1e-9, "{}", split[0]);
    let (a, b) = (value(&one[0], "loss/total"), value(&split[0], "loss/total"));
    assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "loss/total {a} whole, {b} in micro-batches");

    // 2 ranks: the same samples (rewards) at the first step, the same fresh log-probs as the old
    // ones after the gather, and the same loss as one process.
    let two = trained(&config, &dir.path().join("two"), &["--nproc", "2"]);
    assert_eq!(one[0]["reward"], two[0]["reward"]);
    assert_eq!(value(&two[0], "clip_ratio/low_mean") + value(&two[0], "clip_ratio/high_mean"), 0.0);
    let (a, b) = (value(&one[0], "loss/total"), value(&two[0], "loss/total"));
    assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "loss/total {a} on one process, {b} on 2 ranks");
    // At ZeRO stage 3 (the tower sharded with the embeddings, gathered for each pass; a rank whose
    // rows hold no image gathers it too).
    let three = trained(&config, &dir.path().join("three"), &["--nproc", "2", "--set", "distributed.zero_stage=3"]);
    assert_eq!(one[0]["reward"], three[0]["reward"]);
    assert_eq!(value(&three[0], "clip_ratio/low_mean") + value(&three[0], "clip_ratio/high_mean"), 0.0);
    let c = value(&three[0], "loss/total");
    assert!((a - c).abs() <= 1e-5 * a.abs().max(1.0), "loss/total {a} on one process, {c} at ZeRO stage 3");

    // Resumed from the checkpoint of step 1, the run ends with the same weights and metrics.
    let (run, res) = (dir.path().join("one"), dir.path().join("resumed"));
    rlhf_integration_tests::copy_dir(&run, &res);
    std::fs::remove_dir_all(res.join("checkpoints/step-000002")).unwrap();
    std::fs::remove_dir_all(res.join("actor")).unwrap();
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: Vec<&str> = text.lines().filter(|l| !l.contains("\"step\":2")).collect();
    std::fs::write(res.join("metrics.jsonl"), first.join("\n") + "\n").unwrap();
    let out = rlhf(&["train", "--no-progress", "--resume", res.join("checkpoints/step-000001").to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let w = |r: &Path| std::fs::read(r.join("actor/model.safetensors")).unwrap();
    assert!(w(&run) == w(&res), "the resumed run's actor differs");
    let last = |r: &Path| metrics(r).pop().unwrap();
    for key in ["reward", "loss/total", "kl", "entropy"] {
        assert_eq!(last(&run)[key], last(&res)[key], "{key}");
    }
}

#[test]
fn the_vision_tower_trains_when_asked_and_unsupported_runs_are_refused() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let ppo = dir.path().join("ppo.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &ppo,
        text.replace("name = \"grpo\"\n\n[algorithm.config]\nbeta = 0.04\nepsilon = 1e-4", "name = \"ppo\""),
    )
    .unwrap();
    let run = dir.path().join("tower");
    trained(&config, &run, &["--set", "model.freeze_vision=false", "--set", "train.steps=1"]);
    let (before, after) = (weights(&vl_fixture().join("model")), weights(&run.join("actor")));
    assert!(!same(&before, &after, "visual."), "the tower did not train");

    // PPO: the critic (made from the actor's checkpoint, its tower with it) reads the rows' images
    // in the experience pass and in every minibatch: their values are the same (a value off by
    // 1e-6 would be clipped).
    let critic_run = dir.path().join("ppo");
    for l in trained(&ppo, &critic_run, &["--set", "algorithm.config.cliprange_value=1e-6"]) {
        assert_eq!(value(&l, "ppo/vf_clipfrac"), 0.0, "{l}");
        assert!(value(&l, "loss/value").is_finite() && value(&l, "ppo/values_mean").is_finite(), "{l}");
    }

    let text_critic = rlhf_integration_tests::model_dir("llama-rm").display().to_string();
    let text_critic_set = format!("model.critic={text_critic:?}");
    // Asynchronous rollouts: the generation worker samples with the rows' images, so its
    // behaviour log-probs are the trainer's old ones while both hold the same policy (step 1).
    let lines = trained(&config, &dir.path().join("async"), &["--set", "rollout.max_staleness=1"]);
    assert!(value(&lines[0], "is/logprob_diff_max") < 1e-4, "{}", lines[0]);
    assert_eq!(value(&lines[1], "rollout/staleness"), 1.0);

    let run = dir.path().join("refused");
    let out = train(&ppo, &run, &["--set", text_critic_set.as_str()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("reads no images") && e.contains("holds images"), "{e}");
    assert!(!run.join("metrics.jsonl").exists(), "a refused run wrote metrics");
}

/// Multi-turn episodes on prompts with images (the scripted environment: three turns, text
/// observations after each): every turn is sampled with the rows' images at their multimodal
/// positions and the text after them — the asynchronous worker's behaviour log-probs are the
/// trainer's old ones at step 1 (a turn sampled without the images, or with the text after them
/// at other positions, differs by far more) — and every fresh pass of a synchronous run equals
/// the old one; held-out evaluation runs its episodes on the same rows.
#[test]
fn multi_turn_episodes_sample_and_train_with_the_prompts_images() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let env = [
        "environment.plugin=\"env-script\"",
        "environment.reward=\"sum\"",
        "environment.max_turns=3",
        "environment.config={ turns = 3, observation = \" then look again:\" }",
    ];
    let sets: Vec<&str> = env.iter().flat_map(|e| ["--set", *e]).collect();
    // Held-out evaluation runs its episodes on the same rows, images included.
    let held_out = format!("eval.data={:?}", vl_fixture().join("prompts.jsonl").display().to_string());
    let lines = trained(&config, &dir.path().join("sync"), &[&sets[..], &["--set", &held_out]].concat());
    for l in &lines {
        assert!(value(l, "env/turns/mean") > 1.5, "{l}");
        assert_eq!(value(l, "clip_ratio/low_mean") + value(l, "clip_ratio/high_mean"), 0.0, "{l}");
        assert!(value(l, "approx_kl").abs() < 1e-9, "{l}");
    }
    let last = lines.last().unwrap();
    assert_eq!((value(last, "eval/env/episodes"), value(last, "eval/env/errors")), (3.0, 0.0), "{last}");
    let lines =
        trained(&config, &dir.path().join("async"), &[&sets[..], &["--set", "rollout.max_staleness=1"]].concat());
    assert!(value(&lines[0], "env/turns/mean") > 1.5, "{}", lines[0]);
    assert!(value(&lines[0], "is/logprob_diff_max") < 1e-4, "{}", lines[0]);
}

/// An environment's observations with images (`env-script` sends `c.png` with each observation,
/// as bytes, or named by its path): each observation's `<image>` marker becomes the image's run
/// of placeholders in the trajectory — context, not actions —, and every pass reads the image
/// there: every fresh pass of a synchronous run equals the old one, also on 2 ranks (which sample
/// what one process samples), and the asynchronous worker's behaviour log-probs are the trainer's
/// old ones — on text prompts too, whose turns keep their cache until an image comes.
#[test]
fn observations_with_images_are_read_where_their_markers_are() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let image = vl_fixture().join("images").join("c.png");
    let env = |by_path: bool| {
        format!(
            "environment.config={{ turns = 3, observation = \" look:<image> again:\", image = {:?}, image_path = {by_path} }}",
            image.display().to_string()
        )
    };
    let sets = |by_path: bool| -> Vec<String> {
        [
            "environment.plugin=\"env-script\"".to_string(),
            "environment.reward=\"sum\"".into(),
            "environment.max_turns=3".into(),
            "environment.max_total_tokens=64".into(),
            "run.save_rollouts=true".into(),
            env(by_path),
        ]
        .into_iter()
        .flat_map(|s| ["--set".to_string(), s])
        .collect()
    };
    let args = sets(false);
    let lines = trained(&config, &dir.path().join("sync"), &args.iter().map(String::as_str).collect::<Vec<_>>());
    for l in &lines {
        assert!(value(l, "env/turns/mean") > 1.5, "{l}");
        assert_eq!(value(l, "env/errors"), 0.0, "{l}");
        assert_eq!(value(l, "clip_ratio/low_mean") + value(l, "clip_ratio/high_mean"), 0.0, "{l}");
        assert!(value(l, "approx_kl").abs() < 1e-9, "{l}");
    }
    // `c.png` (60×50) is resized to 56×56: 4×4 patches, 2×2 merged tokens, between the vision
    // start and end tokens (400, 401) of the tiny vocabulary; image token 402.
    let run = [400u64, 402, 402, 402, 402, 401];
    let mut observed = 0;
    for r in std::fs::read_to_string(dir.path().join("sync/rollouts/step-1.jsonl")).unwrap().lines() {
        let r: serde_json::Value = serde_json::from_str(r).unwrap();
        let Some(traj) = r.get("trajectory_ids") else { continue };
        let ids: Vec<u64> = traj.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let act: Vec<u64> = r["action_mask"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let context: Vec<u64> = ids.iter().zip(&act).filter(|(_, &a)| a == 0).map(|(&t, _)| t).collect();
        let found = context.windows(run.len()).filter(|w| *w == run).count();
        assert!(found >= 1, "a multi-turn episode without its observation's image: {r}");
        observed += found;
    }
    assert!(observed >= 3, "{observed} observations with images");
    // 2 ranks: each trains on the gathered batch, the other rank's rows with their observations'
    // images (exchanged once per batch), and samples at step 1 what one process samples.
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let two = trained(&config, &dir.path().join("two"), &[&args[..], &["--nproc", "2"]].concat());
    for (x, y) in lines.iter().zip(&two) {
        assert_eq!(value(y, "env/errors"), 0.0, "{y}");
        assert_eq!(value(y, "clip_ratio/low_mean") + value(y, "clip_ratio/high_mean"), 0.0, "{y}");
        assert!(value(y, "approx_kl").abs() < 1e-9, "{y}");
        if x["step"] == 1 {
            for k in ["reward", "completions/mean_length", "env/turns/mean"] {
                assert_eq!(x[k], y[k], "step 1: `{k}` on 2 ranks");
            }
        }
    }
    let args = sets(true);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--set", "rollout.max_staleness=1"]);
    let lines = trained(&config, &dir.path().join("async"), &args);
    assert!(value(&lines[0], "env/turns/mean") > 1.5, "{}", lines[0]);
    assert_eq!(value(&lines[0], "env/errors"), 0.0, "{}", lines[0]);
    assert!(value(&lines[0], "is/logprob_diff_max") < 1e-4, "{}", lines[0]);
    // Text prompts: the turns reuse their cached keys and values until the first observation
    // brings an image, then prefill the context with it.
    let text = dir.path().join("text.jsonl");
    std::fs::write(&text, "{\"prompt\": \"Describe it.\"}\n{\"prompt\": \"What now?\"}\n{\"prompt\": \"Go on.\"}\n")
        .unwrap();
    let data = format!("data.prompts={:?}", text.display().to_string());
    args.extend(["--set", &data]);
    let lines = trained(&config, &dir.path().join("text"), &args);
    assert_eq!(value(&lines[0], "env/errors"), 0.0, "{}", lines[0]);
    assert!(value(&lines[0], "is/logprob_diff_max") < 1e-4, "{}", lines[0]);
}

/// `configs/grpo-vl.toml` (the built-in visual task on `builtin:tiny-qwen2.5-vl`) learns from the
/// images: the reward rises by 0.3 and held-out greedy accuracy ends at 0.4 or more, where the
/// questions alone allow 0.3 (the most frequent answer of each question; `builtin_shapes`' own
/// test bounds it by 0.35). Seeds 42–45 end at 0.40–0.71 on an AMD EPYC. 2 ranks sample what one
/// process samples over the first steps.
#[test]
fn the_visual_preset_learns_from_the_images() {
    let dir = tempfile::tempdir().unwrap();
    let preset = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-vl.toml");
    let one = trained(&preset, &dir.path().join("one"), &[]);
    let rewards: Vec<f64> = one.iter().filter(|l| l.get("reward").is_some()).map(|l| value(l, "reward")).collect();
    let k = rewards.len() / 10;
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&rewards[..k]), mean(&rewards[rewards.len() - k..]));
    println!("grpo-vl: reward first 10% {first:.3}, last 10% {last:.3}");
    assert!(last >= first + 0.3, "reward {first:.3} -> {last:.3}");
    let accuracy: Vec<f64> =
        metrics(&dir.path().join("one")).iter().filter_map(|l| l.get("eval/reward/accuracy")?.as_f64()).collect();
    println!("grpo-vl: held-out accuracy {accuracy:?}");
    assert!(accuracy[0] < 0.3 && *accuracy.last().unwrap() >= 0.4, "held-out accuracy {accuracy:?}");

    let two = trained(
        &preset,
        &dir.path().join("two"),
        &["--nproc", "2", "--set", "train.steps=5", "--set", "eval.data=\"\""],
    );
    let first_two: Vec<&serde_json::Value> = two.iter().map(|l| &l["reward"]).collect();
    let first_one: Vec<&serde_json::Value> =
        one.iter().filter(|l| l.get("reward").is_some()).take(5).map(|l| &l["reward"]).collect();
    assert_eq!(first_one, first_two, "2 ranks sample other tokens than one process");
}

/// `configs/grpo-qwen2.5-vl-geo3k.toml` (the Geometry3K recipe) runs as written on data in verl's
/// layout — chat prompts with `<image>` markers, the images' bytes, the answer under
/// `reward_model.ground_truth` — with only the model, the data and the sizes swapped for the tiny
/// fixture's.
#[test]
fn the_geometry3k_recipe_runs_on_data_in_verls_layout() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-qwen2.5-vl-geo3k.toml");
    let fx = vl_fixture();
    let (model, data) = (fx.join("model").display().to_string(), fx.join("prompts.parquet").display().to_string());
    let sets = [
        "run.device=\"cpu\"".to_string(),
        "run.dtype=\"f32\"".into(),
        format!("model.actor={model:?}"),
        format!("data.prompts={data:?}"),
        "eval.data=\"\"".into(),
        "train.steps=1".into(),
        "rollout.prompts_per_batch=3".into(),
        "rollout.max_new_tokens=4".into(),
        "train.minibatch_size=15".into(),
    ];
    let extra: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    let lines = trained(&recipe, &dir.path().join("run"), &extra);
    assert_eq!(lines.len(), 1);
    assert!(value(&lines[0], "loss/total").is_finite(), "{}", lines[0]);
}
