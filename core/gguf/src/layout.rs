//! llama.cpp's tensor names and layout, and transformers' for the same weights.
//!
//! Two things differ between llama.cpp's layout and transformers' besides names:
//!
//! - Dimensions are stored innermost first, so a GGUF `[in, out]` is the HF `[out, in]` weight;
//!   the data is already row-major for that shape and only the dims are reversed.
//! - llama.cpp's HF→GGUF converter permutes the rows of `q_proj` and `k_proj` (per head, it
//!   interleaves the two halves that transformers' `rotate_half` pairs up, because ggml's rope
//!   pairs neighbours). Viewing a head's rows as `[2, head_dim/2]` in HF and `[head_dim/2, 2]` in
//!   GGUF, HF row `(h, i, r)` was stored at GGUF row `(h, r, i)`; [`unpermute_rows`] undoes it.
//!   Only for `llama`: Qwen's and Gemma's converters keep transformers' order (ggml's NeoX-style
//!   rope pairs the halves as `rotate_half` does).
//! - Gemma's RMSNorm weights are stored plus one ([`norm_shifted`]).
//! - gpt-oss's experts: transformers stacks them as `x · W` (`gate_up_proj: [experts, hidden,
//!   2 · inter]` with gate and up interleaved, `down_proj: [experts, inter, hidden]`), llama.cpp
//!   as `W · x` with gate and up apart (`ffn_{gate,up,down}_exps`) or stacked (`ffn_gate_up_exps`):
//!   [`Transform`] says how each is put back, [`gate_up_interleaved`] does it.
//! - Qwen3.5, Qwen3.5-MoE and Qwen3-Next: their linear attention's tensors, in [`crate::hybrid`] and [`crate::linear`].

use crate::params::LlamaParams;
use crate::transform::Transform;

/// The placeholder of the expert index in a stacked tensor's HF name.
pub(crate) const EXPERT: &str = "{e}";

/// Restores transformers' row order of a `q_proj`/`k_proj` weight stored by llama.cpp (see the
/// module docs): `data` is row-major `[rows, cols]` with `rows = n_head · head_dim`.
pub fn unpermute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    move_rows(data, rows, cols, n_head, |hf, gguf| (gguf, hf))
}

/// The inverse of [`unpermute_rows`]: what llama.cpp's converter does to an HF weight.
pub fn permute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    move_rows(data, rows, cols, n_head, |hf, gguf| (hf, gguf))
}

