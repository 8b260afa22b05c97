//! A minibatch's micro-batches: the forward and backward passes an optimizer step accumulates.
//!
//! Without a token budget each rank's share of a minibatch is one micro-batch, as it always was.
//! With `train.micro_batch_tokens` (verl's `use_dynamic_bsz` with `ppo_max_token_len_per_gpu`)
//! each rank's share is split into the fewest micro-batches whose real tokens (prompt and
//! completion, no padding) stay within the budget, balanced by tokens: rows longest first, each
//! to the micro-batch holding the fewest tokens so far (Graham's LPT rule), one more micro-batch
//! whenever that overflows. A row longer than the budget is a micro-batch of its own. Every rank
//! runs as many micro-batches as the rank that needs the most (each one ends with the engines'
//! collectives), so a rank may have empty ones; every rank computes every rank's plan from the
//! gathered batch, so no collective decides it. The plugins' per-token and per-sample means are
//! over the whole optimizer step (`step_tokens`, `step_rows`), so however the rows fall the step's
//! gradient is the one of the minibatches whole, within float rounding.
//!
//! With shared prompts (`train.share_prompts`) a prompt is computed once only for the rows of
//! one micro-batch, so the planner also places whole groups by the same LPT rule (a group over
//! the budget first cut into full parts and a remainder) and keeps that plan where it computes
//! fewer tokens, each micro-batch's prompts counted once. The budget still counts every row's
//! prompt: a micro-batch never holds more than it did.

use std::collections::{HashMap, HashSet};

use rlhf_collective::World;
use tch::{Device, Kind, Tensor};

use crate::dist;
use crate::error::Result;

/// One minibatch's micro-batches on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroPlan {
    /// `parts[rank][micro]`: batch rows, in the minibatch's order.
    parts: Vec<Vec<Vec<i64>>>,
}

impl MicroPlan {
    /// The micro-batches of `minibatch` (batch rows, shuffled) on each of `world_size` ranks,
    /// rank `r` holding its [`dist::shard`] of the rows. `lengths[row]` is the row's real tokens;
    /// `groups` the rows' prompt groups ([`Groups::default`]: rows placed one by one); `budget`
    /// the most tokens a micro-batch holds (`None`: one micro-batch per rank).
    pub fn new(minibatch: &[i64], lengths: &[i64], groups: &Groups, budget: Option<usize>, world_size: usize) -> Self {
        let shares: Vec<&[i64]> =
            (0..world_size).map(|r| &minibatch[dist::shard(minibatch.len(), r, world_size)]).collect();
        let Some(budget) = budget else {
            return MicroPlan { parts: shares.iter().map(|s| vec![s.to_vec()]).collect() };
        };
        let budget = budget.max(1) as i64;
        // The fewest micro-batches every rank fits in (LPT may need more bins with more rows).
        let mut n = 1;
        loop {
            let parts: Vec<Vec<Vec<i64>>> = shares.iter().map(|s| plan(s, lengths, groups, budget, n)).collect();
            let most = parts.iter().map(Vec::len).max().unwrap_or(1);
            if most == n {
                return MicroPlan { parts };
            }
            n = most;
        }
    }

    /// Micro-batches per rank (the same on every rank).
    pub fn micro_batches(&self) -> usize {
        self.parts.first().map_or(0, Vec::len)
    }

    /// Rank `rank`'s rows of micro-batch `j` (empty where it has none).
    pub fn rows(&self, rank: usize, j: usize) -> &[i64] {
        &self.parts[rank][j]
    }

    /// Whether every rank has rows in micro-batch `j` (at ZeRO stage 3 the sharded passes are
    /// collectives every rank must join).
    pub fn every_rank_has(&self, j: usize) -> bool {
        self.parts.iter().all(|p| !p[j].is_empty())
    }
}

/// Each row's real tokens (prompt and completion) for a token budget; empty without one.
///
/// # Shapes
/// `attention_mask`: `[B, L]` (0/1); returns `B` lengths.
pub fn row_lengths(attention_mask: &Tensor, budget: Option<usize>) -> Result<Vec<i64>> {
    if budget.is_none() {
        return Ok(Vec::new());
    }
    let lengths = attention_mask.f_sum_dim_intlist(1, false, Kind::Int64)?.f_to_device(Device::Cpu)?;
    Ok(Vec::<i64>::try_from(&lengths)?)
}

