//! Building a [`Trainer`]: plugins first (a wrong name or config fails before any model loads),
//! then the actor (with the optional supervised warm-up), the reference, critic and EMA copies,
//! the optimizers and the ptx data; on resume, the checkpoint.
//!
//! The run directory is owned by one process ([`RunLock`], taken before anything is written into
//! it). What can be checked without it — the config (at load), the plugins and their config
//! sections, the prompt data — is checked before it is created. A fresh start that fails after
//! that (a model that does not load, a bad ptx file, a W&B setting) leaves the directory as it
//! found it ([`RunLock::abandon`]: a directory it created goes entirely), so no failed start
//! leaves a directory that can neither be reused nor resumed. The run's own files (`config.toml`,
//! `metrics.jsonl`) are written only once nothing but I/O can fail, so a refused resume leaves
//! them as they were.

mod models;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rlhf_collective::World;
use rlhf_models::parse_dtype;
use rlhf_plugin_api::PluginKind;
use rlhf_tokenizer::HfTokenizer;
use tch::{Device, Kind};

use crate::checkpoint::Loaded;
use crate::config::RlConfig;
use crate::data::{PromptDataset, RawPrompt};
use crate::error::{Result, TrainerError};
use crate::metrics::MetricsWriter;
use crate::plugins::{host_context, AlgorithmHandle, PluginRegistry};
use crate::prompt_images::PromptImages;
use crate::rl::eval::Evaluator;
use crate::rl::ptx::PtxData;
use crate::rl::score::{self, RewardSource};
use crate::rl::visual::Visual;
use crate::rl::Trainer;
use crate::run_lock::RunLock;

/// `run.run_dir`, or `runs/<algo>-<unix time>`.
fn run_dir_of(cfg: &RlConfig) -> PathBuf {
    cfg.run.run_dir.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from("runs").join(format!("{}-{t}", cfg.algorithm.name))
    })
}

/// Refuses a fresh run into a directory that already holds a run (checked under the lock, so two
/// starts cannot both pass): a new run never appends to, or overwrites, another run's outputs.
/// One with a checkpoint is continued with `--resume`. One without (it stopped before its first
/// checkpoint, or wrote none) cannot be continued, and is never restarted over: its logged steps
/// would be lost or mixed with the new run's, so the message says to remove it or choose another
/// directory.
fn check_fresh(run_dir: &Path) -> Result<()> {
    let Some(step) = crate::metrics::logged_steps(run_dir) else { return Ok(()) };
    // Only the held-out evaluation before training was logged: nothing was trained, so the run
    // starts over (and its metrics.jsonl with it).
    if step == 0 && crate::checkpoint::latest(run_dir)?.is_none() && !run_dir.join("actor").is_dir() {
        return Ok(());
    }
    let d = run_dir.display();
    Err(TrainerError::Config(match crate::checkpoint::latest(run_dir)? {
        Some(_) => format!(
            "{d}: the run directory already holds a run (metrics.jsonl); continue it with --resume {d} or choose \
             another --run-dir"
        ),
        None if run_dir.join("actor").is_dir() => format!(
            "{d}: the run directory holds a finished run without checkpoints (metrics.jsonl ends at step {step}), so \
             it cannot be continued; remove the directory or choose another --run-dir"
        ),
        None => format!(
            "{d}: the run directory holds a run that stopped before its first checkpoint (metrics.jsonl ends at step \
             {step}), so it cannot be resumed; remove the directory or choose another --run-dir"
        ),
    }))
}

/// The algorithm and the reward sources, each given its config section.
fn load_plugins(cfg: &RlConfig, registry: &PluginRegistry) -> Result<Plugins> {
    let g = cfg.rollout.samples_per_prompt as u32;
    let ctx = || host_context(&cfg.run.device, cfg.run.seed, g);
    let algo_plugin = registry.get(&cfg.algorithm.name, PluginKind::Algorithm)?;
    let algo = AlgorithmHandle::new(algo_plugin, &cfg.algorithm.config.to_string(), ctx(), "algorithm.config")
        .map_err(|e| score::config_error(cfg, e))?;
    let resolved = algo.resolved_config();
    if !resolved.is_null() {
        tracing::info!("algorithm `{}`: {resolved}", algo.meta.name);
    }
    let env = crate::rl::episode::EnvRuntime::load(cfg, registry)?;
    Ok((algo, score::load_rewards(cfg, registry)?, env))
}

