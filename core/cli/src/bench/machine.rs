//! The machine's own limits, measured in the same run with the same libtorch and thread count,
//! so the other sections' figures read as fractions of what this machine can do and rows from
//! different machines compare; and what the machine is (CPU model, GPU name and bandwidth): the GEMM peak (an `n × n` matrix multiply in the benchmark's
//! dtype, `2n³` FLOPs) and the memory bandwidth (a large tensor copy, read + write).

use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::sync;

/// Measured limits.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Machine {
    /// Matrix-multiply throughput, TFLOP/s.
    pub gemm_tflops: f64,
    /// Copy bandwidth (bytes read + written per second), GB/s.
    pub copy_gbps: f64,
}

/// The best of `reps` timings of `f` (after one untimed call), in seconds.
fn best(device: Device, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    sync(device);
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            sync(device);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Measures the GEMM peak in `kind` and the copy bandwidth on `device`.
pub fn measure(device: Device, kind: Kind) -> Machine {
    let n: i64 = if device.is_cuda() { 8192 } else { 1024 };
    let a = Tensor::randn([n, n], (kind, device));
    let b = Tensor::randn([n, n], (kind, device));
    let reps = if device.is_cuda() { 10 } else { 5 };
    let gemm_s = best(device, reps, || {
        let _ = a.matmul(&b);
    });
    // 256 MiB of f32, well past the caches.
    let elems: i64 = 64 << 20;
    let src = Tensor::ones([elems], (Kind::Float, device));
    let mut dst = src.zeros_like();
    let copy_s = best(device, reps, || {
        dst.copy_(&src);
    });
    Machine {
        gemm_tflops: 2.0 * (n as f64).powi(3) / gemm_s / 1e12,
        copy_gbps: 2.0 * (elems as f64) * 4.0 / copy_s / 1e9,
    }
}

/// The CUDA device's name from the driver (`nvidia-smi`, else `/proc/driver/nvidia`).
pub(crate) fn cuda_name(index: usize) -> Option<String> {
    // nvidia-smi numbers devices physically; CUDA_VISIBLE_DEVICES maps ours onto them.
    let physical = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| v.split(',').nth(index).map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| index.to_string());
    let smi = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader", "-i", &physical])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty());
    smi.or_else(|| {
        let mut gpus: Vec<PathBuf> =
            std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?.flatten().map(|e| e.path()).collect();
        gpus.sort();
        let info = std::fs::read_to_string(gpus.get(index)?.join("information")).ok()?;
        Some(info.lines().find_map(|l| l.strip_prefix("Model:"))?.trim().to_string())
    })
}

/// CUDA device name, or the CPU ([`crate::machine::describe_cpu`]: model, vector extensions,
/// libtorch's kernel capability) with the libtorch thread count.
pub(super) fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => cuda_name(i).unwrap_or_else(|| format!("CUDA device {i}")),
        _ => format!("{} ({} threads)", crate::machine::describe_cpu(), tch::get_num_threads()),
    }
}

/// HBM bandwidth (GB/s) of known GPUs.
pub(super) fn hbm_gbps(name: &str) -> Option<f64> {
    [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100", 2039.0), ("L40S", 864.0), ("A10", 600.0)]
        .iter()
        .find(|(k, _)| name.contains(k))
        .map(|(_, v)| *v)
}

/// Parameters stored in the checkpoint (read from the safetensors headers; tied weights once).
pub fn stored_params(dir: &Path) -> anyhow::Result<u64> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{}: not valid JSON", index.display()))?;
        let mut shards: Vec<String> = v["weight_map"]
            .as_object()
            .map(|m| m.values().filter_map(|s| s.as_str().map(String::from)).collect())
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        shards.iter().map(|s| dir.join(s)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut total = 0u64;
    for file in files {
        use std::io::Read;
        let mut f = std::fs::File::open(&file).with_context(|| format!("opening {}", file.display()))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).with_context(|| format!("{}: no safetensors header", file.display()))?;
        let mut header = vec![0u8; u64::from_le_bytes(len).min(100 << 20) as usize];
        f.read_exact(&mut header).with_context(|| format!("{}: truncated safetensors header", file.display()))?;
        let v: serde_json::Value = serde_json::from_slice(&header)
            .with_context(|| format!("{}: safetensors header is not JSON", file.display()))?;
        for (name, t) in v.as_object().into_iter().flatten() {
            if name != "__metadata__" {
                total += t["shape"].as_array().map(|s| s.iter().filter_map(|d| d.as_u64()).product()).unwrap_or(0);
            }
        }
    }
    Ok(total)
}
