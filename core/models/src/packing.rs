//! Padding-free passes, as verl's `use_remove_padding` and transformers' padding-free collator
//! run them: a batch's rows without their padding, laid back to back in as few rows of the same
//! width as hold them, each sequence a segment of its own (its positions restart at 0 and it
//! attends to no other segment, [`crate::layers::attention_mask`]), and the layers' output put
//! back in the batch's layout. The layers then compute the real tokens only (and the padding at
//! the end of each packed row); every real token sees the same keys at the same positions as in
//! the padded batch, so the hidden states are the padded pass's within float rounding (the
//! GEMMs' shapes change), and so are their gradients.

use tch::{Device, Tensor};

use crate::error::Result;
use crate::layers::position_ids_from_mask;

/// A batch packed into fewer rows of its width.
///
/// # Shapes
/// `ids`, `mask`, `positions`: `[rows, seq]` (int64; `mask` holds segment ids 1, 2, … and 0 for
/// padding) for a batch of `[batch, seq]`, `rows < batch`.
#[derive(Debug)]
pub struct Packing {
    pub ids: Tensor,
    pub mask: Tensor,
    pub positions: Tensor,
    /// Flat indices (into `batch · seq`) of the batch's real tokens, and where each of them sits
    /// in the packed rows (into `rows · seq`), in the same order.
    batch_slots: Tensor,
    packed_slots: Tensor,
    batch: i64,
    seq: i64,
}

impl Packing {
    /// The batch's rows packed first-fit in row order (a row goes into the first packed row with
    /// room for its real tokens, the non-zero entries of `attention_mask`); `None` when that saves
    /// no row, or when a row's real tokens are not contiguous (padding only at the ends of a row,
    /// as [`position_ids_from_mask`] reads it). Reads the mask back to the host.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`
    pub fn new(input_ids: &Tensor, attention_mask: &Tensor) -> Result<Option<Packing>> {
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let real: Vec<bool> = Vec::try_from(attention_mask.f_ne(0)?.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
        let (su, bu) = (seq as usize, batch as usize);
        // First fit: each packed row's fill, and for each batch row its packed row, its offset
        // there, its first real column and its count of real tokens.
        let mut fill: Vec<usize> = Vec::new();
        let mut place = Vec::with_capacity(bu);
        for r in 0..bu {
            let row = &real[r * su..(r + 1) * su];
            let n = row.iter().filter(|&&x| x).count();
            let first = row.iter().position(|&x| x).unwrap_or(0);
            if row[first..first + n].iter().any(|&x| !x) {
                return Ok(None);
            }
            let p = match fill.iter().position(|&f| f + n <= su) {
                Some(p) => p,
                None => {
                    fill.push(0);
                    fill.len() - 1
                }
            };
            place.push((p, fill[p], first, n));
            fill[p] += n;
        }
        if fill.len() >= bu {
            return Ok(None);
        }
        let rows = fill.len();
        let mut segments = vec![0i64; rows];
        let mut mask = vec![0i64; rows * su];
        let (mut batch_slots, mut packed_slots) = (Vec::new(), Vec::new());
        for (r, &(p, offset, first, n)) in place.iter().enumerate() {
            segments[p] += 1;
            for k in 0..n {
                let at = p * su + offset + k;
                mask[at] = segments[p];
                batch_slots.push((r * su + first + k) as i64);
                packed_slots.push(at as i64);
            }
        }
        let device = input_ids.device();
        let to_device = |v: &[i64]| Tensor::f_from_slice(v).and_then(|t| t.f_to_device(device));
        let (batch_slots, packed_slots) = (to_device(&batch_slots)?, to_device(&packed_slots)?);
        let mask = to_device(&mask)?.f_view([rows as i64, seq])?;
        let flat_ids = input_ids.f_reshape([batch * seq])?.f_index_select(0, &batch_slots)?;
        let ids = Tensor::f_zeros([rows as i64 * seq], (input_ids.kind(), device))?
            .f_index_copy(0, &packed_slots, &flat_ids)?
            .f_view([rows as i64, seq])?;
        let positions = position_ids_from_mask(&mask)?;
        Ok(Some(Packing { ids, mask, positions, batch_slots, packed_slots, batch, seq }))
    }

    /// The packed rows.
    pub fn rows(&self) -> i64 {
        self.ids.size()[0]
    }

    /// The layers' output back in the batch's layout, zeros at its padding (differentiable: the
    /// gradient of the result reaches `hidden` at the real tokens' slots).
    ///
    /// # Shapes
    /// - `hidden`: `[rows, seq, h]` → `[batch, seq, h]`
    pub fn unpack(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = hidden.size()[2];
        let real = hidden.f_reshape([-1, h])?.f_index_select(0, &self.packed_slots)?; // [tokens, h]
        let out = Tensor::f_zeros([self.batch * self.seq, h], (hidden.kind(), hidden.device()))?;
        Ok(out.f_index_copy(0, &self.batch_slots, &real)?.f_view([self.batch, self.seq, h])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// Rows of 3, 2, 4 and 1 real tokens in a width of 5 pack into two rows: [3, 2] and [4, 1].
    #[test]
    fn rows_pack_first_fit_and_unpack_in_place() {
        let ids = Tensor::from_slice(&[
            0i64, 0, 11, 12, 13, //
            0, 0, 0, 21, 22, //
            0, 31, 32, 33, 34, //
            41, 0, 0, 0, 0,
        ])
        .view([4, 5]);
        let mask = ids.ne(0).to_kind(Kind::Int64);
        let p = Packing::new(&ids, &mask).unwrap().unwrap();
        assert_eq!(p.rows(), 2);
        assert_eq!(Vec::<i64>::try_from(p.ids.flatten(0, -1)).unwrap(), [11, 12, 13, 21, 22, 31, 32, 33, 34, 41]);
        assert_eq!(Vec::<i64>::try_from(p.mask.flatten(0, -1)).unwrap(), [1, 1, 1, 2, 2, 1, 1, 1, 1, 2]);
        assert_eq!(Vec::<i64>::try_from(p.positions.flatten(0, -1)).unwrap(), [0, 1, 2, 0, 1, 0, 1, 2, 3, 0]);
        // The ids as hidden states of one feature: back where they were, zeros at the padding.
        let back = p.unpack(&p.ids.to_kind(Kind::Float).unsqueeze(-1)).unwrap().squeeze_dim(-1);
        assert_eq!(back, ids.to_kind(Kind::Float));
    }

    /// A batch whose rows fill their width saves nothing, and a row with a gap would change its
    /// positions: neither is packed.
    #[test]
    fn full_rows_and_gaps_are_not_packed() {
        let ids = Tensor::ones([3, 4], (Kind::Int64, Device::Cpu));
        assert!(Packing::new(&ids, &ids).unwrap().is_none());
        let gap = Tensor::from_slice(&[1i64, 0, 1, 0, 0, 0, 0, 1]).view([2, 4]);
        assert!(Packing::new(&gap, &gap).unwrap().is_none());
        let ends = Tensor::from_slice(&[0i64, 1, 1, 0, 0, 0, 0, 1]).view([2, 4]);
        assert!(Packing::new(&ends, &ends).unwrap().is_some());
    }
}
