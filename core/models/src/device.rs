//! Device and dtype selection. CUDA needs `libtorch_cuda.so` loaded into the process: the linker's
//! `--as-needed` drops it because nothing references its symbols directly, so we `dlopen` it on first
//! request and fail with a clear message when CUDA is asked for and absent.

use std::sync::OnceLock;

use tch::{Device, Kind};

use crate::error::{ModelError, Result};

/// Parses `cpu`, `cuda` or `cuda:N` and makes sure the device can be used.
pub fn parse_device(spec: &str) -> Result<Device> {
    let err = |message: &str| ModelError::Device { device: spec.to_string(), message: message.to_string() };
    match spec.trim() {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let index = match s.strip_prefix("cuda:") {
                None => 0,
                Some(n) => n.parse::<usize>().map_err(|_| err("expected cuda:<index>"))?,
            };
            ensure_cuda().map_err(|m| err(&m))?;
            let count = tch::Cuda::device_count() as usize;
            if index >= count {
                return Err(err(&format!("only {count} CUDA device(s) visible")));
            }
            Ok(Device::Cuda(index))
        }
        _ => Err(err("expected cpu, cuda or cuda:<index>")),
    }
}

/// Loads `libtorch_cuda.so` once and checks that a CUDA device is visible.
fn ensure_cuda() -> std::result::Result<(), String> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut candidates = vec![std::path::PathBuf::from("libtorch_cuda.so")];
            if let Some(dir) = option_env!("RLHF_LIBTORCH_LIB").or(option_env!("DEP_TCH_LIBTORCH_LIB")) {
                candidates.push(std::path::Path::new(dir).join("libtorch_cuda.so"));
            }
            if let Ok(dir) = std::env::var("LIBTORCH") {
                candidates.push(std::path::Path::new(&dir).join("lib").join("libtorch_cuda.so"));
            }
            let mut last = String::from("libtorch_cuda.so not found");
            for c in &candidates {
                // SAFETY: loading libtorch's own CUDA library runs its static initialisers, which
                // register CUDA kernels with the already loaded libtorch_cpu; nothing else runs.
                match unsafe { libloading::Library::new(c) } {
                    Ok(lib) => {
                        std::mem::forget(lib); // keep it loaded for the life of the process
                        if tch::Cuda::is_available() {
                            return Ok(());
                        }
                        return Err("libtorch_cuda.so loaded but no CUDA device is available".into());
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            Err(format!("CUDA requested but libtorch_cuda.so could not be loaded ({last})"))
        })
        .clone()
}

/// Parses a dtype name: `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`.
pub fn parse_dtype(spec: &str) -> Result<Kind> {
    match spec.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "f16" | "float16" | "half" => Ok(Kind::Half),
        other => Err(ModelError::Input(format!("dtype `{other}`: expected f32, bf16 or f16"))),
    }
}

/// The name transformers writes in `config.json` for a kind.
pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Double => "float64",
        _ => "float32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_dtypes() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
        assert!(parse_device("tpu").unwrap_err().to_string().contains("device `tpu`"));
        assert!(parse_device("cuda:x").is_err());
        assert_eq!(parse_dtype("bf16").unwrap(), Kind::BFloat16);
        assert!(parse_dtype("int8").unwrap_err().to_string().contains("int8"));
    }

    #[test]
    fn cuda_absent_is_a_clear_error() {
        if tch::Cuda::is_available() {
            return;
        }
        let e = parse_device("cuda").unwrap_err().to_string();
        assert!(e.starts_with("device `cuda`:"), "{e}");
    }
}
