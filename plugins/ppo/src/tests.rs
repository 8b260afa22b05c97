//! Hand-computed tests of the PPO plugin: rewards, GAE, losses, adaptive KL, config errors.
use super::*;
use rlhf_plugin_api::testing::{assert_close, metric, t1, t2, values_of};
use serde_json::json;
use tch::Device;

const NAN: f32 = f32::NAN;

fn ctx() -> Context {
    Context { device: "cpu".into(), seed: 0, samples_per_prompt: 1 }
}

fn ppo(cfg: serde_json::Value) -> Ppo {
    Ppo::new(&cfg.to_string(), &ctx()).unwrap()
}

fn experience(score: &[f32], old: &[&[f32]], reff: &[&[f32]], values: &[&[f32]], mask: &[&[f32]]) -> Experience {
    Experience {
        rewards: t1(score),
        logprobs: t2(old),
        ref_logprobs: Some(t2(reff)),
        values: Some(t2(values)),
        action_mask: t2(mask),
        group_ids: Tensor::arange(score.len() as i64, (Kind::Int64, Device::Cpu)),
        step: 0,
        behavior_logprobs: None,
    }
}

/// "Boil → the → shoe": V = [8, 9, 1], final score 0, no KL, γ = 1, λ = 0 (pure TD):
/// A = [9 − 8, 1 − 9, 0 − 1] = [+1, −8, −1], returns = A + V = [9, 1, 0].
#[test]
fn boil_the_shoe() {
    let mut algo = ppo(json!({"kl_ctl": 0.0, "gamma": 1.0, "lam": 0.0}));
    let exp =
        experience(&[0.0], &[&[-1.0, -2.0, -3.0]], &[&[-0.5, -0.5, -0.5]], &[&[8.0, 9.0, 1.0]], &[&[1.0, 1.0, 1.0]]);
    let p = algo.prepare(&exp).unwrap();
    assert_close(&values_of(&p.advantages), &[1.0, -8.0, -1.0], 1e-6);
    assert_close(&values_of(&p.returns.unwrap()), &[9.0, 1.0, 0.0], 1e-6);
}

/// A multi-turn trajectory: sampled, sampled, 2 observation tokens, sampled, padding. The
/// observation slots are not steps: advantages and returns of the three sampled tokens equal those
/// of the same three tokens without the observation in between, and are 0 on the observation,
/// whatever values, log-probs and reference log-probs it carries.
#[test]
fn gae_skips_observation_tokens() {
    let cfg = json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95});
    let compact = experience(&[2.0], &[&[-1.0, -2.0, -0.5]], &[&[-0.5, -1.0, -1.0]], &[&[1.0, 2.0, 3.0]], &[&[1.0; 3]]);
    let holes = experience(
        &[2.0],
        &[&[-1.0, -2.0, -9.0, NAN, -0.5, 0.0]],
        &[&[-0.5, -1.0, 4.0, 7.0, -1.0, 0.0]],
        &[&[1.0, 2.0, 50.0, -60.0, 3.0, 0.0]],
        &[&[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]],
    );
    let (a, b) = (ppo(cfg.clone()).prepare(&compact).unwrap(), ppo(cfg).prepare(&holes).unwrap());
    let pick = |v: Vec<f32>| vec![v[0], v[1], v[4]];
    let adv = values_of(&b.advantages);
    assert_close(&pick(adv.clone()), &values_of(&a.advantages), 1e-6);
    assert_close(&[adv[2], adv[3], adv[5]], &[0.0, 0.0, 0.0], 0.0);
    assert_close(&pick(values_of(&b.returns.unwrap())), &values_of(&a.returns.unwrap()), 1e-6);
}

