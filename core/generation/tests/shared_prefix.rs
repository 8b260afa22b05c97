//! A prompt shared by several rows computed once ([`LogProbOptions::share_prefix`]) gives the
//! log-probs, entropies and parameter gradients of the plain pass, on the fixture checkpoints of
//! every family, with prompts of different lengths, rows of one prompt scattered through the batch
//! and completions of different lengths.

use std::path::PathBuf;

use rlhf_generation::{left_pad, right_pad, token_logprobs, LogProbOptions};
use rlhf_models::{CausalLm, SharedPrefixes};
use tch::{Device, Kind, Tensor};

fn model(name: &str) -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models").join(name);
    CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap()
}

/// Left-padded prompts followed by right-padded completions, as rollouts lay them out.
///
/// # Shapes
/// returns ids and mask `[rows, P + R]` and `P`
fn rows(prompts: &[&[i64]], completions: &[&[i64]]) -> (Tensor, Tensor, i64) {
    let owned = |r: &[&[i64]]| r.iter().map(|x| x.to_vec()).collect::<Vec<_>>();
    let p = left_pad(&owned(prompts), 0, Device::Cpu).unwrap();
    let c = right_pad(&owned(completions), 0, Device::Cpu).unwrap();
    let ids = Tensor::cat(&[&p.input_ids, &c.input_ids], 1);
    let mask = Tensor::cat(&[&p.attention_mask, &c.attention_mask], 1);
    (ids, mask, p.input_ids.size()[1])
}

/// Log-probs, entropy and every parameter's gradient of `Σ w·logp + 0.1 Σ entropy`.
fn pass(m: &CausalLm, ids: &Tensor, mask: &Tensor, from: i64, share: bool) -> (Tensor, Tensor, Vec<Tensor>) {
    for (_, v) in m.vs.variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let opts =
        LogProbOptions { max_chunk_elements: 1000, entropy: true, share_prefix: share, pack: false, pack_width: 0 };
    let lp = token_logprobs(m, ids, mask, from, opts).unwrap();
    let entropy = lp.entropy.unwrap();
    let w = Tensor::arange(lp.logprobs.numel() as i64, (Kind::Float, Device::Cpu)).view(lp.logprobs.size().as_slice());
    let loss = (&lp.logprobs * (w.sin() + 1.5)).sum(Kind::Float) + entropy.sum(Kind::Float) * 0.1;
    loss.backward();
    let vars: std::collections::BTreeMap<String, Tensor> = m.vs.variables().into_iter().collect();
    let grads = vars.into_values().map(|v| v.grad().copy()).collect();
    (lp.logprobs.detach(), entropy.detach(), grads)
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn a_shared_prompt_computed_once_matches_the_plain_pass() {
    let (a, b): (&[i64], &[i64]) = (&[5, 9, 33, 120, 7, 64, 2], &[300, 11, 12]);
    let prompts = [a, b, a, a, b];
    let completions: [&[i64]; 5] = [&[17, 3, 99, 4], &[8], &[17, 250, 6], &[40, 41, 42, 43], &[8, 9]];
    let (ids, mask, from) = rows(&prompts, &completions);
    let shared = SharedPrefixes::find(&ids, &mask, from).unwrap();
    assert_eq!(shared.first, vec![0, 1]);
    assert_eq!(shared.of_row, vec![0, 1, 0, 0, 1]);
    for family in ["llama", "llama-tied", "qwen2", "gpt2"] {
        let m = model(family);
        let (lp0, ent0, g0) = pass(&m, &ids, &mask, from, false);
        let (lp1, ent1, g1) = pass(&m, &ids, &mask, from, true);
        assert_eq!(lp1.size(), lp0.size());
        let (d, e) = (max_abs(&lp0, &lp1), max_abs(&ent0, &ent1));
        assert!(d < 1e-5 && e < 1e-4, "{family}: log-prob diff {d}, entropy diff {e}");
        for (x, y) in g0.iter().zip(&g1) {
            let scale = x.abs().max().double_value(&[]).max(1e-3);
            let d = max_abs(x, y) / scale;
            assert!(d < 1e-4, "{family}: gradient differs by {d} of its largest entry");
        }
    }
}

#[test]
fn without_shared_prompts_it_is_the_plain_pass_bit_for_bit() {
    let (ids, mask, from) = rows(&[&[5, 9, 33], &[300, 11, 12, 13]], &[&[17, 3], &[8]]);
    assert!(!SharedPrefixes::find(&ids, &mask, from).unwrap().any_shared());
    let m = model("llama");
    let (lp0, ent0, g0) = pass(&m, &ids, &mask, from, false);
    let (lp1, ent1, g1) = pass(&m, &ids, &mask, from, true);
    assert!(lp0.equal(&lp1) && ent0.equal(&ent1));
    assert!(g0.iter().zip(&g1).all(|(x, y)| x.equal(y)));
}

#[test]
fn rows_with_the_same_ids_but_another_mask_do_not_share() {
    // The same prompt ids, one row with its first token masked out: two different prompts.
    let ids = Tensor::from_slice(&[4i64, 5, 6, 7, 4, 5, 6, 8]).view([2, 4]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 0, 1, 1, 1]).view([2, 4]);
    assert!(!SharedPrefixes::find(&ids, &mask, 3).unwrap().any_shared());
    let e = SharedPrefixes::find(&ids, &mask, 5).unwrap_err().to_string();
    assert!(e.contains("shared prefix of 5 tokens in rows of 4"), "{e}");
}
