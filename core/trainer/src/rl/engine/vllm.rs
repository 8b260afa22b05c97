//! The vLLM engine: a step's prompt groups are split over the servers (each prompt's
//! `samples_per_prompt` samples on one server, `n = G`), requested in parallel as token ids, and
//! the responses laid out as the local engine lays out its own: prompts left-padded as the
//! prompt batch has them, responses right-padded with the pad id, the engine's per-token
//! log-probs alongside.

use std::path::Path;
use std::time::Duration;

use rlhf_collective::World;
use rlhf_generation::{batch::to_rows, Generated};
use rlhf_models::CausalLm;
use rlhf_vision::ImageRef;
use tch::{Kind, Tensor};

use super::client::VllmClient;
pub use super::client::{Completion, Sampling};
use super::generate::collapse;
use super::sync::Weights;
use crate::config::{RolloutConfig, VllmConfig};
use crate::dist;
use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::rl::prompts::PromptBatch;
use crate::rl::rollout::{self, Rollout};

/// Clients of the configured servers and the weight versions they serve.
pub struct VllmEngine {
    pub(crate) clients: Vec<VllmClient>,
    pub(crate) cfg: VllmConfig,
    pub(crate) weights: Weights,
    /// The optimizer step whose policy every server confirmed.
    synced: Option<usize>,
}

fn err(e: super::client::VllmError) -> TrainerError {
    TrainerError::Run(format!("rollout.vllm: {e}"))
}

impl VllmEngine {
    pub fn new(cfg: &VllmConfig, run_dir: &Path) -> Result<Self> {
        let timeout = Duration::from_secs_f64(cfg.timeout_s);
        let clients =
            cfg.urls.iter().map(|u| VllmClient::new(u, timeout, cfg.retries).map_err(err)).collect::<Result<_>>()?;
        Ok(VllmEngine { clients, cfg: cfg.clone(), weights: Weights::new(run_dir, cfg), synced: None })
    }

    /// See [`super::Engine::ensure_synced`]: rank 0 writes version `version`, every server loads
    /// and confirms it (a probe token's log-prob within `sync_tolerance` of the trainer's), old
    /// versions are pruned; the ranks agree before any samples.
    pub fn ensure_synced(
        &mut self,
        actor: &CausalLm,
        version: usize,
        probe: &[u32],
        world: &World,
        m: &mut StepMetrics,
    ) -> Result<()> {
        if self.synced == Some(version) {
            // Already served (e.g. synced by the held-out evaluation after the previous step).
            m.set("rollout/weights_version", version as f64);
            return Ok(());
        }
        let t = std::time::Instant::now();
        let result = if world.is_main() { self.weights.push(actor, version, probe, &self.clients) } else { Ok(()) };
        dist::agree(world, "syncing the rollout servers", result)?;
        self.synced = Some(version);
        m.set("rollout/sync_s", t.elapsed().as_secs_f64());
        m.set("rollout/weights_version", version as f64);
        Ok(())
    }

    /// Samples `G` responses of every prompt of `batch` on the servers.
    ///
    /// # Shapes
    /// `batch.padded`: `[N, P]` with `N = prompts · G`; returns `generated.sequences [N, P + R]`,
    /// `behavior_logprobs [N, R]` with `R <=` `max_new_tokens`.
    pub fn sample(&mut self, batch: &PromptBatch, cfg: &RolloutConfig, eos_ids: &[i64], pad: i64) -> Result<Rollout> {
        let g = cfg.samples_per_prompt;
        let ids = to_rows(&batch.padded.input_ids)?;
        let masks = to_rows(&batch.padded.attention_mask)?;
        // One prompt per group: the unpadded ids of its first row.
        let prompts: Vec<Vec<u32>> = (0..ids.len() / g)
            .map(|p| ids[p * g].iter().zip(&masks[p * g]).filter(|(_, &k)| k == 1).map(|(&t, _)| t as u32).collect())
            .collect();
        let sampling = rollout_sampling(cfg, eos_ids, cfg.max_new_tokens, Vec::new());
        let completions = match &batch.image_files {
            Some(files) if files.rows.iter().any(|r| !r.is_empty()) => {
                let images: Vec<&[ImageRef]> = (0..prompts.len()).map(|p| files.rows[p * g].as_slice()).collect();
                self.generate(&prompts, &images, files.placeholder, g, &sampling)?
            }
            _ => self.complete(&prompts, g, &sampling)?,
        };
        layout(batch, completions, pad, eos_ids)
    }

