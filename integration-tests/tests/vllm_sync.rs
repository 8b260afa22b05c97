//! Weight sync to vLLM servers against a mock server: the host writes a version, the server is
//! told to load it and to drop its prefix cache, and the server must confirm it with a probe
//! token's log-prob equal to the trainer's; a server that answers every call but still serves
//! the old policy (its probe log-prob is the old one) is an error naming it. Old versions are
//! pruned. The behaviour log-probs a step gets from the engine reach the metrics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::Uri;
use axum::response::IntoResponse;
use axum::Router;
use rlhf_generation::{token_logprobs, LogProbOptions};
use rlhf_models::CausalLm;
use rlhf_trainer::config::VllmConfig;
use rlhf_trainer::rl::engine::client::VllmClient;
use rlhf_trainer::rl::engine::sync::Weights;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// What the mock answers the probe with, and the calls it saw.
#[derive(Default)]
struct Mock {
    probe_logprob: f64,
    probe_token: u32,
    calls: Vec<String>,
    loaded: Vec<String>,
    /// Weight loads and rollout requests, in order.
    events: Vec<&'static str>,
    /// Whether the server keeps its output head tied (vLLM's reload then leaves it stale): the
    /// canary version's zero head then changes nothing.
    tied_head: bool,
    /// While the canary version is loaded: the probe's log-prob under its zero head, `-ln V`.
    canary: Option<f64>,
    canaries: usize,
}

async fn handle(State(m): State<Arc<Mutex<Mock>>>, uri: Uri, body: Bytes) -> axum::response::Response {
    let mut m = m.lock().unwrap();
    let path = uri.path().to_string();
    m.calls.push(path.clone());
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = match path.as_str() {
        "/collective_rpc" => {
            let path = req["kwargs"]["weights_path"].as_str().unwrap_or("").to_string();
            m.canary = rlhf_integration_tests::canary_logprob(&path).filter(|_| !m.tied_head);
            if path.ends_with("/canary") {
                m.canaries += 1;
            } else {
                m.loaded.push(path);
                m.events.push("load");
            }
            json!({"results": [null]})
        }
        "/reset_prefix_cache" => json!({"success": true}),
        "/reset_mm_cache" | "/reset_encoder_cache" => return axum::http::StatusCode::OK.into_response(),
        "/v1/completions" if req["max_tokens"] == 1 => json!({"choices": [{
            "index": 0, "text": "x", "finish_reason": "length", "token_ids": [m.probe_token],
            "logprobs": {"token_logprobs": [m.canary.unwrap_or(m.probe_logprob)], "tokens": ["x"], "top_logprobs": [], "text_offset": [0]}
        }]}),
        // A rollout: every sample of every prompt answers "5 <eos>" at log-prob -2 per token.
        "/v1/completions" => {
            m.events.push("rollout");
            let n = req["n"].as_u64().unwrap_or(1) * req["prompt"].as_array().map_or(0, |p| p.len() as u64);
            let choices: Vec<Value> = (0..n)
                .map(|i| json!({"index": i, "text": "5", "finish_reason": "stop", "token_ids": [9, 1],
                    "logprobs": {"token_logprobs": [-2.0, -2.0], "tokens": ["5", "<eos>"], "top_logprobs": [], "text_offset": [0, 1]}}))
                .collect();
            json!({ "choices": choices })
        }
        _ => return (axum::http::StatusCode::NOT_FOUND, "no such path").into_response(),
    };
    axum::Json(reply).into_response()
}

/// A mock server on 127.0.0.1:0 and its state.
fn serve() -> (String, Arc<Mutex<Mock>>) {
    let state = Arc::new(Mutex::new(Mock::default()));
    let app = Router::new().fallback(handle).with_state(Arc::clone(&state));
    (format!("http://{}", rlhf_integration_tests::serve_in_background(app)), state)
}