/// The rows' prompt groups, for a token budget that keeps the rows sharing a prompt together
/// (empty: rows placed one by one).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Groups {
    /// `group[row]`: the row's prompt group.
    group: Vec<i64>,
    /// `prompt[row]`: the row's real prompt tokens.
    prompt: Vec<i64>,
}

impl Groups {
    /// The groups of a batch's rows under a token budget with `share_prompts`; none without
    /// either.
    ///
    /// # Shapes
    /// `group_ids`: `[B]` (integers); `attention_mask`: `[B, L]` (0/1), its first `prompt_len`
    /// columns the prompts.
    pub fn of(
        group_ids: &Tensor,
        attention_mask: &Tensor,
        prompt_len: i64,
        budget: Option<usize>,
        share_prompts: bool,
    ) -> Result<Self> {
        if budget.is_none() || !share_prompts {
            return Ok(Groups::default());
        }
        let host = |t: Tensor| -> Result<Vec<i64>> {
            let t = t.f_to_kind(Kind::Int64)?.f_to_device(Device::Cpu)?.f_contiguous()?;
            Ok(Vec::<i64>::try_from(t.f_view([-1])?)?)
        };
        let prompt = attention_mask.f_narrow(1, 0, prompt_len)?.f_sum_dim_intlist(1, false, Kind::Int64)?;
        Ok(Groups { group: host(group_ids.shallow_clone())?, prompt: host(prompt)? })
    }

    /// Rows given as `(group, prompt tokens)`, in row order (for tests).
    #[cfg(test)]
    fn from_rows(rows: &[(i64, i64)]) -> Self {
        Groups { group: rows.iter().map(|r| r.0).collect(), prompt: rows.iter().map(|r| r.1).collect() }
    }

    /// The tokens a micro-batch of `rows` computes with each of its groups' prompts laid once:
    /// its real tokens less `(k − 1) ·` the prompt of each group it holds `k` rows of.
    fn computed(&self, rows: &[i64], lengths: &[i64]) -> i64 {
        let mut seen = HashSet::new();
        rows.iter()
            .map(|&r| {
                let r = r as usize;
                if seen.insert(self.group[r]) {
                    lengths[r]
                } else {
                    lengths[r] - self.prompt[r]
                }
            })
            .sum()
    }
}

/// The micro-batches of the experience passes (the old policy's, the reference's, the critic's,
/// without gradients) over this rank's `lengths.len()` rows, as row lists; `None` without a budget
/// or when one micro-batch holds every row. `groups` as for [`MicroPlan::new`]. With `lockstep`
/// (ZeRO stage 3, whose sharded passes are collectives) every rank runs as many as the rank that
/// needs the most (agreed by collectives), and the flag says whether every rank has rows in every
/// one of them.
pub fn experience_plan(
    world: &World,
    lengths: &[i64],
    groups: &Groups,
    budget: Option<usize>,
    lockstep: bool,
) -> Result<(Option<Vec<Vec<i64>>>, bool)> {
    let Some(budget) = budget else { return Ok((None, true)) };
    let budget = budget.max(1) as i64;
    let rows: Vec<i64> = (0..lengths.len() as i64).collect();
    let mut bins = plan(&rows, lengths, groups, budget, 1);
    if lockstep {
        // Every rank takes the same number of rounds: each ends on a verdict of all of them.
        loop {
            let most = dist::max(world, bins.len() as f64)? as usize;
            if dist::all(world, bins.len() == most)? {
                break;
            }
            bins = plan(&rows, lengths, groups, budget, most);
        }
    }
    let every_rank_has_rows = !lockstep || dist::all(world, bins.iter().all(|b| !b.is_empty()))?;
    Ok(((bins.len() > 1).then_some(bins), every_rank_has_rows))
}

