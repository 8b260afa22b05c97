//! Decoder-only transformers from Hugging Face checkpoints on libtorch.
//!
//! - [`config`]: `config.json` → resolved [`ArchConfig`].
//! - [`weights`]: safetensors in and out (single or sharded), scoped shape-checked loading.
//! - [`layers`]: linear, norm, rotary, mask, attention, linear attention (Gated DeltaNet),
//!   MLP/expert and cache building blocks.
//! - [`decoder`]: the rotary decoder stack, assembled from the layers by the resolved config.
//! - The families, one file each: [`llama`] (Llama, Mistral, SmolLM, Qwen2), [`qwen3`],
//!   [`qwen3_moe`], [`qwen3_5`], [`gpt_oss`], [`gemma`] (Gemma 2, Gemma 3 text), [`gemma4`], [`olmo2`], [`olmo3`],
//!   [`phi3`], [`gpt2`].
//! - [`lora`]: LoRA adapters on the linear layers, merged on save.
//! - [`model`] and [`scalar_head`]: [`CausalLm`] and [`ScalarHeadModel`], what the trainer holds.
//! - [`gate`]: when a sharded model's units are gathered and freed (ZeRO stage 3).
//! - [`prefix`]: prompts shared by several rows, computed once.
//! - [`device`]: `cpu` / `cuda:N` and dtype parsing, loading libtorch's CUDA library on demand.
//!
//! Verified against transformers: `integration-tests` compares logits, greedy continuations and
//! scores with references transformers produced for tiny random checkpoints of every family.

pub mod adapters;
pub mod backbone;
pub mod checkpointing;
pub mod config;
pub mod decoder;
pub mod device;
pub mod error;
pub mod families;
pub mod gate;
pub mod gemma;
pub mod gemma4;
pub mod gpt2;
pub mod gpt_oss;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod model;
pub mod multimodal;
pub mod olmo2;
pub mod olmo3;
pub mod packing;
pub mod pass_cost;
pub mod phi3;
pub mod prefix;
pub mod qwen2_5_vl;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_vl;
pub mod scalar_head;
pub mod vision_layers;
pub mod vision_tower;
pub mod vision_tower3;
pub mod visual_input;
pub mod weights;

pub use checkpointing::Checkpointed;
pub use config::{ArchConfig, Family, ModelConfig};
pub use device::{parse_device, parse_dtype};
pub use error::{ModelError, Result};
pub use gate::{ParamGate, Unit};
pub use layers::{position_ids_from_mask, ExpertSteps, KvCache};
pub use lora::LoraConfig;
pub use model::CausalLm;
pub use multimodal::Images;
pub use packing::Packing;
pub use pass_cost::PassCost;
pub use prefix::SharedPrefixes;
pub use scalar_head::{last_token_index, ScalarHeadModel};
pub use visual_input::Visual;
