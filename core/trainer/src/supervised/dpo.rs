//! Direct Preference Optimization: a causal LM trained on preference pairs ([`crate::pairs`], read
//! as `rlhf rm` reads them, each side split into prompt and response by
//! [`build_split_pairs`]) with the losses of TRL (`train.loss_type`, see [`dpo_loss`]). The
//! log-prob of a response is the sum of its tokens' log-probs (the prompt's are not counted).
//! Chosen and rejected sides run in one forward pass (`[2B, T]`, chosen rows first).
//!
//! The reference (`model.reference`): `policy`, a frozen copy of the starting weights — with LoRA
//! (`lora.rank > 0`) the policy itself with its adapters switched off
//! ([`CausalLm::with_adapters_disabled`]), no second copy; a model directory; or `precomputed`,
//! the starting policy's log-probs of every train and eval pair computed once before training (no
//! reference forward passes during training). SimPO needs none.
//!
//! Metrics (TRL's names): `rewards/chosen`, `rewards/rejected` (β·(π − π_ref), SimPO: β·π̄),
//! `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, `loss`; on the eval
//! split the same under `eval/`, with `eval/accuracy` the fraction of pairs whose implicit reward
//! of chosen exceeds rejected's, and `eval/logps_accuracy` the fraction whose policy log-prob
//! (summed over the response) of chosen exceeds rejected's.

use std::path::{Path, PathBuf};

use rlhf_generation::{token_logprobs_pass, LogProbOptions, LogProbPass};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

use super::dpo_batch::{collate, DpoBatch};
use super::pairs::{build_split_pairs, pair_sets, PairOptions, SplitPair};
use super::phase::{finite, lora_error, resolve_model_dir, total_steps, write_summary};
use super::run_loop::{begin_phase, run_phase, Begun, MicroOut, PhaseTask};
pub use crate::config::{DpoConfig, DpoLossType, DpoModelConfig, DpoTrainConfig};
use rlhf_collective::World;

use crate::checkpoint::Loaded;
use crate::dist;
use crate::error::{Result, TrainerError};
use crate::metrics::StepMetrics;
use crate::router_aux::with_router_aux_loss;
use crate::train_engine::TrainEngine;

/// The settings of [`dpo_loss`].
#[derive(Debug, Clone, Copy)]
pub struct DpoLossParams {
    pub loss_type: DpoLossType,
    pub beta: f64,
    pub label_smoothing: f64,
    pub simpo_gamma: f64,
}

impl DpoLossParams {
    /// The loss settings of a `[train]` section.
    pub fn of(t: &DpoTrainConfig) -> Self {
        DpoLossParams {
            loss_type: t.loss_type,
            beta: t.beta,
            label_smoothing: t.label_smoothing,
            simpo_gamma: t.simpo_gamma,
        }
    }

    /// IPO and SimPO work on log-probs averaged over the response tokens (TRL).
    pub fn averages(&self) -> bool {
        matches!(self.loss_type, DpoLossType::Ipo | DpoLossType::Simpo)
    }
}

/// Per-pair losses and implicit rewards of [`dpo_loss`].
#[derive(Debug)]
pub struct DpoLossOut {
    /// `[B]`: each pair's loss (the batch loss is their mean).
    pub losses: Tensor,
    /// `[B]`, detached: the implicit rewards.
    pub chosen_rewards: Tensor,
    pub rejected_rewards: Tensor,
    /// `[B]`, detached: the log-probs the loss used (averaged for IPO and SimPO).
    pub chosen_logps: Tensor,
    pub rejected_logps: Tensor,
}

/// −log σ(x) = softplus(−x), stable for large |x|.
fn neg_logsigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_neg()?.f_softplus()?)
}

/// `−(1−ε)·log σ(βx) − ε·log σ(−βx)`.
fn smoothed(x: &Tensor, beta: f64, eps: f64) -> Result<Tensor> {
    let bx = x.f_mul_scalar(beta)?;
    let l = neg_logsigmoid(&bx)?.f_mul_scalar(1.0 - eps)?;
    if eps == 0.0 {
        return Ok(l);
    }
    Ok(l.f_add(&neg_logsigmoid(&bx.f_neg()?)?.f_mul_scalar(eps)?)?)
}

