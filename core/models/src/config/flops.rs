//! What a token costs in a model's matrix multiplications, as PaLM's model-FLOPs formula counts
//! it (Chowdhery et al. 2022, appendix B): `2·N` forward FLOPs per token for the `N` parameters
//! that multiply its activations, and `4·L·H` per query-key pair of attention (`L·H` = Σ heads ×
//! head_dim over the attention layers). `rlhf bench` reports MFU with it, and the padding-free
//! passes choose the layout of a batch that costs the fewest FLOPs by it.

use super::{ArchConfig, Family};

impl ArchConfig {
    /// Parameters that take part in a matrix multiplication per token but the LM head's. A
    /// mixture of experts counts what one token uses: the router and its `top_k` experts (the active
    /// parameters), not every expert, and a shared expert with its gate where there is one. Each
    /// layer counts with its own head size and MLP width; a layer reusing another's keys and values
    /// has no k/v projections, one whose values are its keys no v projection; Gemma 4's per-layer
    /// inputs add their projection and each layer's gate and projection, and its experts beside the
    /// MLP what a token uses of them.
    pub fn layers_matmul_params(&self) -> i64 {
        let (a, d) = (self, self.hidden_size);
        let attention = |i: usize| {
            let g = a.heads(i);
            let (attn, kv) = (a.num_heads * g.head_dim, g.kv_heads * g.head_dim);
            let q = if a.attn_output_gate { 2 * attn } else { attn };
            let kv_projections = match (a.kv_source(i), a.gemma4.as_ref().is_some_and(|g| g.values_are_keys[i])) {
                (Some(_), _) => 0,
                (None, true) => 1,
                (None, false) => 2,
            };
            d * q + kv_projections * d * kv + attn * d
        };
        let linear = a.linear_attn.map_or(0, |l| {
            let values = l.num_value_heads * l.value_head_dim;
            d * (l.conv_dim() + values + 2 * l.num_value_heads) + values * d
        });
        let mixers: i64 = (0..a.num_layers as usize).map(|i| if a.is_linear(i) { linear } else { attention(i) }).sum();
        let per_layer_inputs =
            a.gemma4.as_ref().and_then(|g| g.per_layer_input).map_or(0, |p| 3 * d * p.dim * a.num_layers);
        // Gemma 4's experts beside every dense MLP: the router and the top-k experts a token uses.
        let beside = a.gemma4.as_ref().and_then(|g| g.moe.as_ref());
        let beside = beside.map_or(0, |m| (d * m.num_experts + m.top_k * 3 * d * m.intermediate_size) * a.num_layers);
        let dense = |i: usize| match a.family {
            Family::Gpt2 => 2 * d * a.intermediate(i),
            _ => 3 * d * a.intermediate(i),
        };
        let mlps: i64 = (0..a.num_layers as usize)
            .map(|i| match &a.moe {
                Some(m) if m.sparse_layers.get(i) == Some(&true) => {
                    let shared = m.shared_expert_intermediate_size.map_or(0, |s| 3 * d * s + d);
                    d * m.num_experts + m.top_k * 3 * d * m.intermediate_size + shared
                }
                _ => dense(i),
            })
            .sum();
        mixers + mlps + per_layer_inputs + beside
    }

    /// `Σ heads · head_dim` over the attention layers: the `L·H` of the attention FLOPs, which a
    /// query-key pair costs `4·L·H` of forward (its scores and its share of the weighted values).
    pub fn attention_width(&self) -> i64 {
        let a = self;
        (0..a.num_layers as usize).filter(|&i| !a.is_linear(i)).map(|i| a.num_heads * a.heads(i).head_dim).sum()
    }

    /// [`ArchConfig::layers_matmul_params`] and the LM head's `d·V`.
    pub fn matmul_params(&self) -> i64 {
        self.layers_matmul_params() + self.hidden_size * self.vocab_size
    }
}