    /// `n` completions of every prompt with its images (`images[p]`, in placeholder order), one
    /// generate request per prompt ([`super::generate`]): each image's run of `placeholder`
    /// tokens goes out as one token, and the server's expansion of the prompt must equal
    /// `prompts[p]`. The prompts are split over the servers, [`IN_FLIGHT`] requests at a time on
    /// each; returned prompt by prompt, `n` each.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        images: &[&[ImageRef]],
        placeholder: u32,
        n: usize,
        sampling: &Sampling,
    ) -> Result<Vec<Completion>> {
        let model = self.cfg.model.as_str();
        let one = |client: &VllmClient, p: usize| -> std::result::Result<Vec<Completion>, String> {
            let (collapsed, runs) = collapse(&prompts[p], placeholder);
            // More runs than images: placeholder tokens the policy sampled after the images (an
            // episode's context), which the server also reads as text; the expansion check says.
            if runs < images[p].len() {
                return Err(format!("prompt {p}: {runs} image placeholder run(s) for {} image(s)", images[p].len()));
            }
            let (completions, expanded) =
                client.generate(model, &collapsed, images[p], n, sampling).map_err(|e| e.to_string())?;
            if expanded != prompts[p] {
                let names: Vec<String> = images[p].iter().map(ImageRef::name).collect();
                return Err(format!(
                    "{}: prompt {p} (images {}): the server's prompt has {} ids where the trainer's has {}{}: \
                     serve the policy's own preprocessor_config.json (min_pixels, max_pixels, patch and merge \
                     sizes), so both patch the images alike",
                    client.url(),
                    names.join(", "),
                    expanded.len(),
                    prompts[p].len(),
                    first_difference(&expanded, &prompts[p]),
                ));
            }
            Ok(completions)
        };
        self.per_server(prompts.len(), |client, range| {
            let all: Vec<usize> = range.collect();
            let mut out = Vec::with_capacity(all.len() * n);
            for wave in all.chunks(IN_FLIGHT) {
                let answers: Vec<_> = std::thread::scope(|w| {
                    let hs: Vec<_> = wave.iter().map(|&p| w.spawn(move || one(client, p))).collect();
                    hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("request thread panicked".into()))).collect()
                });
                for a in answers {
                    out.extend(a?);
                }
            }
            Ok(out)
        })
    }

    /// `n` completions of every prompt, the prompts split over the servers and requested in
    /// parallel; returned prompt by prompt, `n` each.
    pub fn complete(&self, prompts: &[Vec<u32>], n: usize, sampling: &Sampling) -> Result<Vec<Completion>> {
        let model = self.cfg.model.as_str();
        self.per_server(prompts.len(), |client, range| {
            let prompts = &prompts[range];
            if prompts.is_empty() {
                return Ok(Vec::new());
            }
            let per_prompt = client.complete(model, prompts, n, sampling).map_err(|e| e.to_string())?;
            Ok(per_prompt.into_iter().flatten().collect())
        })
    }

    /// `prompts` prompts split over the servers in order ([`dist::shard`]), `f` run for each
    /// server's share at once; the servers' answers joined in prompt order, the first error
    /// (naming its server) returned.
    fn per_server<T: Send>(
        &self,
        prompts: usize,
        f: impl Fn(&VllmClient, std::ops::Range<usize>) -> std::result::Result<Vec<T>, String> + Sync,
    ) -> Result<Vec<T>> {
        let n_servers = self.clients.len();
        let results: Vec<std::result::Result<Vec<T>, String>> = std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = (0..n_servers)
                .map(|k| {
                    let (client, range) = (&self.clients[k], dist::shard(prompts, k, n_servers));
                    s.spawn(move || f(client, range))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("request thread panicked".into()))).collect()
        });
        let mut out = Vec::new();
        for r in results {
            out.extend(r.map_err(|m| TrainerError::Run(format!("rollout.vllm: {m}")))?);
        }
        Ok(out)
    }
}

