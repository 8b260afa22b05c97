//! `run.save_rollouts`: every scored sample of a step as one JSON line of
//! `<run_dir>/rollouts/step-<N>.jsonl` (verl's `trainer.rollout_data_dir`, TRL's
//! `log_completions`), with the sampled token ids exactly as sampled, so a user can read what the
//! policy answered and a test can compare two runs' samples token for token.

use std::path::{Path, PathBuf};

use rlhf_tokenizer::HfTokenizer;
use serde_json::json;
use tch::{Kind, Tensor};

use crate::error::Result;
use crate::rl::experience::Batch;

/// `<run_dir>/rollouts/step-<step>.jsonl`.
pub fn path(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join("rollouts").join(format!("step-{step}.jsonl"))
}

/// Writes the samples of step `step` (1-based) atomically: a temporary file renamed into place,
/// so a killed run never leaves half a file (a resumed run writes the step again).
///
/// # Shapes
/// `batch.sequences`, `batch.attention_mask` `[B, P + R]` i64; `batch.action_mask [B, R]` f32;
/// `batch.group_ids [B]` i64; `rewards` holds `B` values in the batch's row order. `version`: the
/// steps the sampling policy had trained (asynchronous rollouts), written on every line.
pub fn write(
    run_dir: &Path,
    step: usize,
    tok: &HfTokenizer,
    batch: &Batch,
    rewards: &[f64],
    version: Option<usize>,
) -> Result<()> {
    let rows = rows_of(&batch.sequences)?;
    let attention = rows_of(&batch.attention_mask)?;
    let actions = rows_of(&batch.action_mask.f_gt(0.0)?)?;
    let groups = Vec::<i64>::try_from(&batch.group_ids.f_to_kind(Kind::Int64)?)?;
    let p = batch.prompt_len as usize;
    let mut text = String::new();
    for (i, seq) in rows.iter().enumerate() {
        let prompt: Vec<u32> =
            seq[..p].iter().zip(&attention[i][..p]).filter(|(_, &m)| m != 0).map(|(&t, _)| t as u32).collect();
        let completion: Vec<u32> =
            seq[p..].iter().zip(&actions[i]).filter(|(_, &m)| m != 0).map(|(&t, _)| t as u32).collect();
        let mut line = json!({
            "step": step,
            "group": groups[i],
            "prompt": tok.decode(&prompt, false)?,
            "completion": tok.decode(&completion, true)?,
            "completion_ids": completion,
            "reward": rewards[i],
        });
        if let Some(v) = version {
            line["policy_version"] = json!(v);
        }
        // A multi-turn trajectory also has observation tokens: the whole response block and
        // which of its tokens were sampled.
        let real = &attention[i][p..];
        if real.iter().zip(&actions[i]).any(|(&a, &s)| a != 0 && s == 0) {
            let n = real.iter().filter(|&&a| a != 0).count();
            let ids: Vec<u32> = seq[p..p + n].iter().map(|&t| t as u32).collect();
            line["trajectory"] = json!(tok.decode(&ids, true)?);
            line["trajectory_ids"] = json!(ids);
            line["action_mask"] = json!(actions[i][..n]);
        }
        text.push_str(&line.to_string());
        text.push('\n');
    }
    crate::metrics::write_atomic(&path(run_dir, step), &text)
}

/// The rows of a 2-D tensor as integers.
///
/// # Shapes
/// `t [B, T]` (any kind) → `B` vectors of `T` values.
fn rows_of(t: &Tensor) -> Result<Vec<Vec<i64>>> {
    let t = t.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?;
    let width = t.size()[1] as usize;
    let flat = Vec::<i64>::try_from(&t.f_flatten(0, -1)?)?;
    Ok(if width == 0 {
        vec![Vec::new(); t.size()[0] as usize]
    } else {
        flat.chunks(width).map(<[i64]>::to_vec).collect()
    })
}