/// What rank 0 writes into the run directory once every rank has set up.
pub(crate) struct RunFiles {
    /// The resolved config, for `config.toml`.
    resolved: String,
    wandb: Option<rlhf_wandb::WandbSettings>,
    resumed: bool,
}

/// The algorithm, the training's reward sources and the environment.
type Plugins = (AlgorithmHandle, Vec<RewardSource>, Option<crate::rl::episode::EnvRuntime>);

/// Refuses an unknown `builtin:` actor, and resolves (downloads) models named by Hub id, before
/// anything is written.
fn check_actor_spec(cfg: &RlConfig) -> Result<()> {
    if !cfg.model.actor.starts_with("builtin:") {
        crate::model_source::resolve(&cfg.model.actor, "model.actor")?;
    }
    if let Some(spec) = &cfg.model.reference {
        crate::model_source::resolve(spec, "model.reference")?;
    }
    if cfg.model.critic != "actor" {
        crate::model_source::resolve(&cfg.model.critic, "model.critic")?;
    }
    match cfg.model.actor.strip_prefix("builtin:") {
        Some(other) if !crate::builtin_models::MODELS.contains(&other) => Err(TrainerError::Config(format!(
            "{}: model.actor: unknown built-in model `builtin:{other}` (available: {})",
            cfg.source_of("model.actor"),
            crate::builtin_models::MODELS.iter().map(|m| format!("builtin:{m}")).collect::<Vec<_>>().join(", ")
        ))),
        _ => Ok(()),
    }
}

/// The directory of the initial actor: a Hugging Face directory, or the built-in tiny model
/// written into the run directory.
fn actor_dir_of(cfg: &RlConfig, run_dir: &Path) -> Result<PathBuf> {
    match cfg.model.actor.strip_prefix("builtin:") {
        Some(name) => {
            let dir = run_dir.join("builtin-model");
            crate::builtin_models::write_model(name, &dir, cfg.run.seed)?;
            Ok(dir)
        }
        None => crate::model_source::resolve(&cfg.model.actor, "model.actor"),
    }
}

/// The raw prompts of `data.prompts` (a file or a `builtin:` task), read before the run directory
/// is created.
fn raw_prompts(cfg: &RlConfig) -> Result<Vec<RawPrompt>> {
    crate::builtin::prompts_of(&cfg.data).map_err(|e| match e {
        TrainerError::Config(m) => {
            TrainerError::Config(format!("{}: data.prompts: {m}", cfg.source_of("data.prompts")))
        }
        e => e,
    })
}

/// Refuses to train a vision tower at ZeRO stage 3.
fn check_vision_tower(cfg: &RlConfig, arch: &rlhf_models::ArchConfig) -> Result<()> {
    if arch.vision.is_some() && !cfg.model.freeze_vision && cfg.distributed.zero_stage == 3 {
        return Err(TrainerError::Config(format!(
            "{}: model.freeze_vision: training the vision tower at distributed.zero_stage = 3 is not supported \
             yet (stages 0-2 train it)",
            cfg.source_of("model.freeze_vision")
        )));
    }
    Ok(())
}

/// The training prompts and the held-out evaluation (its prompts in file order), tokenized, with
/// their images when the policy reads them; a run on prompts with images is checked for settings
/// that cannot work with them.
fn datasets(
    cfg: &RlConfig,
    (raw, eval): (Vec<RawPrompt>, Option<crate::rl::eval::EvalInputs>),
    tok: &HfTokenizer,
    images: Option<&PromptImages>,
) -> Result<(PromptDataset, Option<Evaluator>)> {
    let data = PromptDataset::new_with_images(raw, tok, &cfg.data, cfg.run.seed, images)?;
    let evaluator = match eval {
        Some(e) => {
            let unshuffled = crate::config::DataConfig { shuffle: false, ..cfg.data.clone() };
            let held_out = PromptDataset::new_with_images(e.raw, tok, &unshuffled, cfg.run.seed, images)?;
            let ev = Evaluator::new(&cfg.eval, held_out, e.rewards, &cfg.rollout, cfg.run.seed, e.env)?;
            Some(ev.with_images(images.cloned()))
        }
        None => None,
    };
    if cfg.rollout.prompts_per_batch > data.records.len() {
        tracing::warn!(
            "rollout.prompts_per_batch = {} is more than the {} prompts of data.prompts ({}): every batch repeats \
             prompts",
            cfg.rollout.prompts_per_batch,
            data.records.len(),
            cfg.data.prompts
        );
    }
    Ok((data, evaluator))
}

