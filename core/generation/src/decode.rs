//! The decode loop, built from one capture-safe step.
//!
//! Everything a decode updates lives in device buffers of fixed shape ([`State`]): the KV cache,
//! its key mask, each row's last token and position, the finished and non-finite flags, the
//! step and slot counters, the noise table, and the outputs. A step ([`unit`]) feeds the last
//! token at the slot counter, samples the next one with the noise at the step counter, records
//! it and advances the counters — all in place, nothing read back to the host, no shape that
//! depends on a value — so on CUDA it is captured once as a graph and replayed
//! ([`crate::graphs`]). The host looks every [`GenerateConfig::sync_steps`] steps: non-finite
//! logits end the decode with an error, all rows finished end it, and when few rows are left the
//! batch is compacted to the next power of two that holds them (the noise is keyed by each row's
//! place in the whole batch, so a row samples the same tokens in any batch).

use std::sync::atomic::{AtomicU64, Ordering};

use tch::{Device, Kind, Tensor};

use rlhf_models::{CausalLm, KvCache};

use crate::config::{GenerateConfig, StopCheck};
use crate::error::{GenerationError, Result};
use crate::graphs::Runner;
use crate::noise::uniform_table;

/// Compactions in this process (a decode dropping finished rows into a smaller batch).
static COMPACTIONS: AtomicU64 = AtomicU64::new(0);

/// How many times a decode of this process compacted its batch.
pub fn compactions() -> u64 {
    COMPACTIONS.load(Ordering::Relaxed)
}

/// Where a decode starts.
pub(crate) struct Start {
    /// Holds the prompts (or the turns so far) in slots `..base`.
    pub cache: KvCache,
    /// Which cache slots hold real tokens, `[b, capacity]` int64.
    pub key_mask: Tensor,
    /// The first slot the decode writes.
    pub base: i64,
    /// Each row's next position, `[b, 1]` int64.
    pub next_pos: Tensor,
    /// What the first token is sampled from, `[b, vocab]`.
    pub logits: Tensor,
    /// Rows finished from the start, `[b]` bool.
    pub finished: Tensor,
    /// Whether finished rows may be dropped as the decode goes (not when the caller keeps the
    /// cache, as a multi-turn session does).
    pub compact: bool,
}

/// What a decode sampled, in the rows' original order.
pub(crate) struct Decoded {
    /// `[b, steps]`, the pad id once a row finished.
    pub tokens: Tensor,
    /// Which rows were still running at each step, `[b, steps]` bool.
    pub alive: Tensor,
    /// With [`GenerateConfig::logprobs`]: the sampled tokens' log-probs, `[b, steps]` f32.
    pub logprobs: Option<Tensor>,
    /// The cache and key mask after the decode (the rows in their original order when the decode
    /// did not compact); every sampled token but the last was fed at slots `base..`.
    pub cache: KvCache,
    pub key_mask: Tensor,
}

/// The device buffers a step updates in place (see the module docs).
pub(crate) struct State {
    cache: KvCache,
    key_mask: Tensor,      // [b, capacity] i64
    tokens: Tensor,        // [b, 1] i64: the last sampled token, fed next
    pos: Tensor,           // [b, 1] i64: its position
    finished: Tensor,      // [b] bool
    broken: Tensor,        // [b] bool: the row's logits were not finite at some step
    rows: Tensor,          // [b] i64: each row's place in the outputs
    noise: Option<Tensor>, // [max_new, b] f32 uniforms (sampling)
    step: Tensor,          // [1] i64: the step sampled last
    slot: Tensor,          // [1] i64: where the next fed token goes
}

/// The decode's outputs in the rows' original order, `[batch, max_new]`.
struct Outputs {
    tokens: Tensor,           // i64, pad where nothing was sampled
    alive: Tensor,            // bool
    logprobs: Option<Tensor>, // f32
}

impl State {
    /// Rows in the current batch.
    fn rows(&self) -> i64 {
        self.tokens.size()[0]
    }

    /// Keeps the rows `index` (in that order) of every buffer.
    ///
    /// # Shapes
    /// `index`: `[rows]` int64
    fn select(&mut self, index: &Tensor) -> Result<()> {
        self.cache.select_rows(index)?;
        let pick = |t: &Tensor| t.f_index_select(0, index);
        self.key_mask = pick(&self.key_mask)?;
        self.tokens = pick(&self.tokens)?;
        self.pos = pick(&self.pos)?;
        self.finished = pick(&self.finished)?;
        self.broken = pick(&self.broken)?;
        self.rows = pick(&self.rows)?;
        if let Some(n) = &self.noise {
            self.noise = Some(n.f_index_select(1, index)?);
        }
        Ok(())
    }
}