fn trainer_logprob(actor: &CausalLm, probe: &[u32], token: u32) -> f64 {
    let ids: Vec<i64> = probe.iter().chain([&token]).map(|&t| i64::from(t)).collect();
    let seq = Tensor::from_slice(&ids).view([1, -1]);
    let attn = seq.ones_like().to_kind(Kind::Int64);
    let opts = LogProbOptions { entropy: false, ..LogProbOptions::default() };
    let lp = tch::no_grad(|| token_logprobs(actor, &seq, &attn, probe.len() as i64, opts)).unwrap();
    lp.logprobs.double_value(&[0, 0])
}

#[test]
fn a_server_must_confirm_each_version_and_old_versions_are_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    rlhf_trainer::builtin_models::write_tiny_model(&model_dir, 7).unwrap();
    let actor = CausalLm::from_dir(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let (url, mock) = serve();
    let cfg = VllmConfig { urls: vec![url.clone()], keep_versions: 2, ..VllmConfig::default() };
    let run_dir = dir.path().join("run");
    let weights = Weights::new(&run_dir, &cfg);
    let client = VllmClient::new(&url, Duration::from_secs(10), 0).unwrap();
    let probe = [3u32, 4, 5];
    let ours = trainer_logprob(&actor, &probe, 6);
    {
        let mut m = mock.lock().unwrap();
        (m.probe_token, m.probe_logprob) = (6, ours + 1e-5);
    }
    for version in 1..=3 {
        weights.push(&actor, version, &probe, std::slice::from_ref(&client)).unwrap();
    }
    let m = mock.lock().unwrap().calls.clone();
    assert_eq!(&m[..3], ["/collective_rpc", "/reset_prefix_cache", "/v1/completions"], "{m:?}");
    let loaded = mock.lock().unwrap().loaded.clone();
    assert_eq!(loaded.len(), 3);
    assert!(loaded[2].ends_with("rollout-weights/v000003"), "{loaded:?}");
    let mut kept: Vec<String> = std::fs::read_dir(run_dir.join("rollout-weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, ["v000002", "v000003"], "only the newest keep_versions remain");
    assert!(run_dir.join("rollout-weights/v000003/model.safetensors").is_file());
    // The built-in model ties its head to the embeddings: every version also holds the head, untied,
    // and the first sync checked once that the server's head is untied (the canary, then gone).
    let v3 = run_dir.join("rollout-weights/v000003");
    let head = Tensor::read_safetensors(v3.join("lm_head.safetensors")).unwrap();
    let embed = Tensor::read_safetensors(v3.join("model.safetensors")).unwrap();
    let embed = &embed.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1;
    assert_eq!(head[0].0, "lm_head.weight");
    assert!(head[0].1.equal(embed));
    let config: Value = serde_json::from_str(&std::fs::read_to_string(v3.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], json!(false));
    assert_eq!(mock.lock().unwrap().canaries, 1);
    assert!(!run_dir.join("rollout-weights/canary").exists());

    // The server acknowledges the reload but keeps serving another policy.
    mock.lock().unwrap().probe_logprob = ours - 0.5;
    let e = weights.push(&actor, 4, &probe, std::slice::from_ref(&client)).unwrap_err().to_string();
    assert!(e.contains(&format!("{url} did not take weight version 4")) && e.contains("sync_tolerance"), "{e}");
    assert!(!e.contains('\n'), "{e}");

    // A server started on the tied checkpoint: its head ignores the canary's zeros, and the first
    // sync stops, saying what to do.
    mock.lock().unwrap().tied_head = true;
    let e = Weights::new(&dir.path().join("run2"), &cfg)
        .push(&actor, 1, &probe, std::slice::from_ref(&client))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("{url} serves the policy with its output head tied")) && e.contains("untied"), "{e}");
}

