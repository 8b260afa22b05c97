//! Supervised fine-tuning (DeepSpeed-Chat phase 1): next-token cross-entropy on the response tokens
//! (or every token, `loss_on_prompt`) of prompt/response or chat examples ([`crate::sft_data`]),
//! optionally packed, with AdamW, warm-up + schedule, gradient accumulation and clipping. The loss of
//! a step is the mean NLL over every target token of its micro-batches. Evaluation is perplexity,
//! `exp(mean NLL)` over the target tokens of the eval split (DSC evaluates `exp(loss)` the same
//! way), before training, every `eval_every` steps and at the end. The model is saved in Hugging
//! Face format (checkpoints every `save_every` steps, the final one in `<run_dir>/model`).

use std::path::{Path, PathBuf};

use rlhf_generation::{token_logprobs, token_logprobs_pass, LogProbOptions};
use rlhf_models::CausalLm;
use rlhf_tokenizer::HfTokenizer;

use super::phase::{finite, lora_error, resolve_model_dir, total_steps, write_summary, DataReport};
use super::run_loop::{begin_phase, run_phase, Begun, MicroOut, PhaseTask};
use super::sft_data::{build_sft_examples, collate, masked_nll_sum, pack, SftExample, SftTokenizeOptions};
pub use crate::config::{SftConfig, SftDataConfig, PHASE_PRESETS};
use rlhf_collective::World;

use crate::checkpoint::Loaded;
use crate::dist;
use crate::error::Result;
use crate::metrics::StepMetrics;
use crate::router_aux::with_router_aux_loss;
use crate::train_engine::TrainEngine;

/// Where a finished SFT run left its outputs.
#[derive(Debug, Clone)]
pub struct SftSummary {
    pub run_dir: PathBuf,
    pub metrics_path: PathBuf,
    /// The final model (Hugging Face format).
    pub model_dir: PathBuf,
    pub steps: usize,
    pub train_examples: usize,
    pub eval_examples: usize,
    /// Eval perplexity before the first and after the last step.
    pub eval_ppl_before: Option<f64>,
    pub eval_ppl_after: Option<f64>,
    pub loss_first: f64,
    pub loss_last: f64,
}

/// Perplexity over the target tokens of `examples`: `(ppl, mean nll, tokens)`.
pub fn perplexity(model: &CausalLm, examples: &[SftExample], batch_size: usize, pad: i64) -> Result<(f64, f64, usize)> {
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| examples[i].ids.len());
    let (mut nll, mut tokens) = (0f64, 0usize);
    tch::no_grad(|| -> Result<()> {
        for chunk in order.chunks(batch_size.max(1)) {
            let batch: Vec<&SftExample> = chunk.iter().map(|&i| &examples[i]).collect();
            let b = collate(&batch, pad, model.device())?;
            let lp = token_logprobs(model, &b.input_ids, &b.attention_mask, 1, LogProbOptions::default())?;
            nll += masked_nll_sum(&lp.logprobs, &b.target_mask)?.double_value(&[]);
            tokens += b.targets;
        }
        Ok(())
    })?;
    let mean = nll / tokens.max(1) as f64;
    Ok((mean.exp(), mean, tokens))
}

struct SftTask {
    model: CausalLm,
    train: Vec<SftExample>,
    eval: Vec<SftExample>,
    pad: i64,
    eval_batch_size: usize,
    /// `train.gradient_checkpointing`.
    checkpointing: bool,
}

impl PhaseTask for SftTask {
    fn weight(&self, items: &[usize]) -> f64 {
        items.iter().map(|&i| self.train[i].target_count()).sum::<usize>() as f64
    }

    fn micro_step(&mut self, items: &[usize], total_weight: f64, m: &mut StepMetrics) -> Result<Option<MicroOut>> {
        self.model.set_training(true);
        let batch: Vec<&SftExample> = items.iter().map(|&i| &self.train[i]).collect();
        let b = collate(&batch, self.pad, self.model.device())?;
        let opts = LogProbOptions::default();
        let (lp, ck) = token_logprobs_pass(&self.model, &b.input_ids, &b.attention_mask, 1, opts, self.checkpointing)?;
        let nll = masked_nll_sum(&lp.logprobs, &b.target_mask)?; // scalar
        let value = nll.double_value(&[]);
        let share = self.weight(items) / total_weight;
        let loss = with_router_aux_loss(nll.f_div_scalar(total_weight)?, lp.aux_loss.as_ref(), &self.model, share, m)?;
        if value.is_finite() {
            loss.f_backward()?;
        }
        // Also without a loss: a sharded model's pass gathers and reduces with the other ranks.
        ck.backward(&self.model)?;
        if !value.is_finite() {
            return Ok(None);
        }
        Ok(Some(MicroOut { loss_sum: value, tokens: b.tokens }))
    }

    fn trained_vars(&self) -> &tch::nn::VarStore {
        &self.model.vs
    }

    fn evaluate(&mut self) -> Result<Option<StepMetrics>> {
        self.model.set_training(false);
        if self.eval.is_empty() {
            return Ok(None);
        }
        let (ppl, nll, tokens) = perplexity(&self.model, &self.eval, self.eval_batch_size, self.pad)?;
        let mut m = StepMetrics::default();
        m.set("eval/ppl", ppl);
        m.set("eval/loss", nll);
        m.set("eval/tokens", tokens as f64);
        Ok(Some(m))
    }

