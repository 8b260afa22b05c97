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
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig { rank: 0, alpha: 16.0, dropout: 0.0, target_modules: vec!["q_proj".into(), "v_proj".into()] }
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
        if self.enabled() && self.target_modules.is_empty() {
            return bad("target_modules", "must name at least one module".into());
        }
        Ok(())
    }

    pub(crate) fn matches(&self, path: &str) -> bool {
        self.target_modules.iter().any(|t| t == "all-linear" || path == t || path.ends_with(&format!(".{t}")))
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
