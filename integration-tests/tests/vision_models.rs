//! Qwen2.5-VL against transformers on a tiny random checkpoint made at test time
//! (`fixtures/make_vl.py`): a left-padded batch of a prompt with one image, one with two and one
//! of text alone — the patches of our processor equal to transformers' processor's, the logits
//! within the families' tolerance, greedy tokens through the cache (3-D positions in the prompt,
//! each row's delta after it) equal; in both layouts a checkpoint comes in (transformers 5's
//! `model.language_model.*`, the Hub's `model.layers.*` + `visual.*` with a flat config); a save
//! keeps the names it loaded and reloads to the same logits bit for bit.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use rlhf_integration_tests::{fixtures, python};
use rlhf_models::{CausalLm, Images};
use rlhf_vision::{load_path, QwenVlProcessor};
use tch::{Device, Kind, Tensor};

/// The families' tolerance (transformers' own f32 logits are within 3e-7 of its f64 ones here).
const TOL: f64 = 1e-4;

fn make(dir: &Path) -> HashMap<String, Tensor> {
    let python = python().expect("python with transformers");
    let out = Command::new(python)
        .arg(fixtures().join("make_vl.py"))
        .args(["--out", dir.to_str().unwrap()])
        .output()
        .expect("spawn python");
    assert!(out.status.success(), "make_vl.py failed: {}", String::from_utf8_lossy(&out.stderr));
    println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap().into_iter().collect()
}

/// Our processor's patches for each row's images, in order.
fn images(dir: &Path) -> Images {
    let rows: Vec<Vec<String>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rows.json")).unwrap()).unwrap();
    let processor = QwenVlProcessor::default();
    let (mut values, mut grids) = (Vec::new(), Vec::new());
    for name in rows.iter().flatten() {
        let p = processor.preprocess(&load_path(&dir.join("images").join(name)).unwrap(), name).unwrap();
        values.push(Tensor::from_slice(&p.values).view([p.len() as i64, p.dim as i64]));
        grids.push(p.grid.map(|g| g as i64));
    }
    Images { pixel_values: Tensor::cat(&values, 0), grids }
}

/// Greedy decoding through the cache: the prompt with its images and 3-D positions, then each
/// token at its plain position plus the row's delta.
fn greedy(m: &CausalLm, ids: &Tensor, mask: &Tensor, images: &Images, steps: i64) -> Tensor {
    let (b, width) = (ids.size()[0], ids.size()[1]);
    let mut cache = m.new_cache(b, width + steps).unwrap();
    let (pos, deltas) = m.image_positions(ids, mask, &images.grids).unwrap();
    let features = m.image_features(images).unwrap();
    let h = m.hidden_states_with_images(ids, mask, &pos, &features, Some(&mut cache)).unwrap();
    let mut next = m.logits_from_hidden(&h.select(1, width - 1)).unwrap().argmax(-1, false).unsqueeze(-1);
    let (mut mask, mut out) = (mask.shallow_clone(), vec![next.shallow_clone()]);
    for _ in 1..steps {
        mask = Tensor::cat(&[&mask, &Tensor::ones([b, 1], (Kind::Int64, Device::Cpu))], 1);
        let plain = mask.sum_dim_intlist(-1, true, Kind::Int64) - 1; // [b, 1]
        let pos = rlhf_models::multimodal::shifted_positions(&plain, &deltas).unwrap();
        let h = m.hidden_states(&next, &mask, &pos, Some(&mut cache)).unwrap();
        next = m.logits_from_hidden(&h.select(1, 0)).unwrap().argmax(-1, false).unsqueeze(-1);
        out.push(next.shallow_clone());
    }
    Tensor::cat(&out, 1)
}

/// Largest logit difference over the real (unpadded) tokens.
fn logit_diff(ours: &Tensor, theirs: &Tensor, mask: &Tensor) -> f64 {
    let real = mask.to_kind(Kind::Bool).unsqueeze(-1);
    (ours - theirs).abs().masked_select(&real).max().double_value(&[])
}

fn tensor_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        Tensor::read_safetensors(dir.join("model.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    names.sort();
    names
}

#[test]
fn qwen2_5_vl_matches_transformers_with_images() {
    if python().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let r = make(dir.path());
    let imgs = images(dir.path());
    let grids: Vec<Vec<i64>> = Vec::try_from(&r["image_grid_thw"]).unwrap();
    assert_eq!(imgs.grids.iter().map(|g| g.to_vec()).collect::<Vec<_>>(), grids, "grids");
    let diff = (&imgs.pixel_values - &r["pixel_values"]).abs().max().double_value(&[]);
    assert_eq!(diff, 0.0, "processor patches differ from transformers'");
    let (ids, mask) = (&r["input_ids"], &r["attention_mask"]);
    for layout in ["model", "legacy"] {
        let src = dir.path().join(layout);
        let m = CausalLm::from_dir(&src, Device::Cpu, Kind::Float).unwrap();
        assert!(m.vision().is_some(), "{layout}: the tower is read");
        let logits = tch::no_grad(|| m.forward_with_images(ids, mask, &imgs)).unwrap();
        let diff = logit_diff(&logits, &r["logits"], mask);
        println!("{layout}: max |Δlogit| = {diff:.2e}");
        assert!(diff < TOL, "{layout}: logits differ by {diff}");
        let tokens = tch::no_grad(|| greedy(&m, ids, mask, &imgs, 8));
        assert_eq!(
            Vec::<Vec<i64>>::try_from(&tokens).unwrap(),
            Vec::<Vec<i64>>::try_from(&r["greedy"]).unwrap(),
            "{layout}: greedy tokens"
        );
        // Save → reload: the same names as loaded, the same logits bit for bit.
        let saved = dir.path().join(format!("{layout}-saved"));
        m.save(&saved).unwrap();
        assert_eq!(tensor_names(&saved), tensor_names(&src), "{layout}: saved tensor names");
        let again = CausalLm::from_dir(&saved, Device::Cpu, Kind::Float).unwrap();
        let logits2 = tch::no_grad(|| again.forward_with_images(ids, mask, &imgs)).unwrap();
        assert!(logits2.equal(&logits), "{layout}: the reloaded save computes other logits");
    }
}
