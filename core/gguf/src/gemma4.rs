//! Gemma 4 (llama.cpp's `gemma4`) as llama.cpp's converter writes it, and the transformers
//! `Gemma4ForCausalLM` (`gemma4_text`) it comes back to. The converter changes no value (Gemma 4's
//! RMSNorm scales by `w`, not Gemma 3's `1 + w`); what it changes is where the hyper-parameters
//! live:
//!
//! - the full-attention layers' head size is `attention.key_length` (transformers'
//!   `global_head_dim`), the sliding layers' `attention.key_length_swa` (`head_dim`);
//! - `attention.head_count_kv` and `feed_forward_length` may hold one value per layer: the full
//!   layers' KV heads (`num_global_key_value_heads`), and twice the width on the layers that reuse
//!   another layer's keys and values (`use_double_wide_mlp`);
//! - the full layers' proportional RoPE (the first `partial_rotary_factor` of each head's frequency
//!   pairs rotate, with frequencies over the whole head size) is a `rope_freqs` tensor: a factor 1
//!   for each rotating pair and 1e30 (a frequency of zero) for the others;
//! - a full layer whose values are its keys (`attention_k_eq_v`) has no `attn_v`, a layer that
//!   reuses another's keys and values (the last `attention.shared_kv_layers`) no `attn_k`/`attn_v`;
//! - the per-layer input embeddings (`embedding_length_per_layer_input`) keep Gemma 3n's names
//!   (`per_layer_token_embd`, `blk.N.inp_gate`, ...); the router's `scale` and `per_expert_scale`
//!   become `ffn_gate_inp.scale` and `ffn_down_exps.scale`; `layer_scalar` becomes
//!   `layer_output_scale`.

use serde_json::{json, Map, Value};

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;
use crate::types::Value as GgufValue;

/// The largest size a hyper-parameter may give one dimension of a weight.
const MAX_DIM: u64 = 1 << 31;
/// A `rope_freqs` factor at least this large leaves its pair unrotated (the converter writes 1e30).
const UNROTATED: f32 = 1e20;

/// What a `gemma4` file says beyond the common hyper-parameters (whose `head_dim` and
/// `num_key_value_heads` are the sliding layers').
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Params {
    /// Which layers slide (`attention.sliding_window_pattern`).
    pub sliding: Vec<bool>,
    /// The full layers' head size (`attention.key_length`).
    pub global_head_dim: u64,
    /// The full layers' KV heads.
    pub global_kv_heads: u64,
    /// The sliding layers' head size (`attention.key_length_swa`) and KV heads, which are the
    /// config's `head_dim` and `num_key_value_heads`.
    pub sliding_head_dim: u64,
    pub sliding_kv_heads: u64,
    /// The full layers' values are their keys (no `attn_v`).
    pub k_eq_v: bool,
    /// Each layer's MLP width.
    pub ffn: Vec<u64>,
    /// The last layers reuse earlier layers' keys and values (`attention.shared_kv_layers`).
    pub shared_kv_layers: u64,
    /// Those layers' MLPs are twice as wide.
    pub double_wide: bool,
    /// Width of each layer's input embedding (`embedding_length_per_layer_input`; 0: none).
    pub per_layer_input: u64,
    /// Rows of `per_layer_token_embd`.
    pub per_layer_vocab: u64,
    /// Share of the full layers' frequency pairs that rotate (from `rope_freqs`).
    pub partial_rotary_factor: f64,
    /// The sliding layers' RoPE base (`rope.freq_base_swa`).
    pub rope_theta_sliding: f64,
}

/// The common hyper-parameters a Gemma 4 config repeats ([`Gemma4Params::config_keys`]).
pub(crate) struct ConfigBase {
    pub window: Option<u64>,
    pub softcap: Option<f64>,
    pub rope_theta: f64,
    pub vocab: u64,
    pub kv_heads: u64,
    pub moe: bool,
}

