//! OLMo 3, which llama.cpp's converter writes as `olmo2` with a sliding window: the layers named
//! sliding by `attention.sliding_window_pattern` (one flag per layer, or a period whose last layer
//! is full; every fourth layer full where the file does not say) attend to the window, with plain
//! RoPE at `rope.freq_base_swa` (the full layers' base where absent); the full layers attend to
//! everything with the file's RoPE scaling — as llama.cpp computes them, and as transformers'
//! `Olmo3ForCausalLM` does with `layer_types` and a rope block per layer type.

use serde_json::{json, Value};

use crate::error::{GgufError, Result};
use crate::reader::GgufFile;
use crate::types::Value as GgufValue;

/// Which of `layers` layers slide, from an `olmo2` file that has a window.
pub(crate) fn sliding_layers(g: &GgufFile, arch: &str, layers: u64) -> Result<Vec<bool>> {
    let key = format!("{arch}.attention.sliding_window_pattern");
    let period = |n: u64| (0..layers).map(|i| (i + 1) % n != 0).collect();
    match g.get(&key) {
        None => Ok(period(4)),
        Some(GgufValue::Array(_, flags)) => {
            let flags: Option<Vec<bool>> = flags.iter().map(GgufValue::as_bool).collect();
            match flags {
                Some(f) if f.len() as u64 == layers => Ok(f),
                Some(f) => Err(GgufError::metadata(g.path(), &key, format!("{} flags for {layers} layers", f.len()))),
                None => Err(GgufError::metadata(g.path(), &key, "expected a period or one bool per layer")),
            }
        }
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(period(n)),
            _ => Err(GgufError::metadata(g.path(), &key, "expected a period of at least 1 or one bool per layer")),
        },
    }
}

/// What an OLMo 3 config adds: the window, the layer kinds, and the rope block of each kind —
/// the full layers' (`full`: the file's scaling with its base) and the sliding layers' plain RoPE
/// at `sliding_theta`.
pub(crate) fn config_keys(sliding: &[bool], window: Option<u64>, full: Value, sliding_theta: f64) -> Value {
    let layer_types: Vec<&str> =
        sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    json!({
        "attention_bias": false,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta},
        },
    })
}
