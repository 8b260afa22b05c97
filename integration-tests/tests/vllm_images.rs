//! Prompts with images on the vLLM engine, against a mock server that replays what a real vLLM
//! 0.32 answered (`fixtures/vllm/generate_image.json` and the others `record.py vl` and
//! `record.py disabled` wrote): the client sends exactly the recorded generate request — the
//! prompt with its image's placeholder run collapsed to one token, the image as a data URL of the
//! file's own bytes — and reads the recorded answer; a server without `--enable-scale-out` is an
//! error that says so; the engine sends each prompt with its own images and stops on a server
//! whose expansion of a prompt is not the trainer's, naming the prompt and its images; a weight
//! sync of a model with a vision tower drops the server's cached image encodings.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;
use rlhf_trainer::config::VllmConfig;
use rlhf_trainer::rl::engine::client::{Sampling, VllmClient};
use rlhf_trainer::rl::engine::vllm::VllmEngine;
use rlhf_vision::ImageRef;
use serde_json::{json, Value};

/// The image placeholder of the recordings' model (the built-in visual task's vocabulary).
const PAD: u32 = 5;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vllm").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// How the mock answers a generate request: the recorded answer, or vLLM's 403 without
/// `--enable-scale-out`; `grid` placeholder tokens per image in the prompt it answers with.
#[derive(Clone, Copy)]
enum Mode {
    Replay { grid: usize },
    Disabled,
}

struct Mock {
    mode: Mode,
    /// (path, request body) of every call.
    calls: Vec<(String, Value)>,
}

