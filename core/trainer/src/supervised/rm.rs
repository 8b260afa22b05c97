//! Reward-model training (DeepSpeed-Chat phase 2): a scalar head on a causal-LM backbone
//! ([`ScalarHeadModel::from_causal_lm_dir`], a fresh `score` head) trained on preference pairs
//! ([`crate::pairs`]) with the pairwise ranking loss — DSC's divergent-segment mean by default,
//! `loss = "last_token"` for the TRL/OpenRLHF form. Chosen and rejected sides run in one forward
//! pass (`[2B, T]`, chosen rows first, as DSC's collator). Evaluation: accuracy (chosen score >
//! rejected score, scores read at the last real token), mean chosen and rejected scores and the eval
//! loss. Saved in the `*ForSequenceClassification` layout that the `reward-model` plugin,
//! `rlhf serve-reward` and transformers load.

use std::path::{Path, PathBuf};

use rlhf_models::{parse_device, parse_dtype, LoraConfig, ScalarHeadModel};
use rlhf_tokenizer::HfTokenizer;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::config::{load_layered_figment, ConfigSource, KeySource, Schedule};
use crate::error::Result;
use crate::metrics::{MetricsWriter, StepMetrics};
use crate::optim::Optim;
use crate::pairs::{build_pairs, collate_pairs, pairwise_loss, PairExample, PairLoss, PairOptions, RmLoss};
use crate::phase::{
    load_splits, lora_error, prepare_run_dir, resolve_model_dir, run_phase, total_steps, DataReport, MicroOut,
    Overlong, PhaseModelConfig, PhaseRunConfig, PhaseTask, PhaseTrainConfig, SourceLines,
};
use crate::sft::{finite, write_summary, PHASE_PRESETS};

/// `[data]` of `rlhf rm`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmDataConfig {
    /// JSONL of `prompt`/`chosen`/`rejected` (text or chat lists); or `builtin:addition-pairs`.
    pub train: String,
    /// A separate eval JSONL (or a built-in: its held-out split); unset: `eval_fraction` when > 0,
    /// else a built-in train set's held-out split.
    pub eval: Option<String>,
    /// Fraction of the train lines held out for evaluation when `eval` is unset (0 = none).
    pub eval_fraction: f64,
    /// Tokens per side of a pair.
    pub max_len: usize,
    /// `truncate` (keep the first `max_len` tokens of both sides, as DSC) or `drop`.
    pub overlong: Overlong,
    /// Render through the chat template when the tokenizer has one (else `prompt + response`).
    pub apply_chat_template: bool,
    /// Append EOS to every side (DSC appends its end-of-conversation token). Off by default: the
    /// `reward-model` plugin scores the text as is, and training should see what scoring sees.
    pub append_eos: bool,
}

impl Default for RmDataConfig {
    fn default() -> Self {
        RmDataConfig {
            train: "builtin:addition-pairs".into(),
            eval: None,
            eval_fraction: 0.0,
            max_len: 512,
            overlong: Overlong::Truncate,
            apply_chat_template: true,
            append_eos: false,
        }
    }
}

/// `[train]` of `rlhf rm`: the keys of [`PhaseTrainConfig`] plus the loss. (Written out rather
/// than `#[serde(flatten)]`, which serde does not combine with `deny_unknown_fields`.)
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmTrainConfig {
    /// `dsc` (divergent-segment mean, the default) or `last_token`.
    pub loss: RmLoss,
    pub epochs: usize,
    /// Pairs per forward pass (2 × this many sequences).
    pub batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub adam_betas: (f64, f64),
    pub adam_eps: f64,
    pub warmup_steps: usize,
    pub schedule: Schedule,
    pub max_grad_norm: f64,
    pub max_steps: usize,
    pub eval_every: usize,
    pub save_every: usize,
    pub eval_batch_size: usize,
}

impl Default for RmTrainConfig {
    fn default() -> Self {
        let c = PhaseTrainConfig::default();
        RmTrainConfig {
            loss: RmLoss::Dsc,
            epochs: c.epochs,
            batch_size: c.batch_size,
            grad_accum: c.grad_accum,
            lr: c.lr,
            weight_decay: c.weight_decay,
            adam_betas: c.adam_betas,
            adam_eps: c.adam_eps,
            warmup_steps: c.warmup_steps,
            schedule: c.schedule,
            max_grad_norm: c.max_grad_norm,
            max_steps: c.max_steps,
            eval_every: c.eval_every,
            save_every: c.save_every,
            eval_batch_size: c.eval_batch_size,
        }
    }
}