/// The preference losses of TRL (`DPOTrainer.dpo_loss` in trl/trainer/dpo_trainer.py; SimPO from
/// `CPOTrainer.cpo_loss` in trl/trainer/cpo_trainer.py), from the summed response log-probs of
/// the policy (`chosen_logps`, `rejected_logps`) and the reference, and the response lengths. With
/// `π`, `π_ref` the log-probs (divided by the length for `ipo` and `simpo`, as TRL's
/// `concatenated_forward` averages them for those losses) and `x = (π_c − π_r) − (π_ref_c − π_ref_r)`:
/// - `sigmoid` (DPO, cDPO): `−(1−ε)·log σ(βx) − ε·log σ(−βx)`
/// - `ipo`: `(x − 1/(2β))²`
/// - `simpo` (reference-free): with `y = (π̄_c − π̄_r) − γ/β`, `−(1−ε)·log σ(βy) − ε·log σ(−βy)`,
///   i.e. `−log σ(β·(π̄_c − π̄_r) − γ)` at ε = 0 (`γ` = `simpo_gamma`)
///
/// Rewards: `β·(π − π_ref)` (SimPO: `β·π̄`), detached.
///
/// # Shapes
/// - every tensor `[B]` (lengths as floats) → per-pair values `[B]`
pub fn dpo_loss(
    p: &DpoLossParams,
    chosen_logps: &Tensor,
    rejected_logps: &Tensor,
    reference: Option<(&Tensor, &Tensor)>,
    chosen_lens: &Tensor,
    rejected_lens: &Tensor,
) -> Result<DpoLossOut> {
    let norm = |lp: &Tensor, len: &Tensor| -> Result<Tensor> {
        Ok(if p.averages() { lp.f_div(len)? } else { lp.shallow_clone() })
    };
    let (c, r) = (norm(chosen_logps, chosen_lens)?, norm(rejected_logps, rejected_lens)?);
    let (losses, chosen_rewards, rejected_rewards) = match p.loss_type {
        DpoLossType::Sigmoid | DpoLossType::Ipo => {
            let (rc, rr) = reference.ok_or_else(|| TrainerError::Run("dpo_loss: the loss needs a reference".into()))?;
            let (rc, rr) = (norm(rc, chosen_lens)?, norm(rr, rejected_lens)?);
            let x = c.f_sub(&r)?.f_sub(&rc.f_sub(&rr)?)?;
            let losses = match p.loss_type {
                DpoLossType::Ipo => x.f_sub_scalar(1.0 / (2.0 * p.beta))?.f_square()?,
                _ => smoothed(&x, p.beta, p.label_smoothing)?,
            };
            (losses, c.f_sub(&rc)?.f_mul_scalar(p.beta)?, r.f_sub(&rr)?.f_mul_scalar(p.beta)?)
        }
        DpoLossType::Simpo => {
            let y = c.f_sub(&r)?.f_sub_scalar(p.simpo_gamma / p.beta)?;
            (smoothed(&y, p.beta, p.label_smoothing)?, c.f_mul_scalar(p.beta)?, r.f_mul_scalar(p.beta)?)
        }
    };
    Ok(DpoLossOut {
        losses,
        chosen_rewards: chosen_rewards.f_detach()?,
        rejected_rewards: rejected_rewards.f_detach()?,
        chosen_logps: c.f_detach()?,
        rejected_logps: r.f_detach()?,
    })
}

/// Summed response log-probs of every row, `([B] chosen, [B] rejected)`; padding-free with
/// `pack` (`train.padding_free`).
fn response_logps(model: &CausalLm, b: &DpoBatch, pack: bool) -> Result<(Tensor, Tensor)> {
    Ok(response_logps_pass(model, b, false, pack)?.logps)
}

/// A training pass over a batch of pairs.
struct PolicyPass {
    /// Summed response log-probs, `([B] chosen, [B] rejected)`.
    logps: (Tensor, Tensor),
    /// The load-balancing loss where the model computes it.
    aux: Option<Tensor>,
    /// To hand to [`LogProbPass::backward`] once the loss is backpropagated.
    pass: LogProbPass,
}