/// A model with a vision tower: after the reload (the whole model, tower included) the server also
/// drops its cached image encodings, which vLLM's reload leaves recorded in its scheduler.
#[test]
fn a_vision_language_version_drops_the_servers_image_caches() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    rlhf_trainer::builtin_vl::write_model(&model_dir, 7).unwrap();
    let actor = CausalLm::from_dir(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let (url, mock) = serve();
    let cfg = VllmConfig { urls: vec![url.clone()], ..VllmConfig::default() };
    let run_dir = dir.path().join("run");
    let client = VllmClient::new(&url, Duration::from_secs(10), 0).unwrap();
    let probe = [7u32, 8, 9];
    let ours = trainer_logprob(&actor, &probe, 10);
    {
        let mut m = mock.lock().unwrap();
        (m.probe_token, m.probe_logprob) = (10, ours);
    }
    Weights::new(&run_dir, &cfg).push(&actor, 1, &probe, std::slice::from_ref(&client)).unwrap();
    let calls = mock.lock().unwrap().calls.clone();
    let want = ["/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/v1/completions"];
    assert_eq!(calls, [want, want].concat(), "the canary of the tied head, then the version");
    let saved = Tensor::read_safetensors(run_dir.join("rollout-weights/v000001/model.safetensors")).unwrap();
    assert!(saved.iter().any(|(n, _)| n.starts_with("visual.")), "the tower is synced too");
}

#[test]
fn a_lora_version_is_a_peft_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    rlhf_trainer::builtin_models::write_tiny_model(&model_dir, 7).unwrap();
    let mut actor = CausalLm::from_dir(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let lora = rlhf_models::LoraConfig { rank: 2, alpha: 8.0, ..Default::default() };
    assert!(actor.apply_lora(&lora).unwrap() > 0);
    let out = dir.path().join("adapter");
    actor.save_lora_adapter(&out).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["peft_type"].as_str(), config["r"].as_i64(), config["lora_alpha"].as_f64()),
        (Some("LORA"), Some(2), Some(8.0))
    );
    assert_eq!(config["target_modules"], json!(["q_proj", "v_proj"]));
    let tensors = Tensor::read_safetensors(out.join("adapter_model.safetensors")).unwrap();
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), "{names:?}");
    let a = tensors.iter().find(|(n, _)| n.ends_with("layers.0.self_attn.q_proj.lora_A.weight")).unwrap();
    assert_eq!(a.1.size()[0], 2);
    // A model without adapters has nothing to export.
    let plain = CausalLm::from_dir(&model_dir, Device::Cpu, Kind::Float).unwrap();
    assert!(plain.save_lora_adapter(&dir.path().join("none")).unwrap_err().to_string().contains("no LoRA adapters"));
}