impl RmTrainConfig {
    /// The loop settings.
    pub fn common(&self) -> PhaseTrainConfig {
        PhaseTrainConfig {
            epochs: self.epochs,
            batch_size: self.batch_size,
            grad_accum: self.grad_accum,
            lr: self.lr,
            weight_decay: self.weight_decay,
            adam_betas: self.adam_betas,
            adam_eps: self.adam_eps,
            warmup_steps: self.warmup_steps,
            schedule: self.schedule,
            max_grad_norm: self.max_grad_norm,
            max_steps: self.max_steps,
            eval_every: self.eval_every,
            save_every: self.save_every,
            eval_batch_size: self.eval_batch_size,
        }
    }
}

/// The whole `rlhf rm` configuration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmConfig {
    pub run: PhaseRunConfig,
    /// The causal LM the backbone comes from (usually the SFT output).
    pub model: PhaseModelConfig,
    pub data: RmDataConfig,
    pub train: RmTrainConfig,
    /// LoRA adapters on the backbone (`rank = 0`: full fine-tuning); the score head always trains.
    pub lora: LoraConfig,
}

impl RmConfig {
    /// Loads base (file or the embedded `rm` preset), `RLHF_*` variables and `--set` overrides, and
    /// validates.
    pub fn load(source: &ConfigSource, sets: &[String]) -> Result<Self> {
        let (cfg, fig): (RmConfig, _) = load_layered_figment(source, PHASE_PRESETS, sets)?;
        let label = match source {
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Preset(n) => format!("preset {n}"),
        };
        let src = KeySource { fig: &fig, base: &label };
        cfg.train.common().validate(&src)?;
        cfg.lora.validate().map_err(|e| lora_error(&src.of("lora"), e))?;
        if cfg.data.max_len < 2 {
            return Err(src.error("data.max_len", "must be >= 2"));
        }
        Ok(cfg)
    }
}

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

/// Values of both sides of a batch and the loss.
///
/// # Shapes
/// - `pairs.len() = B` → per-pair losses and scores `[B]`
fn forward_pairs(model: &ScalarHeadModel, pairs: &[&PairExample], pad: i64, loss: RmLoss) -> Result<(PairLoss, usize)> {
    let b = collate_pairs(pairs, pad, model.device())?;
    let values = model.values(&b.input_ids, &b.attention_mask)?; // [2B, T]
    let n = pairs.len() as i64;
    let (chosen, rejected) = (values.f_narrow(0, 0, n)?, values.f_narrow(0, n, n)?); // [B, T] each
    let out = pairwise_loss(loss, &chosen, &rejected, &b.segment, &b.chosen_last, &b.rejected_last)?;
    Ok((out, b.tokens))
}

