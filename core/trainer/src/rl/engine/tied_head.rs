//! Policies whose output head is tied to the input embeddings (SmolLM2, Qwen2.5-0.5B, Qwen3-0.6B,
//! the built-in models) on vLLM. vLLM 0.32's `reload_weights` reloads layer by layer into fresh
//! storage and skips `lm_head.weight` of a tied model (its checkpoints store none), so the head
//! keeps the weights the server started with while the embeddings move on: a sync that looks
//! done serves a policy the trainer never had, and the probe notices only once the difference
//! grows past its tolerance. (Measured: a reload that tripled the embeddings left a probe token's
//! log-prob at -1.63 where a server started on those weights gives -0.08.)
//!
//! So a full sync of a tied policy writes its head too, under `lm_head.weight`, with
//! `tie_word_embeddings = false` — the version a server with an untied head loads whole — and the
//! first sync checks, with a canary version whose head is zero, that every server has an untied
//! head: it must then give every token the log-prob `-ln V`. A server started on the tied
//! checkpoint does not, and is refused with what to do.

use std::collections::BTreeMap;
use std::path::Path;

use rlhf_models::CausalLm;
use serde_json::Value;
use tch::{Device, Tensor};

use crate::error::{Result, TrainerError};

/// The file of the head a tied policy's version adds.
const HEAD_FILE: &str = "lm_head.safetensors";

/// How close to `-ln V` the canary's probe log-prob must be.
const CANARY_TOLERANCE: f64 = 1e-3;

/// Adds `head` (`[vocab, hidden]`) as `lm_head.weight` to the checkpoint in `dir` (listed in its
/// shard index if it has one) and marks the config untied.
pub fn write_head(dir: &Path, head: &Tensor) -> Result<()> {
    let head = head.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let tensors = BTreeMap::from([("lm_head.weight".to_string(), head)]);
    rlhf_models::weights::save_safetensors_file(&dir.join(HEAD_FILE), &tensors)?;
    let index = dir.join(rlhf_models::weights::INDEX_FILE);
    if index.is_file() {
        let mut v = read_json(&index)?;
        if let Some(map) = v.get_mut("weight_map").and_then(Value::as_object_mut) {
            map.insert("lm_head.weight".into(), Value::from(HEAD_FILE));
        }
        rlhf_models::weights::write_json(&index, &v)?;
    }
    let config = dir.join("config.json");
    let mut v = read_json(&config)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("tie_word_embeddings".into(), Value::Bool(false));
        if let Some(text) = o.get_mut("text_config").and_then(Value::as_object_mut) {
            text.insert("tie_word_embeddings".into(), Value::Bool(false));
        }
    }
    Ok(rlhf_models::weights::write_json(&config, &v)?)
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainerError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| TrainerError::Run(format!("{}: {e}", path.display())))
}

/// Writes the canary version of `actor` into `dir`: its weights with a head of zeros, under
/// which every token has the log-prob `-ln V`.
pub fn write_canary(actor: &CausalLm, dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    actor.save(dir)?;
    write_head(dir, &actor.lm_head_weight().f_zeros_like()?)
}

/// Checks a server's log-prob of the probe token under the canary: `-ln V` when its head took the
/// zeros; otherwise its head is still tied, and the message says what to do.
pub fn check_canary(url: &str, logprob: f64, vocab: i64) -> Result<()> {
    let want = -(vocab as f64).ln();
    if (logprob - want).abs() <= CANARY_TOLERANCE {
        return Ok(());
    }
    Err(TrainerError::Run(format!(
        "rollout.vllm: {url} serves the policy with its output head tied to the embeddings (a canary \
         version with a zero head gave the probe token the log-prob {logprob:.6}, not -ln {vocab} = {want:.6}), and \
         vLLM's reload_weights leaves a tied head stale: start the server on a copy of the model with untied \
         embeddings (`tie_word_embeddings: false` and an `lm_head.weight`; docs/rollout-engines.md)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canary_passes_at_minus_ln_v_only() {
        assert!(check_canary("http://h:1", -(10f64).ln() + 1e-4, 10).is_ok());
        let e = check_canary("http://h:1", -1.7, 10).unwrap_err().to_string();
        assert!(e.contains("http://h:1 serves the policy with its output head tied") && e.contains("-ln 10"), "{e}");
    }
}