    fn save(&self, dir: &Path) -> Result<()> {
        Ok(self.model.save(dir)?)
    }
}

/// Tokenizes a split, warns once per kind of bad line, and fails when nothing is usable.
fn examples_of(
    src: &super::phase::SourceLines,
    tok: &HfTokenizer,
    opts: &SftTokenizeOptions,
) -> Result<Vec<SftExample>> {
    let mut report = DataReport::default();
    let ex = build_sft_examples(src, tok, opts, &mut report);
    report.warn(&src.label);
    if ex.is_empty() {
        return Err(report.all_bad(&src.label, src.lines.len()));
    }
    Ok(ex)
}

/// Runs SFT as configured. The data files are read before the run directory is created; the run
/// owns the directory (its lock) until it returns.
pub fn run_sft(cfg: SftConfig, world: &World, resume: Option<&Loaded>) -> Result<SftSummary> {
    begin_phase(world, &cfg, resume, |run_dir, begun| sft_in(&cfg, run_dir, begun, world, resume))
}

fn sft_in(cfg: &SftConfig, run_dir: &Path, begun: Begun, world: &World, resume: Option<&Loaded>) -> Result<SftSummary> {
    let Begun { device, kind, splits, shared } = begun;
    let run_dir = run_dir.to_path_buf();
    let model_dir = resolve_model_dir(&cfg.model.path, &run_dir, cfg.run.seed)?;
    let tok = crate::model_source::tokenizer(&model_dir, &cfg.data.chat_template_kwargs)?;
    let d = &cfg.data;
    let opts = SftTokenizeOptions {
        max_len: d.max_len,
        apply_chat_template: d.apply_chat_template,
        loss_on_prompt: d.loss_on_prompt,
        assistant_turns: d.assistant_turns,
        overlong: d.overlong,
    };
    let mut train = examples_of(&splits.train, &tok, &opts)?;
    let eval = match &splits.eval {
        Some(e) => examples_of(e, &tok, &opts)?,
        None => Vec::new(),
    };
    let train_examples = train.len();
    if d.packing {
        train = pack(&train, d.max_len, cfg.run.seed);
        tracing::info!("packing: {train_examples} examples into {} rows of up to {} tokens", train.len(), d.max_len);
    }
    let mut model = CausalLm::from_dir(&model_dir, device, kind)?;
    tok.check_fits_vocab(model.arch().vocab_size)?;
    if model.apply_lora(&cfg.model.lora).map_err(|e| lora_error("config", e))? > 0 {
        let (t, n) = rlhf_models::lora::parameter_counts(&model.vs);
        tracing::info!("LoRA: {t} of {n} parameters train");
    }
    let t = &cfg.train;
    let total = total_steps(train.len(), t);
    crate::supervised::phase::continue_run(&run_dir, cfg, resume, total)?;
    dist::broadcast_weights(world, &model.vs)?;
    let mut opt = TrainEngine::new(&model.vs, &t.optim(), total, cfg.distributed.strategy(), world)?;
    model.set_gate(opt.gate());
    tracing::info!(
        "sft: {} train examples, {} eval examples, {total} optimizer steps, run dir {}",
        train_examples,
        eval.len(),
        run_dir.display()
    );
    let (run, mut sinks) = crate::supervised::state::open(
        "sft",
        cfg,
        cfg.run.seed,
        (&run_dir, &shared),
        world,
        &cfg.checkpoint,
        (&cfg.wandb, &cfg.tensorboard),
        &cfg.data.train,
        resume,
    )?;
    let n = train.len();
    let eval_examples = eval.len();
    let mut task = SftTask {
        model,
        train,
        eval,
        pad: i64::from(tok.pad_token_id()),
        eval_batch_size: t.eval_batch_size,
        checkpointing: t.gradient_checkpointing,
    };
    let s = run_phase(&mut task, n, t, &mut opt, &run, &mut sinks)?;
    let ppl = |m: &Option<StepMetrics>| m.as_ref().and_then(|m| m.get("eval/ppl"));
    let summary = SftSummary {
        metrics_path: sinks.path().to_path_buf(),
        run_dir: run_dir.clone(),
        model_dir: s.model_dir,
        steps: s.steps,
        train_examples,
        eval_examples,
        eval_ppl_before: ppl(&s.eval_before),
        eval_ppl_after: ppl(&s.eval_after),
        loss_first: s.loss_first,
        loss_last: s.loss_last,
    };
    write_summary(
        &run_dir,
        &serde_json::json!({
            "phase": "sft",
            "steps": summary.steps,
            "train_examples": train_examples,
            "eval_examples": eval_examples,
            "eval_ppl_before": summary.eval_ppl_before,
            "eval_ppl_after": summary.eval_ppl_after,
            "loss_first": finite(summary.loss_first),
            "loss_last": finite(summary.loss_last),
            "model_dir": summary.model_dir,
        }),
    )?;
    Ok(summary)
}
