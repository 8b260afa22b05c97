//! A decode that continues across turns: multi-turn episodes append each observation to the KV
//! cache and go on sampling, instead of prefilling the whole context again every turn.
//!
//! A [`Session`] holds the cache, its key mask (which slots hold a row's real tokens) and each
//! row's next position. Rows append chunks of different lengths in one forward pass, so a row's
//! slots are not contiguous: a shorter chunk leaves masked padding slots after it, as does a row
//! that finished its turn before the others. Positions count real tokens only, and masked slots
//! take no attention, so a row sees exactly its own tokens in order — the same keys and values a
//! fresh prefill of the whole context computes, up to float rounding. Before each turn the cache
//! is compacted (every row's real slots moved to the front, left-padded), so it never grows by
//! more than the turn's own tokens. Slots are what a sliding window counts, so a model with one
//! cannot use a session (its episodes re-prefill).

use tch::{Kind, Tensor};

use rlhf_models::{position_ids_from_mask, CausalLm, KvCache};

use crate::batch::left_pad;
use crate::config::{GenerateConfig, StopCheck};
use crate::decode::{decode, Decoded, Start};
use crate::error::{GenerationError, Result};
use crate::generate::prefill;

/// A decode that continues across turns (see the module docs).
pub struct Session {
    cache: KvCache,
    /// Which cache slots hold real tokens, `[b, capacity]` i64.
    mask: Tensor,
}

/// One turn's samples, as [`crate::Generated`] has them for a response: `tokens` `[b, steps]`,
/// `response_mask` `[b, steps]` (1 up to and including the row's last token), `logprobs`.
pub struct Turn {
    pub tokens: Tensor,
    pub response_mask: Tensor,
    pub logprobs: Option<Tensor>,
    /// Per row, how many of its sampled tokens are in the cache (all but a last one sampled
    /// when the decode ended); the rest must be appended before the next turn.
    pub cached: Vec<usize>,
}

impl Session {
    /// Prefills left-padded `contexts` (runs of `group` identical rows share one prefill, as in
    /// [`crate::generate`]), with room for `extra` more slots; returns the last logits `[b, vocab]`.
    pub fn start(
        model: &CausalLm,
        contexts: &[Vec<i64>],
        pad: i64,
        group: i64,
        extra: i64,
    ) -> Result<(Session, Tensor)> {
        tch::no_grad(|| {
            let device = model.device();
            let padded = left_pad(contexts, pad, device)?;
            let (b, len) = (padded.input_ids.size()[0], padded.input_ids.size()[1]);
            let prompt_mask = padded.attention_mask.f_to_kind(Kind::Int64)?;
            let mut cache = model.new_cache(b / group, len + extra)?;
            let mask = Tensor::f_zeros([b, len + extra], (Kind::Int64, device))?;
            mask.f_narrow(1, 0, len)?.f_copy_(&prompt_mask)?;
            let positions = position_ids_from_mask(&prompt_mask)?;
            let logits = prefill(model, &padded.input_ids, &prompt_mask, &positions, &mut cache, group)?;
            Ok((Session { cache, mask }, logits))
        })
    }

    /// Moves every row's real slots to the front (left-padded, in order) with room for `extra`
    /// more slots.
    pub fn compact(&mut self, extra: i64) -> Result<()> {
        let used = self.cache.len();
        let device = self.mask.device();
        let rows = crate::batch::to_rows(&self.mask.f_narrow(1, 0, used)?)?;
        let width = rows.iter().map(|r| r.iter().filter(|&&m| m != 0).count()).max().unwrap_or(0).max(1);
        let (mut index, mut mask) = (Vec::new(), Vec::new());
        for r in &rows {
            let real: Vec<i64> = (0..used).filter(|&s| r[s as usize] != 0).collect();
            let pad = width - real.len();
            index.extend(std::iter::repeat_n(0, pad).chain(real.iter().copied()));
            mask.extend(std::iter::repeat_n(0, pad).chain(std::iter::repeat_n(1, real.len())));
        }
        let b = rows.len() as i64;
        let index = Tensor::f_from_slice(&index)?.f_view([b, width as i64])?.f_to_device(device)?;
        self.cache = self.cache.gather_slots(&index, width as i64 + extra)?;
        let m = Tensor::f_zeros([b, width as i64 + extra], (Kind::Int64, device))?;
        m.f_narrow(1, 0, width as i64)?
            .f_copy_(&Tensor::f_from_slice(&mask)?.f_view([b, width as i64])?.f_to_device(device)?)?;
        self.mask = m;
        Ok(())
    }

    /// Masks out the last real slot of each row of `rows` (its token is appended again next).
    /// Right after [`Session::compact`], where a row's real slots end at the last used one.
    pub fn unmask_last(&mut self, rows: &[usize]) -> Result<()> {
        let last = self.cache.len() - 1;
        for &r in rows {
            let _ = self.mask.f_get(r as i64)?.f_narrow(0, last, 1)?.f_fill_(0)?;
        }
        Ok(())
    }