impl Trainer {
    /// Prepares models, plugins, data and optimizers; with `resume`, restores a checkpoint of this
    /// run (see [`crate::checkpoint`]) so the following steps equal those of an uninterrupted run.
    /// The trainer owns the run directory (its lock) until it is dropped.
    ///
    /// Data-parallel (`world` of several ranks): rank 0 owns the run directory and writes into
    /// it; the other ranks read from it only to resume, and write what they must (a built-in
    /// model) into a scratch directory. Every rank builds the same trainer, rank 0's initial
    /// weights are broadcast, and the ranks agree that setup succeeded everywhere before the
    /// first step.
    ///
    /// The run's own files (`config.toml`, `metrics.jsonl`, W&B) are touched only once every rank
    /// has set up: a start or resume refused on any rank (a damaged optimizer shard of rank 1,
    /// say) leaves every file of the run as it was, and a fresh start leaves nothing behind.
    pub fn new(cfg: RlConfig, registry: &PluginRegistry, resume: Option<&Loaded>, world: Arc<World>) -> Result<Self> {
        let result = Self::new_on_rank(cfg, registry, resume, world.clone());
        let here = match &result {
            Ok(_) => Ok(()),
            Err(_) => Err(TrainerError::Run("setup failed on this rank".into())),
        };
        let everywhere = crate::dist::agree(&world, "setup", here);
        let mut trainer = match (result, everywhere) {
            (Err(e), _) => return Err(e),
            (Ok(t), Err(e)) => {
                t.abandon_start(resume.is_none());
                return Err(e);
            }
            (Ok(t), Ok(())) => t,
        };
        let opened = trainer.open_run_files();
        match crate::dist::agree(&world, "opening the run's files", opened) {
            Ok(()) => Ok(trainer),
            Err(e) => {
                trainer.abandon_start(resume.is_none());
                Err(e)
            }
        }
    }

    /// Gives up a start that did not begin: a fresh run's directory goes (see
    /// [`RunLock::abandon`]); a resumed run's stays as it was.
    fn abandon_start(mut self, fresh: bool) {
        if let (true, Some(lock)) = (fresh, self._lock.take()) {
            lock.abandon();
        }
    }

    /// Rank 0: truncates `metrics.jsonl` to the resumed step (or clears a fresh directory's),
    /// writes the resolved `config.toml`, opens the metrics file and W&B.
    fn open_run_files(&mut self) -> Result<()> {
        let Some(files) = self.run_files.take() else { return Ok(()) };
        let metrics_path = self.run_dir.join("metrics.jsonl");
        if files.resumed {
            crate::metrics::truncate_after(&metrics_path, self.step)?;
        } else if metrics_path.is_file() {
            // A fresh run here may find only a stopped run's step-0 evaluation (`check_fresh`).
            std::fs::remove_file(&metrics_path).map_err(|e| TrainerError::io(&metrics_path, e))?;
        }
        let config_path = self.run_dir.join("config.toml");
        std::fs::write(&config_path, files.resolved).map_err(|e| TrainerError::io(&config_path, e))?;
        self.metrics = Some(MetricsWriter::create(&self.run_dir)?);
        let first = if files.resumed { self.step + 1 } else { 0 };
        self.tensorboard = crate::tensorboard::TensorboardSink::open(&self.cfg.tensorboard, &self.run_dir, first)?;
        if let Some(settings) = files.wandb {
            self.start_wandb(settings);
        }
        Ok(())
    }

