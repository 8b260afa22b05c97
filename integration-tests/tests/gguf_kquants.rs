//! The K-quants (`Q4_K`, `Q5_K`, `Q6_K`), `Q5_0`, `Q5_1` and `MXFP4` dequantised as the `gguf` Python package (llama.cpp's
//! reference) does, bit for bit, on random blocks it made.

use rlhf_gguf::{dequantize, GgmlType};
use rlhf_integration_tests::{fixtures, python};

#[test]
fn k_quants_dequantise_as_the_gguf_package() {
    let Some(python) = python() else { return };
    let out = std::process::Command::new(&python).arg(fixtures().join("gguf_kquants.py")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for t in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::MXFP4] {
        let case = &reference[t.name()];
        let hex = case["data"].as_str().unwrap();
        let data: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let ours = dequantize(t, &data, want.len()).unwrap();
        let differ = ours.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        println!("{t}: {} values, {differ} differ", want.len());
        assert_eq!(differ, 0, "{t}: first {:?} vs {:?}", &ours[..4], &want[..4]);
    }
}
