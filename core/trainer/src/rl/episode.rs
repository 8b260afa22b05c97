//! Stage 2 with an environment (`[environment]`): multi-turn **episodes**, on the local engine or
//! on vLLM servers ([`Decoder`]).
//!
//! Each prompt row is an episode. The environment's `reset` may add a first observation; then
//! every turn the policy samples until EOS, a stop string or `rollout.max_new_tokens`, the
//! environment's `step` answers, and its observation is tokenized and appended — until the
//! environment says done, the policy samples EOS, or `environment.max_turns` /
//! `environment.max_total_tokens` is reached (the last turn is sent with `ended = true`, so the
//! environment gives its final reward).
//!
//! **Token in, token out**: the trajectory is exactly the sampled tokens and the observation
//! tokens, in order; sampled text is decoded for the environment but never re-tokenized. The
//! response block of the returned batch holds the whole trajectory (attention 1), and its
//! `response_mask` — the action mask every later stage uses — is 1 on sampled tokens only, so
//! observation tokens are context: no loss, KL, entropy, clipping statistic or value target. An
//! observation may carry images ([`super::observed`]): its markers become placeholder runs the
//! policy reads the images at, on the local engine.
//!
//! On the local engine every turn decodes all rows of the batch (finished ones stop at once) from
//! the seed of (step, turn), so the sampling of a row does not depend on how many decode steps the
//! other rows of its rank needed: data-parallel ranks sample what one process samples. A turn
//! continues from the keys and values the batch cached so far ([`super::local_turns`]); on vLLM
//! its prefix cache serves the repeated context.

use std::collections::BTreeMap;

use rlhf_generation::{batch::to_rows, Generated};
use rlhf_models::{CausalLm, Images};
use rlhf_plugin_api::{Action, Episode, ObservationImage, StepOutcome};
use rlhf_vision::ImageRef;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Result, TrainerError};
use crate::plugins::EnvHandle;
use crate::rl::engine::vllm::{rollout_sampling, VllmEngine};
pub use crate::rl::local_turns::EpisodeSettings;
use crate::rl::local_turns::{LocalTurns, Row, Sampled};
use crate::rl::observed::{self, Encoded, Observed};
use crate::rl::prompts::{ImageFiles, PromptBatch};
use crate::rl::rollout::Rollout;

/// What an episode did, for the `env/*` metrics.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EpisodeStats {
    /// Policy turns taken.
    pub turns: usize,
    /// An environment call failed for this episode (it ended with the penalty).
    pub error: bool,
    /// Cut by `max_turns` or `max_total_tokens` before the environment or the policy ended it.
    pub truncated: bool,
    /// The environment's per-episode numbers, summed over turns.
    pub metrics: BTreeMap<String, f64>,
}

/// The episodes of one batch.
pub struct Episodes {
    /// The trajectories as a rollout: responses are whole trajectories, the action mask marks
    /// the sampled tokens.
    pub rollout: Rollout,
    /// Per row: the environment's reward (sum over turns; `error_penalty` when it failed).
    pub rewards: Vec<f64>,
    pub stats: Vec<EpisodeStats>,
    /// The first environment failure of the batch, for the log and the run's error.
    pub first_error: Option<String>,
    /// Per row: the images its observations added (mostly none).
    pub observed: Vec<Observed>,
}

/// Who samples the policy's turns.
pub enum Decoder<'a> {
    /// The trainer's own decode of `model` (the actor, or its bf16 copy whose log-probs of the
    /// sampled tokens are then behaviour log-probs: `behavior`).
    Local { model: &'a CausalLm, behavior: bool },
    /// vLLM servers, synced to the policy: each turn's contexts go out as token ids, with the stop
    /// strings; the engine's log-probs are the behaviour log-probs.
    Vllm(&'a VllmEngine),
}

impl Decoder<'_> {
    fn behavior(&self) -> bool {
        matches!(self, Decoder::Vllm(_) | Decoder::Local { behavior: true, .. })
    }
}

/// One trajectory being built.
#[derive(Default)]
struct Trajectory {
    /// The prompt ids, unpadded.
    prompt: Vec<i64>,
    /// Sampled and observation tokens, in order.
    tokens: Vec<i64>,
    /// Per token of `tokens`: sampled (true) or observed.
    sampled: Vec<bool>,
    /// Per token of `tokens`: the behaviour log-prob (0 on observations).
    logprobs: Vec<f32>,
    /// The patches of the prompt's images, then of each observation's.
    patches: Vec<Images>,
    /// The observations' images and the columns of `tokens` that are their placeholders.
    observed: Observed,
    done: bool,
    reward: f64,
    stats: EpisodeStats,
}