/// [`response_logps`] as a training pass, checkpointed when `checkpointed`
/// (`train.gradient_checkpointing`). With `pack` the rows run without their padding
/// ([`LogProbOptions::pack`]; each pair's two rows packed whole).
fn response_logps_pass(model: &CausalLm, b: &DpoBatch, checkpointed: bool, pack: bool) -> Result<PolicyPass> {
    let opts = LogProbOptions {
        pack,
        share_prefix: b.pack_width.is_some(),
        pack_width: b.pack_width.unwrap_or(0),
        ..LogProbOptions::default()
    };
    let (lp, pass) = token_logprobs_pass(model, &b.input_ids, &b.attention_mask, b.from, opts, checkpointed)?;
    let sums = lp.logprobs.f_mul(&b.response_mask)?.f_sum_dim_intlist(1, false, Kind::Float)?; // [2B]
    let n = sums.size()[0] / 2;
    Ok(PolicyPass { logps: (sums.f_narrow(0, 0, n)?, sums.f_narrow(0, n, n)?), aux: lp.aux_loss, pass })
}

/// Where the reference log-probs come from.
enum Reference {
    /// SimPO: none.
    Free,
    /// A frozen model.
    Model(Box<CausalLm>),
    /// The policy with its LoRA adapters switched off.
    Adapters,
    /// Per train / eval pair, `(chosen, rejected)` summed log-probs of the starting policy.
    Precomputed { train: Vec<(f32, f32)>, eval: Vec<(f32, f32)> },
}

#[derive(Clone, Copy)]
enum Split {
    Train,
    Eval,
}

struct DpoTask {
    policy: CausalLm,
    reference: Reference,
    train: Vec<SplitPair>,
    eval: Vec<SplitPair>,
    pad: i64,
    params: DpoLossParams,
    eval_batch_size: usize,
    /// `train.gradient_checkpointing`.
    checkpointing: bool,
    /// `train.padding_free`.
    padding_free: bool,
    /// Each pair's prompt laid once in the padding-free passes ([`pair_passes`]).
    share_prompts: bool,
}

/// The passes' layout: padding-free (`train.padding_free`), and then with each prompt laid once
/// for the rows that hold it (`train.share_prompts`, unless LoRA dropout makes a prompt's
/// activations differ from row to row).
fn pair_passes(cfg: &DpoConfig) -> (bool, bool) {
    let pack = cfg.train.padding_free;
    (pack, pack && cfg.train.share_prompts && cfg.model.lora.dropout == 0.0)
}

/// Summed log-probs of `pairs` under `model`, without gradients, `eval_batch_size` at a time
/// (padding-free with `pack`, each shared prompt laid once with `share_prompts`).
fn all_logps(
    model: &CausalLm,
    pairs: &[SplitPair],
    batch_size: usize,
    pad: i64,
    (pack, share_prompts): (bool, bool),
) -> Result<Vec<(f32, f32)>> {
    let mut out = Vec::with_capacity(pairs.len());
    tch::no_grad(|| -> Result<()> {
        for chunk in pairs.chunks(batch_size.max(1)) {
            let refs: Vec<&SplitPair> = chunk.iter().collect();
            let (c, r) = response_logps(model, &collate(&refs, pad, model.device(), share_prompts)?, pack)?;
            out.extend(Vec::<f32>::try_from(&c)?.into_iter().zip(Vec::<f32>::try_from(&r)?));
        }
        Ok(())
    })?;
    Ok(out)
}