/// Eval metrics of a reward model on `pairs`: `eval/accuracy`, `eval/chosen_score`,
/// `eval/rejected_score`, `eval/loss`.
pub fn evaluate_pairs(
    model: &ScalarHeadModel,
    pairs: &[PairExample],
    batch_size: usize,
    pad: i64,
    loss: RmLoss,
) -> Result<StepMetrics> {
    let (mut correct, mut chosen, mut rejected, mut loss_sum) = (0f64, 0f64, 0f64, 0f64);
    tch::no_grad(|| -> Result<()> {
        for chunk in pairs.chunks(batch_size.max(1)) {
            let batch: Vec<&PairExample> = chunk.iter().collect();
            let (out, _) = forward_pairs(model, &batch, pad, loss)?;
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
}

impl PhaseTask for RmTask {
    fn weight(&self, items: &[usize]) -> f64 {
        items.len() as f64
    }

    fn micro_step(&mut self, items: &[usize], total_weight: f64, m: &mut StepMetrics) -> Result<Option<MicroOut>> {
        self.model.set_training(true);
        let batch: Vec<&PairExample> = items.iter().map(|&i| &self.train[i]).collect();
        let (out, tokens) = forward_pairs(&self.model, &batch, self.pad, self.loss)?;
        let sum = out.per_pair.f_sum(Kind::Float)?; // scalar
        let value = sum.double_value(&[]);
        if !value.is_finite() {
            return Ok(None);
        }
        sum.f_div_scalar(total_weight)?.f_backward()?;
        let correct = out.chosen_scores.f_gt_tensor(&out.rejected_scores)?.f_to_kind(Kind::Float)?;
        for v in Vec::<f32>::try_from(&correct)? {
            m.add("train/accuracy", f64::from(v));
        }
        Ok(Some(MicroOut { loss_sum: value, tokens }))
    }

    fn evaluate(&mut self) -> Result<Option<StepMetrics>> {
        self.model.set_training(false);
        if self.eval.is_empty() {
            return Ok(None);
        }
        Ok(Some(evaluate_pairs(&self.model, &self.eval, self.eval_batch_size, self.pad, self.loss)?))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        Ok(self.model.save(dir)?)
    }
}

fn pairs_of(src: &SourceLines, tok: &HfTokenizer, opts: &PairOptions) -> Result<Vec<PairExample>> {
    let mut report = DataReport::default();
    let pairs = build_pairs(src, tok, opts, &mut report);
    report.warn(&src.label);
    if pairs.is_empty() {
        return Err(report.all_bad(&src.label, src.lines.len()));
    }
    Ok(pairs)
}

/// Trains a reward model as configured.
pub fn run_rm(cfg: RmConfig) -> Result<RmSummary> {
    let device: Device = parse_device(&cfg.run.device)?;
    let kind = parse_dtype(&cfg.run.dtype)?;
    tch::manual_seed(cfg.run.seed as i64);
    let run_dir = prepare_run_dir(&cfg.run.run_dir, "rm", &cfg)?;
    let model_dir = resolve_model_dir(&cfg.model.path, &run_dir, cfg.run.seed)?;
    let tok = HfTokenizer::from_dir(&model_dir)?;
    let d = &cfg.data;
    let splits = load_splits(&d.train, d.eval.as_deref(), d.eval_fraction, cfg.run.seed)?;
    let opts = PairOptions {
        max_len: d.max_len,
        apply_chat_template: d.apply_chat_template,
        append_eos: d.append_eos,
        overlong: d.overlong,
    };
    let train = pairs_of(&splits.train, &tok, &opts)?;
    let eval = match &splits.eval {
        Some(e) => pairs_of(e, &tok, &opts)?,
        None => Vec::new(),
    };
    let mut model = ScalarHeadModel::from_causal_lm_dir(&model_dir, device, kind)?;
    if model.apply_lora(&cfg.lora).map_err(|e| lora_error("config", e))? > 0 {
        let (t, n) = rlhf_models::lora::parameter_counts(&model.vs);
        tracing::info!("LoRA: {t} of {n} parameters train");
    }
    let t = &cfg.train.common();
    let total = total_steps(train.len(), t);
    let mut opt = Optim::new(
        &model.vs,
        t.lr,
        t.adam_betas,
        t.adam_eps,
        t.weight_decay,
        t.schedule,
        t.warmup_steps,
        total,
        t.max_grad_norm,
    )?;
    tracing::info!(
        "rm: {} train pairs, {} eval pairs, {total} optimizer steps, loss {:?}, run dir {}",
        train.len(),
        eval.len(),
        cfg.train.loss,
        run_dir.display()
    );
    let mut metrics = MetricsWriter::create(&run_dir)?;
    let (train_pairs, eval_pairs) = (train.len(), eval.len());
    let mut task = RmTask {
        model,
        train,
        eval,
        pad: i64::from(tok.pad_token_id()),
        loss: cfg.train.loss,
        eval_batch_size: t.eval_batch_size,
    };
    let s = run_phase(&mut task, train_pairs, t, cfg.run.seed, &mut opt, &run_dir, &mut metrics)?;
    let get = |m: &Option<StepMetrics>, k: &str| m.as_ref().and_then(|m| m.get(k));
    let summary = RmSummary {
        run_dir: run_dir.clone(),
        metrics_path: metrics.path().to_path_buf(),
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
