//! Our models against references transformers produced for tiny random peaky checkpoints
//! (`fixtures/make_fixtures.py`): f32 logits within 1e-4, identical greedy tokens (batched with
//! left padding, and single), reward scores, perplexity, and bit-identical save → reload.

use std::collections::HashMap;

use rlhf_generation::perplexity;
use rlhf_integration_tests::{fixtures, model_dir, read_json};
use rlhf_models::{CausalLm, ScalarHeadModel};
use rlhf_tokenizer::HfTokenizer;
use tch::{Device, Kind, Tensor};

const CAUSAL: &[&str] = &["llama", "llama-tied", "qwen2", "gpt2"];
const SCALAR: &[&str] = &["llama-rm", "gpt2-rm"];

fn reference(name: &str) -> HashMap<String, Tensor> {
    let path = model_dir(name).join("reference.safetensors");
    Tensor::read_safetensors(&path).unwrap().into_iter().collect()
}

fn load(name: &str) -> CausalLm {
    CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap()
}

/// Max |a - b| over positions where `mask` is 1. `a`, `b`: `[batch, seq, ...]`, `mask`: `[batch, seq]`.
fn masked_max_abs_diff(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let mut m = mask.to_kind(Kind::Bool);
    while m.dim() < a.dim() {
        m = m.unsqueeze(-1);
    }
    let d = (a - b).abs().masked_fill(&m.logical_not(), 0.0);
    d.max().double_value(&[])
}

#[test]
fn logits_match_transformers() {
    for name in CAUSAL {
        let model = load(name);
        let r = reference(name);
        let logits = tch::no_grad(|| model.forward(&r["input_ids"], &r["attention_mask"])).unwrap();
        assert_eq!(logits.size(), r["logits"].size(), "{name}");
        let diff = masked_max_abs_diff(&logits, &r["logits"], &r["attention_mask"]);
        let scale = r["logits"].abs().max().double_value(&[]);
        println!("{name}: max |Δlogit| = {diff:.2e} (max |logit| = {scale:.1})");
        assert!(diff < 1e-4, "{name}: max abs logit difference {diff}");
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    for name in CAUSAL {
        let tok = HfTokenizer::from_dir(&model_dir(name)).unwrap();
        rlhf_integration_tests::assert_greedy_matches(name, &load(name), &tok, &reference(name));
    }
}

#[test]
fn reward_scores_match_transformers() {
    for name in SCALAR {
        let model = ScalarHeadModel::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let r = reference(name);
        let scores = tch::no_grad(|| model.scores(&r["input_ids"], &r["attention_mask"])).unwrap();
        let diff = (&scores - &r["scores"]).abs().max().double_value(&[]);
        println!("{name}: scores {:?}, max |Δ| = {diff:.2e}", Vec::<f32>::try_from(&scores).unwrap());
        assert!(diff < 1e-4, "{name}: score difference {diff}");
    }
}

#[test]
fn perplexity_matches_transformers() {
    let lines: Vec<String> = std::fs::read_to_string(fixtures().join("ppl.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .collect();
    for name in CAUSAL {
        let model = load(name);
        let tok = HfTokenizer::from_dir(&model_dir(name)).unwrap();
        let seqs: Vec<Vec<i64>> =
            lines.iter().map(|t| tok.encode(t, true).unwrap().into_iter().map(i64::from).collect()).collect();
        let expected = read_json(&model_dir(name).join("reference.json"));
        for batch_size in [1, 3, 8] {
            let p = perplexity(&model, &seqs, batch_size, i64::from(tok.pad_token_id())).unwrap();
            let want = expected["ppl"].as_f64().unwrap();
            assert_eq!(p.tokens, expected["tokens"].as_i64().unwrap(), "{name}");
            assert!(
                ((p.ppl - want) / want).abs() < 1e-4,
                "{name} (batch {batch_size}): ppl {} vs transformers {want}",
                p.ppl
            );
        }
    }
}

fn assert_same_variables(a: &tch::nn::VarStore, b: &tch::nn::VarStore, what: &str) {
    let (va, vb) = (a.variables(), b.variables());
    assert_eq!(va.len(), vb.len(), "{what}: variable count");
    for (name, t) in &va {
        let u = vb.get(name).unwrap_or_else(|| panic!("{what}: `{name}` missing after reload"));
        assert!(t.equal(u), "{what}: `{name}` differs after reload");
    }
}

#[test]
fn save_and_reload_is_bit_identical() {
    for name in CAUSAL {
        let model = load(name);
        let r = reference(name);
        for shard in [rlhf_models::model::DEFAULT_MAX_SHARD_BYTES, 40_000] {
            let dir = tempfile::tempdir().unwrap();
            model.save_sharded(dir.path(), shard).unwrap();
            let sharded = dir.path().join("model.safetensors.index.json").exists();
            assert_eq!(sharded, shard == 40_000, "{name}: sharding as requested");
            let again = CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
            assert_same_variables(&model.vs, &again.vs, name);
            let (a, b) = tch::no_grad(|| {
                (
                    model.forward(&r["input_ids"], &r["attention_mask"]).unwrap(),
                    again.forward(&r["input_ids"], &r["attention_mask"]).unwrap(),
                )
            });
            assert!(a.equal(&b), "{name}: logits differ after reload");
            assert!(dir.path().join("tokenizer.json").exists() && dir.path().join("generation_config.json").exists());
        }
    }
    for name in SCALAR {
        let model = ScalarHeadModel::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.save(dir.path()).unwrap();
        let again = ScalarHeadModel::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
        assert_same_variables(&model.vs, &again.vs, name);
    }
}

#[test]
fn bf16_stays_close_to_f32() {
    let r = reference("llama");
    let model = CausalLm::from_dir(&model_dir("llama"), Device::Cpu, Kind::BFloat16).unwrap();
    let logits = tch::no_grad(|| model.forward(&r["input_ids"], &r["attention_mask"])).unwrap().to_kind(Kind::Float);
    let diff = masked_max_abs_diff(&logits, &r["logits"], &r["attention_mask"]);
    let scale = r["logits"].abs().max().double_value(&[]);
    println!("llama bf16: max |Δlogit| = {diff:.3} (max |logit| = {scale:.1})");
    assert!(diff / scale < 0.05, "bf16 relative logit error {}", diff / scale);
}