/// γ = 0.9, λ = 0.95 (γλ = 0.855), kl_ctl = 0.1, clip_reward_value = 5.
///
/// Row 0 (3 tokens): k1 = old − ref = [0.5, −1.0, 0.0] → r = [−0.05, 0.1, 0.0]; score 7 → 5 at t = 2:
///   r = [−0.05, 0.1, 5.0], V = [1, 2, 3]
///   t=2: δ = 5 + 0 − 3 = 2.0;             A = 2.0
///   t=1: δ = 0.1 + 0.9·3 − 2 = 0.8;        A = 0.8 + 0.855·2.0 = 2.51
///   t=0: δ = −0.05 + 0.9·2 − 1 = 0.75;     A = 0.75 + 0.855·2.51 = 2.89605
///   returns = A + V = [3.89605, 4.51, 5.0]
/// Row 1 (2 tokens, slot 2 padded with garbage incl. NaN): k1 = [0.0, 0.2] → r = [0, −0.02];
///   score −8 → −5 at t = 1: r = [0, −5.02], V = [0.5, −1.0, (0)]
///   t=2: padding → A = 0
///   t=1: δ = −5.02 + 0.9·0 − (−1) = −4.02;  A = −4.02
///   t=0: δ = 0 + 0.9·(−1) − 0.5 = −1.4;     A = −1.4 + 0.855·(−4.02) = −4.8371
///   returns = [−4.3371, −5.02, 0]
#[test]
fn gae_by_hand_with_kl_clip_and_padding() {
    let mut algo = ppo(json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95, "clip_reward_value": 5.0}));
    let exp = experience(
        &[7.0, -8.0],
        &[&[-1.0, -2.0, -0.5], &[-0.2, -0.4, 9.0]],
        &[&[-1.5, -1.0, -0.5], &[-0.2, -0.6, -3.0]],
        &[&[1.0, 2.0, 3.0], &[0.5, -1.0, NAN]],
        &[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]],
    );
    let p = algo.prepare(&exp).unwrap();
    assert_close(&values_of(&p.advantages), &[2.89605, 2.51, 2.0, -4.8371, -4.02, 0.0], 1e-5);
    assert_close(&values_of(&p.returns.unwrap()), &[3.89605, 4.51, 5.0, -4.3371, -5.02, 0.0], 1e-5);
    assert_eq!(metric(&p.metrics, "ppo/kl_coef"), 0.1);
    // Σ k1 per row: [−0.5, 0.2] → mean −0.15.
    assert!((metric(&p.metrics, "ppo/rollout_kl") + 0.15).abs() < 1e-6);
    assert!(!p.advantages.requires_grad());
}

/// One token, γ = λ = 1, V = 0, score 0, kl_ctl = 1, old − ref = 0.5: A = −k.
/// k1 = 0.5; k2 = ½·0.25 = 0.125; k3 = exp(−0.5) + 0.5 − 1 = 0.1065307.
#[test]
fn kl_estimators() {
    for (est, k) in [("k1", 0.5f32), ("k2", 0.125), ("k3", 0.1065307)] {
        let mut algo = ppo(json!({"kl_ctl": 1.0, "lam": 1.0, "kl_estimator": est}));
        let exp = experience(&[0.0], &[&[-1.0]], &[&[-1.5]], &[&[0.0]], &[&[1.0]]);
        let p = algo.prepare(&exp).unwrap();
        assert_close(&values_of(&p.advantages), &[-k], 1e-6);
    }
}

/// Whitened advantages have mean 0 and unbiased std 1 over the valid tokens, 0 on padding;
/// returns are computed from the raw advantages.
#[test]
fn whitening() {
    let cfg = json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95, "whiten_advantages": true});
    let exp = || {
        experience(
            &[7.0, -8.0],
            &[&[-1.0, -2.0, -0.5], &[-0.2, -0.4, 9.0]],
            &[&[-1.5, -1.0, -0.5], &[-0.2, -0.6, -3.0]],
            &[&[1.0, 2.0, 3.0], &[0.5, -1.0, NAN]],
            &[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]],
        )
    };
    let p = ppo(cfg).prepare(&exp()).unwrap();
    let a = values_of(&p.advantages);
    assert_eq!(a[5], 0.0);
    let valid = &a[..5];
    let mean = valid.iter().sum::<f32>() / 5.0;
    let var = valid.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 4.0;
    assert!(mean.abs() < 1e-6, "{mean}");
    assert!((var.sqrt() - 1.0).abs() < 1e-5, "{var}");
    let raw = ppo(json!({"kl_ctl": 0.1, "gamma": 0.9, "lam": 0.95})).prepare(&exp()).unwrap();
    assert_close(&values_of(&p.returns.unwrap()), &values_of(&raw.returns.unwrap()), 0.0);
}

