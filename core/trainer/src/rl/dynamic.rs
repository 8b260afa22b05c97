//! DAPO's dynamic sampling (Yu et al. 2025, §3.2; verl's `algorithm.filter_groups`): a group
//! whose samples all score the same has zero advantage under GRPO's group baseline and teaches
//! nothing, so it is dropped and more prompts are sampled until the step holds
//! `prompts_per_batch` groups with differing scores, or `max_gen_batches` generation batches have
//! been sampled. The decisions are made on the scores of the whole batch, which every
//! data-parallel rank holds, so every rank keeps the same groups.

use std::collections::HashMap;

use tch::Tensor;

use crate::error::{Result, TrainerError};
use crate::rl::experience::Selected;
use crate::rl::score::{Scored, SourceScores};

/// The value a group's samples must not all share, per scored row: the weighted reward
/// (`metric = "reward"`), or the score `metric` names (one of `names`, the step's score names in
/// the order of `scores`), looked up by row in `kept_rows` (the rows `scores` are for).
pub fn values(
    metric: &str,
    names: &[String],
    scores: &[SourceScores],
    kept_rows: &[usize],
    scored: &Scored,
) -> Result<Vec<f64>> {
    if metric == "reward" {
        return Ok(scored.rewards.clone());
    }
    let i = names
        .iter()
        .position(|n| n == metric)
        .ok_or_else(|| TrainerError::Config(format!("rollout.filter_groups.metric: no score named `{metric}`")))?;
    let at: HashMap<usize, usize> = kept_rows.iter().enumerate().map(|(k, &r)| (r, k)).collect();
    Ok(scored.rows.iter().map(|r| scores[i].scores[at[r]]).collect())
}

/// The groups (a row's group is `row / g`) whose `values` are not all equal, in row order; a
/// group with one scored sample has nothing to compare and is dropped too.
pub fn varied_groups(rows: &[usize], values: &[f64], g: usize) -> Vec<usize> {
    let mut order: Vec<usize> = Vec::new();
    let mut seen: HashMap<usize, (f64, bool)> = HashMap::new();
    for (&r, &v) in rows.iter().zip(values) {
        match seen.get_mut(&(r / g)) {
            Some((first, varied)) => *varied |= v != *first,
            None => {
                seen.insert(r / g, (v, false));
                order.push(r / g);
            }
        }
    }
    order.into_iter().filter(|k| seen[k].1).collect()
}

/// `scored` restricted to the rows of `groups`.
pub fn keep_groups(scored: &Scored, groups: &[usize], g: usize) -> Scored {
    let (rows, rewards) = scored
        .rows
        .iter()
        .zip(&scored.rewards)
        .filter(|(r, _)| groups.contains(&(*r / g)))
        .map(|(&r, &x)| (r, x))
        .unzip();
    Scored { rows, rewards }
}

/// `t` `[n, w]` widened to `[n, left + w + right]` with `value` on both sides.
fn pad2(t: &Tensor, left: i64, right: i64, value: f64) -> Result<Tensor> {
    if left == 0 && right == 0 {
        return Ok(t.shallow_clone());
    }
    let (n, w) = (t.size()[0], t.size()[1]);
    let out = Tensor::f_full([n, left + w + right], value, (t.kind(), t.device()))?;
    out.f_narrow(1, left, w)?.f_copy_(t)?;
    Ok(out)
}