impl DpoTask {
    /// The loss of the pairs `items` of `split` (with gradients when `no_grad` is not active), the
    /// policy's summed response log-probs (chosen, rejected; detached), the batch's tokens, and
    /// with `train.gradient_checkpointing` on the train split the policy's checkpointed pass.
    #[allow(clippy::type_complexity)]
    fn forward(&self, split: Split, items: &[usize]) -> Result<(DpoLossOut, (Tensor, Tensor), usize, PolicyPass)> {
        let pairs = match split {
            Split::Train => &self.train,
            Split::Eval => &self.eval,
        };
        let batch: Vec<&SplitPair> = items.iter().map(|&i| &pairs[i]).collect();
        let b = collate(&batch, self.pad, self.policy.device(), self.share_prompts)?;
        let checkpointed = self.checkpointing && matches!(split, Split::Train);
        let pack = self.padding_free;
        let policy = response_logps_pass(&self.policy, &b, checkpointed, pack)?;
        let (c, r) = &policy.logps;
        let reference = match &self.reference {
            Reference::Free => None,
            Reference::Model(m) => Some(tch::no_grad(|| response_logps(m, &b, pack))?),
            Reference::Adapters => {
                Some(tch::no_grad(|| self.policy.with_adapters_disabled(|| response_logps(&self.policy, &b, pack)))?)
            }
            Reference::Precomputed { train, eval } => {
                let table = match split {
                    Split::Train => train,
                    Split::Eval => eval,
                };
                let (rc, rr): (Vec<f32>, Vec<f32>) = items.iter().map(|&i| table[i]).unzip();
                let dev = self.policy.device();
                Some((Tensor::f_from_slice(&rc)?.f_to_device(dev)?, Tensor::f_from_slice(&rr)?.f_to_device(dev)?))
            }
        };
        let refs = reference.as_ref().map(|(a, b)| (a, b));
        let out = dpo_loss(&self.params, c, r, refs, &b.chosen_lens, &b.rejected_lens)?;
        let detached = (c.f_detach()?, r.f_detach()?);
        Ok((out, detached, b.tokens, policy))
    }
}

/// Adds one observation per pair of the TRL metrics, under `prefix` (`""` or `"eval/"`).
fn record(out: &DpoLossOut, prefix: &str, m: &mut StepMetrics) -> Result<()> {
    let v = |t: &Tensor| -> Result<Vec<f32>> { Ok(Vec::<f32>::try_from(&t.f_to_kind(Kind::Float)?)?) };
    let (rc, rr) = (v(&out.chosen_rewards)?, v(&out.rejected_rewards)?);
    let (lc, lr) = (v(&out.chosen_logps)?, v(&out.rejected_logps)?);
    for i in 0..rc.len() {
        m.add(&format!("{prefix}rewards/chosen"), f64::from(rc[i]));
        m.add(&format!("{prefix}rewards/rejected"), f64::from(rr[i]));
        m.add(&format!("{prefix}rewards/accuracies"), f64::from(u8::from(rc[i] > rr[i])));
        m.add(&format!("{prefix}rewards/margins"), f64::from(rc[i] - rr[i]));
        m.add(&format!("{prefix}logps/chosen"), f64::from(lc[i]));
        m.add(&format!("{prefix}logps/rejected"), f64::from(lr[i]));
    }
    Ok(())
}

impl PhaseTask for DpoTask {
    fn weight(&self, items: &[usize]) -> f64 {
        items.len() as f64
    }

    fn trains_sharded(&self) -> bool {
        // The policy with its adapters off is the reference: a forward that is not checkpointed.
        !matches!(self.reference, Reference::Adapters)
    }

    fn micro_step(&mut self, items: &[usize], total_weight: f64, m: &mut StepMetrics) -> Result<Option<MicroOut>> {
        self.policy.set_training(true);
        let (out, _, tokens, policy) = self.forward(Split::Train, items)?;
        let sum = out.losses.f_sum(Kind::Float)?; // scalar
        let value = sum.double_value(&[]);
        let share = items.len() as f64 / total_weight;
        let loss = with_router_aux_loss(sum.f_div_scalar(total_weight)?, policy.aux.as_ref(), &self.policy, share, m)?;
        if value.is_finite() {
            loss.f_backward()?;
        }
        // Also without a loss: a sharded model's pass gathers and reduces with the other ranks.
        policy.pass.backward(&self.policy)?;
        if !value.is_finite() {
            return Ok(None);
        }
        record(&out, "", m)?;
        Ok(Some(MicroOut { loss_sum: value, tokens }))
    }

    fn trained_vars(&self) -> &tch::nn::VarStore {
        &self.policy.vs
    }

