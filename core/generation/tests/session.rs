//! A multi-turn decode [`Session`] — chunks of different lengths appended per row, finished rows'
//! slots masked, the cache compacted between turns, a cached last token fed again — gives the
//! logits and greedy tokens of prefilling each row's whole context afresh, on the fixture
//! checkpoints of the llama, qwen2 and gpt2 families.

use std::path::PathBuf;

use rlhf_generation::{generate_until, left_pad, GenerateConfig, Session};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

fn model(name: &str) -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models").join(name);
    CausalLm::from_dir(&dir, Device::Cpu, Kind::Float).unwrap()
}

/// Greedy decode of `new` tokens (no EOS) from fresh contexts: per row its tokens, and the
/// logits of the contexts' last position `[b, vocab]`.
fn fresh(m: &CausalLm, contexts: &[Vec<i64>], new: i64) -> (Vec<Vec<i64>>, Tensor) {
    let p = left_pad(contexts, 0, Device::Cpu).unwrap();
    let cfg = GenerateConfig::greedy(new, vec![], 0);
    let g = generate_until(m, &p.input_ids, &p.attention_mask, &cfg, None).unwrap();
    let pos = rlhf_models::position_ids_from_mask(&p.attention_mask).unwrap();
    let h = m.hidden_states(&p.input_ids, &p.attention_mask, &pos, None).unwrap();
    let last = m.logits_from_hidden(&h.select(1, h.size()[1] - 1)).unwrap();
    (rows(&g.responses().unwrap()), last)
}

fn rows(t: &Tensor) -> Vec<Vec<i64>> {
    rlhf_generation::batch::to_rows(t).unwrap()
}

#[test]
fn a_session_continues_as_a_fresh_prefill_would() {
    for family in ["llama", "qwen2", "gpt2"] {
        let m = model(family);
        let mut ctx: Vec<Vec<i64>> = vec![vec![5, 9, 33, 120], vec![7, 64], vec![300, 11, 12, 13, 14], vec![8]];
        let cfg = GenerateConfig::greedy(4, vec![], 0);
        // Turn 0: the session's prefill and decode are the plain ones.
        let (mut s, logits) = Session::start(&m, &ctx, 0, 1, cfg.max_new_tokens).unwrap();
        let turn = s.decode(&m, logits, &[false; 4], &cfg, None).unwrap();
        let (want, _) = fresh(&m, &ctx, 4);
        assert_eq!(rows(&turn.tokens), want, "{family}: turn 0");
        // Every token but the last sampled is cached.
        assert_eq!(turn.cached, vec![3; 4], "{family}");
        // Turn 1: rows gain observations of different lengths; row 3 is done (nothing appended,
        // finished from the start); row 1 gains nothing but its last sampled token.
        let obs: [&[i64]; 4] = [&[40, 41, 42], &[], &[50], &[]];
        let mut chunks = Vec::new();
        for (r, c) in ctx.iter_mut().enumerate() {
            let sampled = &want[r];
            let chunk: Vec<i64> = if r == 3 { vec![] } else { [&sampled[3..], obs[r]].concat() };
            c.extend_from_slice(sampled);
            c.extend_from_slice(obs[r]);
            chunks.push(chunk);
        }
        // Row 1 feeds its last token again (its cached slot masked), as a turn does when a row
        // gained nothing since its last token was cached.
        let width = chunks.iter().map(Vec::len).max().unwrap() as i64;
        s.compact(width + 4).unwrap();
        let logits = s.append(&m, &chunks, 0).unwrap();
        let running = [0usize, 1, 2];
        let (want, fresh_logits) = fresh(&m, &ctx[..3], 4);
        let diff = (logits.narrow(0, 0, 3) - &fresh_logits).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{family}: turn-1 logits differ by {diff}");
        let turn = s.decode(&m, logits, &[false, false, false, true], &cfg, None).unwrap();
        let got = rows(&turn.tokens);
        for &r in &running {
            assert_eq!(got[r], want[r], "{family}: turn 1, row {r}");
        }
        assert_eq!(turn.cached[3], 0, "{family}: a done row caches nothing");
        // Turn 2 after a compaction: row 0 gains one observation token.
        for &r in &running {
            ctx[r].extend_from_slice(&got[r]);
        }
        ctx[0].push(77);
        let chunks = vec![vec![got[0][3], 77], vec![got[1][3]], vec![got[2][3]], vec![]];
        s.compact(2 + 4).unwrap();
        let logits = s.append(&m, &chunks, 0).unwrap();
        let (want, fresh_logits) = fresh(&m, &ctx[..3], 4);
        let diff = (logits.narrow(0, 0, 3) - &fresh_logits).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{family}: turn-2 logits differ by {diff}");
        let got = rows(&s.decode(&m, logits, &[false, false, false, true], &cfg, None).unwrap().tokens);
        assert_eq!(&got[..3], &want[..], "{family}: turn 2");
    }
}

#[test]
fn a_cached_last_token_fed_again_is_seen_once() {
    let m = model("llama");
    let ctx = vec![vec![5i64, 9, 33], vec![7, 64, 2, 3]];
    let cfg = GenerateConfig::greedy(2, vec![], 0);
    let (mut s, logits) = Session::start(&m, &ctx, 0, 1, 2).unwrap();
    let turn = s.decode(&m, logits, &[false, false], &cfg, None).unwrap();
    let sampled = rows(&turn.tokens);
    // Feed row 0's cached first token again after masking its slot, with its last token: the
    // context is unchanged, so the logits are the fresh ones of prompt + both tokens.
    s.compact(3 + 2).unwrap();
    s.unmask_last(&[0]).unwrap();
    let logits = s.append(&m, &[vec![sampled[0][0], sampled[0][1]], vec![sampled[1][1]]], 0).unwrap();
    let full: Vec<Vec<i64>> = ctx.iter().zip(&sampled).map(|(c, t)| [c.as_slice(), t].concat()).collect();
    let (_, fresh_logits) = fresh(&m, &full, 1);
    let diff = (logits - fresh_logits).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "{diff}");
}
