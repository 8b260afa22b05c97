//! Padding-free passes, as verl's `use_remove_padding` and transformers' padding-free collator
//! run them: a batch's rows without their padding, laid back to back in as few rows of the same
//! width as hold them, each sequence a segment of its own (its positions restart at 0 and it
//! attends to no other segment, [`crate::layers::attention_mask`]), and the layers' output put
//! back in the batch's layout. The layers then compute the real tokens only (and the padding at
//! the end of each packed row); every real token sees the same keys at the same positions as in
//! the padded batch, so the hidden states are the padded pass's within float rounding (the
//! GEMMs' shapes change), and so are their gradients. With shared prompts
//! ([`Packing::sharing`]) a prompt is laid once and its rows after it, in packed rows that may be
//! wider than the batch's so that one copy serves more of them.

use std::collections::HashMap;

use tch::{Device, Tensor};

use crate::error::Result;
use crate::layers::{branch_segment, position_ids_from_mask};
use crate::prefix::SharedPrefixes;

/// A batch packed into fewer token slots: rows of its width, or wider ones with shared prompts.
///
/// # Shapes
/// `ids`, `mask`, `positions`: `[rows, width]` (int64; `mask` holds segment ids 1, 2, … and 0
/// for padding, [`crate::layers::attention_mask`]) for a batch of `[batch, seq]`, `width ≥ seq`,
/// `rows · width < batch · seq`.
#[derive(Debug)]
pub struct Packing {
    pub ids: Tensor,
    pub mask: Tensor,
    pub positions: Tensor,
    /// Flat indices (into `batch · seq`) of the batch's real tokens, and where each of them sits
    /// in the packed rows (into `rows · width`), in the same order. A shared prompt's packed slots
    /// appear once for each row that reads them.
    batch_slots: Tensor,
    packed_slots: Tensor,
    batch: i64,
    seq: i64,
}

/// Where a batch row's real tokens are: its first real column and its count of real tokens, or
/// `None` when they are not contiguous (padding only at the ends of a row, as
/// [`position_ids_from_mask`] reads it).
fn real_span(row: &[bool]) -> Option<(usize, usize)> {
    let n = row.iter().filter(|&&x| x).count();
    let first = row.iter().position(|&x| x).unwrap_or(0);
    row[first..first + n].iter().all(|&x| x).then_some((first, n))
}

/// The packed layout on the host: each packed token's segment id and position, and the slot
/// pairs that move the batch's tokens in (`ids_from` → `ids_to`, each packed slot once) and the
/// layers' output out (`batch_slots` ← `packed_slots`).
#[derive(Default)]
struct Layout {
    rows: usize,
    mask: Vec<i64>,
    positions: Vec<i64>,
    ids_from: Vec<i64>,
    ids_to: Vec<i64>,
    batch_slots: Vec<i64>,
    packed_slots: Vec<i64>,
}

impl Layout {
    /// A packed row with room for `n` more tokens (first fit), opened when none has: its index.
    fn fit(&mut self, fill: &mut Vec<usize>, n: usize, seq: usize) -> usize {
        if let Some(p) = fill.iter().position(|&f| f + n <= seq) {
            return p;
        }
        fill.push(0);
        self.rows = fill.len();
        self.mask.resize(self.rows * seq, 0);
        self.positions.resize(self.rows * seq, 0);
        self.rows - 1
    }

    /// `n` tokens from batch slot `from` on placed at packed slot `to` on, as segment id `seg`
    /// at positions `pos0 ..`.
    fn place(&mut self, from: usize, to: usize, n: usize, seg: i64, pos0: usize) {
        for k in 0..n {
            self.mask[to + k] = seg;
            self.positions[to + k] = (pos0 + k) as i64;
            self.ids_from.push((from + k) as i64);
            self.ids_to.push((to + k) as i64);
        }
    }

    /// The batch's tokens at `from ..` read the layers' output at packed slots `to ..`.
    fn read(&mut self, from: usize, to: usize, n: usize) {
        self.batch_slots.extend((from..from + n).map(|s| s as i64));
        self.packed_slots.extend((to..to + n).map(|s| s as i64));
    }
}

