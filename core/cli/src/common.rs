//! Options shared by subcommands: model directory, device and dtype.

use std::path::PathBuf;

use anyhow::Context;
use tch::{Device, Kind};

/// `--model`, `--device`, `--dtype`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json), or a Hub id
    /// (`org/name[@revision]`) read from the Hugging Face cache and downloaded when missing.
    #[arg(long)]
    pub model: PathBuf,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

impl ModelArgs {
    /// Parsed device and dtype.
    pub fn device_kind(&self) -> anyhow::Result<(Device, Kind)> {
        Ok((rlhf_models::parse_device(&self.device)?, rlhf_models::parse_dtype(&self.dtype)?))
    }

    /// The model directory: `--model` as a path, or the snapshot of a Hub id.
    pub fn dir(&self) -> anyhow::Result<PathBuf> {
        let spec = self.model.to_string_lossy();
        if spec.starts_with("builtin:") {
            // The built-in models are random weights a run writes into its own directory.
            anyhow::bail!(
                "--model {spec}: built-in models are written by a run (`rlhf train`, `sft`, `rm`, `dpo`, `bench`); \
                 give a model directory (a run's saved checkpoint) or a Hub id"
            );
        }
        let dir = rlhf_hub::resolve_model(&spec)?;
        if !dir.is_dir() {
            anyhow::bail!("--model {}: model directory not found", dir.display());
        }
        Ok(dir)
    }

    /// Loads the causal LM.
    pub fn load_lm(&self) -> anyhow::Result<rlhf_models::CausalLm> {
        let (device, kind) = self.device_kind()?;
        Ok(rlhf_models::CausalLm::from_dir(&self.dir()?, device, kind)?)
    }

    /// Loads the causal LM and its tokenizer, checked to fit each other.
    pub fn load_lm_and_tokenizer(&self) -> anyhow::Result<(rlhf_models::CausalLm, rlhf_tokenizer::HfTokenizer)> {
        let tok = self.load_tokenizer()?;
        let model = self.load_lm()?;
        tok.check_fits_vocab(model.arch().vocab_size)?;
        Ok((model, tok))
    }

    /// Loads the tokenizer files of the model directory.
    pub fn load_tokenizer(&self) -> anyhow::Result<rlhf_tokenizer::HfTokenizer> {
        let dir = self.dir()?;
        rlhf_tokenizer::HfTokenizer::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))
    }
}

/// This process's place among the data-parallel ranks: the world torchrun (or `--nproc`)
/// described in the environment, or a single process. `RLHF_DIST_TIMEOUT` (seconds, default
/// 600) bounds the rendezvous and every collective, so a rank whose peer died or hangs exits
/// with an error instead of waiting forever.
pub fn world() -> anyhow::Result<std::sync::Arc<rlhf_collective::World>> {
    let secs = match std::env::var("RLHF_DIST_TIMEOUT") {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0 && s.is_finite())
            .ok_or_else(|| anyhow::anyhow!("RLHF_DIST_TIMEOUT={v:?}: expected a number of seconds > 0"))?,
        Err(_) => 600.0,
    };
    let opts = rlhf_collective::InitOptions { timeout: std::time::Duration::from_secs_f64(secs), threads: 1 };
    let world = rlhf_collective::World::from_env(&opts)?;
    if world.is_distributed() {
        tracing::info!(
            "rank {}/{} (local rank {}), rendezvous at {}",
            world.rank(),
            world.size(),
            world.local_rank(),
            world.master().unwrap_or("-")
        );
    }
    Ok(std::sync::Arc::new(world))
}