impl Trajectory {
    fn room(&self, max_total: i64) -> usize {
        (max_total as usize).saturating_sub(self.tokens.len())
    }

    /// Appends an observation's ids, as many as fit (all or none of one with images, whose
    /// placeholder runs cannot be cut); returns whether all fitted.
    fn observe(&mut self, o: Encoded, max_total: i64) -> bool {
        let ids = &o.ids;
        let mut n = ids.len().min(self.room(max_total));
        if let Some(patches) = o.patches.filter(|_| n == ids.len()) {
            let at = self.tokens.len() as i64;
            self.observed.slots.extend(o.placeholders.iter().map(|&p| at + p as i64));
            self.observed.images.extend(o.images);
            self.patches.push(patches);
        } else if !o.images.is_empty() {
            n = 0;
        }
        self.tokens.extend_from_slice(&ids[..n]);
        self.sampled.extend(std::iter::repeat_n(false, n));
        self.logprobs.extend(std::iter::repeat_n(0.0, n));
        n == ids.len() && self.room(max_total) > 0
    }

    /// Encodes an observation (`at` names it in errors) and appends it: the episode ends
    /// truncated when it does not fit, failed (its error kept in `first_error`) when it cannot be
    /// encoded.
    fn take_observation(
        &mut self,
        text: &str,
        images: Vec<ObservationImage>,
        s: &EpisodeSettings<'_>,
        at: &str,
        first_error: &mut Option<String>,
    ) -> Result<()> {
        match observed::encode(s.tok, text, images, s.observation_images, at)? {
            Ok(enc) => {
                if !self.observe(enc, s.env.max_total_tokens) {
                    self.done = true;
                    self.stats.truncated = true;
                }
            }
            Err(e) => {
                first_error.get_or_insert(e);
                self.fail(s.env.error_penalty);
            }
        }
        Ok(())
    }

    /// Whether the policy sampled `placeholder` (an image token, text where the policy sampled
    /// it) before an observation's image: vLLM, which expands a context's placeholder tokens in
    /// order, would take it for that image.
    fn sampled_placeholder_before_image(&self, placeholder: u32) -> bool {
        let Some(&last) = self.observed.slots.last() else { return false };
        let mut before = self.tokens.iter().zip(&self.sampled).take(last as usize);
        before.any(|(&t, &s)| s && t == i64::from(placeholder))
    }

    fn fail(&mut self, penalty: f64) {
        self.done = true;
        self.reward = penalty;
        self.stats.error = true;
    }
}

/// The episodes of `batch`'s rows, ids from `offset` (the rows' place in the whole batch).
pub fn episodes_of(batch: &PromptBatch, offset: usize, data: &crate::data::PromptDataset) -> Vec<Episode> {
    batch
        .group_of_row
        .iter()
        .enumerate()
        .map(|(r, &(idx, _))| {
            let rec = &data.records[idx];
            Episode {
                id: (offset + r) as u64,
                prompt: rec.text.clone(),
                prompt_ids: rec.ids.clone(),
                label: rec.label.clone(),
                metadata: rec.metadata.clone(),
                messages: rec
                    .messages
                    .iter()
                    .map(|m| rlhf_plugin_api::ChatMessage { role: m.role.clone(), content: m.content.clone() })
                    .collect(),
            }
        })
        .collect()
}

