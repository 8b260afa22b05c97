//! Activation checkpointing changes memory, not gradients: on every fixture family (Llama with and
//! without tied embeddings, Qwen2, GPT-2), a loss on checkpointed log-probs (and on checkpointed
//! critic values) gives the parameter gradients that the plain pass gives, within f32 rounding,
//! with the LM head recomputed chunk by chunk in the backward. So does the training pass without
//! checkpointing, whose head keeps no logits either.

mod grads;

use grads::{assert_same_grads, fixture, take_grads};

use rlhf_generation::{left_pad, token_logprobs, token_logprobs_checkpointed, token_logprobs_pass, LogProbOptions};
use rlhf_models::{CausalLm, LoraConfig, ScalarHeadModel};
use tch::{Device, Kind, Tensor};

fn batch() -> (Tensor, Tensor) {
    let b = left_pad(&[vec![5, 9, 33, 120, 7, 64, 2], vec![300, 11, 12]], 0, Device::Cpu).unwrap();
    (b.input_ids, b.attention_mask)
}

/// A loss that uses the log-probs and the entropy with weights, as a policy loss does.
fn loss(lp: &rlhf_generation::TokenLogProbs) -> Tensor {
    let w = Tensor::arange(lp.logprobs.size()[1], (Kind::Float, Device::Cpu)).g_add_scalar(1.0);
    (&lp.logprobs * &w).sum(Kind::Float) - 0.1 * lp.entropy.as_ref().unwrap().sum(Kind::Float)
}

/// Checkpointed log-probs of `ids` from `from` on, with `opts`, against the plain pass with the
/// same options: the same log-probs and gradients on every family, with and without LoRA.
fn check_logprobs(ids: &Tensor, mask: &Tensor, from: i64, opts: LogProbOptions) {
    for name in ["llama", "llama-tied", "qwen2", "gpt2"] {
        for lora in [false, true] {
            let mut m = CausalLm::from_dir(&fixture(name), Device::Cpu, Kind::Float).unwrap();
            if lora {
                let cfg = LoraConfig {
                    rank: 4,
                    alpha: 8.0,
                    dropout: 0.0,
                    target_modules: vec!["all-linear".into()],
                    ..Default::default()
                };
                assert!(m.apply_lora(&cfg).unwrap() > 0);
                // Non-zero B so the adapters change the output and get gradients through it.
                for (n, mut v) in m.vs.variables() {
                    if n.contains("lora_B") {
                        tch::no_grad(|| v.copy_(&(v.randn_like() * 0.1)));
                    }
                }
            }
            let what = format!(
                "{name}{}{}",
                if lora { " + LoRA" } else { "" },
                if opts.share_prefix { ", shared prompts" } else { "" }
            );
            let plain_lp = token_logprobs(&m, ids, mask, from, opts).unwrap();
            loss(&plain_lp).backward();
            let plain = take_grads(&m.vs);

            let (lp, ck) = token_logprobs_checkpointed(&m, ids, mask, from, opts).unwrap();
            let d = (&lp.logprobs - &plain_lp.logprobs).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{what}: the checkpointed pass computes the same log-probs ({d})");
            loss(&lp).backward();
            ck.backward(&m).unwrap();
            assert_same_grads(&what, &plain, &take_grads(&m.vs));
            // The training pass with the layers' graph and the chunked head.
            let (lp, pass) = token_logprobs_pass(&m, ids, mask, from, opts, false).unwrap();
            let d = (&lp.logprobs - &plain_lp.logprobs).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{what}: the chunked-head pass computes the same log-probs ({d})");
            loss(&lp).backward();
            pass.backward(&m).unwrap();
            assert_same_grads(&format!("{what}, chunked head"), &plain, &take_grads(&m.vs));
        }
    }
}

#[test]
fn checkpointed_logprobs_give_the_plain_gradients() {
    let (ids, mask) = batch();
    check_logprobs(
        &ids,
        &mask,
        2,
        LogProbOptions { max_chunk_elements: 800, entropy: true, share_prefix: false, pack: false, pack_width: 0 },
    );
}

