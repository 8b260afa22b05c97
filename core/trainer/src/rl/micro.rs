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
    /// `budget` the most tokens a micro-batch holds (`None`: one micro-batch per rank).
    pub fn new(minibatch: &[i64], lengths: &[i64], budget: Option<usize>, world_size: usize) -> Self {
        let shares: Vec<&[i64]> =
            (0..world_size).map(|r| &minibatch[dist::shard(minibatch.len(), r, world_size)]).collect();
        let Some(budget) = budget else {
            return MicroPlan { parts: shares.iter().map(|s| vec![s.to_vec()]).collect() };
        };
        let budget = budget.max(1) as i64;
        // The fewest micro-batches every rank fits in (LPT may need more bins with more rows).
        let mut n = 1;
        loop {
            let parts: Vec<Vec<Vec<i64>>> = shares.iter().map(|s| split(s, lengths, budget, n)).collect();
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

/// The micro-batches of the experience passes (the old policy's, the reference's, the critic's,
/// without gradients) over this rank's `lengths.len()` rows, as row lists; `None` without a budget
/// or when one micro-batch holds every row. With `lockstep` (ZeRO stage 3, whose sharded passes
/// are collectives) every rank runs as many as the rank that needs the most (agreed by
/// collectives), and the flag says whether every rank has rows in every one of them.
pub fn experience_plan(
    world: &World,
    lengths: &[i64],
    budget: Option<usize>,
    lockstep: bool,
) -> Result<(Option<Vec<Vec<i64>>>, bool)> {
    let Some(budget) = budget else { return Ok((None, true)) };
    let budget = budget.max(1) as i64;
    let rows: Vec<i64> = (0..lengths.len() as i64).collect();
    let mut bins = split(&rows, lengths, budget, 1);
    if lockstep {
        // Every rank takes the same number of rounds: each ends on a verdict of all of them.
        loop {
            let most = dist::max(world, bins.len() as f64)? as usize;
            if dist::all(world, bins.len() == most)? {
                break;
            }
            bins = split(&rows, lengths, budget, most);
        }
    }
    let every_rank_has_rows = !lockstep || dist::all(world, bins.iter().all(|b| !b.is_empty()))?;
    Ok(((bins.len() > 1).then_some(bins), every_rank_has_rows))
}

/// `rows` in at least `n` bins of at most `budget` tokens each (LPT: longest row first, each to
/// the lightest bin, ties to the lower bin), as many more as it takes; each bin in `rows`' order.
/// Bins past the row count stay empty.
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
            return bins
                .into_iter()
                .map(|mut b| {
                    b.sort_unstable();
                    b.into_iter().map(|i| rows[i]).collect()
                })
                .collect();
        }
        n += 1;
    }
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
        let plan = MicroPlan::new(&[4, 0, 3, 1, 2], &[1; 5], None, 2);
        assert_eq!(plan.micro_batches(), 1);
        assert_eq!((plan.rows(0, 0), plan.rows(1, 0)), (&[4, 0, 3][..], &[1, 2][..]));
        assert!(plan.every_rank_has(0));
        assert!(!MicroPlan::new(&[3], &[1; 4], None, 2).every_rank_has(0));
    }

    /// Rows of 9, 7, 6, 5, 3 and 2 tokens (32) in a budget of 12: three micro-batches (LPT
    /// places 9+2, 7+3 and 6+5), every row once, each in minibatch order.
    #[test]
    fn a_budget_splits_into_the_fewest_balanced_micro_batches() {
        let lengths = [3, 9, 2, 7, 5, 6];
        let minibatch = [5, 1, 0, 3, 2, 4];
        let plan = MicroPlan::new(&minibatch, &lengths, Some(12), 1);
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
        let one = MicroPlan::new(&minibatch, &lengths, Some(32), 1);
        assert_eq!((one.micro_batches(), one.rows(0, 0)), (1, &minibatch[..]));
    }

    /// A row over the budget is a micro-batch of its own, the others share one; on two ranks
    /// both run as many micro-batches as the rank that needs the most, spreading their rows over
    /// them, and a rank with fewer rows than that has empty ones.
    #[test]
    fn long_rows_run_alone_and_ranks_agree_on_the_count() {
        let lengths = [20, 1, 1, 1];
        let plan = MicroPlan::new(&[0, 1, 2, 3], &lengths, Some(4), 1);
        assert_eq!(plan.micro_batches(), 2);
        assert_eq!(tokens(&plan, 0, &lengths), [20, 3]);
        // Rank 0 holds rows 0 and 1 (two micro-batches), rank 1 rows 2 and 3 (one would do).
        let plan = MicroPlan::new(&[0, 1, 2, 3], &lengths, Some(4), 2);
        assert_eq!(plan.micro_batches(), 2);
        assert_eq!((plan.rows(0, 0), plan.rows(0, 1)), (&[0][..], &[1][..]));
        assert_eq!((plan.rows(1, 0), plan.rows(1, 1)), (&[2][..], &[3][..]));
        assert!(plan.every_rank_has(1));
        // Rank 1 holds row 2 alone.
        let plan = MicroPlan::new(&[0, 1, 2], &lengths, Some(4), 2);
        assert_eq!((plan.micro_batches(), plan.rows(1, 0), plan.rows(1, 1)), (2, &[2][..], &[][..]));
        assert!(plan.every_rank_has(0) && !plan.every_rank_has(1));
    }
}