/// kl_ctl = 0.1, target 6, horizon 10000, B = 2.
/// Batch 1: Σ k1 per row = [3, 5] → KL 4; err = clip(4/6 − 1 = −0.333, ±0.2) = −0.2;
///   kl_ctl = 0.1·(1 − 0.2·2/10000) = 0.099996.
/// Batch 2 (uses 0.099996): KL 6.6; err = 6.6/6 − 1 = 0.1; kl_ctl = 0.099996·(1 + 0.1·2/10000).
#[test]
fn adaptive_kl_update() {
    let mut algo = ppo(json!({"kl_ctl": 0.1, "adaptive_kl": {"target": 6.0, "horizon": 10000}}));
    let batch = |k: [f32; 2]| {
        experience(&[0.0, 0.0], &[&[k[0]], &[k[1]]], &[&[0.0], &[0.0]], &[&[0.0], &[0.0]], &[&[1.0], &[1.0]])
    };
    let p = algo.prepare(&batch([3.0, 5.0])).unwrap();
    assert_eq!(metric(&p.metrics, "ppo/kl_coef"), 0.1);
    assert!((algo.kl_ctl - 0.099996).abs() < 1e-12, "{}", algo.kl_ctl);
    let p = algo.prepare(&batch([6.0, 7.2])).unwrap();
    assert!((metric(&p.metrics, "ppo/kl_coef") - 0.099996).abs() < 1e-12);
    assert!((algo.kl_ctl - 0.099996 * (1.0 + 0.1 * 2.0 / 10000.0)).abs() < 1e-9, "{}", algo.kl_ctl);
    // Fixed controller: unchanged.
    let mut fixed = ppo(json!({"kl_ctl": 0.1}));
    fixed.prepare(&batch([3.0, 5.0])).unwrap();
    assert_eq!(fixed.kl_ctl, 0.1);
}

