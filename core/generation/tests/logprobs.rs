//! Chunked log-probs and entropy against a direct full-vocabulary computation, on a tiny fixture
//! Llama; chunk size must not change results, and gradients must reach the parameters.

use std::path::PathBuf;

use rlhf_generation::{generate, left_pad, token_logprobs, GenerateConfig, LogProbOptions};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

/// libtorch's default generator is process-wide and the tests of this file run on parallel
/// threads: a test that seeds it and samples holds this lock, or another test's draws land between
/// its seed and its samples (seen once as the same tokens shifted by two rows).
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model() -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models/llama");
    CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap()
}

fn batch() -> (Tensor, Tensor) {
    let b = left_pad(&[vec![5, 9, 33, 120, 7, 64, 2], vec![300, 11, 12]], 0, Device::Cpu).unwrap();
    (b.input_ids, b.attention_mask)
}

#[test]
fn chunked_logprobs_equal_full_log_softmax() {
    let m = model();
    let (ids, mask) = batch();
    let full = tch::no_grad(|| m.forward(&ids, &mask)).unwrap().log_softmax(-1, Kind::Float); // [2, 7, V]
    let from = 2;
    let n = 7 - from;
    let expected = full.narrow(1, from - 1, n).gather(2, &ids.narrow(1, from, n).unsqueeze(-1), false).squeeze_dim(-1);
    let p = full.exp();
    let expected_entropy = -(p * full).sum_dim_intlist(-1, false, Kind::Float).narrow(1, from - 1, n);
    for max_chunk_elements in [1, 400 * 3, 1 << 26] {
        let opts =
            LogProbOptions { max_chunk_elements, entropy: true, share_prefix: false, pack: false, pack_width: 0 };
        let lp = tch::no_grad(|| token_logprobs(&m, &ids, &mask, from, opts)).unwrap();
        assert_eq!(lp.logprobs.size(), [2, n]);
        let d = (&lp.logprobs - &expected).abs().max().double_value(&[]);
        let e = (lp.entropy.unwrap() - &expected_entropy).abs().max().double_value(&[]);
        assert!(d < 1e-5 && e < 1e-4, "chunk {max_chunk_elements}: logprob diff {d}, entropy diff {e}");
    }
}

#[test]
fn gradients_flow_through_logprobs() {
    let m = model();
    let (ids, mask) = batch();
    let lp = token_logprobs(
        &m,
        &ids,
        &mask,
        1,
        LogProbOptions { max_chunk_elements: 800, entropy: false, share_prefix: false, pack: false, pack_width: 0 },
    )
    .unwrap();
    lp.logprobs.sum(Kind::Float).backward();
    for (name, v) in m.vs.variables() {
        let g = v.grad();
        assert!(g.defined(), "{name} has no gradient");
        assert!(g.abs().sum(Kind::Float).double_value(&[]) > 0.0, "{name} has a zero gradient");
    }
}

#[test]
fn eos_stops_each_row_and_masks_the_rest() {
    let m = model();
    let (ids, mask) = batch();
    // Make every token an EOS for the first step of row 0 only by choosing row 0's greedy first token.
    let first = tch::no_grad(|| m.forward(&ids, &mask)).unwrap().select(1, 6).argmax(-1, false);
    let eos_row0 = first.int64_value(&[0]);
    let eos_row1 = first.int64_value(&[1]);
    assert_ne!(eos_row0, eos_row1, "fixture rows must start differently for this test");
    let cfg = GenerateConfig::greedy(6, vec![eos_row0], 0);
    let out = generate(&m, &ids, &mask, &cfg).unwrap();
    let resp = out.responses().unwrap();
    let rmask = &out.response_mask;
    assert_eq!(resp.int64_value(&[0, 0]), eos_row0, "EOS is part of the response");
    assert_eq!(rmask.int64_value(&[0, 0]), 1);
    let steps = resp.size()[1];
    for t in 1..steps {
        assert_eq!(rmask.int64_value(&[0, t]), 0, "row 0 is masked after its EOS");
        assert_eq!(resp.int64_value(&[0, t]), 0, "row 0 is padded after its EOS");
    }
    let len1 = out.response_lengths().unwrap().int64_value(&[1]);
    assert!(len1 >= 1, "row 1 keeps generating");
    assert_eq!(out.attention_mask.size()[1], 7 + steps);
}

/// Prompts prefilled once per group of identical rows generate what prefilling every row does:
/// the same tokens (sampled, same seed) and the same masks; rows that are not such groups are an
/// input error.
#[test]
fn prefill_once_per_group_generates_what_every_row_does() {
    let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let m = model();
    let rows: Vec<Vec<i64>> = [vec![5, 9, 33, 120, 7, 64, 2], vec![300, 11, 12]]
        .iter()
        .flat_map(|r| std::iter::repeat_n(r.clone(), 3))
        .collect();
    let b = left_pad(&rows, 0, Device::Cpu).unwrap();
    let mut cfg = GenerateConfig::greedy(8, vec![], 0);
    cfg.sampling = rlhf_generation::Sampling::Sample { temperature: 1.0, top_k: None, top_p: None };
    cfg.seed = Some(7);
    let every = generate(&m, &b.input_ids, &b.attention_mask, &cfg).unwrap();
    cfg.prefill_group = 3;
    let once = generate(&m, &b.input_ids, &b.attention_mask, &cfg).unwrap();
    assert!(every.sequences.equal(&once.sequences), "{} vs {}", every.sequences, once.sequences);
    assert!(every.attention_mask.equal(&once.attention_mask));
    // Samples of one prompt still differ from each other.
    assert!(
        !once.sequences.get(0).equal(&once.sequences.get(1)) || !once.sequences.get(1).equal(&once.sequences.get(2))
    );
    for (group, what) in
        [(4, "divide the batch of 6 rows"), (2, "not runs of 2 identical prompts"), (0, "must be >= 1")]
    {
        cfg.prefill_group = group;
        let e = generate(&m, &b.input_ids, &b.attention_mask, &cfg).unwrap_err().to_string();
        assert!(e.contains(what), "{group}: {e}");
    }
}

/// The log-probs `generate` returns for its sampled tokens are the model's own log-probs of them
/// (what `token_logprobs` computes over the finished sequences), 0 after a row's EOS.
#[test]
fn generated_logprobs_are_the_models_logprobs_of_the_sampled_tokens() {
    let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let m = model();
    let (ids, mask) = batch();
    let mut cfg = GenerateConfig::greedy(6, vec![7], 0);
    cfg.sampling = rlhf_generation::Sampling::Sample { temperature: 1.0, top_k: None, top_p: None };
    cfg.seed = Some(3);
    cfg.logprobs = true;
    let out = generate(&m, &ids, &mask, &cfg).unwrap();
    let lp = out.logprobs.as_ref().expect("asked for");
    let steps = out.response_mask.size()[1];
    assert_eq!(lp.size(), [2, steps]);
    let want = tch::no_grad(|| {
        token_logprobs(&m, &out.sequences, &out.attention_mask, out.prompt_len, LogProbOptions::default())
    })
    .unwrap()
    .logprobs
        * out.response_mask.to_kind(Kind::Float);
    let d = (lp - &want).abs().max().double_value(&[]);
    assert!(d < 1e-5, "max |Δ log-prob| {d}");
    assert!(lp.lt(0.0).logical_and(&out.response_mask.ne(0)).any().int64_value(&[]) == 1);
}