/// One value per layer of `key`: the number it holds for every layer, or its array of one per layer.
fn per_layer(g: &GgufFile, key: &str, layers: usize) -> Result<Option<Vec<u64>>> {
    let bad = |m: String| GgufError::metadata(g.path(), key, m);
    match g.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(_, items)) => {
            let values: Option<Vec<u64>> = items.iter().map(GgufValue::as_u64).collect();
            match values {
                Some(v) if v.len() == layers => Ok(Some(v)),
                Some(v) => Err(bad(format!("{} values for {layers} layers", v.len()))),
                None => Err(bad("expected non-negative integers".into())),
            }
        }
        Some(v) => {
            v.as_u64().map(|n| Some(vec![n; layers])).ok_or_else(|| bad(format!("expected a number, got {v:?}")))
        }
    }
}

/// The one value of `values` on the layers `pick` selects (`None` where it selects none).
fn one_value(g: &GgufFile, key: &str, values: &[u64], pick: impl Fn(usize) -> bool, what: &str) -> Result<Option<u64>> {
    let mut chosen = values.iter().enumerate().filter(|(i, _)| pick(*i)).map(|(_, v)| *v);
    let first = chosen.next();
    match chosen.find(|v| Some(*v) != first) {
        Some(other) => Err(GgufError::unsupported(
            g.path(),
            format!(
                "`{key}`: the {what} layers have {} and {other} (one value per layer kind is supported)",
                first.unwrap_or(0)
            ),
        )),
        None => Ok(first),
    }
}