/// The smallest batch the compacted rows go in: the next power of two that holds `alive` rows,
/// at most `current` (so a batch shrinks through a few fixed sizes, each captured once).
fn bucket(alive: i64, current: i64) -> i64 {
    (alive.max(1) as u64).next_power_of_two().min(current as u64) as i64
}

/// Samples the token of step `st.step` from `logits` for every row, records it, and marks the
/// rows it finishes. Capture-safe.
///
/// # Shapes
/// `logits`: `[b, vocab]`
fn sample(st: &mut State, out: &Outputs, logits: &Tensor, cfg: &GenerateConfig, eos: &Tensor) -> Result<()> {
    let bad = logits.f_isfinite()?.f_all_dim(-1, false)?.f_logical_not()?; // [b]
    let _ = st.broken.f_logical_or_(&bad)?;
    let logits = logits.f_masked_fill(&bad.f_unsqueeze(1)?, 0.0)?; // [b, vocab]
    let u = match &st.noise {
        Some(n) => Some(n.f_index_select(0, &st.step)?.f_squeeze_dim(0)?), // [b]
        None => None,
    };
    let next = cfg.sampling.next_tokens(&logits, u.as_ref())?.f_masked_fill(&st.finished, cfg.pad_token_id)?; // [b]
    let alive = st.finished.f_logical_not()?; // [b]
    let at = [Some(st.rows.shallow_clone()), Some(st.step.shallow_clone())];
    if let Some(lps) = &out.logprobs {
        let lp = logits.f_log_softmax(-1, Kind::Float)?.f_gather(1, &next.f_unsqueeze(1)?, false)?; // [b, 1]
        let _ = lps.shallow_clone().f_index_put_(&at, &lp.f_squeeze_dim(1)?.f_mul(&alive)?, false)?;
    }
    let _ = out.tokens.shallow_clone().f_index_put_(&at, &next, false)?;
    let _ = out.alive.shallow_clone().f_index_put_(&at, &alive, false)?;
    if eos.numel() > 0 {
        // Compared with every EOS id (`isin` may sort and deduplicate: a shape that depends on
        // values, which a captured step cannot have).
        let hit = next.f_unsqueeze(1)?.f_eq_tensor(&eos.f_view([1, -1])?)?.f_any_dim(1, false)?; // [b]
        let _ = st.finished.f_logical_or_(&hit)?;
    }
    st.tokens.f_copy_(&next.f_unsqueeze(1)?)?;
    Ok(())
}

/// One decode step: feeds each row's last token at the slot counter, then samples the next
/// step's token from the logits after it. Capture-safe: in-place updates of fixed-shape buffers.
fn unit(model: &CausalLm, st: &mut State, out: &Outputs, cfg: &GenerateConfig, eos: &Tensor) -> Result<()> {
    let _ = st.key_mask.f_index_fill_(1, &st.slot, 1)?;
    let logits = model.decode_step(&st.tokens, &st.pos, &st.key_mask, &st.slot, &mut st.cache)?; // [b, vocab]
    let _ = st.slot.f_add_scalar_(1)?;
    let _ = st.pos.f_add_scalar_(1)?;
    let _ = st.step.f_add_scalar_(1)?;
    sample(st, out, &logits, cfg, eos)
}

/// The noise key of a decode: the config's, or one drawn from libtorch's (seeded, CPU)
/// generator, so a seeded run repeats and data-parallel ranks in step draw the same key.
fn noise_key(cfg: &GenerateConfig) -> Result<u64> {
    match cfg.noise_key {
        Some(k) => Ok(k),
        None => Ok(Tensor::f_randint(i64::MAX, [1], (Kind::Int64, Device::Cpu))?.f_int64_value(&[0])? as u64),
    }
}

