//! Qwen3.5, Qwen3.5-MoE and Qwen3-Next (llama.cpp's `qwen35`, `qwen35moe`, `qwen3next`): hybrid
//! models in which every `full_attention_interval`-th layer is gated full attention and the others
//! are Gated DeltaNet linear attention (Yang et al. 2024). What llama.cpp's converter does to their
//! tensors, and what the importer does to undo it:
//!
//! - Every RMSNorm but the gated output norm (`ssm_norm`) scales by `1 + w` in transformers and
//!   by `w` in ggml: the converter stores `1 + w`, the importer takes the one off
//!   ([`crate::layout::norm_shifted`]).
//! - `A_log` is stored as `A = −exp(A_log)` (`ssm_a`, what ggml multiplies by): back with
//!   `ln(−A)` ([`a_log`]); `dt_bias` as `ssm_dt.bias`; the depthwise convolution's `[channels, 1,
//!   kernel]` weight squeezed to `[channels, kernel]`.
//! - Qwen3.5 only: with fewer key heads than value heads, the value heads are reordered from
//!   grouped by key head (`[k0: v0 v1, k1: v0 v1]`, transformers' order, which `repeat_interleave`
//!   of the keys matches) to tiled (`[k0 v0, k1 v0, k0 v1, k1 v1]`, what ggml's broadcast
//!   matches): the value rows of `in_proj_qkv` and of the convolution, `in_proj_z`, `in_proj_a`,
//!   `in_proj_b`, `A_log`, `dt_bias`, and the columns of `out_proj`. [`untile`] puts them back.
//! - Qwen3-Next's `in_proj_qkvz` is grouped by key head (per key head its q, k, v and z rows);
//!   the converter splits it into `attn_qkv` (all q rows, then k, then v) and `attn_gate` (z),
//!   which [`qkvz_grouped`] regroups; older files keep it whole as `ssm_in`. `in_proj_ba` stays
//!   grouped (`ssm_ba`).
//! - Qwen3.5's multi-token-prediction layers follow the decoder's as extra blocks
//!   (`nextn_predict_layers`): transformers' causal LM does not load them, nor does the import.
//!
//! The experts are written stacked, as the Hub's Qwen3.5-MoE checkpoints store them
//! (`mlp.experts.gate_up_proj: [experts, 2 · inter, hidden]`, gate rows first, and
//! `mlp.experts.down_proj: [experts, hidden, inter]`), which transformers and `rlhf-models` read
//! for Qwen3-Next too.

use serde_json::{json, Value};

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;
use crate::transform::Transform;

/// The architectures read here.
pub(crate) const ARCHITECTURES: [&str; 3] = ["qwen35", "qwen35moe", "qwen3next"];

/// The largest size a hyper-parameter may give one dimension of a weight.
const MAX_DIM: u64 = 1 << 31;

/// The linear attention of a `qwen35`, `qwen35moe` or `qwen3next` file (`ssm.*`,
/// `full_attention_interval`, `nextn_predict_layers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearParams {
    /// `ssm.conv_kernel`: the causal convolution's width.
    pub conv_kernel: u64,
    /// `ssm.group_count` and `ssm.state_size`.
    pub key_heads: u64,
    pub key_head_dim: u64,
    /// `ssm.time_step_rank`, and `ssm.inner_size` over it.
    pub value_heads: u64,
    pub value_head_dim: u64,
    /// Layer `i` is full attention when `(i + 1) % interval == 0` (llama.cpp's default 4).
    pub full_attention_interval: u64,
    /// Multi-token-prediction blocks after the decoder's (`nextn_predict_layers`), left out.
    pub mtp_layers: u64,
    /// Whether the converter tiled the value heads (Qwen3.5, not Qwen3-Next).
    pub tiled: bool,
}

impl LinearParams {
    /// Reads a hybrid file's linear attention, checked; `None` for the other architectures.
    pub(crate) fn from_gguf(g: &GgufFile, arch: &str, block_count: u64) -> Result<Option<Self>> {
        if !ARCHITECTURES.contains(&arch) {
            return Ok(None);
        }
        let path = g.path();
        let k = |name: &str| format!("{arch}.{name}");
        let bounded = |key: &str| -> Result<u64> {
            let n = g.req_u64(&k(key))?;
            if n == 0 || n > MAX_DIM {
                return Err(GgufError::metadata(path, &k(key), format!("{n} (expected 1 to {MAX_DIM})")));
            }
            Ok(n)
        };
        let (conv_kernel, key_heads, key_head_dim) =
            (bounded("ssm.conv_kernel")?, bounded("ssm.group_count")?, bounded("ssm.state_size")?);
        let (value_heads, inner) = (bounded("ssm.time_step_rank")?, bounded("ssm.inner_size")?);
        if value_heads % key_heads != 0 {
            return Err(GgufError::metadata(
                path,
                &k("ssm.time_step_rank"),
                format!("{value_heads} value heads are not a multiple of the {key_heads} key heads"),
            ));
        }
        if inner % value_heads != 0 {
            return Err(GgufError::metadata(
                path,
                &k("ssm.inner_size"),
                format!("{inner} is not a multiple of the {value_heads} value heads"),
            ));
        }
        if key_heads.checked_mul(key_head_dim).is_none_or(|n| 2 * n + inner > MAX_DIM) {
            return Err(GgufError::metadata(
                path,
                &k("ssm.group_count"),
                format!("{key_heads} key heads of dimension {key_head_dim} give more than {MAX_DIM} rows"),
            ));
        }
        let interval = g.opt_u64(&k("full_attention_interval"))?.unwrap_or(4);
        if interval == 0 {
            return Err(GgufError::metadata(path, &k("full_attention_interval"), "0 (expected at least 1)"));
        }
        let mtp_layers = g.opt_u64(&k("nextn_predict_layers"))?.unwrap_or(0);
        if mtp_layers >= block_count {
            return Err(GgufError::metadata(
                path,
                &k("nextn_predict_layers"),
                format!("{mtp_layers}, but the file has {block_count} blocks in all"),
            ));
        }
        Ok(Some(LinearParams {
            conv_kernel,
            key_heads,
            key_head_dim,
            value_heads,
            value_head_dim: inner / value_heads,
            full_attention_interval: interval,
            mtp_layers,
            tiled: arch != "qwen3next",
        }))
    }

