//! The ATen operators one training pass — the log-prob forward, its backward — dispatches per
//! decoder layer, counted through libtorch's `RecordFunction` hook as the decode step's are
//! (`decode_ops.rs`): a budget that an extra copy, a cast, or a composite op in the layers'
//! forward or backward breaks on any device, CPU included. Per layer = the count of a 2-layer
//! model's pass minus a 1-layer model's (the same random Qwen2 otherwise), after one warm-up pass.

use rlhf_generation::logprobs::{token_logprobs_pass, LogProbOptions};
use rlhf_models::CausalLm;
use rlhf_trainer::random_qwen2::{write_qwen2, Qwen2Shape};
use tch::{Device, Kind, Tensor};

/// At most this many operators per layer that the pass and the autograd engine dispatch
/// themselves (94 when this was set, on the CPU, where `rms_norm`'s backward is composite).
const BUDGET: usize = 110;

/// The operators of a forward and backward pass of the mean token log-prob of a left-padded
/// batch (4 rows of 24, wide enough that the layers take their row-major GEMMs) through a
/// `layers`-layer random Qwen2.
fn pass_ops(layers: i64, dir: &std::path::Path) -> rlhf_aten::op_count::OpCount {
    let shape = Qwen2Shape { layers, ..Qwen2Shape::SMALL };
    write_qwen2(dir, &shape, Kind::Float, 3).unwrap();
    let m = CausalLm::from_dir(dir, Device::Cpu, Kind::Float).unwrap();
    m.set_training(true);
    let ids = Tensor::arange_start(1, 97, (Kind::Int64, Device::Cpu)).view([4, 24]);
    let mask = Tensor::ones([4, 24], (Kind::Int64, Device::Cpu));
    let _ = mask.get(0).narrow(0, 0, 3).fill_(0);
    let pass = || {
        let (lp, pass) = token_logprobs_pass(&m, &ids, &mask, 1, LogProbOptions::default(), false).unwrap();
        lp.logprobs.mean(Kind::Float).neg().backward();
        pass.backward(&m).unwrap();
    };
    pass();
    rlhf_aten::op_count::count(pass).unwrap().1
}

#[test]
fn a_trained_layer_dispatches_few_operators() {
    let tmp = tempfile::tempdir().unwrap();
    let one = pass_ops(1, &tmp.path().join("one"));
    let two = pass_ops(2, &tmp.path().join("two"));
    let outer = two.outer.len() - one.outer.len();
    println!(
        "training pass of a random Qwen2 (f32, CPU): {outer} operators per layer, forward and backward ({} with 1 \
         layer, {} with 2), {} with the nested ones",
        one.outer.len(),
        two.outer.len(),
        two.total() - one.total()
    );
    assert!(
        outer <= BUDGET,
        "a decoder layer's training pass dispatches {outer} ATen operators (budget {BUDGET}); the 2-layer pass's:\n{}",
        two.outer.join("\n")
    );
}