/// Runs one batch of episodes: `episodes[r]` describes row `r` of `batch`.
///
/// # Shapes
/// `batch.padded`: `[N, P]`; the result's `generated.sequences`: `[N, P + R]` with `R <=
/// environment.max_total_tokens`, `response_mask` (sampled tokens) `[N, R]`.
pub fn run(
    decoder: &Decoder<'_>,
    env: &mut EnvHandle,
    batch: &PromptBatch,
    episodes: &[Episode],
    s: &EpisodeSettings<'_>,
) -> Result<Episodes> {
    let ids = to_rows(&batch.padded.input_ids)?;
    let mask = to_rows(&batch.padded.attention_mask)?;
    let mut trajs: Vec<Trajectory> = ids
        .iter()
        .zip(&mask)
        .map(|(i, m)| Trajectory {
            prompt: i.iter().zip(m).filter(|(_, &k)| k == 1).map(|(&t, _)| t).collect(),
            ..Default::default()
        })
        .collect();
    if let (Decoder::Local { model, .. }, Some(images)) = (decoder, &batch.images) {
        for (t, rows) in trajs.iter_mut().zip(model.images_per_row(&batch.padded.input_ids, images)?) {
            let which: Vec<usize> = rows.collect();
            if !which.is_empty() {
                t.patches.push(images.select(&which)?);
            }
        }
    }
    let max_total = s.env.max_total_tokens;
    let mut first_error = reset(env, episodes, &mut trajs, s)?;
    let mut local = LocalTurns::new(
        match decoder {
            Decoder::Local { model, .. } => Some(model),
            Decoder::Vllm(_) => None,
        },
        s,
        batch.images.is_some(),
    );
    for turn in 0..s.env.max_turns {
        if trajs.iter().all(|t| t.done) {
            break;
        }
        if let (Decoder::Vllm(_), Some(f)) = (decoder, &batch.image_files) {
            for t in trajs.iter_mut().filter(|t| !t.done && t.sampled_placeholder_before_image(f.placeholder)) {
                first_error.get_or_insert_with(|| {
                    format!(
                        "the policy sampled the image token {} before an observation's image, which vLLM would take \
                         for that image: the episode ends as failed",
                        f.placeholder
                    )
                });
                t.fail(s.env.error_penalty);
            }
        }
        let sampled = match decoder {
            Decoder::Local { model, behavior } => {
                let rows: Vec<Row<'_>> = trajs
                    .iter()
                    .map(|t| Row {
                        prompt: &t.prompt,
                        tokens: &t.tokens,
                        done: t.done,
                        room: t.room(max_total),
                        images: &t.patches,
                        slots: &t.observed.slots,
                    })
                    .collect();
                local.sample(model, *behavior, &rows, s, turn)?
            }
            Decoder::Vllm(engine) => vllm_turn(engine, &trajs, batch.image_files.as_ref(), s)?,
        };
        let (actions, rows) = take_turn(&mut trajs, sampled, episodes, s, turn)?;
        match env.step(&actions) {
            Ok(outs) => {
                for ((&r, a), o) in rows.iter().zip(&actions).zip(outs) {
                    answer(&mut trajs[r], a, o, s, &mut first_error)?;
                }
            }
            Err(e) => {
                first_error.get_or_insert_with(|| e.to_string());
                rows.iter().for_each(|&r| trajs[r].fail(s.env.error_penalty));
            }
        }
    }
    let rewards = trajs.iter().map(|t| t.reward).collect();
    let stats = trajs.iter().map(|t| t.stats.clone()).collect();
    let rollout = into_rollout(&trajs, batch, s, decoder.behavior())?;
    let observed = trajs.iter_mut().map(|t| std::mem::take(&mut t.observed)).collect();
    Ok(Episodes { rollout, rewards, stats, first_error, observed })
}

/// Each episode's first observation from the environment's `reset`, appended to its trajectory;
/// an episode whose observation does not fit ends truncated, one that cannot be encoded (or every
/// episode, when `reset` fails) ends failed. Returns the first error, for the log.
fn reset(
    env: &mut EnvHandle,
    episodes: &[Episode],
    trajs: &mut [Trajectory],
    s: &EpisodeSettings<'_>,
) -> Result<Option<String>> {
    let mut first_error = None;
    match env.reset(episodes) {
        Ok(obs) => {
            for ((t, o), e) in trajs.iter_mut().zip(obs).zip(episodes) {
                let at = format!("episode {} first observation", e.id);
                t.take_observation(&o.text, o.images, s, &at, &mut first_error)?;
            }
        }
        Err(e) => {
            first_error = Some(e.to_string());
            trajs.iter_mut().for_each(|t| t.fail(s.env.error_penalty));
        }
    }
    Ok(first_error)
}

