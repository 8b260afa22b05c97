//! LoRA: adapters on every family, merged (in place and on save) vs unmerged logits within 1e-5 of
//! the largest logit, only adapters (and a scalar model's head) train, and bad settings are refused by key.

use rlhf_integration_tests::model_dir;
use rlhf_models::{CausalLm, LoraConfig, ScalarHeadModel};
use tch::{Device, Kind, Tensor};

fn lora(targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: targets.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Gives every `lora_B` a non-zero value (it starts at zero) so the update is visible, and every
/// `lora_A` a fixed one too. The values are fixed patterns (`0.02·sin(1.7·i + k)`, `0.1·cos(0.9·i +
/// k)`: updates about as large as the weights), not draws from libtorch's global generator, which
/// the other tests of this binary use concurrently: every run checks the same numbers. Returns the
/// number of `lora_B` tensors.
fn randomise_b(vs: &tch::nn::VarStore) -> usize {
    let mut n = 0;
    let mut vars = vs.variables().into_iter().collect::<Vec<_>>();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| {
        for (k, (name, mut t)) in vars.into_iter().enumerate() {
            let i = Tensor::arange(t.numel() as i64, (Kind::Float, Device::Cpu));
            let size = t.size();
            if name.contains(".lora_B.") {
                t.copy_(&((i * 1.7 + k as f64).sin() * 0.02).view(size.as_slice()));
                n += 1;
            } else if name.contains(".lora_A.") {
                t.copy_(&((i * 0.9 + k as f64).cos() * 0.1).view(size.as_slice()));
            }
        }
    });
    n
}

fn batch() -> (Tensor, Tensor) {
    let ids = Tensor::from_slice(&[0i64, 5, 9, 12, 3, 7, 1, 2, 8, 4, 6, 10]).view([2, 6]);
    let mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]).view([2, 6]);
    (ids, mask)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn merged_and_unmerged_logits_agree() {
    let (ids, mask) = batch();
    for (name, targets) in
        [("llama", vec!["all-linear"]), ("qwen2", vec!["q_proj", "v_proj"]), ("gpt2", vec!["c_attn", "mlp.c_proj"])]
    {
        let base = CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let base_logits = tch::no_grad(|| base.forward(&ids, &mask)).unwrap();
        let mut m = CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Float).unwrap();
        let n = m.apply_lora(&lora(&targets)).unwrap();
        assert!(n > 0);
        // B = 0: adapters start as the identity update.
        let fresh = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        assert_eq!(max_diff(&fresh, &base_logits), 0.0, "{name}: fresh adapters changed the output");
        assert_eq!(randomise_b(&m.vs), n);
        let unmerged = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        assert!(max_diff(&unmerged, &base_logits) > 1e-2, "{name}: adapters have no effect");

        // Saved (merged) checkpoint, reloaded as a plain model.
        let dir = tempfile::tempdir().unwrap();
        m.save(dir.path()).unwrap();
        let names: Vec<String> = Tensor::read_safetensors(dir.path().join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(names.iter().all(|n| !n.contains("lora")), "{name}: adapter tensors saved: {names:?}");
        let plain = CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
        let reloaded = tch::no_grad(|| plain.forward(&ids, &mask)).unwrap();
        // 1e-5 relative to the largest logit: W·x + B·(A·x) and (W + B·A)·x round differently, and
        // on these logits (|z| ≈ 8) f32 rounding alone reaches ~9e-6 (ulp(8) = 9.5e-7).
        let scale = unmerged.abs().max().double_value(&[]).max(1.0);
        let d = max_diff(&reloaded, &unmerged);
        println!("{name}: max |logit| {scale:.3}, merged vs unmerged {d:e}");
        assert!(d < 1e-5 * scale, "{name}: merged checkpoint differs by {d} (max |logit| {scale})");

        // In-place merge.
        m.merge_lora().unwrap();
        let merged = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        let d = max_diff(&merged, &unmerged);
        assert!(d < 1e-5 * scale, "{name}: in-place merge differs by {d} (max |logit| {scale})");
    }
}

