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