/// Decodes up to `cfg.max_new_tokens` tokens per row from `s` (see the module docs); `stop`
/// ends rows after any step, as an EOS does.
pub(crate) fn decode(
    model: &CausalLm,
    s: Start,
    cfg: &GenerateConfig,
    mut stop: Option<StopCheck<'_>>,
) -> Result<Decoded> {
    let Start { cache, key_mask, base, next_pos, logits, finished, compact } = s;
    let (batch, device) = (logits.size()[0], logits.device());
    let max_new = cfg.max_new_tokens;
    let noise = match cfg.sampling {
        crate::Sampling::Greedy => None,
        _ => {
            let first_row = cfg.rows.map_or(0, |w| w.offset);
            if let Some(w) = cfg.rows.filter(|w| w.offset < 0 || w.offset + batch > w.total) {
                return Err(GenerationError::Input(format!(
                    "rows {}..{} are outside a batch of {}",
                    w.offset,
                    w.offset + batch,
                    w.total
                )));
            }
            Some(uniform_table(noise_key(cfg)?, first_row, batch, max_new, device)?)
        }
    };
    let eos = Tensor::f_from_slice(&cfg.eos_token_ids)?.f_to_device(device)?;
    let i64s = (Kind::Int64, device);
    let mut st = State {
        cache,
        key_mask,
        tokens: Tensor::f_full([batch, 1], cfg.pad_token_id, i64s)?,
        pos: next_pos.f_contiguous()?,
        finished: finished.f_contiguous()?,
        broken: Tensor::f_zeros([batch], (Kind::Bool, device))?,
        rows: Tensor::f_arange(batch, i64s)?,
        noise,
        step: Tensor::f_zeros([1], i64s)?,
        slot: Tensor::f_full([1], base, i64s)?,
    };
    let out = Outputs {
        tokens: Tensor::f_full([batch, max_new], cfg.pad_token_id, i64s)?,
        alive: Tensor::f_zeros([batch, max_new], (Kind::Bool, device))?,
        logprobs: if cfg.logprobs { Some(Tensor::f_zeros([batch, max_new], (Kind::Float, device))?) } else { None },
    };
    let sync_every = cfg.sync_steps(device);
    let mut runner = Runner::new(model, cfg)?;
    sample(&mut st, &out, &logits, cfg, &eos)?;
    let mut steps = 1;
    loop {
        if let Some(stop) = stop.as_mut() {
            apply_stop(stop, &mut st, &out, steps - 1, batch)?;
        }
        let last = steps == max_new;
        if last || steps % sync_every == 0 {
            let alive = check(&st, steps - 1)?;
            if last || alive == 0 {
                break;
            }
            let rows = bucket(alive, st.rows());
            if compact && rows < st.rows() {
                // The running rows first (in order), then finished ones to fill the bucket.
                let order = st.finished.f_to_kind(Kind::Int64)?.f_argsort_stable(true, 0, false)?;
                st.select(&order.f_narrow(0, 0, rows)?)?;
                runner.reset();
                COMPACTIONS.fetch_add(1, Ordering::Relaxed);
            }
        }
        runner.run(&mut |/* one step */| unit(model, &mut st, &out, cfg, &eos))?;
        steps += 1;
    }
    let mut cache = st.cache;
    // Every sampled token but the last was fed.
    cache.set_len(base + steps - 1)?;
    Ok(Decoded {
        tokens: out.tokens.f_narrow(1, 0, steps)?,
        alive: out.alive.f_narrow(1, 0, steps)?,
        logprobs: out.logprobs.map(|l| l.f_narrow(1, 0, steps)).transpose()?,
        cache,
        key_mask: st.key_mask,
    })
}

/// The host check after step `step`: an error if some row's logits were not finite, else how
/// many rows are still running (one read of two numbers).
fn check(st: &State, step: i64) -> Result<i64> {
    let flags = Tensor::f_stack(
        &[st.broken.f_any()?.f_to_kind(Kind::Int64)?, st.finished.f_logical_not()?.f_sum(Kind::Int64)?],
        0,
    )?;
    let flags = Vec::<i64>::try_from(flags.f_to_device(Device::Cpu)?)?;
    if flags[0] != 0 {
        return Err(GenerationError::NonFiniteLogits { step });
    }
    Ok(flags[1])
}

/// Runs the caller's stop check on step `step`'s tokens (all rows, in their original order) and
/// finishes the rows it names.
fn apply_stop(stop: StopCheck<'_>, st: &mut State, out: &Outputs, step: i64, batch: i64) -> Result<()> {
    let tokens = Vec::<i64>::try_from(out.tokens.f_select(1, step)?.f_to_device(Device::Cpu)?)?;
    let flags = stop(&tokens)?;
    if flags.len() as i64 != batch {
        return Err(GenerationError::Input(format!("stop check gave {} flags for {batch} rows", flags.len())));
    }
    let flags = Tensor::f_from_slice(&flags)?.f_to_device(st.finished.device())?.f_index_select(0, &st.rows)?;
    let _ = st.finished.f_logical_or_(&flags)?;
    Ok(())
}