/// Copies each row of `data` (`[rows, cols]`) to its place: `from_to(hf, gguf)` gives the source
/// and destination of the row transformers stores at `hf` and llama.cpp at `gguf`.
fn move_rows(
    data: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
    from_to: impl Fn(usize, usize) -> (usize, usize),
) -> Vec<f32> {
    assert!(n_head > 0 && rows % (2 * n_head) == 0 && data.len() == rows * cols, "bad q/k shape");
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0.0; data.len()];
    for h in 0..n_head {
        for i in 0..2 {
            for r in 0..half {
                let (from, to) = from_to(h * head_dim + i * half + r, h * head_dim + 2 * r + i);
                out[to * cols..(to + 1) * cols].copy_from_slice(&data[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Whether llama.cpp stores this HF tensor as `1 + w` (Gemma's and Qwen3.5's norms scale by
/// `1 + w`, ggml's by `w`: its converter adds the one, the importer takes it off again) — all
/// their norms but Qwen3.5's gated output norm, which scales by `w`.
pub(crate) fn norm_shifted(hf_name: &str, p: &LlamaParams) -> bool {
    let shifted = matches!(p.architecture.as_str(), "gemma2" | "gemma3") || p.linear.is_some();
    shifted && hf_name.ends_with("norm.weight") && !hf_name.ends_with("linear_attn.norm.weight")
}

/// Whether this tensor belongs to one of the multi-token-prediction blocks a Qwen3.5 file has
/// after the decoder's layers (which are left out).
pub(crate) fn is_mtp_block(name: &str, p: &LlamaParams) -> bool {
    let Some(l) = p.linear else { return false };
    let layer = name.strip_prefix("blk.").and_then(|r| r.split_once('.')).and_then(|(n, _)| n.parse::<u64>().ok());
    layer.is_some_and(|n| n >= p.num_hidden_layers && n < p.num_hidden_layers + l.mtp_layers)
}

/// transformers' interleaved `gate_up_proj` `[experts, cols, 2 · inter]` from the gate's and the up
/// projection's `[experts, inter, cols]` (a bias is `cols = 1`): column `2i` of expert `e` is the
/// gate's row `i`, column `2i + 1` the up projection's.
pub(crate) fn gate_up_interleaved(gate: &[f32], up: &[f32], experts: usize, inter: usize) -> Vec<f32> {
    assert!(gate.len() == up.len() && experts * inter > 0 && gate.len() % (experts * inter) == 0, "bad gate/up");
    let cols = gate.len() / (experts * inter);
    let mut out = vec![0.0; 2 * gate.len()];
    for e in 0..experts {
        for i in 0..inter {
            for c in 0..cols {
                let from = (e * inter + i) * cols + c;
                let to = (e * cols + c) * 2 * inter + 2 * i;
                out[to] = gate[from];
                out[to + 1] = up[from];
            }
        }
    }
    out
}

/// `[experts, rows, cols]` → `[experts, cols, rows]`.
pub(crate) fn transpose_last(data: &[f32], experts: usize, rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for e in 0..experts {
        for r in 0..rows {
            for c in 0..cols {
                out[(e * cols + c) * rows + r] = data[(e * rows + r) * cols + c];
            }
        }
    }
    out
}

/// gpt-oss's tensors that the other architectures do not have: biases on q/k/v/o, the sinks, the
/// router with its bias, and the biased experts.
fn gpt_oss_name(rest: &str, p: &LlamaParams) -> Option<(&'static str, Transform, Vec<u64>)> {
    let (h, m) = (p.hidden_size, p.moe?);
    let (e, i) = (m.num_experts, m.moe_intermediate_size);
    let (q_rows, kv_rows) = (p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim);
    let plain = Transform::Plain;
    Some(match rest {
        "attn_q.bias" => ("self_attn.q_proj.bias", plain, vec![q_rows]),
        "attn_k.bias" => ("self_attn.k_proj.bias", plain, vec![kv_rows]),
        "attn_v.bias" => ("self_attn.v_proj.bias", plain, vec![kv_rows]),
        "attn_output.bias" => ("self_attn.o_proj.bias", plain, vec![h]),
        "attn_sinks.weight" => ("self_attn.sinks", plain, vec![p.num_attention_heads]),
        "post_attention_norm.weight" => ("post_attention_layernorm.weight", plain, vec![h]),
        "ffn_gate_inp.weight" => ("mlp.router.weight", plain, vec![e, h]),
        "ffn_gate_inp.bias" => ("mlp.router.bias", plain, vec![e]),
        "ffn_gate_exps.weight" => ("mlp.experts.gate_up_proj", Transform::Gate, vec![e, i, h]),
        "ffn_up_exps.weight" => ("mlp.experts.gate_up_proj", Transform::Up, vec![e, i, h]),
        "ffn_gate_up_exps.weight" => ("mlp.experts.gate_up_proj", Transform::GateUp, vec![e, 2 * i, h]),
        "ffn_gate_exps.bias" => ("mlp.experts.gate_up_proj_bias", Transform::Gate, vec![e, i]),
        "ffn_up_exps.bias" => ("mlp.experts.gate_up_proj_bias", Transform::Up, vec![e, i]),
        "ffn_gate_up_exps.bias" => ("mlp.experts.gate_up_proj_bias", Transform::GateUp, vec![e, 2 * i]),
        "ffn_down_exps.weight" => ("mlp.experts.down_proj", Transform::Transpose, vec![e, h, i]),
        "ffn_down_exps.bias" => ("mlp.experts.down_proj_bias", plain, vec![e, h]),
        _ => return None,
    })
}

/// The HF name of a GGUF tensor, what becomes of its data, and its shape in the file (dims
/// reversed).
pub(crate) fn hf_name(name: &str, p: &LlamaParams) -> Option<(String, Transform, Vec<u64>)> {
    if let Some(g4) = &p.gemma4 {
        return crate::gemma4_layout::hf_name(name, g4, p);
    }
    let llama = p.architecture == "llama";
    let gemma = matches!(p.architecture.as_str(), "gemma2" | "gemma3");
    let phi3 = p.architecture == "phi3";
    let olmo2 = p.architecture == "olmo2";
    let qk_norm = matches!(p.architecture.as_str(), "qwen3" | "qwen3moe" | "gemma3");
    // llama.cpp permutes q/k rows for `llama` only.
    let heads = |n: u64| if llama { Transform::Unpermute(n) } else { Transform::Plain };
    let (h, inter) = (p.hidden_size, p.intermediate_size);
    let (q_rows, kv_rows) = (p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim);
    let top = match name {
        "token_embd.weight" => Some(("model.embed_tokens.weight".to_owned(), vec![p.vocab_size, h])),
        "output_norm.weight" => Some(("model.norm.weight".to_owned(), vec![h])),
        "output.weight" => Some(("lm_head.weight".to_owned(), vec![p.vocab_size, h])),
        _ => None,
    };
    if let Some((n, shape)) = top {
        return Some((n, Transform::Plain, shape));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: u64 = layer.parse().ok()?;
    if layer >= p.num_hidden_layers {
        return None;
    }
    if p.linear.is_some() {
        let (suffix, transform, shape) = crate::hybrid::layer_name(rest, layer, p)?;
        return Some((format!("model.layers.{layer}.{suffix}"), transform, shape));
    }
    if p.architecture == "gpt-oss" {
        if let Some((suffix, transform, shape)) = gpt_oss_name(rest, p) {
            return Some((format!("model.layers.{layer}.{suffix}"), transform, shape));
        }
    }
    let (suffix, rope, shape) = match rest {
        "attn_norm.weight" => ("input_layernorm.weight", Transform::Plain, vec![h]),
        // Gemma 3's sandwich: llama.cpp's `ffn_norm` is the norm before the MLP.
        "ffn_norm.weight" if gemma => ("pre_feedforward_layernorm.weight", Transform::Plain, vec![h]),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", Transform::Plain, vec![h]),
        "post_attention_norm.weight" if gemma || olmo2 => {
            ("post_attention_layernorm.weight", Transform::Plain, vec![h])
        }
        "post_ffw_norm.weight" if gemma || olmo2 => ("post_feedforward_layernorm.weight", Transform::Plain, vec![h]),
        // OLMo 2's q/k norms span all heads.
        "attn_q_norm.weight" if olmo2 => ("self_attn.q_norm.weight", Transform::Plain, vec![q_rows]),
        "attn_k_norm.weight" if olmo2 => ("self_attn.k_norm.weight", Transform::Plain, vec![kv_rows]),
        "attn_q.weight" => ("self_attn.q_proj.weight", heads(p.num_attention_heads), vec![q_rows, h]),
        "attn_k.weight" => ("self_attn.k_proj.weight", heads(p.num_key_value_heads), vec![kv_rows, h]),
        "attn_q.bias" if p.architecture == "qwen2" => ("self_attn.q_proj.bias", Transform::Plain, vec![q_rows]),
        "attn_k.bias" if p.architecture == "qwen2" => ("self_attn.k_proj.bias", Transform::Plain, vec![kv_rows]),
        "attn_v.bias" if p.architecture == "qwen2" => ("self_attn.v_proj.bias", Transform::Plain, vec![kv_rows]),
        "attn_q_norm.weight" if qk_norm => ("self_attn.q_norm.weight", Transform::Plain, vec![p.head_dim]),
        "attn_k_norm.weight" if qk_norm => ("self_attn.k_norm.weight", Transform::Plain, vec![p.head_dim]),
        "attn_v.weight" => ("self_attn.v_proj.weight", Transform::Plain, vec![kv_rows, h]),
        // Phi-3's fused projections: `[q; k; v]` rows and `[gate; up]` rows, as transformers stores them.
        "attn_qkv.weight" if phi3 => ("self_attn.qkv_proj.weight", Transform::Plain, vec![q_rows + 2 * kv_rows, h]),
        "ffn_up.weight" if phi3 => ("mlp.gate_up_proj.weight", Transform::Plain, vec![2 * inter, h]),
        "attn_output.weight" => ("self_attn.o_proj.weight", Transform::Plain, vec![h, q_rows]),
        "ffn_gate.weight" if p.moe.is_none() && !phi3 => ("mlp.gate_proj.weight", Transform::Plain, vec![inter, h]),
        "ffn_up.weight" if p.moe.is_none() => ("mlp.up_proj.weight", Transform::Plain, vec![inter, h]),
        "ffn_down.weight" if p.moe.is_none() => ("mlp.down_proj.weight", Transform::Plain, vec![h, inter]),
        _ => match (rest, p.moe) {
            ("ffn_gate_inp.weight", Some(m)) => ("mlp.gate.weight", Transform::Plain, vec![m.num_experts, h]),
            ("ffn_gate_exps.weight", Some(m)) => {
                ("mlp.experts.{e}.gate_proj.weight", Transform::Plain, vec![m.num_experts, m.moe_intermediate_size, h])
            }
            ("ffn_up_exps.weight", Some(m)) => {
                ("mlp.experts.{e}.up_proj.weight", Transform::Plain, vec![m.num_experts, m.moe_intermediate_size, h])
            }
            ("ffn_down_exps.weight", Some(m)) => {
                ("mlp.experts.{e}.down_proj.weight", Transform::Plain, vec![m.num_experts, h, m.moe_intermediate_size])
            }
            _ => return None,
        },
    };
    Some((format!("model.layers.{layer}.{suffix}"), rope, shape))
}

/// The HF tensors a file of this architecture must have (`{e}` standing for every expert).
pub(crate) fn required_names(p: &LlamaParams) -> Vec<String> {
    if let Some(g4) = &p.gemma4 {
        return crate::gemma4_layout::required(g4, p);
    }
    if p.linear.is_some() {
        let mut required = vec!["model.embed_tokens.weight".to_owned(), "model.norm.weight".to_owned()];
        for l in 0..p.num_hidden_layers {
            required.extend(crate::hybrid::required(l, p).iter().map(|s| format!("model.layers.{l}.{s}")));
        }
        return required;
    }
    let own: &[&str] = match p.architecture.as_str() {
        "qwen2" => &["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "qwen3" => &["self_attn.q_norm.weight", "self_attn.k_norm.weight"],
        "gemma2" => &["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"],
        "gemma3" => &[
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
        ],
        "qwen3moe" => &[
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate.weight",
            "mlp.experts.{e}.gate_proj.weight",
            "mlp.experts.{e}.up_proj.weight",
            "mlp.experts.{e}.down_proj.weight",
        ],
        "phi3" => &["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"],
        "olmo2" => &["self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_feedforward_layernorm.weight"],
        "gpt-oss" => &[
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.bias",
            "self_attn.sinks",
            "mlp.router.weight",
            "mlp.router.bias",
            "mlp.experts.gate_up_proj",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias",
        ],
        _ => &[],
    };
    // OLMo 2 normalises after attention and after the MLP only.
    let input_norm: &[&str] = if p.architecture == "olmo2" { &[] } else { &["input_layernorm.weight"] };
    let separate: &[&str] = match (p.architecture.as_str(), p.moe) {
        ("phi3", _) => &[],
        (_, Some(_)) => &["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        (_, None) => &[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ],
    };
    let mut required = vec!["model.embed_tokens.weight".to_owned(), "model.norm.weight".to_owned()];
    for l in 0..p.num_hidden_layers {
        for s in own
            .iter()
            .chain(separate)
            .chain(input_norm)
            .copied()
            .chain(["post_attention_layernorm.weight", "self_attn.o_proj.weight"])
        {
            required.push(format!("model.layers.{l}.{s}"));
        }
    }
    required
}
