//! The loop the supervised phases share: evaluation, epochs of shuffled micro-batches with
//! gradient accumulation, optimizer steps, metrics and checkpoints — on one process, or
//! data-parallel over the ranks of a [`World`]: every rank takes its share of each micro-batch,
//! scales its loss by the weight of the whole step, and the gradients are summed over ranks
//! before clipping, so N ranks take the step one process would take on the whole batch.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rlhf_collective::World;
use rlhf_models::parse_dtype;
use serde::Serialize;
use tch::{nn, Device, Kind};

use crate::checkpoint::Loaded;
use crate::config::PhaseRunConfig;
use crate::dist;
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::optim::StepInfo;
use crate::run_lock::RunLock;
use crate::supervised::phase::{
    check_model_spec, epoch_plan, in_run_dir, load_splits, prepare_run_dir, shared_run_dir, total_steps,
    PhaseTrainConfig, Splits,
};
use crate::supervised::state::{earlier_figures, PhaseRun, Sinks};
use crate::train_engine::{self, TrainEngine};

/// A supervised phase's configuration, as [`begin_phase`] reads it.
pub trait PhaseConfig: Serialize {
    /// The phase (`sft`, `rm`, `dpo`): its run directory's default name.
    const NAME: &'static str;
    /// `[run]`: device, dtype, seed and run directory.
    fn run(&self) -> &PhaseRunConfig;
    /// `model.path`: a directory, a Hub id or a built-in model.
    fn model_path(&self) -> &str;
    /// `train.steps` (0 = every epoch).
    fn steps(&self) -> usize;
    /// The data files, read and split (with `run.seed` where an eval share is drawn).
    fn splits(&self) -> Result<Splits>;
}

/// [`PhaseConfig`] of a phase's configuration type, whose `run`, `model.path`, `train.steps` and
/// `data` (`train`, `eval`, `eval_fraction`, `columns()`) are named alike in every phase.
macro_rules! phase_config {
    ($ty:ty, $name:literal) => {
        impl PhaseConfig for $ty {
            const NAME: &'static str = $name;

            fn run(&self) -> &PhaseRunConfig {
                &self.run
            }

            fn model_path(&self) -> &str {
                &self.model.path
            }

            fn steps(&self) -> usize {
                self.train.steps
            }

            fn splits(&self) -> Result<Splits> {
                let d = &self.data;
                load_splits(&d.train, d.eval.as_deref(), d.eval_fraction, self.run.seed, &d.columns())
            }
        }
    };
}

phase_config!(crate::config::SftConfig, "sft");
phase_config!(crate::config::RmConfig, "rm");
phase_config!(crate::config::DpoConfig, "dpo");

/// What a phase has once begun ([`begin_phase`]).
pub struct Begun {
    pub device: Device,
    pub kind: Kind,
    /// The data, read and split before the run directory existed.
    pub splits: Splits,
    /// The run directory as every rank names it (rank 0's).
    pub shared: PathBuf,
}

/// Begins a supervised phase, the same way for each, with everything checked before its run
/// directory exists: the device and dtype, the seed, the data, a model named by Hub id (fetched,
/// or refused), and a resume with no step left to train; then runs `body` in the run directory
/// ([`in_phase_dir`]), which the run owns (its lock) until `body` returns.
pub fn begin_phase<C: PhaseConfig, T>(
    world: &World,
    cfg: &C,
    resume: Option<&Loaded>,
    body: impl FnOnce(&Path, Begun) -> Result<T>,
) -> Result<T> {
    let run = cfg.run();
    let device: Device = dist::device(world, &run.device)?;
    let kind = parse_dtype(&run.dtype)?;
    tch::manual_seed(run.seed as i64);
    let splits = cfg.splits()?;
    check_model_spec(cfg.model_path())?;
    if cfg.steps() > 0 {
        let what = format!("train.steps = {}", cfg.steps());
        crate::checkpoint::refuse_nothing_to_train(resume, cfg.steps(), &what)?;
    }
    let shared = shared_run_dir(world, &run.run_dir, C::NAME)?;
    let create = || prepare_run_dir(&shared, cfg, resume.is_some());
    let begun = Begun { device, kind, splits, shared: shared.clone() };
    in_phase_dir(world, create, |run_dir| body(run_dir, begun))
}

