//! Cross-checks that call transformers at test time (through `RLHF_PYTHON`, set by
//! `cargo xtask test`; under CI a missing interpreter fails instead of skipping):
//! - `rlhf ppl` on fresh transformers-made checkpoints of every family agrees with transformers'
//!   own perplexity to 1e-4 relative, with the same token count;
//! - what we save (causal LM and scalar head) loads in transformers with the same logits / score.

use rlhf_integration_tests::{fixtures, hf_check, model_dir, python, rlhf};
use rlhf_models::{CausalLm, ScalarHeadModel};
use tch::{Device, Kind, Tensor};

#[test]
fn ppl_agrees_with_transformers_on_fresh_checkpoints() {
    let Some(py) = python() else { return };
    let data = fixtures().join("ppl.jsonl");
    for (family, seed) in [("llama", "11"), ("qwen2", "12"), ("gpt2", "13")] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(family);
        let dir_s = dir.to_str().unwrap();
        hf_check(&py, &["make-model", "--family", family, "--out", dir_s, "--seed", seed]);
        let want = hf_check(&py, &["ppl", "--model", dir_s, "--data", data.to_str().unwrap()]);
        let out = rlhf(&["ppl", "--model", dir_s, "--data", data.to_str().unwrap(), "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let got: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(got["tokens"], want["tokens"], "{family}: token count");
        let (g, w) = (got["ppl"].as_f64().unwrap(), want["ppl"].as_f64().unwrap());
        println!("{family}: ppl ours {g} transformers {w}");
        assert!(((g - w) / w).abs() < 1e-4, "{family}: {g} vs {w}");
    }
}

/// `[1, n]` ids of a short text, and as the comma list hf_check.py takes.
fn ids() -> (Tensor, String) {
    let v: Vec<i64> = vec![5, 77, 120, 3, 250, 9, 18, 301, 44, 60];
    let s = v.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    (Tensor::from_slice(&v).view([1, -1]), s)
}

#[test]
fn our_saved_checkpoints_load_in_transformers() {
    let Some(py) = python() else { return };
    let (ids, ids_s) = ids();
    let mask = ids.ones_like();
    for name in ["llama", "llama-tied", "qwen2", "gpt2"] {
        let model = CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        model.save(tmp.path()).unwrap();
        let ours = tch::no_grad(|| model.forward(&ids, &mask)).unwrap().squeeze_dim(0);
        let theirs = hf_check(&py, &["logits", "--model", tmp.path().to_str().unwrap(), "--ids", &ids_s]);
        let rows: Vec<Vec<f32>> = serde_json::from_value(theirs["logits"].clone()).unwrap();
        let theirs = Tensor::from_slice(&rows.concat()).view([rows.len() as i64, -1]);
        let diff = (&ours - &theirs).abs().max().double_value(&[]);
        println!("{name}: saved checkpoint in transformers, max |Δlogit| = {diff:.2e}");
        assert!(diff < 1e-4, "{name}: {diff}");
    }
    // A critic made from a causal LM, saved as *ForSequenceClassification.
    for name in ["llama", "gpt2"] {
        let critic = ScalarHeadModel::from_causal_lm_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        critic.save(tmp.path()).unwrap();
        let ours = tch::no_grad(|| critic.scores(&ids, &mask)).unwrap().double_value(&[0]);
        let theirs = hf_check(&py, &["logits", "--model", tmp.path().to_str().unwrap(), "--ids", &ids_s]);
        let theirs = theirs["score"].as_f64().unwrap();
        println!("{name} critic: score ours {ours} transformers {theirs}");
        assert!((ours - theirs).abs() < 1e-4, "{name}: {ours} vs {theirs}");
    }
}
