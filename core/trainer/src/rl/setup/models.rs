//! The models of a run: the actor (after the optional supervised warm-up), its companions
//! (reference, critic, EMA copy, LoRA adapters), their initial weights shared by every rank, and
//! the optimizers that train them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rlhf_collective::World;
use rlhf_models::{CausalLm, ScalarHeadModel};
use rlhf_plugin_api::Requirements;
use rlhf_tokenizer::HfTokenizer;
use tch::{Device, Kind};

use crate::config::RlConfig;
use crate::data::PromptDataset;
use crate::error::{Result, TrainerError};
use crate::prompt_images::PromptImages;
use crate::rl::optimise;
use crate::rl::prompts::ids_i64;
use crate::rl::warmup::sft_warmup;
use crate::train_engine::stage3::Params;
use crate::train_engine::TrainEngine;

/// The actor after the optional warm-up, and the directory its weights come from (the warm-up's
/// output when there is one: it is also the reference and the base of critic and EMA).
#[allow(clippy::too_many_arguments)]
pub(super) fn warmed_up_actor(
    cfg: &RlConfig,
    run_dir: &Path,
    actor_dir: PathBuf,
    tok: &HfTokenizer,
    (data, images): (&PromptDataset, Option<&PromptImages>),
    resume: bool,
    device: Device,
    kind: Kind,
) -> Result<(CausalLm, PathBuf)> {
    let actor = CausalLm::from_dir(&actor_dir, device, kind)?;
    tok.check_fits_vocab(actor.arch().vocab_size)?;
    if cfg.warmup.steps == 0 {
        return Ok((actor, actor_dir));
    }
    let dir = run_dir.join("warmup-model");
    if resume {
        // The warm-up ran before the checkpoint: its output is the reference and the base.
        let actor = CausalLm::from_dir(&dir, device, kind).map_err(|e| {
            TrainerError::Checkpoint(format!(
                "{}: cannot resume: the warm-up model is unreadable: {e}",
                run_dir.display()
            ))
        })?;
        return Ok((actor, dir));
    }
    // The response to learn: the label, or a metadata field (`warmup.target`).
    let target = |r: &crate::data::PromptRecord| match cfg.warmup.target.strip_prefix("metadata.") {
        Some(key) => r.metadata.get(key).filter(|v| !v.is_null()).map(|v| match v.as_str() {
            Some(s) => s.to_string(),
            None => v.to_string(),
        }),
        None => r.label.clone(),
    };
    // Each pair's (prompt, response) ids and the record its prompt is.
    let (mut records, mut pairs) = (Vec::new(), Vec::new());
    for (i, r) in data.records.iter().enumerate() {
        if let Some(l) = target(r) {
            records.push(i);
            pairs.push((ids_i64(&r.ids), ids_i64(&tok.encode(&l, false)?)));
        }
    }
    if pairs.is_empty() {
        return Err(TrainerError::Config(format!(
            "{}: warmup.steps: the prompts of data.prompts have no `{}` to warm up on",
            cfg.source_of("warmup.steps"),
            cfg.warmup.target
        )));
    }
    let eos = tok.eos_token_ids().first().copied().map(i64::from).unwrap_or(0);
    let pad = i64::from(tok.pad_token_id());
    // Each batch's images, decoded and patched when drawn.
    let pair_images = |picked: &[usize]| -> Result<Option<rlhf_models::Images>> {
        let Some(p) = images else { return Ok(None) };
        let rows = picked.iter().map(|&i| p.patches(&data.records[records[i]].images)).collect::<Result<Vec<_>>>()?;
        crate::rl::visual::cat(&rows, None)
    };
    let loss = sft_warmup(&actor, &pairs, eos, pad, &cfg.warmup, cfg.run.seed, Some(&pair_images))?;
    tracing::info!("supervised warm-up: {} steps, final loss {loss:.4}", cfg.warmup.steps);
    actor.save(&dir)?;
    let actor = CausalLm::from_dir(&dir, device, kind)?;
    Ok((actor, dir))
}

/// Reference, critic (with its LoRA), the actor's LoRA and the EMA copy — in this order, which
/// fixes the random draws of new heads and adapters.
pub(super) type Companions = (Option<CausalLm>, Option<ScalarHeadModel>, Option<CausalLm>);

