//! The capture-safe decode, run eagerly on the CPU: its noise is keyed by (key, global row,
//! step), so a row samples the same tokens alone, in its batch, in any window of rows (the rows of
//! a data-parallel rank) and after finished rows were compacted away; a seeded run repeats; greedy
//! decoding equals the argmax of full forwards.

use std::path::PathBuf;

use rlhf_generation::{compactions, generate, left_pad, GenerateConfig, RowWindow, Sampling};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

fn model(name: &str) -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models").join(name);
    CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap()
}

fn prompts() -> Vec<Vec<i64>> {
    vec![vec![5, 9, 33, 120, 7], vec![7, 64], vec![300, 11, 12, 13], vec![8], vec![40, 41, 42], vec![99, 3]]
}

/// Each row's response tokens up to and including its last one (the rest is padding).
fn responses(m: &CausalLm, rows: &[Vec<i64>], cfg: &GenerateConfig) -> Vec<Vec<i64>> {
    let p = left_pad(rows, 0, Device::Cpu).unwrap();
    let g = generate(m, &p.input_ids, &p.attention_mask, cfg).unwrap();
    let tokens = rlhf_generation::batch::to_rows(&g.responses().unwrap()).unwrap();
    let mask = rlhf_generation::batch::to_rows(&g.response_mask).unwrap();
    tokens.iter().zip(&mask).map(|(t, k)| t.iter().zip(k).filter(|(_, &k)| k == 1).map(|(&t, _)| t).collect()).collect()
}

fn sampled(key: u64) -> GenerateConfig {
    let mut cfg = GenerateConfig::greedy(12, vec![], 0);
    cfg.sampling = Sampling::Sample { temperature: 1.0, top_k: Some(40), top_p: Some(0.9) };
    cfg.noise_key = Some(key);
    cfg
}

/// EOS ids that stop most rows early: the tokens the rows sample at their third step.
fn early_eos(m: &CausalLm, cfg: &GenerateConfig) -> Vec<i64> {
    let all = responses(m, &prompts(), cfg);
    let mut ids: Vec<i64> = all.iter().take(4).map(|r| r[2]).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[test]
fn a_row_samples_the_same_tokens_alone_in_its_batch_and_after_compaction() {
    for family in ["llama", "qwen2", "gpt2"] {
        let m = model(family);
        let mut cfg = sampled(7);
        cfg.eos_token_ids = early_eos(&m, &cfg);
        let before = compactions();
        let batch = responses(&m, &prompts(), &cfg);
        assert!(compactions() > before, "{family}: rows stopped, the batch was compacted");
        let lens: Vec<usize> = batch.iter().map(Vec::len).collect();
        assert!(lens.iter().any(|&l| l < 12) && lens.iter().any(|&l| l != lens[0]), "{family}: {batch:?}");
        for (r, p) in prompts().iter().enumerate() {
            let alone = GenerateConfig { rows: Some(RowWindow { offset: r as i64, total: 6 }), ..cfg.clone() };
            assert_eq!(responses(&m, std::slice::from_ref(p), &alone)[0], batch[r], "{family}: row {r}");
        }
        // Two windows of rows (two ranks) sample the whole batch.
        let (a, b) = (prompts()[..4].to_vec(), prompts()[4..].to_vec());
        let first = GenerateConfig { rows: Some(RowWindow { offset: 0, total: 6 }), ..cfg.clone() };
        let second = GenerateConfig { rows: Some(RowWindow { offset: 4, total: 6 }), ..cfg.clone() };
        let joined = [responses(&m, &a, &first), responses(&m, &b, &second)].concat();
        assert_eq!(joined, batch, "{family}: two windows");
    }
}

#[test]
fn the_key_decides_the_samples_and_a_seed_repeats_them() {
    let m = model("llama");
    let a = responses(&m, &prompts(), &sampled(1));
    assert_eq!(responses(&m, &prompts(), &sampled(1)), a);
    assert_ne!(responses(&m, &prompts(), &sampled(2)), a);
    // Without a key, it is drawn from libtorch's (seeded) generator.
    let seeded = |seed| GenerateConfig { noise_key: None, seed: Some(seed), ..sampled(0) };
    let s = responses(&m, &prompts(), &seeded(5));
    assert_eq!(responses(&m, &prompts(), &seeded(5)), s);
    assert_ne!(responses(&m, &prompts(), &seeded(6)), s);
}

/// Greedy decoding is the argmax of full forwards over each prefix (no cache), row by row.
#[test]
fn greedy_decode_equals_the_argmax_of_full_forwards() {
    for family in ["llama", "qwen2", "gpt2"] {
        let m = model(family);
        let cfg = GenerateConfig::greedy(6, vec![], 0);
        let got = responses(&m, &prompts(), &cfg);
        for (r, p) in prompts().iter().enumerate() {
            let mut seq = p.clone();
            for (step, &token) in got[r].iter().enumerate() {
                let ids = Tensor::from_slice(&seq).view([1, -1]);
                let logits = tch::no_grad(|| m.forward(&ids, &ids.ones_like())).unwrap();
                let next = logits.select(1, seq.len() as i64 - 1).argmax(-1, false).int64_value(&[0]);
                assert_eq!(token, next, "{family}: row {r} step {step}");
                seq.push(next);
            }
            assert_eq!(got[r].len(), 6, "{family}: row {r}");
        }
    }
}

/// The decode step reads and writes the cache at a slot held on the device and attends over
/// every slot: its logits equal the growing-cache forward's.
#[test]
fn a_decode_step_equals_the_cached_forward() {
    for family in ["llama", "qwen2", "gpt2"] {
        let m = model(family);
        let p = left_pad(&prompts(), 0, Device::Cpu).unwrap();
        let (b, len) = (p.input_ids.size()[0], p.input_ids.size()[1]);
        let pos = rlhf_models::position_ids_from_mask(&p.attention_mask).unwrap();
        let next = Tensor::from_slice(&[3i64, 4, 5, 6, 7, 8]).view([b, 1]);
        let next_pos = pos.narrow(1, len - 1, 1) + 1;
        let want = tch::no_grad(|| {
            let mut cache = m.new_cache(b, len + 1).unwrap();
            let _ = m.hidden_states(&p.input_ids, &p.attention_mask, &pos, Some(&mut cache)).unwrap();
            let mask = Tensor::cat(&[&p.attention_mask, &Tensor::ones([b, 1], (Kind::Int64, Device::Cpu))], 1);
            let h = m.hidden_states(&next, &mask, &next_pos, Some(&mut cache)).unwrap();
            m.logits_from_hidden(&h.select(1, 0)).unwrap()
        });
        let got = tch::no_grad(|| {
            let capacity = len + 5;
            let mut cache = m.new_cache(b, capacity).unwrap();
            let _ = m.hidden_states(&p.input_ids, &p.attention_mask, &pos, Some(&mut cache)).unwrap();
            let key_mask = Tensor::zeros([b, capacity], (Kind::Int64, Device::Cpu));
            key_mask.narrow(1, 0, len).copy_(&p.attention_mask);
            let _ = key_mask.narrow(1, len, 1).fill_(1);
            let slot = Tensor::from_slice(&[len]);
            m.decode_step(&next, &next_pos, &key_mask, &slot, &mut cache).unwrap()
        });
        let d = (&got - &want).abs().max().double_value(&[]);
        assert!(d < 1e-4, "{family}: {d}");
    }
}