async fn handle(State(m): State<Arc<Mutex<Mock>>>, uri: Uri, body: Bytes) -> axum::response::Response {
    let mut m = m.lock().unwrap();
    let path = uri.path().to_string();
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    m.calls.push((path.clone(), req.clone()));
    match (path.as_str(), m.mode) {
        ("/inference/v1/generate", Mode::Disabled) => {
            let f = fixture("error_generate_scale_out_disabled");
            (StatusCode::FORBIDDEN, axum::Json(f["response"].clone())).into_response()
        }
        ("/inference/v1/generate", Mode::Replay { grid }) => {
            // The recorded answer, its prompt as vLLM expands this request's: `grid` ids per
            // placeholder, and as many choices as asked.
            let mut answer = fixture("generate_image")["response"].clone();
            let expanded: Vec<u64> = req["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|t| vec![t.as_u64().unwrap(); if t.as_u64() == Some(u64::from(PAD)) { grid } else { 1 }])
                .collect();
            answer["prompt_token_ids"] = json!(expanded);
            let n = req["sampling_params"]["n"].as_u64().unwrap() as usize;
            let first = answer["choices"][0].clone();
            let choice = |i: usize| {
                let mut c = first.clone();
                c["index"] = json!(i);
                c
            };
            answer["choices"] = (0..n).map(choice).collect();
            axum::Json(answer).into_response()
        }
        ("/reset_mm_cache" | "/reset_encoder_cache", _) => StatusCode::OK.into_response(),
        _ => (StatusCode::NOT_FOUND, "no such path").into_response(),
    }
}

/// A mock server on 127.0.0.1:0 and its state.
fn serve(mode: Mode) -> (String, Arc<Mutex<Mock>>) {
    let state = Arc::new(Mutex::new(Mock { mode, calls: Vec::new() }));
    let app = Router::new().fallback(handle).with_state(Arc::clone(&state));
    (format!("http://{}", rlhf_integration_tests::serve_in_background(app)), state)
}

/// The recorded request's image, as the dataset would hold it (encoded bytes).
fn recorded_image(request: &Value) -> ImageRef {
    let url = request["content_parts"][0]["url"].as_str().unwrap();
    let b64 = url.strip_prefix("data:image/png;base64,").unwrap();
    ImageRef::Bytes { name: "row 0 image 0".into(), bytes: rlhf_vision::prompt::decode_base64(b64).unwrap().into() }
}

fn sampling_of(request: &Value) -> Sampling {
    let s = &request["sampling_params"];
    Sampling {
        max_tokens: s["max_tokens"].as_i64().unwrap(),
        temperature: s["temperature"].as_f64().unwrap(),
        top_p: s["top_p"].as_f64().unwrap(),
        top_k: 0,
        stop_token_ids: vec![1],
        stop: Vec::new(),
        seed: s["seed"].as_u64(),
    }
}

#[test]
fn a_prompt_with_an_image_is_requested_and_read_as_recorded() {
    let f = fixture("generate_image");
    let request = &f["request"];
    let (url, mock) = serve(Mode::Replay { grid: 4 });
    let client = VllmClient::new(&url, Duration::from_secs(10), 0).unwrap();
    let ids: Vec<u32> = serde_json::from_value(request["token_ids"].clone()).unwrap();
    let (got, prompt) = client.generate("policy", &ids, &[recorded_image(request)], 2, &sampling_of(request)).unwrap();
    // The client sends exactly what was recorded against the real server.
    assert_eq!(mock.lock().unwrap().calls[0].1, *request);
    // What the server answered: the prompt with the 56 × 56 image's 4 placeholder ids, and the
    // sampled ids with their log-probs.
    assert_eq!(
        prompt,
        f["response"]["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    );
    assert_eq!(prompt.iter().filter(|&&t| t == PAD).count(), 4);
    let first = &f["response"]["choices"][0];
    let want_ids: Vec<u32> = serde_json::from_value(first["token_ids"].clone()).unwrap();
    assert_eq!(got[0].token_ids, want_ids);
    assert_eq!(got[0].logprobs[0], first["logprobs"]["content"][0]["logprob"].as_f64().unwrap());
    assert!(got.iter().all(|c| c.logprobs.len() == c.token_ids.len() && c.logprobs.iter().all(|l| *l <= 0.0)));
}

#[test]
fn a_server_without_scale_out_is_an_error_that_says_so() {
    let f = fixture("error_generate_scale_out_disabled");
    assert_eq!(f["status"], 403);
    let (url, mock) = serve(Mode::Disabled);
    let client = VllmClient::new(&url, Duration::from_secs(10), 2).unwrap();
    let image = recorded_image(&f["request"]);
    let e =
        client.generate("policy", &[3, PAD, 4, 12], &[image], 1, &sampling_of(&fixture("generate_image")["request"]));
    let e = e.unwrap_err().to_string();
    assert!(e.contains("HTTP 403") && e.contains("--enable-scale-out"), "{e}");
    assert_eq!(mock.lock().unwrap().calls.len(), 1, "a 4xx is not retried");
}

/// Two prompts with images and a text prompt, over two servers: each request carries its own
/// prompt's images; a server that expands an image to another number of ids stops the step.
#[test]
fn the_engine_sends_each_prompt_with_its_images_and_checks_the_servers_expansion() {
    let request = fixture("generate_image")["request"].clone();
    let image = recorded_image(&request);
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, PAD, PAD, PAD, PAD, 4, 12],
        vec![9, 9],
        vec![3, PAD, PAD, PAD, PAD, 4, 3, PAD, PAD, PAD, PAD, 4, 20],
    ];
    let images: Vec<Vec<ImageRef>> = vec![vec![image.clone()], vec![], vec![image.clone(), image.clone()]];
    let images: Vec<&[ImageRef]> = images.iter().map(Vec::as_slice).collect();
    let run = tempfile::tempdir().unwrap();
    let servers = [serve(Mode::Replay { grid: 4 }), serve(Mode::Replay { grid: 4 })];
    let cfg = VllmConfig { urls: servers.iter().map(|s| s.0.clone()).collect(), ..VllmConfig::default() };
    let engine = VllmEngine::new(&cfg, run.path()).unwrap();
    let s = sampling_of(&request);
    let got = engine.generate(&prompts, &images, PAD, 3, &s).unwrap();
    assert_eq!(got.len(), 9, "3 samples of each prompt, in prompt order");
    // Each server sends its prompts at once, so in any order.
    let mut sent: Vec<(Vec<u64>, usize)> = servers
        .iter()
        .flat_map(|(_, m)| m.lock().unwrap().calls.clone())
        .map(|(_, r)| {
            let ids = r["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
            (ids, r["content_parts"].as_array().map_or(0, Vec::len))
        })
        .collect();
    sent.sort();
    assert_eq!(sent, vec![(vec![3, 5, 4, 3, 5, 4, 20], 2), (vec![3, 5, 4, 12], 1), (vec![9, 9], 0)]);
    assert!(servers.iter().all(|(_, m)| !m.lock().unwrap().calls.is_empty()), "both servers take prompts");

    // A server whose processor patches the image to 9 ids instead of 4.
    let (url, _) = serve(Mode::Replay { grid: 9 });
    let cfg = VllmConfig { urls: vec![url.clone()], ..VllmConfig::default() };
    let e = VllmEngine::new(&cfg, run.path()).unwrap().generate(&prompts, &images, PAD, 1, &s).unwrap_err().to_string();
    assert!(
        e.contains(&format!("rollout.vllm: {url}: prompt 0 (images row 0 image 0)"))
            && e.contains("the server's prompt has 12 ids where the trainer's has 7")
            && e.contains("preprocessor_config.json"),
        "{e}"
    );
    // A prompt with fewer placeholder runs than images.
    let e = engine.generate(&prompts[1..2], &images[..1], PAD, 1, &s).unwrap_err().to_string();
    assert!(e.contains("prompt 0: 0 image placeholder run(s) for 1 image(s)"), "{e}");
}
