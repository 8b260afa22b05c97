//! DeepSpeed-Chat's pairwise ranking loss (`RewardModel.forward` in DeepSpeed-Chat's
//! `dschat/utils/model/reward_model.py`) against an independent reference: `hf_check.py dsc-loss`
//! runs the same reward-model checkpoint in transformers on right-padded pairs and applies
//! DeepSpeed-Chat's index arithmetic (first pad, `max(c_ind, r_ind)`, first divergence). The tail of the shorter side is read at its padding positions, so this also pins
//! what padding queries see (the real tokens before them, as in transformers).

use rlhf_integration_tests::{hf_check, model_dir, python};
use rlhf_models::ScalarHeadModel;
use rlhf_trainer::pairs::{collate_pairs, pairwise_loss, PairExample, RmLoss};
use tch::{Device, Kind};

#[test]
fn dsc_loss_matches_deepspeed_chat_in_transformers() {
    let Some(py) = python() else { return };
    // Rejected shorter, chosen shorter, equal lengths with one differing token.
    let pairs = [
        (vec![5i64, 6, 7, 8, 9, 10], vec![5i64, 6, 7, 11]),
        (vec![5, 6, 12], vec![5, 6, 12, 13, 14]),
        (vec![3, 4, 5, 6], vec![3, 4, 9, 6]),
    ];
    let examples: Vec<PairExample> =
        pairs.iter().map(|(c, r)| PairExample { chosen: c.clone(), rejected: r.clone(), line: 1 }).collect();
    let refs: Vec<&PairExample> = examples.iter().collect();
    let json =
        serde_json::to_string(&pairs.iter().map(|(c, r)| vec![c.clone(), r.clone()]).collect::<Vec<_>>()).unwrap();
    for family in ["llama-rm", "gpt2-rm"] {
        let dir = model_dir(family);
        let model = ScalarHeadModel::from_dir(&dir, Device::Cpu, Kind::Float).unwrap();
        let pad = 0;
        let batch = collate_pairs(&refs, pad, Device::Cpu).unwrap();
        let values = tch::no_grad(|| model.values(&batch.input_ids, &batch.attention_mask)).unwrap(); // [2B, T]
        let n = pairs.len() as i64;
        let (c, r) = (values.narrow(0, 0, n), values.narrow(0, n, n));
        let ours = pairwise_loss(RmLoss::Dsc, &c, &r, &batch.segment, &batch.chosen_last, &batch.rejected_last)
            .unwrap()
            .per_pair;
        let ours = Vec::<f32>::try_from(ours).unwrap();

        let reference = hf_check(&py, &["dsc-loss", "--model", dir.to_str().unwrap(), "--pairs", &json]);
        let theirs: Vec<f64> = reference["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let their_values: Vec<Vec<f64>> = reference["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect())
            .collect();
        let our_values = Vec::<Vec<f32>>::try_from(values).unwrap();
        println!("{family}: DSC loss ours {ours:?}, DeepSpeed-Chat in transformers {theirs:?}");
        // Every position, padding included: the loss reads the shorter side's padding.
        for (row, (a, b)) in our_values.iter().zip(&their_values).enumerate() {
            for (t, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((f64::from(*x) - y).abs() <= 1e-5, "{family}: value [{row}, {t}]: {x} vs {y}");
            }
        }
        for (i, (x, y)) in ours.iter().zip(&theirs).enumerate() {
            assert!((f64::from(*x) - y).abs() <= 1e-5, "{family}: pair {i}: loss {x} vs {y}");
        }
    }
}

/// `train.padding_free` (with the last-token loss): the pairs' rows packed without their padding
/// give the padded pass's scores, losses and every parameter's gradient within float rounding —
/// on pairs of 2 to 12 tokens that pack into fewer rows than the batch's, with and without
/// gradient checkpointing.
#[test]
fn padding_free_pairs_train_as_padded_ones() {
    use rlhf_trainer::rm::{forward_pairs, PassOptions};
    let lengths = [(12usize, 2usize), (3, 9), (4, 5), (6, 3)];
    let examples: Vec<PairExample> = lengths
        .iter()
        .enumerate()
        .map(|(i, &(c, r))| {
            let side = |n: usize, base: i64| (0..n as i64).map(|t| 3 + (base + 5 * t + i as i64) % 40).collect();
            PairExample { chosen: side(c, 1), rejected: side(r, 2), line: i + 1 }
        })
        .collect();
    let refs: Vec<&PairExample> = examples.iter().collect();
    for family in ["llama-rm", "gpt2-rm"] {
        let model = ScalarHeadModel::from_dir(&model_dir(family), Device::Cpu, Kind::Float).unwrap();
        let batch = collate_pairs(&refs, 0, Device::Cpu).unwrap();
        let cost = rlhf_models::PassCost::of(model.arch());
        let packing =
            rlhf_models::Packing::cheapest(&batch.input_ids, &batch.attention_mask, None, 12, &|_| false, cost)
                .unwrap();
        let rows = packing.map(|p| p.rows());
        assert!(rows.is_some_and(|r| r < 8), "{family}: 8 rows of 12 should pack into fewer: {rows:?}");
        // The packed pass runs: it leaves 0 at the padding, where the padded pass has values.
        let (ids, mask) = (&batch.input_ids, &batch.attention_mask);
        let (packed, _) = tch::no_grad(|| model.values_pass_packed(ids, mask, false, None)).unwrap();
        let (padded, _) = tch::no_grad(|| model.values_pass(ids, mask, false)).unwrap();
        let pad = mask.eq(0);
        assert_eq!(packed.masked_select(&pad).abs().max().double_value(&[]), 0.0, "{family}");
        assert!(padded.masked_select(&pad).abs().max().double_value(&[]) > 0.0, "{family}");
        for checkpointing in [false, true] {
            let run = |padding_free: bool| {
                for v in model.vs.trainable_variables() {
                    let mut g = v.grad();
                    if g.defined() {
                        let _ = g.zero_();
                    }
                }
                let pass = PassOptions { checkpointing, padding_free };
                let (out, tokens, ck) = forward_pairs(&model, &refs, 0, RmLoss::LastToken, pass).unwrap();
                out.per_pair.mean(Kind::Float).backward();
                if let Some(ck) = &ck {
                    model.backward_checkpointed(ck).unwrap();
                }
                let grads: std::collections::BTreeMap<String, tch::Tensor> =
                    model.vs.variables().into_iter().map(|(name, v)| (name, v.grad().copy())).collect();
                (out, tokens, grads)
            };
            let (padded, tokens, g_padded) = run(false);
            let (packed, packed_tokens, g_packed) = run(true);
            assert_eq!(tokens, packed_tokens);
            let close = |what: &str, a: &tch::Tensor, b: &tch::Tensor, tol: f64| {
                let d = (a - b).abs().max().double_value(&[]);
                assert!(d <= tol, "{family}, checkpointing {checkpointing}: {what}: max |Δ| = {d:e}");
            };
            close("per-pair loss", &padded.per_pair, &packed.per_pair, 1e-5);
            close("chosen scores", &padded.chosen_scores, &packed.chosen_scores, 1e-5);
            close("rejected scores", &padded.rejected_scores, &packed.rejected_scores, 1e-5);
            assert_eq!(g_padded.len(), g_packed.len());
            for ((name, a), (_, b)) in g_padded.iter().zip(&g_packed) {
                close(&format!("gradient of {name}"), a, b, 1e-5 * a.abs().max().double_value(&[]).max(1.0));
            }
        }
    }
}
