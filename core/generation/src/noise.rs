//! Counter-based sampling noise: one uniform per (key, global row, decode step), a pure function
//! of the three, computed on the device in integer tensor ops — exact, so every device, every
//! rank and a replayed CUDA graph draw the same numbers, and no generator state is consumed.
//!
//! A row's base `splitmix64(splitmix64(key) ^ row)` is hashed on the host once per decode; the
//! table `u[step, row] = lowbias32(base[row] ^ lowbias32(step)) / 2³²` (24 bits kept) is built on
//! the device once for every step of the decode, and each step reads its row of the table by the
//! step counter that lives on the device.
//!
//! splitmix64: Steele, Lea and Flood, "Fast splittable pseudorandom number generators" (2014).
//! lowbias32: Chris Wellons' hash-prospector (a 32-bit integer hash with low bias, public domain).

use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// lowbias32's multipliers.
const M1: u32 = 0x7feb_352d;
const M2: u32 = 0x846c_a68b;

/// splitmix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// lowbias32 on the host (the reference the tensor version is tested against).
#[cfg(test)]
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(M1);
    x ^= x >> 15;
    x = x.wrapping_mul(M2);
    x ^ (x >> 16)
}

/// A row's 32-bit base for `key`.
fn row_base(key: u64, row: u64) -> u32 {
    (mix64(mix64(key) ^ row) >> 32) as u32
}

/// The uniform of (`key`, `row`, `step`) on the host: the top 24 bits of the hash, exact in f32.
#[cfg(test)]
fn uniform(key: u64, row: u64, step: u64) -> f32 {
    let h = hash32(row_base(key, row) ^ hash32(step as u32));
    (h >> 8) as f32 / (1u32 << 24) as f32
}

/// `(x · c) mod 2³²` for int64 tensors holding values below 2³², without an int64 overflow: `c`
/// is split in 16-bit halves, so no product exceeds 2⁴⁸.
fn mul32(x: &Tensor, c: u32) -> Result<Tensor> {
    let (lo, hi) = (i64::from(c & 0xffff), i64::from(c >> 16));
    let high = x.f_mul_scalar(hi)?.f_bitwise_and(0xffff)?.f_mul_scalar(1i64 << 16)?;
    Ok(x.f_mul_scalar(lo)?.f_add(&high)?.f_bitwise_and(0xffff_ffffi64)?)
}

/// `x ^ (x >> s)` for non-negative int64 tensors (the arithmetic shift is the logical one there).
fn xorshift(x: &Tensor, s: i64) -> Result<Tensor> {
    Ok(x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(s)?)?)
}

/// lowbias32 elementwise on an int64 tensor of values below 2³².
fn hash32_tensor(x: &Tensor) -> Result<Tensor> {
    let x = mul32(&xorshift(x, 16)?, M1)?;
    let x = mul32(&xorshift(&x, 15)?, M2)?;
    xorshift(&x, 16)
}

/// The noise of a decode: `u[step, r]` for `steps` steps and the rows `first_row ..
/// first_row + rows` of the whole batch, f32 in `[0, 1)`.
///
/// # Shapes
/// returns `[steps, rows]` (f32) on `device`
pub fn uniform_table(key: u64, first_row: i64, rows: i64, steps: i64, device: Device) -> Result<Tensor> {
    let bases: Vec<i64> = (0..rows).map(|r| i64::from(row_base(key, (first_row + r) as u64))).collect();
    let bases = Tensor::f_from_slice(&bases)?.f_to_device(device)?.f_view([1, rows])?;
    let steps = hash32_tensor(&Tensor::f_arange(steps, (Kind::Int64, device))?)?.f_view([steps, 1])?;
    let h = hash32_tensor(&bases.f_bitwise_xor_tensor(&steps)?)?; // [steps, rows]
    Ok(h.f_bitwise_right_shift_tensor_scalar(8)?.f_to_kind(Kind::Float)?.f_mul_scalar(1.0 / f64::from(1u32 << 24))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor hash is the host hash, bit for bit, across the whole 32-bit range.
    #[test]
    fn tensor_hash_equals_the_host_hash() {
        let xs: Vec<u32> =
            (0..4096u32).map(|i| i.wrapping_mul(0x9E37_79B9)).chain([0, 1, u32::MAX, u32::MAX - 1, 1 << 31]).collect();
        let t = Tensor::from_slice(&xs.iter().map(|&x| i64::from(x)).collect::<Vec<_>>());
        let got = Vec::<i64>::try_from(hash32_tensor(&t).unwrap()).unwrap();
        let want: Vec<i64> = xs.iter().map(|&x| i64::from(hash32(x))).collect();
        assert_eq!(got, want);
    }

    /// The table is the host formula, a window of rows is the same rows of the whole batch, and
    /// the uniforms look uniform.
    #[test]
    fn table_is_the_keyed_formula() {
        let t = uniform_table(42, 3, 5, 7, Device::Cpu).unwrap();
        assert_eq!(t.size(), [7, 5]);
        for s in 0..7 {
            for r in 0..5 {
                let got = t.double_value(&[s, r]) as f32;
                assert_eq!(got, uniform(42, 3 + r as u64, s as u64), "step {s} row {r}");
            }
        }
        let whole = uniform_table(42, 0, 8, 7, Device::Cpu).unwrap();
        assert!(whole.narrow(1, 3, 5).equal(&t));
        let big = uniform_table(7, 0, 256, 256, Device::Cpu).unwrap();
        let mean = big.mean(Kind::Double).double_value(&[]);
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        let low = big.lt(0.1).to_kind(Kind::Double).mean(Kind::Double).double_value(&[]);
        assert!((low - 0.1).abs() < 0.01, "{low}");
        assert!(!uniform_table(8, 0, 8, 7, Device::Cpu).unwrap().equal(&whole));
    }
}
