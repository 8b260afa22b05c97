//! Tests of the shared tensor helpers against hand-computed values.

use super::*;

fn t2(rows: &[&[f32]]) -> Tensor {
    Tensor::from_slice2(rows)
}

fn values_of(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.f_to_kind(Kind::Double).unwrap().flatten(0, -1)).unwrap()
}

fn assert_close(actual: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((a - e).abs() <= tol, "{actual:?} vs {expected:?}");
    }
}

/// A step of 5 samples [1..5] split into micro-batches of 3 and 2 (k = 2): each micro-batch's
/// `row_mean / k` sums to the step's mean 3, where the mean of the two micro-batch means
/// (2 and 4.5) would give 3.25; and `token_mean` likewise for tokens (7 in all, 4 + 3).
#[test]
fn step_means_are_exact_over_unequal_micro_batches() {
    let micro = [Tensor::from_slice(&[1f32, 2., 3.]), Tensor::from_slice(&[4f32, 5.])];
    let sum: f64 = micro.iter().map(|x| row_mean(x, 2, 5.0).unwrap().double_value(&[]) / 2.0).sum();
    assert_close(&[sum], &[3.0], 1e-6);
    assert_close(&[row_mean(&micro[0], 1, 0.0).unwrap().double_value(&[])], &[2.0], 0.0);
    let (x, mask) = (t2(&[&[1., 2.], &[3., 9.]]), t2(&[&[1., 1.], &[1., 0.]])); // 3 tokens, Σ 6
    let (y, mask_y) = (t2(&[&[4., 5.], &[6., 7.]]), t2(&[&[1., 1.], &[1., 1.]])); // 4 tokens, Σ 22
    let n = 7.0;
    let step = token_mean(&x, &mask, 2, n).unwrap().double_value(&[]) / 2.0
        + token_mean(&y, &mask_y, 2, n).unwrap().double_value(&[]) / 2.0;
    assert_close(&[step], &[28.0 / 7.0], 1e-6);
}

/// Row 0: 2 valid tokens [1, 3] (slot 2 NaN garbage dropped by `masked`); row 1: none.
/// masked_mean = (1 + 3)/2 = 2; row sums [4, 0]; an all-padding batch gives 0, not NaN.
#[test]
fn masked_mean_and_sums_with_an_empty_row() {
    let mask = t2(&[&[1., 1., 0.], &[0., 0., 0.]]);
    let valid = mask.gt(0.0);
    let x = masked(&t2(&[&[1., 3., f32::NAN], &[f32::NAN, 5., 6.]]), &valid).unwrap();
    assert_close(&values_of(&x), &[1., 3., 0., 0., 0., 0.], 0.0);
    assert_eq!(scalar(&masked_mean(&x, &mask).unwrap()).unwrap(), 2.0);
    assert_close(&values_of(&masked_row_sum(&x, &mask).unwrap()), &[4., 0.], 0.0);
    let empty = t2(&[&[0., 0., 0.]]);
    assert_eq!(scalar(&masked_mean(&x.narrow(0, 1, 1), &empty).unwrap()).unwrap(), 0.0);
    // Fraction of valid tokens > 2: one of two.
    assert_eq!(scalar(&masked_fraction(&x.gt(2.0), &mask).unwrap()).unwrap(), 0.5);
    // approx_kl of log ratios [1, 3] = ½·(1 + 9)/2 = 2.5.
    assert_eq!(scalar(&approx_kl(&x, &mask).unwrap()).unwrap(), 2.5);
}

/// Valid [1, 2, 3 | 6]: mean 3, centred [−2, −1, 0, 3], unbiased var (4 + 1 + 0 + 9)/3 = 14/3.
#[test]
fn masked_whiten_by_hand() {
    let mask = t2(&[&[1., 1., 1.], &[1., 0., 0.]]);
    let x = t2(&[&[1., 2., 3.], &[6., 0., 0.]]);
    let s = (14.0f64 / 3.0 + 1e-8).sqrt();
    let expected = [-2.0 / s, -1.0 / s, 0.0, 3.0 / s, 0.0, 0.0];
    assert_close(&values_of(&masked_whiten(&x, &mask).unwrap()), &expected, 1e-6);
}