    fn evaluate(&mut self) -> Result<Option<StepMetrics>> {
        self.policy.set_training(false);
        if self.eval.is_empty() {
            return Ok(None);
        }
        let mut m = StepMetrics::default();
        let (mut loss, mut logps_correct) = (0f64, 0f64);
        let all: Vec<usize> = (0..self.eval.len()).collect();
        tch::no_grad(|| -> Result<()> {
            for chunk in all.chunks(self.eval_batch_size.max(1)) {
                let (out, (c, r), _, _) = self.forward(Split::Eval, chunk)?;
                loss += out.losses.f_sum(Kind::Double)?.double_value(&[]);
                record(&out, "eval/", &mut m)?;
                logps_correct += c.f_gt_tensor(&r)?.f_sum(Kind::Double)?.double_value(&[]);
            }
            Ok(())
        })?;
        let n = self.eval.len() as f64;
        let acc = m.get("eval/rewards/accuracies").unwrap_or(0.0);
        m.set("eval/accuracy", acc);
        m.set("eval/logps_accuracy", logps_correct / n);
        m.set("eval/loss", loss / n);
        Ok(Some(m))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        Ok(self.policy.save(dir)?)
    }
}

/// Where a finished DPO run left its outputs.
#[derive(Debug, Clone)]
pub struct DpoSummary {
    pub run_dir: PathBuf,
    pub metrics_path: PathBuf,
    /// The final policy (Hugging Face format, LoRA merged).
    pub model_dir: PathBuf,
    pub steps: usize,
    pub train_pairs: usize,
    pub eval_pairs: usize,
    /// Eval preference accuracy (implicit reward) before the first and after the last step.
    pub eval_accuracy_before: Option<f64>,
    pub eval_accuracy_after: Option<f64>,
    /// Eval accuracy of the policy's own log-probs, before and after.
    pub eval_logps_accuracy_before: Option<f64>,
    pub eval_logps_accuracy_after: Option<f64>,
    pub loss_first: f64,
    pub loss_last: f64,
}

/// Trains a policy with DPO (or IPO, SimPO) as configured. The data files are read before the run
/// directory is created; the run owns the directory (its lock) until it returns.
pub fn run_dpo(cfg: DpoConfig, world: &World, resume: Option<&Loaded>) -> Result<DpoSummary> {
    begin_phase(world, &cfg, resume, |run_dir, begun| dpo_in(&cfg, run_dir, begun, world, resume))
}

/// The reference of `model.reference` (before the policy gets its adapters): none for SimPO,
/// the policy's log-probs of every pair computed once (`precomputed`), the policy with its
/// adapters off (`policy` with LoRA), or a frozen model (`policy`'s weights, or a path or Hub id).
fn reference_of(
    cfg: &DpoConfig,
    policy: &CausalLm,
    model_dir: &Path,
    (train, eval): (&[SplitPair], &[SplitPair]),
    pad: i64,
    device: Device,
    kind: Kind,
) -> Result<Reference> {
    let batch = cfg.train.common().eval_batch_size;
    Ok(match (cfg.train.loss_type, cfg.model.reference.as_str()) {
        (DpoLossType::Simpo, _) => Reference::Free,
        (_, "precomputed") => {
            policy.set_training(false);
            Reference::Precomputed {
                train: all_logps(policy, train, batch, pad, pair_passes(cfg))?,
                eval: all_logps(policy, eval, batch, pad, pair_passes(cfg))?,
            }
        }
        (_, "policy") if cfg.model.lora.enabled() => Reference::Adapters,
        (_, spec) => {
            let dir = if spec == "policy" {
                model_dir.to_path_buf()
            } else {
                crate::model_source::resolve(spec, "model.reference")?
            };
            if !dir.is_dir() {
                return Err(TrainerError::Config(format!("model.reference: {spec}: model directory not found")));
            }
            let mut m = CausalLm::from_dir(&dir, device, kind)?;
            if m.arch().vocab_size != policy.arch().vocab_size {
                return Err(TrainerError::Config(format!(
                    "model.reference: {spec}: vocabulary of {} tokens, the policy's has {}",
                    m.arch().vocab_size,
                    policy.arch().vocab_size
                )));
            }
            m.freeze();
            Reference::Model(Box::new(m))
        }
    })
}

