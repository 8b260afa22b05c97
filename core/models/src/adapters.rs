//! Attaching LoRA adapters to a model's linear layers and folding them back in: the part of LoRA
//! that knows [`Linear`] (the adapter itself, [`LoraAdapter`], is in [`crate::lora`]).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tch::{nn, Tensor};

use crate::backbone::Backbone;
use crate::error::{ModelError, Result};
use crate::layers::Linear;
use crate::lora::{ExpertLora, LoraAdapter, LoraConfig, StackedWeight};

/// Adds adapters to every targeted linear layer of `layers` (named by their full weight path
/// without `.weight`), registering `A` and `B` in `vs` as `<path>.lora_A.weight` /
/// `<path>.lora_B.weight` (PEFT's names), then freezes every other variable of `vs` except those
/// whose name starts with one of `keep_trainable`. `training` turns the adapters' dropout on,
/// `disabled` switches them off. Returns the number of adapted layers; [`check_targets`] has
/// checked that `target_modules` match some.
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
    for (path, linear) in layers {
        if !cfg.matches(&path) {
            continue;
        }
        if linear.lora.is_some() {
            return Err(ModelError::Input(format!("{path}: LoRA is already applied")));
        }
        let (in_dim, out_dim) = linear.dims();
        let p = var_path(vs, &path);
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
    for (name, t) in vs.variables() {
        let adapter = name.contains(".lora_A.") || name.contains(".lora_B.");
        if !adapter && !keep_trainable.iter().any(|k| name.starts_with(k)) {
            let _ = t.set_requires_grad(false);
        }
    }
    Ok(n)
}

/// The var-store path of a dotted weight path (`model.layers.0.mlp`), where the adapter's `A` and
/// `B` are registered.
fn var_path<'a>(vs: &'a nn::VarStore, path: &str) -> nn::Path<'a> {
    path.split('.').fold(vs.root(), |p, part| p / part)
}

/// Checks, before anything is attached, that `target_modules` match one of the linear layers of
/// `backbone` (under `prefix`) and `target_parameters` one of its stacked weights, where they name
/// any; errors list what the model has.
pub(crate) fn check_targets(backbone: &Backbone, prefix: &str, cfg: &LoraConfig) -> Result<()> {
    let linears: Vec<String> = backbone.linears(prefix).into_iter().map(|(n, _)| n).collect();
    let stacked: Vec<String> = backbone.stacked(prefix).into_iter().map(|(n, _)| n).collect();
    cfg.validate()?;
    if !cfg.enabled() {
        return Ok(());
    }
    if !cfg.target_modules.is_empty() && !linears.iter().any(|p| cfg.matches(p)) {
        let mut available: Vec<&str> = linears.iter().map(|p| p.rsplit('.').next().unwrap_or(p)).collect();
        available.sort();
        available.dedup();
        return Err(ModelError::Input(format!(
            "lora.target_modules: {:?} match no linear layer of this model (its layers: {})",
            cfg.target_modules,
            available.join(", ")
        )));
    }
    if !cfg.target_parameters.is_empty() && !stacked.iter().any(|p| cfg.matches_parameter(p)) {
        return Err(ModelError::Input(format!(
            "lora.target_parameters: {:?} match no stacked expert weight of this model (its stacked weights: {})",
            cfg.target_parameters,
            if stacked.is_empty() { "none".to_string() } else { stacked.join(", ") }
        )));
    }
    Ok(())
}

/// Adds per-expert updates ([`ExpertLora`]) to every targeted stacked expert weight of `stacked`
/// (named by their full path), registering `A` and `B` in `vs` as `<path>.lora_A.weight` /
/// `<path>.lora_B.weight`, drawn as PEFT draws them. [`apply`] freezes the rest. Returns the
/// number of adapted weights.
pub(crate) fn apply_stacked(
    vs: &nn::VarStore,
    stacked: Vec<(String, &mut StackedWeight)>,
    cfg: &LoraConfig,
    disabled: &Arc<AtomicBool>,
) -> Result<usize> {
    if !cfg.enabled() || cfg.target_parameters.is_empty() {
        return Ok(0);
    }
    let mut n = 0;
    for (path, w) in stacked {
        if !cfg.matches_parameter(&path) {
            continue;
        }
        if w.lora.is_some() {
            return Err(ModelError::Input(format!("{path}: LoRA is already applied")));
        }
        let size = w.weight.size(); // [experts, d₁, d₂]
        let (experts, d1, d2) = (size[0], size[1], size[2]);
        let p = var_path(vs, &path);
        let r = cfg.rank * experts;
        let bound = 1.0 / (d1 as f64).sqrt();
        let a = (&p / "lora_A").f_var("weight", &[r, d1], nn::Init::Uniform { lo: -bound, up: bound })?;
        let b = (&p / "lora_B").f_zeros("weight", &[d2, r])?;
        w.lora = Some(ExpertLora { a, b, scale: cfg.alpha / cfg.rank as f64, disabled: disabled.clone() });
        n += 1;
    }
    Ok(n)
}