/// A prompt laid once in a packed row: the row, its first slot, its segment id and the branches
/// placed after it so far.
struct PromptCopy {
    row: usize,
    at: usize,
    segment: i64,
    branches: i64,
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
        let real = real_tokens(attention_mask)?;
        let (su, bu) = (seq as usize, batch as usize);
        let (mut layout, mut fill, mut segments) = (Layout::default(), Vec::new(), Vec::new());
        for r in 0..bu {
            let Some((first, n)) = real_span(&real[r * su..(r + 1) * su]) else { return Ok(None) };
            let p = layout.fit(&mut fill, n, su);
            segments.resize(layout.rows, 0);
            segments[p] += 1;
            let (from, to) = (r * su + first, p * su + fill[p]);
            layout.place(from, to, n, segments[p], 0);
            layout.read(from, to, n);
            fill[p] += n;
        }
        if layout.rows >= bu {
            return Ok(None);
        }
        let mut packing = Packing::build(input_ids, layout, seq)?;
        packing.positions = position_ids_from_mask(&packing.mask)?;
        Ok(Some(packing))
    }

    /// The batch's rows packed with their shared prompts laid once: a prompt (the first
    /// `prefix.len` columns, which `prefix` says which rows share) once in a packed row, and the
    /// rest of each row that holds it after it as a branch ([`branch_segment`]) that sees the
    /// prompt and itself at the positions it has in its row — Prefix Grouper's shared-prefix
    /// forward, padding-free. A row goes after a copy of its prompt with room for it, else into
    /// the first packed row with room for the prompt and it (a new copy). `None` when that saves
    /// no row or a row's real tokens are not contiguous. The model must attend by the mask alone:
    /// no sliding window narrower than the width and no linear attention (a branch's keys do not
    /// follow its prompt's slot for slot, and a recurrence would run through the siblings).
    /// The packed rows are `width` slots wide (at least `seq`: wider rows hold more of a prompt's
    /// rows after one copy of it); `None` too when they would hold no fewer slots than the batch.
    /// Reads the mask back to the host.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`; `prefix` of the same batch; returns rows
    ///   of `max(width, seq)`
    pub fn sharing(
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: &SharedPrefixes,
        width: i64,
    ) -> Result<Option<Packing>> {
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let real = real_tokens(attention_mask)?;
        // Batch slots count in rows of `su`, packed slots in rows of `w`.
        let (su, bu, cols, w) = (seq as usize, batch as usize, prefix.len as usize, width.max(seq) as usize);
        if prefix.of_row.len() != bu || cols > su {
            return Ok(None);
        }
        let (mut layout, mut fill, mut segments) = (Layout::default(), Vec::new(), Vec::new());
        let mut copies: HashMap<i64, Vec<PromptCopy>> = HashMap::new();
        for r in 0..bu {
            let row = &real[r * su..(r + 1) * su];
            let Some((first, n)) = real_span(row) else { return Ok(None) };
            let n_prompt = row[..cols].iter().filter(|&&x| x).count();
            let n_rest = n - n_prompt;
            let group = copies.entry(prefix.of_row[r]).or_default();
            let c = match group.iter().position(|c| fill[c.row] + n_rest <= w) {
                Some(c) => c,
                None => {
                    let p = layout.fit(&mut fill, n_prompt + n_rest, w);
                    segments.resize(layout.rows, 0);
                    segments[p] += 1;
                    let at = p * w + fill[p];
                    layout.place(r * su + first, at, n_prompt, segments[p], 0);
                    fill[p] += n_prompt;
                    group.push(PromptCopy { row: p, at, segment: segments[p], branches: 0 });
                    group.len() - 1
                }
            };
            let copy = &mut group[c];
            copy.branches += 1;
            let to = copy.row * w + fill[copy.row];
            layout.place(r * su + first + n_prompt, to, n_rest, branch_segment(copy.segment, copy.branches), n_prompt);
            fill[copy.row] += n_rest;
            layout.read(r * su + first, copy.at, n_prompt);
            layout.read(r * su + first + n_prompt, to, n_rest);
        }
        if layout.rows * w >= bu * su {
            return Ok(None);
        }
        Packing::build(input_ids, layout, w as i64).map(Some)
    }

    /// The batch packed padding-free: with `prefix` (shared prompts the model may lay once in
    /// rows `width` wide, [`crate::CausalLm::packs_shared_prompts`]) as [`Packing::sharing`] packs
    /// it where that saves slots, else its rows whole ([`Packing::new`]); `None` when neither
    /// saves a row.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`; `prefix` of the same batch
    pub fn best(
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: Option<&SharedPrefixes>,
        width: i64,
    ) -> Result<Option<Packing>> {
        if let Some(prefix) = prefix {
            if let Some(p) = Packing::sharing(input_ids, attention_mask, prefix, width)? {
                return Ok(Some(p));
            }
        }
        Packing::new(input_ids, attention_mask)
    }

    /// The packed tensors of `layout` (rows `width` wide) on `input_ids`' device.
    fn build(input_ids: &Tensor, layout: Layout, width: i64) -> Result<Packing> {
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let (device, rows) = (input_ids.device(), layout.rows as i64);
        let to_device = |v: &[i64]| Tensor::f_from_slice(v).and_then(|t| t.f_to_device(device));
        let flat_ids = input_ids.f_reshape([batch * seq])?.f_index_select(0, &to_device(&layout.ids_from)?)?;
        let ids = Tensor::f_zeros([rows * width], (input_ids.kind(), device))?
            .f_index_copy(0, &to_device(&layout.ids_to)?, &flat_ids)?
            .f_view([rows, width])?;
        Ok(Packing {
            ids,
            mask: to_device(&layout.mask)?.f_view([rows, width])?,
            positions: to_device(&layout.positions)?.f_view([rows, width])?,
            batch_slots: to_device(&layout.batch_slots)?,
            packed_slots: to_device(&layout.packed_slots)?,
            batch,
            seq,
        })
    }

    /// The packed rows.
    pub fn rows(&self) -> i64 {
        self.ids.size()[0]
    }

    /// The token slots of the packed rows (rows × their width).
    pub fn slots(&self) -> i64 {
        self.ids.numel() as i64
    }

    /// The layers' output back in the batch's layout, zeros at its padding (differentiable: the
    /// gradient of the result reaches `hidden` at the real tokens' slots).
    ///
    /// # Shapes
    /// - `hidden`: `[rows, width, h]` → `[batch, seq, h]`
    pub fn unpack(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = hidden.size()[2];
        let real = hidden.f_reshape([-1, h])?.f_index_select(0, &self.packed_slots)?; // [tokens, h]
        let out = Tensor::f_zeros([self.batch * self.seq, h], (hidden.kind(), hidden.device()))?;
        Ok(out.f_index_copy(0, &self.batch_slots, &real)?.f_view([self.batch, self.seq, h])?)
    }
}