/// Runs `f` in the phase's run directory: rank 0's, which `create` makes and locks (see
/// [`crate::supervised::phase::prepare_run_dir`]); another rank works in a private scratch
/// directory (a built-in model, its own metrics) that is removed afterwards. The ranks agree that
/// the directory could be made before any of them goes on.
pub fn in_phase_dir<T>(
    world: &World,
    create: impl FnOnce() -> Result<RunLock>,
    f: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let lock = if world.is_main() { create() } else { RunLock::acquire(&dist::scratch_path(world)) };
    let lock = dist::agree(world, "creating the run directory", lock)?;
    let scratch = (!world.is_main()).then(|| lock.dir().to_path_buf());
    let result = in_run_dir(lock, f);
    if let Some(dir) = scratch {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

/// One micro-batch's forward and backward.
#[derive(Debug, Clone, Copy)]
pub struct MicroOut {
    /// The micro-batch's loss summed over its items (tokens for SFT, pairs for RM), before scaling.
    pub loss_sum: f64,
    /// Real tokens processed.
    pub tokens: usize,
}

/// A supervised phase as the shared loop drives it.
pub trait PhaseTask {
    /// Loss weight of a micro-batch (target tokens for SFT, pairs for RM). A step's loss is the sum
    /// of its micro-batches' losses divided by the total weight, so gradient accumulation equals
    /// one large batch.
    fn weight(&self, items: &[usize]) -> f64;
    /// Forward, loss scaled by `1 / total_weight`, backward. Returns `None` when the loss is not
    /// finite (the step is then skipped); a checkpointed pass is still handed back for its
    /// backward, which then only makes a sharded model's collective calls.
    fn micro_step(&mut self, items: &[usize], total_weight: f64, m: &mut StepMetrics) -> Result<Option<MicroOut>>;
    /// Whether the micro-steps may run on sharded parameters (ZeRO stage 3): every forward of the
    /// trained model in them is a checkpointed pass.
    fn trains_sharded(&self) -> bool {
        true
    }
    /// Metrics on the eval split (`eval/...`), or `None` without one.
    fn evaluate(&mut self) -> Result<Option<StepMetrics>>;
    /// The variables the phase trains (checkpointed and restored with the optimizer state).
    fn trained_vars(&self) -> &nn::VarStore;
    /// Saves the model in Hugging Face format.
    fn save(&self, dir: &Path) -> Result<()>;
}

/// What [`run_phase`] did.
#[derive(Debug, Clone)]
pub struct LoopSummary {
    pub steps: usize,
    /// Eval metrics before the first step and after the last.
    pub eval_before: Option<StepMetrics>,
    pub eval_after: Option<StepMetrics>,
    /// Training loss of the first and last step.
    pub loss_first: f64,
    pub loss_last: f64,
    /// The final model.
    pub model_dir: PathBuf,
}

/// The loop shared by the supervised phases, on one rank or data-parallel over `world` (each
/// micro-batch split across ranks, gradients summed, rank 0 saving): restore a resumed
/// checkpoint → evaluate (step 0) → per optimizer step, the micro-batches of [`epoch_plan`] with
/// gradient accumulation → optimizer and schedule step → metrics (`loss`, `lr`, `grad_norm`,
/// `tokens_per_s`, `epoch`, and `eval/...` every `eval_every` steps and at the end) → a
/// checkpoint every `checkpoint.every` steps and at the end → the final model in
/// `<run_dir>/model`. Every random draw of a step (dropout) follows from (seed, step), and the
/// data order from (seed, epoch), so a resumed run repeats the uninterrupted one's steps.
pub fn run_phase<T: PhaseTask>(
    task: &mut T,
    n: usize,
    t: &PhaseTrainConfig,
    opt: &mut TrainEngine,
    run: &PhaseRun,
    sinks: &mut Sinks,
) -> Result<LoopSummary> {
    let (world, run_dir, seed) = (run.world, run.run_dir, run.seed);
    let total = total_steps(n, t);
    if t.gradient_checkpointing {
        tracing::info!("gradient checkpointing: each decoder layer is recomputed in backward");
    }
    let start = run.restore(task.trained_vars(), opt)?;
    let (eval_before, mut loss_first) = if start == 0 {
        let e = task.evaluate()?;
        if let Some(m) = &e {
            sinks.record(0, m)?;
            tracing::info!("step 0/{total}  {}", show(m));
        }
        (e, f64::NAN)
    } else {
        earlier_figures(sinks.path())
    };
    let mut eval_after = eval_before.clone();
    let (mut step, mut loss_last, mut saved) = (0usize, f64::NAN, start);
    let log_every = (total / 20).max(1);
    'epochs: for epoch in 0..t.epochs {
        let plan = epoch_plan(n, t, seed, epoch);
        let per_epoch = plan.len();
        for (k, group) in plan.into_iter().enumerate() {
            if step >= total {
                break 'epochs;
            }
            if step < start {
                step += 1;
                continue;
            }
            if let Some(sig) = dist::stop_signal(world)? {
                return Err(stopped(sig, step, total, saved, task, opt, run, sinks)?.into());
            }
            crate::optim::seed_step(seed, step);
            let t0 = Instant::now();
            let comm0 = world.stats();
            let mut m = StepMetrics::default();
            // The weight of the whole step, over every rank's items: each rank's loss is divided by
            // it, so the gradients summed over ranks are the one-process gradient of the step.
            let weight: f64 = group.iter().map(|g| task.weight(g)).sum();
            let mut local = StepMetrics::default();
            let (mut loss_sum, mut tokens, finite) = accumulate(task, &group, weight, opt, world, &mut local)?;
            if world.is_distributed() {
                let s = dist::sum(world, &[loss_sum, tokens as f64])?;
                (loss_sum, tokens) = (s[0], s[1] as usize);
            }
            // Every rank takes the same decision on the same combined gradient.
            let stepped = train_engine::finish_step(world, &mut [&mut *opt], finite)?;
            dist::merge_metrics(world, &local, &mut m)?;
            train_engine::memory_metrics(world, &[&*opt], &mut m)?;
            step += 1;
            if let Some(loss) = step_metrics(stepped.map(|infos| infos[0]), loss_sum / weight.max(1e-12), step, &mut m)
            {
                if loss_first.is_nan() {
                    loss_first = loss;
                }
                loss_last = loss;
            }
            m.set("epoch", epoch as f64 + (k + 1) as f64 / per_epoch as f64);
            let elapsed = t0.elapsed().as_secs_f64();
            m.set("tokens_per_s", tokens as f64 / elapsed.max(1e-9));
            m.set("step_time", elapsed);
            dist::comm_metrics(world, comm0, &mut m);
            let last = step == total;
            let every = run.checkpoint.every;
            let (eval_now, save_now) = (t.eval_every > 0 && step % t.eval_every == 0, every > 0 && step % every == 0);
            // Stage 3: whole weights only to evaluate or save (every rank gathers; rank 0 saves).
            opt.set_sharded(!(eval_now || save_now || last))?;
            if eval_now || last {
                if let Some(e) = task.evaluate()? {
                    for (key, v) in e.means() {
                        m.set(&key, v);
                    }
                    eval_after = Some(e);
                }
            }
            sinks.record(step, &m)?;
            if save_now && !last {
                run.save(step, task.trained_vars(), opt, sinks)?;
                saved = step;
            }
            if step % log_every == 0 || last || m.get("eval/loss").is_some() {
                tracing::info!("step {step}/{total}  {}", show(&m));
            }
        }
    }
    opt.gather_params()?;
    opt.check_identical(world, "model")?;
    if run.checkpoint.at_end && step > saved {
        run.save(step, task.trained_vars(), opt, sinks)?;
    }
    let model_dir = run_dir.join("model");
    if world.is_main() {
        task.save(&model_dir)?;
        let plots = run_dir.join("plots");
        match rlhf_plot::plot_run(run_dir, &plots) {
            Ok(files) => tracing::info!("plots: {} charts in {}", files.len(), plots.display()),
            Err(e) => tracing::warn!("plots not written: {e}"),
        }
    }
    sinks.finish(step, 0);
    Ok(LoopSummary { steps: step, eval_before, eval_after, loss_first, loss_last, model_dir })
}

/// The micro-batches of one optimizer step, each rank on its share of each: their gradients
/// accumulated (each loss divided by the step's `weight`), and this rank's loss sum, token count
/// and whether every loss was finite.
fn accumulate<T: PhaseTask>(
    task: &mut T,
    group: &[Vec<usize>],
    weight: f64,
    opt: &mut TrainEngine,
    world: &World,
    local: &mut StepMetrics,
) -> Result<(f64, usize, bool)> {
    let (mut loss_sum, mut tokens, mut finite) = (0f64, 0usize, true);
    for micro in group {
        let mine = &micro[dist::shard(micro.len(), world.rank(), world.size())];
        // Stage 3 trains on sharded parameters, but a micro-batch some rank has no rows
        // of runs on whole ones: the sharded passes are collectives every rank joins.
        opt.set_sharded(micro.len() >= world.size() && task.trains_sharded())?;
        // Sharded, a rank whose loss was not finite still runs its passes.
        if !mine.is_empty() && (finite || opt.lockstep()) {
            match task.micro_step(mine, weight.max(1e-12), local)? {
                Some(o) => {
                    loss_sum += o.loss_sum;
                    tokens += o.tokens;
                }
                None => finite = false,
            }
        }
        // Every rank, once per micro-batch (stage 2 reduce-scatters its gradients).
        opt.micro_done(world)?;
    }
    Ok((loss_sum, tokens, finite))
}

/// Ends a supervised phase on signal `sig` between steps: a checkpoint of the last finished step
/// is written (every rank takes part) unless one exists, so `--resume` continues where it stopped.
#[allow(clippy::too_many_arguments)]
fn stopped(
    sig: i32,
    step: usize,
    total: usize,
    saved: usize,
    task: &mut dyn PhaseTask,
    opt: &mut TrainEngine,
    run: &PhaseRun,
    sinks: &mut Sinks,
) -> Result<crate::signals::Stopped> {
    let name = crate::signals::name(sig);
    sinks.finish(step, 1);
    if step == 0 {
        return Ok(crate::signals::Stopped {
            signal: sig,
            message: format!("stopped by {name} before the first step"),
        });
    }
    opt.gather_params()?;
    if step > saved {
        run.save(step, task.trained_vars(), opt, sinks)?;
    }
    let dir = crate::checkpoint::step_dir(run.run_dir, step);
    Ok(crate::signals::Stopped {
        signal: sig,
        message: format!(
            "stopped by {name} after step {step} of {total}: checkpoint {} (continue with --resume {})",
            dir.display(),
            dir.display()
        ),
    })
}

/// Sets `lr`, `grad_norm`, `loss` and `skipped_steps` of optimizer step `step` from what it did
/// (`None`: a non-finite loss skipped it); returns the loss when the step ran.
fn step_metrics(stepped: Option<StepInfo>, loss: f64, step: usize, m: &mut StepMetrics) -> Option<f64> {
    let Some(info) = stepped else {
        tracing::warn!("step {step}: non-finite loss; optimizer step skipped");
        m.set("skipped_steps", 1.0);
        return None;
    };
    m.set("lr", info.lr);
    m.set("grad_norm", info.grad_norm);
    if info.skipped {
        tracing::warn!("step {step}: non-finite gradient; optimizer step skipped");
        m.set("skipped_steps", 1.0);
    }
    m.set("loss", loss);
    Some(loss)
}

/// `key value` pairs of the interesting metrics of a step, for the log.
fn show(m: &StepMetrics) -> String {
    let mut parts = Vec::new();
    for (k, v) in m.means() {
        if k == "lr" {
            parts.push(format!("lr {v:.3e}"));
        } else if k == "loss" || k.starts_with("eval/") || k == "train/accuracy" {
            parts.push(format!("{k} {v:.4}"));
        }
    }
    parts.join("  ")
}