/// Rows of lengths 2, 3, 0: last indices [1, 2, 0].
#[test]
fn last_valid_token_and_per_token() {
    let valid = t2(&[&[1., 1., 0.], &[1., 1., 1.], &[0., 0., 0.]]).gt(0.0);
    assert_eq!(Vec::<i64>::try_from(last_index(&valid).unwrap().flatten(0, -1)).unwrap(), [1, 2, 0]);
    // A multi-turn action mask (observation slots 1–2 inside): the last sampled token.
    let holes = t2(&[&[1., 0., 0., 1., 0.], &[1., 1., 0., 0., 0.]]).gt(0.0);
    assert_eq!(Vec::<i64>::try_from(last_index(&holes).unwrap().flatten(0, -1)).unwrap(), [3, 1]);
    let x = t2(&[&[1., 2., 3.], &[4., 5., 6.], &[7., 8., 9.]]);
    assert_close(&values_of(&last_valid(&x, &valid).unwrap()), &[2., 6., 7.], 0.0);
    let a = per_token(&Tensor::from_slice(&[0.5f32, -1.0, 2.0]), &valid).unwrap();
    assert_close(&values_of(&a), &[0.5, 0.5, 0., -1., -1., -1., 0., 0., 0.], 0.0);
}

/// ids [7, 3, 7, 42, 7, 3] → dense [0, 1, 0, 2, 0, 1], G = 3 (group 7 not contiguous).
/// Group 7: [1, 2, 6] → mean 3, Σ (x − 3)² = 4 + 1 + 9 = 14: population sqrt(14/3), unbiased
///   sqrt(14/2) = sqrt(7).
/// Group 3: [4, 4] → mean 4, std 0 under both.
/// Group 42: [5] alone → mean 5, std 0 under both (the unbiased divisor is clamped to 1).
#[test]
fn group_stats_by_hand() {
    let ids = Tensor::from_slice(&[7i64, 3, 7, 42, 7, 3]);
    let (group, n) = group_index(&ids).unwrap();
    assert_eq!(n, 3);
    assert_eq!(Vec::<i64>::try_from(&group).unwrap(), [0, 1, 0, 2, 0, 1]);
    let x = Tensor::from_slice(&[1.0f64, 4.0, 2.0, 5.0, 6.0, 4.0]);
    let (mean, std) = group_stats(&x, &group, n, StdEstimator::Population).unwrap();
    assert_close(&values_of(&mean), &[3., 4., 5.], 0.0);
    assert_close(&values_of(&std), &[(14.0f64 / 3.0).sqrt(), 0., 0.], 1e-12);
    let (mean, std) = group_stats(&x, &group, n, StdEstimator::Unbiased).unwrap();
    assert_close(&values_of(&mean), &[3., 4., 5.], 0.0);
    assert_close(&values_of(&std), &[7.0f64.sqrt(), 0., 0.], 1e-12);
    // Per-sample form.
    assert_close(&values_of(&mean.index_select(0, &group)), &[3., 4., 3., 5., 3., 4.], 0.0);
}

