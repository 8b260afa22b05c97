//! LoRA (Hu et al. 2021, PEFT's conventions): `y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ` on the
//! targeted linear layers, `A: [r, in]` drawn like PEFT (kaiming-uniform, bound 1/√in), `B: [out, r]`
//! zero so training starts from the base model. Applying LoRA freezes every base weight; only the
//! adapters (and a scalar model's `score` head) train. Saving writes the merged plain weights
//! `W + (α / r) B A` under the base names, so the output is an ordinary Hugging Face checkpoint.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

use crate::error::{ModelError, Result};

/// LoRA settings (`[lora]` in the SFT, RM and RL configs). `rank = 0` disables LoRA.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Adapter rank r; 0 = full fine-tuning.
    pub rank: i64,
    /// Scale numerator α (the update is scaled by α / r).
    pub alpha: f64,
    /// Dropout on the adapter's input while training.
    pub dropout: f64,
    /// Module names to adapt, matched against the end of the weight path (`q_proj` matches
    /// `model.layers.3.self_attn.q_proj`; `attn.c_proj` only GPT-2's attention output), or
    /// `all-linear` for every linear layer of the backbone.
    pub target_modules: Vec<String>,
    /// Stacked expert weights to adapt (PEFT's `target_parameters`), matched against the end of
    /// their path (`mlp.experts.gate_up_proj`, `experts.down_proj`): one rank-r update per expert.
    pub target_parameters: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 0,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            target_parameters: Vec::new(),
        }
    }
}

impl LoraConfig {
    /// Whether LoRA is on.
    pub fn enabled(&self) -> bool {
        self.rank > 0
    }

    /// Checks the values; errors name the key under `lora.`.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, msg: String| Err(ModelError::Input(format!("lora.{key}: {msg}")));
        if self.rank < 0 {
            return bad("rank", format!("must be >= 0, got {}", self.rank));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad("alpha", format!("must be > 0, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("must be in [0, 1), got {}", self.dropout));
        }
        if self.enabled() && self.target_modules.is_empty() && self.target_parameters.is_empty() {
            return bad("target_modules", "must name at least one module".into());
        }
        if !self.target_parameters.is_empty() && self.dropout > 0.0 {
            // As PEFT: the update of a weight cannot see the inputs, so they cannot be dropped.
            return bad("dropout", "must be 0 with target_parameters (an update of the weight sees no input)".into());
        }
        Ok(())
    }

    pub(crate) fn matches(&self, path: &str) -> bool {
        self.target_modules.iter().any(|t| t == "all-linear" || path == t || path.ends_with(&format!(".{t}")))
    }

    /// Whether the stacked weight at `path` is one of `target_parameters`.
    pub(crate) fn matches_parameter(&self, path: &str) -> bool {
        self.target_parameters.iter().any(|t| path == t || path.ends_with(&format!(".{t}")))
    }
}

/// The low-rank update of one linear layer.
#[derive(Debug)]
pub struct LoraAdapter {
    /// `[r, in]`
    pub a: Tensor,
    /// `[out, r]`
    pub b: Tensor,
    /// α / r
    pub scale: f64,
    pub(crate) dropout: f64,
    pub(crate) training: Arc<AtomicBool>,
    /// While set, the layer computes the base weight alone (a DPO reference without a second copy).
    pub(crate) disabled: Arc<AtomicBool>,
}

impl LoraAdapter {
    /// The update for `x`.
    ///
    /// # Shapes
    /// - `x`: `[..., in]` → `[..., out]`
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.dropout > 0.0 && self.training.load(Ordering::Relaxed) {
            x.f_dropout(self.dropout, true)?
        } else {
            x.shallow_clone()
        };
        Ok(x.f_linear::<&Tensor>(&self.a, None)?.f_linear::<&Tensor>(&self.b, None)?.f_mul_scalar(self.scale)?)
    }

    /// Whether the update is switched off ([`crate::CausalLm::with_adapters_disabled`]).
    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// `(α / r) B A` in the layout of the base weight (`[out, in]`, or `[in, out]` when `transposed`).
    pub fn delta(&self, transposed: bool) -> Result<Tensor> {
        let d = self.b.f_matmul(&self.a)?.f_mul_scalar(self.scale)?;
        Ok(if transposed { d.f_transpose(0, 1)? } else { d })
    }
}

/// The low-rank updates of a stacked expert weight `W: [experts, d₁, d₂]`, one per expert, as
/// PEFT's `target_parameters` computes them: `A: [experts · r, d₁]` (expert-major rows), `B: [d₂,
/// r · experts]` (rank-major columns), `ΔW[e, i, o] = (α / r) Σₖ B[o, k·E + e] A[e·r + k, i]`.
#[derive(Debug)]
pub struct ExpertLora {
    pub a: Tensor,
    pub b: Tensor,
    /// α / r
    pub scale: f64,
    pub(crate) disabled: Arc<AtomicBool>,
}

impl ExpertLora {
    /// `ΔW`, `[experts, d₁, d₂]`.
    pub fn delta(&self, experts: i64) -> Result<Tensor> {
        let (d1, d2) = (self.a.size()[1], self.b.size()[0]);
        let a = self.a.f_view([experts, -1, d1])?; // [E, r, d₁]
        let b = self.b.f_view([d2, -1, experts])?; // [d₂, r, E]
        Ok(Tensor::f_einsum("ore,eri->eio", &[b, a], None::<&[i64]>)?.f_mul_scalar(self.scale)?)
    }

    /// Whether the update is switched off ([`crate::CausalLm::with_adapters_disabled`]).
    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }
}

/// A stacked expert weight `[experts, d₁, d₂]` and its LoRA update where it has one.
#[derive(Debug)]
pub struct StackedWeight {
    pub weight: Tensor,
    pub lora: Option<ExpertLora>,
}

impl StackedWeight {
    pub fn new(weight: Tensor) -> Self {
        StackedWeight { weight, lora: None }
    }

    /// The weight the experts compute with: `W + ΔW` while an update is on, else `W`.
    ///
    /// # Shapes
    /// returns `[experts, d₁, d₂]`
    pub fn effective(&self) -> Result<Tensor> {
        match &self.lora {
            Some(l) if !l.is_disabled() => {
                Ok(self.weight.f_add(&l.delta(self.weight.size()[0])?.f_to_kind(self.weight.kind())?)?)
            }
            _ => Ok(self.weight.shallow_clone()),
        }
    }
}

/// Whether `name` is a LoRA adapter variable (not saved in merged checkpoints).
pub(crate) fn is_adapter_var(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

/// Counts of trainable and total parameters of `vs` (for the log line PEFT users expect).
pub fn parameter_counts(vs: &nn::VarStore) -> (i64, i64) {
    let (mut trainable, mut total) = (0, 0);
    for (_, t) in vs.variables() {
        let n = t.numel() as i64;
        total += n;
        if t.requires_grad() {
            trainable += n;
        }
    }
    (trainable, total)
}