/// Generate requests each server has in flight at once (each prompt with images is a request of
/// its own; the server batches them).
const IN_FLIGHT: usize = 32;

/// Where two id lists first differ, for an error: `" (first at position i: a, not b)"`.
fn first_difference(server: &[u32], ours: &[u32]) -> String {
    match server.iter().zip(ours).position(|(a, b)| a != b) {
        Some(i) => format!(" (first at position {i}: {}, not {})", server[i], ours[i]),
        None => String::new(),
    }
}

/// The sampling of rollouts with `[rollout]`'s settings: at most `max_tokens`, ended by EOS or one of
/// `stop`. No seed: vLLM seeds sample k of every prompt of a request with `seed + k`, which would
/// correlate the samples of different prompts.
pub fn rollout_sampling(cfg: &RolloutConfig, eos_ids: &[i64], max_tokens: i64, stop: Vec<String>) -> Sampling {
    Sampling {
        max_tokens,
        temperature: cfg.temperature,
        top_p: cfg.top_p,
        top_k: cfg.top_k,
        stop_token_ids: eos_ids.iter().map(|&e| e as u32).collect(),
        stop,
        seed: None,
    }
}

/// The completions (one per row of `batch`, in order) as a [`Rollout`] with behaviour log-probs.
fn layout(batch: &PromptBatch, completions: Vec<Completion>, pad: i64, eos_ids: &[i64]) -> Result<Rollout> {
    let device = batch.padded.input_ids.device();
    let n = batch.padded.input_ids.size()[0] as usize;
    if completions.len() != n {
        return Err(TrainerError::Run(format!("rollout.vllm: {} completions for {n} rows", completions.len())));
    }
    // At least one response slot, so every tensor keeps the [N, R] shape.
    let r = completions.iter().map(|c| c.token_ids.len()).max().unwrap_or(0).max(1);
    let (mut ids, mut mask, mut lp) = (vec![pad; n * r], vec![0i64; n * r], vec![0f32; n * r]);
    for (i, c) in completions.iter().enumerate() {
        for (t, (&id, &x)) in c.token_ids.iter().zip(&c.logprobs).enumerate() {
            (ids[i * r + t], mask[i * r + t], lp[i * r + t]) = (i64::from(id), 1, x as f32);
        }
    }
    let r = r as i64;
    let on_device = |t: Tensor| -> Result<Tensor> { Ok(t.f_view([n as i64, r])?.f_to_device(device)?) };
    let response_ids = on_device(Tensor::f_from_slice(&ids)?)?;
    let response_mask = on_device(Tensor::f_from_slice(&mask)?)?;
    let behavior = on_device(Tensor::f_from_slice(&lp)?)?;
    let generated = Generated {
        sequences: Tensor::f_cat(&[&batch.padded.input_ids, &response_ids], 1)?,
        attention_mask: Tensor::f_cat(&[&batch.padded.attention_mask.f_to_kind(Kind::Int64)?, &response_mask], 1)?,
        response_mask,
        prompt_len: batch.padded.input_ids.size()[1],
        logprobs: None, // the engine's, passed as the behaviour log-probs below
    };
    rollout::finish(generated, Some(behavior), eos_ids)
}
