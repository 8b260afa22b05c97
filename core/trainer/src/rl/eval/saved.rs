//! `rlhf eval`: held-out evaluation of a saved policy outside a run, with the metrics and sample
//! file of evaluation during training. The policy is a Hugging Face directory, a run directory
//! (its exported `actor/`), or one of the run's checkpoints (the run's starting weights with the
//! checkpoint's actor variables, LoRA adapters included).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rlhf_collective::World;
use rlhf_models::{parse_dtype, CausalLm};

use crate::checkpoint;
use crate::config::{ConfigSource, RlConfig};
use crate::error::{Result, TrainerError};
use crate::plugins::PluginRegistry;
use crate::rl::eval::Evaluator;

/// What an evaluation of a saved policy found.
pub struct SavedEval {
    /// The `eval/*` metrics.
    pub metrics: BTreeMap<String, f64>,
    /// The directory the weights (or, for a checkpoint, the starting weights) came from.
    pub model_dir: PathBuf,
}

/// Evaluates the policy at `path` on `cfg.eval` (whose `data` must be set) with `cfg`'s reward
/// sources, on `cfg.run.device` in `cfg.run.dtype`; the main rank writes every answer to
/// `samples` when given.
pub fn evaluate_saved(
    cfg: &RlConfig,
    registry: &PluginRegistry,
    path: &Path,
    world: &World,
    samples: Option<&Path>,
) -> Result<SavedEval> {
    let device = crate::dist::device(world, &cfg.run.device)?;
    let kind = parse_dtype(&cfg.run.dtype)?;
    let inputs = crate::rl::eval::inputs(cfg, registry)?
        .ok_or_else(|| TrainerError::Config("no held-out prompts: give --data FILE (or set eval.data)".into()))?;
    let (actor, model_dir) = load_policy(path, device, kind)?;
    let tok = crate::model_source::tokenizer(&model_dir, &cfg.data.chat_template_kwargs)?;
    let unshuffled = crate::config::DataConfig { shuffle: false, ..cfg.data.clone() };
    // A vision-language policy reads the rows' images (docs/vision.md).
    let images = crate::prompt_images::PromptImages::for_model(&model_dir, actor.arch(), &tok)?;
    let data =
        crate::data::PromptDataset::new_with_images(inputs.raw, &tok, &unshuffled, cfg.run.seed, images.as_ref())?;
    let evaluator = Evaluator::new(&cfg.eval, data, inputs.rewards, &cfg.rollout, cfg.run.seed, inputs.env)?;
    let mut evaluator = evaluator.with_images(images);
    let eos: Vec<i64> = tok.eos_token_ids().iter().map(|&i| i64::from(i)).collect();
    let m = evaluator.evaluate(&actor, None, &tok, &eos, i64::from(tok.pad_token_id()), world, samples, 0);
    if model_dir.starts_with(std::env::temp_dir()) && model_dir.to_string_lossy().contains("rlhf-eval-") {
        // A built-in model written for this evaluation only.
        let _ = std::fs::remove_dir_all(&model_dir);
    }
    let metrics = m?.means();
    // An environment that failed every episode leaves nothing to measure: no pass@1 = 0.
    if let (Some(&n), Some(&failed)) = (metrics.get("eval/env/episodes"), metrics.get("eval/env/errors")) {
        if n > 0.0 && failed == n {
            return Err(TrainerError::Run(format!(
                "held-out evaluation: the environment failed every one of the {n} episodes (see its warning above); \
                 no metric is reported"
            )));
        }
    }
    Ok(SavedEval { metrics, model_dir })
}

/// The actor's starting weights for the checkpoint at `path` (by any path: relative, or copied out
/// of its run): the warm-up's output or the written-out built-in model when its run directory
/// holds them, else the built-in model written anew (it is made from the run's seed), else the
/// configured model (as the run itself resumes). A warm-up model that is not there is an error
/// naming the checkpoint.
fn starting_weights(path: &Path, cfg: &RlConfig) -> Result<PathBuf> {
    let abs = std::path::absolute(path).map_err(|e| TrainerError::io(path, e))?;
    let run_dir = abs.parent().filter(|p| p.ends_with("checkpoints")).and_then(Path::parent);
    if let Some(run) = run_dir {
        let found =
            [run.join("warmup-model"), run.join("builtin-model")].into_iter().find(|d| d.join("config.json").is_file());
        if let Some(dir) = found {
            return Ok(dir);
        }
    }
    if cfg.warmup.steps > 0 {
        return Err(TrainerError::Checkpoint(format!(
            "{}: its run started from a supervised warm-up whose model (warmup-model/ of the run directory) is not \
             next to it; evaluate the checkpoint inside its run's checkpoints/ directory",
            path.display()
        )));
    }
    match cfg.model.actor.strip_prefix("builtin:") {
        Some(name) => {
            let dir = std::env::temp_dir().join(format!("rlhf-eval-{}-{name}-{}", std::process::id(), cfg.run.seed));
            crate::builtin_models::write_model(name, &dir, cfg.run.seed)?;
            Ok(dir)
        }
        None => crate::model_source::resolve(&cfg.model.actor, "model.actor"),
    }
}

/// The policy at `path` and the Hugging Face directory its tokenizer (and starting weights) are in.
fn load_policy(path: &Path, device: tch::Device, kind: tch::Kind) -> Result<(CausalLm, PathBuf)> {
    if path.join("config.json").is_file() {
        return Ok((CausalLm::from_dir(path, device, kind)?, path.to_path_buf()));
    }
    let exported = path.join("actor");
    if exported.join("config.json").is_file() {
        return Ok((CausalLm::from_dir(&exported, device, kind)?, exported));
    }
    if !path.join("manifest.json").is_file() {
        return Err(TrainerError::Config(format!(
            "{}: not a model directory (config.json), a run directory with an exported actor/ or a checkpoint \
             (manifest.json)",
            path.display()
        )));
    }
    let ckpt = checkpoint::load(path)?;
    let named = |e: TrainerError| TrainerError::Checkpoint(format!("{}: {e}", path.display()));
    let cfg = RlConfig::load(&ConfigSource::File(path.join("config.toml")), None, &[]).map_err(named)?;
    let base = starting_weights(path, &cfg)?;
    let mut actor = CausalLm::from_dir(&base, device, kind).map_err(|e| named(e.into()))?;
    actor.apply_lora(&cfg.model.lora).map_err(|e| crate::model_source::lora_error("model.lora", e))?;
    ckpt.restore_vars("actor", &actor.vs)?;
    Ok((actor, base))
}
