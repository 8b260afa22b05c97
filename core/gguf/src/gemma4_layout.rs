//! The tensor names of Gemma 4 (llama.cpp's `gemma4`; [`crate::gemma4`] says what its converter
//! does) and transformers' for the same weights: the sandwich norms, the attention with each
//! layer kind's head size (no keys and values on the layers that reuse another's, no values on
//! full layers whose values are their keys), the per-layer inputs, and the experts beside the
//! dense MLP.

use crate::gemma4::Gemma4Params;
use crate::params::LlamaParams;
use crate::transform::Transform;

/// The HF name of a `gemma4` tensor, what becomes of its data (nothing but the experts' gate and
/// up halves joined), and its transformers shape.
pub(crate) fn hf_name(name: &str, g4: &Gemma4Params, p: &LlamaParams) -> Option<(String, Transform, Vec<u64>)> {
    let (h, plain) = (p.hidden_size, Transform::Plain);
    let (pl, layers) = (g4.per_layer_input, g4.sliding.len() as u64);
    let top = match name {
        "token_embd.weight" => Some(("model.embed_tokens.weight", vec![p.vocab_size, h])),
        "output_norm.weight" => Some(("model.norm.weight", vec![h])),
        "output.weight" => Some(("lm_head.weight", vec![p.vocab_size, h])),
        "per_layer_token_embd.weight" if pl > 0 => {
            Some(("model.embed_tokens_per_layer.weight", vec![g4.per_layer_vocab, layers * pl]))
        }
        "per_layer_model_proj.weight" if pl > 0 => {
            Some(("model.per_layer_model_projection.weight", vec![layers * pl, h]))
        }
        "per_layer_proj_norm.weight" if pl > 0 => Some(("model.per_layer_projection_norm.weight", vec![pl])),
        _ => None,
    };
    if let Some((n, shape)) = top {
        return Some((n.to_owned(), plain, shape));
    }
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let l: usize = layer.parse().ok().filter(|l| *l < g4.sliding.len())?;
    let full = !g4.sliding[l];
    let (hd, kv) = if full { (g4.global_head_dim, g4.global_kv_heads) } else { (p.head_dim, p.num_key_value_heads) };
    let (q_rows, kv_rows, ff) = (p.num_attention_heads * hd, kv * hd, g4.ffn[l]);
    let own_kv = !g4.shares_kv(l);
    // A full layer with `attention_k_eq_v` takes its values from its keys.
    let own_v = own_kv && (!full || !g4.k_eq_v);
    let (suffix, transform, shape) = match rest {
        "attn_norm.weight" => ("input_layernorm.weight", plain, vec![h]),
        "post_attention_norm.weight" => ("post_attention_layernorm.weight", plain, vec![h]),
        "ffn_norm.weight" => ("pre_feedforward_layernorm.weight", plain, vec![h]),
        "post_ffw_norm.weight" => ("post_feedforward_layernorm.weight", plain, vec![h]),
        "attn_q.weight" => ("self_attn.q_proj.weight", plain, vec![q_rows, h]),
        "attn_q_norm.weight" => ("self_attn.q_norm.weight", plain, vec![hd]),
        "attn_k.weight" if own_kv => ("self_attn.k_proj.weight", plain, vec![kv_rows, h]),
        "attn_k_norm.weight" if own_kv => ("self_attn.k_norm.weight", plain, vec![hd]),
        "attn_v.weight" if own_v => ("self_attn.v_proj.weight", plain, vec![kv_rows, h]),
        "attn_output.weight" => ("self_attn.o_proj.weight", plain, vec![h, q_rows]),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", plain, vec![ff, h]),
        "ffn_up.weight" => ("mlp.up_proj.weight", plain, vec![ff, h]),
        "ffn_down.weight" => ("mlp.down_proj.weight", plain, vec![h, ff]),
        "layer_output_scale.weight" => ("layer_scalar", plain, vec![1]),
        "inp_gate.weight" if pl > 0 => ("per_layer_input_gate.weight", plain, vec![pl, h]),
        "proj.weight" if pl > 0 => ("per_layer_projection.weight", plain, vec![h, pl]),
        "post_norm.weight" if pl > 0 => ("post_per_layer_input_norm.weight", plain, vec![h]),
        _ => {
            let m = p.moe?;
            let (e, i) = (m.num_experts, m.moe_intermediate_size);
            match rest {
                "ffn_gate_inp.weight" => ("router.proj.weight", plain, vec![e, h]),
                "ffn_gate_inp.scale" => ("router.scale", plain, vec![h]),
                "ffn_down_exps.scale" => ("router.per_expert_scale", plain, vec![e]),
                "ffn_gate_up_exps.weight" => ("experts.gate_up_proj", plain, vec![e, 2 * i, h]),
                "ffn_gate_exps.weight" => ("experts.gate_up_proj", Transform::Gate, vec![e, i, h]),
                "ffn_up_exps.weight" => ("experts.gate_up_proj", Transform::Up, vec![e, i, h]),
                "ffn_down_exps.weight" => ("experts.down_proj", plain, vec![e, h, i]),
                "pre_ffw_norm_2.weight" => ("pre_feedforward_layernorm_2.weight", plain, vec![h]),
                "post_ffw_norm_1.weight" => ("post_feedforward_layernorm_1.weight", plain, vec![h]),
                "post_ffw_norm_2.weight" => ("post_feedforward_layernorm_2.weight", plain, vec![h]),
                _ => return None,
            }
        }
    };
    Some((format!("model.layers.{l}.{suffix}"), transform, shape))
}

/// The HF tensors a `gemma4` file must have.
pub(crate) fn required(g4: &Gemma4Params, p: &LlamaParams) -> Vec<String> {
    let mut names = vec!["model.embed_tokens.weight".to_owned(), "model.norm.weight".to_owned()];
    let per_layer: &[&str] = if g4.per_layer_input > 0 {
        names.extend(
            ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"]
                .into_iter()
                .chain(["model.per_layer_projection_norm.weight"])
                .map(str::to_owned),
        );
        &["per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"]
    } else {
        &[]
    };
    let moe: &[&str] = if p.moe.is_some() {
        &[
            "router.proj.weight",
            "router.scale",
            "router.per_expert_scale",
            "experts.gate_up_proj",
            "experts.down_proj",
            "pre_feedforward_layernorm_2.weight",
            "post_feedforward_layernorm_1.weight",
            "post_feedforward_layernorm_2.weight",
        ]
    } else {
        &[]
    };
    for l in 0..g4.sliding.len() {
        let mut own = vec![
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "layer_scalar",
        ];
        if !g4.shares_kv(l) {
            own.extend(["self_attn.k_proj.weight", "self_attn.k_norm.weight"]);
            if g4.sliding[l] || !g4.k_eq_v {
                own.push("self_attn.v_proj.weight");
            }
        }
        names.extend(own.iter().chain(per_layer).chain(moe).map(|s| format!("model.layers.{l}.{s}")));
    }
    names
}
