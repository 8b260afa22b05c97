//! The ATen operators one decode step dispatches per decoder layer, counted through libtorch's
//! `RecordFunction` hook (every operator, nested ones too): a budget that a regression — an
//! extra copy, a composite norm, a mask rebuilt per layer — breaks on any device, CPU included.
//! Per layer = the count of a 2-layer model's step minus a 1-layer model's (the same random
//! Qwen2 otherwise), after one warm-up step each. And what makes a step capturable as a CUDA
//! graph, checked on a CPU: a step reads nothing back to the host, on every family that is not
//! refused the graph path.

use std::path::Path;

use rlhf_integration_tests::{family_models, python, FAMILIES};
use rlhf_models::{CausalLm, ExpertSteps};
use rlhf_trainer::random_qwen2::{write_qwen2, Qwen2Shape};
use tch::{Device, Kind, Tensor};

/// At most this many operators per layer (the step measured 41 when this was set; the eager
/// decode before the capture-safe step, fused projections and norms dispatched 96).
const BUDGET: usize = 60;

/// Operators that read a tensor's value back to the host (or size their output by one): a CUDA
/// graph cannot capture them, so a step that dispatches one runs eagerly. (A tensor copied to
/// the host and read there dispatches nothing on a CPU; `bincount` stands for the MoE's counts.)
const HOST_READS: &[&str] = &[
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
    "aten::bincount",
    "aten::equal",
    "aten::allclose",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
];

/// The operators of one decode step of a `layers`-layer random Qwen2, in order.
fn step_ops(layers: i64, dir: &Path) -> rlhf_aten::op_count::OpCount {
    let shape = Qwen2Shape { layers, ..Qwen2Shape::SMALL };
    write_qwen2(dir, &shape, Kind::Float, 3).unwrap();
    model_step_ops(&CausalLm::from_dir(dir, Device::Cpu, Kind::Float).unwrap()).1
}

/// The logits (`[4, vocab]`) and the operators, in order, of `m`'s second decode step over 4
/// rows (9 tokens cached).
fn model_step_ops(m: &CausalLm) -> (Tensor, rlhf_aten::op_count::OpCount) {
    let (b, capacity) = (4, 24);
    let mut cache = m.new_cache(b, capacity).unwrap();
    let key_mask = Tensor::zeros([b, capacity], (Kind::Int64, Device::Cpu));
    let _ = key_mask.narrow(1, 0, 9).fill_(1);
    let ids = Tensor::from_slice(&[5i64, 6, 7, 8]).view([b, 1]);
    let pos = Tensor::full([b, 1], 8, (Kind::Int64, Device::Cpu));
    let slot = Tensor::from_slice(&[8i64]);
    tch::no_grad(|| {
        let _ = m.decode_step(&ids, &pos, &key_mask, &slot, &mut cache).unwrap();
        rlhf_aten::op_count::count(|| m.decode_step(&ids, &pos, &key_mask, &slot, &mut cache).unwrap()).unwrap()
    })
}

#[test]
fn a_decode_layer_dispatches_few_operators() {
    let tmp = tempfile::tempdir().unwrap();
    let one = step_ops(1, &tmp.path().join("one"));
    let two = step_ops(2, &tmp.path().join("two"));
    let outer = two.outer.len() - one.outer.len();
    let all = two.total() - one.total();
    println!(
        "decode step of a random Qwen2 (f32, CPU): {outer} operators per layer dispatched by the model ({} with 1 \
         layer, {} with 2), {all} with the nested ones",
        one.outer.len(),
        two.outer.len()
    );
    if let Ok(path) = std::env::var("RLHF_DECODE_OPS_DUMP") {
        std::fs::write(path, format!("{}\n---\n{}", two.outer.join("\n"), two.names.join("\n"))).unwrap();
    }
    assert!(
        outer <= BUDGET,
        "a decoder layer's decode step dispatches {outer} ATen operators (budget {BUDGET}); the 1-layer step's:\n{}",
        one.outer.join("\n")
    );
}

/// Every family whose decode runs as a CUDA graph ([`CausalLm::capture_blocker`] says nothing)
/// dispatches no operator that reads back to the host in its step; and every family refused the
/// graph path still does (else its refusal is stale and costs its users the graphs' speed). A
/// mixture of experts' step over its stacked weights, either way, gives the routed step's logits.
#[test]
fn a_capturable_decode_step_reads_nothing_back_to_the_host() {
    let Some(py) = python() else { return };
    let root = family_models(&py);
    let tmp = tempfile::tempdir().unwrap();
    let qwen2 = tmp.path().join("qwen2");
    write_qwen2(&qwen2, &Qwen2Shape { layers: 2, ..Qwen2Shape::SMALL }, Kind::Float, 3).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models");
    let dirs = FAMILIES
        .iter()
        .map(|f| (f.to_string(), root.join(f)))
        .chain(["llama", "gpt2"].map(|f| (f.to_string(), fixtures.join(f))))
        .chain([("qwen2".to_string(), qwen2)]);
    for (name, dir) in dirs {
        let mut m = CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap_or_else(|e| panic!("{name}: {e}"));
        // What a step computes on CUDA: a mixture's experts over their stacked weights, both ways.
        let (routed, _) = model_step_ops(&m);
        let mut ops = Vec::new();
        for steps in [ExpertSteps::AllExperts, ExpertSteps::Gathered] {
            m.set_expert_steps(Some(steps));
            let (logits, count) = model_step_ops(&m);
            let diff = (&logits - &routed).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{name}: {steps:?} steps' logits differ from the routed step's by {diff:.1e}");
            if diff > 0.0 {
                println!("{name}: {steps:?} steps, max |Δlogit| against the routed step {diff:.1e}");
            }
            ops.extend(count.names);
        }
        let reads: Vec<&String> = ops.iter().filter(|n| HOST_READS.contains(&n.as_str())).collect();
        match m.capture_blocker() {
            None => {
                println!("{name}: capturable, {} operators in two steps, no host read", ops.len());
                assert!(reads.is_empty(), "{name}: its decode step is captured, but it dispatches {reads:?}");
            }
            Some(why) => {
                println!("{name}: decodes eagerly ({why}); host reads {reads:?}");
                assert!(!reads.is_empty(), "{name}: refused CUDA graphs ({why}), but its step reads nothing back");
            }
        }
    }
}

/// LoRA adapters on experts stored one by one add to what each expert computes, which their
/// stacked weights do not hold: the step then routes tokens to their experts (and decodes
/// eagerly on CUDA, saying why); without adapters, and with them disabled, it can be captured.
#[test]
fn lora_on_experts_stored_one_by_one_keeps_the_routed_step() {
    let tmp = tempfile::tempdir().unwrap();
    rlhf_trainer::builtin_models::write_model("tiny-qwen3-moe", tmp.path(), 0).unwrap();
    let mut m = CausalLm::from_dir(tmp.path(), Device::Cpu, Kind::Float).unwrap();
    assert_eq!(m.capture_blocker(), None);
    let cfg = rlhf_models::LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
        target_parameters: vec![],
    };
    assert!(m.apply_lora(&cfg).unwrap() > 0);
    let why = m.capture_blocker().expect("adapters on experts stored one by one");
    assert!(why.contains("LoRA"), "{why}");
    assert_eq!(m.with_adapters_disabled(|| m.capture_blocker()), None, "disabled adapters add nothing");
}
