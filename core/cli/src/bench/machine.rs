//! The machine's own limits, measured in the same run with the same libtorch and thread count,
//! so the other sections' figures read as fractions of what this machine can do and rows from
//! different machines compare: the GEMM peak (an `n × n` matrix multiply in the benchmark's
//! dtype, `2n³` FLOPs) and the memory bandwidth (a large tensor copy, read + write).

use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

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