    /// Appends each row's `chunks[r]` (right-padded with `pad` into one forward pass) and returns
    /// the logits after each row's last appended token `[b, vocab]` (zeros for an empty chunk).
    /// The cache must have room ([`Session::compact`]).
    pub fn append(&mut self, model: &CausalLm, chunks: &[Vec<i64>], pad: i64) -> Result<Tensor> {
        tch::no_grad(|| {
            let device = model.device();
            let b = chunks.len() as i64;
            let width = chunks.iter().map(Vec::len).max().unwrap_or(0).max(1) as i64;
            let used = self.cache.len();
            let (mut ids, mut real) = (vec![pad; (b * width) as usize], vec![0i64; (b * width) as usize]);
            for (r, c) in chunks.iter().enumerate() {
                for (j, &t) in c.iter().enumerate() {
                    ids[r * width as usize + j] = t;
                    real[r * width as usize + j] = 1;
                }
            }
            let ids = Tensor::f_from_slice(&ids)?.f_view([b, width])?.f_to_device(device)?;
            let real = Tensor::f_from_slice(&real)?.f_view([b, width])?.f_to_device(device)?;
            // A row's positions continue from its real tokens so far.
            let before = self.mask.f_narrow(1, 0, used)?.f_sum_dim_intlist(1, true, Kind::Int64)?; // [b, 1]
            let positions = before.f_add(&real.f_cumsum(1, Kind::Int64)?.f_sub_scalar(1)?.f_clamp_min(0)?)?;
            self.mask.f_narrow(1, used, width)?.f_copy_(&real)?;
            let hidden = model.hidden_states(
                &ids,
                &self.mask.f_narrow(1, 0, used + width)?,
                &positions,
                Some(&mut self.cache),
            )?;
            let lens: Vec<i64> = chunks.iter().map(|c| (c.len() as i64 - 1).max(0)).collect();
            let last = Tensor::f_from_slice(&lens)?.f_to_device(device)?.f_view([b, 1, 1])?;
            let h = hidden.f_gather(1, &last.f_expand([b, 1, hidden.size()[2]], false)?, false)?.f_squeeze_dim(1)?;
            let logits = model.logits_from_hidden(&h)?;
            let empty: Vec<bool> = chunks.iter().map(Vec::is_empty).collect();
            let empty = Tensor::f_from_slice(&empty)?.f_to_device(device)?.f_view([b, 1])?;
            Ok(logits.f_masked_fill(&empty, 0.0)?)
        })
    }

    /// Decodes one turn from `logits` as [`crate::generate_until`] does (the same sampling, EOS,
    /// `stop` and checks); rows in `done` are finished from the start. The turn's cache slots of
    /// tokens sampled after a row finished are masked out again.
    ///
    /// # Shapes
    /// `logits`: `[b, vocab]`; see [`Turn`].
    pub fn decode(
        &mut self,
        model: &CausalLm,
        logits: Tensor,
        done: &[bool],
        cfg: &GenerateConfig,
        stop: Option<StopCheck<'_>>,
    ) -> Result<Turn> {
        cfg.check()?;
        let device = model.device();
        let base = self.cache.len();
        if base + cfg.max_new_tokens > self.cache.max_len() {
            return Err(GenerationError::Input(format!(
                "session cache of {} slots has no room for {} more after {base}",
                self.cache.max_len(),
                cfg.max_new_tokens
            )));
        }
        tch::no_grad(|| {
            let next_pos = self.mask.f_narrow(1, 0, base)?.f_sum_dim_intlist(1, true, Kind::Int64)?; // [b, 1]
            let finished = Tensor::f_from_slice(done)?.f_to_device(device)?;
            // The decode writes into this session's cache and mask and hands them back; it
            // keeps every row (no compaction), so they stay in the session's row order.
            let cache = std::mem::replace(&mut self.cache, KvCache::growing());
            let key_mask = self.mask.shallow_clone();
            let start = Start { cache, key_mask, base, next_pos, logits, finished, compact: false };
            let Decoded { tokens, alive, logprobs, cache, key_mask } = decode(model, start, cfg, stop)?;
            (self.cache, self.mask) = (cache, key_mask);
            let response_mask = alive.f_to_kind(Kind::Int64)?; // [b, steps]
            let fed = tokens.size()[1] - 1;
            // A row's slots past its own last token held its padding: masked out again.
            let kept = response_mask.f_narrow(1, 0, fed)?;
            self.mask.f_narrow(1, base, fed)?.f_copy_(&kept)?;
            let cached =
                Vec::<i64>::try_from(kept.f_sum_dim_intlist(1, false, Kind::Int64)?.f_to_device(tch::Device::Cpu)?)?
                    .into_iter()
                    .map(|n| n as usize)
                    .collect();
            Ok(Turn { tokens, response_mask, logprobs, cached })
        })
    }
}
