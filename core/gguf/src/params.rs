//! The hyper-parameters of a GGUF file's model (`<architecture>.*` metadata), checked against the
//! file, and the transformers `config.json` they make.

use serde_json::{json, Value};

use crate::error::{GgufError, Result};
use crate::gemma4::Gemma4Params;
use crate::linear::{LinearParams, ARCHITECTURES as HYBRID};
use crate::reader::GgufFile;
use crate::tokenizer::SpecialIds;

/// The dtype of the written safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    F32,
    Bf16,
}

impl OutDtype {
    /// `f32` or `bf16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" | "float32" => Some(OutDtype::F32),
            "bf16" | "bfloat16" => Some(OutDtype::Bf16),
            _ => None,
        }
    }

    /// `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            OutDtype::F32 => "f32",
            OutDtype::Bf16 => "bf16",
        }
    }

    /// safetensors' name (`F32`, `BF16`).
    pub(crate) fn safetensors_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "F32",
            OutDtype::Bf16 => "BF16",
        }
    }

    /// transformers' name (`config.json`'s `dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "float32",
            OutDtype::Bf16 => "bfloat16",
        }
    }
}

/// Hyper-parameters from `<architecture>.*` metadata (Llama, Qwen2, Qwen3 and Qwen3-MoE share
/// them).
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    /// llama.cpp's name: `llama`, `qwen2`, `qwen3` or `qwen3moe`.
    pub architecture: String,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `{"rope_type": "linear", "factor": f}`, Phi-3's `{"rope_type": "longrope", "long_factor",
    /// "short_factor"}` (from its factor tensors), or none.
    pub rope_scaling: Option<Value>,
    /// Dimensions of each head that RoPE rotates (`rope.dimension_count`; less than `head_dim`
    /// only for Phi-3).
    pub rotary_dim: u64,
    pub max_position_embeddings: Option<u64>,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    /// The mixture of experts of a `qwen3moe` file.
    pub moe: Option<MoeParams>,
    /// A `gemma3` or `phi3` file's window of its sliding layers (`attention.sliding_window`).
    pub sliding_window: Option<u64>,
    /// The context the model was trained at before its RoPE was scaled
    /// (`rope.scaling.original_context_length`; Phi-3's `original_max_position_embeddings`).
    pub original_context_length: Option<u64>,
    /// Gemma 2's soft-capping of attention scores and of the final logits
    /// (`attn_logit_softcapping`, `final_logit_softcapping`).
    pub softcaps: (Option<f64>, Option<f64>),
    /// The linear attention of a `qwen35`, `qwen35moe` or `qwen3next` file.
    pub linear: Option<LinearParams>,
    /// Which layers slide, for an `olmo2` file with a window (OLMo 3); empty otherwise.
    pub sliding_layers: Vec<bool>,
    /// The sliding layers' RoPE base (`rope.freq_base_swa`) of an OLMo 3 file, where it has one.
    pub rope_theta_sliding: Option<f64>,
    /// A `gemma4` file's layers (whose sliding layers' sizes are `head_dim` and
    /// `num_key_value_heads` above).
    pub gemma4: Option<Gemma4Params>,
}

/// A `qwen3moe`, `gpt-oss`, `qwen35moe` or `qwen3next` file's experts (`expert_count`,
/// `expert_used_count`, `expert_feed_forward_length`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeParams {
    pub num_experts: u64,
    pub num_experts_per_tok: u64,
    pub moe_intermediate_size: u64,
    /// The gated shared expert's (`expert_shared_feed_forward_length`) of `qwen35moe` and
    /// `qwen3next` files.
    pub shared_intermediate_size: Option<u64>,
}

/// Tensors every layer has (norms, q/k/v/o, gate/up/down): a block count is at most the file's
/// tensors over this.
const LAYER_TENSORS: u64 = 9;
/// The largest size a hyper-parameter may give one dimension of a weight (2^31: libtorch and the
/// importer index rows with it).
const MAX_DIM: u64 = 1 << 31;

