//! DPO's batches: a batch of preference pairs as one `[2B, T]` pass, chosen rows first, and
//! which of its log-probs are the responses'.

use tch::{Device, Tensor};

use super::pairs::SplitPair;
use crate::error::Result;

/// A padded batch of pairs: chosen rows first, then rejected rows.
pub(super) struct DpoBatch {
    /// `[2B, T]` int64.
    pub input_ids: Tensor,
    pub attention_mask: Tensor,
    /// The first column whose token's log-prob is taken: 1, or with the prompts aligned the
    /// prompts' width `P` (every response starts there).
    pub from: i64,
    /// `[2B, T − from]` f32: 1 where the predicted token (position `from + j`) is a response token.
    pub response_mask: Tensor,
    /// `[B]` f32: response tokens of the chosen / rejected sides.
    pub chosen_lens: Tensor,
    pub rejected_lens: Tensor,
    pub tokens: usize,
    /// With the prompts aligned: each shared prompt laid once in packed rows `P + 2R` wide (a
    /// pair's prompt and both its answers in one row); `None` otherwise.
    pub pack_width: Option<i64>,
}

/// The batch of `pairs`: each row its sequence from column 0, padded on the right (`T` the
/// longest); or with `share_prompts` the prompts aligned — each prompt padded on the left to the
/// longest, `P`, its response after it, padded on the right to the longest, `R` (`T = P + R`) —
/// so that a pair's two rows (and any rows of one prompt) share their first `P` columns.
///
/// # Shapes
/// - returns `input_ids`, `attention_mask`: `[2B, T]`; `response_mask`: `[2B, T − from]`; lengths
///   `[B]`
pub(super) fn collate(pairs: &[&SplitPair], pad: i64, device: Device, share_prompts: bool) -> Result<DpoBatch> {
    let b = pairs.len();
    let sides = |p: &&SplitPair| [(p.pair.chosen.len(), p.chosen_start), (p.pair.rejected.len(), p.rejected_start)];
    let (width, from) = if share_prompts {
        let prompt = pairs.iter().flat_map(sides).map(|(_, start)| start).max().unwrap_or(1);
        let response = pairs.iter().flat_map(sides).map(|(len, start)| len - start).max().unwrap_or(1);
        (prompt + response, prompt)
    } else {
        (pairs.iter().flat_map(sides).map(|(len, _)| len).max().unwrap_or(2).max(2), 1)
    };
    let (t, r) = (width, width - from);
    let mut ids = vec![pad; 2 * b * t];
    let mut mask = vec![0i64; 2 * b * t];
    let mut resp = vec![0f32; 2 * b * r];
    let (mut lens_c, mut lens_r) = (Vec::with_capacity(b), Vec::with_capacity(b));
    let mut tokens = 0;
    for (i, p) in pairs.iter().enumerate() {
        for (row, side, start) in [(i, &p.pair.chosen, p.chosen_start), (b + i, &p.pair.rejected, p.rejected_start)] {
            // The row's first column: 0, or where its prompt ends at column `from`.
            let at = row * t + if share_prompts { from - start } else { 0 };
            ids[at..at + side.len()].copy_from_slice(side);
            mask[at..at + side.len()].iter_mut().for_each(|m| *m = 1);
            // The token of column c is predicted at index c − from.
            let (first, last) = (at - row * t + start - from, at - row * t + side.len() - from);
            resp[row * r + first..row * r + last].iter_mut().for_each(|m| *m = 1.0);
            tokens += side.len();
        }
        lens_c.push((p.pair.chosen.len() - p.chosen_start) as f32);
        lens_r.push((p.pair.rejected.len() - p.rejected_start) as f32);
    }
    let (b2, t, r) = ((2 * b) as i64, t as i64, r as i64);
    Ok(DpoBatch {
        input_ids: Tensor::f_from_slice(&ids)?.f_view([b2, t])?.f_to_device(device)?,
        attention_mask: Tensor::f_from_slice(&mask)?.f_view([b2, t])?.f_to_device(device)?,
        from: from as i64,
        response_mask: Tensor::f_from_slice(&resp)?.f_view([b2, r])?.f_to_device(device)?,
        chosen_lens: Tensor::f_from_slice(&lens_c)?.f_to_device(device)?,
        rejected_lens: Tensor::f_from_slice(&lens_r)?.f_to_device(device)?,
        tokens,
        pack_width: share_prompts.then_some(t + r),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervised::pairs::PairExample;

    fn pair(chosen: &[i64], rejected: &[i64], start: usize) -> SplitPair {
        let pair = PairExample { chosen: chosen.to_vec(), rejected: rejected.to_vec(), line: 1 };
        SplitPair { pair, chosen_start: start, rejected_start: start }
    }

    fn rows(t: &Tensor) -> Vec<Vec<f64>> {
        Vec::<Vec<f64>>::try_from(t.to_kind(tch::Kind::Double)).unwrap()
    }

    /// Two pairs, prompts of 2 and 3 tokens (ids 1–3), answers of 1 to 3 tokens (ids 7–9): from
    /// column 0 each row is its sequence and the responses are read from column 1; with the
    /// prompts aligned, each prompt ends at column 3 and every response starts there, in rows
    /// `P + R = 6` wide whose packing may be `P + 2R = 9` wide.
    #[test]
    fn prompts_align_so_that_a_pair_shares_its_first_columns() {
        let pairs = [pair(&[1, 2, 7], &[1, 2, 8, 8, 8], 2), pair(&[1, 2, 3, 9, 9], &[1, 2, 3, 7], 3)];
        let refs: Vec<&SplitPair> = pairs.iter().collect();
        let plain = collate(&refs, 0, Device::Cpu, false).unwrap();
        assert_eq!((plain.from, plain.pack_width, plain.tokens), (1, None, 17));
        assert_eq!(rows(&plain.input_ids)[1], [1.0, 2.0, 3.0, 9.0, 9.0]);
        assert_eq!(rows(&plain.response_mask)[2], [0.0, 1.0, 1.0, 1.0]);
        let aligned = collate(&refs, 0, Device::Cpu, true).unwrap();
        assert_eq!((aligned.from, aligned.pack_width, aligned.tokens), (3, Some(9), 17));
        let ids = rows(&aligned.input_ids);
        assert_eq!(ids[0], [0.0, 1.0, 2.0, 7.0, 0.0, 0.0]);
        assert_eq!(ids[2], [0.0, 1.0, 2.0, 8.0, 8.0, 8.0]);
        assert_eq!(ids[3], [1.0, 2.0, 3.0, 7.0, 0.0, 0.0]);
        assert_eq!(rows(&aligned.attention_mask)[0], [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        let resp = rows(&aligned.response_mask);
        assert_eq!(resp, [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]);
        // The same responses either way: as many response tokens per row.
        let sum = |m: &Tensor| m.sum_dim_intlist(1, false, tch::Kind::Float);
        assert!(sum(&plain.response_mask).equal(&sum(&aligned.response_mask)));
    }
}
