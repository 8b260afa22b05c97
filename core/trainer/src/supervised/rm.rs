//! Reward-model training (DeepSpeed-Chat phase 2): a scalar head on a causal-LM backbone
//! ([`ScalarHeadModel::from_causal_lm_dir`], a fresh `score` head) trained on preference pairs
//! ([`crate::pairs`]) with the pairwise ranking loss — DSC's divergent-segment mean by default,
//! `loss = "last_token"` for the TRL/OpenRLHF form. Chosen and rejected sides run in one forward
//! pass (`[2B, T]`, chosen rows first, as DSC's collator). Evaluation: accuracy (chosen score >
//! rejected score, scores read at the last real token), mean chosen and rejected scores and the eval
//! loss. Saved in the `*ForSequenceClassification` layout that the `reward-model` plugin,
//! `rlhf serve-reward` and transformers load.

use std::path::{Path, PathBuf};

use rlhf_models::{Checkpointed, ScalarHeadModel};
use tch::{Kind, Tensor};

use super::pairs::{build_pairs, collate_pairs, pair_sets, pairwise_loss, PairExample, PairLoss, PairOptions, RmLoss};
use super::phase::{finite, lora_error, resolve_model_dir, total_steps, write_summary};
use super::run_loop::{begin_phase, run_phase, Begun, MicroOut, PhaseTask};
pub use crate::config::{RmConfig, RmDataConfig, RmTrainConfig};
use rlhf_collective::World;

use crate::checkpoint::Loaded;
use crate::dist;
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::train_engine::TrainEngine;

/// Where a finished reward-model run left its outputs.
#[derive(Debug, Clone)]
pub struct RmSummary {
    pub run_dir: PathBuf,
    pub metrics_path: PathBuf,
    /// The final reward model (`*ForSequenceClassification`).
    pub model_dir: PathBuf,
    pub steps: usize,
    pub train_pairs: usize,
    pub eval_pairs: usize,
    /// Eval accuracy before the first and after the last step.
    pub eval_accuracy_before: Option<f64>,
    pub eval_accuracy_after: Option<f64>,
    /// Mean eval chosen / rejected scores after the last step.
    pub eval_chosen_score: Option<f64>,
    pub eval_rejected_score: Option<f64>,
    pub loss_first: f64,
    pub loss_last: f64,
}

/// How the reward model's passes run: `train.gradient_checkpointing`, `train.padding_free`.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassOptions {
    pub checkpointing: bool,
    pub padding_free: bool,
}

/// Values of both sides of a batch and the loss; with `checkpointing` from a checkpointed pass,
/// returned for [`ScalarHeadModel::backward_checkpointed`] once the loss is backpropagated. With
/// `padding_free` the rows run packed ([`ScalarHeadModel::values_pass_packed`]; 0 at the padding).
///
/// # Shapes
/// - `pairs.len() = B` → per-pair losses and scores `[B]`
pub fn forward_pairs(
    model: &ScalarHeadModel,
    pairs: &[&PairExample],
    pad: i64,
    loss: RmLoss,
    pass: PassOptions,
) -> Result<(PairLoss, usize, Option<Checkpointed>)> {
    let b = collate_pairs(pairs, pad, model.device())?;
    let (ids, mask) = (&b.input_ids, &b.attention_mask);
    let (values, ck) = match pass.padding_free {
        true => model.values_pass_packed(ids, mask, pass.checkpointing, None)?, // [2B, T]
        false => model.values_pass(ids, mask, pass.checkpointing)?,             // [2B, T]
    };
    let n = pairs.len() as i64;
    let (chosen, rejected) = (values.f_narrow(0, 0, n)?, values.f_narrow(0, n, n)?); // [B, T] each
    let out = pairwise_loss(loss, &chosen, &rejected, &b.segment, &b.chosen_last, &b.rejected_last)?;
    Ok((out, b.tokens, ck))
}

/// Eval metrics of a reward model on `pairs`: `eval/accuracy`, `eval/chosen_score`,
/// `eval/rejected_score`, `eval/loss`.
pub fn evaluate_pairs(
    model: &ScalarHeadModel,
    pairs: &[PairExample],
    batch_size: usize,
    pad: i64,
    loss: RmLoss,
    padding_free: bool,
) -> Result<StepMetrics> {
    let (mut correct, mut chosen, mut rejected, mut loss_sum) = (0f64, 0f64, 0f64, 0f64);
    tch::no_grad(|| -> Result<()> {
        for chunk in pairs.chunks(batch_size.max(1)) {
            let batch: Vec<&PairExample> = chunk.iter().collect();
            let (out, _, _) =
                forward_pairs(model, &batch, pad, loss, PassOptions { checkpointing: false, padding_free })?;
            let sum = |t: &Tensor| -> Result<f64> { Ok(t.f_sum(Kind::Double)?.double_value(&[])) };
            correct += sum(&out.chosen_scores.f_gt_tensor(&out.rejected_scores)?)?;
            chosen += sum(&out.chosen_scores)?;
            rejected += sum(&out.rejected_scores)?;
            loss_sum += sum(&out.per_pair)?;
        }
        Ok(())
    })?;
    let n = pairs.len().max(1) as f64;
    let mut m = StepMetrics::default();
    m.set("eval/accuracy", correct / n);
    m.set("eval/chosen_score", chosen / n);
    m.set("eval/rejected_score", rejected / n);
    m.set("eval/loss", loss_sum / n);
    Ok(m)
}

struct RmTask {
    model: ScalarHeadModel,
    train: Vec<PairExample>,
    eval: Vec<PairExample>,
    pad: i64,
    loss: RmLoss,
    eval_batch_size: usize,
    pass: PassOptions,
}