impl LlamaParams {
    /// Reads the hyper-parameters of a `general.architecture = "llama"`, `"qwen2"`, `"qwen3"` or
    /// `"qwen3moe"` file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let path = g.path();
        let arch = architecture(g)?;
        let k = |name: &str| format!("{arch}.{name}");
        let moe = Self::moe_from_gguf(g, arch)?;
        let hidden = g.req_u64(&k("embedding_length"))?;
        let heads = g.req_u64(&k("attention.head_count"))?;
        let gemma4 = Gemma4Params::from_gguf(g, arch, heads)?;
        let (kv_heads, head_dim) = head_dims(g, arch, hidden, heads, gemma4.as_ref())?;
        let (rotary_dim, rope_scaling) = crate::rope::rope_of(g, arch, head_dim, gemma4.is_some())?;
        let vocab_size = vocab_size(g, arch, hidden)?;
        let layers = block_count(g, arch, [heads, kv_heads], head_dim)?;
        let linear = LinearParams::from_gguf(g, arch, layers)?;
        // OLMo 3 (`olmo2` with a window): which layers slide.
        let olmo3_window =
            if arch == "olmo2" { g.opt_u64(&k("attention.sliding_window"))?.filter(|&n| n > 0) } else { None };
        let sliding_layers = match olmo3_window {
            Some(_) => crate::olmo3::sliding_layers(g, arch, layers)?,
            None => Vec::new(),
        };
        // A mixture of experts has no dense MLP: its `feed_forward_length` is informational.
        let intermediate = match (&gemma4, moe) {
            (Some(g4), _) => g4.ffn[0],
            (None, _) if g.get(&k("feed_forward_length")).is_some() => g.req_u64(&k("feed_forward_length"))?,
            (None, Some(m)) => m.moe_intermediate_size,
            (None, None) => g.req_u64(&k("feed_forward_length"))?,
        };
        for (key, n) in [("embedding_length", hidden), ("feed_forward_length", intermediate)] {
            if n == 0 || n > MAX_DIM {
                return Err(GgufError::metadata(path, &k(key), format!("{n} (expected 1 to {MAX_DIM})")));
            }
        }
        Ok(LlamaParams {
            architecture: arch.to_string(),
            hidden_size: hidden,
            intermediate_size: intermediate,
            // Qwen3.5's multi-token-prediction blocks come after the decoder's.
            num_hidden_layers: layers - linear.map_or(0, |l| l.mtp_layers),
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: g.opt_f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
            rope_theta: g.opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling,
            rotary_dim,
            max_position_embeddings: g.opt_u64(&k("context_length"))?,
            vocab_size,
            tie_word_embeddings: g.tensor("output.weight").is_none(),
            moe,
            sliding_window: match arch {
                "gemma2" | "gemma3" | "gemma4" | "gpt-oss" => Some(g.req_u64(&k("attention.sliding_window"))?),
                "phi3" => g.opt_u64(&k("attention.sliding_window"))?,
                "olmo2" => olmo3_window,
                _ => None,
            },
            original_context_length: g.opt_u64(&k("rope.scaling.original_context_length"))?,
            softcaps: (g.opt_f64(&k("attn_logit_softcapping"))?, g.opt_f64(&k("final_logit_softcapping"))?),
            linear,
            sliding_layers,
            rope_theta_sliding: g.opt_f64(&k("rope.freq_base_swa"))?,
            gemma4,
        })
    }

    /// The experts of a `qwen3moe`, `gpt-oss`, `qwen35moe` or `qwen3next` file; any other
    /// architecture with experts is refused.
    fn moe_from_gguf(g: &GgufFile, arch: &str) -> Result<Option<MoeParams>> {
        let path = g.path();
        let k = |name: &str| format!("{arch}.{name}");
        let experts = g.opt_u64(&k("expert_count"))?.unwrap_or(0);
        if !matches!(arch, "qwen3moe" | "gpt-oss" | "qwen35moe" | "qwen3next" | "gemma4") {
            if experts > 0 {
                return Err(GgufError::unsupported(
                    path,
                    format!(
                        "mixture-of-experts `{arch}` models are not supported (qwen3moe, gpt-oss, qwen35moe, \
                         qwen3next and gemma4 are)"
                    ),
                ));
            }
            return Ok(None);
        }
        let used = g.req_u64(&k("expert_used_count"))?;
        let ffn = g.req_u64(&k("expert_feed_forward_length"))?;
        // Experts multiply into every expert tensor's shape: bounded before anything is built.
        if experts == 0 || experts > 1 << 16 {
            return Err(GgufError::metadata(path, &k("expert_count"), format!("{experts} (expected 1 to 65536)")));
        }
        if used == 0 || used > experts {
            return Err(GgufError::metadata(
                path,
                &k("expert_used_count"),
                format!("{used} (expected 1 to the {experts} experts)"),
            ));
        }
        if ffn == 0 || ffn > MAX_DIM {
            return Err(GgufError::metadata(
                path,
                &k("expert_feed_forward_length"),
                format!("{ffn} (expected 1 to {MAX_DIM})"),
            ));
        }
        // The shared expert's size, or where the file does not say, the dense one, as llama.cpp
        // reads it.
        let shared = if matches!(arch, "qwen35moe" | "qwen3next") {
            let key = k("expert_shared_feed_forward_length");
            let n = match g.opt_u64(&key)? {
                Some(n) => n,
                None => g.req_u64(&k("feed_forward_length"))?,
            };
            if n == 0 || n > MAX_DIM {
                return Err(GgufError::metadata(path, &key, format!("{n} (expected 1 to {MAX_DIM})")));
            }
            Some(n)
        } else {
            None
        };
        Ok(Some(MoeParams {
            num_experts: experts,
            num_experts_per_tok: used,
            moe_intermediate_size: ffn,
            shared_intermediate_size: shared,
        }))
    }

    /// `config.json` for `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or
    /// `Qwen3MoeForCausalLM`.
    pub fn hf_config(&self, special: &SpecialIds, dtype: OutDtype) -> Value {
        let eos = eos_value(special);
        let (class, model_type) = match self.architecture.as_str() {
            "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
            "qwen3" => ("Qwen3ForCausalLM", "qwen3"),
            "qwen3moe" => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "gemma2" => ("Gemma2ForCausalLM", "gemma2"),
            "gemma3" => ("Gemma3ForCausalLM", "gemma3_text"),
            "gemma4" => ("Gemma4ForCausalLM", "gemma4_text"),
            "phi3" => ("Phi3ForCausalLM", "phi3"),
            "olmo2" if self.sliding_window.is_some() => ("Olmo3ForCausalLM", "olmo3"),
            "olmo2" => ("Olmo2ForCausalLM", "olmo2"),
            "gpt-oss" => ("GptOssForCausalLM", "gpt_oss"),
            "qwen35" => ("Qwen3_5ForCausalLM", "qwen3_5_text"),
            "qwen35moe" => ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
            "qwen3next" => ("Qwen3NextForCausalLM", "qwen3_next"),
            _ => ("LlamaForCausalLM", "llama"),
        };
        let mut config = json!({
            "architectures": [class],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings.unwrap_or(2048),
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "bos_token_id": special.bos,
            "eos_token_id": eos,
            "pad_token_id": special.pad,
            "dtype": dtype.torch_name(),
        });
        let extra = match model_type {
            "llama" => json!({"attention_bias": false, "mlp_bias": false, "pretraining_tp": 1}),
            "qwen3" => json!({"attention_bias": false, "use_sliding_window": false}),
            "qwen3_moe" => {
                let m = self.moe.expect("a qwen3moe file has experts");
                json!({
                    "attention_bias": false,
                    "use_sliding_window": false,
                    "num_experts": m.num_experts,
                    "num_experts_per_tok": m.num_experts_per_tok,
                    "moe_intermediate_size": m.moe_intermediate_size,
                    "norm_topk_prob": true,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                })
            }
            "gemma2" | "gemma3_text" => self.gemma_keys(),
            "gemma4_text" => self.gemma4_keys(),
            "olmo2" => json!({"attention_bias": false}),
            "olmo3" => {
                let full = self.rope_parameters();
                let sliding = self.rope_theta_sliding.unwrap_or(self.rope_theta);
                crate::olmo3::config_keys(&self.sliding_layers, self.sliding_window, full, sliding)
            }
            "gpt_oss" => self.gpt_oss_keys(),
            "qwen3_5_text" | "qwen3_5_moe_text" | "qwen3_next" => self.hybrid_keys(),
            "phi3" => json!({
                "sliding_window": self.sliding_window,
                "partial_rotary_factor": self.rotary_dim as f64 / self.head_dim as f64,
                "original_max_position_embeddings": self.original_context_length
                    .or(self.max_position_embeddings)
                    .unwrap_or(4096),
            }),
            _ => json!({"use_sliding_window": false}),
        };
        if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
            if model_type.starts_with("gemma") {
                c.remove("hidden_act"); // Gemma names it `hidden_activation`
            }
            if model_type == "qwen3_5_moe_text" {
                c.remove("intermediate_size"); // every layer is sparse
            }
            if e.contains_key("rope_parameters") {
                c.remove("rope_theta");
                c.remove("rope_scaling");
            }
            c.extend(e.clone());
        }
        config
    }

    /// The rope block as transformers 5 writes it (`rope_parameters`): the file's scaling (or the
    /// default) with its base.
    fn rope_parameters(&self) -> Value {
        let mut rope = self.rope_scaling.clone().unwrap_or_else(|| json!({"rope_type": "default"}));
        rope["rope_theta"] = json!(self.rope_theta);
        rope
    }

    /// What a hybrid Qwen config adds: the layer kinds and the linear attention's sizes, the rope
    /// block as transformers 5 writes it for these models (`rope_parameters` with the rotating share
    /// of each head, in place of `rope_theta` and `rope_scaling`), and the experts.
    fn hybrid_keys(&self) -> Value {
        let mut keys = self.linear.expect("a hybrid file has linear attention").config_keys(self.num_hidden_layers);
        let mut rope = self.rope_parameters();
        rope["partial_rotary_factor"] = json!(self.rotary_dim as f64 / self.head_dim as f64);
        keys["rope_parameters"] = rope;
        keys["attention_bias"] = json!(false);
        if let Some(m) = self.moe {
            keys["num_experts"] = json!(m.num_experts);
            keys["num_experts_per_tok"] = json!(m.num_experts_per_tok);
            keys["moe_intermediate_size"] = json!(m.moe_intermediate_size);
            keys["shared_expert_intermediate_size"] = json!(m.shared_intermediate_size);
        }
        if self.architecture == "qwen3next" {
            // llama.cpp renormalises the top-k weights and makes every layer sparse.
            keys["norm_topk_prob"] = json!(true);
            keys["decoder_sparse_step"] = json!(1);
            keys["mlp_only_layers"] = json!([]);
        }
        keys
    }

    /// What a Gemma 4 config adds ([`Gemma4Params::config_keys`]), with its experts.
    fn gemma4_keys(&self) -> Value {
        let base = crate::gemma4::ConfigBase {
            window: self.sliding_window,
            softcap: self.softcaps.1,
            rope_theta: self.rope_theta,
            vocab: self.vocab_size,
            kv_heads: self.num_key_value_heads,
            moe: self.moe.is_some(),
        };
        let mut keys = self.gemma4.as_ref().expect("a gemma4 file has its layers").config_keys(base);
        if let Some(m) = self.moe {
            keys["num_experts"] = json!(m.num_experts);
            keys["top_k_experts"] = json!(m.num_experts_per_tok);
            keys["moe_intermediate_size"] = json!(m.moe_intermediate_size);
        }
        keys
    }

    /// What a gpt-oss config adds, as llama.cpp computes these models: even layers slide over
    /// the file's window and odd ones attend to everything, biased attention, the experts'
    /// `expert_feed_forward_length` as `intermediate_size`, and the SwiGLU clamped at 7 (which
    /// llama.cpp fixes for gpt-oss and the file does not store).
    fn gpt_oss_keys(&self) -> Value {
        let m = self.moe.expect("a gpt-oss file has experts");
        let layer_types: Vec<&str> = (0..self.num_hidden_layers)
            .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
            .collect();
        json!({
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "intermediate_size": m.moe_intermediate_size,
            "sliding_window": self.sliding_window,
            "layer_types": layer_types,
            "attention_bias": true,
            "swiglu_limit": 7.0,
        })
    }

    /// What a Gemma config adds, as llama.cpp computes these models: Gemma 3 has every sixth layer
    /// full attention and the others sliding with RoPE base 10000 (the file's `rope.freq_base` and
    /// scaling are the full layers'), no soft-capping; Gemma 2 alternates sliding and full layers,
    /// one RoPE, and soft-caps as the file says (50 and 30 where it does not). Both use GELU (tanh) and scale queries by
    /// `1/√head_dim` — by `1/√(hidden/heads)` for the 27B models (46 layers for Gemma 2, 62 for
    /// Gemma 3), as llama.cpp special-cases them.
    fn gemma_keys(&self) -> Value {
        let gemma3 = self.architecture == "gemma3";
        let (pattern, large) = if gemma3 { (6, 62) } else { (2, 46) };
        let layer_types: Vec<&str> = (0..self.num_hidden_layers)
            .map(|i| if i % pattern == pattern - 1 { "full_attention" } else { "sliding_attention" })
            .collect();
        let scalar =
            if self.num_hidden_layers == large { self.hidden_size / self.num_attention_heads } else { self.head_dim };
        // llama.cpp's defaults where a Gemma 2 file does not say.
        let softcaps =
            if gemma3 { self.softcaps } else { (self.softcaps.0.or(Some(50.0)), self.softcaps.1.or(Some(30.0))) };
        let mut keys = json!({
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": layer_types,
            "sliding_window": self.sliding_window,
            "query_pre_attn_scalar": scalar,
            "attn_logit_softcapping": softcaps.0,
            "final_logit_softcapping": softcaps.1,
            "attention_bias": false,
        });
        if gemma3 {
            keys["rope_local_base_freq"] = json!(10000.0);
        }
        keys
    }
}

