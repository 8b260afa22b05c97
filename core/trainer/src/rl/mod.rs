//! The RL host. One step is one generation batch, and reads as the modules below, in order:
//!
//! 1. [`prompts`]: the next prompts, `samples_per_prompt` rows each, a group id per prompt
//!    (stages 1–3 are run by [`sampling`], again with [`dynamic`] sampling until the groups differ);
//! 2. [`rollout`]: the actor samples responses; empty ones are dropped;
//! 3. [`score`]: every reward source scores every sample; the reward is their weighted sum
//!    (with DAPO's [`overlong`] length penalty when asked);
//! 4. [`experience`]: old-policy and reference log-probs and critic values (no gradients);
//! 5. [`advantages`]: the algorithm plugin's `prepare` turns rewards into advantages/returns
//!    (truncated responses then leave the loss with `rollout.overlong_filter`);
//! 6. [`optimise`]: `ppo_epochs` × minibatches of plugin loss (+ [`ptx`]) → backward → AdamW;
//! 7. metrics and checkpoints ([`state`]).
//!
//! [`setup`] builds a [`Trainer`] (plugins, models, optional [`warmup`], optimizers, resume).
//! With several data-parallel ranks, [`shard`] splits the batch for rollout, scoring and
//! experience, gathers the experience so stage 5 sees the whole batch, and stage 6 splits each
//! minibatch and sums the gradients; rank 0 alone writes the run's files.

pub mod advantages;
pub mod correction;
pub mod dynamic;
pub mod engine;
pub mod env_stage;
pub mod episode;
pub mod eval;
pub mod experience;
pub mod local_turns;
pub mod micro;
pub mod observed;
pub mod optimise;
pub mod overlong;
pub mod phase;
pub mod pipeline;
pub mod prompts;
pub mod ptx;
pub mod rollout;
pub mod rollout_log;
pub mod sampling;
pub mod score;
pub mod setup;
pub mod shard;
pub mod state;
pub mod visual;
pub mod warmup;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rlhf_collective::World;
use rlhf_generation::LogProbOptions;

use rlhf_models::{CausalLm, ScalarHeadModel};
use rlhf_tokenizer::HfTokenizer;
use tch::Device;

use crate::config::RlConfig;
use crate::data::{PromptDataset, SplitMix};
use crate::error::Result;
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::plugins::AlgorithmHandle;
use crate::progress::RunProgress;
use crate::train_engine::TrainEngine;
use eval::OnEngine;
use experience::Models;
use optimise::Learner;
use phase::PhaseClock;
use ptx::PtxData;
use score::RewardSource;

/// Where a finished run left its outputs.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub metrics_path: PathBuf,
    pub steps: usize,
    /// Final actor in Hugging Face format, when saved.
    pub actor_dir: Option<PathBuf>,
    /// Mean `reward` of the first and last 10 % of steps.
    pub reward_first: f64,
    pub reward_last: f64,
}

/// Everything a run holds.
pub struct Trainer {
    cfg: RlConfig,
    run_dir: PathBuf,
    /// Ownership of `run_dir` (set once the trainer is built); released when the trainer is dropped.
    _lock: Option<crate::run_lock::RunLock>,
    device: Device,
    tok: HfTokenizer,
    actor: CausalLm,
    reference: Option<CausalLm>,
    /// The reference's sharded decoder layers (`[distributed] shard_frozen`).
    ref_params: Option<crate::train_engine::stage3::Params>,
    critic: Option<ScalarHeadModel>,
    ema: Option<CausalLm>,
    algo: AlgorithmHandle,
    rewards: Vec<RewardSource>,
    data: PromptDataset,
    /// The prompts' images, when the policy reads images ([`visual`]).
    visual: Option<visual::Visual>,
    /// The tower is frozen and ungated: each prompt's features are computed once, kept with its
    /// patches ([`visual`]).
    frozen_features: bool,
    /// The reference's vision tower is the actor's (it may take the actor's features).
    ref_shares_vision: bool,
    /// The critic's vision tower is the actor's (both frozen, from the same weights).
    critic_shares_vision: bool,
    actor_opt: TrainEngine,
    critic_opt: Option<TrainEngine>,
    ptx: Option<PtxData>,
    metrics: Option<MetricsWriter>,
    step: usize,
    prompts_seen: usize,
    reward_history: Vec<f64>,
    wandb: Option<rlhf_wandb::WandbSink>,
    tensorboard: Option<crate::tensorboard::TensorboardSink>,
    progress: Option<RunProgress>,
    /// Who samples the responses (the trainer itself, or vLLM servers).
    engine: engine::Engine,
    /// The generation worker of asynchronous rollouts (`rollout.max_staleness > 0`).
    pipeline: Option<pipeline::Pipeline>,
    /// This process's rank among the data-parallel ranks (a world of one by default).
    world: Arc<World>,
    /// Held-out evaluation (`[eval]`), when configured.
    evaluator: Option<eval::Evaluator>,
    /// The environment of multi-turn episodes (`[environment]`), when configured.
    env: Option<episode::EnvRuntime>,
    /// Where a rank other than 0 writes what it must (a built-in model), removed at the end.
    _scratch: Option<crate::dist::Scratch>,
    /// The run's own files to open once every rank has set up (rank 0).
    run_files: Option<setup::RunFiles>,
    /// The step this process started from (the checkpoint's when resumed, else 0).
    resumed_at: usize,
    /// The prompt files read, with sizes and checksums ([`crate::data::identity`]).
    data_identity: Vec<serde_json::Value>,
}

