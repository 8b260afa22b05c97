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
use tch::{Kind, Tensor};

use super::client::VllmClient;
pub use super::client::{Completion, Sampling};
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
        let completions = self.complete(&prompts, g, &sampling)?;
        layout(batch, completions, pad, eos_ids)
    }

    /// `n` completions of every prompt, the prompts split over the servers and requested in
    /// parallel; returned prompt by prompt, `n` each.
    pub fn complete(&self, prompts: &[Vec<u32>], n: usize, sampling: &Sampling) -> Result<Vec<Completion>> {
        let n_servers = self.clients.len();
        let model = self.cfg.model.clone();
        let results: Vec<std::result::Result<Vec<Vec<Completion>>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n_servers)
                .map(|k| {
                    let range = dist::shard(prompts.len(), k, n_servers);
                    let (client, prompts, model, sampling) = (&self.clients[k], &prompts[range], &model, &sampling);
                    s.spawn(move || {
                        if prompts.is_empty() {
                            return Ok(Vec::new());
                        }
                        client.complete(model, prompts, n, sampling).map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("request thread panicked".into()))).collect()
        });
        let mut completions: Vec<Completion> = Vec::with_capacity(prompts.len() * n);
        for r in results {
            let per_prompt = r.map_err(|m| TrainerError::Run(format!("rollout.vllm: {m}")))?;
            completions.extend(per_prompt.into_iter().flatten());
        }
        Ok(completions)
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
