//! How one chunk of token sequences is laid out for a forward pass of the reward model.
//!
//! GRPO's G samples of a prompt reach the reward model as G texts that begin with the same
//! rendered prompt. The chunk is sorted, so such texts are neighbours, and cut into runs that
//! share a prefix ([`shared_lengths`]): each row's shared part is right-aligned in the first `P`
//! columns (the longest shared part of the chunk), its own part follows at column `P`. Rows that
//! hold the same first `P` columns then share a prompt, which
//! [`rlhf_models::ScalarHeadModel::scores_sharing`] computes once; every row's tokens stay
//! contiguous and at their own positions, so the split changes no score beyond float rounding.

/// A chunk laid out in `rows × cols`, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Laid {
    pub ids: Vec<i64>,
    pub mask: Vec<i64>,
    pub rows: usize,
    pub cols: usize,
    /// `P`: the columns holding the rows' shared parts (0 when no row shares a token).
    pub prefix_cols: usize,
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[i64], b: &[i64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// For each row of `seqs` (sorted, so that rows sharing a prefix are neighbours), how many of its
/// first tokens it shares with the other rows of its run: the rows are cut into runs of
/// neighbours, each run sharing the longest prefix all its rows hold (at most the shortest row's
/// length − 1, so every row keeps a token of its own), so as to share the most tokens —
/// `Σ (rows − 1) · shared` over the runs (dynamic programming over the cuts, `O(n²)`). A row alone
/// shares nothing. Taking the longest prefix a row shares with either neighbour instead would cut
/// a prompt's samples apart wherever two of them also begin their answers alike.
pub(crate) fn shared_lengths(seqs: &[&[i64]]) -> Vec<usize> {
    let n = seqs.len();
    let links: Vec<usize> = seqs.windows(2).map(|w| common_prefix(w[0], w[1])).collect();
    // best[b]: the most tokens shared by rows 0..b; cut[b]: where the last run of them starts.
    let (mut best, mut cut) = (vec![0usize; n + 1], vec![0usize; n + 1]);
    for end in 1..=n {
        let (mut shared, mut run_best) = (usize::MAX, (best[end - 1], end - 1));
        for start in (0..end - 1).rev() {
            // The run start..end shares the common prefix of all its rows.
            shared = shared.min(links[start]).min(seqs[start].len() - 1).min(seqs[end - 1].len() - 1);
            let gain = best[start] + (end - 1 - start) * shared;
            if gain > run_best.0 {
                run_best = (gain, start);
            }
        }
        (best[end], cut[end]) = run_best;
    }
    let mut out = vec![0; n];
    let mut end = n;
    while end > 0 {
        let start = cut[end];
        let shared = (start..end - 1).map(|i| links[i]).chain((start..end).map(|i| seqs[i].len() - 1)).min();
        out[start..end].fill(if end - start > 1 { shared.unwrap_or(0) } else { 0 });
        end = start;
    }
    out
}

/// Lays `seqs` out split at their [`shared_lengths`]: row `i`'s first `pᵢ` tokens end at column
/// `P = max pᵢ`, the rest start there; `pad` (mask 0) elsewhere.
pub(crate) fn split_at_shared(seqs: &[&[i64]], pad: i64) -> Laid {
    lay(seqs, &shared_lengths(seqs), pad)
}

/// `seqs` right-padded: each row from column 0, `pad` (mask 0) after it.
pub(crate) fn right_padded(seqs: &[&[i64]], pad: i64) -> Laid {
    lay(seqs, &vec![0; seqs.len()], pad)
}

/// `seqs` with row `i`'s first `shared[i]` tokens ending at column `max(shared)`.
fn lay(seqs: &[&[i64]], shared: &[usize], pad: i64) -> Laid {
    let prefix_cols = shared.iter().copied().max().unwrap_or(0);
    let tail = seqs.iter().zip(shared).map(|(s, &p)| s.len() - p).max().unwrap_or(0);
    let (rows, cols) = (seqs.len(), prefix_cols + tail);
    let (mut ids, mut mask) = (vec![pad; rows * cols], vec![0; rows * cols]);
    for (r, (s, &p)) in seqs.iter().zip(shared).enumerate() {
        let start = r * cols + prefix_cols - p;
        ids[start..start + s.len()].copy_from_slice(s);
        mask[start..start + s.len()].fill(1);
    }
    Laid { ids, mask, rows, cols, prefix_cols }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_share_their_common_prefix_and_keep_a_token_of_their_own() {
        let (a, b, c, d) = ([1, 2, 3, 4].as_slice(), [1, 2, 3, 9].as_slice(), [1, 2].as_slice(), [7].as_slice());
        // Sorted: [1, 2], [1, 2, 3, 4], [1, 2, 3, 9], [7]: the middle two share three tokens
        // (3 shared), all three first ones one token (2 shared).
        assert_eq!(shared_lengths(&[c, a, b, d]), vec![0, 3, 3, 0]);
        assert_eq!(shared_lengths(&[a]), vec![0]);
        assert!(shared_lengths(&[]).is_empty());
        // A text that is a prefix of another keeps its last token as its own.
        assert_eq!(shared_lengths(&[c, c]), vec![1, 1]);
    }

    #[test]
    fn a_prompts_samples_stay_one_run_when_two_answers_begin_alike() {
        // Two prompts' samples, sorted; two of the first prompt's answers begin with 7, 7.
        let rows: [&[i64]; 6] = [
            &[1, 2, 3, 4, 5],
            &[1, 2, 3, 7, 7, 1],
            &[1, 2, 3, 7, 7, 2],
            &[1, 2, 3, 9],
            &[8, 8, 8, 8, 8, 1],
            &[8, 8, 8, 8, 8, 2],
        ];
        assert_eq!(shared_lengths(&rows), vec![3, 3, 3, 3, 5, 5]);
        // Where two answers' common start saves more than what all three rows share, it is
        // taken: 1 row × 6 tokens against 2 rows × 1.
        let rows: [&[i64]; 3] = [&[1, 2], &[1, 5, 5, 5, 5, 5, 1], &[1, 5, 5, 5, 5, 5, 2]];
        assert_eq!(shared_lengths(&rows), vec![0, 6, 6]);
    }

    #[test]
    fn shared_parts_end_at_the_prefix_columns_and_rows_stay_contiguous() {
        let seqs: [&[i64]; 3] = [&[5, 6, 7, 8], &[5, 6, 7, 9, 10], &[11, 12]];
        let laid = split_at_shared(&seqs, 0);
        assert_eq!((laid.rows, laid.cols, laid.prefix_cols), (3, 5, 3));
        #[rustfmt::skip]
        assert_eq!(laid.ids, vec![
            5, 6, 7, 8, 0,
            5, 6, 7, 9, 10,
            0, 0, 0, 11, 12,
        ]);
        #[rustfmt::skip]
        assert_eq!(laid.mask, vec![
            1, 1, 1, 1, 0,
            1, 1, 1, 1, 1,
            0, 0, 0, 1, 1,
        ]);
        let none = split_at_shared(&[&[1, 2], &[3]], 0);
        assert_eq!(right_padded(&[&[1, 2], &[3]], 0), none);
        assert_eq!((none.prefix_cols, none.ids, none.mask), (0, vec![1, 2, 3, 0], vec![1, 1, 1, 0]));
    }
}