/// Appends a turn's sampled tokens (and their log-probs) to the running trajectories, cut to the
/// room each has left, and makes the environment's actions of them: the decoded text without EOS,
/// `ended` when the policy sampled EOS, on the last turn, or when the trajectory is full. Returns
/// the actions and the rows they belong to.
fn take_turn(
    trajs: &mut [Trajectory],
    sampled: Sampled,
    episodes: &[Episode],
    s: &EpisodeSettings<'_>,
    turn: usize,
) -> Result<(Vec<Action>, Vec<usize>)> {
    let max_total = s.env.max_total_tokens;
    let last_turn = turn + 1 == s.env.max_turns;
    let (mut actions, mut rows) = (Vec::new(), Vec::new());
    for (r, (t, (toks, lps))) in trajs.iter_mut().zip(sampled).enumerate() {
        if t.done {
            continue;
        }
        let n = toks.len().min(t.room(max_total));
        let eos = toks[..n].last().is_some_and(|x| s.eos_ids.contains(x));
        t.tokens.extend_from_slice(&toks[..n]);
        t.sampled.extend(std::iter::repeat_n(true, n));
        t.logprobs.extend_from_slice(&lps[..n]);
        t.stats.turns += 1;
        let out_of_room = t.room(max_total) == 0;
        let ended = eos || last_turn || out_of_room;
        t.stats.truncated = ended && !eos;
        let ids: Vec<u32> = toks[..n].iter().map(|&x| x as u32).collect();
        let content: Vec<u32> = ids.iter().copied().filter(|x| !s.eos_ids.contains(&i64::from(*x))).collect();
        let text = s.tok.decode(&content, true)?;
        actions.push(Action { id: episodes[r].id, turn: turn as u32, text, token_ids: ids, ended });
        rows.push(r);
    }
    Ok((actions, rows))
}

/// Applies the environment's answer to one action.
fn answer(
    t: &mut Trajectory,
    a: &Action,
    o: StepOutcome,
    s: &EpisodeSettings<'_>,
    first_error: &mut Option<String>,
) -> Result<()> {
    if let Some(e) = o.error {
        first_error.get_or_insert_with(|| format!("episode {}: {e}", a.id));
        t.fail(s.env.error_penalty);
        return Ok(());
    }
    t.reward += o.reward;
    if !t.reward.is_finite() {
        // Finite turn rewards can overflow when summed: the environment's failure, not a reward.
        first_error.get_or_insert_with(|| format!("episode {}: its reward summed over turns is {}", a.id, t.reward));
        t.fail(s.env.error_penalty);
        return Ok(());
    }
    for (k, v) in o.metrics {
        *t.stats.metrics.entry(k).or_insert(0.0) += v;
    }
    if o.done || a.ended {
        t.done = true;
        t.stats.truncated &= !o.done;
        return Ok(());
    }
    let at = format!("episode {} turn {}", a.id, a.turn);
    t.take_observation(&o.observation, o.images, s, &at, first_error)
}

/// One policy turn of every episode still running, on vLLM: its context (prompt and trajectory
/// so far) as token ids, one completion each, ended by EOS, a stop string (kept) or the turn's
/// token limit; the engine's log-probs of the returned ids. Finished episodes get nothing. A
/// context with images (`files`: the prompts', then the observations') goes with them.
fn vllm_turn(
    engine: &VllmEngine,
    trajs: &[Trajectory],
    files: Option<&ImageFiles>,
    s: &EpisodeSettings<'_>,
) -> Result<Vec<(Vec<i64>, Vec<f32>)>> {
    let active: Vec<usize> = (0..trajs.len()).filter(|&r| !trajs[r].done).collect();
    let contexts: Vec<Vec<u32>> =
        active.iter().map(|&r| trajs[r].prompt.iter().chain(&trajs[r].tokens).map(|&t| t as u32).collect()).collect();
    let room = active.iter().map(|&r| trajs[r].room(s.env.max_total_tokens)).max().unwrap_or(1);
    let max_tokens = s.rollout.max_new_tokens.min(room.max(1) as i64);
    let sampling = rollout_sampling(s.rollout, s.eos_ids, max_tokens, s.stops.to_vec());
    let images: Vec<Vec<ImageRef>> = active
        .iter()
        .map(|&r| {
            let prompt = files.and_then(|f| f.rows.get(r)).map(Vec::as_slice).unwrap_or_default();
            prompt.iter().cloned().chain(trajs[r].observed.images.iter().map(|i| i.to_ref())).collect()
        })
        .collect();
    let completions = match files {
        Some(f) if images.iter().any(|i| !i.is_empty()) => {
            let images: Vec<&[ImageRef]> = images.iter().map(Vec::as_slice).collect();
            engine.generate(&contexts, &images, f.placeholder, 1, &sampling)?
        }
        _ => engine.complete(&contexts, 1, &sampling)?,
    };
    if completions.len() != active.len() {
        return Err(TrainerError::Run(format!(
            "rollout.vllm: {} completions for {} episodes",
            completions.len(),
            active.len()
        )));
    }
    let mut out = vec![(Vec::new(), Vec::new()); trajs.len()];
    for (&r, c) in active.iter().zip(completions) {
        out[r] = (c.token_ids.iter().map(|&t| i64::from(t)).collect(), c.logprobs.iter().map(|&x| x as f32).collect());
    }
    Ok(out)
}