    fn new_on_rank(
        cfg: RlConfig,
        registry: &PluginRegistry,
        resume: Option<&Loaded>,
        world: Arc<World>,
    ) -> Result<Self> {
        let device = crate::dist::device(&world, &cfg.run.device)?;
        let kind = parse_dtype(&cfg.run.dtype)?;
        tch::manual_seed(cfg.run.seed as i64);
        let what = format!("train.steps = {}", cfg.train.steps);
        crate::checkpoint::refuse_nothing_to_train(resume, cfg.train.steps, &what)?;
        check_actor_spec(&cfg)?;
        if cfg.rollout.prompts_per_batch < world.size() {
            return Err(TrainerError::Config(format!(
                "{}: rollout.prompts_per_batch = {} is below the {} data-parallel ranks: every rank needs a prompt",
                cfg.source_of("rollout.prompts_per_batch"),
                cfg.rollout.prompts_per_batch,
                world.size()
            )));
        }
        let r = &cfg.rollout;
        if r.engine == crate::config::EngineKind::Vllm
            && r.is_correction.mode != crate::config::IsMode::None
            && (r.temperature != 1.0 || r.top_k > 0 || r.top_p < 1.0)
        {
            tracing::warn!(
                "rollout.is_correction with temperature {} / top_k {} / top_p {}: the trainer's log-probs are the \
                 untempered policy's, so start vLLM with --logprobs-mode raw_logprobs for the ratio to measure only \
                 the engine's numerics (processed_logprobs include the sampling transform)",
                r.temperature,
                r.top_k,
                r.top_p
            );
        }
        let plugins = load_plugins(&cfg, registry)?;
        let raw = raw_prompts(&cfg)?;
        let eval = crate::rl::eval::inputs(&cfg, registry)?;
        if !world.is_main() {
            // Rank 0 owns the run directory; this rank reads it only to resume.
            let scratch = crate::dist::Scratch::new(&world)?;
            let run_dir = run_dir_of(&cfg);
            let mut t = Self::build(cfg, run_dir, scratch.dir(), plugins, (raw, eval), resume, device, kind, world)?;
            t._scratch = Some(scratch);
            return Ok(t);
        }
        let lock = RunLock::acquire(&run_dir_of(&cfg))?;
        if resume.is_none() {
            check_fresh(lock.dir())?;
        }
        let dir = lock.dir().to_path_buf();
        match Self::build(cfg, dir.clone(), &dir, plugins, (raw, eval), resume, device, kind, world) {
            Ok(mut trainer) => {
                trainer._lock = Some(lock);
                Ok(trainer)
            }
            Err(e) => {
                if resume.is_none() {
                    lock.abandon();
                }
                Err(e)
            }
        }
    }

