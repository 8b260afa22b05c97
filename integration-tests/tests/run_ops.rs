//! Running for real: checkpoints and exact resume, a `kill -9` during a checkpoint write, the
//! layered config (file → `RLHF_` env → `--set`) with `rlhf config show`, and the log formats.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rlhf_integration_tests::{behaviour_metrics, copy_dir, rlhf_bin};

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

fn last_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string()
}

/// A small PPO run (critic, reference, adaptive KL) on the built-in task.
const SMALL: &[&str] = &[
    "--algo",
    "ppo",
    // The preset's held-out evaluation is off: these runs test other things, step by step.
    "--set",
    "eval.data=\"\"",
    "--set",
    "train.steps=6",
    "--set",
    "warmup.steps=5",
    "--set",
    "rollout.prompts_per_batch=4",
    "--set",
    "rollout.samples_per_prompt=2",
    "--set",
    "algorithm.config.adaptive_kl={ target = 0.01, horizon = 100 }",
];

#[test]
fn resumed_run_repeats_the_uninterrupted_one_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let o = rlhf(
        &[&["train"], SMALL, &["--set", "checkpoint.every=3", "--set", "checkpoint.keep=5", "--run-dir", s(&a)]]
            .concat(),
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(a.join("checkpoints/step-000003/manifest.json").is_file());
    assert!(a.join("checkpoints/step-000006/manifest.json").is_file(), "a checkpoint at the end");
    assert!(a.join("actor/model.safetensors").is_file() && a.join("plots/reward.png").is_file());

    // The same run killed during step 5, after its checkpoint at step 3: its directory as it was
    // then (step 4 logged, no later checkpoint, no final actor), resumed.
    let b = tmp.path().join("b");
    copy_dir(&a, &b);
    std::fs::remove_dir_all(b.join("checkpoints/step-000006")).unwrap();
    std::fs::remove_dir_all(b.join("actor")).unwrap();
    let text = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let logged: Vec<&str> = text.lines().take(3).collect();
    std::fs::write(b.join("metrics.jsonl"), format!("{}\n{{\"step\": 4, \"reward\": 999.0}}\n", logged.join("\n")))
        .unwrap();
    let o = rlhf(&["train", "--resume", s(&b.join("checkpoints/step-000003"))], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ma, mb) = (behaviour_metrics(&a), behaviour_metrics(&b));
    assert_eq!((ma.len(), mb.len()), (6, 6), "steps 1-3 kept, 4-6 rewritten");
    assert!(mb.iter().all(|m| m["reward"] != serde_json::json!(999.0)), "the stale step-4 row is gone");
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x, y, "step {} differs", x["step"]);
    }
    assert!(ma[5].contains_key("loss/value") && ma[5]["ppo/kl_coef"] != ma[0]["ppo/kl_coef"], "adaptive KL moved");
    let (wa, wb) = (
        std::fs::read(a.join("actor/model.safetensors")).unwrap(),
        std::fs::read(b.join("actor/model.safetensors")).unwrap(),
    );
    assert!(wa == wb, "final actors differ");

    // Refusals: a different config, a corrupt checkpoint, a missing run dir, a bad W&B setting
    // (found only once the models are loaded), a checkpoint moved out of its run — one line
    // each, nothing written.
    let before = std::fs::read(b.join("metrics.jsonl")).unwrap();
    let config_before = std::fs::read(b.join("config.toml")).unwrap();
    let o = rlhf(
        &["train", "--resume", s(&b.join("checkpoints/step-000003"))],
        &[("WANDB_API_KEY", "k"), ("WANDB_BASE_URL", "ftp://example")],
    );
    let e = last_line(&o);
    assert!(!o.status.success() && e.contains("wandb") && e.contains("base_url"), "{e}");
    assert_eq!(std::fs::read(b.join("metrics.jsonl")).unwrap(), before, "a refused resume kept every metrics row");
    assert_eq!(std::fs::read(b.join("config.toml")).unwrap(), config_before, "and the run's config");
    let moved = tmp.path().join("moved");
    copy_dir(&b.join("checkpoints/step-000003"), &moved.join("step-000003"));
    let o = rlhf(&["train", "--resume", s(&moved.join("step-000003"))], &[]);
    let e = last_line(&o);
    assert!(!o.status.success() && e.contains("not inside a run's checkpoints/") && e.contains("--run-dir"), "{e}");
    assert!(!tmp.path().join("metrics.jsonl").exists() && !tmp.path().join("config.toml").exists());
    let o = rlhf(&[&["train"], SMALL, &["--set", "train.lr=0.1", "--resume", s(&b)]].concat(), &[]);
    let e = last_line(&o);
    assert!(!o.status.success() && e.contains("checkpoint written by another config") && e.contains("train.lr"), "{e}");
    let state = b.join("checkpoints/step-000006/state.json");
    std::fs::write(&state, "{}").unwrap();
    let o = rlhf(&["train", "--resume", s(&b)], &[]);
    let e = last_line(&o);
    assert!(!o.status.success() && e.contains("corrupt checkpoint: state.json"), "{e}");
    let o = rlhf(&["train", "--resume", s(&tmp.path().join("nope"))], &[]);
    assert!(last_line(&o).contains("nope: run directory not found"), "{}", last_line(&o));
    assert_eq!(std::fs::read(b.join("metrics.jsonl")).unwrap(), before, "a refused resume wrote nothing");

    // A fresh run never appends to another run's directory.
    let o = rlhf(&[&["train"], SMALL, &["--run-dir", s(&a)]].concat(), &[]);
    assert!(last_line(&o).contains("already holds a run"), "{}", last_line(&o));
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tmp_dirs(run: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(run.join("checkpoints"))
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.to_string_lossy().contains(".tmp-")).collect())
        .unwrap_or_default()
}

