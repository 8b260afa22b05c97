//! Small helpers for an algorithm's hand-computed unit tests (they panic on failure, as tests do):
//! tensors from literals, values back out, a toleranced comparison and a metric by name. The
//! in-tree algorithm plugins use them; so can a third-party plugin's `#[cfg(test)]` module.

use tch::Tensor;

/// A `[n]` f32 tensor.
pub fn t1(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

/// A `[rows, cols]` f32 tensor.
pub fn t2(rows: &[&[f32]]) -> Tensor {
    Tensor::from_slice2(rows)
}

/// Every value of an f32 tensor, row-major.
pub fn values_of(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).expect("an f32 tensor")
}

/// Panics unless `actual` and `expected` have one length and differ by at most `tol` everywhere.
pub fn assert_close(actual: &[f32], expected: &[f32], tol: f32) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((a - e).abs() <= tol, "{actual:?} vs {expected:?}");
    }
}

/// The value of metric `name` (panics when there is none).
pub fn metric(m: &[(String, f64)], name: &str) -> f64 {
    m.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no metric {name} in {m:?}")).1
}