/// `rows` in at least `n` bins of at most `budget` tokens each, as many more as it takes: rows
/// placed one by one ([`split`]) or, with `groups`, each group's rows kept in one bin (a group
/// over the budget first cut into full parts and a remainder by [`fill`]), whichever computes
/// fewer tokens with each bin's shared prompts laid once (fewer bins on a tie, rows one by one
/// on a full tie). Each bin in `rows`' order.
fn plan(rows: &[i64], lengths: &[i64], groups: &Groups, budget: i64, n: usize) -> Vec<Vec<i64>> {
    let by_row = split(rows, lengths, budget, n);
    if groups.group.is_empty() {
        return by_row;
    }
    // Each group's rows in `rows`' order (groups in order of first row), then its parts.
    let mut units: Vec<Vec<i64>> = Vec::new();
    let mut unit_of: HashMap<i64, usize> = HashMap::new();
    for &r in rows {
        let u = *unit_of.entry(groups.group[r as usize]).or_insert_with(|| {
            units.push(Vec::new());
            units.len() - 1
        });
        units[u].push(r);
    }
    let units: Vec<Vec<i64>> = units.iter().flat_map(|u| fill(u, lengths, budget)).collect();
    let tokens: Vec<i64> = units.iter().map(|u| u.iter().map(|&r| lengths[r as usize]).sum()).collect();
    let ids: Vec<i64> = (0..units.len() as i64).collect();
    let at: HashMap<i64, usize> = rows.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let by_group: Vec<Vec<i64>> = split(&ids, &tokens, budget, n)
        .into_iter()
        .map(|bin| {
            let mut b: Vec<i64> = bin.iter().flat_map(|&u| units[u as usize].iter().copied()).collect();
            b.sort_by_key(|r| at[r]);
            b
        })
        .collect();
    let cost = |bins: &[Vec<i64>]| (bins.iter().map(|b| groups.computed(b, lengths)).sum::<i64>(), bins.len());
    if cost(&by_group) < cost(&by_row) {
        by_group
    } else {
        by_row
    }
}

/// `rows` in parts of at most `budget` tokens (a row over it alone), first fit, longest row
/// first: the fewest parts within a little, each as full as it goes but the last, so the
/// remainder of a group that overflows a micro-batch packs beside other groups. Each part in
/// `rows`' order.
fn fill(rows: &[i64], lengths: &[i64], budget: i64) -> Vec<Vec<i64>> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[rows[i] as usize]));
    let (mut parts, mut load): (Vec<Vec<usize>>, Vec<i64>) = (Vec::new(), Vec::new());
    for i in order {
        let len = lengths[rows[i] as usize];
        match load.iter().position(|&l| l + len <= budget) {
            Some(p) => {
                load[p] += len;
                parts[p].push(i);
            }
            None => {
                load.push(len);
                parts.push(vec![i]);
            }
        }
    }
    in_order(rows, parts)
}

/// `rows` in at least `n` bins of at most `budget` tokens each (LPT: longest row first, each to
/// the lightest bin, ties to the lower bin), as many more as it takes; each bin in `rows`' order.
/// Bins past the row count stay empty. A row is any item: `lengths[row]` is its weight.
pub(crate) fn split(rows: &[i64], lengths: &[i64], budget: i64, n: usize) -> Vec<Vec<i64>> {
    // No fewer than the rows over the budget plus the others' tokens over the budget, rounded up.
    let over = rows.iter().filter(|&&r| lengths[r as usize] > budget).count();
    let rest: i64 = rows.iter().map(|&r| lengths[r as usize]).filter(|&l| l <= budget).sum();
    let least = (over + (rest as u64).div_ceil(budget as u64) as usize).min(rows.len());
    let mut n = n.max(least).max(1);
    loop {
        // Positions in `rows`, longest first (a stable sort: equal lengths keep their order).
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lengths[rows[i] as usize]));
        let mut load = vec![0i64; n];
        let mut bins: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in order {
            let lightest = (0..n).min_by_key(|&b| (load[b], b)).expect("n >= 1");
            load[lightest] += lengths[rows[i] as usize];
            bins[lightest].push(i);
        }
        // A bin over the budget is fine only when it holds a single row.
        if n >= rows.len() || bins.iter().zip(&load).all(|(b, &l)| l <= budget || b.len() == 1) {
            return in_order(rows, bins);
        }
        n += 1;
    }
}