impl Gemma4Params {
    /// Reads a `gemma4` file's layers; `None` for other architectures. `heads`: attention heads.
    pub(crate) fn from_gguf(g: &GgufFile, arch: &str, heads: u64) -> Result<Option<Self>> {
        if arch != "gemma4" {
            return Ok(None);
        }
        let path = g.path();
        let k = |name: &str| format!("{arch}.{name}");
        let layers = g.req_u64(&k("block_count"))?;
        if layers == 0 || layers > g.tensors.len() as u64 {
            return Err(GgufError::metadata(
                path,
                &k("block_count"),
                format!("{layers} layers, but the file has {} tensors", g.tensors.len()),
            ));
        }
        let n = layers as usize;
        let pattern = k("attention.sliding_window_pattern");
        if g.get(&pattern).is_none() {
            return Err(GgufError::metadata(path, &pattern, "missing (which layers slide)"));
        }
        let sliding = crate::olmo3::sliding_layers(g, arch, layers)?;
        if sliding[n - 1] {
            return Err(GgufError::unsupported(
                path,
                format!("`{pattern}`: the last layer slides; transformers' Gemma 4 makes it full attention"),
            ));
        }
        let dim = |key: &str| -> Result<u64> {
            let d = g.opt_u64(&k(key))?.ok_or_else(|| GgufError::metadata(path, &k(key), "missing"))?;
            if d == 0 || d % 2 != 0 || d > MAX_DIM {
                return Err(GgufError::metadata(path, &k(key), format!("{d} (expected an even size)")));
            }
            Ok(d)
        };
        let (global, local) = (dim("attention.key_length")?, dim("attention.key_length_swa")?);
        for (key, want) in [("attention.value_length", global), ("attention.value_length_swa", local)] {
            if let Some(v) = g.opt_u64(&k(key))?.filter(|v| *v != want) {
                return Err(GgufError::unsupported(
                    path,
                    format!("`{}` {v} differs from the key length {want}", k(key)),
                ));
            }
        }
        for (key, want) in [("rope.dimension_count", global), ("rope.dimension_count_swa", local)] {
            if let Some(v) = g.opt_u64(&k(key))?.filter(|v| *v != want) {
                return Err(GgufError::unsupported(
                    path,
                    format!("`{}` {v}: RoPE over {v} of {want} dimensions is not Gemma 4's", k(key)),
                ));
            }
        }
        if let Some(t) = g.opt_str(&k("rope.scaling.type"))?.filter(|t| *t != "none") {
            return Err(GgufError::unsupported(path, format!("rope scaling `{t}` is not supported for gemma4")));
        }
        let kv = per_layer(g, &k("attention.head_count_kv"), n)?.unwrap_or_else(|| vec![heads; n]);
        let kv_key = k("attention.head_count_kv");
        let local_kv = one_value(g, &kv_key, &kv, |i| sliding[i], "sliding")?.unwrap_or(heads);
        let global_kv = one_value(g, &kv_key, &kv, |i| !sliding[i], "full")?.unwrap_or(heads);
        for h in [local_kv, global_kv] {
            if h == 0 || heads % h != 0 || h.checked_mul(global.max(local)).is_none_or(|r| r > MAX_DIM) {
                return Err(GgufError::metadata(path, &kv_key, format!("{h} key/value heads for {heads} heads")));
            }
        }
        let shared = g.opt_u64(&k("attention.shared_kv_layers"))?.unwrap_or(0);
        if shared >= layers {
            return Err(GgufError::metadata(
                path,
                &k("attention.shared_kv_layers"),
                format!("{shared} of {layers} layers: at least one layer must compute its keys and values"),
            ));
        }
        let first_shared = n - shared as usize;
        let ffn_key = k("feed_forward_length");
        let ffn = per_layer(g, &ffn_key, n)?.ok_or_else(|| GgufError::metadata(path, &ffn_key, "missing"))?;
        let base = ffn[0];
        let wide = ffn[first_shared..].first().copied().unwrap_or(base);
        let double_wide = wide != base;
        let expected = |i: usize| if i >= first_shared && double_wide { 2 * base } else { base };
        if base == 0 || base > MAX_DIM || ffn.iter().enumerate().any(|(i, w)| *w != expected(i)) {
            return Err(GgufError::unsupported(
                path,
                format!("`{ffn_key}` {ffn:?}: one width, or twice it on the last {shared} layers, is what Gemma 4 has"),
            ));
        }
        // A full layer without `attn_v` takes its values from its keys.
        let with_v: Vec<bool> = (0..first_shared)
            .filter(|&i| !sliding[i])
            .map(|i| g.tensor(&format!("blk.{i}.attn_v.weight")).is_some())
            .collect();
        if with_v.iter().any(|v| *v) && with_v.iter().any(|v| !*v) {
            return Err(GgufError::invalid(path, "some full-attention layers have `attn_v` and others do not"));
        }
        let k_eq_v = with_v.first().is_some_and(|v| !*v);
        let (per_layer_input, per_layer_vocab) = per_layer_inputs(g, arch, layers)?;
        Ok(Some(Gemma4Params {
            sliding,
            global_head_dim: global,
            global_kv_heads: global_kv,
            sliding_head_dim: local,
            sliding_kv_heads: local_kv,
            k_eq_v,
            ffn,
            shared_kv_layers: shared,
            double_wide,
            per_layer_input,
            per_layer_vocab,
            partial_rotary_factor: rotary_share(g, global)?,
            rope_theta_sliding: g.opt_f64(&k("rope.freq_base_swa"))?.unwrap_or(10_000.0),
        }))
    }

    /// Whether layer `l` reuses an earlier layer's keys and values.
    pub(crate) fn shares_kv(&self, l: usize) -> bool {
        l >= self.sliding.len() - self.shared_kv_layers as usize
    }