/// The trajectories as one rollout batch: the prompt block as sampled, then each trajectory
/// right-padded; the action mask is 1 on sampled tokens.
///
/// # Shapes
/// `[N, P]` prompts → `sequences`, `attention_mask` `[N, P + R]`, `response_mask` `[N, R]`.
fn into_rollout(trajs: &[Trajectory], batch: &PromptBatch, s: &EpisodeSettings<'_>, behavior: bool) -> Result<Rollout> {
    let n = trajs.len();
    let width = trajs.iter().map(|t| t.tokens.len()).max().unwrap_or(0).max(1);
    let (mut ids, mut attn, mut act, mut lps) =
        (vec![s.pad; n * width], vec![0i64; n * width], vec![0i64; n * width], vec![0f32; n * width]);
    let mut kept_rows = Vec::new();
    let mut responses = Vec::new();
    for (r, t) in trajs.iter().enumerate() {
        for (j, &tok) in t.tokens.iter().enumerate() {
            ids[r * width + j] = tok;
            attn[r * width + j] = 1;
            act[r * width + j] = i64::from(t.sampled[j]);
            lps[r * width + j] = t.logprobs[j];
        }
        if t.sampled.iter().any(|&x| x) {
            let all: Vec<u32> = t.tokens.iter().map(|&x| x as u32).collect();
            let content = all.iter().copied().filter(|x| !s.eos_ids.contains(&i64::from(*x))).collect();
            kept_rows.push(r);
            responses.push((content, all));
        }
    }
    let device = batch.padded.input_ids.device();
    let shape = [n as i64, width as i64];
    let t = |v: &[i64]| -> Result<Tensor> { Ok(Tensor::f_from_slice(v)?.f_view(shape)?.f_to_device(device)?) };
    let (resp, resp_attn, response_mask) = (t(&ids)?, t(&attn)?, t(&act)?);
    let generated = Generated {
        sequences: Tensor::f_cat(&[&batch.padded.input_ids, &resp], 1)?,
        attention_mask: Tensor::f_cat(&[&batch.padded.attention_mask, &resp_attn], 1)?,
        response_mask,
        prompt_len: batch.padded.input_ids.size()[1],
        logprobs: None,
    };
    let behavior_logprobs =
        if behavior { Some(Tensor::f_from_slice(&lps)?.f_view(shape)?.f_to_device(device)?) } else { None };
    Ok(Rollout { generated, kept_rows, responses, behavior_logprobs })
}

/// The host's own `env/*` metric names (an environment's metric of one of these names goes under
/// `env/<plugin>/` so it cannot replace them).
const HOST_ENV_METRICS: &[&str] = &["turns", "errors", "truncated", "reward"];

/// `env/*` metrics of a whole batch's episodes (all ranks'): `env/turns/mean`, `env/errors`,
/// `env/truncated` (counts), `env/reward/mean`, and `env/<name>/mean` per environment metric
/// (`env/<plugin>/<name>/mean` for a name of the host's own).
///
/// `seen` collects the environment's metric names over the run (at most
/// [`crate::plugins::metric_names::MAX_PLUGIN_METRICS`]): one an earlier batch reported and this
/// one did not is 0, so every step's row has every key.
pub fn metrics(
    stats: &[EpisodeStats],
    rewards: &[f64],
    plugin: &str,
    seen: &mut crate::plugins::metric_names::MetricNames,
    m: &mut crate::metrics::StepMetrics,
) {
    let n = stats.len().max(1) as f64;
    m.set("env/turns/mean", stats.iter().map(|s| s.turns as f64).sum::<f64>() / n);
    m.set("env/errors", stats.iter().filter(|s| s.error).count() as f64);
    m.set("env/truncated", stats.iter().filter(|s| s.truncated).count() as f64);
    m.set("env/reward/mean", rewards.iter().sum::<f64>() / n);
    for name in stats.iter().flat_map(|s| s.metrics.keys()) {
        seen.admit(plugin, name);
    }
    for name in seen.names() {
        let sum: f64 = stats.iter().map(|s| s.metrics.get(name).copied().unwrap_or(0.0)).sum();
        let host = HOST_ENV_METRICS.iter().any(|h| name == h || name.starts_with(&format!("{h}/")));
        let key = if host { format!("env/{plugin}/{name}/mean") } else { format!("env/{name}/mean") };
        m.set(&key, sum / n);
    }
}