/// Whether each token of `attention_mask` is real, row after row, on the host.
fn real_tokens(attention_mask: &Tensor) -> Result<Vec<bool>> {
    Ok(Vec::try_from(attention_mask.f_ne(0)?.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?)
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

    /// Two prompts, the first held by rows 0, 2 and 3, the second by row 1: the first is laid
    /// once for rows 0 and 2 and again for row 3 (no room left beside them), its rows' rests
    /// follow as branches at the positions they have in their rows, and the layers' output of a
    /// prompt's slots goes back to every row that holds it.
    #[test]
    fn shared_prompts_are_laid_once_per_packed_row() {
        let ids = Tensor::from_slice(&[
            0i64, 11, 12, 13, 14, 0, //
            21, 22, 23, 24, 25, 0, //
            0, 11, 12, 15, 0, 0, //
            0, 11, 12, 16, 17, 18,
        ])
        .view([4, 6]);
        let mask = ids.ne(0).to_kind(Kind::Int64);
        let prefix = SharedPrefixes::find(&ids, &mask, 3).unwrap();
        assert_eq!(prefix.of_row, [0, 1, 0, 0]);
        let p = Packing::sharing(&ids, &mask, &prefix, 0).unwrap().unwrap();
        assert_eq!(p.rows(), 3);
        let rows = |t: &Tensor| Vec::<i64>::try_from(t.flatten(0, -1)).unwrap();
        assert_eq!(rows(&p.ids), [11, 12, 13, 14, 15, 0, 21, 22, 23, 24, 25, 0, 11, 12, 16, 17, 18, 0]);
        let (b1, b2) = (branch_segment(1, 1), branch_segment(1, 2));
        assert_eq!(rows(&p.mask), [1, 1, b1, b1, b2, 0, 1, 1, 1, b1, b1, 0, 1, 1, b1, b1, b1, 0]);
        assert_eq!(rows(&p.positions), [0, 1, 2, 3, 2, 0, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 0]);
        let back = p.unpack(&p.ids.to_kind(Kind::Float).unsqueeze(-1)).unwrap().squeeze_dim(-1);
        assert_eq!(back, ids.to_kind(Kind::Float));
        // The prompt's slots read by three rows: their gradients sum there.
        let hidden = Tensor::zeros([3, 6, 1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        p.unpack(&hidden).unwrap().sum(Kind::Float).backward();
        assert_eq!(rows(&hidden.grad().to_kind(Kind::Int64)), [2, 2, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]);
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