pub(super) fn companions(
    cfg: &RlConfig,
    req: Requirements,
    actor: &mut CausalLm,
    actor_dir: &Path,
    device: Device,
    kind: Kind,
) -> Result<Companions> {
    let reference = if req.reference {
        let dir = match &cfg.model.reference {
            Some(spec) => crate::model_source::resolve(spec, "model.reference")?,
            None => actor_dir.to_path_buf(),
        };
        let mut r = CausalLm::from_dir(&dir, device, kind)?;
        r.freeze();
        Some(r)
    } else {
        None
    };
    let critic = if req.critic {
        let mut c = match cfg.model.critic.as_str() {
            "actor" => ScalarHeadModel::from_causal_lm_dir(actor_dir, device, kind)?,
            spec => ScalarHeadModel::from_dir(&crate::model_source::resolve(spec, "model.critic")?, device, kind)?,
        };
        if c.apply_lora(&cfg.model.critic_lora).map_err(|e| crate::model_source::lora_error("model.critic_lora", e))?
            > 0
        {
            let (t, n) = rlhf_models::lora::parameter_counts(&c.vs);
            tracing::info!("critic LoRA: {t} of {n} parameters train");
        }
        Some(c)
    } else {
        None
    };
    if actor.apply_lora(&cfg.model.lora).map_err(|e| crate::model_source::lora_error("model.lora", e))? > 0 {
        let (t, n) = rlhf_models::lora::parameter_counts(&actor.vs);
        tracing::info!("actor LoRA: {t} of {n} parameters train");
    }
    let ema = match cfg.train.ema_decay {
        Some(_) => {
            let mut e = CausalLm::from_dir(actor_dir, device, kind)?;
            // The same adapters, so the average tracks them by name.
            e.apply_lora(&cfg.model.lora).map_err(|e| crate::model_source::lora_error("model.lora", e))?;
            e.freeze();
            Some(e)
        }
        None => None,
    };
    Ok((reference, critic, ema))
}

/// Refuses a critic that reads no images for prompts that hold them.
pub(super) fn check_critic_reads_images(
    cfg: &RlConfig,
    critic: Option<&ScalarHeadModel>,
    with_images: bool,
) -> Result<()> {
    match critic {
        Some(c) if with_images && c.vision().is_none() => Err(TrainerError::Config(format!(
            "{}: model.critic `{}` reads no images, and data.prompts `{}` holds images",
            cfg.source_of("model.critic"),
            cfg.model.critic,
            cfg.data.prompts
        ))),
        _ => Ok(()),
    }
}

/// Once every rank has its models (a rank that failed before here meets this agreement at the end
/// of its setup), they start from rank 0's weights, before the optimizers copy them into masters.
pub(super) fn share_initial_weights(
    world: &Arc<World>,
    actor: &CausalLm,
    critic: Option<&ScalarHeadModel>,
    ema: Option<&CausalLm>,
) -> Result<()> {
    crate::dist::agree(world, "loading the models", Ok(()))?;
    crate::dist::broadcast_weights(world, &actor.vs)?;
    if let Some(c) = critic {
        crate::dist::broadcast_weights(world, &c.vs)?;
    }
    if let Some(e) = ema {
        crate::dist::broadcast_weights(world, &e.vs)?;
    }
    Ok(())
}

/// The actor's and the critic's optimizers, their ZeRO stage-3 gates set on the models (the
/// checkpointed passes gather and free each layer of the sharded parameters), and, with
/// `distributed.shard_frozen`, the reference's sharded parameters, gathered layer by layer in its
/// pass.
pub(super) fn optimizers(
    cfg: &RlConfig,
    actor: &mut CausalLm,
    critic: Option<&mut ScalarHeadModel>,
    reference: Option<&mut CausalLm>,
    world: &Arc<World>,
) -> Result<(TrainEngine, Option<TrainEngine>, Option<Params>)> {
    // Optimizer steps per generation batch: ppo_epochs × ⌈⌈batch / minibatch⌉ / accumulation⌉.
    let batch = cfg.rollout.prompts_per_batch * cfg.rollout.samples_per_prompt;
    let total = cfg.train.steps * cfg.train.ppo_epochs * optimise::steps_per_epoch(batch, &cfg.train);
    let strategy = cfg.distributed.strategy();
    let actor_opt = TrainEngine::new(&actor.vs, &cfg.train.actor_optim(), total, strategy, world)?;
    actor.set_gate(actor_opt.gate());
    let critic_opt = match critic {
        Some(c) => {
            let o = TrainEngine::new(&c.vs, &cfg.train.critic_optim(), total, strategy, world)?;
            c.set_gate(o.gate());
            Some(o)
        }
        None => None,
    };
    let ref_params = match reference.filter(|_| cfg.distributed.shard_frozen) {
        Some(r) => {
            let p = Params::frozen(&r.vs, world)?;
            r.set_gate(Some(p.gate()));
            Some(p)
        }
        None => None,
    };
    Ok((actor_opt, critic_opt, ref_params))
}