/// Counts consecutive batches in which every episode failed; `Err` once there are
/// `environment.max_failed_batches` of them.
#[derive(Debug, Default)]
pub struct FailureCount(usize);

impl FailureCount {
    /// Notes a batch (all ranks' stats); `name` is the plugin's, for the error.
    pub fn note(&mut self, stats: &[EpisodeStats], first_error: Option<&str>, name: &str, max: usize) -> Result<()> {
        let all_failed = !stats.is_empty() && stats.iter().all(|s| s.error);
        self.0 = if all_failed { self.0 + 1 } else { 0 };
        if self.0 >= max {
            return Err(TrainerError::Run(format!(
                "environment `{name}` failed every episode of {max} consecutive batches (last error: {})",
                first_error.unwrap_or("unknown")
            )));
        }
        Ok(())
    }
}

/// The configured environment of a run.
pub struct EnvRuntime {
    /// Shared with an asynchronous generation worker, which runs the episodes then.
    pub handle: std::sync::Arc<std::sync::Mutex<EnvHandle>>,
    /// The environment plugin's name.
    pub name: String,
    /// `environment.stop` and the plugin's own stop strings.
    pub stops: Vec<String>,
    pub failures: FailureCount,
    /// The environment's metric names reported so far (see [`metrics`]).
    pub seen_metrics: crate::plugins::metric_names::MetricNames,
}

impl EnvRuntime {
    /// The environment of `[environment]`, if one is configured.
    pub(crate) fn load(
        cfg: &crate::config::RlConfig,
        registry: &crate::plugins::PluginRegistry,
    ) -> Result<Option<EnvRuntime>> {
        let e = &cfg.environment;
        if !e.enabled() {
            return Ok(None);
        }
        let plugin = registry.environment(&e.plugin).map_err(|err| {
            TrainerError::Config(format!("{}: environment.plugin: {err}", cfg.source_of("environment.plugin")))
        })?;
        let ctx = crate::plugins::host_context(&cfg.run.device, cfg.run.seed, cfg.rollout.samples_per_prompt as u32);
        let handle = EnvHandle::new(plugin, &e.config.to_string(), ctx, "environment.config")
            .map_err(|err| crate::rl::score::config_error(cfg, err))?;
        let mut stops = e.stop.clone();
        for s in handle.stop_strings() {
            if !s.is_empty() && !stops.contains(&s) {
                stops.push(s);
            }
        }
        tracing::info!("environment `{}` ({}), stop strings {stops:?}", handle.name, handle.path.display());
        Ok(Some(EnvRuntime {
            name: handle.name.clone(),
            handle: std::sync::Arc::new(std::sync::Mutex::new(handle)),
            stops,
            failures: FailureCount::default(),
            seen_metrics: Default::default(),
        }))
    }
}

/// Every rank's episode stats and environment rewards, in rank order (one all-gather).
pub fn gather(
    world: &rlhf_collective::World,
    stats: Vec<EpisodeStats>,
    rewards: Vec<f64>,
) -> Result<(Vec<EpisodeStats>, Vec<f64>)> {
    if !world.is_distributed() {
        return Ok((stats, rewards));
    }
    let err = |e: String| TrainerError::Distributed(format!("episode stats: {e}"));
    // Rewards travel as bits, so every value survives exactly.
    let bits: Vec<u64> = rewards.iter().map(|r| r.to_bits()).collect();
    let bytes = serde_json::to_vec(&(stats, bits)).map_err(|e| err(e.to_string()))?;
    let (mut all_stats, mut all_rewards) = (Vec::new(), Vec::new());
    for part in world.all_gather_bytes(&bytes).map_err(|e| err(e.to_string()))? {
        let (s, b): (Vec<EpisodeStats>, Vec<u64>) = serde_json::from_slice(&part).map_err(|e| err(e.to_string()))?;
        all_stats.extend(s);
        all_rewards.extend(b.into_iter().map(f64::from_bits));
    }
    Ok((all_stats, all_rewards))
}
