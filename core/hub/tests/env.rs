//! The client as the environment configures it (one test: the environment is the process's):
//! a server that trickles a file a byte at a time is given up at `RLHF_HUB_FILE_TIMEOUT`, and a
//! bad `HF_ENDPOINT` or timeout is an error naming the variable.

mod common;

use std::time::Duration;

use common::{etag, within, Reply, Server};
use rlhf_hub::{resolve_model, Hub};
use serde_json::json;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn the_environment_bounds_a_trickling_download_and_bad_values_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let weights = vec![7u8; 4096];
    let tag = etag(&weights);
    let server = Server::start("127.0.0.1", move |req| {
        if req.path.starts_with("/api/") {
            let siblings = [json!({"rfilename": "config.json"}), json!({"rfilename": "model.safetensors"})];
            return Reply::json(json!({ "sha": COMMIT, "siblings": siblings }));
        }
        if req.path.ends_with("/config.json") {
            return Reply::new(200).header("etag", "\"cfg\"").body("{}");
        }
        // A byte every 100 ms: each read succeeds, so only an overall deadline ends it.
        let mut r = Reply::new(200).header("etag", format!("\"{tag}\"")).body(weights.clone());
        r.trickle = Some(Duration::from_millis(100));
        r
    });
    // SAFETY (edition 2021: safe to call): this binary's only test reads the environment.
    std::env::set_var("HF_ENDPOINT", server.url());
    std::env::set_var("HF_HUB_CACHE", tmp.path().join("cache"));
    std::env::set_var("HF_HOME", tmp.path().join("home"));
    std::env::remove_var("HF_TOKEN");
    std::env::remove_var("HF_HUB_OFFLINE");
    std::env::set_var("RLHF_HUB_FILE_TIMEOUT", "1.5");
    let e = within(120, || resolve_model("org/slow")).unwrap_err().to_string();
    assert!(
        e.starts_with("model `org/slow`: model.safetensors: the download took longer than its deadline of 1.5 s"),
        "{e}"
    );
    assert!(e.contains("RLHF_HUB_FILE_TIMEOUT") && e.contains("run again to resume"), "{e}");

    std::env::set_var("RLHF_HUB_FILE_TIMEOUT", "soon");
    let e = Hub::from_env().unwrap_err().to_string();
    assert_eq!(e, "RLHF_HUB_FILE_TIMEOUT `soon`: expected a number of seconds > 0");
    std::env::remove_var("RLHF_HUB_FILE_TIMEOUT");
    for bad in ["huggingface.co", "ftp://mirror.example", "not a url"] {
        std::env::set_var("HF_ENDPOINT", bad);
        let e = resolve_model("org/other").unwrap_err().to_string();
        assert!(e.starts_with(&format!("HF_ENDPOINT `{bad}`: not an http(s) URL")), "{e}");
        assert!(!e.contains("builder error"), "{e}");
    }
}
