//! Turning stored tensor data into `f32`, as ggml's `dequantize_row_*` do.
//!
//! Block layouts (32 elements per block, little-endian):
//!
//! | type | bytes | layout | element `j` |
//! | --- | --- | --- | --- |
//! | `Q8_0` | 34 | `f16 d`, 32 × `i8 q` | `d · q[j]` |
//! | `Q4_0` | 18 | `f16 d`, 16 bytes of nibbles | `d · (n_j − 8)` |
//! | `Q4_1` | 20 | `f16 d`, `f16 m`, 16 bytes of nibbles | `d · n_j + m` |
//! | `Q5_0` | 22 | `f16 d`, 4 bytes of fifth bits, 16 bytes of nibbles | `(n_j + 16·h_j − 16) · d` |
//! | `Q5_1` | 24 | `f16 d`, `f16 m`, 4 bytes of fifth bits, 16 bytes of nibbles | `(n_j + 16·h_j) · d + m` |
//! | `MXFP4` | 17 | `u8 e` (E8M0), 16 bytes of nibbles | `2^(e−128) · K[n_j]` |
//!
//! where the nibble `n_j` is the low four bits of byte `j` for `j < 16` and the high four bits
//! of byte `j − 16` for `j ≥ 16`, and the fifth bit `h_j` is bit `j` of the little-endian `u32`
//! before the nibbles. MXFP4's nibbles are E2M1 codes (sign bit, then a value of 0, 0.5, 1, 1.5,
//! 2, 3, 4 or 6), which ggml reads through `K = [0, 1, 2, 3, 4, 6, 8, 12, 0, −1, −2, −3, −4, −6,
//! −8, −12]` (the values doubled) with half the shared scale `2^(e−127)`. llama.cpp quantises to Q5_0 and Q8_0 the tensors of a K-quant file whose
//! rows are not a multiple of 256 (Gemma 3 270M's 640).
//!
//! The K-quants (256 elements per block, in sub-blocks with their own scales):
//!
//! | type | bytes | layout | element |
//! | --- | --- | --- | --- |
//! | `Q4_K` | 144 | `f16 d`, `f16 dmin`, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles | `d · sc · n − dmin · m` |
//! | `Q5_K` | 176 | as `Q4_K`, then 32 bytes of fifth bits before the nibbles | `d · sc · (n + 16·h) − dmin · m` |
//! | `Q6_K` | 210 | 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 `i8` scales, `f16 d` | `d · sc · (q − 32)` |
//!
//! Q4_K and Q5_K have 8 sub-blocks of 32 with a 6-bit scale and min each (`get_scale_min_k4`),
//! Q6_K 16 sub-blocks of 16 with an `i8` scale; the element order is ggml's
//! `dequantize_row_q{4,5,6}_K`.

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
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let with_min = t == GgmlType::Q5_1;
            for block in data.chunks_exact(t.block_bytes() as usize) {
                // As ggml: the 5-bit integer (minus 16 for Q5_0) times `d`, plus `m` for Q5_1.
                let d = f16_at(block, 0);
                let (m, rest) = if with_min { (Some(f16_at(block, 2)), &block[4..]) } else { (None, &block[2..]) };
                let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                let qs = &rest[4..];
                let value = |n: u8, j: usize| {
                    let x = i32::from(n) | (((qh >> j) & 1) as i32) << 4;
                    match m {
                        Some(m) => x as f32 * d + m,
                        None => (x - 16) as f32 * d,
                    }
                };
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(q & 0x0f, j)));
                out.extend(qs.iter().enumerate().map(|(j, &q)| value(q >> 4, j + 16)));
            }
        }
        GgmlType::MXFP4 => {
            for block in data.chunks_exact(17) {
                let d = e8m0_half(block[0]);
                let qs = &block[1..];
                out.extend(qs.iter().map(|&q| d * f32::from(MXFP4_VALUES[usize::from(q & 0x0f)])));
                out.extend(qs.iter().map(|&q| d * f32::from(MXFP4_VALUES[usize::from(q >> 4)])));
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let five = t == GgmlType::Q5_K;
            for block in data.chunks_exact(t.block_bytes() as usize) {
                k4_k5_block(block, five, &mut out);
            }
        }
        GgmlType::Q6_K => {
            for block in data.chunks_exact(210) {
                q6_k_block(block, &mut out);
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

/// The E2M1 values of the 16 MXFP4 codes, doubled (ggml's `kvalues_mxfp4`).
const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e − 128)`, half the E8M0 scale `e`, exactly (ggml's `GGML_E8M0_TO_FP32_HALF`): the f32
/// exponent field `e − 1` for `e ≥ 2`, and the subnormals `2^−128` and `2^−127` for 0 and 1.
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

/// Scale and min `j` (0..8) of a Q4_K / Q5_K block's 12 packed bytes (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (d, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (f32::from(d), f32::from(m))
}

/// One Q4_K (or, with `five`, Q5_K) block of 256 elements.
fn k4_k5_block(block: &[u8], five: bool, out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let (qh, ql) = if five { (&block[16..48], &block[48..]) } else { (&block[0..0], &block[16..]) };
    let (mut u1, mut u2) = (1u8, 2u8);
    for (chunk, q) in ql.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1, d2, min2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let high = |l: usize, u: u8| if five && qh[l] & u != 0 { 16.0 } else { 0.0 };
        out.extend(q.iter().enumerate().map(|(l, &b)| d1 * (f32::from(b & 0x0f) + high(l, u1)) - min1));
        out.extend(q.iter().enumerate().map(|(l, &b)| d2 * (f32::from(b >> 4) + high(l, u2)) - min2));
        u1 <<= 2;
        u2 <<= 2;
    }
}

/// One Q6_K block of 256 elements.
fn q6_k_block(block: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
    let d = f16_at(block, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let mut y = [0f32; 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
        out.extend_from_slice(&y);
    }
}
