//! The host's side of the plugin contract, through the real `.so` plugins: padding positions of
//! every per-token input reach a plugin as exactly 0.0 (whatever the host held there, NaN
//! included), and a plugin metric named like a host metric comes back namespaced.

use std::path::PathBuf;

use rlhf_plugin_api::{Experience, Minibatch, PluginKind};
use rlhf_trainer::plugins::{host_context, AlgorithmHandle, PluginRegistry};
use tch::{Kind, Tensor};

fn plugin_dir() -> PathBuf {
    rlhf_integration_tests::rlhf_bin().parent().unwrap().to_path_buf()
}

fn handle(name: &str, config: &str) -> AlgorithmHandle {
    let reg = PluginRegistry::scan(&[plugin_dir()]).unwrap();
    AlgorithmHandle::new(
        reg.get(name, PluginKind::Algorithm).unwrap(),
        config,
        host_context("cpu", 0, 2),
        "algorithm.config",
    )
    .unwrap()
}

thread_local! {
    /// Which action mask the helpers below use: right padding only, or multi-turn holes.
    static HOLES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Four samples in two groups; rows 1 and 3 end early (padding after them). `[4, 3]` per token.
/// With holes (a multi-turn trajectory's observation tokens): rows 0 and 2 have an observation
/// slot inside, between sampled tokens.
fn mask() -> Tensor {
    let m: [f32; 12] = if HOLES.get() {
        [1., 0., 1., 1., 0., 0., 1., 0., 1., 1., 1., 0.]
    } else {
        [1., 1., 1., 1., 0., 0., 1., 1., 1., 1., 1., 0.]
    };
    Tensor::from_slice(&m).view([4, 3])
}

/// `x` with `fill` at the padding positions of [`mask`].
fn with_padding(x: &[f32], fill: f32) -> Tensor {
    let m = mask();
    Tensor::from_slice(x).view([4, 3]).where_self(&m.gt(0.0), &Tensor::from(fill))
}

fn experience(fill: f32) -> Experience {
    Experience {
        rewards: Tensor::from_slice(&[1f32, 0., 0.5, 0.25]),
        logprobs: with_padding(&[-1.0, -0.5, -2.0, -0.3, 0., 0., -1.2, -0.7, -0.1, -0.9, -1.5, 0.], fill),
        ref_logprobs: Some(with_padding(&[-1.1, -0.4, -2.2, -0.2, 0., 0., -1.0, -0.8, -0.2, -1.0, -1.4, 0.], fill)),
        values: Some(with_padding(&[0.1, 0.2, 0.3, 0.4, 0., 0., 0.5, 0.6, 0.7, 0.8, 0.9, 0.], fill)),
        action_mask: mask(),
        group_ids: Tensor::from_slice(&[3i64, 3, 8, 8]),
        step: 0,
        behavior_logprobs: None,
    }
}

fn minibatch(exp: &Experience, advantages: &Tensor, returns: Option<&Tensor>, fill: f32) -> (Minibatch, Tensor) {
    // The current policy's log-probs as a leaf, so the gradient can be read back.
    let lp = with_padding(&[-0.9, -0.6, -1.9, -0.35, 0., 0., -1.1, -0.75, -0.15, -0.8, -1.6, 0.], fill)
        .set_requires_grad(true);
    let values = with_padding(&[0.15, 0.2, 0.25, 0.45, 0., 0., 0.5, 0.55, 0.7, 0.75, 0.9, 0.], fill);
    let pad = |t: &Tensor| t.where_self(&mask().gt(0.0), &Tensor::from(fill));
    let mb = Minibatch {
        logprobs: lp.shallow_clone(),
        old_logprobs: exp.logprobs.shallow_clone(),
        ref_logprobs: exp.ref_logprobs.as_ref().map(|t| t.shallow_clone()),
        values: Some(values),
        old_values: exp.values.as_ref().map(|t| t.shallow_clone()),
        advantages: pad(advantages),
        returns: returns.map(pad),
        action_mask: mask(),
        entropy: Some(with_padding(&[0.5; 12], fill)),
        rewards: exp.rewards.shallow_clone(),
        step: 0,
        epoch: 0,
        accumulation_steps: 1,
        step_tokens: 0.0,
        step_rows: 0.0,
        behavior_logprobs: None,
    };
    (mb, lp)
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// Whatever the host holds in the padding (0, a stale value, NaN), the plugin computes the same
/// advantages, the same loss and the same gradient: the seam hands it zeros there.
#[test]
fn padding_reaches_plugins_as_zero() {
    padding_is_inert();
}

/// The observation tokens inside a multi-turn trajectory (action mask 0 between sampled tokens)
/// take no part either: whatever log-probs, values and advantages they carry, every algorithm
/// computes the same advantages on the sampled tokens, the same loss and the same gradient, and
/// none flows to an observation slot.
#[test]
fn observation_slots_inside_a_trajectory_are_inert() {
    HOLES.set(true);
    padding_is_inert();
}

fn padding_is_inert() {
    let algos = [
        ("grpo", "{}"),
        ("ppo", "{}"),
        ("ppo-seq", "{}"),
        ("rloo", "{}"),
        ("reinforce-pp", "{}"),
        ("gspo", "{}"),
        ("template-reinforce", "{}"),
    ];
    for (algo, config) in algos {
        let mut results = Vec::new();
        for fill in [0.0f32, 7.5, f32::NAN] {
            let mut h = handle(algo, config);
            let exp = experience(fill);
            let prepared = h.prepare(&exp).unwrap();
            let (mb, lp) = minibatch(&exp, &prepared.advantages, prepared.returns.as_ref(), fill);
            let out = h.loss(&mb).unwrap();
            out.loss.backward();
            let loss = out.loss.double_value(&[]);
            assert!(loss.is_finite(), "{algo}, padding {fill}: loss {loss}");
            let grad = values(&lp.grad());
            assert!(grad.iter().all(|g| g.is_finite()), "{algo}, padding {fill}: gradient {grad:?}");
            let m = mask();
            let adv = values(&prepared.advantages.where_self(&m.gt(0.0), &Tensor::from(0f32)));
            results.push((fill, adv, loss, grad));
        }
        let (_, adv0, loss0, grad0) = &results[0];
        let m = values(&mask());
        assert!(grad0.iter().zip(&m).all(|(g, m)| *m > 0.0 || *g == 0.0), "{algo}: gradient on a masked slot");
        for (fill, adv, loss, grad) in &results[1..] {
            assert_eq!(adv, adv0, "{algo}: advantages on valid tokens depend on padding {fill}");
            assert_eq!(loss, loss0, "{algo}: loss depends on padding {fill}");
            assert_eq!(grad, grad0, "{algo}: gradient depends on padding {fill}");
        }
    }
}

/// grpo reports the mean of its groups' reward std as `reward_std`, which is also the host's
/// batch std: the seam renames the plugin's to `grpo/reward_std`.
#[test]
fn plugin_metrics_named_like_host_metrics_are_namespaced() {
    let mut h = handle("grpo", "{}");
    let prepared = h.prepare(&experience(0.0)).unwrap();
    let names: Vec<&str> = prepared.metrics.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"grpo/reward_std"), "{names:?}");
    assert!(!names.contains(&"reward_std"), "{names:?}");
    // Group 3 has rewards [1, 0] (population std 0.5), group 8 [0.5, 0.25] (0.125): mean 0.3125.
    let v = prepared.metrics.iter().find(|(n, _)| n == "grpo/reward_std").unwrap().1;
    assert!((v - 0.3125).abs() < 1e-9, "{v}");
}