/// The merged stacked weights `W + ΔW` of every adapted one, keyed by weight name.
pub(crate) fn merged_stacked(stacked: Vec<(String, &StackedWeight)>) -> Result<Vec<(String, Tensor)>> {
    tch::no_grad(|| {
        let mut out = Vec::new();
        for (path, w) in stacked {
            if let Some(l) = &w.lora {
                let d = l.delta(w.weight.size()[0])?.f_to_kind(w.weight.kind())?;
                out.push((path, w.weight.f_add(&d)?));
            }
        }
        Ok(out)
    })
}

/// Folds every stacked update into its weight in place and zeroes `B`.
pub(crate) fn merge_stacked_in_place(stacked: Vec<(String, &mut StackedWeight)>) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for (_, w) in stacked {
            if let Some(l) = &mut w.lora {
                let d = l.delta(w.weight.size()[0])?.f_to_kind(w.weight.kind())?;
                let _ = w.weight.f_add_(&d)?;
                let _ = l.b.f_zero_()?;
            }
        }
        Ok(())
    })
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

/// One adapted stacked weight of a module: its parameter name, update and number of experts.
type StackedUpdate<'a> = (String, &'a ExpertLora, i64);

/// The adapters of `layers` and `stacked` in PEFT's saved layout: `adapter_model.safetensors`
/// tensors named `base_model.model.<path>.lora_{A,B}.weight` (`A [r, in]`, `B [out, r]`) and the
/// `adapter_config.json` fields that go with them (`r`, `lora_alpha = scale · r`, the adapted
/// module names). A stacked expert weight's update is PEFT's `target_parameters` one, on its
/// module (`…mlp.experts.lora_A.weight`); where a module has two, PEFT nests the first inside the
/// second (`…experts.base_layer.lora_A.weight` for `gate_up_proj`). Errors when there are none,
/// or for transposed (GPT-2 Conv1D) layers.
pub(crate) fn peft_adapter(
    layers: Vec<(String, &Linear)>,
    stacked: Vec<(String, &StackedWeight)>,
) -> Result<(serde_json::Value, Vec<(String, Tensor)>)> {
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
    // Stacked weights by module, in the module's order (gate_up before down).
    let mut by_module: Vec<(String, Vec<StackedUpdate>)> = Vec::new();
    for (path, w) in &stacked {
        let Some(l) = &w.lora else { continue };
        let (module, param) = path.rsplit_once('.').unwrap_or(("", path));
        match by_module.iter_mut().find(|(m, _)| m == module) {
            Some((_, params)) => params.push((param.to_string(), l, w.weight.size()[0])),
            None => by_module.push((module.to_string(), vec![(param.to_string(), l, w.weight.size()[0])])),
        }
    }
    let mut parameters: Vec<String> = Vec::new();
    for (module, params) in &by_module {
        for (j, (param, l, experts)) in params.iter().enumerate() {
            let r = l.a.size()[0] / experts;
            rank_alpha.get_or_insert((r, l.scale * r as f64));
            let nest = "base_layer.".repeat(params.len() - 1 - j);
            tensors.push((format!("base_model.model.{module}.{nest}lora_A.weight"), l.a.f_detach()?.f_contiguous()?));
            tensors.push((format!("base_model.model.{module}.{nest}lora_B.weight"), l.b.f_detach()?.f_contiguous()?));
            // PEFT matches the end of `<module>.<param>`: the part after the layer index.
            let full = format!("{module}.{param}");
            let suffix = full
                .split_once(".layers.")
                .and_then(|(_, rest)| rest.split_once('.'))
                .map_or(full.as_str(), |(_, s)| s);
            parameters.push(suffix.to_string());
        }
    }
    parameters.dedup();
    let mut seen = std::collections::BTreeSet::new();
    parameters.retain(|p| seen.insert(p.clone()));
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
        "target_parameters": if parameters.is_empty() { serde_json::Value::Null } else { serde_json::json!(parameters) },
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "modules_to_save": null,
    });
    Ok((config, tensors))
}
