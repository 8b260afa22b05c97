//! The loader's rule: every key of `config.json` is either implemented by the family, or known not
//! to change what the model computes (names, token ids, generation defaults, initialisation,
//! dropout — no dropout is applied in training, as with TRL's `disable_dropout`). Any other key
//! is refused with one line naming the file and the key: an unknown key could change the
//! computation, and a silent difference from transformers is worse than a refusal. A user who
//! knows a key to be inert for their checkpoint lists it in `RLHF_ALLOW_CONFIG_KEYS`
//! (comma-separated).

use std::path::Path;

use serde_json::{Map, Value};

use super::Family;
use crate::error::{ModelError, Result};

/// Keys of transformers' `PretrainedConfig` and of hub configs that never change the forward pass.
const INERT: &[&str] = &[
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_commit_hash",
    "_name_or_path",
    "add_cross_attention",
    "architectures",
    "attn_implementation",
    "auto_map",
    "bad_words_ids",
    "begin_suppress_tokens",
    "bos_token_id",
    "cache_implementation",
    "chunk_size_feed_forward",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "diversity_penalty",
    "do_sample",
    "dtype",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "eos_token_id",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "gradient_checkpointing",
    "id2label",
    "initializer_range",
    "is_decoder",
    "is_encoder_decoder",
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "model_type",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_labels",
    "num_return_sequences",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "pad_token_id",
    "prefix",
    "problem_type",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict",
    "return_dict_in_generate",
    "sep_token_id",
    "suppress_tokens",
    "task_specific_params",
    "temperature",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "tokenizer_class",
    "top_k",
    "top_p",
    "torch_dtype",
    "torchscript",
    "transformers_version",
    "typical_p",
    "use_bfloat16",
    "use_cache",
    "use_return_dict",
    // Dropout probabilities: read and not applied.
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "summary_first_dropout",
];

/// The keys `family` implements (beyond [`INERT`]).
fn family_keys(family: Family) -> &'static [&'static str] {
    match family {
        Family::Gpt2 => crate::gpt2::CONFIG_KEYS,
        Family::Llama | Family::Mistral | Family::Qwen2 => crate::llama::CONFIG_KEYS,
        Family::Qwen3 => crate::qwen3::CONFIG_KEYS,
        Family::Qwen3Moe => crate::qwen3_moe::CONFIG_KEYS,
        Family::Gemma2 | Family::Gemma3 => crate::gemma::CONFIG_KEYS,
        Family::Olmo2 => crate::olmo2::CONFIG_KEYS,
        Family::Phi3 => crate::phi3::CONFIG_KEYS,
    }
}

/// Keys every rotary decoder reads ([`super::rotary_decoder`]).
pub(crate) const ROTARY_DECODER: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "hidden_act",
];

/// Refuses the first key of `config` that is neither inert, implemented by `family`, nor allowed
/// by the user (`RLHF_ALLOW_CONFIG_KEYS`).
pub fn check(path: &Path, config: &Map<String, Value>, family: Family) -> Result<()> {
    let allowed = std::env::var("RLHF_ALLOW_CONFIG_KEYS").unwrap_or_default();
    let allowed: Vec<&str> = allowed.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let own = family_keys(family);
    let rotary = family != Family::Gpt2;
    for key in config.keys() {
        let k = key.as_str();
        let known = INERT.contains(&k) || own.contains(&k) || (rotary && ROTARY_DECODER.contains(&k));
        if !known && !allowed.contains(&k) {
            return Err(ModelError::config(
                path,
                k,
                format!(
                    "not a key this loader implements for model_type `{}`; it may change the computation, so it is \
                     refused rather than ignored (if it does not, list it in RLHF_ALLOW_CONFIG_KEYS)",
                    family.model_type()
                ),
            ));
        }
    }
    Ok(())
}