/// With prompts shared by several rows ([`LogProbOptions::share_prefix`]) the checkpointed pass
/// recomputes the prompts and the rest of the rows layer by layer together.
#[test]
fn checkpointed_shared_prompt_logprobs_give_the_plain_gradients() {
    let (a, b) = (vec![5, 9, 33, 120, 7, 64, 2], vec![300, 11, 12]);
    let prompts = left_pad(&[a.clone(), b.clone(), a.clone(), a, b], 0, Device::Cpu).unwrap();
    let completions = [vec![17, 3, 99, 4], vec![8], vec![17, 250, 6], vec![40, 41, 42, 43], vec![8, 9]];
    let rest = rlhf_generation::right_pad(&completions, 0, Device::Cpu).unwrap();
    let ids = Tensor::cat(&[&prompts.input_ids, &rest.input_ids], 1);
    let mask = Tensor::cat(&[&prompts.attention_mask, &rest.attention_mask], 1);
    let opts =
        LogProbOptions { max_chunk_elements: 800, entropy: true, share_prefix: true, pack: false, pack_width: 0 };
    check_logprobs(&ids, &mask, 7, opts);
}

#[test]
fn checkpointed_critic_values_give_the_plain_gradients() {
    let (ids, mask) = batch();
    for name in ["llama", "gpt2"] {
        let m = ScalarHeadModel::from_causal_lm_dir(&fixture(name), Device::Cpu, Kind::Float).unwrap();
        let w = Tensor::arange(7, (Kind::Float, Device::Cpu)).g_sub_scalar(3.0);
        let plain_v = m.values(&ids, &mask).unwrap();
        (&plain_v * &w).square().sum(Kind::Float).backward();
        let plain = take_grads(&m.vs);
        let (v, ck) = m.values_checkpointed(&ids, &mask).unwrap();
        assert!(v.allclose(&plain_v, 1e-6, 1e-6, false), "{name}: the same values");
        (&v * &w).square().sum(Kind::Float).backward();
        m.backward_checkpointed(&ck).unwrap();
        assert_same_grads(&format!("{name} critic"), &plain, &take_grads(&m.vs));
    }
}

/// A loss that does not reach the pass leaves every gradient untouched.
#[test]
fn a_pass_the_loss_does_not_use_changes_nothing() {
    let m = CausalLm::from_dir(&fixture("llama"), Device::Cpu, Kind::Float).unwrap();
    let (ids, mask) = batch();
    let (_lp, ck) = token_logprobs_checkpointed(&m, &ids, &mask, 2, LogProbOptions::default()).unwrap();
    ck.backward(&m).unwrap();
    assert!(take_grads(&m.vs).is_empty());
}

/// The checkpointed pass keeps no graph of its LM head either: its log-probs and entropy are
/// leaves, so no chunk's `[rows, vocab]` logits outlive the forward. Its backward recomputes the
/// head chunk by chunk (here one row of logits per chunk) and gives the plain pass's gradients for
/// a loss on the log-probs alone and on the entropy alone.
#[test]
fn the_checkpointed_head_is_recomputed_chunk_by_chunk() {
    let (ids, mask) = batch();
    let m = CausalLm::from_dir(&fixture("llama-tied"), Device::Cpu, Kind::Float).unwrap();
    let vocab = m.arch().vocab_size;
    let opts =
        LogProbOptions { max_chunk_elements: vocab, entropy: true, share_prefix: false, pack: false, pack_width: 0 };
    type Loss = fn(&rlhf_generation::TokenLogProbs) -> Tensor;
    let losses: [(&str, Loss); 2] = [
        ("log-probs", |lp| lp.logprobs.square().sum(Kind::Float)),
        ("entropy", |lp| lp.entropy.as_ref().unwrap().sum(Kind::Float)),
    ];
    for (what, loss) in losses {
        let plain_lp = token_logprobs(&m, &ids, &mask, 2, opts).unwrap();
        loss(&plain_lp).backward();
        let plain = take_grads(&m.vs);
        let (lp, ck) = token_logprobs_checkpointed(&m, &ids, &mask, 2, opts).unwrap();
        for t in [&lp.logprobs, lp.entropy.as_ref().unwrap()] {
            assert!(t.is_leaf() && t.requires_grad(), "{what}: the pass's outputs are graph-free leaves");
        }
        loss(&lp).backward();
        ck.backward(&m).unwrap();
        assert_same_grads(what, &plain, &take_grads(&m.vs));
    }
}
