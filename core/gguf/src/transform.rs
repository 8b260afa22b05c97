//! What becomes of a GGUF tensor's data on its way to its HF tensor ([`Transform`]), which the
//! layouts ([`crate::layout`], [`crate::hybrid`]) name and the import ([`crate::import`]) applies.

/// What becomes of a GGUF tensor's data on its way to its HF tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transform {
    /// As stored.
    Plain,
    /// Rows un-permuted with this many heads ([`crate::layout::unpermute_rows`]).
    Unpermute(u64),
    /// gpt-oss's `down_proj`: the last two dims swapped (GGUF `[experts, out, in]`, HF `[experts,
    /// in, out]`, which gpt-oss multiplies as `x · W`).
    Transpose,
    /// One half of gpt-oss's `gate_up_proj` (or of its bias), which transformers stores as `[experts,
    /// in, 2 · inter]` with gate and up interleaved (gate at even columns): the gate's `[experts,
    /// inter, in]` or the up projection's, or both stacked (`ffn_gate_up_exps`, gate rows first).
    /// For the hybrid Qwens the two halves are joined stacked (`[experts, 2 · inter, in]`, gate rows
    /// first), as transformers stores their experts.
    Gate,
    Up,
    GateUp,
    /// Qwen3-Next's `in_proj_qkvz`, which the converter splits into its q/k/v rows (`attn_qkv`)
    /// and its z rows (`attn_gate`): regrouped by key head ([`crate::linear::qkvz_grouped`]).
    Qkv,
    Z,
    /// Qwen3.5's value heads (of `head_dim` rows each, from row `start` on) back from llama.cpp's
    /// tiled order to transformers' grouped one ([`crate::linear::untile`]), or the same for the
    /// columns of `out_proj`.
    Untile {
        start: u64,
        head_dim: u64,
    },
    UntileColumns {
        head_dim: u64,
    },
}

impl Transform {
    /// Which part of a two-part HF tensor this is (0: gate or q/k/v, 1: up or z), if it is one.
    pub(crate) fn part(self) -> Option<usize> {
        match self {
            Transform::Gate | Transform::Qkv => Some(0),
            Transform::Up | Transform::Z => Some(1),
            _ => None,
        }
    }
}