impl PhaseTask for RmTask {
    fn weight(&self, items: &[usize]) -> f64 {
        items.len() as f64
    }

    fn micro_step(&mut self, items: &[usize], total_weight: f64, m: &mut StepMetrics) -> Result<Option<MicroOut>> {
        self.model.set_training(true);
        let batch: Vec<&PairExample> = items.iter().map(|&i| &self.train[i]).collect();
        let (out, tokens, ck) = forward_pairs(&self.model, &batch, self.pad, self.loss, self.pass)?;
        let sum = out.per_pair.f_sum(Kind::Float)?; // scalar
        let value = sum.double_value(&[]);
        if value.is_finite() {
            sum.f_div_scalar(total_weight)?.f_backward()?;
        }
        // Also without a loss: a sharded model's pass gathers and reduces with the other ranks.
        if let Some(ck) = &ck {
            self.model.backward_checkpointed(ck)?;
        }
        if !value.is_finite() {
            return Ok(None);
        }
        let correct = out.chosen_scores.f_gt_tensor(&out.rejected_scores)?.f_to_kind(Kind::Float)?;
        for v in Vec::<f32>::try_from(&correct)? {
            m.add("train/accuracy", f64::from(v));
        }
        Ok(Some(MicroOut { loss_sum: value, tokens }))
    }

    fn trained_vars(&self) -> &tch::nn::VarStore {
        &self.model.vs
    }

    fn evaluate(&mut self) -> Result<Option<StepMetrics>> {
        self.model.set_training(false);
        if self.eval.is_empty() {
            return Ok(None);
        }
        Ok(Some(evaluate_pairs(
            &self.model,
            &self.eval,
            self.eval_batch_size,
            self.pad,
            self.loss,
            self.pass.padding_free,
        )?))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        Ok(self.model.save(dir)?)
    }
}

/// Trains a reward model as configured. The data files are read before the run directory is
/// created; the run owns the directory (its lock) until it returns.
pub fn run_rm(cfg: RmConfig, world: &World, resume: Option<&Loaded>) -> Result<RmSummary> {
    begin_phase(world, &cfg, resume, |run_dir, begun| rm_in(&cfg, run_dir, begun, world, resume))
}

fn rm_in(cfg: &RmConfig, run_dir: &Path, begun: Begun, world: &World, resume: Option<&Loaded>) -> Result<RmSummary> {
    let Begun { device, kind, splits, shared } = begun;
    let run_dir = run_dir.to_path_buf();
    let model_dir = resolve_model_dir(&cfg.model.path, &run_dir, cfg.run.seed)?;
    let tok = crate::model_source::tokenizer(&model_dir, &cfg.data.chat_template_kwargs)?;
    let d = &cfg.data;
    let opts = PairOptions::of(d);
    let (train, eval) = pair_sets(&splits, |src, report| build_pairs(src, &tok, &opts, report))?;
    let mut model = ScalarHeadModel::from_causal_lm_dir(&model_dir, device, kind)?;
    tok.check_fits_vocab(model.arch().vocab_size)?;
    if model.apply_lora(&cfg.model.lora).map_err(|e| lora_error("config", e))? > 0 {
        let (t, n) = rlhf_models::lora::parameter_counts(&model.vs);
        tracing::info!("LoRA: {t} of {n} parameters train");
    }
    let t = &cfg.train.common();
    let total = total_steps(train.len(), t);
    crate::supervised::phase::continue_run(&run_dir, cfg, resume, total)?;
    dist::broadcast_weights(world, &model.vs)?;
    let mut opt = TrainEngine::new(&model.vs, &t.optim(), total, cfg.distributed.strategy(), world)?;
    model.set_gate(opt.gate());
    tracing::info!(
        "rm: {} train pairs, {} eval pairs, {total} optimizer steps, loss {:?}, run dir {}",
        train.len(),
        eval.len(),
        cfg.train.loss,
        run_dir.display()
    );
    let (run, mut sinks) = crate::supervised::state::open(
        "rm",
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
    let mut task = RmTask {
        model,
        train,
        eval,
        pad: i64::from(tok.pad_token_id()),
        loss: cfg.train.loss,
        eval_batch_size: t.eval_batch_size,
        pass: PassOptions { checkpointing: t.gradient_checkpointing, padding_free: cfg.train.padding_free },
    };
    let s = run_phase(&mut task, train_pairs, t, &mut opt, &run, &mut sinks)?;
    let get = |m: &Option<StepMetrics>, k: &str| m.as_ref().and_then(|m| m.get(k));
    let summary = RmSummary {
        run_dir: run_dir.clone(),
        metrics_path: sinks.path().to_path_buf(),
        model_dir: s.model_dir,
        steps: s.steps,
        train_pairs,
        eval_pairs,
        eval_accuracy_before: get(&s.eval_before, "eval/accuracy"),
        eval_accuracy_after: get(&s.eval_after, "eval/accuracy"),
        eval_chosen_score: get(&s.eval_after, "eval/chosen_score"),
        eval_rejected_score: get(&s.eval_after, "eval/rejected_score"),
        loss_first: s.loss_first,
        loss_last: s.loss_last,
    };
    write_summary(
        &run_dir,
        &serde_json::json!({
            "phase": "rm",
            "steps": summary.steps,
            "train_pairs": train_pairs,
            "eval_pairs": eval_pairs,
            "eval_accuracy_before": summary.eval_accuracy_before,
            "eval_accuracy_after": summary.eval_accuracy_after,
            "eval_chosen_score": summary.eval_chosen_score,
            "eval_rejected_score": summary.eval_rejected_score,
            "loss_first": finite(summary.loss_first),
            "loss_last": finite(summary.loss_last),
            "model_dir": summary.model_dir,
        }),
    )?;
    Ok(summary)
}
