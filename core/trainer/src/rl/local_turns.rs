//! The local engine's policy turns of multi-turn episodes ([`super::episode`]).
//!
//! Every turn decodes all rows of the batch (rows already done stop at once) with the seed of
//! (step, turn), so a row's sampling does not depend on how many decode steps the other rows of
//! its rank needed. With `environment.kv_reuse` (the default) the batch keeps one decode
//! [`Session`] across its turns: a turn appends what each row's trajectory gained since the
//! cache last saw it — the token sampled last (a decode ends before feeding it) and the
//! observation — and continues from the cached keys and values; otherwise (or for a model with a
//! sliding window, which counts cache slots, or with linear attention, whose state cannot skip
//! the padding slots a session leaves) every turn prefills the whole context again. So does a
//! batch whose prompts or observations hold images (from the turn an observation first brings
//! one): each turn prefills the images with the context, at the multimodal positions they take,
//! and the text after them; an image token an earlier turn sampled stays text.

use rlhf_generation::{batch::to_rows, generate_until_with_images, left_pad, GenerateConfig, RowWindow, Session};
use rlhf_models::{CausalLm, Images};
use tch::{Kind, Tensor};

use crate::error::Result;
use rlhf_tokenizer::HfTokenizer;

use crate::config::{EnvironmentConfig, RolloutConfig};
use crate::rl::observed::ObservationImages;
use crate::rl::rollout::{diverged, generate_config};

/// The settings of one batch of episodes.
pub struct EpisodeSettings<'a> {
    pub rollout: &'a RolloutConfig,
    pub env: &'a EnvironmentConfig,
    /// The configured and the plugin's stop strings.
    pub stops: &'a [String],
    pub tok: &'a HfTokenizer,
    pub eos_ids: &'a [i64],
    pub pad: i64,
    /// Where this rank's rows sit in the whole batch.
    pub rows: Option<RowWindow>,
    /// Seeds turn `t >= 1` with `turn_seed + t` mixed.
    pub turn_seed: u64,
    /// Keys every turn's sampling noise by `turn_seed` and the turn instead of seeding libtorch's
    /// process-wide generator (an asynchronous generation worker).
    pub keyed: bool,
    /// How observations' images are read (or why they cannot be).
    pub observation_images: ObservationImages<'a>,
}

/// One episode as a turn sees it.
pub struct Row<'a> {
    pub prompt: &'a [i64],
    /// Sampled and observation tokens so far.
    pub tokens: &'a [i64],
    pub done: bool,
    /// Tokens the episode may still take.
    pub room: usize,
    /// The patches of the prompt's images, then of the observations'.
    pub images: &'a [Images],
    /// The columns of `tokens` holding the observations' image placeholders.
    pub slots: &'a [i64],
}

/// Per row, the turn's sampled ids (up to and including EOS or the token that completed a stop
/// string) and their log-probs.
pub type Sampled = Vec<(Vec<i64>, Vec<f32>)>;

/// The decode state of one batch of episodes across its turns.
pub struct LocalTurns {
    session: Option<Session>,
    /// Per row, how many of its trajectory tokens the session's cache holds.
    cached: Vec<usize>,
    reuse: bool,
}

impl LocalTurns {
    /// Turns of `model` under settings `s` (KV reuse when `environment.kv_reuse`, the prompts
    /// hold no images and the model has neither a sliding window nor linear attention, see
    /// `ArchConfig::continues_with_gaps`).
    pub fn new(model: Option<&CausalLm>, s: &EpisodeSettings<'_>, images: bool) -> LocalTurns {
        let reuse = s.env.kv_reuse && !images && model.is_some_and(|m| m.arch().continues_with_gaps());
        LocalTurns { session: None, cached: Vec::new(), reuse }
    }

