//! Building blocks shared by the model families, chosen by the resolved [`crate::ArchConfig`]:
//! linear layers in both weight layouts, the norm variants, rotary embeddings and their scalings,
//! attention masks (padded, packed, windowed), attention, Gated DeltaNet linear attention, dense
//! and expert MLPs with their load-balancing loss, Gemma 4's per-layer inputs and experts beside the
//! MLP, the KV cache.

mod attention;
mod cache;
pub mod delta_net;
pub mod delta_rule;
mod fused;
mod gemma4;
mod linear;
pub mod load_balance;
mod mask;
mod mlp;
mod norm;
mod rotary;

pub use attention::Attention;
pub use cache::{CacheLayer, KvCache};
pub use delta_net::{GatedDeltaNet, LinearShared};
pub use fused::FusedRows;
pub use gemma4::{ExpertsBeside, PerLayerBranch, PerLayerEmbed};
pub use linear::{activate, linear, Linear, FEW_ROWS};
pub use load_balance::{RouterRecord, RouterStats};
pub use mask::{
    attention_mask, branch_segment, position_ids_from_mask, step_attention_mask, windowed_attention_mask, Deepstack,
    LayerShared, SideInputs,
};
pub use mlp::{ExpertSteps, GatedMlp, Mlp, SparseMoe};
pub use norm::{LayerNorm, RmsNorm};
pub use rotary::{apply_rotary, Rotary};

/// Whether autograd records operations on this thread (off inside `tch::no_grad`).
pub(crate) fn grad_enabled() -> bool {
    // SAFETY: sets the thread's grad mode and returns the previous one, which is put back at once.
    unsafe {
        let previous = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(previous);
        previous != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn sliding_window_sees_the_last_window_keys() {
        // One row, left-padded by 1, window 3; then one cached step.
        let key_mask = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1]).view([1, 6]);
        let m = windowed_attention_mask(&key_mask, 0, 6, Some(3)).unwrap().view([6, 6]);
        let rows: Vec<Vec<bool>> = (0..6).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[3], vec![false, true, true, true, false, false]);
        assert_eq!(rows[5], vec![false, false, false, true, true, true]);
        let key_mask = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1, 1]).view([1, 7]);
        let m = windowed_attention_mask(&key_mask, 6, 1, Some(3)).unwrap().view([7]);
        assert_eq!(Vec::<bool>::try_from(m).unwrap(), vec![false, false, false, false, true, true, true]);
        // No window: the plain mask.
        let full = windowed_attention_mask(&key_mask, 6, 1, None).unwrap();
        assert!(full.equal(&attention_mask(&key_mask, 6, 1).unwrap()));
    }

    #[test]
    fn mask_is_causal_padded_and_never_empty() {
        // One row left-padded by 2.
        let key_mask = Tensor::from_slice(&[0i64, 0, 1, 1]).view([1, 4]);
        let m = attention_mask(&key_mask, 0, 4).unwrap().view([4, 4]);
        let rows: Vec<Vec<bool>> = (0..4).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[0], vec![true, false, false, false]); // pad sees itself only
        assert_eq!(rows[1], vec![false, true, false, false]);
        assert_eq!(rows[2], vec![false, false, true, false]);
        assert_eq!(rows[3], vec![false, false, true, true]);
        // With one cached token, the single new query at absolute index 4 sees all real keys.
        let key_mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1]).view([1, 5]);
        let m = attention_mask(&key_mask, 4, 1).unwrap().view([5]);
        assert_eq!(Vec::<bool>::try_from(m).unwrap(), vec![false, false, true, true, true]);
    }

    #[test]
    fn packed_segments_attend_within_themselves_and_restart_positions() {
        // Two examples packed in one row (ids 1 and 2), then right padding.
        let key_mask = Tensor::from_slice(&[1i64, 1, 2, 2, 2, 0]).view([1, 6]);
        let m = attention_mask(&key_mask, 0, 6).unwrap().view([6, 6]);
        let rows: Vec<Vec<bool>> = (0..6).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[1], vec![true, true, false, false, false, false]);
        assert_eq!(rows[2], vec![false, false, true, false, false, false]); // not the first example
        assert_eq!(rows[4], vec![false, false, true, true, true, false]);
        // Trailing padding sees the real keys before it (not itself), as in transformers.
        assert_eq!(rows[5], vec![true, true, true, true, true, false]);
        let p = position_ids_from_mask(&key_mask).unwrap().view([6]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 1, 0, 1, 2, 3]); // right pad keeps counting

        // A plain 0/1 mask, right-padded: transformers' `arange`.
        let p = position_ids_from_mask(&Tensor::from_slice(&[1i64, 1, 1, 0, 0]).view([1, 5])).unwrap().view([5]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 1, 2, 3, 4]);
        let m = attention_mask(&Tensor::from_slice(&[1i64, 1, 0]).view([1, 3]), 0, 3).unwrap().view([3, 3]);
        assert_eq!(Vec::<bool>::try_from(m.get(2)).unwrap(), vec![true, true, false]);
    }

    #[test]
    fn branches_see_their_segment_and_themselves() {
        // Segment 1 (a prompt of 2), its branches 1 and 2 (2 and 1 tokens), segment 2, padding.
        let (b1, b2) = (branch_segment(1, 1), branch_segment(1, 2));
        let key_mask = Tensor::from_slice(&[1i64, 1, b1, b1, b2, 2, 0]).view([1, 7]);
        let m = attention_mask(&key_mask, 0, 7).unwrap().view([7, 7]);
        let rows: Vec<Vec<bool>> = (0..7).map(|i| Vec::<bool>::try_from(m.get(i)).unwrap()).collect();
        assert_eq!(rows[1], vec![true, true, false, false, false, false, false]); // the prompt: no branch
        assert_eq!(rows[3], vec![true, true, true, true, false, false, false]); // prompt + own branch
        assert_eq!(rows[4], vec![true, true, false, false, true, false, false]); // not its sibling
        assert_eq!(rows[5], vec![false, false, false, false, false, true, false]); // another segment
        assert_eq!(rows[6], vec![true, true, true, true, true, true, false]); // padding as before

        // Under a window that counts slots, a branch still sees only its own segment's keys.
        let w = windowed_attention_mask(&key_mask, 0, 7, Some(3)).unwrap().view([7, 7]);
        assert_eq!(Vec::<bool>::try_from(w.get(4)).unwrap(), vec![false, false, false, false, true, false, false]);
    }

    #[test]
    fn positions_ignore_left_padding() {
        let mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1]).view([1, 5]);
        let p = position_ids_from_mask(&mask).unwrap().view([5]);
        assert_eq!(Vec::<i64>::try_from(p).unwrap(), vec![0, 0, 0, 1, 2]);
    }

    #[test]
    fn rotate_half_matches_formula() {
        let x = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([1, 1, 1, 4]);
        let cos = Tensor::from_slice(&[0.5f32, 0.5, 0.5, 0.5]).view([1, 1, 1, 4]);
        // The signed table: [−sin, sin] for sin = 1.
        let sin = Tensor::from_slice(&[-1f32, -1., 1., 1.]).view([1, 1, 1, 4]);
        let y = apply_rotary(&x, &cos, &sin).unwrap().view([4]);
        // x*cos + [-x3, -x4, x1, x2]*sin
        assert_eq!(Vec::<f32>::try_from(y).unwrap(), vec![0.5 - 3., 1. - 4., 1.5 + 1., 2. + 2.]);
    }
}