/// The run stops after `idle` steps in a row that trained nothing; the message names the likely
/// cause from the last step's metrics.
fn idle_error(idle: usize, m: &StepMetrics) -> crate::error::TrainerError {
    let why = match (m.get("completions/scored"), m.get("skipped_steps"), m.get("reward"), m.get("reward_std")) {
        (Some(0.0), ..) => "no sample could be scored (see the reward sources' warnings)".to_string(),
        (None, ..) => "every response was empty".to_string(),
        (_, Some(k), Some(r), Some(sd)) if k > 0.0 && (r.abs() > 1e30 || sd > 1e30 || !r.is_finite()) => format!(
            "every optimizer step had a non-finite loss; the rewards are too large to train on (mean {r:e}, std \
             {sd:e}): scale the reward sources or their weights down"
        ),
        (_, Some(k), ..) if k > 0.0 => {
            "every optimizer step had a non-finite loss (see the warnings: a reward, a plugin's loss or the \
             learning rate)"
                .to_string()
        }
        _ => "no optimizer step ran".to_string(),
    };
    crate::error::TrainerError::Run(format!(
        "the last {idle} steps trained nothing: {why} (train.max_idle_steps = {idle})"
    ))
}

pub(crate) use crate::optim::seed_step;

impl Trainer {
    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Runs every remaining step (checkpointing every `checkpoint.every`), then writes the final
    /// checkpoint, the HF-format actor and the plots, and returns where things are.
    pub fn run(mut self) -> Result<RunSummary> {
        let total = self.cfg.train.steps;
        self.progress = Some(RunProgress::new(total as u64, self.step as u64, "step"));
        let result = self.run_steps();
        self.progress = None;
        let exit_code = i32::from(result.is_err());
        if let Err(e) = result {
            self.finish_wandb(exit_code);
            return Err(e);
        }
        if let Err(e) = self.check_ranks_identical() {
            self.finish_wandb(1);
            return Err(e);
        }
        let main = self.world.is_main();
        if self.cfg.checkpoint.at_end && self.step > 0 {
            self.save_checkpoint()?;
        }
        let actor_dir = if self.cfg.run.save_actor && main {
            let dir = self.run_dir.join("actor");
            self.actor.save(&dir)?;
            if let Some(e) = &self.ema {
                e.save(&self.run_dir.join("actor-ema"))?;
            }
            Some(dir)
        } else {
            None
        };
        if main {
            match rlhf_plot::plot_run(&self.run_dir, &self.run_dir.join("plots")) {
                Ok(files) => {
                    tracing::info!("plots: {} charts in {}", files.len(), self.run_dir.join("plots").display())
                }
                Err(e) => tracing::warn!("plots not written: {e}"),
            }
        }
        self.finish_wandb(0);
        let n = self.reward_history.len();
        let k = (n / 10).max(1).min(n.max(1));
        let mean = |xs: &[f64]| if xs.is_empty() { f64::NAN } else { xs.iter().sum::<f64>() / xs.len() as f64 };
        let metrics_path = self.run_dir.join("metrics.jsonl");
        Ok(RunSummary {
            metrics_path,
            run_dir: self.run_dir.clone(),
            steps: self.step,
            actor_dir,
            reward_first: mean(&self.reward_history[..k.min(n)]),
            reward_last: mean(&self.reward_history[n.saturating_sub(k)..]),
        })
    }

