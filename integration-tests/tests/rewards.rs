//! Reward sources end to end: RL runs scored by `reward-http` against a live `rlhf serve-reward`, two
//! weighted reward sources in one run, the `reward-model` plugin scoring with what `rlhf rm` wrote,
//! and `serve-reward`'s answers to bad requests, its scores against [`RewardModelScorer`] and
//! transformers, and its refusals and clean shutdown.
//!
//! Every server is started on loopback with an OS-chosen port and killed by [`Server`]'s `Drop`,
//! also when an assertion fails. HTTP requests are written by hand over `TcpStream`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rlhf_generation::{generate, GenerateConfig};
use rlhf_integration_tests::{metrics, model_dir, read_json, rlhf_bin};
use rlhf_models::CausalLm;
use rlhf_reward::RewardModelScorer;
use rlhf_tokenizer::HfTokenizer;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// How long a server may take to print its address, and a request to be answered.
const TIMEOUT: Duration = Duration::from_secs(60);

fn plugin_so(name: &str) -> PathBuf {
    let p = rlhf_bin().parent().unwrap().join(format!("lib{}.so", name.replace('-', "_")));
    assert!(p.exists(), "{} not built: run `cargo xtask test` (it builds every plugin)", p.display());
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A running `rlhf serve-reward` on the fixture reward model; killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `rlhf serve-reward --model llama-rm ARGS` and waits for its `listening on` line.
    fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let stderr = dir.path().join("stderr.log");
        let mut cmd = Command::new(rlhf_bin());
        cmd.args(["serve-reward", "--model", s(&model_dir("llama-rm"))])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn rlhf serve-reward");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut server = Server { child, addr: "127.0.0.1:0".parse().unwrap(), stderr, _dir: dir };
        let line = rx.recv_timeout(TIMEOUT).unwrap_or_default();
        let addr = line.trim().strip_prefix("listening on http://").and_then(|a| a.parse().ok());
        match addr {
            Some(addr) => server.addr = addr,
            None => panic!("serve-reward printed {line:?}, not its address; stderr: {}", server.log()),
        }
        assert!(server.addr.ip().is_loopback(), "{}", server.addr);
        server
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// `POST path` with a JSON body.
    fn post(&self, path: &str, auth: Option<&str>, body: &str) -> (u16, Value) {
        let mut headers = vec![("Content-Type", "application/json".to_string())];
        if let Some(token) = auth {
            headers.push(("Authorization", format!("Bearer {token}")));
        }
        http(self.addr, "POST", path, &headers, body.as_bytes())
    }

    /// Sends SIGTERM and waits (bounded) for the exit.
    fn terminate(&mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(killed.success());
        wait_bounded(&mut self.child).unwrap_or_else(|| panic!("no exit within {TIMEOUT:?} of SIGTERM"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_bounded(child: &mut Child) -> Option<ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < TIMEOUT {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// One HTTP/1.1 request (`Connection: close`); returns the status and the body parsed as JSON
/// (panics if it is not JSON: every answer of serve-reward is).
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, String)], body: &[u8]) -> (u16, Value) {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(TIMEOUT)).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(head.as_bytes()).unwrap();
    // A server refusing an oversized body may answer and close before reading it all.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        assert!(!raw.is_empty(), "{method} {path}: no response: {e}");
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let status: u16 = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap();
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("{method} {path}: body {body:?} is not JSON: {e}"));
    (status, json)
}

fn assert_error(got: (u16, Value), status: u16, needle: &str) {
    let (code, body) = got;
    assert_eq!(code, status, "{body}");
    let message = body["error"].as_str().unwrap_or_else(|| panic!("no `error` string in {body}"));
    assert!(message.contains(needle), "{message:?} does not mention {needle:?}");
}

/// `configs/grpo.toml` with its `[[rewards]]` replaced by `rewards` (TOML).
fn config_with_rewards(dir: &Path, rewards: &str) -> PathBuf {
    let preset = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/grpo.toml")).unwrap();
    let head = &preset[..preset.find("[[rewards]]").expect("grpo.toml has a [[rewards]] entry")];
    let path = dir.join("run.toml");
    std::fs::write(&path, format!("{head}{rewards}")).unwrap();
    path
}

