//! A GGUF imported, then loaded, computes what transformers computes reading the same file: a
//! tiny random Qwen3-MoE written as llama.cpp writes `qwen3moe` (stacked experts, the router as
//! `ffn_gate_inp`) by `fixtures/gguf_qwen3moe.py`, against transformers' own GGUF loader.

use std::collections::HashMap;

use rlhf_gguf::{import_llama, GgufFile, OutDtype};
use rlhf_integration_tests::{fixtures, python, read_json};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

#[test]
fn a_qwen3moe_gguf_imports_to_the_logits_transformers_reads_from_it() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(&python)
        .arg(fixtures().join("gguf_qwen3moe.py"))
        .arg("--out")
        .arg(dir.path())
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = GgufFile::open(&dir.path().join("qwen3moe.gguf")).unwrap();
    let model_dir = dir.path().join("imported");
    let summary = import_llama(&file, &model_dir, OutDtype::F32).unwrap();
    // Per layer: 2 norms, q/k/v/o, q/k norms, the router, 3 × 4 experts; embeddings, norm, head.
    assert_eq!(summary.tensors, 2 * (2 + 4 + 2 + 1 + 12) + 3);
    let config = read_json(&model_dir.join("config.json"));
    assert_eq!(config["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!((config["num_experts"].as_u64(), config["moe_intermediate_size"].as_u64()), (Some(4), Some(16)));
    assert_eq!(config["norm_topk_prob"], true);

    let model = CausalLm::from_dir(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let r: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.path().join("reference.safetensors")).unwrap().into_iter().collect();
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    let logits = tch::no_grad(|| model.forward(ids, mask)).unwrap();
    let real = mask.to_kind(Kind::Bool).unsqueeze(-1);
    let diff = (&logits - &r["logits"]).abs().masked_fill(&real.logical_not(), 0.0).max().double_value(&[]);
    println!("qwen3moe GGUF: max |Δlogit| vs transformers reading the file = {diff:.2e}");
    assert!(diff < 1e-4, "logits differ by {diff}");
}