/// Bins of positions in `rows` as bins of rows, each in `rows`' order.
fn in_order(rows: &[i64], bins: Vec<Vec<usize>>) -> Vec<Vec<i64>> {
    bins.into_iter()
        .map(|mut b| {
            b.sort_unstable();
            b.into_iter().map(|i| rows[i]).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(plan: &MicroPlan, rank: usize, lengths: &[i64]) -> Vec<i64> {
        (0..plan.micro_batches()).map(|j| plan.rows(rank, j).iter().map(|&r| lengths[r as usize]).sum()).collect()
    }

    /// Without a budget each rank's share is one micro-batch: the minibatch's order, split as
    /// `dist::shard` splits it.
    #[test]
    fn without_a_budget_each_rank_has_its_share_whole() {
        let plan = MicroPlan::new(&[4, 0, 3, 1, 2], &[1; 5], &Groups::default(), None, 2);
        assert_eq!(plan.micro_batches(), 1);
        assert_eq!((plan.rows(0, 0), plan.rows(1, 0)), (&[4, 0, 3][..], &[1, 2][..]));
        assert!(plan.every_rank_has(0));
        assert!(!MicroPlan::new(&[3], &[1; 4], &Groups::default(), None, 2).every_rank_has(0));
    }

    /// Rows of 9, 7, 6, 5, 3 and 2 tokens (32) in a budget of 12: three micro-batches (LPT
    /// places 9+2, 7+3 and 6+5), every row once, each in minibatch order.
    #[test]
    fn a_budget_splits_into_the_fewest_balanced_micro_batches() {
        let lengths = [3, 9, 2, 7, 5, 6];
        let minibatch = [5, 1, 0, 3, 2, 4];
        let plan = MicroPlan::new(&minibatch, &lengths, &Groups::default(), Some(12), 1);
        assert_eq!(plan.micro_batches(), 3);
        assert_eq!(tokens(&plan, 0, &lengths), [11, 10, 11]);
        let mut all: Vec<i64> = (0..3).flat_map(|j| plan.rows(0, j).to_vec()).collect();
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2, 3, 4, 5]);
        for j in 0..3 {
            let pos: Vec<usize> =
                plan.rows(0, j).iter().map(|r| minibatch.iter().position(|m| m == r).unwrap()).collect();
            assert!(pos.windows(2).all(|w| w[0] < w[1]), "micro-batch {j} out of order: {pos:?}");
        }
        // A budget that holds everything: one micro-batch, the minibatch as it was.
        let one = MicroPlan::new(&minibatch, &lengths, &Groups::default(), Some(32), 1);
        assert_eq!((one.micro_batches(), one.rows(0, 0)), (1, &minibatch[..]));
    }

    /// A row over the budget is a micro-batch of its own, the others share one; on two ranks
    /// both run as many micro-batches as the rank that needs the most, spreading their rows over
    /// them, and a rank with fewer rows than that has empty ones.
    #[test]
    fn long_rows_run_alone_and_ranks_agree_on_the_count() {
        let lengths = [20, 1, 1, 1];
        let plan = MicroPlan::new(&[0, 1, 2, 3], &lengths, &Groups::default(), Some(4), 1);
        assert_eq!(plan.micro_batches(), 2);
        assert_eq!(tokens(&plan, 0, &lengths), [20, 3]);
        // Rank 0 holds rows 0 and 1 (two micro-batches), rank 1 rows 2 and 3 (one would do).
        let plan = MicroPlan::new(&[0, 1, 2, 3], &lengths, &Groups::default(), Some(4), 2);
        assert_eq!(plan.micro_batches(), 2);
        assert_eq!((plan.rows(0, 0), plan.rows(0, 1)), (&[0][..], &[1][..]));
        assert_eq!((plan.rows(1, 0), plan.rows(1, 1)), (&[2][..], &[3][..]));
        assert!(plan.every_rank_has(1));
        // Rank 1 holds row 2 alone.
        let plan = MicroPlan::new(&[0, 1, 2], &lengths, &Groups::default(), Some(4), 2);
        assert_eq!((plan.micro_batches(), plan.rows(1, 0), plan.rows(1, 1)), (2, &[2][..], &[][..]));
        assert!(plan.every_rank_has(0) && !plan.every_rank_has(1));
    }

    /// With groups, a shuffled minibatch of two groups of four equal rows splits by group (one
    /// by one, LPT deals the rows out alternately); a group over the budget is cut into a full
    /// part and a remainder that packs beside another group; where whole groups take a third
    /// micro-batch (three groups of 6 tokens in a budget of 10) they are kept when that computes
    /// fewer tokens, and the rows go one by one when it does not (prompts of no tokens).
    #[test]
    fn groups_stay_together_where_that_computes_fewer_tokens() {
        let none = Groups::default();
        let lengths = [10; 8];
        let groups = Groups::from_rows(&[(0, 4), (0, 4), (0, 4), (0, 4), (1, 4), (1, 4), (1, 4), (1, 4)]);
        let minibatch = [0, 1, 4, 5, 2, 3, 6, 7];
        let rows = MicroPlan::new(&minibatch, &lengths, &none, Some(40), 1);
        assert_eq!((rows.rows(0, 0), rows.rows(0, 1)), (&[0, 4, 2, 6][..], &[1, 5, 3, 7][..]));
        let plan = MicroPlan::new(&minibatch, &lengths, &groups, Some(40), 1);
        assert_eq!((plan.micro_batches(), plan.rows(0, 0), plan.rows(0, 1)), (2, &[0, 1, 2, 3][..], &[4, 5, 6, 7][..]));
        // 80 tokens less 3 · 4 for each group: 56 computed, against 80 − 4 · 1 · 4 = 64.
        assert_eq!(groups.computed(plan.rows(0, 0), &lengths) + groups.computed(plan.rows(0, 1), &lengths), 56);
        assert_eq!(groups.computed(rows.rows(0, 0), &lengths) + groups.computed(rows.rows(0, 1), &lengths), 64);
        // Group 0 of six rows (60 tokens) over a budget of 40, group 1 of two rows.
        let groups = Groups::from_rows(&[(0, 4), (0, 4), (0, 4), (0, 4), (0, 4), (0, 4), (1, 4), (1, 4)]);
        let all = [0, 1, 2, 3, 4, 5, 6, 7];
        let rows = MicroPlan::new(&all, &lengths, &none, Some(40), 1);
        assert_eq!((rows.rows(0, 0), rows.rows(0, 1)), (&[0, 2, 4, 6][..], &[1, 3, 5, 7][..]));
        let plan = MicroPlan::new(&all, &lengths, &groups, Some(40), 1);
        assert_eq!((plan.micro_batches(), plan.rows(0, 0), plan.rows(0, 1)), (2, &[0, 1, 2, 3][..], &[4, 5, 6, 7][..]));
        // Three groups of two rows of 3 tokens in a budget of 10: one by one, two micro-batches
        // of 9 tokens share nothing; whole groups take three and compute 3 · (6 − 2) = 12.
        let groups = Groups::from_rows(&[(0, 2), (0, 2), (1, 2), (1, 2), (2, 2), (2, 2)]);
        let plan = MicroPlan::new(&all[..6], &[3; 6], &groups, Some(10), 1);
        assert_eq!((plan.micro_batches(), plan.rows(0, 0), plan.rows(0, 2)), (3, &[0, 1][..], &[4, 5][..]));
        let empty = Groups::from_rows(&[(0, 0), (0, 0), (1, 0), (1, 0), (2, 0), (2, 0)]);
        let plan = MicroPlan::new(&all[..6], &[3; 6], &empty, Some(10), 1);
        assert_eq!(plan, MicroPlan::new(&all[..6], &[3; 6], &none, Some(10), 1));
        assert_eq!(plan.micro_batches(), 2);
        // On two ranks each rank's share is planned by its own groups.
        let groups = Groups::from_rows(&[(0, 4), (0, 4), (2, 4), (2, 4), (1, 4), (1, 4), (3, 4), (3, 4)]);
        let plan = MicroPlan::new(&minibatch, &lengths, &groups, Some(20), 2);
        assert_eq!((plan.rows(0, 0), plan.rows(0, 1)), (&[0, 1][..], &[4, 5][..]));
        assert_eq!((plan.rows(1, 0), plan.rows(1, 1)), (&[2, 3][..], &[6, 7][..]));
    }
}