    /// What a Gemma 4 config adds: the layer kinds and head sizes, the shared keys and values, the
    /// per-layer inputs, a rope block per layer kind (the full layers' at `rope_theta`), whether
    /// it has experts (their sizes are the common MoE keys'). `window`, `softcap`: the file's
    /// sliding window and final soft-capping; `vocab`, `kv_heads`: the config's `vocab_size` and
    /// `num_key_value_heads`.
    pub(crate) fn config_keys(&self, c: ConfigBase) -> Value {
        let layer_types: Vec<&str> =
            self.sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
        let mut keys = json!({
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": layer_types,
            "sliding_window": c.window,
            "final_logit_softcapping": c.softcap,
            "global_head_dim": self.global_head_dim,
            "attention_k_eq_v": self.k_eq_v,
            "num_kv_shared_layers": self.shared_kv_layers,
            "use_double_wide_mlp": self.double_wide,
            "hidden_size_per_layer_input": self.per_layer_input,
            "vocab_size_per_layer_input": if self.per_layer_input > 0 { self.per_layer_vocab } else { c.vocab },
            "attention_bias": false,
            "use_bidirectional_attention": null,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": self.partial_rotary_factor,
                    "rope_theta": c.rope_theta,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_theta_sliding},
            },
            "enable_moe_block": c.moe,
        });
        if self.k_eq_v {
            keys["num_global_key_value_heads"] = json!(self.global_kv_heads);
        } else if self.global_kv_heads != c.kv_heads {
            // Without `attention_k_eq_v`, transformers reads the full layers' KV heads per layer only.
            let over: Map<String, Value> = (0..self.sliding.len())
                .filter(|&i| !self.sliding[i])
                .map(|i| {
                    (
                        i.to_string(),
                        json!({"head_dim": self.global_head_dim, "num_key_value_heads": self.global_kv_heads}),
                    )
                })
                .collect();
            keys["per_layer_config"] = Value::Object(over);
        }
        keys
    }
}

/// The width of each layer's input embedding (`embedding_length_per_layer_input`; 0: none) and the
/// rows of `per_layer_token_embd`, checked against each other.
fn per_layer_inputs(g: &GgufFile, arch: &str, layers: u64) -> Result<(u64, u64)> {
    let path = g.path();
    let per_layer_input = g.opt_u64(&format!("{arch}.embedding_length_per_layer_input"))?.unwrap_or(0);
    let per_layer_vocab = if per_layer_input == 0 {
        0
    } else {
        let t = g
            .tensor("per_layer_token_embd.weight")
            .ok_or_else(|| GgufError::invalid(path, "per-layer inputs without `per_layer_token_embd.weight`"))?;
        if t.dims.len() != 2 || Some(t.dims[0]) != per_layer_input.checked_mul(layers) {
            return Err(GgufError::invalid(
                path,
                format!(
                    "`per_layer_token_embd.weight` has dims {:?}, expected [{layers} × {per_layer_input}, vocab]",
                    t.dims
                ),
            ));
        }
        t.dims[1]
    };
    Ok((per_layer_input, per_layer_vocab))
}

/// The full layers' rotating share of frequency pairs, from `rope_freqs.weight`: factors of 1 for
/// the pairs that rotate, then factors of at least 1e20 (1e30 as written) for those that do not.
/// Without the tensor every pair rotates.
fn rotary_share(g: &GgufFile, global_head_dim: u64) -> Result<f64> {
    let path = g.path();
    let Some(t) = g.tensor("rope_freqs.weight") else { return Ok(1.0) };
    let pairs = global_head_dim / 2;
    if t.dims != [pairs] {
        return Err(GgufError::invalid(
            path,
            format!("`rope_freqs.weight` has dims {:?}, expected [{pairs}] (half the full layers' head size)", t.dims),
        ));
    }
    let factors = g.dequantize(t)?;
    let rotating = factors.iter().take_while(|f| **f == 1.0).count();
    if let Some(f) = factors[rotating..].iter().find(|f| f.is_nan() || **f < UNROTATED) {
        return Err(GgufError::unsupported(
            path,
            format!(
                "`rope_freqs.weight` holds the factor {f} after {rotating} ones: only proportional RoPE (ones, then 1e30 \
                 for the pairs that do not rotate) is Gemma 4's"
            ),
        ));
    }
    Ok(rotating as f64 / pairs as f64)
}
