//! What the family tests share: the tiny random checkpoints of the newer families
//! (`fixtures/make_families.py`), loading them, and the tolerances against transformers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use rlhf_integration_tests::{family_models, python};
use rlhf_models::CausalLm;
use tch::{Device, Kind, Tensor};

/// The largest logit difference tolerated, as in `transformers_parity.rs`.
pub const TOL: f64 = 1e-4;

/// The same for the Gated DeltaNet families (Qwen3.5, Qwen3-Next): the chunked delta rule's f32
/// rounding differs between CPU kinds more than attention's — 1.1e-5 to 2.8e-5 on most, up to
/// 2.6e-4 measured on an AMD EPYC with AVX2 only, where transformers' own f32 logits were 2.3e-4 from its f64
/// ones (logits of about 15; a wrong formula is off by 1e-2 and more).
pub const LINEAR_TOL: f64 = 5e-4;

/// The tolerance for family `name`'s logits: [`TOL`] ([`LINEAR_TOL`] with linear attention), or
/// twice transformers' own f32 error where the fixture measured it (`reference.json`'s `key`).
pub fn tol_for(name: &str, dir: &Path, key: &str) -> f64 {
    let base = if name.starts_with("qwen3_5") || name == "qwen3_next" { LINEAR_TOL } else { TOL };
    base.max(measured_tol(dir, key))
}

pub fn reference(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

pub fn load(dir: &Path) -> CausalLm {
    CausalLm::from_dir(dir, Device::Cpu, Kind::Float).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Max |a − b| where `mask` is 1 (`a`, `b`: `[batch, seq, ...]`, `mask`: `[batch, seq]`).
pub fn masked_max_abs_diff(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let mut m = mask.to_kind(Kind::Bool);
    while m.dim() < a.dim() {
        m = m.unsqueeze(-1);
    }
    (a - b).abs().masked_fill(&m.logical_not(), 0.0).max().double_value(&[])
}

/// The models, or `None` (skipped outside CI) without Python.
pub fn models() -> Option<&'static Path> {
    python().map(|p| family_models(&p))
}

/// [`TOL`], or twice transformers' own f32 error (from f64) where the fixture measured it
/// (`reference.json`'s `key`): a reference cannot be matched closer than it is itself.
pub fn measured_tol(dir: &Path, key: &str) -> f64 {
    let own = rlhf_integration_tests::read_json(&dir.join("reference.json"))[key].as_f64().unwrap_or(0.0);
    TOL.max(2.0 * own)
}
