//! Turning stored tensor data into `f32`, as ggml's `dequantize_row_*` do.
//!
//! Block layouts (32 elements per block, little-endian):
//!
//! | type | bytes | layout | element `j` |
//! | --- | --- | --- | --- |
//! | `Q8_0` | 34 | `f16 d`, 32 × `i8 q` | `d · q[j]` |
//! | `Q4_0` | 18 | `f16 d`, 16 bytes of nibbles | `d · (n_j − 8)` |
//! | `Q4_1` | 20 | `f16 d`, `f16 m`, 16 bytes of nibbles | `d · n_j + m` |
//!
//! where the nibble `n_j` is the low four bits of byte `j` for `j < 16` and the high four bits
//! of byte `j − 16` for `j ≥ 16`.

use half::{bf16, f16};

use crate::types::GgmlType;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantises `n` elements of type `t` from `data` (exactly `n / block_size × block_bytes`
/// bytes). The error message says which type is not handled.
pub fn dequantize(t: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let expected = n as u64 / t.block_size() * t.block_bytes();
    if n as u64 % t.block_size() != 0 || data.len() as u64 != expected {
        return Err(format!("{n} elements of {t} need {expected} bytes, got {}", data.len()));
    }
    let mut out = Vec::with_capacity(n);
    match t {
        GgmlType::F32 => out.extend(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => {
            out.extend(data.chunks_exact(2).map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        GgmlType::BF16 => {
            out.extend(data.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
        }
        GgmlType::Q8_0 => {
            for block in data.chunks_exact(34) {
                let d = f16_at(block, 0);
                out.extend(block[2..].iter().map(|&q| d * f32::from(q as i8)));
            }
        }
        GgmlType::Q4_0 => {
            for block in data.chunks_exact(18) {
                let d = f16_at(block, 0);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| d * (f32::from(q & 0x0f) - 8.0)));
                out.extend(qs.iter().map(|&q| d * (f32::from(q >> 4) - 8.0)));
            }
        }
        GgmlType::Q4_1 => {
            for block in data.chunks_exact(20) {
                let d = f16_at(block, 0);
                let m = f16_at(block, 2);
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| d * f32::from(q & 0x0f) + m));
                out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
            }
        }
        other => {
            let supported: Vec<&str> =
                crate::types::ALL_TYPES.iter().filter(|t| t.can_dequantize()).map(|t| t.name()).collect();
            return Err(format!("cannot dequantise {other} (supported: {})", supported.join(", ")));
        }
    }
    debug_assert_eq!(out.len(), n);
    Ok(out)
}