#[test]
fn kill_during_a_checkpoint_write_leaves_the_previous_one_usable() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let args = [&["train"], SMALL, &["--set", "checkpoint.every=2", "--run-dir", s(&run)]].concat();
    let mut child = Command::new(rlhf_bin())
        .args(&args)
        .env("RLHFRS_TEST_CHECKPOINT_DELAY_MS", "400")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for("the step-2 checkpoint", Duration::from_secs(120), || {
        run.join("checkpoints/step-000002/manifest.json").is_file()
    });
    wait_for("the step-4 checkpoint write", Duration::from_secs(120), || !tmp_dirs(&run).is_empty());
    std::thread::sleep(Duration::from_millis(500)); // some files of step 4 are on disk
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!run.join("checkpoints/step-000004").exists(), "an incomplete checkpoint was published");
    assert!(!tmp_dirs(&run).is_empty(), "the kill landed mid-write");

    let o = rlhf(
        &[&["train"], SMALL, &["--set", "checkpoint.every=2", "--run-dir", s(&run), "--resume", "latest"]].concat(),
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("resumed from")
            && String::from_utf8_lossy(&o.stderr).contains("step-000002")
    );
    let lines = behaviour_metrics(&run);
    assert_eq!(lines.iter().map(|l| l["step"].as_u64().unwrap()).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
    assert!(tmp_dirs(&run).is_empty(), "the stale temp dir was cleaned");
}

