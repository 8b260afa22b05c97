//! Weight sync to the vLLM servers. After each optimizer step the policy is written to a
//! versioned directory of the run, `<run_dir>/rollout-weights/v<step>` (the whole model in
//! Hugging Face layout, or only the LoRA adapter in PEFT's), every server is told to load it and
//! to drop its prefix cache, and each server must then **confirm** it: the log-prob it gives a
//! probe token has to match the trainer's own within `rollout.vllm.sync_tolerance`. A server that
//! fails any of this stops the step with an error naming it — never a silent stale policy. The
//! newest `keep_versions` directories are kept.
//!
//! A policy whose head is tied to its embeddings is written with its head untied, and the first
//! sync checks that the servers' heads are untied too ([`super::tied_head`]).
//!
//! The servers read the directory by path, so they must see the run directory (the same machine
//! or a shared filesystem).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rlhf_generation::{token_logprobs, LogProbOptions};
use rlhf_models::CausalLm;
use tch::{Kind, Tensor};

use super::client::{Sampling, VllmClient};
use super::tied_head;
use crate::config::{VllmConfig, WeightSync};
use crate::error::{Result, TrainerError};

/// The versions written and how to push them.
pub struct Weights {
    root: PathBuf,
    mode: WeightSync,
    model: String,
    keep: usize,
    tolerance: f64,
    /// Whether the servers' heads were found untied ([`super::tied_head`]); checked once, at the
    /// first full sync of a tied policy.
    heads_checked: AtomicBool,
}

impl Weights {
    pub fn new(run_dir: &Path, cfg: &VllmConfig) -> Self {
        Weights {
            root: run_dir.join("rollout-weights"),
            mode: cfg.weight_sync,
            model: cfg.model.clone(),
            keep: cfg.keep_versions,
            tolerance: cfg.sync_tolerance,
            heads_checked: AtomicBool::new(false),
        }
    }

    /// The directory of `version`.
    pub fn dir(&self, version: usize) -> PathBuf {
        self.root.join(format!("v{version:06}"))
    }

    /// Writes `version` of `actor`, has every client load and confirm it, prunes old versions.
    pub fn push(&self, actor: &CausalLm, version: usize, probe: &[u32], clients: &[VllmClient]) -> Result<()> {
        let tied = matches!(self.mode, WeightSync::Full) && actor.arch().tie_word_embeddings;
        if tied && !self.heads_checked.load(Ordering::Relaxed) {
            let canary = self.root.join("canary");
            tied_head::write_canary(actor, &canary)?;
            let results = self.load_all(actor, &canary, probe, 0, clients);
            let _ = std::fs::remove_dir_all(&canary);
            for (c, r) in clients.iter().zip(results) {
                let (_, lp) = r.map_err(|m| TrainerError::Run(format!("rollout.vllm: {m}")))?;
                tied_head::check_canary(c.url(), lp, actor.arch().vocab_size)?;
            }
            self.heads_checked.store(true, Ordering::Relaxed);
        }
        let dir = self.dir(version);
        let _ = std::fs::remove_dir_all(&dir);
        match self.mode {
            WeightSync::Full => actor.save(&dir)?,
            WeightSync::Lora => actor.save_lora_adapter(&dir)?,
        }
        if tied {
            tied_head::write_head(&dir, actor.lm_head_weight())?;
        }
        for (c, r) in clients.iter().zip(self.load_all(actor, &dir, probe, version, clients)) {
            let (token, engine_lp) = r.map_err(|m| TrainerError::Run(format!("rollout.vllm: {m}")))?;
            let ours = probe_logprob(actor, probe, token)?;
            let d = (engine_lp - ours).abs();
            if d.is_nan() || d > self.tolerance {
                return Err(TrainerError::Run(format!(
                    "rollout.vllm: {} did not take weight version {} ({}): its log-prob of the probe token {token} is \
                     {engine_lp:.6}, the trainer's {ours:.6} (|Δ| = {d:.2e} > rollout.vllm.sync_tolerance = {})",
                    c.url(),
                    version,
                    dir.display(),
                    self.tolerance
                )));
            }
        }
        self.prune()
    }

    /// [`Self::load_on`] on every server at once.
    fn load_all(
        &self,
        actor: &CausalLm,
        dir: &Path,
        probe: &[u32],
        version: usize,
        clients: &[VllmClient],
    ) -> Vec<std::result::Result<(u32, f64), String>> {
        let images = actor.vision().is_some();
        std::thread::scope(|s| {
            let handles: Vec<_> = clients
                .iter()
                .map(|c| s.spawn(move || self.load_on(c, dir, probe, version, images).map_err(|e| e.to_string())))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("sync thread panicked".into()))).collect()
        })
    }

    /// Loads `dir` on one server, drops its prefix cache (and for a model that reads `images`,
    /// its cached image encodings), and samples one token of `probe` there: returns the token and
    /// the server's log-prob of it.
    fn load_on(&self, c: &VllmClient, dir: &Path, probe: &[u32], version: usize, images: bool) -> Result<(u32, f64)> {
        let e = |e: super::client::VllmError| TrainerError::Run(e.to_string());
        match self.mode {
            WeightSync::Full => c.reload_weights(dir).map_err(e)?,
            WeightSync::Lora => c.load_lora(&self.model, dir).map_err(e)?,
        }
        c.reset_prefix_cache().map_err(e)?;
        if images {
            c.reset_image_caches().map_err(e)?;
        }
        // Temperature 1, no top-k/top-p: the log-prob is the model's own whatever the server's
        // logprobs mode.
        let s = Sampling {
            max_tokens: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            seed: Some(version as u64),
        };
        let out = c.complete(&self.model, &[probe.to_vec()], 1, &s).map_err(e)?;
        let first = out.first().and_then(|p| p.first());
        match first.and_then(|c| Some((*c.token_ids.first()?, *c.logprobs.first()?))) {
            Some(x) => Ok(x),
            None => Err(TrainerError::Run(format!("{}: the probe request returned no token", c.url()))),
        }
    }

    /// Removes all but the newest `keep` versions.
    fn prune(&self) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return Ok(()) };
        let mut versions: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('v')))
            .collect();
        versions.sort();
        let drop = versions.len().saturating_sub(self.keep);
        for old in &versions[..drop] {
            std::fs::remove_dir_all(old).map_err(|e| TrainerError::io(old, e))?;
        }
        Ok(())
    }
}

/// The trainer's log-prob of `token` after `probe`.
fn probe_logprob(actor: &CausalLm, probe: &[u32], token: u32) -> Result<f64> {
    let ids: Vec<i64> = probe.iter().chain(std::iter::once(&token)).map(|&t| i64::from(t)).collect();
    let device = actor.device();
    let seq = Tensor::f_from_slice(&ids)?.f_view([1, ids.len() as i64])?.f_to_device(device)?;
    let attn = seq.f_ones_like()?.f_to_kind(Kind::Int64)?;
    let opts = LogProbOptions { entropy: false, ..LogProbOptions::default() };
    let lp = tch::no_grad(|| token_logprobs(actor, &seq, &attn, probe.len() as i64, opts))?;
    Ok(lp.logprobs.f_double_value(&[0, 0])?)
}