/// `eos_token_id`: one id, or `[eos, eot]` when the file names a separate end-of-turn token.
/// The key/value heads and the head dimension of a file with `heads` query heads (Gemma 4's are
/// its sliding layers'), each checked against the others.
fn head_dims(g: &GgufFile, arch: &str, hidden: u64, heads: u64, gemma4: Option<&Gemma4Params>) -> Result<(u64, u64)> {
    let path = g.path();
    let k = |name: &str| format!("{arch}.{name}");
    let kv_heads = match gemma4 {
        Some(g4) => g4.sliding_kv_heads,
        None => g.opt_u64(&k("attention.head_count_kv"))?.unwrap_or(heads),
    };
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(GgufError::metadata(
            path,
            &k("attention.head_count_kv"),
            format!("{kv_heads} key/value heads do not divide {heads} heads"),
        ));
    }
    let head_dim = match (gemma4, g.opt_u64(&k("attention.key_length"))?) {
        (Some(g4), _) => g4.sliding_head_dim,
        (None, Some(d)) => d,
        (None, None) if hidden % heads == 0 => hidden / heads,
        (None, None) => {
            return Err(GgufError::metadata(
                path,
                &k("attention.head_count"),
                format!("{heads} heads do not divide the embedding length {hidden}"),
            ))
        }
    };
    // (Gemma 4's are its full layers' sizes, checked with its layers.)
    if let Some(v) = g.opt_u64(&k("attention.value_length"))?.filter(|_| gemma4.is_none()) {
        if v != head_dim {
            return Err(GgufError::unsupported(path, format!("value length {v} differs from key length {head_dim}")));
        }
    }
    if head_dim % 2 != 0 {
        return Err(GgufError::unsupported(path, format!("odd head dimension {head_dim}")));
    }
    Ok((kv_heads, head_dim))
}

