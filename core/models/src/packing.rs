//! Padding-free passes, as verl's `use_remove_padding` and transformers' padding-free collator
//! run them: a batch's rows without their padding, laid back to back in as few rows of the same
//! width as hold them, each sequence a segment of its own (its positions restart at 0 and it
//! attends to no other segment, [`crate::layers::attention_mask`]), and the layers' output put
//! back in the batch's layout. The layers then compute the real tokens only (and the padding at
//! the end of each packed row); every real token sees the same keys at the same positions as in
//! the padded batch, so the hidden states are the padded pass's within float rounding (the
//! GEMMs' shapes change), and so are their gradients. With shared prompts
//! ([`Packing::sharing`]) a prompt is laid once and its rows after it, in packed rows that may be
//! wider than the batch's so that one copy serves more of them ([`Packing::cheapest`] picks the
//! layout and width of the fewest forward FLOPs, [`crate::PassCost`]).

use std::collections::HashMap;

use tch::{Device, Tensor};

use crate::error::Result;
use crate::layers::{branch_segment, position_ids_from_mask};
use crate::pass_cost::PassCost;
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
/// layers' output out (`batch_slots` ← `packed_slots`). Without `record` it only counts the
/// packed rows (to compare layouts before building one).
#[derive(Default)]
struct Layout {
    record: bool,
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
        if self.record {
            self.mask.resize(self.rows * seq, 0);
            self.positions.resize(self.rows * seq, 0);
        }
        self.rows - 1
    }

    /// `n` tokens from batch slot `from` on placed at packed slot `to` on, as segment id `seg`
    /// at positions `pos0 ..`.
    fn place(&mut self, from: usize, to: usize, n: usize, seg: i64, pos0: usize) {
        if !self.record {
            return;
        }
        for k in 0..n {
            self.mask[to + k] = seg;
            self.positions[to + k] = (pos0 + k) as i64;
            self.ids_from.push((from + k) as i64);
            self.ids_to.push((to + k) as i64);
        }
    }

    /// The batch's tokens at `from ..` read the layers' output at packed slots `to ..`.
    fn read(&mut self, from: usize, to: usize, n: usize) {
        if !self.record {
            return;
        }
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
    /// The batch's rows packed first-fit (a row goes into the first packed row with room for its
    /// real tokens, the non-zero entries of `attention_mask`), in row order or longest first,
    /// whichever takes fewer packed rows; `None` when that saves no row, or when a row's real
    /// tokens are not contiguous (padding only at the ends of a row, as [`position_ids_from_mask`]
    /// reads it). Reads the mask back to the host.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`
    pub fn new(input_ids: &Tensor, attention_mask: &Tensor) -> Result<Option<Packing>> {
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let real = real_tokens(attention_mask)?;
        let Some(spans) = spans(&real, batch as usize, seq as usize, 0) else { return Ok(None) };
        let order = whole_order(&spans, seq as usize);
        order.map(|(order, _)| Packing::whole(input_ids, lay_whole(&spans, seq as usize, &order, true))).transpose()
    }

    /// [`Packing::build`] of rows of the batch's width, each segment's positions from 0.
    fn whole(input_ids: &Tensor, layout: Layout) -> Result<Packing> {
        let mut packing = Packing::build(input_ids, layout, input_ids.size()[1])?;
        packing.positions = position_ids_from_mask(&packing.mask)?;
        Ok(packing)
    }

    /// The batch's rows packed with their shared prompts laid once: a prompt (the first
    /// `prefix.len` columns, which `prefix` says which rows share) once in a packed row, and the
    /// rest of each row that holds it after it as a branch ([`branch_segment`]) that sees the
    /// prompt and itself at the positions it has in its row — Prefix Grouper's shared-prefix
    /// forward, padding-free. A row goes after a copy of its prompt with room for it, else into
    /// the first packed row with room for the prompt and it (a new copy) — the rows in their order
    /// or a prompt at a time, whichever takes fewer packed rows. `None` when a row's real tokens
    /// are not contiguous. The model must attend by the mask alone: no sliding window narrower
    /// than the width and no linear attention (a branch's keys do not follow its prompt's slot for
    /// slot, and a recurrence would run through the siblings).
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
        let (bu, su) = (batch as usize, seq as usize);
        let real = real_tokens(attention_mask)?;
        let Some(spans) = shared_spans(&real, bu, su, prefix) else { return Ok(None) };
        let (w, orders) = (width.max(seq) as usize, sharing_orders(&spans, prefix));
        let Some((o, _)) = shared_order(&spans, (bu, su), prefix, w, &orders) else { return Ok(None) };
        Packing::build(input_ids, lay_shared(&spans, su, prefix, w, &orders[o], true), w as i64).map(Some)
    }

    /// The batch packed padding-free at the fewest forward FLOPs ([`PassCost`]): its rows whole
    /// in rows of its width ([`Packing::new`]) or, with `prefix`, its shared prompts laid once
    /// ([`Packing::sharing`]) in rows `min_width` wide (at least the batch's) or wider, where
    /// `shares(width)` says the model attends by the mask alone in rows that wide
    /// ([`crate::CausalLm::packs_shared_prompts`]). The wider widths tried put more of a prompt's
    /// rows after one copy of it: `⌈W / k⌉` for `k` = 1 … 8, `W` the widest prompt with all its
    /// rows' tokens after it; a wider packing is kept only where its rows hold no more query-key
    /// pairs than the padded batch (`rows · width² ≤ batch · seq²`: its attention mask is no
    /// larger, nor its attention's work). Sharing wins a tie, and a narrower width. `None` when no
    /// packing has fewer slots than the batch. Reads the mask back to the host once.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, seq]`; `prefix` of the same batch; returns rows
    ///   of at least `max(min_width, seq)`
    pub fn cheapest(
        input_ids: &Tensor,
        attention_mask: &Tensor,
        prefix: Option<&SharedPrefixes>,
        min_width: i64,
        shares: &dyn Fn(i64) -> bool,
        cost: PassCost,
    ) -> Result<Option<Packing>> {
        let (batch, seq) = (input_ids.size()[0], input_ids.size()[1]);
        let (bu, su) = (batch as usize, seq as usize);
        let real = real_tokens(attention_mask)?;
        let base = min_width.max(seq);
        // The layouts are compared by their rows alone; only the cheapest is laid out in full.
        let mut best: Option<(f64, i64, usize)> = None; // (cost, width, order)
        let shared = prefix.filter(|_| shares(base)).and_then(|p| Some((p, shared_spans(&real, bu, su, p)?)));
        let orders = shared.as_ref().map(|(p, spans)| sharing_orders(spans, p));
        if let (Some((prefix, spans)), Some(orders)) = (&shared, &orders) {
            for w in shared_widths(spans, prefix, base) {
                if w > base && !shares(w) {
                    continue;
                }
                let Some((o, rows)) = shared_order(spans, (bu, su), prefix, w as usize, orders) else { continue };
                let rows = rows as i64;
                if w > base && rows * w * w > batch * seq * seq {
                    continue;
                }
                let c = cost.rows(rows, w);
                if best.is_none_or(|(b, _, _)| c < b) {
                    best = Some((c, w, o));
                }
            }
        }
        if let Some(spans) = spans(&real, bu, su, 0) {
            if let Some((order, rows)) = whole_order(&spans, su) {
                if best.is_none_or(|(b, _, _)| cost.rows(rows as i64, seq) < b) {
                    return Packing::whole(input_ids, lay_whole(&spans, su, &order, true)).map(Some);
                }
            }
        }
        let (Some((_, w, o)), Some((prefix, spans)), Some(orders)) = (best, &shared, &orders) else { return Ok(None) };
        Packing::build(input_ids, lay_shared(spans, su, prefix, w as usize, &orders[o], true), w).map(Some)
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

    /// The packed rows' width.
    pub fn width(&self) -> i64 {
        self.ids.size()[1]
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

/// A batch row's real tokens: its first real column, their count, and how many of them are in
/// the prompt's columns.
struct Span {
    first: usize,
    n: usize,
    n_prompt: usize,
}

/// Each row's [`Span`] with a prompt of `cols` columns; `None` when a row's real tokens are not
/// contiguous.
///
/// # Shapes
/// - `real`: `[batch · seq]`, row after row
fn spans(real: &[bool], batch: usize, seq: usize, cols: usize) -> Option<Vec<Span>> {
    (0..batch)
        .map(|r| {
            let row = &real[r * seq..(r + 1) * seq];
            let (first, n) = real_span(row)?;
            Some(Span { first, n, n_prompt: row[..cols].iter().filter(|&&x| x).count() })
        })
        .collect()
}

/// [`Packing::new`]'s order: the rows first-fit in rows of the batch's width in their order or
/// longest first (first-fit decreasing), whichever takes fewer packed rows (the rows' order on a
/// tie), with its packed rows; `None` when that saves no row.
fn whole_order(spans: &[Span], seq: usize) -> Option<(Vec<usize>, usize)> {
    let in_order: Vec<usize> = (0..spans.len()).collect();
    let mut longest_first = in_order.clone();
    longest_first.sort_by_key(|&r| (std::cmp::Reverse(spans[r].n), r));
    let (a, b) = (lay_whole(spans, seq, &in_order, false).rows, lay_whole(spans, seq, &longest_first, false).rows);
    let best = if b < a { (longest_first, b) } else { (in_order, a) };
    (best.1 < spans.len()).then_some(best)
}

/// The rows `order` lays first-fit in rows of `seq`, each a segment of its own (only counted
/// without `record`).
fn lay_whole(spans: &[Span], seq: usize, order: &[usize], record: bool) -> Layout {
    let (mut layout, mut fill, mut segments) = (Layout { record, ..Layout::default() }, Vec::new(), Vec::new());
    for &r in order {
        let (first, n) = (spans[r].first, spans[r].n);
        let p = layout.fit(&mut fill, n, seq);
        segments.resize(layout.rows, 0);
        segments[p] += 1;
        let (from, to) = (r * seq + first, p * seq + fill[p]);
        layout.place(from, to, n, segments[p], 0);
        layout.read(from, to, n);
        fill[p] += n;
    }
    layout
}

/// The rows' [`Span`]s under `prefix`; `None` when `prefix` is not of this batch or a row's
/// real tokens are not contiguous.
fn shared_spans(real: &[bool], batch: usize, seq: usize, prefix: &SharedPrefixes) -> Option<Vec<Span>> {
    let cols = prefix.len as usize;
    (prefix.of_row.len() == batch && cols <= seq).then(|| spans(real, batch, seq, cols)).flatten()
}

/// The two orders [`Packing::sharing`] lays rows in: as they are, and a prompt at a time (in the
/// order the prompts first appear, each prompt's rows longest first, so that its copies fill
/// before another prompt comes between them).
fn sharing_orders(spans: &[Span], prefix: &SharedPrefixes) -> [Vec<usize>; 2] {
    let in_order: Vec<usize> = (0..spans.len()).collect();
    let mut by_prompt = in_order.clone();
    by_prompt.sort_by_key(|&r| (prefix.of_row[r], std::cmp::Reverse(spans[r].n - spans[r].n_prompt), r));
    [in_order, by_prompt]
}

/// Which of `orders` lays the rows in fewer packed rows of `w` (the first on a tie), and how
/// many; `None` when they would hold no fewer slots than the `(batch, seq)` batch.
fn shared_order(
    spans: &[Span],
    (batch, seq): (usize, usize),
    prefix: &SharedPrefixes,
    w: usize,
    orders: &[Vec<usize>; 2],
) -> Option<(usize, usize)> {
    let rows = orders.each_ref().map(|o| lay_shared(spans, seq, prefix, w, o, false).rows);
    let best = if rows[1] < rows[0] { (1, rows[1]) } else { (0, rows[0]) };
    (best.1 * w < batch * seq).then_some(best)
}

/// The rows `order` lays first-fit in rows of `w`, each prompt once per packed row that holds
/// rows of it ([`Packing::sharing`]; only counted without `record`).
fn lay_shared(spans: &[Span], seq: usize, prefix: &SharedPrefixes, w: usize, order: &[usize], record: bool) -> Layout {
    // Batch slots count in rows of `seq`, packed slots in rows of `w`.
    let (mut layout, mut fill, mut segments) = (Layout { record, ..Layout::default() }, Vec::new(), Vec::new());
    let mut copies: HashMap<i64, Vec<PromptCopy>> = HashMap::new();
    for &r in order {
        let Span { first, n, n_prompt } = spans[r];
        let n_rest = n - n_prompt;
        let group = copies.entry(prefix.of_row[r]).or_default();
        let c = match group.iter().position(|c| fill[c.row] + n_rest <= w) {
            Some(c) => c,
            None => {
                let p = layout.fit(&mut fill, n_prompt + n_rest, w);
                segments.resize(layout.rows, 0);
                segments[p] += 1;
                let at = p * w + fill[p];
                layout.place(r * seq + first, at, n_prompt, segments[p], 0);
                fill[p] += n_prompt;
                group.push(PromptCopy { row: p, at, segment: segments[p], branches: 0 });
                group.len() - 1
            }
        };
        let copy = &mut group[c];
        copy.branches += 1;
        let to = copy.row * w + fill[copy.row];
        layout.place(r * seq + first + n_prompt, to, n_rest, branch_segment(copy.segment, copy.branches), n_prompt);
        fill[copy.row] += n_rest;
        layout.read(r * seq + first, copy.at, n_prompt);
        layout.read(r * seq + first + n_prompt, to, n_rest);
    }
    layout
}

/// The widths [`Packing::cheapest`] tries with shared prompts, narrowest first: `base`, and
/// `⌈W / k⌉` above it for `k` = 1 … 8, where `W` is the widest of the prompts with all their
/// rows' tokens after one copy (a prompt's real tokens plus the rest of each of its rows).
fn shared_widths(spans: &[Span], prefix: &SharedPrefixes, base: i64) -> Vec<i64> {
    let mut groups: HashMap<i64, i64> = HashMap::new();
    for (s, &p) in spans.iter().zip(&prefix.of_row) {
        *groups.entry(p).or_insert(s.n_prompt as i64) += (s.n - s.n_prompt) as i64;
    }
    let widest = groups.values().copied().max().unwrap_or(0);
    let mut widths: Vec<i64> = (1..=8).map(|k| (widest + k - 1) / k).filter(|&w| w > base).collect();
    widths.push(base);
    widths.sort_unstable();
    widths.dedup();
    widths
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

    /// Four rows of 6 under a prompt of 3 columns: rows 0, 2 and 3 share one prompt (2 real
    /// tokens) with 2, 1 and 3 tokens after it, row 1 holds another (3 tokens) with 2 after it.
    fn two_prompts() -> (Tensor, Tensor, SharedPrefixes) {
        let ids = Tensor::from_slice(&[
            0i64, 11, 12, 13, 14, 0, //
            21, 22, 23, 24, 25, 0, //
            0, 11, 12, 15, 0, 0, //
            0, 11, 12, 16, 17, 18,
        ])
        .view([4, 6]);
        let mask = ids.ne(0).to_kind(Kind::Int64);
        let prefix = SharedPrefixes::find(&ids, &mask, 3).unwrap();
        (ids, mask, prefix)
    }

    /// Two prompts, the first held by rows 0, 2 and 3, the second by row 1: the first is laid
    /// once for rows 0 and 2 and again for row 3 (no room left beside them), its rows' rests
    /// follow as branches at the positions they have in their rows, and the layers' output of a
    /// prompt's slots goes back to every row that holds it. A prompt at a time (rows 3, 0, 2, 1)
    /// takes three packed rows too, so the rows' order is kept.
    #[test]
    fn shared_prompts_are_laid_once_per_packed_row() {
        let (ids, mask, prefix) = two_prompts();
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

    /// The cheapest packing of the batch above (one prompt under rows 0, 2 and 3 with 2 + 1 + 3
    /// tokens after it, another under row 1): rows of its width 6 take three rows (18 slots, 108
    /// query-key pairs); rows of 8, the first prompt with all its rows in one, take two (16 slots,
    /// 128 pairs, within the padded batch's 144). Which one runs depends on what a pair costs
    /// beside a slot; on a tie the narrower. Rows packed whole save nothing here.
    #[test]
    fn the_cheapest_width_by_flops() {
        let (ids, mask, prefix) = two_prompts();
        let all = |_: i64| true;
        let width = |per_pair: f64| {
            let cost = PassCost { per_slot: 10.0, per_pair };
            let p = Packing::cheapest(&ids, &mask, Some(&prefix), 0, &all, cost).unwrap().unwrap();
            (p.rows(), p.width())
        };
        assert_eq!(width(0.0), (2, 8)); // 160 against 180
        assert_eq!(width(1.0), (3, 6)); // 288 each
        assert_eq!(width(1.5), (3, 6)); // 342 against 352
                                        // A model that cannot lay prompts once in rows of 8 gets rows of 6.
        let narrow = |w: i64| w <= 6;
        let cost = PassCost { per_slot: 10.0, per_pair: 0.0 };
        let p = Packing::cheapest(&ids, &mask, Some(&prefix), 0, &narrow, cost).unwrap().unwrap();
        assert_eq!((p.rows(), p.width()), (3, 6));
        assert!(Packing::cheapest(&ids, &mask, None, 0, &all, cost).unwrap().is_none());
    }

    /// Four rows of one prompt token and three more fill their width: one row of 13 or two of 7
    /// would hold them in fewer slots, but with more query-key pairs than the batch's 4 × 4²
    /// (169 and 98 against 64), so nothing is packed.
    #[test]
    fn wider_rows_never_hold_more_pairs_than_the_batch() {
        let ids = Tensor::from_slice(&[1i64, 2, 3, 4, 1, 5, 6, 7, 1, 8, 9, 10, 1, 11, 12, 13]).view([4, 4]);
        let mask = ids.ones_like();
        let prefix = SharedPrefixes::find(&ids, &mask, 1).unwrap();
        let cost = PassCost { per_slot: 10.0, per_pair: 0.0 };
        assert!(Packing::cheapest(&ids, &mask, Some(&prefix), 0, &|_| true, cost).unwrap().is_none());
        assert_eq!(Packing::sharing(&ids, &mask, &prefix, 13).unwrap().unwrap().slots(), 13);
    }

    /// Rows of 4, 5, 6 and 5 real tokens in a width of 10 take three packed rows in their order
    /// (4 + 5 | 6 | 5) and two longest first (6 + 4 | 5 + 5), which is what runs.
    #[test]
    fn rows_pack_longest_first_where_that_takes_fewer_rows() {
        let lengths = [4usize, 5, 6, 5];
        let real: Vec<bool> = lengths.iter().flat_map(|&n| (0..10).map(move |c| c < n)).collect();
        let ids = Tensor::from_slice(&real.iter().map(|&x| i64::from(x)).collect::<Vec<_>>()).view([4, 10]);
        let p = Packing::new(&ids, &ids).unwrap().unwrap();
        assert_eq!(p.rows(), 2);
        let rows = |t: &Tensor| Vec::<i64>::try_from(t.flatten(0, -1)).unwrap();
        assert_eq!(rows(&p.mask), [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
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
