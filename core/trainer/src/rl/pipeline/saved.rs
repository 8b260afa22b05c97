//! The batches an asynchronous run sampled ahead, as a checkpoint stores them: each rank writes
//! its own part of every batch (`rollouts-ahead.rank-R-of-N.safetensors`) — the token ids, masks
//! and behaviour log-probs as tensors, everything else (step, version, rows, responses,
//! environment outcome) as JSON in a `u8` tensor `meta`.

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::worker::Finished;
use crate::error::{Result, TrainerError};
use crate::rl::env_stage::EnvOutcome;
use crate::rl::episode::EpisodeStats;
use crate::rl::observed::Observed;
use crate::rl::rollout::Rollout;
use crate::rl::shard::Part;
use rlhf_generation::Generated;

/// What the checkpoint stores under `what`.
pub const WHAT: &str = "rollouts-ahead";

#[derive(Serialize, Deserialize)]
struct Meta {
    index: usize,
    version: usize,
    prompt_len: i64,
    kept_rows: Vec<usize>,
    responses: Vec<(Vec<u32>, Vec<u32>)>,
    group_of_row: Vec<(usize, i64)>,
    part: (usize, usize, usize),
    behavior: bool,
    /// Rewards as bits, so every value survives exactly.
    env: Option<(Vec<u64>, Vec<EpisodeStats>, Option<String>)>,
    /// Per row, the images its episode's observations added.
    #[serde(default)]
    observed: Vec<Observed>,
    gen_s: f64,
}

/// The tensors of `batches`.
///
/// # Shapes
/// Per batch `i`: `b<i>.sequences`, `b<i>.attention_mask` `[N, P + R]` i64, `b<i>.response_mask`
/// `[N, R]` i64, `b<i>.behavior_logprobs` `[N, R]` f32; `meta` `[bytes]` u8.
pub fn to_tensors<'a>(batches: impl Iterator<Item = &'a Finished>) -> Result<Vec<(String, Tensor)>> {
    let (mut tensors, mut metas) = (Vec::new(), Vec::new());
    for (i, f) in batches.enumerate() {
        let g = &f.rollout.generated;
        let cpu = |t: &Tensor| t.f_to_device(Device::Cpu);
        tensors.push((format!("b{i}.sequences"), cpu(&g.sequences)?));
        tensors.push((format!("b{i}.attention_mask"), cpu(&g.attention_mask)?));
        tensors.push((format!("b{i}.response_mask"), cpu(&g.response_mask)?));
        if let Some(lp) = &f.rollout.behavior_logprobs {
            tensors.push((format!("b{i}.behavior_logprobs"), cpu(lp)?));
        }
        metas.push(Meta {
            index: f.index,
            version: f.version,
            prompt_len: g.prompt_len,
            kept_rows: f.rollout.kept_rows.clone(),
            responses: f.rollout.responses.clone(),
            group_of_row: f.group_of_row.clone(),
            part: (f.part.offset, f.part.rows, f.part.total),
            behavior: f.rollout.behavior_logprobs.is_some(),
            env: f
                .env
                .as_ref()
                .map(|e| (e.rewards.iter().map(|r| r.to_bits()).collect(), e.stats.clone(), e.first_error.clone())),
            observed: f.env.as_ref().map(|e| e.observed.clone()).unwrap_or_default(),
            gen_s: f.gen_s,
        });
    }
    let json = serde_json::to_vec(&metas).map_err(|e| TrainerError::Checkpoint(format!("{WHAT}: {e}")))?;
    tensors.push(("meta".into(), Tensor::f_from_slice(&json)?));
    Ok(tensors)
}

/// The batches stored in `tensors` (read from `file`), on `device`.
pub fn from_tensors(tensors: Vec<(String, Tensor)>, file: &str, device: Device) -> Result<Vec<Finished>> {
    let bad = |what: String| TrainerError::Checkpoint(format!("{file}: {what}"));
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    let meta = map.get("meta").ok_or_else(|| bad("no `meta` tensor".into()))?;
    let bytes = Vec::<u8>::try_from(meta.f_to_kind(Kind::Uint8)?).map_err(|e| bad(e.to_string()))?;
    let metas: Vec<Meta> = serde_json::from_slice(&bytes).map_err(|e| bad(format!("meta: {e}")))?;
    let mut out = Vec::with_capacity(metas.len());
    for (i, m) in metas.into_iter().enumerate() {
        let get = |name: &str| -> Result<Tensor> {
            let t = map.get(&format!("b{i}.{name}")).ok_or_else(|| bad(format!("no tensor b{i}.{name}")))?;
            Ok(t.f_to_device(device)?)
        };
        let generated = Generated {
            sequences: get("sequences")?,
            attention_mask: get("attention_mask")?,
            response_mask: get("response_mask")?,
            prompt_len: m.prompt_len,
            logprobs: None,
        };
        let behavior_logprobs = if m.behavior { Some(get("behavior_logprobs")?) } else { None };
        let rollout = Rollout { generated, kept_rows: m.kept_rows, responses: m.responses, behavior_logprobs };
        let observed = m.observed;
        let env = m.env.map(|(bits, stats, first_error)| EnvOutcome {
            rewards: bits.into_iter().map(f64::from_bits).collect(),
            stats,
            first_error,
            observed,
        });
        let (offset, rows, total) = m.part;
        out.push(Finished {
            index: m.index,
            version: m.version,
            rollout,
            env,
            group_of_row: m.group_of_row,
            part: Part { offset, rows, total },
            gen_s: m.gen_s,
        });
    }
    Ok(out)
}
