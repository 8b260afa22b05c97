//! The Qwen-VL image processor against transformers' (`Qwen2VLImageProcessorPil`, Pillow's
//! resampling) on images made at test time (`fixtures/make_images.py`): several sizes and aspect
//! ratios, transparency, palette and grey images, PNG, WebP, JPEG with and without an EXIF
//! rotation; Qwen2.5-VL's settings and Qwen3-VL's (patches of 16, mean and deviation 0.5, a
//! smaller pixel budget). The grids must be equal; the pixel values equal for lossless files
//! (decoding, Pillow's fixed-point bicubic and the f32 normalisation reproduce transformers'
//! bit for bit) and within a measured tolerance for JPEG, whose decoders (libjpeg-turbo in
//! Pillow, `jpeg-decoder` here) round the inverse DCT differently: at most 3 levels of 255 apart
//! on these photos' decoded pixels (mean 0.11), which bicubic resampling's negative lobes can
//! raise to about 4.

use std::collections::HashMap;
use std::process::Command;

use rlhf_integration_tests::{fixtures, python};
use rlhf_vision::{load_path, QwenVlProcessor};
use serde_json::json;
use tch::Tensor;

/// JPEG: 5 levels of 255 are `5/255/std` ≤ 0.075 after normalisation (CLIP's smallest std);
/// measured up to 0.057.
const JPEG_TOL: f64 = 0.075;

#[test]
fn patches_match_transformers_processor() {
    let Some(python) = python() else { return };
    let configs = [
        json!({}),
        json!({"patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
               "size": {"shortest_edge": 4096, "longest_edge": 200704}}),
    ];
    for config in configs {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(&python)
            .arg(fixtures().join("make_images.py"))
            .args(["--out", dir.path().to_str().unwrap(), "--config", &config.to_string()])
            .output()
            .expect("spawn python");
        assert!(out.status.success(), "make_images.py failed: {}", String::from_utf8_lossy(&out.stderr));
        let names: Vec<String> =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("images.json")).unwrap()).unwrap();
        let want: HashMap<String, Tensor> =
            Tensor::read_safetensors(dir.path().join("patches.safetensors")).unwrap().into_iter().collect();
        let processor = QwenVlProcessor::from_value(&dir.path().join("config.json"), &config).unwrap();
        for (i, name) in names.iter().enumerate() {
            let image = load_path(&dir.path().join(name)).unwrap();
            let ours = processor.preprocess(&image, name).unwrap();
            let grid: Vec<i64> = Vec::try_from(&want[&format!("grid.{i}")]).unwrap();
            assert_eq!(ours.grid.map(|g| g as i64).to_vec(), grid, "{name}: grid");
            let theirs = &want[&format!("pixel_values.{i}")];
            assert_eq!(theirs.size(), [ours.len() as i64, ours.dim as i64], "{name}: shape");
            let ours = Tensor::from_slice(&ours.values).view([ours.len() as i64, ours.dim as i64]);
            let diff = (&ours - theirs).abs().max().double_value(&[]);
            println!("{config}: {name} grid {grid:?} max |Δpixel| = {diff:.2e}");
            let tol = if name.ends_with(".jpg") { JPEG_TOL } else { 0.0 };
            assert!(diff <= tol, "{name}: pixel values differ by {diff} (tolerance {tol})");
        }
    }
}

#[test]
fn bad_images_are_one_line_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.png");
    let e = load_path(&missing).unwrap_err().to_string();
    assert!(e.starts_with(&missing.display().to_string()), "{e}");
    let corrupt = dir.path().join("corrupt.png");
    std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let e = load_path(&corrupt).unwrap_err().to_string();
    assert!(e.contains("corrupt.png: not a decodable image"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // A 1 × 300 strip: its aspect ratio is refused as transformers refuses it.
    let strip = rlhf_vision::RgbImage::new(300, 1, vec![0; 900]).unwrap();
    let e = QwenVlProcessor::default().preprocess(&strip, "strip.png").unwrap_err().to_string();
    assert!(e.contains("strip.png: absolute aspect ratio must be smaller than 200"), "{e}");
    let e = QwenVlProcessor::from_value(&dir.path().join("preprocessor_config.json"), &json!({"merge_size": 0}));
    assert!(e.unwrap_err().to_string().contains("preprocessor_config.json: merge_size: expected a positive"));
}
