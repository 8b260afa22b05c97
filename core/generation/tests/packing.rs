//! Padding-free log-prob passes ([`LogProbOptions::pack`]) compute what the padded passes do: on
//! every fixture family, the log-probs and entropy of the real tokens and the parameter gradients
//! of a loss over them (as a policy loss masks its padding) equal the padded pass's within f32
//! rounding — without a graph, with the layers' graph and the chunked head, and checkpointed; so
//! do they with shared prompts laid once in the packed rows ([`Packing::sharing`]). So do a
//! critic's values.

mod grads;

use grads::{assert_same_grads, fixture, take_grads};

use rlhf_generation::{token_logprobs, token_logprobs_pass, LogProbOptions, TokenLogProbs};
use rlhf_models::{CausalLm, Packing, PassCost, ScalarHeadModel, SharedPrefixes};
use tch::{Device, Kind, Tensor};

/// Rows as the trainer lays them out: each prompt left-padded to `prompt_width` columns, each
/// response right-padded to `response_width`; returns ids and mask `[rows, prompt_width +
/// response_width]`.
fn lay_out(rows: &[(&[i64], &[i64])], prompt_width: usize, response_width: usize) -> (Tensor, Tensor) {
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for (prompt, response) in rows {
        let row: Vec<Option<i64>> = std::iter::repeat_n(None, prompt_width - prompt.len())
            .chain(prompt.iter().map(|&t| Some(t)))
            .chain(response.iter().map(|&t| Some(t)))
            .chain(std::iter::repeat_n(None, response_width - response.len()))
            .collect();
        ids.extend(row.iter().map(|t| t.unwrap_or(0)));
        mask.extend(row.iter().map(|t| i64::from(t.is_some())));
    }
    let shape = [rows.len() as i64, (prompt_width + response_width) as i64];
    (Tensor::from_slice(&ids).view(shape), Tensor::from_slice(&mask).view(shape))
}

/// Prompts left-padded to 3 columns and responses right-padded to 5: 8, 3, 3 and 7 real tokens,
/// which pack into three rows of 8 (8 | 3 + 3 | 7).
fn batch() -> (Tensor, Tensor) {
    let rows: [(&[i64], &[i64]); 4] =
        [(&[5, 9, 33], &[120, 7, 64, 2, 18]), (&[300], &[11, 12]), (&[40, 41], &[42]), (&[7, 8, 9], &[10, 11, 12, 13])];
    lay_out(&rows, 3, 5)
}

/// GRPO's layout: two prompts (of 4 tokens, and of 2 left-padded to 4) with three samples each,
/// interleaved, completions right-padded to 6. Laid once per packed row the prompts take three
/// rows of 10 (A + 2 + 1 + 3 | B + 2 + 6 | B + 1); packed whole the rows take four, and the
/// shared-prefix pass 2 × 4 + 6 × 6 = 44 slots.
fn grouped_batch() -> (Tensor, Tensor) {
    let (a, b): (&[i64], &[i64]) = (&[5, 9, 33, 120], &[300, 11]);
    let rows: [(&[i64], &[i64]); 6] =
        [(a, &[7, 64]), (b, &[40, 41]), (a, &[2]), (b, &[70, 71, 72, 73, 74, 75]), (a, &[18, 19, 20]), (b, &[8])];
    lay_out(&rows, 4, 6)
}

/// A policy-like loss over the real targets: weighted log-probs minus a share of the entropy.
fn loss(lp: &TokenLogProbs, targets: &Tensor) -> Tensor {
    let w = Tensor::arange(lp.logprobs.size()[1], (Kind::Float, Device::Cpu)).g_add_scalar(1.0) * targets;
    (&lp.logprobs * &w).sum(Kind::Float) - 0.1 * (lp.entropy.as_ref().unwrap() * targets).sum(Kind::Float)
}