/// A run on the vLLM engine (a mock one): the policy of each optimizer step is pushed before the
/// step samples, the engine's log-probs reach the importance-sampling metrics and correction.
#[test]
fn a_run_on_the_vllm_engine_syncs_each_step_and_corrects_for_the_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let (url, mock) = serve();
    let rd = dir.path().join("run");
    let out = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["train", "--algo", "grpo", "--run-dir", rd.to_str().unwrap()])
        .args(["--set", "train.steps=2", "--set", "rollout.engine=\"vllm\""])
        .args(["--set", &format!("rollout.vllm.urls=[\"{url}\"]")])
        // The mock cannot compute the policy's log-prob of the probe.
        .args(["--set", "rollout.vllm.sync_tolerance=1e9", "--set", "rollout.is_correction.mode=\"token_mask\""])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let rows = rlhf_integration_tests::metrics(&rd);
    // The preset's held-out evaluation ran on the engine, synced first: before training (row 0,
    // version 0) and after the last step (version 4). Every held-out answer is the mock's.
    for r in [&rows[0], &rows[2]] {
        assert_eq!(r["eval/length/mean"].as_f64(), Some(2.0), "{r}");
        assert!(r["eval/sync_s"].is_number() && r["eval/pass@1"].is_number(), "{r}");
    }
    let answers = std::fs::read_to_string(rd.join("eval/step-2.jsonl")).unwrap();
    assert_eq!(answers.lines().count(), 11);
    for line in answers.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        for c in v["completions"].as_array().unwrap() {
            assert_eq!(c["ids"], json!([9, 1]), "{line}");
        }
    }
    let rows: Vec<Value> = rows.into_iter().filter(|r| r["step"] != 0).collect();
    assert_eq!(rows.len(), 2);
    // The version is the optimizer steps taken: 2 per generation batch (128 samples, minibatches of 64).
    for (k, r) in rows.iter().enumerate() {
        assert_eq!(r["rollout/weights_version"].as_f64(), Some(2.0 * k as f64), "{r}");
        assert_eq!(r["completions/mean_length"].as_f64(), Some(2.0), "{r}");
        for key in ["is/ratio_mean", "is/logprob_diff_max", "is/masked_fraction"] {
            assert!(r[key].as_f64().is_some_and(f64::is_finite), "{key}: {r}");
        }
    }
    // Version 0 (the evaluation before training; step 1 finds it served), 2 (step 2), 4 (the
    // evaluation at the end).
    let loaded = mock.lock().unwrap().loaded.clone();
    assert_eq!(loaded.len(), 3, "{loaded:?}");
    for (v, l) in [0, 2, 4].iter().zip(&loaded) {
        assert!(l.ends_with(&format!("rollout-weights/v{v:06}")), "{loaded:?}");
    }

    // On 2 data-parallel ranks rank 0 alone pushes each version; both ranks sample from the server.
    let rd2 = dir.path().join("run2");
    let before = mock.lock().unwrap().calls.iter().filter(|c| *c == "/v1/completions").count();
    let out = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["train", "--algo", "grpo", "--nproc", "2", "--run-dir", rd2.to_str().unwrap()])
        .args(["--set", "train.steps=2", "--set", "rollout.engine=\"vllm\""])
        .args(["--set", &format!("rollout.vllm.urls=[\"{url}\"]"), "--set", "rollout.vllm.sync_tolerance=1e9"])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = mock.lock().unwrap();
    assert_eq!(m.loaded.len(), 6, "one reload per version, from rank 0 only: {:?}", m.loaded);
    let completions = m.calls.iter().filter(|c| *c == "/v1/completions").count() - before;
    // Per sync rank 0's probe (versions 0, 2 and 4; and the canary of the tied head once), and one
    // request from each rank per training step and per evaluation (the 11 held-out prompts are one
    // chunk, shared by the ranks).
    assert_eq!(completions, 1 + 3 + 2 * 2 + 2 * 2, "{:?}", m.calls);
}

/// Asynchronous rollouts on vLLM (`max_staleness = 1`): the next step's batch goes to the servers
/// right after this step's came back and the servers were synced to the current policy, so they
/// sample it while the step trains; its samples carry that policy's version.
#[test]
fn a_one_step_stale_run_sends_the_next_batch_after_each_sync() {
    let dir = tempfile::tempdir().unwrap();
    let (url, mock) = serve();
    let rd = dir.path().join("run");
    let out = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
        .args(["train", "--algo", "grpo", "--run-dir", rd.to_str().unwrap(), "--set", "eval.data=\"\""])
        .args(["--set", "train.steps=3", "--set", "rollout.engine=\"vllm\"", "--set", "rollout.max_staleness=1"])
        .args(["--set", &format!("rollout.vllm.urls=[\"{url}\"]"), "--set", "rollout.vllm.sync_tolerance=1e9"])
        .args(["--set", "rollout.is_correction.mode=\"token_truncate\""])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows = rlhf_integration_tests::metrics(&rd);
    let versions: Vec<f64> = rows.iter().map(|r| r["rollout/policy_version"].as_f64().unwrap()).collect();
    assert_eq!(versions, [0.0, 0.0, 1.0]);
    for r in &rows {
        assert!(r["rollout/staleness"].as_f64().unwrap() <= 1.0, "{r}");
        assert!(r["is/ratio_mean"].as_f64().is_some_and(f64::is_finite), "{r}");
    }
    // Version 0, batches 1 and 2 (2 sampled by version 0 while step 1 trained), version 2 (after
    // step 1's two optimizer steps), batch 3; the last step sends nothing more.
    let m = mock.lock().unwrap();
    assert_eq!(m.events, ["load", "rollout", "rollout", "load", "rollout"], "{:?}", m.calls);
    assert!(m.loaded[1].ends_with("rollout-weights/v000002"), "{:?}", m.loaded);
}