    /// [`Trainer::new`] once the run directory is ours (rank 0), or with a scratch directory for
    /// what this rank writes (`out_dir`).
    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: RlConfig,
        run_dir: PathBuf,
        out_dir: &Path,
        (algo, rewards, env): Plugins,
        (raw, eval): (Vec<RawPrompt>, Option<crate::rl::eval::EvalInputs>),
        resume: Option<&Loaded>,
        device: Device,
        kind: Kind,
        world: Arc<World>,
    ) -> Result<Self> {
        // The resolved config is written only once everything below has loaded (see the end), so a
        // refused resume leaves the run's config.toml and metrics.jsonl as they were.
        let resolved =
            toml::to_string(&cfg).map_err(|e| TrainerError::Config(format!("cannot serialise config: {e}")))?;
        let actor_dir = actor_dir_of(&cfg, out_dir)?;
        let tok = crate::model_source::tokenizer(&actor_dir, &cfg.data.chat_template_kwargs)?;
        let arch = rlhf_models::ModelConfig::from_dir(&actor_dir)?.arch;
        check_vision_tower(&cfg, &arch)?;
        let images = PromptImages::for_model(&actor_dir, &arch, &tok)?;
        let (data, evaluator) = datasets(&cfg, (raw, eval), &tok, images.as_ref())?;
        let with_images = data.records.iter().any(|r| !r.images.is_empty());
        // An environment's observations may bring images to text prompts too.
        let visual_of = images.filter(|_| with_images || cfg.environment.enabled());
        let warmup_dir = if resume.is_some() { &run_dir } else { out_dir };
        let (mut actor, actor_dir) = models::warmed_up_actor(
            &cfg,
            warmup_dir,
            actor_dir,
            &tok,
            (&data, visual_of.as_ref()),
            resume.is_some(),
            device,
            kind,
        )?;
        // Two generation batches' prompts keep their patches (dynamic sampling may draw more in a
        // step; those are patched again when needed).
        let visual = visual_of.map(|i| Visual::new(i, 2 * cfg.rollout.prompts_per_batch));
        if visual.is_some() && cfg.environment.enabled() && cfg.environment.kv_reuse {
            tracing::info!(
                "environment.kv_reuse: a batch prefills each turn again once its prompts or observations hold images"
            );
        }
        // Before the optimizers collect the trainable parameters.
        let tower = actor.set_vision_trainable(!cfg.model.freeze_vision);
        if tower > 0 {
            let how = if cfg.model.freeze_vision { "frozen (model.freeze_vision)" } else { "trained" };
            tracing::info!("the vision tower's {tower} parameters are {how}");
        }
        let (mut reference, mut critic, ema) =
            models::companions(&cfg, algo.requirements(), &mut actor, &actor_dir, device, kind)?;
        models::check_critic_reads_images(&cfg, critic.as_ref(), with_images)?;
        if let Some(c) = &critic {
            c.set_vision_trainable(!cfg.model.freeze_vision);
        }
        let ref_shares_vision = reference.as_ref().is_some_and(|r| actor.same_vision(r.vision()));
        let critic_shares_vision =
            cfg.model.freeze_vision && critic.as_ref().is_some_and(|c| actor.same_vision(c.vision()));
        // A frozen, ungated tower's features are computed once per prompt (see `visual`).
        let frozen_features = visual.is_some() && cfg.model.freeze_vision && cfg.distributed.zero_stage < 3;
        models::share_initial_weights(&world, &actor, critic.as_ref(), ema.as_ref())?;
        let (actor_opt, critic_opt, ref_params) =
            models::optimizers(&cfg, &mut actor, critic.as_mut(), reference.as_mut(), &world)?;
        let ptx = match &cfg.train.ptx_data {
            Some(path) if cfg.train.ptx_coef != 0.0 => Some(PtxData::read(path, &tok)?),
            _ => None,
        };
        let engine = super::engine::Engine::new(&cfg.rollout, &run_dir)?;
        let cfg_prompts = cfg.data.prompts.clone();
        let trainer = Trainer {
            cfg,
            run_dir,
            _lock: None,
            device,
            tok,
            actor,
            reference,
            ref_params,
            critic,
            ema,
            algo,
            rewards,
            data,
            frozen_features,
            ref_shares_vision,
            critic_shares_vision,
            visual,
            actor_opt,
            critic_opt,
            ptx,
            metrics: None,
            step: 0,
            prompts_seen: 0,
            reward_history: Vec::new(),
            wandb: None,
            tensorboard: None,
            progress: None,
            engine,
            pipeline: None,
            world,
            evaluator,
            env,
            _scratch: None,
            run_files: None,
            resumed_at: 0,
            data_identity: crate::data::identity(&cfg_prompts)?,
        };
        trainer.resumed(resume, resolved)
    }

    /// A built trainer with the checkpoint `resume` restored and its pipeline started; rank 0
    /// keeps what it will write into the run directory (`resolved`, the config), for when every
    /// rank got here ([`Trainer::new`]).
    fn resumed(mut self, resume: Option<&Loaded>, resolved: String) -> Result<Self> {
        if let Some(ckpt) = resume {
            self.restore(ckpt)?;
            self.resumed_at = self.step;
        }
        self.start_pipeline(resume)?;
        if !self.world.is_main() {
            return Ok(self);
        }
        let wandb = self.wandb_settings(resume)?;
        self.run_files = Some(RunFiles { resolved, wandb, resumed: resume.is_some() });
        Ok(self)
    }
}
