//! What the gradient tests share: the fixture models, and parameter gradients taken and compared.

use std::path::PathBuf;

use tch::Tensor;

/// A fixture model's directory (`integration-tests/fixtures/models/<name>`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integration-tests/fixtures/models").join(name)
}

/// Every defined gradient of `vs`, by name, then cleared.
pub fn take_grads(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter_map(|(n, v)| {
            let g = v.grad();
            g.defined().then(|| (n, g.copy()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, v) in vs.variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    out
}

/// The same parameters got gradients in both, each within 1e-5 of the largest of `plain`'s.
pub fn assert_same_grads(what: &str, plain: &[(String, Tensor)], ck: &[(String, Tensor)]) {
    assert!(!plain.is_empty(), "{what}: no gradients");
    let names = |g: &[(String, Tensor)]| g.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(plain), names(ck), "{what}: the same parameters get gradients");
    for ((name, a), (_, b)) in plain.iter().zip(ck) {
        let scale = a.abs().max().double_value(&[]).max(1e-12);
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-5 * scale, "{what}: {name}: max |Δ| {d} against max |g| {scale}");
    }
}
