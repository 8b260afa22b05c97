//! Pillow's resampling of 8-bit images (`Image.resize`, `libImaging/Resample.c`), bit for bit:
//! a separable convolution, horizontal pass then vertical, each output pixel a weighted sum of the
//! input pixels within the filter's support (widened by the scale when shrinking, which is
//! Pillow's antialiasing), with the weights normalised to sum to 1, turned into 22-bit fixed point
//! and the sums rounded and clipped to 8 bits after each pass.

use crate::load::RgbImage;

/// Fixed-point precision of the 8-bit weights: `32 − 8 − 2` bits.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// A resampling filter: its kernel and its support (half-width) in input pixels at scale 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Keys' cubic convolution with `a = −0.5` (`Image.BICUBIC`, transformers' `resample=3`).
    Bicubic,
    /// The triangle filter (`Image.BILINEAR`, `resample=2`).
    Bilinear,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Bilinear => 1.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bicubic => {
                const A: f64 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Filter::Bilinear => (1.0 - x).max(0.0),
        }
    }
}

/// For each output pixel, the first input pixel it reads and its fixed-point weights
/// (Pillow's `precompute_coeffs` then `normalize_coeffs_8bpc`).
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ss = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero, then clamps.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let count = xmax.saturating_sub(xmin);
            let w: Vec<f64> = (0..count).map(|x| filter.weight((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
            let total: f64 = w.iter().sum();
            let fixed = w
                .iter()
                .map(|k| {
                    let k = if total != 0.0 { k / total } else { *k };
                    let scaled = k * f64::from(1u32 << PRECISION_BITS);
                    (if k < 0.0 { -0.5 + scaled } else { 0.5 + scaled }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

/// Rounds a fixed-point sum to 8 bits, clipping (Pillow's `clip8`).
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `image` resized to `width × height` with `filter`, as Pillow's `Image.resize(size, filter)`.
/// Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the
/// width does (earlier Pillow always ran the horizontal pass first; the two orders round
/// differently in the last bit of some pixels).
pub fn resize(image: &RgbImage, width: usize, height: usize, filter: Filter) -> RgbImage {
    let (w0, h0) = (image.width as i64, image.height as i64);
    let vertical_first = h0 - height as i64 > 0 && h0 - height as i64 > (w0 - width as i64) * 2;
    if vertical_first {
        let tall = vertical(image, height, filter);
        return horizontal(&tall, width, filter);
    }
    if width == image.width {
        return vertical(image, height, filter);
    }
    // Only the input rows the vertical pass reads go through the horizontal one.
    let (first, last) = if height != image.height {
        let rows = coefficients(image.height, height, filter);
        let (lo, k) = &rows[height - 1];
        (rows[0].0, lo + k.len())
    } else {
        (0, image.height)
    };
    let band = RgbImage {
        width: image.width,
        height: last - first,
        data: image.data[first * image.width * 3..last * image.width * 3].to_vec(),
    };
    let wide = horizontal(&band, width, filter);
    if height == image.height {
        return wide;
    }
    vertical_from(&wide, first, image.height, height, filter)
}

/// The horizontal pass: every row resampled to `width`.
fn horizontal(image: &RgbImage, width: usize, filter: Filter) -> RgbImage {
    if width == image.width {
        return image.clone();
    }
    let w0 = image.width;
    let half = 1i32 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; image.height * width * 3];
    for (y, src) in image.data.chunks_exact(w0 * 3).enumerate() {
        for (xx, (xmin, k)) in coefficients(w0, width, filter).iter().enumerate() {
            for c in 0..3 {
                let mut sum = half;
                for (x, w) in k.iter().enumerate() {
                    sum += i32::from(src[(xmin + x) * 3 + c]) * w;
                }
                out[(y * width + xx) * 3 + c] = clip8(sum);
            }
        }
    }
    RgbImage { width, height: image.height, data: out }
}

/// The vertical pass: every column resampled to `height`.
fn vertical(image: &RgbImage, height: usize, filter: Filter) -> RgbImage {
    vertical_from(image, 0, image.height, height, filter)
}

/// The vertical pass of an image `in_height` rows high of which `rows` holds those from `first`
/// on (the band the horizontal pass computed).
fn vertical_from(rows: &RgbImage, first: usize, in_height: usize, height: usize, filter: Filter) -> RgbImage {
    if height == in_height && first == 0 {
        return rows.clone();
    }
    let stride = rows.width * 3;
    let half = 1i32 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; height * stride];
    for (yy, (ymin, k)) in coefficients(in_height, height, filter).iter().enumerate() {
        let ymin = ymin - first;
        for x in 0..stride {
            let mut sum = half;
            for (y, w) in k.iter().enumerate() {
                sum += i32::from(rows.data[(ymin + y) * stride + x]) * w;
            }
            out[yy * stride + x] = clip8(sum);
        }
    }
    RgbImage { width: rows.width, height, data: out }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point_and_identity_is_a_copy() {
        for (i, o) in [(10, 3), (3, 10), (7, 7), (640, 28)] {
            for (_, k) in coefficients(i, o, Filter::Bicubic) {
                let total: i32 = k.iter().sum();
                assert!((total - (1 << PRECISION_BITS)).abs() <= k.len() as i32, "{i}->{o}: {total}");
            }
        }
        let img = RgbImage::new(2, 2, (0..12).map(|v| v as u8 * 20).collect()).unwrap();
        assert_eq!(resize(&img, 2, 2, Filter::Bicubic), img);
    }
}