    /// Whether layer `i` is full attention.
    pub(crate) fn is_full(&self, layer: u64) -> bool {
        (layer + 1) % self.full_attention_interval == 0
    }

    /// The convolution's channels: q, k and v.
    pub(crate) fn conv_dim(&self) -> u64 {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }

    /// The value heads each key head serves.
    pub(crate) fn per_key(&self) -> u64 {
        self.value_heads / self.key_heads
    }

    /// A reordering from tiled value heads back to grouped ones, from row (or column) `start` on,
    /// heads of `head_dim` rows; plain where the converter did not tile or there is nothing to do.
    pub(crate) fn untile(&self, start: u64, head_dim: u64) -> Transform {
        if self.tiled && self.per_key() > 1 {
            Transform::Untile { start, head_dim }
        } else {
            Transform::Plain
        }
    }

    /// The same for columns (`out_proj`'s inputs).
    pub(crate) fn untile_columns(&self, head_dim: u64) -> Transform {
        match self.untile(0, head_dim) {
            Transform::Untile { head_dim, .. } => Transform::UntileColumns { head_dim },
            t => t,
        }
    }

    /// What the config adds for these models: the kinds of `layers` layers and the linear
    /// attention's sizes.
    pub(crate) fn config_keys(&self, layers: u64) -> Value {
        let layer_types: Vec<&str> =
            (0..layers).map(|i| if self.is_full(i) { "full_attention" } else { "linear_attention" }).collect();
        json!({
            "layer_types": layer_types,
            "linear_conv_kernel_dim": self.conv_kernel,
            "linear_key_head_dim": self.key_head_dim,
            "linear_value_head_dim": self.value_head_dim,
            "linear_num_key_heads": self.key_heads,
            "linear_num_value_heads": self.value_heads,
        })
    }
}

/// Whether this HF tensor is `A_log`, which llama.cpp stores as `−exp(A_log)`.
pub(crate) fn is_a_log(hf_name: &str) -> bool {
    hf_name.ends_with("linear_attn.A_log")
}

/// `A_log = ln(−A)` from llama.cpp's `A`; an `A` that is not negative cannot come from its
/// converter and is refused by the caller.
pub(crate) fn a_log(values: &mut [f32]) -> std::result::Result<(), f32> {
    if let Some(bad) = values.iter().find(|a| !(**a < 0.0 && a.is_finite())) {
        return Err(*bad);
    }
    values.iter_mut().for_each(|a| *a = (-*a).ln());
    Ok(())
}

/// Rows (`along_rows`) or columns of `data` (`[rows, cols]`) from `start` on, in heads of
/// `head_dim`, back from llama.cpp's tiled order to transformers' grouped one: the head at tiled
/// position `j · key_heads + g` is transformers' head `g · per_key + j`.
pub(crate) fn untile(
    data: &[f32],
    rows: usize,
    (start, head_dim): (usize, usize),
    (key_heads, per_key): (usize, usize),
    along_rows: bool,
) -> Vec<f32> {
    let cols = data.len() / rows;
    let mut out = data.to_vec();
    let grouped = |tiled: usize| {
        let (head, d) = (tiled / head_dim, tiled % head_dim);
        let (j, g) = (head / key_heads, head % key_heads);
        (g * per_key + j) * head_dim + d
    };
    let n = key_heads * per_key * head_dim;
    for t in 0..n {
        let (from, to) = (start + t, start + grouped(t));
        if along_rows {
            out[to * cols..(to + 1) * cols].copy_from_slice(&data[from * cols..(from + 1) * cols]);
        } else {
            for r in 0..rows {
                out[r * cols + to] = data[r * cols + from];
            }
        }
    }
    out
}

/// Qwen3-Next's `in_proj_qkvz` (`[key_heads · (2 · dk + 2 · per_key · dv), cols]`, per key head its
/// q, k, v and z rows) from the converter's `attn_qkv` (all q rows, all k rows, all v rows) and
/// `attn_gate` (all z rows).
pub(crate) fn qkvz_grouped(qkv: &[f32], z: &[f32], l: &LinearParams) -> Vec<f32> {
    let (nk, dk) = (l.key_heads as usize, l.key_head_dim as usize);
    let vz = l.per_key() as usize * l.value_head_dim as usize; // v (or z) rows per key head
    let rows = 2 * nk * dk + nk * vz;
    let cols = qkv.len() / rows;
    let mut out = Vec::with_capacity(qkv.len() + z.len());
    for g in 0..nk {
        let q = &qkv[g * dk * cols..(g + 1) * dk * cols];
        let k = &qkv[(nk + g) * dk * cols..(nk + g + 1) * dk * cols];
        let v = &qkv[(2 * nk * dk + g * vz) * cols..(2 * nk * dk + (g + 1) * vz) * cols];
        out.extend_from_slice(q);
        out.extend_from_slice(k);
        out.extend_from_slice(v);
        out.extend_from_slice(&z[g * vz * cols..(g + 1) * vz * cols]);
    }
    out
}