#[test]
fn config_layers_and_show_say_where_values_come_from() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[algorithm]\nname = \"grpo\"\n[train]\nactor_lr = 1e-5\nsteps = 7\n[[rewards]]\nplugin = \"reward-rules\"\n",
    )
    .unwrap();
    let o = rlhf(
        &["config", "show", "--config", s(&cfg), "--set", "train.steps=9"],
        &[("RLHF_TRAIN__ACTOR_LR", "2e-5"), ("RLHF_ROLLOUT__TOP_K", "5"), ("RLHF_PYTHON", "/usr/bin/python3")],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = |k: &str| {
        out.lines().find(|l| l.starts_with(&format!("{k} = "))).unwrap_or_else(|| panic!("{k}: {out}")).to_string()
    };
    assert!(line("train.steps").contains("= 9") && line("train.steps").contains("# --set train.steps=9"), "{out}");
    // The file and the variable use the old name; both are read as `train.lr`.
    assert!(line("train.lr").contains("0.00002") && line("train.lr").contains("# RLHF_TRAIN__ACTOR_LR"), "{out}");
    assert!(!out.contains("actor_lr ="), "{out}");
    assert!(line("rollout.top_k").contains("= 5") && line("rollout.top_k").contains("RLHF_ROLLOUT__TOP_K"), "{out}");
    assert!(line("algorithm.name").contains(&format!("# {}", s(&cfg))), "{out}");
    assert!(line("rollout.temperature").ends_with("# default"), "{out}");

    // A variable for one command leaves the others alone: `train.actor_lr` is no key of `rlhf sft`,
    // whose config has a `train` section too; one of its own keys still applies there.
    let o =
        rlhf(&["config", "show", "--command", "sft"], &[("RLHF_TRAIN__ACTOR_LR", "2e-5"), ("RLHF_TRAIN__EPOCHS", "3")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("actor_lr"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("train.epochs = 3") && l.contains("RLHF_TRAIN__EPOCHS")), "{out}");

    // Errors: one line naming the source and the key; non-zero exit.
    let e = last_line(&rlhf(&["config", "show", "--config", s(&cfg)], &[("RLHF_TRAIN__ACTOR_LR", "fast")]));
    assert!(e.contains("RLHF_TRAIN__ACTOR_LR: train.lr: invalid type"), "{e}");
    // A range error names where the value came from, not the base file.
    let e = last_line(&rlhf(&["config", "show", "--config", s(&cfg), "--set", "rollout.top_p=2"], &[]));
    assert!(e.contains("--set rollout.top_p=2: rollout.top_p: must be in (0, 1]"), "{e}");
    let e = last_line(&rlhf(&["config", "show", "--command", "sft"], &[("RLHF_TRAIN__BATCH_SIZE", "0")]));
    assert!(e.contains("RLHF_TRAIN__BATCH_SIZE: train.batch_size: must be >= 1"), "{e}");
    let e = last_line(&rlhf(&["config", "show", "--config", s(&cfg)], &[("RLHF_TRAIN__STEPZ", "1")]));
    assert!(e.contains("RLHF_TRAIN__STEPZ: train.stepz: unknown field"), "{e}");
    std::fs::write(&cfg, "[algorithm]\nname = \"grpo\"\n[rollout]\ntemperature = \"hot\"\n").unwrap();
    let e = last_line(&rlhf(&["config", "show", "--config", s(&cfg)], &[]));
    assert!(e.contains(&format!("{}: rollout.temperature: invalid type", s(&cfg))), "{e}");
    std::fs::write(&cfg, "[algorithm]\nname = \"grpo\"\n[wandb]\nprojekt = \"x\"\n").unwrap();
    let e = last_line(&rlhf(&["config", "show", "--config", s(&cfg)], &[]));
    assert!(e.contains("wandb.projekt: unknown field"), "{e}");
    let e = last_line(&rlhf(&["config", "show", "--config", s(&tmp.path().join("missing.toml"))], &[]));
    assert!(e.contains("missing.toml: config file not found"), "{e}");
    let o = rlhf(&["config", "show", "--command", "sft", "--set", "train.lr=\"x\""], &[]);
    assert!(!o.status.success() && last_line(&o).contains("train.lr"), "{}", last_line(&o));
}

#[test]
fn json_logs_carry_the_plugin_name_as_target() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = rlhf(
        &[
            "--log-format",
            "json",
            "train",
            "--algo",
            "template-reinforce",
            "--set",
            "train.steps=1",
            "--set",
            "warmup.steps=0",
            "--set",
            "rollout.prompts_per_batch=2",
            "--run-dir",
            s(&run),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let events: Vec<serde_json::Value> =
        String::from_utf8_lossy(&o.stderr).lines().map(|l| serde_json::from_str(l).expect("a JSON log line")).collect();
    let ready = events.iter().find(|e| e["message"].as_str().is_some_and(|m| m.contains("template-reinforce ready")));
    let ready = ready.expect("the plugin's event");
    assert_eq!(ready["target"], "template-reinforce", "{ready}");
    assert!(events.iter().any(|e| e["target"].as_str().is_some_and(|t| t.starts_with("rlhf_trainer::rl"))));

    // RUST_LOG filters a plugin by its name.
    let run2 = tmp.path().join("run2");
    let o = rlhf(
        &[
            "train",
            "--algo",
            "template-reinforce",
            "--set",
            "train.steps=1",
            "--set",
            "warmup.steps=0",
            "--run-dir",
            s(&run2),
        ],
        &[("RUST_LOG", "info,template-reinforce=off")],
    );
    assert!(o.status.success());
    assert!(!String::from_utf8_lossy(&o.stderr).contains("template-reinforce ready"));
}

/// A minimal W&B server on loopback (std only): answers `upsertBucket` and records every
/// file_stream body. One request per connection (`Connection: close`).
/// Requests the mock saw: (path, JSON body).
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>;

fn mock_wandb() -> (String, Seen) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).is_err() {
                continue;
            }
            let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut len = 0usize;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; len];
            let _ = reader.read_exact(&mut body);
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
            let reply = if path == "/graphql" {
                let name = body.pointer("/variables/name").cloned().unwrap_or_default();
                serde_json::json!({"data": {"upsertBucket": {"bucket": {
                    "id": "x", "name": name, "displayName": name, "historyLineCount": 0,
                    "project": {"name": "proj", "entity": {"name": "ent"}}}, "inserted": true}}})
            } else {
                serde_json::json!({"exitcode": null, "limits": {}})
            };
            log.lock().unwrap().push((path, body));
            let text = reply.to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    (url, seen)
}

#[test]
fn a_run_streams_its_history_to_wandb() {
    let (url, seen) = mock_wandb();
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = rlhf(
        &[&["train"], SMALL, &["--set", "train.steps=3", "--set", "wandb.flush_interval_s=0.05", "--run-dir", s(&run)]]
            .concat(),
        &[("WANDB_API_KEY", "k"), ("WANDB_BASE_URL", &url), ("WANDB_PROJECT", "proj")],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].0, "/graphql");
    let streams: Vec<&serde_json::Value> =
        seen.iter().filter(|(p, _)| p.ends_with("/file_stream")).map(|(_, b)| b).collect();
    assert!(seen.iter().skip(1).all(|(p, _)| p.starts_with("/files/ent/proj/")), "{seen:?}");
    let mut steps = Vec::new();
    for b in &streams {
        if let Some(lines) = b.pointer("/files/wandb-history.jsonl/content").and_then(|c| c.as_array()) {
            for l in lines {
                let l: serde_json::Value = serde_json::from_str(l.as_str().unwrap()).unwrap();
                assert!(l.get("reward").is_some() && l.get("loss/policy").is_some(), "{l}");
                steps.push(l["_step"].as_u64().unwrap());
            }
        }
    }
    assert_eq!(steps, vec![1, 2, 3]);
    assert_eq!(streams.last().unwrap()["complete"], true, "the run is marked complete last");
    assert_eq!(streams.last().unwrap()["exitcode"], 0);
}