    fn run_steps(&mut self) -> Result<()> {
        // Steps in a row without an optimizer step.
        let mut idle = 0usize;
        if self.step == 0 {
            if let Some(m) = self.evaluate_if_due()? {
                self.record(&m)?;
            }
        }
        while self.step < self.cfg.train.steps {
            if let Some(sig) = crate::dist::stop_signal(&self.world)? {
                return Err(self.stopped_by(sig)?.into());
            }
            let optimizer_steps = self.actor_opt.steps();
            let mut m = self.train_step()?;
            idle = if self.actor_opt.steps() == optimizer_steps { idle + 1 } else { 0 };
            if let Some(e) = self.evaluate_if_due()? {
                for (k, v) in e.means() {
                    m.set(&k, v);
                }
            }
            self.record(&m)?;
            let show = |k: &str| m.get(k).map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
            if let Some(p) = &self.progress {
                p.step_done(format!("reward {} kl {}", show("reward"), show("kl")));
            }
            tracing::info!(
                "step {}/{}  reward {}  kl {}  loss/policy {}  len {}  {}s",
                self.step,
                self.cfg.train.steps,
                show("reward"),
                show("kl"),
                show("loss/policy"),
                show("completions/mean_length"),
                show("step_time"),
            );
            let every = self.cfg.checkpoint.every;
            if every > 0 && self.step.is_multiple_of(every) && self.step < self.cfg.train.steps {
                self.save_checkpoint()?;
            }
            let max_idle = self.cfg.train.max_idle_steps;
            if max_idle > 0 && idle >= max_idle {
                return Err(idle_error(idle, &m));
            }
        }
        Ok(())
    }

    /// Ends the run on signal `sig` between steps: the last finished step is checkpointed on every
    /// rank (unless the periodic checkpoint just did), so a resume repeats nothing and loses
    /// nothing; the message says where to continue.
    fn stopped_by(&mut self, sig: i32) -> Result<crate::signals::Stopped> {
        let name = crate::signals::name(sig);
        if self.step == self.resumed_at {
            let message = match self.step {
                0 => format!("stopped by {name} before the first step: nothing was trained"),
                s => {
                    format!("stopped by {name} before step {}: the run is as its checkpoint of step {s} left it", s + 1)
                }
            };
            return Ok(crate::signals::Stopped { signal: sig, message });
        }
        let every = self.cfg.checkpoint.every;
        let saved = if every > 0 && self.step.is_multiple_of(every) {
            crate::checkpoint::latest(&self.run_dir)?
        } else {
            self.save_checkpoint()?
        };
        let dir = saved.map(|d| d.display().to_string()).unwrap_or_else(|| "(written by rank 0)".into());
        Ok(crate::signals::Stopped {
            signal: sig,
            message: format!(
                "stopped by {name} after step {} of {}: checkpoint {dir}; continue with `rlhf train --resume {}`",
                self.step,
                self.cfg.train.steps,
                self.run_dir.display()
            ),
        })
    }