/// The largest difference of two passes' log-probs and entropy at the real targets.
fn max_diff(a: &TokenLogProbs, b: &TokenLogProbs, targets: &Tensor) -> f64 {
    let d = |x: &Tensor, y: &Tensor| ((x - y) * targets).abs().max().double_value(&[]);
    d(&a.logprobs, &b.logprobs).max(d(a.entropy.as_ref().unwrap(), b.entropy.as_ref().unwrap()))
}

/// On the four fixture families, the padding-free passes (`share`: with shared prompts laid once)
/// of `ids` from `from` give the padded pass's log-probs, entropy and gradients: without a graph,
/// with the layers' graph, and checkpointed. 8 rows of the head's logits at a time, so the target
/// rows take several chunks and the training passes recompute the head chunk by chunk.
fn assert_packed_passes_equal_padded(ids: &Tensor, mask: &Tensor, from: i64, share: bool, pack_width: i64) {
    let seq = ids.size()[1];
    let targets = mask.narrow(1, from, seq - from).to_kind(Kind::Float);
    let how = if share { "packed with shared prompts" } else { "packed" };
    for name in ["llama", "llama-tied", "qwen2", "gpt2"] {
        let m = CausalLm::from_dir(&fixture(name), Device::Cpu, Kind::Float).unwrap();
        assert!(m.packs_shared_prompts(pack_width.max(seq)), "{name} attends by the mask alone");
        let elements = 8 * m.arch().vocab_size;
        let padded_opts = LogProbOptions {
            max_chunk_elements: elements,
            entropy: true,
            share_prefix: false,
            pack: false,
            pack_width: 0,
        };
        let packed_opts = LogProbOptions { pack: true, share_prefix: share, pack_width, ..padded_opts };
        let padded = token_logprobs(&m, ids, mask, from, padded_opts).unwrap();
        loss(&padded, &targets).backward();
        let want = take_grads(&m.vs);

        let packed = token_logprobs(&m, ids, mask, from, packed_opts).unwrap();
        let d = max_diff(&padded, &packed, &targets);
        assert!(d < 1e-5, "{name}, {how}: log-probs and entropy within {d}");
        loss(&packed, &targets).backward();
        assert_same_grads(&format!("{name}, {how}"), &want, &take_grads(&m.vs));

        for checkpointed in [false, true] {
            let what = format!("{name}, {how}, training pass (checkpointed: {checkpointed})");
            let (lp, pass) = token_logprobs_pass(&m, ids, mask, from, packed_opts, checkpointed).unwrap();
            let d = max_diff(&padded, &lp, &targets);
            assert!(d < 1e-5, "{what}: log-probs and entropy within {d}");
            loss(&lp, &targets).backward();
            pass.backward(&m).unwrap();
            assert_same_grads(&what, &want, &take_grads(&m.vs));
        }
    }
}

#[test]
fn the_batch_packs_into_fewer_rows() {
    let (ids, mask) = batch();
    let p = Packing::new(&ids, &mask).unwrap().unwrap();
    assert_eq!(p.rows(), 3);
}

#[test]
fn packed_passes_equal_the_padded_ones_in_values_and_gradients() {
    let (ids, mask) = batch();
    assert_packed_passes_equal_padded(&ids, &mask, 3, false, 0);
}