#[test]
fn scalar_head_lora_merges_and_keeps_head_trainable() {
    tch::manual_seed(1);
    let (ids, mask) = batch();
    let mut m = ScalarHeadModel::from_dir(&model_dir("llama-rm"), Device::Cpu, Kind::Float).unwrap();
    m.apply_lora(&lora(&["q_proj", "v_proj"])).unwrap();
    randomise_b(&m.vs);
    for (name, t) in m.vs.variables() {
        let expect = name.contains(".lora_") || name.starts_with("score.");
        assert_eq!(t.requires_grad(), expect, "{name}");
    }
    let scores = tch::no_grad(|| m.scores(&ids, &mask)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    m.save(dir.path()).unwrap();
    let plain = ScalarHeadModel::from_dir(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let d = max_diff(&tch::no_grad(|| plain.scores(&ids, &mask)).unwrap(), &scores);
    assert!(d < 1e-5, "scores differ by {d}");
}

#[test]
fn only_adapters_receive_gradients() {
    let (ids, mask) = batch();
    let mut m = CausalLm::from_dir(&model_dir("llama"), Device::Cpu, Kind::Float).unwrap();
    m.apply_lora(&lora(&["q_proj", "v_proj"])).unwrap();
    let (trainable, total) = rlhf_models::lora::parameter_counts(&m.vs);
    assert!(trainable > 0 && trainable < total / 4, "{trainable} of {total}");
    m.forward(&ids, &mask).unwrap().sum(Kind::Float).backward();
    for (name, t) in m.vs.variables() {
        let g = t.grad();
        if name.contains(".lora_") {
            assert!(g.defined(), "{name} got no gradient");
        } else {
            assert!(!g.defined(), "{name} is frozen but got a gradient");
        }
    }
}

#[test]
fn bad_settings_name_the_key() {
    let mut m = CausalLm::from_dir(&model_dir("gpt2"), Device::Cpu, Kind::Float).unwrap();
    let e = m.apply_lora(&lora(&["q_proj"])).unwrap_err().to_string();
    assert!(e.contains("lora.target_modules") && e.contains("c_attn"), "{e}");
    let e = m.apply_lora(&LoraConfig { dropout: 1.5, ..lora(&["c_attn"]) }).unwrap_err().to_string();
    assert!(e.contains("lora.dropout"), "{e}");
    let e = m.apply_lora(&LoraConfig { rank: -1, ..lora(&["c_attn"]) }).unwrap_err().to_string();
    assert!(e.contains("lora.rank"), "{e}");
    let experts = vec!["experts.gate_up_proj".to_string()];
    let e = m.apply_lora(&LoraConfig { dropout: 0.1, target_parameters: experts.clone(), ..lora(&["c_attn"]) });
    let e = e.unwrap_err().to_string();
    assert!(e.contains("lora.dropout: must be 0 with target_parameters"), "{e}");
    let e = m.apply_lora(&LoraConfig { target_parameters: experts, ..lora(&["c_attn"]) }).unwrap_err().to_string();
    assert!(e.contains("lora.target_parameters") && e.contains("its stacked weights: none"), "{e}");
    assert_eq!(m.apply_lora(&LoraConfig::default()).unwrap(), 0, "rank 0 is off");
}

/// The bound taken literally, 1e-5 absolute on the logits: in f64 the merge is exact up to
/// rounding far below it, so the f32 test's relative bound above measures f32 rounding alone.
#[test]
fn merged_and_unmerged_logits_agree_within_1e_5_in_f64() {
    let (ids, mask) = batch();
    for (name, targets) in [("llama", vec!["all-linear"]), ("gpt2", vec!["c_attn", "mlp.c_proj"])] {
        let mut m = CausalLm::from_dir(&model_dir(name), Device::Cpu, Kind::Double).unwrap();
        let base = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        m.apply_lora(&lora(&targets)).unwrap();
        assert!(randomise_b(&m.vs) > 0);
        let unmerged = tch::no_grad(|| m.forward(&ids, &mask)).unwrap();
        assert_eq!(unmerged.kind(), Kind::Double, "{name}: computed in f64");
        assert!(max_diff(&unmerged, &base) > 1e-2, "{name}: adapters have no effect");
        let dir = tempfile::tempdir().unwrap();
        m.save(dir.path()).unwrap();
        let plain = CausalLm::from_dir(dir.path(), Device::Cpu, Kind::Double).unwrap();
        let reloaded = tch::no_grad(|| plain.forward(&ids, &mask)).unwrap();
        let d = max_diff(&reloaded, &unmerged);
        println!("{name} (f64): merged checkpoint vs unmerged {d:e}");
        assert!(d < 1e-5, "{name}: merged checkpoint differs by {d}");
    }
}