    /// Stage 4, **experience**: the old policy, reference and critic passes over this rank's
    /// `selected` rows ([`experience::compute`]), then the whole batch of every rank. When one
    /// epoch of one minibatch covers the batch (`batch_rows`) the actor's pass is kept for the loss
    /// instead of a second forward; at ZeRO stage 3 that pass runs on sharded weights (a collective
    /// every rank makes, so only when every rank has rows).
    fn experience(
        &mut self,
        mut selected: experience::Selected,
        batch_rows: usize,
        share_prompts: bool,
        pad: i64,
    ) -> Result<(experience::Batch, Option<tch::Tensor>, experience::ExperienceTimes)> {
        selected.images = self.images_of_tensor(&selected.records)?;
        let (cfg, t) = (&self.cfg, &self.cfg.train);
        // On data-parallel ranks each keeps its own pass and trains on its own rows (see
        // `shard::gather_batch`).
        let mut reuse = t.reuse_old_logprobs
            && t.ppo_epochs == 1
            && t.minibatch_size >= batch_rows
            && t.gradient_accumulation_steps <= 1
            && t.micro_batch_tokens.is_none() // the training passes run per micro-batch
            && cfg.model.lora.dropout == 0.0;
        let stage3 = self.actor_opt.strategy() == crate::train_engine::Strategy::ShardedParams;
        // Passes on sharded weights are collectives: a rank without rows makes none, so they run
        // only when every rank has rows (whole weights otherwise).
        let mut every_rank_has_rows =
            if stage3 { crate::dist::all(&self.world, selected.action_mask.size()[0] > 0)? } else { true };
        reuse &= every_rank_has_rows;
        // With a token budget the passes run in micro-batches, as many on every rank at stage 3;
        // one some rank has no rows of runs the reference on whole weights too.
        let lengths = micro::row_lengths(&selected.attention_mask, t.micro_batch_tokens)?;
        let groups = micro::Groups::of(
            &selected.group_ids,
            &selected.attention_mask,
            selected.prompt_len,
            t.micro_batch_tokens,
            share_prompts,
        )?;
        let (micro, all_have_rows) =
            micro::experience_plan(&self.world, &lengths, &groups, t.micro_batch_tokens, stage3)?;
        every_rank_has_rows &= all_have_rows;
        let ref_whole = self.ref_params.as_ref().filter(|_| !every_rank_has_rows);
        if let Some(p) = ref_whole {
            p.gather_all()?;
        }
        let opts = LogProbOptions {
            max_chunk_elements: t.logprob_chunk_elements,
            entropy: true,
            share_prefix: share_prompts,
            pack: t.padding_free,
            pack_width: 0,
        };
        let models = Models {
            actor: &self.actor,
            reference: self.reference.as_ref(),
            critic: self.critic.as_ref(),
            ref_shares_vision: self.ref_shares_vision,
            critic_shares_vision: self.critic_shares_vision,
        };
        let entropy_grad = self.algo.requirements().entropy;
        let shard_actor = if reuse && stage3 { Some(&mut self.actor_opt) } else { None };
        let passes = experience::Passes { reuse, checkpointing: t.gradient_checkpointing, shard_actor };
        let (exp, entropy, times) =
            experience::compute_in_micro_batches(&models, selected, opts, self.device, passes, entropy_grad, micro)?;
        if let Some(p) = ref_whole {
            p.shard()?;
        }
        let (mut exp, entropy) = shard::gather_batch(&self.world, exp, entropy, pad)?;
        if self.world.is_distributed() {
            exp.images = self.images_of_tensor(&exp.records)?;
        }
        Ok((exp, entropy, times))
    }

    /// One generation batch, stage by stage (see the module docs). Returns its metrics.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let t0 = Instant::now();
        let comm0 = self.world.stats();
        let mut m = StepMetrics::default();
        let (cfg, device) = (&self.cfg, self.device);
        seed_step(cfg.run.seed, self.step);
        let (pad, eos_ids) = (i64::from(self.tok.pad_token_id()), self.eos_ids());

        // 1–3. Prompts, rollout and scores (more than one generation batch with dynamic sampling).
        let (n_prompts, g) = (cfg.rollout.prompts_per_batch, cfg.rollout.samples_per_prompt);
        let Some(sampled) = self.sample_and_score(&eos_ids, pad, &mut m)? else {
            return Ok(self.end_empty_step(m, t0));
        };
        let (reward_mean, reward_std) = score::mean_std(&sampled.rewards);
        m.set("reward", reward_mean);
        m.set("reward_std", reward_std);
        self.reward_history.push(reward_mean);
        let (t_gen, t_score) = (sampled.t_gen, sampled.t_score);
        let cfg = &self.cfg;

        // 4. Experience of this rank's samples, then the whole batch on every rank.
        let share_prompts = cfg.train.share_prompts && cfg.model.lora.dropout == 0.0;
        let (mut exp, entropy, times) = self.experience(sampled.selected, n_prompts * g, share_prompts, pad)?;
        let cfg = &self.cfg;
        experience::metrics(&exp, entropy.as_ref(), &mut m)?;
        if cfg.run.save_rollouts && self.world.is_main() {
            let rewards = match sampled.in_batch_order {
                true => sampled.rewards,
                false => Vec::<f32>::try_from(&exp.rewards)?.into_iter().map(f64::from).collect(),
            };
            let version = m.get("rollout/policy_version").map(|v| v as usize);
            rollout_log::write(&self.run_dir, self.step + 1, &self.tok, &exp, &rewards, version)?;
        }

        // 5. Advantages.
        let mut prepared = advantages::prepare(&mut self.algo, &exp, self.actor_opt.steps() as u64, &mut m)?;
        let behavior = exp.behavior_logprobs.as_ref();
        let adv = prepared.advantages.shallow_clone();
        prepared.advantages =
            correction::apply(&cfg.rollout.is_correction, &exp.old_logprobs, behavior, &exp.action_mask, adv, &mut m)?;
        if cfg.rollout.overlong_filter {
            overlong::filter(&mut exp, cfg.rollout.max_new_tokens, &eos_ids, &mut m)?;
        }

