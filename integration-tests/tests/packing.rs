//! Packed rows: several examples in one row with a segment-numbered attention mask (1, 2, ...; 0 =
//! padding) give every example exactly the logits it gets alone — attention stays inside each
//! example and positions restart — on every model family.

use rlhf_integration_tests::model_dir;
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

#[test]
fn packed_examples_get_their_unpacked_logits() {
    let a = [5i64, 9, 12];
    let b = [3i64, 7, 1, 2];
    for name in ["llama", "qwen2", "gpt2"] {
        let m = CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let alone = |ids: &[i64]| {
            let n = ids.len() as i64;
            tch::no_grad(|| {
                m.forward(&Tensor::from_slice(ids).view([1, n]), &Tensor::ones([1, n], (Kind::Int64, Device::Cpu)))
            })
            .unwrap()
        }; // [1, n, vocab]
        let packed_ids = Tensor::from_slice(&[5i64, 9, 12, 3, 7, 1, 2, 0]).view([1, 8]);
        let segments = Tensor::from_slice(&[1i64, 1, 1, 2, 2, 2, 2, 0]).view([1, 8]);
        let packed = tch::no_grad(|| m.forward(&packed_ids, &segments)).unwrap(); // [1, 8, vocab]
        let da = (packed.narrow(1, 0, 3) - alone(&a)).abs().max().double_value(&[]);
        let db = (packed.narrow(1, 3, 4) - alone(&b)).abs().max().double_value(&[]);
        assert!(da < 1e-5 && db < 1e-5, "{name}: packed vs alone differ by {da:e} / {db:e}");
        // A plain mask over the same row lets the second example see the first: the logits change.
        let plain = tch::no_grad(|| m.forward(&packed_ids, &segments.ne(0).to_kind(Kind::Int64))).unwrap();
        let crossed = (plain.narrow(1, 3, 4) - alone(&b)).abs().max().double_value(&[]);
        assert!(crossed > 1e-4, "{name}: the plain mask should differ ({crossed:e})");
    }
}
