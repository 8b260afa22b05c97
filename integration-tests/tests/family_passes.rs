//! Passes over the newer families' tiny random checkpoints (`fixtures/make_families.py`) that
//! compute what one plain pass computes: a prompt computed once for the rows that share it, a
//! checkpointed pass, and padding-free passes with shared prompts laid once in the packed rows —
//! hidden states or log-probs, and every parameter's gradient.

mod family_common;

use family_common::{load, masked_max_abs_diff, models, tol_for, LINEAR_TOL};
use rlhf_integration_tests::FAMILIES;
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

/// What a layer reads beside its input survives a prompt computed once for the rows that share it
/// then continued, and a checkpointed pass recomputing one layer at a time: both compute what one
/// plain pass computes — hidden states and every parameter's gradient. Linear attention carries
/// its state where attention carries keys and values (Qwen3.5); Gemma 4's last layers reuse
/// earlier layers' keys and values and every layer reads its per-layer input.
#[test]
fn side_inputs_continue_across_shared_prompts_and_checkpointed_layers() {
    let Some(root) = models() else { return };
    let cases = [("qwen3_5", "A_log"), ("gemma4", "layers.1.self_attn.k_proj"), ("gemma4-moe", "layers.0.router.proj")];
    for (name, witness) in cases {
        shared_prompts_and_checkpointing_match_a_plain_pass(&load(&root.join(name)), name, witness);
    }
}

/// The check of [`side_inputs_continue_across_shared_prompts_and_checkpointed_layers`] on one model
/// (hidden size 32); `witness` names a parameter whose gradient must not be zero.
fn shared_prompts_and_checkpointing_match_a_plain_pass(model: &CausalLm, name: &str, witness: &str) {
    // Two prompts (the second left-padded by 2), each shared by two rows; responses right-padded.
    let ids = Tensor::from_slice(&[
        5i64, 17, 42, 9, 101, 7, 3, 64, 12, 250, 0, 0, //
        5, 17, 42, 9, 101, 7, 8, 33, 0, 0, 0, 0, //
        0, 0, 77, 21, 60, 14, 90, 91, 92, 93, 94, 95, //
        0, 0, 77, 21, 60, 14, 4, 0, 0, 0, 0, 0,
    ])
    .view([4, 12]);
    let mask = Tensor::from_slice(&[
        1i64, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, //
        1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, //
        0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, //
        0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,
    ])
    .view([4, 12]);
    let p = 6;
    let pos = rlhf_models::position_ids_from_mask(&mask).unwrap();
    let plain = tch::no_grad(|| model.hidden_states(&ids, &mask, &pos, None)).unwrap();
    let prefix = rlhf_models::SharedPrefixes::find(&ids, &mask, p).unwrap();
    assert!(prefix.any_shared());
    let shared = tch::no_grad(|| model.hidden_states_after_prefix(&ids, &mask, &prefix)).unwrap();
    let tail = mask.narrow(1, p - 1, 12 - p + 1);
    let diff = masked_max_abs_diff(&shared, &plain.narrow(1, p - 1, 12 - p + 1), &tail);
    // 1e-5 of the largest hidden value (Gemma 4's reach 10 and more).
    let tol = 1e-5 * plain.abs().max().double_value(&[]).max(1.0);
    assert!(diff < tol, "{name}: shared prompts differ by {diff}");

    // Gradients of one loss, plain and checkpointed, over all positions and then after the
    // shared prompts.
    let weights = Tensor::randn([4, 12, 32], (Kind::Float, Device::Cpu));
    let (a, b) = (
        grads_of(model, || (model.hidden_states(&ids, &mask, &pos, None).unwrap() * &weights).sum(Kind::Float)),
        grads_of(model, || {
            let ck = model.hidden_states_checkpointed(&ids, &mask, &pos).unwrap();
            (ck.hidden() * &weights).sum(Kind::Float).backward();
            model.backward_checkpointed(&ck).unwrap();
            Tensor::zeros([], (Kind::Float, Device::Cpu))
        }),
    );
    assert!(
        a.iter().any(|(n, g)| n.contains(witness) && g.abs().sum(Kind::Float).double_value(&[]) > 0.0),
        "{name}: no gradient on {witness}"
    );
    assert_close(name, "checkpointed", &a, &b);
    let tail_weights = weights.narrow(1, p - 1, 12 - p + 1);
    let (a, b) = (
        grads_of(model, || {
            (model.hidden_states_after_prefix(&ids, &mask, &prefix).unwrap() * &tail_weights).sum(Kind::Float)
        }),
        grads_of(model, || {
            let ck = model.hidden_states_checkpointed_after_prefix(&ids, &mask, &prefix).unwrap();
            (ck.hidden() * &tail_weights).sum(Kind::Float).backward();
            model.backward_checkpointed(&ck).unwrap();
            Tensor::zeros([], (Kind::Float, Device::Cpu))
        }),
    );
    assert_close(name, "checkpointed shared-prompt", &a, &b);
}

