//! The ATen operators one decode step dispatches per decoder layer, counted through libtorch's
//! `RecordFunction` hook (every operator, nested ones too): a budget that a regression — an
//! extra copy, a composite norm, a mask rebuilt per layer — breaks on any device, CPU included.
//! Per layer = the count of a 2-layer model's step minus a 1-layer model's (the same random
//! Qwen2 otherwise), after one warm-up step each.

use rlhf_models::CausalLm;
use rlhf_trainer::random_qwen2::{write_qwen2, Qwen2Shape};
use tch::{Device, Kind, Tensor};

/// At most this many operators per layer (the step measured 41 when this was set; the eager
/// decode before the capture-safe step, fused projections and norms dispatched 96).
const BUDGET: usize = 60;

/// The operators of one decode step of a `layers`-layer random Qwen2, in order.
fn step_ops(layers: i64, dir: &std::path::Path) -> rlhf_aten::op_count::OpCount {
    let shape = Qwen2Shape { layers, ..Qwen2Shape::SMALL };
    write_qwen2(dir, &shape, Kind::Float, 3).unwrap();
    let m = CausalLm::from_dir(dir, Device::Cpu, Kind::Float).unwrap();
    let (b, capacity) = (4, 24);
    let mut cache = m.new_cache(b, capacity).unwrap();
    let key_mask = Tensor::zeros([b, capacity], (Kind::Int64, Device::Cpu));
    let _ = key_mask.narrow(1, 0, 9).fill_(1);
    let ids = Tensor::from_slice(&[5i64, 6, 7, 8]).view([b, 1]);
    let pos = Tensor::full([b, 1], 8, (Kind::Int64, Device::Cpu));
    let slot = Tensor::from_slice(&[8i64]);
    tch::no_grad(|| {
        let _ = m.decode_step(&ids, &pos, &key_mask, &slot, &mut cache).unwrap();
        let (_, ops) =
            rlhf_aten::op_count::count(|| m.decode_step(&ids, &pos, &key_mask, &slot, &mut cache).unwrap()).unwrap();
        ops
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