#[test]
fn shared_prompts_pack_into_fewer_rows() {
    let (ids, mask) = grouped_batch();
    let prefix = SharedPrefixes::find(&ids, &mask, 4).unwrap();
    assert_eq!(prefix.of_row, [0, 1, 0, 1, 0, 1]);
    assert_eq!(Packing::sharing(&ids, &mask, &prefix, 0).unwrap().unwrap().rows(), 3);
    assert_eq!(Packing::new(&ids, &mask).unwrap().unwrap().rows(), 4);
    // Rows of 20: each prompt once, all its rows after it (10 and 11 tokens: two rows, 40 slots
    // against 3 × 10); rows of 30 hold all 21 tokens in one.
    let wide = Packing::sharing(&ids, &mask, &prefix, 20).unwrap().unwrap();
    assert_eq!((wide.rows(), wide.slots()), (2, 40));
    assert!(Packing::sharing(&ids, &mask, &prefix, 30).unwrap().is_some_and(|p| p.slots() == 30));
    // What the passes run on the fixture: rows of 11, the widest prompt with all its rows, each
    // prompt's rows laid a prompt at a time (in the rows' order the second prompt's would take a
    // third row: A + 2 + B + 2 + 1 | B + 6 + 1 | A + 3).
    let m = CausalLm::from_dir(&fixture("llama"), Device::Cpu, Kind::Float).unwrap();
    let cost = PassCost::of(m.arch());
    let p = Packing::cheapest(&ids, &mask, Some(&prefix), 0, &|_| true, cost).unwrap().unwrap();
    assert_eq!((p.rows(), p.width()), (2, 11));
}

/// Packed rows at least 20 wide (as DPO asks for) hold a prompt and all its rows: the passes
/// (the packed layout's 40 slots against 44 for the shared prompts padded, the cheaper on the
/// fixtures, so it is the one that runs) equal the padded pass's too.
#[test]
fn wide_packed_rows_with_shared_prompts_equal_the_padded_pass() {
    let (ids, mask) = grouped_batch();
    assert_packed_passes_equal_padded(&ids, &mask, 4, true, 20);
}

/// With shared prompts laid once per packed row every pass computes the padded pass's log-probs,
/// entropy and gradients. The cheapest layout here is two rows of 11, each prompt with all its
/// rows after it (22 slots, against 30 in rows of the batch's width 10).
#[test]
fn packed_shared_prompts_equal_the_padded_passes_in_values_and_gradients() {
    let (ids, mask) = grouped_batch();
    assert_packed_passes_equal_padded(&ids, &mask, 4, true, 0);
}

/// A critic's values padding-free equal the padded ones, and their gradients: its rows packed
/// whole, and with shared prompts laid once (the grouped batch's prompts of 4 tokens).
#[test]
fn packed_critic_values_equal_the_padded_ones_in_values_and_gradients() {
    for ((ids, mask), shared_prompt) in [(batch(), None), (grouped_batch(), Some(4))] {
        assert_packed_critic_values_equal_padded(&ids, &mask, shared_prompt);
    }
}

fn assert_packed_critic_values_equal_padded(ids: &Tensor, mask: &Tensor, shared_prompt: Option<i64>) {
    let real = mask.to_kind(Kind::Float);
    let seq = ids.size()[1];
    let loss = |v: &Tensor| (v * &real * Tensor::arange(seq, (Kind::Float, Device::Cpu))).square().sum(Kind::Float);
    for name in ["llama", "qwen2", "gpt2"] {
        let c = ScalarHeadModel::from_causal_lm_dir(&fixture(name), Device::Cpu, Kind::Float).unwrap();
        for checkpointed in [false, true] {
            let what = format!("{name} critic (checkpointed: {checkpointed}, shared prompt: {shared_prompt:?})");
            let (padded, ck) = c.values_pass(ids, mask, checkpointed).unwrap();
            loss(&padded).backward();
            if let Some(ck) = &ck {
                c.backward_checkpointed(ck).unwrap();
            }
            let want = take_grads(&c.vs);
            let (packed, ck) = c.values_pass_packed(ids, mask, checkpointed, shared_prompt).unwrap();
            let d = ((&packed - &padded) * &real).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{what}: values within {d}");
            let pad = (&packed * real.ones_like().g_sub(&real)).abs().max().double_value(&[]);
            assert_eq!(pad, 0.0, "{what}: 0 at the padding");
            loss(&packed).backward();
            if let Some(ck) = &ck {
                c.backward_checkpointed(ck).unwrap();
            }
            assert_same_grads(&what, &want, &take_grads(&c.vs));
        }
    }
}