    /// One policy turn for every row.
    pub fn sample(
        &mut self,
        model: &CausalLm,
        behavior: bool,
        rows: &[Row<'_>],
        s: &EpisodeSettings<'_>,
        turn: usize,
    ) -> Result<Sampled> {
        let contexts: Vec<Vec<i64>> = rows.iter().map(|r| [r.prompt, r.tokens].concat()).collect();
        let images = Images::concat(&rows.iter().flat_map(|r| r.images).collect::<Vec<_>>())?;
        let observed = rows.iter().any(|r| !r.slots.is_empty());
        if observed && self.reuse {
            // The session's cache cannot take images: every turn from this one prefills again.
            (self.reuse, self.session) = (false, None);
        }
        // Past the first turn, or with an observation's images, the context's image tokens are not
        // all placeholders: the slots say which are.
        let slotted = images.is_some() && (turn > 0 || observed);
        let g = s.rollout.samples_per_prompt.max(1);
        // A prompt's G rows share one prefill while their contexts are still equal (turn 0 with
        // equal first observations).
        let same_runs = contexts.len().is_multiple_of(g) && contexts.chunks(g).all(|c| c.iter().all(|x| *x == c[0]));
        let group = if same_runs && !slotted { g as i64 } else { 1 };
        let room = rows.iter().filter(|r| !r.done).map(|r| r.room).max().unwrap_or(1);
        let mut cfg = generate_config(s.rollout, s.eos_ids, s.pad, s.rows, group, behavior);
        cfg.max_new_tokens = cfg.max_new_tokens.min(room.max(1) as i64);
        if s.keyed {
            cfg.noise_key = Some(s.turn_seed ^ (turn as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        } else if turn > 0 {
            let seed = s.turn_seed ^ (turn as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            tch::manual_seed((seed & i64::MAX as u64) as i64);
        }
        let mut turn_ids: Vec<Vec<u32>> = vec![Vec::new(); rows.len()];
        let mut stopped: Vec<bool> = rows.iter().map(|r| r.done).collect();
        let mut check = |next: &[i64]| -> rlhf_generation::Result<Vec<bool>> {
            let mut flags = vec![false; next.len()];
            for (r, &tok) in next.iter().enumerate() {
                if stopped[r] {
                    flags[r] = true;
                    continue;
                }
                if s.eos_ids.contains(&tok) {
                    stopped[r] = true;
                    continue;
                }
                turn_ids[r].push(tok as u32);
                if !s.stops.is_empty() {
                    let text = s.tok.decode(&turn_ids[r], true).unwrap_or_default();
                    if s.stops.iter().any(|x| text.contains(x.as_str())) {
                        stopped[r] = true;
                        flags[r] = true;
                    }
                }
            }
            Ok(flags)
        };
        if !self.reuse {
            let padded = left_pad(&contexts, s.pad, model.device())?;
            let (ids, mask) = (&padded.input_ids, &padded.attention_mask);
            let slots = if slotted { Some(slot_mask(rows, ids.size()[1], model.device())?) } else { None };
            let images = images.as_ref().map(|i| (i, slots.as_ref()));
            let mut gen = generate_until_with_images(model, ids, mask, images, &cfg, Some(&mut check))
                .map_err(|e| diverged(model, e))?;
            return per_row(&gen.responses()?, &gen.response_mask, gen.logprobs.take());
        }
        let logits = self.feed(model, rows, &contexts, group, &cfg)?;
        let done: Vec<bool> = rows.iter().map(|r| r.done).collect();
        let session = self.session.as_mut().ok_or_else(|| crate::error::TrainerError::Run("no session".into()))?;
        let out = session.decode(model, logits, &done, &cfg, Some(&mut check)).map_err(|e| diverged(model, e))?;
        for (c, n) in self.cached.iter_mut().zip(&out.cached) {
            *c += n;
        }
        per_row(&out.tokens, &out.response_mask, out.logprobs)
    }

    /// Brings the session up to every row's trajectory and returns the logits to sample the
    /// turn's first token from: turn 0 prefills the contexts; later turns append what each
    /// running row gained since (a row whose last token is already cached and gained nothing
    /// feeds that token again, its old slot masked).
    fn feed(
        &mut self,
        model: &CausalLm,
        rows: &[Row<'_>],
        contexts: &[Vec<i64>],
        group: i64,
        cfg: &GenerateConfig,
    ) -> Result<Tensor> {
        let Some(session) = self.session.as_mut() else {
            let (session, logits) = Session::start(model, contexts, cfg.pad_token_id, group, cfg.max_new_tokens)?;
            self.session = Some(session);
            self.cached = rows.iter().map(|r| r.tokens.len()).collect();
            return Ok(logits);
        };
        let mut refeed = Vec::new();
        let chunks: Vec<Vec<i64>> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                if row.done {
                    return Vec::new();
                }
                let from = self.cached[r].min(row.tokens.len());
                if from == row.tokens.len() && from > 0 {
                    refeed.push(r);
                    return row.tokens[from - 1..].to_vec();
                }
                row.tokens[from..].to_vec()
            })
            .collect();
        let width = chunks.iter().map(Vec::len).max().unwrap_or(0) as i64;
        session.compact(width + cfg.max_new_tokens)?;
        session.unmask_last(&refeed)?;
        let logits = session.append(model, &chunks, cfg.pad_token_id)?;
        for (c, row) in self.cached.iter_mut().zip(rows).filter(|(_, row)| !row.done) {
            *c = row.tokens.len();
        }
        Ok(logits)
    }
}

/// Where each left-padded context's image placeholders may be: its prompt and its observations'
/// placeholder runs (an image token a turn sampled is text).
///
/// # Shapes
/// → `[rows, width]` int64
fn slot_mask(rows: &[Row<'_>], width: i64, device: tch::Device) -> Result<Tensor> {
    let w = width as usize;
    let mut mask = vec![0i64; rows.len() * w];
    for (r, row) in rows.iter().enumerate() {
        let start = r * w + w - (row.prompt.len() + row.tokens.len());
        mask[start..start + row.prompt.len()].fill(1);
        for &c in row.slots {
            mask[start + row.prompt.len() + c as usize] = 1;
        }
    }
    Ok(Tensor::f_from_slice(&mask)?.f_view([rows.len() as i64, width])?.f_to_device(device)?)
}

/// Per row, its sampled ids up to its mask's end and their log-probs (0 without them).
///
/// # Shapes
/// `tokens`, `mask`: `[b, steps]`; `logprobs`: `[b, steps]` f32.
fn per_row(tokens: &Tensor, mask: &Tensor, logprobs: Option<Tensor>) -> Result<Sampled> {
    let ids = to_rows(tokens)?;
    let mask = to_rows(mask)?;
    let lps: Option<Vec<Vec<f32>>> = logprobs
        .map(|l| -> Result<Vec<Vec<f32>>> {
            let l = l.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Float)?;
            (0..l.size()[0]).map(|i| Ok(Vec::<f32>::try_from(l.get(i))?)).collect()
        })
        .transpose()?;
    Ok((0..ids.len())
        .map(|r| {
            let n = mask[r].iter().take_while(|&&m| m == 1).count();
            let lp = lps.as_ref().map(|l| l[r][..n].to_vec()).unwrap_or_else(|| vec![0.0; n]);
            (ids[r][..n].to_vec(), lp)
        })
        .collect())
}