fn train(config: &Path, run_dir: &Path, env: &[(&str, &str)]) -> Output {
    train_with(config, run_dir, env, &["--set", "warmup.steps=2"])
}

/// Two GRPO steps of `config` with extra arguments (`--set` overrides).
fn train_with(config: &Path, run_dir: &Path, env: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut cmd = Command::new(rlhf_bin());
    cmd.args(["train", "--algo", "grpo", "--config", s(config)])
        .args(["--set", "train.steps=2", "--run-dir", s(run_dir)])
        .args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn number(line: &Value, key: &str) -> f64 {
    line[key].as_f64().unwrap_or_else(|| panic!("metric {key} missing in {line}"))
}

/// Every sample of the step was kept and scored by every source.
fn assert_all_scored(line: &Value) {
    let (count, dropped) = (number(line, "completions/count"), number(line, "completions/dropped"));
    assert_eq!(count + dropped, 16.0 * 8.0, "prompts × samples");
    assert_eq!(number(line, "completions/scored"), count, "{line}");
    assert_eq!(number(line, "completions/unscored"), 0.0, "{line}");
}

#[test]
fn rl_run_scored_by_reward_http_against_serve_reward() {
    plugin_so("rlhf-plugin-reward-http");
    let token = ("RLHF_TEST_RM_TOKEN", "e2e-secret");
    let server = Server::start(&["--token-env", token.0], &[token]);
    let tmp = tempfile::tempdir().unwrap();
    let config = config_with_rewards(
        tmp.path(),
        &format!(
            "[[rewards]]\nplugin = \"reward-http\"\nname = \"rm\"\nweight = 1.0\n[rewards.config]\n\
             url = \"http://{}/get_reward\"\nformat = \"openrlhf\"\ntoken_env = \"{}\"\nretries = 0\n",
            server.addr, token.0
        ),
    );
    let rd = tmp.path().join("run");
    let o = train(&config, &rd, &[token]);
    assert!(o.status.success(), "{}\nserver: {}", String::from_utf8_lossy(&o.stderr), server.log());
    let lines = metrics(&rd);
    assert_eq!(lines.len(), 2, "one line per step");
    for l in &lines {
        assert_all_scored(l);
        let mean = number(l, "rewards/rm/mean");
        assert!(mean.is_finite() && number(l, "rewards/rm/std") > 0.0, "{l}");
        assert_eq!(number(l, "rewards/rm/skipped"), 0.0);
        assert!((number(l, "reward") - mean).abs() < 1e-9, "weight 1: reward is the RM's mean");
    }
}

#[test]
fn two_reward_sources_are_weighted_and_logged() {
    plugin_so("rlhf-plugin-reward-model");
    let tmp = tempfile::tempdir().unwrap();
    let config = config_with_rewards(
        tmp.path(),
        &format!(
            "[[rewards]]\nplugin = \"reward-rules\"\nname = \"accuracy\"\nweight = 1.0\n\
             [rewards.config.exact_match]\nextract = \"full\"\n\n\
             [[rewards]]\nplugin = \"reward-model\"\nname = \"rm\"\nweight = 0.5\n[rewards.config]\nmodel = {:?}\n",
            s(&model_dir("llama-rm"))
        ),
    );
    let rd = tmp.path().join("run");
    let o = train(&config, &rd, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = metrics(&rd);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_all_scored(l);
        let (acc, rm) = (number(l, "rewards/accuracy/mean"), number(l, "rewards/rm/mean"));
        assert!((0.0..=1.0).contains(&acc), "{l}");
        assert!((number(l, "reward_model/raw_mean") - rm).abs() < 1e-12, "{l}");
        assert!(l.get("reward_rules/exact_match").is_some(), "{l}");
        assert!((number(l, "reward") - (acc + 0.5 * rm)).abs() < 1e-9, "reward = 1.0·accuracy + 0.5·rm: {l}");
    }
}

/// What the host does for one prompt with `top_k = 1` (argmax) sampling: the fixture Llama's greedy
/// continuation of `prompt` (special tokens added, as for an untemplated prompt), EOS dropped,
/// decoded without special tokens.
fn greedy_response(actor: &Path, prompt: &str, max_new_tokens: i64) -> String {
    let tok = HfTokenizer::from_dir(actor).unwrap();
    let lm = CausalLm::from_dir(actor, Device::Cpu, Kind::Float).unwrap();
    let ids: Vec<i64> = tok.encode(prompt, true).unwrap().into_iter().map(i64::from).collect();
    let x = Tensor::from_slice(&ids).view([1, -1]); // [1, P]
    let eos: Vec<i64> = tok.eos_token_ids().iter().map(|&t| i64::from(t)).collect();
    let cfg = GenerateConfig::greedy(max_new_tokens, eos.clone(), i64::from(tok.pad_token_id()));
    let gen = tch::no_grad(|| generate(&lm, &x, &x.ones_like(), &cfg)).unwrap();
    let resp = Vec::<i64>::try_from(gen.responses().unwrap().view([-1])).unwrap(); // [N]
    let mask = Vec::<i64>::try_from(gen.response_mask.to_kind(Kind::Int64).view([-1])).unwrap(); // [N]
    let content: Vec<u32> =
        resp.iter().zip(&mask).filter(|&(t, &m)| m == 1 && !eos.contains(t)).map(|(&t, _)| t as u32).collect();
    tok.decode(&content, true).unwrap()
}

/// `rlhf rm`'s output directory is a reward model the `reward-model` plugin loads: a GRPO run scores
/// with it, logs the plugin's metrics, and its first-step score is the one the saved model gives
/// the text the host judged (one prompt, argmax sampling, so the completion is known in advance).
#[test]
fn reward_model_plugin_scores_with_an_rlhf_rm_output() {
    plugin_so("rlhf-plugin-reward-model");
    let tmp = tempfile::tempdir().unwrap();
    let base = model_dir("llama");
    let rm_run = tmp.path().join("rm");
    let o = Command::new(rlhf_bin())
        .args(["rm", "--run-dir", s(&rm_run), "--set", &format!("model.path={:?}", s(&base))])
        .args(["--set", "train.steps=3", "--set", "data.max_len=64"])
        .output()
        .unwrap();
    assert!(o.status.success(), "rlhf rm: {}", String::from_utf8_lossy(&o.stderr));
    let rm_dir = rm_run.join("model");
    assert_eq!(read_json(&rm_run.join("summary.json"))["steps"], 3);

    let prompt = "3 + 4 =";
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, format!("{}\n", json!({ "prompt": prompt }))).unwrap();
    let config = config_with_rewards(
        tmp.path(),
        &format!(
            "[[rewards]]\nplugin = \"reward-model\"\nname = \"rm\"\nweight = 1.0\n[rewards.config]\n\
             model = {:?}\ndtype = \"f32\"\nbatch_size = 4\nmax_len = 1024\nchat_template = \"none\"\n",
            s(&rm_dir)
        ),
    );
    let rd = tmp.path().join("run");
    let sets = [
        format!("model.actor={:?}", s(&base)),
        format!("data.prompts={:?}", s(&prompts)),
        "data.apply_chat_template=false".into(),
        "warmup.steps=0".into(),
        "rollout.prompts_per_batch=1".into(),
        "rollout.samples_per_prompt=2".into(),
        "rollout.top_k=1".into(),
        "rollout.max_new_tokens=4".into(),
    ];
    let extra: Vec<&str> = sets.iter().flat_map(|kv| ["--set", kv.as_str()]).collect();
    let o = train_with(&config, &rd, &[], &extra);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = metrics(&rd);
    assert_eq!(lines.len(), 2, "one line per step");
    for l in &lines {
        assert_eq!(number(l, "completions/scored"), 2.0, "{l}");
        assert_eq!(number(l, "completions/unscored"), 0.0, "{l}");
        let (raw, std, mean) =
            (number(l, "reward_model/raw_mean"), number(l, "reward_model/raw_std"), number(l, "rewards/rm/mean"));
        assert!(raw.is_finite() && std.is_finite(), "{l}");
        assert!((raw - mean).abs() < 1e-12, "no normalisation: the source's mean is the raw mean: {l}");
        assert!((number(l, "reward") - mean).abs() < 1e-9, "weight 1: {l}");
    }

    // Step 1 sampled from the untouched actor: both samples are its argmax continuation.
    let response = greedy_response(&base, prompt, 4);
    let scorer = RewardModelScorer::from_dir(&rm_dir, Device::Cpu, Kind::Float, 4, 1024).unwrap();
    let expected = scorer.score_texts(&[format!("{prompt}{response}")]).unwrap()[0];
    let got = number(&lines[0], "reward_model/raw_mean");
    println!("rlhf rm output as reward: {prompt:?} + {response:?} scored {got:.6}, expected {expected:.6}");
    assert!((got - expected).abs() <= 1e-5 * expected.abs().max(1.0), "{got} vs {expected}");
    assert_eq!(number(&lines[0], "reward_model/raw_std"), 0.0, "two identical samples");
}

