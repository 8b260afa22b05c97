//! Attaching LoRA adapters to a model's linear layers and folding them back in: the part of LoRA
//! that knows [`Linear`] (the adapter itself, [`LoraAdapter`], is in [`crate::lora`]).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tch::{nn, Tensor};

use crate::error::{ModelError, Result};
use crate::layers::Linear;
use crate::lora::{LoraAdapter, LoraConfig};

/// Adds adapters to every targeted linear layer of `layers` (named by their full weight path
/// without `.weight`), registering `A` and `B` in `vs` as `<path>.lora_A.weight` /
/// `<path>.lora_B.weight` (PEFT's names), then freezes every other variable of `vs` except those
/// whose name starts with one of `keep_trainable`. `training` turns the adapters' dropout on,
/// `disabled` switches them off. Returns the number of adapted layers.
pub(crate) fn apply(
    vs: &nn::VarStore,
    layers: Vec<(String, &mut Linear)>,
    cfg: &LoraConfig,
    keep_trainable: &[&str],
    training: &Arc<AtomicBool>,
    disabled: &Arc<AtomicBool>,
) -> Result<usize> {
    cfg.validate()?;
    if !cfg.enabled() {
        return Ok(0);
    }
    let mut n = 0;
    let mut available = Vec::new();
    for (path, linear) in layers {
        available.push(path.rsplit('.').next().unwrap_or(&path).to_string());
        if !cfg.matches(&path) {
            continue;
        }
        if linear.lora.is_some() {
            return Err(ModelError::Input(format!("{path}: LoRA is already applied")));
        }
        let (in_dim, out_dim) = linear.dims();
        let mut p = vs.root();
        for part in path.split('.') {
            p = p / part;
        }
        let bound = 1.0 / (in_dim as f64).sqrt();
        let a = (&p / "lora_A").f_var("weight", &[cfg.rank, in_dim], nn::Init::Uniform { lo: -bound, up: bound })?;
        let b = (&p / "lora_B").f_zeros("weight", &[out_dim, cfg.rank])?;
        linear.lora = Some(LoraAdapter {
            a,
            b,
            scale: cfg.alpha / cfg.rank as f64,
            dropout: cfg.dropout,
            training: training.clone(),
            disabled: disabled.clone(),
        });
        n += 1;
    }
    if n == 0 {
        available.sort();
        available.dedup();
        return Err(ModelError::Input(format!(
            "lora.target_modules: {:?} match no linear layer of this model (its layers: {})",
            cfg.target_modules,
            available.join(", ")
        )));
    }
    for (name, t) in vs.variables() {
        let adapter = name.contains(".lora_A.") || name.contains(".lora_B.");
        if !adapter && !keep_trainable.iter().any(|k| name.starts_with(k)) {
            let _ = t.set_requires_grad(false);
        }
    }
    Ok(n)
}

/// The merged weights `W + ΔW` of every adapted layer, keyed by weight name.
pub(crate) fn merged_weights(layers: Vec<(String, &Linear)>) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    tch::no_grad(|| -> Result<()> {
        for (path, l) in layers {
            if let Some(a) = &l.lora {
                let w = l.weight.f_add(&a.delta(l.transposed())?.f_to_kind(l.weight.kind())?)?;
                out.push((format!("{path}.weight"), w));
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Folds every adapter into its base weight in place and zeroes `B`, so the model computes the
/// same function with the update held in the plain weights.
pub(crate) fn merge_in_place(layers: Vec<(String, &mut Linear)>) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for (_, l) in layers {
            let transposed = l.transposed();
            if let Some(a) = &mut l.lora {
                let d = a.delta(transposed)?.f_to_kind(l.weight.kind())?;
                let _ = l.weight.f_add_(&d)?;
                let _ = a.b.f_zero_()?;
            }
        }
        Ok(())
    })
}

/// The adapters of `layers` in PEFT's saved layout: `adapter_model.safetensors` tensors named
/// `base_model.model.<path>.lora_{A,B}.weight` (`A [r, in]`, `B [out, r]`) and the
/// `adapter_config.json` fields that go with them (`r`, `lora_alpha = scale · r`, the adapted
/// module names). Errors when there are none, or for transposed (GPT-2 Conv1D) layers.
pub(crate) fn peft_adapter(layers: Vec<(String, &Linear)>) -> Result<(serde_json::Value, Vec<(String, Tensor)>)> {
    let mut tensors = Vec::new();
    let mut modules: Vec<String> = Vec::new();
    let mut rank_alpha: Option<(i64, f64)> = None;
    for (path, l) in layers {
        let Some(a) = &l.lora else { continue };
        if l.transposed() {
            return Err(ModelError::Input(format!(
                "{path}: a PEFT adapter of a transposed (Conv1D) layer is not supported; use full weight sync"
            )));
        }
        let r = a.a.size()[0];
        rank_alpha.get_or_insert((r, a.scale * r as f64));
        modules.push(path.rsplit('.').next().unwrap_or(&path).to_string());
        tensors.push((format!("base_model.model.{path}.lora_A.weight"), a.a.f_detach()?.f_contiguous()?));
        tensors.push((format!("base_model.model.{path}.lora_B.weight"), a.b.f_detach()?.f_contiguous()?));
    }
    let Some((r, alpha)) = rank_alpha else {
        return Err(ModelError::Input("the model has no LoRA adapters to save".into()));
    };
    modules.sort();
    modules.dedup();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "modules_to_save": null,
    });
    Ok((config, tensors))
}