/// One batch of the selected rows of several generation batches: prompts left-padded and
/// responses right-padded to the widest, `pad` in the ids, 0 in the masks and behaviour log-probs.
/// Parts without rows are skipped (all of them empty: the first one).
///
/// # Shapes
/// Each part: `sequences`, `attention_mask` `[n_i, P_i + R_i]`, `action_mask` and
/// `behavior_logprobs` `[n_i, R_i]`, `rewards`, `group_ids`, `records` `[n_i]`; returns `[Σ n_i, P + R]` with
/// `P = max P_i`, `R = max R_i`.
pub fn concat(mut parts: Vec<Selected>, pad: i64) -> Result<Selected> {
    if parts.iter().all(|p| p.rewards.size()[0] == 0) {
        return parts.into_iter().next().ok_or_else(|| TrainerError::Run("no generation batch".into()));
    }
    parts.retain(|p| p.rewards.size()[0] > 0);
    if parts.len() == 1 {
        return parts.pop().ok_or_else(|| TrainerError::Run("no generation batch".into()));
    }
    let p = parts.iter().map(|s| s.prompt_len).max().unwrap_or(0);
    let r = parts.iter().map(|s| s.action_mask.size()[1]).max().unwrap_or(0);
    let (mut seqs, mut attn, mut act, mut beh) = (vec![], vec![], vec![], vec![]);
    for s in &parts {
        let (left, right) = (p - s.prompt_len, r - s.action_mask.size()[1]);
        seqs.push(pad2(&s.sequences, left, right, pad as f64)?);
        attn.push(pad2(&s.attention_mask, left, right, 0.0)?);
        act.push(pad2(&s.action_mask, 0, right, 0.0)?);
        if let Some(b) = &s.behavior_logprobs {
            beh.push(pad2(b, 0, right, 0.0)?);
        }
    }
    let cat = |xs: &[Tensor]| Tensor::f_cat(xs, 0);
    let rewards: Vec<Tensor> = parts.iter().map(|s| s.rewards.shallow_clone()).collect();
    let groups: Vec<Tensor> = parts.iter().map(|s| s.group_ids.shallow_clone()).collect();
    let records: Vec<Tensor> = parts.iter().map(|s| s.records.shallow_clone()).collect();
    Ok(Selected {
        sequences: cat(&seqs)?,
        attention_mask: cat(&attn)?,
        action_mask: cat(&act)?,
        prompt_len: p,
        rewards: cat(&rewards)?,
        group_ids: cat(&groups)?,
        records: cat(&records)?,
        behavior_logprobs: if beh.len() == parts.len() { Some(cat(&beh)?) } else { None },
        // Found again from `records` ([`crate::rl::visual`]).
        images: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn only_groups_whose_scores_differ_are_kept_in_order() {
        // G = 4: group 0 all right, 1 mixed, 2 all wrong, 3 mixed with a dropped row, 4 one row.
        let rows = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16];
        let vals = [1., 1., 1., 1., 0., 1., 0., 1., 0., 0., 0., 0., 0.5, 0.5, 0.2, 0.7];
        assert_eq!(varied_groups(&rows, &vals, 4), [1, 3]);
        let scored = Scored { rows: rows.to_vec(), rewards: vals.to_vec() };
        let kept = keep_groups(&scored, &[3], 4);
        assert_eq!((kept.rows, kept.rewards), (vec![12, 13, 15], vec![0.5, 0.5, 0.2]));
    }

    #[test]
    fn a_named_score_is_looked_up_by_row() {
        let names = vec!["acc".to_string(), "format".to_string()];
        let scores = vec![
            SourceScores { scores: vec![1., 0., 1.], metrics: vec![] },
            SourceScores { scores: vec![0.2, 0.3, 0.4], metrics: vec![] },
        ];
        let scored = Scored { rows: vec![0, 5], rewards: vec![1.2, 1.4] };
        let kept_rows = [0, 2, 5];
        assert_eq!(values("reward", &names, &scores, &kept_rows, &scored).unwrap(), [1.2, 1.4]);
        assert_eq!(values("format", &names, &scores, &kept_rows, &scored).unwrap(), [0.2, 0.4]);
        assert!(values("nope", &names, &scores, &kept_rows, &scored).is_err());
    }

    fn part(prompt: &[&[i64]], resp: &[&[i64]], reward: f32) -> Selected {
        let p = prompt[0].len();
        let rows: Vec<Vec<i64>> = prompt.iter().zip(resp).map(|(a, b)| [*a, *b].concat()).collect();
        let flat: Vec<i64> = rows.concat();
        let n = rows.len() as i64;
        let seq = Tensor::from_slice(&flat).view([n, -1]);
        let attn = seq.ne(0).to_kind(Kind::Int64);
        let act = seq.narrow(1, p as i64, seq.size()[1] - p as i64).ne(0).to_kind(Kind::Float);
        Selected {
            sequences: seq,
            attention_mask: attn,
            behavior_logprobs: Some(act.shallow_clone() * -0.5),
            action_mask: act,
            prompt_len: p as i64,
            rewards: Tensor::from_slice(&vec![reward; n as usize]),
            group_ids: Tensor::from_slice(&vec![7i64; n as usize]),
            records: Tensor::from_slice(&vec![3i64; n as usize]),
            images: None,
        }
    }

    /// Two generation batches of different prompt and response widths (pad 0) become one.
    #[test]
    fn parts_are_padded_to_the_widest_and_stacked() {
        let a = part(&[&[0, 5, 6]], &[&[7, 8]], 1.0);
        let b = part(&[&[9], &[4]], &[&[3, 2, 1], &[3, 0, 0]], 0.0);
        let empty = part(&[&[1]], &[&[1]], 0.0);
        let empty = Selected {
            sequences: empty.sequences.narrow(0, 0, 0),
            attention_mask: empty.attention_mask.narrow(0, 0, 0),
            action_mask: empty.action_mask.narrow(0, 0, 0),
            behavior_logprobs: None,
            rewards: empty.rewards.narrow(0, 0, 0),
            group_ids: empty.group_ids.narrow(0, 0, 0),
            records: empty.records.narrow(0, 0, 0),
            images: None,
            prompt_len: 1,
        };
        let s = concat(vec![a, empty, b], 0).unwrap();
        assert_eq!(s.prompt_len, 3);
        let rows = |t: &Tensor| -> Vec<Vec<i64>> { Vec::<Vec<i64>>::try_from(t.to_kind(Kind::Int64)).unwrap() };
        assert_eq!(rows(&s.sequences), [[0, 5, 6, 7, 8, 0], [0, 0, 9, 3, 2, 1], [0, 0, 4, 3, 0, 0]]);
        assert_eq!(rows(&s.attention_mask), [[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]);
        assert_eq!(rows(&s.action_mask), [[1, 1, 0], [1, 1, 1], [1, 0, 0]]);
        let beh = Vec::<Vec<f32>>::try_from(s.behavior_logprobs.unwrap()).unwrap();
        assert_eq!(beh, [[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5], [-0.5, 0.0, 0.0]]);
        assert_eq!(Vec::<f32>::try_from(&s.rewards).unwrap(), [1.0, 0.0, 0.0]);
    }
}
