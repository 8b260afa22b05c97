//! GGUF files (llama.cpp's checkpoint format): reading, dequantisation, and import of Llama, Qwen2,
//! Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Gemma 4, Phi-3, OLMo 2 and 3, gpt-oss, Qwen3.5, Qwen3.5-MoE and
//! Qwen3-Next models into Hugging Face checkpoint directories that `rlhf-models` and transformers
//! load.
//!
//! ```no_run
//! use rlhf_gguf::{import_llama, GgufFile, OutDtype};
//!
//! let gguf = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
//! println!("{:?}", gguf.get("general.name"));
//! import_llama(&gguf, "models/smollm2-135m-instruct".as_ref(), OutDtype::F32)?;
//! # Ok::<(), rlhf_gguf::GgufError>(())
//! ```
//!
//! The reader is written here rather than taken from crates.io: of the GGUF crates there,
//! `gguf`, `gguf-rs` and `gguf-rs-lib` (~20k lines) parse but do not dequantise, `candle-core`
//! brings a whole tensor framework, and `ggus` + `ggml-quants` (0.x) dequantise but pull rayon,
//! regex, indexmap and num_enum's proc-macro stack — for a format that takes a few hundred lines.
//! The crate has no tch dependency, so `cargo xtask` can use it.
//!
//! Dequantisation covers F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4; files
//! with other types (Q2_K, Q3_K, IQ) can be read, and their tensors are refused with the type named.

mod dequant;
mod error;
mod gemma4;
mod gemma4_layout;
mod hybrid;
mod import;
mod layout;
mod linear;
mod meta;
mod olmo3;
mod params;
mod reader;
mod rope;
mod spm;
mod streamed;
pub mod tokenizer;
mod transform;
mod types;
mod writer;

pub use dequant::dequantize;
pub use error::{GgufError, Result};
pub use gemma4::Gemma4Params;
pub use import::{import_llama, ImportSummary, OUTPUT_FILES};
pub use layout::{permute_rows, unpermute_rows};
pub use linear::LinearParams;
pub use params::{LlamaParams, MoeParams, OutDtype};
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
pub use types::{GgmlType, Value, ValueType};
pub use writer::GgufWriter;