        // 6–7. Minibatch losses and optimizer steps.
        let clock = PhaseClock::start(device);
        let learner = Learner {
            actor: &self.actor,
            actor_opt: &mut self.actor_opt,
            critic: self.critic.as_ref().zip(self.critic_opt.as_mut()),
            ema: self.ema.as_ref().zip(cfg.train.ema_decay),
            ptx: self.ptx.as_ref(),
            world: &self.world,
            share_prompts,
            critic_shares_vision: self.critic_shares_vision,
        };
        let rng = SplitMix(cfg.run.seed ^ (self.step as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        let req = self.algo.requirements();
        let progress = self.progress.as_ref();
        optimise::optimise(
            learner,
            &mut self.algo,
            req,
            &exp,
            &prepared,
            &cfg.train,
            rng,
            self.step + 1,
            progress,
            &mut m,
        )?;
        let t_train = clock.stop();
        crate::dist::expert_load_metrics(&self.world, &self.actor, &mut m)?;

        self.step += 1;
        let step_time = t0.elapsed().as_secs_f64();
        let generated = exp.action_mask.f_sum(tch::Kind::Float)?.double_value(&[]);
        m.set("step_time", step_time);
        m.set("tokens_per_s", generated / step_time.max(1e-9));
        t_gen.record("generate", &mut m);
        t_score.record("score", &mut m);
        times.old_logprobs.record("old_logprobs", &mut m);
        times.reference.record("reference", &mut m);
        times.values.record("values", &mut m);
        t_train.record("train", &mut m);
        if let Some(p) = &mut self.pipeline {
            p.step_metrics(step_time, &mut m);
        }
        crate::dist::comm_metrics(&self.world, comm0, &mut m);
        Ok(m)
    }

    /// The step's row of `metrics.jsonl` and its W&B log.
    fn record(&mut self, m: &StepMetrics) -> Result<()> {
        if let Some(w) = &mut self.metrics {
            w.write(self.step, m)?;
        }
        if let Some(sink) = &self.wandb {
            crate::sinks::log_wandb(sink, self.step, m);
        }
        if let Some(tb) = &mut self.tensorboard {
            tb.record(self.step, m);
        }
        Ok(())
    }

    /// Held-out evaluation of the policy as of `self.step`, when `[eval]` asks for one now.
    fn evaluate_if_due(&mut self) -> Result<Option<StepMetrics>> {
        let (pad, eos_ids) = (i64::from(self.tok.pad_token_id()), self.eos_ids());
        if self.evaluator.as_ref().is_some_and(|e| e.due(self.step, self.cfg.train.steps)) {
            // The servers sample the next step's batch at its version until it is in.
            self.drain_servers()?;
        }
        let Some(evaluator) = self.evaluator.as_mut().filter(|e| e.due(self.step, self.cfg.train.steps)) else {
            return Ok(None);
        };
        if let Some(p) = &self.progress {
            p.phase("eval", 1);
        }
        let samples = self.run_dir.join("eval").join(format!("step-{}.jsonl", self.step));
        // On vLLM the servers answer (synced to this policy first); the local engine's bf16 decode
        // copy does not: the evaluation scores the trained policy itself.
        let engine = self.engine.is_external().then(|| OnEngine {
            engine: &mut self.engine,
            version: self.actor_opt.steps(),
            probe: &self.data.records[0].ids,
        });
        let m = evaluator.evaluate(
            &self.actor,
            engine,
            &self.tok,
            &eos_ids,
            pad,
            &self.world,
            Some(&samples),
            self.step,
        )?;
        tracing::info!(
            "eval at step {}: reward {:.4}  pass@1 {:.4}",
            self.step,
            m.get("eval/reward/mean").unwrap_or(f64::NAN),
            m.get("eval/pass@1").unwrap_or(f64::NAN)
        );
        Ok(Some(m))
    }

    /// Checks that every rank ends with bit-identical trained weights (they take the same steps
    /// on the same summed gradients; a difference means a bug or a broken collective).
    fn check_ranks_identical(&self) -> Result<()> {
        self.actor_opt.check_identical(&self.world, "actor")?;
        if let Some(o) = &self.critic_opt {
            o.check_identical(&self.world, "critic")?;
        }
        Ok(())
    }

    /// EOS ids of the tokenizer.
    fn eos_ids(&self) -> Vec<i64> {
        self.tok.eos_token_ids().iter().map(|&i| i64::from(i)).collect()
    }

    /// A step with nothing to train on still counts (its metrics say why).
    fn end_empty_step(&mut self, mut m: StepMetrics, t0: Instant) -> StepMetrics {
        self.step += 1;
        m.set("step_time", t0.elapsed().as_secs_f64());
        m
    }
}