/// ε = ε_v = 0.2, vf_coef 1. Valid tokens (1,1) is padding (garbage):
///   (0,0): ρ = 1.5, A = 2  → −3.0 vs −2·1.2 = −2.4 → −2.4 (clipped branch)
///   (0,1): ρ = 1,   A = −1 → 1.0 vs 1.0           → 1.0
///   (1,0): ρ = 0.5, A = 1  → −0.5 vs −0.8         → −0.5 (unclipped: pessimistic)
///   pg_loss = (−2.4 + 1.0 − 0.5)/3 = −0.6333333; clip_ratio = 1/3
///   values (v, old, ret): (1, 0.5, 2) → vclip 0.7: max(1, 1.69) = 1.69 (clipped)
///                         (0, 0.1, −1) → vclip 0: max(1, 1) = 1
///                         (3, 2, 2.5) → vclip 2.2: max(0.25, 0.09) = 0.25
///   vf_loss = ½·(1.69 + 1 + 0.25)/3 = 0.49; vf_clipfrac = 1/3
///   entropy [1, 2, 3] → mean 2; entropy_coef 0.01 → loss = −0.6333333 + 0.49 − 0.02 = −0.1633333
///   kl: Σ (logp − ref) per row = [0.1 + 0.2, 0.3] → mean 0.3
///   approx_kl = ½·(ln²1.5 + 0 + ln²0.5)/3
///   explained_var: returns [2, −1, 2.5], values [1, 0, 3]: Var(ret) = 7.1666667/3,
///   Var(ret − v) = Var([1, −1, −0.5]) = 2.1666667/3 → 1 − 2.1666667/7.1666667 = 0.6976744
#[test]
fn loss_by_hand_with_clipping() {
    let mut algo = ppo(json!({"entropy_coef": 0.01}));
    assert!(algo.requirements().entropy);
    let (l15, l05) = (1.5f32.ln(), 0.5f32.ln());
    let logp = t2(&[&[-1.0 + l15, -1.0], &[-2.0 + l05, NAN]]).set_requires_grad(true);
    let values = t2(&[&[1.0, 0.0], &[3.0, NAN]]).set_requires_grad(true);
    let mb = Minibatch {
        logprobs: logp.shallow_clone(),
        old_logprobs: t2(&[&[-1.0, -1.0], &[-2.0, 5.0]]),
        ref_logprobs: Some(t2(&[&[-1.1 + l15, -1.2], &[-2.3 + l05, 7.0]])),
        values: Some(values.shallow_clone()),
        old_values: Some(t2(&[&[0.5, 0.1], &[2.0, NAN]])),
        advantages: t2(&[&[2.0, -1.0], &[1.0, NAN]]),
        returns: Some(t2(&[&[2.0, -1.0], &[2.5, 1e30]])),
        action_mask: t2(&[&[1.0, 1.0], &[1.0, 0.0]]),
        entropy: Some(t2(&[&[1.0, 2.0], &[3.0, NAN]])),
        rewards: t1(&[0.0, 0.0]),
        step: 0,
        epoch: 0,
        accumulation_steps: 1,
        step_tokens: 0.0,
        step_rows: 0.0,
        behavior_logprobs: None,
    };
    let out = algo.loss(&mb).unwrap();
    let m = &out.metrics;
    assert!((metric(m, "loss/policy") + 0.6333333).abs() < 1e-6);
    assert!((metric(m, "loss/value") - 0.49).abs() < 1e-6);
    assert!((out.loss.double_value(&[]) + 0.1633333).abs() < 1e-6);
    assert!((metric(m, "clip_ratio") - 1.0 / 3.0).abs() < 1e-6);
    assert!((metric(m, "ppo/vf_clipfrac") - 1.0 / 3.0).abs() < 1e-6);
    assert!((metric(m, "entropy") - 2.0).abs() < 1e-6);
    assert!((metric(m, "kl") - 0.3).abs() < 1e-6);
    let approx_kl = 0.5 * (1.5f64.ln().powi(2) + 0.5f64.ln().powi(2)) / 3.0;
    assert!((metric(m, "approx_kl") - approx_kl).abs() < 1e-6);
    assert!((metric(m, "explained_var") - 0.6976744).abs() < 1e-6);

    // Gradients: padding gets none (and no NaN); the clipped (0,0) token gets none from pg_loss;
    // (1,0): d/dlogp of −A·ρ/3 = −1·0.5/3.
    out.loss.backward();
    let g = values_of(&logp.grad());
    assert_close(&g, &[0.0, 1.0 / 3.0, -0.5 / 3.0, 0.0], 1e-6);
    // Value grads: ½·d/dv of the chosen branch /3: (0,0) clipped branch is constant → 0;
    // (0,1): (v − ret) = 1 → 1/3 (both branches tie: torch splits, sum is the same); (1,0): 0.5/3.
    assert_close(&values_of(&values.grad()), &[0.0, 1.0 / 3.0, 0.5 / 3.0, 0.0], 1e-6);
}