/// A padding-free pass with shared prompts ([`LogProbOptions`] `pack` and `share_prefix`) computes
/// the padded pass's log-probs and gradients on every family: those that attend by the mask alone
/// lay each prompt once per packed row (OLMo 2, Qwen3-MoE: the other fixtures have windows of 5),
/// those with a window narrower than the rows or with linear attention pack their rows whole.
#[test]
fn packed_shared_prompts_equal_the_padded_pass_on_every_family() {
    let Some(root) = models() else { return };
    // Two prompts with three samples each, interleaved; rows of 10 (prompt width 4).
    let (a, b): (&[i64], &[i64]) = (&[5, 9, 33, 12], &[30, 11]);
    let prompts: Vec<Vec<i64>> = [a, b, a, b, a, b].iter().map(|p| p.to_vec()).collect();
    let completions: Vec<Vec<i64>> = [&[7i64, 64][..], &[40, 41], &[2], &[70, 71, 72, 73, 74, 75], &[18, 19, 20], &[8]]
        .map(<[i64]>::to_vec)
        .to_vec();
    let p = rlhf_generation::left_pad(&prompts, 0, Device::Cpu).unwrap();
    let c = rlhf_generation::right_pad(&completions, 0, Device::Cpu).unwrap();
    let ids = Tensor::cat(&[&p.input_ids, &c.input_ids], 1);
    let mask = Tensor::cat(&[&p.attention_mask, &c.attention_mask], 1);
    let targets = c.attention_mask.to_kind(Kind::Float);
    let weights = Tensor::arange(6 * 6, (Kind::Float, Device::Cpu)).view([6, 6]).sin() + 1.5;
    let mut shared = Vec::new();
    for name in FAMILIES {
        let dir = root.join(name);
        let model = load(&dir);
        let opts = rlhf_generation::LogProbOptions { max_chunk_elements: 1 << 20, ..Default::default() };
        let packed_opts = rlhf_generation::LogProbOptions { pack: true, share_prefix: true, ..opts };
        let mut logprobs = Vec::new();
        let mut grads = Vec::new();
        for o in [opts, packed_opts] {
            grads.push(grads_of(&model, || {
                let lp = rlhf_generation::token_logprobs(&model, &ids, &mask, 4, o).unwrap().logprobs;
                logprobs.push(lp.detach());
                (lp * &weights * &targets).sum(Kind::Float)
            }));
        }
        let diff = masked_max_abs_diff(&logprobs[0], &logprobs[1], &targets);
        let tol = tol_for(name, &dir, "");
        assert!(diff < tol, "{name}: packed shared-prompt log-probs differ by {diff}");
        // The chunked delta rule runs other chunks on packed rows: its gradients measured within
        // 5.2e-5 of their largest entry (log-probs within 2.8e-5), given the logits' margin.
        let rel = if name.starts_with("qwen3_5") || name == &"qwen3_next" { LINEAR_TOL } else { 1e-5 };
        let worst = assert_within(name, "packed shared-prompt", &grads[0], &grads[1], rel);
        println!("{name}: log-probs within {diff:.1e}, gradients within {worst:.1e}");
        if model.packs_shared_prompts(10) {
            shared.push(*name);
        }
    }
    println!("prompts laid once per packed row on: {shared:?}");
    for name in ["olmo2", "qwen3_moe"] {
        assert!(shared.contains(&name), "{name} attends by the mask alone");
    }
    for name in ["qwen3", "gemma2", "mistral", "qwen3_5", "gpt_oss", "gemma4"] {
        assert!(!shared.contains(&name), "{name} has a narrow window or linear attention");
    }
}

/// Every parameter's gradient (but the LM head's, not in these losses, and a vision tower's, which
/// a text pass does not reach) after backpropagating the
/// loss `f` returns (`f` may backpropagate itself and return a constant), from zeroed gradients.
fn grads_of(model: &CausalLm, f: impl FnOnce() -> Tensor) -> Vec<(String, Tensor)> {
    for t in model.vs.variables().values() {
        let mut g = t.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let loss = f();
    if loss.requires_grad() {
        loss.backward();
    }
    let mut out: Vec<(String, Tensor)> = model
        .vs
        .variables()
        .into_iter()
        .filter(|(n, t)| n != "lm_head.weight" && t.grad().defined())
        .map(|(n, t)| (n, t.grad().copy()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Each gradient of `b` within 1e-5 of the largest entry of `a`'s (at least 1).
fn assert_close(name: &str, how: &str, a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_within(name, how, a, b, 1e-5);
}

/// Each gradient of `b` within `rel` of the largest entry of `a`'s (at least 1); the largest such
/// ratio.
fn assert_within(name: &str, how: &str, a: &[(String, Tensor)], b: &[(String, Tensor)], rel: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "{name}: {how}: the same parameters get gradients");
    let mut worst = 0.0f64;
    for ((param, ga), (_, gb)) in a.iter().zip(b) {
        let diff = (ga - gb).abs().max().double_value(&[]) / ga.abs().max().double_value(&[]).max(1.0);
        assert!(diff < rel, "{name}: {param} {how} gradient differs by {diff} of its largest entry");
        worst = worst.max(diff);
    }
    worst
}