/// The vocabulary size: the rows of `token_embd.weight` (each of `hidden` values), which a
/// `vocab_size` key must equal.
fn vocab_size(g: &GgufFile, arch: &str, hidden: u64) -> Result<u64> {
    let path = g.path();
    let k = |name: &str| format!("{arch}.{name}");
    let embed =
        g.tensor("token_embd.weight").ok_or_else(|| GgufError::invalid(path, "no `token_embd.weight` tensor"))?;
    if embed.dims.len() != 2 || embed.dims[0] != hidden {
        return Err(GgufError::invalid(
            path,
            format!("`token_embd.weight` has dims {:?}, expected [{hidden}, vocab]", embed.dims),
        ));
    }
    let vocab_size = embed.dims[1];
    if let Some(v) = g.opt_u64(&k("vocab_size"))? {
        if v != vocab_size {
            return Err(GgufError::metadata(
                path,
                &k("vocab_size"),
                format!("{v}, but `token_embd.weight` has {vocab_size} rows"),
            ));
        }
    }
    Ok(vocab_size)
}

/// The block count, checked against the file's tensors, and each head count of `head_dim` rows
/// against [`MAX_DIM`].
fn block_count(g: &GgufFile, arch: &str, head_counts: [u64; 2], head_dim: u64) -> Result<u64> {
    let path = g.path();
    let k = |name: &str| format!("{arch}.{name}");
    let [heads, kv_heads] = head_counts;
    // Sizes multiply into shapes and name every layer's tensors: each is checked against the
    // file before anything is built from it (a block count of 1e10 would otherwise build
    // names for 1e10 layers, and head counts of 2^32 overflow `heads × head_dim`).
    let layers = g.req_u64(&k("block_count"))?;
    // Phi-3's fused q/k/v and gate/up leave 6 tensors a layer.
    let per_layer = if arch == "phi3" { 6 } else { LAYER_TENSORS };
    let needed = layers.checked_mul(per_layer);
    if layers == 0 || needed.is_none_or(|n| n > g.tensors.len() as u64) {
        return Err(GgufError::metadata(
            path,
            &k("block_count"),
            format!(
                "{layers} layers, but the file has {} tensors (each layer has at least {per_layer})",
                g.tensors.len()
            ),
        ));
    }
    for (key, n) in [("attention.head_count", heads), ("attention.head_count_kv", kv_heads)] {
        if n.checked_mul(head_dim).is_none_or(|rows| rows > MAX_DIM) {
            return Err(GgufError::metadata(
                path,
                &k(key),
                format!("{n} heads of dimension {head_dim} give more than {MAX_DIM} rows"),
            ));
        }
    }
    Ok(layers)
}

pub(crate) fn eos_value(special: &SpecialIds) -> Value {
    match (special.eos, special.eot) {
        (Some(e), Some(t)) => json!([e, t]),
        (e, t) => json!(e.or(t)),
    }
}

pub(crate) fn architecture(g: &GgufFile) -> Result<&str> {
    let arch = g
        .opt_str("general.architecture")?
        .ok_or_else(|| GgufError::metadata(g.path(), "general.architecture", "missing"))?;
    let known = ["llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "gemma4", "phi3", "olmo2", "gpt-oss"];
    if !known.contains(&arch) && !HYBRID.contains(&arch) {
        return Err(GgufError::unsupported(
            g.path(),
            format!(
                "architecture `{arch}` is not supported (llama: Llama, SmolLM, Mistral without sliding window; qwen2; \
                 qwen3; qwen3moe; gemma2; gemma3; gemma4; phi3; olmo2; gpt-oss; qwen35; qwen35moe; qwen3next)"
            ),
        ));
    }
    Ok(arch)
}