fn dpo_in(cfg: &DpoConfig, run_dir: &Path, begun: Begun, world: &World, resume: Option<&Loaded>) -> Result<DpoSummary> {
    let Begun { device, kind, splits, shared } = begun;
    let run_dir = run_dir.to_path_buf();
    let model_dir = resolve_model_dir(&cfg.model.path, &run_dir, cfg.run.seed)?;
    let tok = crate::model_source::tokenizer(&model_dir, &cfg.data.chat_template_kwargs)?;
    let d = &cfg.data;
    let opts = PairOptions::of(d);
    let (train, eval) = pair_sets(&splits, |src, report| build_split_pairs(src, &tok, &opts, report))?;
    let mut policy = CausalLm::from_dir(&model_dir, device, kind)?;
    tok.check_fits_vocab(policy.arch().vocab_size)?;
    let t = &cfg.train.common();
    let pad = i64::from(tok.pad_token_id());
    let reference = reference_of(cfg, &policy, &model_dir, (&train, &eval), pad, device, kind)?;
    if policy.apply_lora(&cfg.model.lora).map_err(|e| lora_error("config", e))? > 0 {
        let (t, n) = rlhf_models::lora::parameter_counts(&policy.vs);
        tracing::info!("LoRA: {t} of {n} parameters train");
    }
    let total = total_steps(train.len(), t);
    crate::supervised::phase::continue_run(&run_dir, cfg, resume, total)?;
    dist::broadcast_weights(world, &policy.vs)?;
    let mut opt = TrainEngine::new(&policy.vs, &t.optim(), total, cfg.distributed.strategy(), world)?;
    policy.set_gate(opt.gate());
    tracing::info!(
        "dpo: {} train pairs, {} eval pairs, {total} optimizer steps, loss {:?}, beta {}, reference {}, run dir {}",
        train.len(),
        eval.len(),
        cfg.train.loss_type,
        cfg.train.beta,
        match reference {
            Reference::Free => "none",
            Reference::Adapters => "the policy with LoRA adapters off",
            _ => cfg.model.reference.as_str(),
        },
        run_dir.display()
    );
    let (run, mut sinks) = crate::supervised::state::open(
        "dpo",
        cfg,
        cfg.run.seed,
        (&run_dir, &shared),
        world,
        &cfg.checkpoint,
        (&cfg.wandb, &cfg.tensorboard),
        &cfg.data.train,
        resume,
    )?;
    let (train_pairs, eval_pairs) = (train.len(), eval.len());
    let mut task = DpoTask {
        policy,
        reference,
        train,
        eval,
        pad,
        params: DpoLossParams::of(&cfg.train),
        eval_batch_size: t.eval_batch_size,
        checkpointing: t.gradient_checkpointing,
        padding_free: cfg.train.padding_free,
        share_prompts: pair_passes(cfg).1,
    };
    let s = run_phase(&mut task, train_pairs, t, &mut opt, &run, &mut sinks)?;
    let get = |m: &Option<StepMetrics>, k: &str| m.as_ref().and_then(|m| m.get(k));
    let summary = DpoSummary {
        run_dir: run_dir.clone(),
        metrics_path: sinks.path().to_path_buf(),
        model_dir: s.model_dir,
        steps: s.steps,
        train_pairs,
        eval_pairs,
        eval_accuracy_before: get(&s.eval_before, "eval/accuracy"),
        eval_accuracy_after: get(&s.eval_after, "eval/accuracy"),
        eval_logps_accuracy_before: get(&s.eval_before, "eval/logps_accuracy"),
        eval_logps_accuracy_after: get(&s.eval_after, "eval/logps_accuracy"),
        loss_first: s.loss_first,
        loss_last: s.loss_last,
    };
    write_summary(
        &run_dir,
        &serde_json::json!({
            "phase": "dpo",
            "loss_type": cfg.train.loss_type,
            "steps": summary.steps,
            "train_pairs": train_pairs,
            "eval_pairs": eval_pairs,
            "eval_accuracy_before": summary.eval_accuracy_before,
            "eval_accuracy_after": summary.eval_accuracy_after,
            "eval_logps_accuracy_before": summary.eval_logps_accuracy_before,
            "eval_logps_accuracy_after": summary.eval_logps_accuracy_after,
            "loss_first": finite(summary.loss_first),
            "loss_last": finite(summary.loss_last),
            "model_dir": summary.model_dir,
        }),
    )?;
    Ok(summary)
}