#[test]
fn serve_reward_scores_like_the_scorer_and_refuses_bad_requests() {
    let token = ("RLHF_TEST_RM_TOKEN", "s3cret");
    let mut server = Server::start(&["--token-env", token.0, "--max-batch", "4", "--max-body-bytes", "4096"], &[token]);
    let auth = Some(token.1);

    // Scores: the reference prompts as texts, against the in-process scorer and transformers.
    let dir = model_dir("llama-rm");
    let prompts: Vec<String> = read_json(&dir.join("reference.json"))["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let mut texts = prompts.clone();
    texts.push("Once upon a time, the fox jumped over the lazy dog.".into());
    let scorer = RewardModelScorer::from_dir(&dir, Device::Cpu, Kind::Float, 16, 1024).unwrap();
    let expected = scorer.score_texts(&texts).unwrap();
    let reference: Vec<f64> = {
        let r: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect();
        Vec::<f64>::try_from(&r["scores"].to_kind(Kind::Double)).unwrap()
    };
    let close = |got: &Value, want: &[f64], tol: f64| {
        let got: Vec<f64> = got.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < tol, "{got:?} vs {want:?}");
        }
    };
    let body = json!({"query": texts, "prompts": ["", "", ""], "labels": [null, "x", null]}).to_string();
    let (code, out) = server.post("/get_reward", auth, &body);
    assert_eq!(code, 200, "{out}");
    close(&out["rewards"], &expected, 1e-5);
    close(&out["scores"], &expected, 1e-5);
    close(&Value::from(out["rewards"].as_array().unwrap()[..2].to_vec()), &reference, 1e-4);
    let (code, out) = server.post("/v1/score/evaluation", auth, &json!({"model": "rm", "messages": texts}).to_string());
    assert_eq!(code, 200, "{out}");
    close(&out["scores"], &expected, 1e-5);
    assert_eq!(out["object"], "score.evaluation");
    let (code, out) = server.post("/get_reward", auth, r#"{"query": []}"#);
    assert_eq!((code, out), (200, json!({"rewards": [], "scores": []})));
    let (code, out) = http(server.addr, "GET", "/health", &[], b"");
    assert_eq!((code, &out["status"]), (200, &json!("ok")));

    // Authentication.
    assert_error(server.post("/get_reward", None, &body), 401, "Authorization");
    assert_error(server.post("/get_reward", Some("s3cre"), &body), 401, "invalid bearer token");
    assert_error(server.post("/v1/score/evaluation", Some("wrong"), &body), 401, "invalid bearer token");

    // Malformed bodies.
    assert_error(server.post("/get_reward", auth, r#"{"query": ["a", "#), 400, "invalid request body");
    assert_error(server.post("/get_reward", auth, r#"{"prompts": ["a"]}"#), 400, "missing field `query`");
    assert_error(server.post("/get_reward", auth, r#"{"query": ["a", 7]}"#), 400, "invalid type");
    assert_error(server.post("/get_reward", auth, r#"{"query": "a"}"#), 400, "invalid type");
    assert_error(server.post("/v1/score/evaluation", auth, r#"{"model": "rm"}"#), 400, "missing field `messages`");
    assert_error(server.post("/get_reward", auth, r#"{"query": ["a", ""]}"#), 400, "text 1 has no tokens");

    // Limits: texts per request, then bytes per body.
    let five = json!({"query": ["a", "b", "c", "d", "e"]}).to_string();
    assert_error(server.post("/get_reward", auth, &five), 413, "--max-batch 4");
    let big = json!({"query": ["x".repeat(5000)]}).to_string();
    assert_error(server.post("/get_reward", auth, &big), 413, "--max-body-bytes");
    assert_error(http(server.addr, "GET", "/nope", &[], b""), 404, "no such endpoint");

    // Still serving after all that; then SIGTERM stops it cleanly.
    let (code, out) = server.post("/get_reward", auth, r#"{"query": ["a"]}"#);
    assert_eq!(code, 200, "{out}");
    let status = server.terminate();
    assert!(status.success(), "exit {status:?} on SIGTERM; stderr: {}", server.log());
    assert!(!server.log().contains("panicked"), "{}", server.log());
}

#[test]
fn serve_reward_refuses_a_public_address_without_a_token() {
    for (args, env, needle) in [
        (vec!["--listen", "0.0.0.0:0"], vec![], "--listen 0.0.0.0:0"),
        (
            vec!["--listen", "0.0.0.0:0", "--token-env", "RLHF_TEST_EMPTY_TOKEN"],
            vec![("RLHF_TEST_EMPTY_TOKEN", "")],
            "RLHF_TEST_EMPTY_TOKEN",
        ),
    ] {
        let mut cmd = Command::new(rlhf_bin());
        cmd.args(["serve-reward", "--model", s(&model_dir("llama-rm"))])
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let status = wait_bounded(&mut child);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?}: still running: it should have refused to start");
        }
        let o = child.wait_with_output().unwrap();
        assert!(!o.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: one error line: {stderr}");
        assert!(errors[0].contains(needle), "{args:?}: {}", errors[0]);
        assert!(!stderr.contains("panicked") && o.stdout.is_empty(), "{stderr}");
    }
}

/// Writes `head` (and no more) to a new loopback connection whose reads give up after `wait`.
fn send_raw(addr: SocketAddr, head: &str, wait: Duration) -> TcpStream {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// Reads until the server closes; the response's status, or `None` for a close without one.
/// Panics if the server neither answers nor closes within the stream's read timeout.
fn status_or_close(mut stream: TcpStream) -> Option<u16> {
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        assert!(
            !raw.is_empty() || e.kind() == std::io::ErrorKind::ConnectionReset,
            "neither an answer nor a close: {e}"
        );
    }
    let text = String::from_utf8_lossy(&raw);
    text.split_whitespace().nth(1).and_then(|c| c.parse().ok())
}

#[test]
fn serve_reward_times_out_half_sent_requests_and_refuses_an_oversized_length_at_once() {
    let server = Server::start(&["--read-timeout-secs", "1", "--max-body-bytes", "4096"], &[]);
    let head = |len: usize| {
        format!(
            "POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    // A declared length over the cap: 413 without sending a byte of the body.
    let t0 = Instant::now();
    let stream = send_raw(server.addr, &head(1 << 30), Duration::from_secs(20));
    assert_eq!(status_or_close(stream), Some(413));
    assert!(t0.elapsed() < Duration::from_millis(900), "413 took {:?}", t0.elapsed());
    // A body that stops short of its Content-Length: 408 once the read timeout is up.
    let t0 = Instant::now();
    let stream = send_raw(server.addr, &format!("{}{{\"query\": [", head(1000)), Duration::from_secs(20));
    assert_eq!(status_or_close(stream), Some(408));
    assert!(t0.elapsed() < Duration::from_secs(10), "408 took {:?}", t0.elapsed());
    // Headers that never end: the connection is closed (or answered 408) once the timeout is up.
    let t0 = Instant::now();
    let stream = send_raw(server.addr, "POST /get_reward HTTP/1.1\r\nHost: x\r\n", Duration::from_secs(20));
    assert!(matches!(status_or_close(stream), None | Some(408)));
    assert!(t0.elapsed() < Duration::from_secs(10), "close took {:?}", t0.elapsed());
    // The server still serves.
    let (code, out) = server.post("/get_reward", None, r#"{"query": ["a"]}"#);
    assert_eq!(code, 200, "{out}");
}

#[test]
fn serve_reward_exits_within_the_grace_period_despite_a_stalled_client() {
    let mut server = Server::start(&["--read-timeout-secs", "600", "--shutdown-grace-secs", "1"], &[]);
    let head =
        "POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"qu";
    let _stalled = send_raw(server.addr, head, TIMEOUT);
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Duration::from_secs(1 + 10);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(t0.elapsed() < deadline, "still running {deadline:?} after SIGTERM; stderr: {}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit {status:?} on SIGTERM; stderr: {}", server.log());
    assert!(server.log().contains("--shutdown-grace-secs"), "{}", server.log());
}
