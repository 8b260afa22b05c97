//! The tensor names of the hybrid Qwens (llama.cpp's `qwen35`, `qwen35moe`, `qwen3next`) and
//! transformers' for the same weights, layer by layer: gated full attention on the layers
//! [`LinearParams::is_full`] names, Gated DeltaNet on the others ([`crate::linear`] says what their
//! converter does to those tensors), a dense MLP or the routed experts with a gated shared expert.

use crate::linear::LinearParams;
use crate::params::LlamaParams;
use crate::transform::Transform;

/// The HF name (below `model.layers.{layer}.`) of a hybrid model's layer tensor, what becomes of
/// its data, and its transformers shape.
pub(crate) fn layer_name(rest: &str, layer: u64, p: &LlamaParams) -> Option<(&'static str, Transform, Vec<u64>)> {
    let l = p.linear?;
    let plain = Transform::Plain;
    let h = p.hidden_size;
    let (q_rows, kv_rows) = (p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim);
    let common = match rest {
        "attn_norm.weight" => Some(("input_layernorm.weight", plain, vec![h])),
        "post_attention_norm.weight" => Some(("post_attention_layernorm.weight", plain, vec![h])),
        _ => None,
    };
    let mixer = if l.is_full(layer) {
        match rest {
            // The queries and the output gate, per head `[q, gate]`.
            "attn_q.weight" => Some(("self_attn.q_proj.weight", plain, vec![2 * q_rows, h])),
            "attn_k.weight" => Some(("self_attn.k_proj.weight", plain, vec![kv_rows, h])),
            "attn_v.weight" => Some(("self_attn.v_proj.weight", plain, vec![kv_rows, h])),
            "attn_output.weight" => Some(("self_attn.o_proj.weight", plain, vec![h, q_rows])),
            "attn_q_norm.weight" => Some(("self_attn.q_norm.weight", plain, vec![p.head_dim])),
            "attn_k_norm.weight" => Some(("self_attn.k_norm.weight", plain, vec![p.head_dim])),
            _ => None,
        }
    } else {
        linear_name(rest, &l, h)
    };
    common.or(mixer).or_else(|| mlp_name(rest, p))
}

/// A Gated DeltaNet layer's tensors.
fn linear_name(rest: &str, l: &LinearParams, h: u64) -> Option<(&'static str, Transform, Vec<u64>)> {
    let (nv, dv, conv) = (l.value_heads, l.value_head_dim, l.conv_dim());
    let qk_rows = 2 * l.key_heads * l.key_head_dim;
    let grouped = !l.tiled; // Qwen3-Next
    Some(match rest {
        "attn_qkv.weight" if grouped => ("linear_attn.in_proj_qkvz.weight", Transform::Qkv, vec![conv, h]),
        "attn_gate.weight" if grouped => ("linear_attn.in_proj_qkvz.weight", Transform::Z, vec![nv * dv, h]),
        "ssm_in.weight" if grouped => ("linear_attn.in_proj_qkvz.weight", Transform::Plain, vec![conv + nv * dv, h]),
        "ssm_ba.weight" if grouped => ("linear_attn.in_proj_ba.weight", Transform::Plain, vec![2 * nv, h]),
        "attn_qkv.weight" => ("linear_attn.in_proj_qkv.weight", l.untile(qk_rows, dv), vec![conv, h]),
        "attn_gate.weight" => ("linear_attn.in_proj_z.weight", l.untile(0, dv), vec![nv * dv, h]),
        "ssm_beta.weight" if !grouped => ("linear_attn.in_proj_b.weight", l.untile(0, 1), vec![nv, h]),
        "ssm_alpha.weight" if !grouped => ("linear_attn.in_proj_a.weight", l.untile(0, 1), vec![nv, h]),
        "ssm_conv1d.weight" => ("linear_attn.conv1d.weight", l.untile(qk_rows, dv), vec![conv, 1, l.conv_kernel]),
        "ssm_dt.bias" => ("linear_attn.dt_bias", l.untile(0, 1), vec![nv]),
        "ssm_a" => ("linear_attn.A_log", l.untile(0, 1), vec![nv]),
        "ssm_norm.weight" => ("linear_attn.norm.weight", Transform::Plain, vec![dv]),
        "ssm_out.weight" => ("linear_attn.out_proj.weight", l.untile_columns(dv), vec![h, nv * dv]),
        _ => return None,
    })
}

/// The MLP: dense for `qwen35`, the routed experts with a gated shared expert otherwise.
fn mlp_name(rest: &str, p: &LlamaParams) -> Option<(&'static str, Transform, Vec<u64>)> {
    let (h, plain) = (p.hidden_size, Transform::Plain);
    let Some(m) = p.moe else {
        let i = p.intermediate_size;
        return Some(match rest {
            "ffn_gate.weight" => ("mlp.gate_proj.weight", plain, vec![i, h]),
            "ffn_up.weight" => ("mlp.up_proj.weight", plain, vec![i, h]),
            "ffn_down.weight" => ("mlp.down_proj.weight", plain, vec![h, i]),
            _ => return None,
        });
    };
    let (e, i, s) = (m.num_experts, m.moe_intermediate_size, m.shared_intermediate_size?);
    Some(match rest {
        "ffn_gate_inp.weight" => ("mlp.gate.weight", plain, vec![e, h]),
        "ffn_gate_exps.weight" => ("mlp.experts.gate_up_proj", Transform::Gate, vec![e, i, h]),
        "ffn_up_exps.weight" => ("mlp.experts.gate_up_proj", Transform::Up, vec![e, i, h]),
        "ffn_gate_up_exps.weight" => ("mlp.experts.gate_up_proj", plain, vec![e, 2 * i, h]),
        "ffn_down_exps.weight" => ("mlp.experts.down_proj", plain, vec![e, h, i]),
        "ffn_gate_inp_shexp.weight" => ("mlp.shared_expert_gate.weight", plain, vec![1, h]),
        "ffn_gate_shexp.weight" => ("mlp.shared_expert.gate_proj.weight", plain, vec![s, h]),
        "ffn_up_shexp.weight" => ("mlp.shared_expert.up_proj.weight", plain, vec![s, h]),
        "ffn_down_shexp.weight" => ("mlp.shared_expert.down_proj.weight", plain, vec![h, s]),
        _ => return None,
    })
}

/// The HF tensors (below `model.layers.{layer}.`) every layer of a hybrid model must have.
pub(crate) fn required(layer: u64, p: &LlamaParams) -> Vec<&'static str> {
    let Some(l) = p.linear else { return Vec::new() };
    let mut names = vec!["input_layernorm.weight", "post_attention_layernorm.weight"];
    if l.is_full(layer) {
        names.extend([
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ]);
    } else {
        if l.tiled {
            names.extend([
                "linear_attn.in_proj_qkv.weight",
                "linear_attn.in_proj_z.weight",
                "linear_attn.in_proj_b.weight",
                "linear_attn.in_proj_a.weight",
            ]);
        } else {
            names.extend(["linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"]);
        }
        names.extend([
            "linear_attn.conv1d.weight",
            "linear_attn.dt_bias",
            "linear_attn.A_log",
            "linear_attn.norm.weight",
            "linear_attn.out_proj.weight",
        ]);
    }
    if p.moe.is_some() {
        names.extend([
            "mlp.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.shared_expert_gate.weight",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert.down_proj.weight",
        ]);
    } else {
        names.extend(["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]);
    }
    names
}