/// log_ratio = 0.5: k1 = 0.5, k2 = ½·0.25 = 0.125, k3 = exp(−0.5) + 0.5 − 1 = 0.1065307.
#[test]
fn kl_estimators_by_hand() {
    let (logp, reff) = (t2(&[&[-1.0]]), t2(&[&[-1.5]]));
    for (est, k) in [(KlEstimator::K1, 0.5), (KlEstimator::K2, 0.125), (KlEstimator::K3, 0.1065307)] {
        assert_close(&values_of(&kl_estimate(&logp, &reff, est).unwrap()), &[k], 1e-7);
    }
    let e: KlEstimator = serde_json::from_str(r#""k3""#).unwrap();
    assert_eq!(e, KlEstimator::K3);
}

/// kl_ctl 0.1, target 6, horizon 10000, 2 samples: KL 4 → err = clip(−1/3) = −0.2 →
/// 0.1·(1 − 0.2·2/10000) = 0.099996; KL 6.6 → err = 0.1 → 0.1·(1 + 0.1·2/10000) = 0.100002.
#[test]
fn adaptive_kl_by_hand() {
    let c = AdaptiveKl::default();
    assert!((c.update(0.1, 4.0, 2) - 0.099996).abs() < 1e-15);
    assert!((c.update(0.1, 6.6, 2) - 0.100002).abs() < 1e-15);
    assert_eq!(c.update(0.1, 6.0, 2), 0.1);
}

#[test]
fn std_estimator_config_names() {
    let e: StdEstimator = serde_json::from_str(r#""unbiased""#).unwrap();
    assert_eq!(e, StdEstimator::Unbiased);
    assert_eq!(serde_json::to_string(&StdEstimator::Population).unwrap(), r#""population""#);
}

/// targets [2, −1, 2.5], values [1, 0, 3]: Var(targets) = 7.1666667/3 (mean 3.5/3),
/// Var([1, −1, −0.5]) = 2.1666667/3 → 1 − 2.1666667/7.1666667 = 0.6976744.
/// Masked: the same three as valid tokens of a [2, 2] batch with one padded slot.
#[test]
fn explained_variance_by_hand() {
    let ev = explained_variance(&Tensor::from_slice(&[1.0f32, 0., 3.]), &Tensor::from_slice(&[2.0f32, -1., 2.5]));
    assert!((ev.unwrap().unwrap() - 0.6976744).abs() < 1e-6);
    let mask = t2(&[&[1., 1.], &[1., 0.]]);
    let ev = masked_explained_variance(&t2(&[&[1., 0.], &[3., 0.]]), &t2(&[&[2., -1.], &[2.5, 0.]]), &mask);
    assert!((ev.unwrap().unwrap() - 0.6976744).abs() < 1e-6);
    // Constant targets: no variance to explain.
    let ones = Tensor::from_slice(&[1.0f32, 1., 1.]);
    assert_eq!(explained_variance(&ones, &ones).unwrap(), None);
    assert_eq!(masked_explained_variance(&mask, &mask.ones_like(), &mask).unwrap(), None);
}

#[test]
fn checks_name_the_tensor_and_the_key() {
    let t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let e = expect_shape("values", &t, &[4, 3]).unwrap_err();
    assert_eq!(e.to_string(), "values: expected shape [4, 3], got [4]");
    assert!(expect_shape("values", &t, &[4]).is_ok());
    let e = need(&None, "ref_logprobs", "grpo").unwrap_err();
    assert_eq!(e.to_string(), "grpo: the host passed no `ref_logprobs` although the requirements ask for it");
    assert!(need(&Some(t), "ref_logprobs", "grpo").is_ok());
    assert_eq!(check_nonnegative("beta", -1.0).unwrap_err().to_string(), "beta: must be >= 0, got -1");
    assert!(check_nonnegative("beta", f64::NAN).is_err() && check_nonnegative("beta", 0.0).is_ok());
    assert_eq!(check_positive("eps", 0.0).unwrap_err().to_string(), "eps: must be > 0, got 0");
    assert!(check_positive("eps", f64::NAN).is_err() && check_positive("eps", 1e-9).is_ok());
    assert_eq!(check_unit_interval("lam", 1.5).unwrap_err().to_string(), "lam: must be in [0, 1], got 1.5");
    assert!(check_unit_interval("lam", f64::NAN).is_err() && check_unit_interval("lam", 1.0).is_ok());
}

#[test]
fn metrics_builder_keeps_order() {
    let m = Metrics::new()
        .value("a", 1.0)
        .scalar("b", &Tensor::from(2.5f64))
        .unwrap()
        .optional("c", None)
        .optional("d", Some(4.0))
        .finish();
    assert_eq!(m, vec![("a".to_string(), 1.0), ("b".to_string(), 2.5), ("d".to_string(), 4.0)]);
}