/// A row with an empty mask produces neither NaN advantages nor a NaN loss, even with NaN garbage.
#[test]
fn all_masked_row_is_finite() {
    let mut algo = ppo(json!({"whiten_advantages": true}));
    let exp = experience(
        &[1.0, 3.0],
        &[&[-1.0, -1.0], &[NAN, NAN]],
        &[&[-1.0, -1.0], &[NAN, 0.0]],
        &[&[0.5, 0.5], &[NAN, NAN]],
        &[&[1.0, 1.0], &[0.0, 0.0]],
    );
    let p = algo.prepare(&exp).unwrap();
    let returns = p.returns.unwrap();
    assert!(values_of(&p.advantages).iter().all(|x| x.is_finite()));
    assert!(values_of(&returns).iter().all(|x| x.is_finite()));
    // The empty row gets no score: advantages and returns are 0, not the score at slot 0.
    assert_close(&values_of(&p.advantages.narrow(0, 1, 1)), &[0.0, 0.0], 0.0);
    assert_close(&values_of(&returns.narrow(0, 1, 1)), &[0.0, 0.0], 0.0);
    assert!(p.metrics.iter().all(|(_, v)| v.is_finite()), "{:?}", p.metrics);
    // A minibatch made of the empty row alone.
    let mb = Minibatch {
        logprobs: t2(&[&[NAN, NAN]]),
        old_logprobs: t2(&[&[NAN, NAN]]),
        ref_logprobs: Some(t2(&[&[NAN, NAN]])),
        values: Some(t2(&[&[NAN, NAN]])),
        old_values: Some(t2(&[&[NAN, NAN]])),
        advantages: p.advantages.narrow(0, 1, 1),
        returns: Some(returns.narrow(0, 1, 1)),
        action_mask: t2(&[&[0.0, 0.0]]),
        entropy: None,
        rewards: t1(&[3.0]),
        step: 0,
        epoch: 0,
        accumulation_steps: 1,
        step_tokens: 0.0,
        step_rows: 0.0,
        behavior_logprobs: None,
    };
    let out = algo.loss(&mb).unwrap();
    assert_eq!(out.loss.double_value(&[]), 0.0);
    assert!(out.metrics.iter().all(|(_, v)| v.is_finite()), "{:?}", out.metrics);
}

/// Shapes are the host's to check (before `prepare` runs); a required optional input that is
/// missing is the plugin's.
#[test]
fn missing_inputs_are_errors() {
    let mut algo = ppo(json!({}));
    let mut exp = experience(&[0.0], &[&[-1.0]], &[&[-1.0]], &[&[0.0]], &[&[1.0]]);
    exp.values = None;
    let e = algo.prepare(&exp).unwrap_err();
    assert!(e.to_string().contains("no `values`"), "{e}");
}

#[test]
fn requirements_follow_config() {
    let r = ppo(json!({})).requirements();
    assert_eq!(r, Requirements { reference: true, critic: true, entropy: false });
}

#[test]
fn defaults_are_deepspeed_chat() {
    let c = ppo(json!({})).cfg;
    assert_eq!((c.kl_ctl, c.clip_reward_value, c.gamma, c.lam), (0.1, 5.0, 1.0, 0.95));
    assert_eq!((c.cliprange, c.cliprange_value, c.vf_coef, c.entropy_coef), (0.2, 0.2, 1.0, 0.0));
    assert_eq!((c.whiten_advantages, c.kl_estimator), (false, KlEstimator::K1));
    assert!(c.adaptive_kl.is_none());
    let a = ppo(json!({"adaptive_kl": {}})).cfg.adaptive_kl.unwrap();
    assert_eq!((a.target, a.horizon), (6.0, 10000.0));
    let resolved = ppo(json!({"adaptive_kl": {}})).resolved_config();
    assert_eq!((&resolved["kl_estimator"], &resolved["adaptive_kl"]["horizon"]), (&json!("k1"), &json!(10000.0)));
}

#[test]
fn config_errors_name_the_key() {
    let err = |cfg: serde_json::Value| Ppo::new(&cfg.to_string(), &ctx()).unwrap_err().to_string();
    let e = err(json!({"kl_coef": 0.1}));
    assert!(e.starts_with("kl_coef: unknown field"), "{e}");
    let e = err(json!({"gamma": "one"}));
    assert!(e.starts_with("gamma: invalid type"), "{e}");
    let e = err(json!({"kl_estimator": "k4"}));
    assert!(e.starts_with("kl_estimator: unknown variant `k4`"), "{e}");
    let e = err(json!({"adaptive_kl": {"target": "six"}}));
    assert!(e.starts_with("adaptive_kl.target: invalid type"), "{e}");
    let e = err(json!({"lam": 1.5}));
    assert!(e.starts_with("lam: must be in [0, 1]"), "{e}");
}
