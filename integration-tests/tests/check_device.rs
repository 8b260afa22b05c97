//! `rlhf check-device`: a model's logits and greedy tokens on a device/dtype against the CPU in
//! f32. Here (CI has no GPU) the target is the CPU itself: f32 must agree exactly, bf16 within its
//! stated tolerance, a tolerance tighter than bf16's rounding must fail with one line, and CUDA
//! where there is none is a clear error. On a GPU machine the same command is the CUDA check.

use rlhf_integration_tests::{model_dir, rlhf};

fn json_line(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("--json prints a JSON last line")
}

#[test]
fn cpu_f32_agrees_exactly_and_bf16_within_its_tolerance() {
    let model = model_dir("llama");
    let m = model.to_str().unwrap();
    let o = rlhf(&["check-device", "--model", m, "--dtype", "f32", "--json"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let j = json_line(&out);
    assert_eq!(j["max_abs_diff"].as_f64(), Some(0.0), "{j}");
    assert_eq!(j["same_top"], j["positions"], "{j}");
    assert_eq!(j["greedy_equal"], j["greedy_total"], "{j}");
    // 4 rows of 48, 43, 38, 33 tokens.
    assert_eq!(j["positions"].as_i64(), Some(48 + 43 + 38 + 33), "{j}");

    let o = rlhf(&["check-device", "--model", m, "--dtype", "bf16", "--json"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let j = json_line(&out);
    let rel = j["relative"].as_f64().unwrap();
    println!("bf16 vs f32 on the CPU: relative {rel:.3e}, top token {}/{}", j["same_top"], j["positions"]);
    assert!(rel > 0.0 && rel <= 0.15, "{j}");
    assert!(j["same_top"].as_i64().unwrap() * 10 >= j["positions"].as_i64().unwrap() * 9, "{j}");

    let o = rlhf(&["check-device", "--model", m, "--dtype", "bf16", "--tolerance", "1e-6"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.contains("over the tolerance 1.0e-6") && last.contains("cpu bf16 vs cpu f32"), "{last}");
}

/// The first line names the CPU and the capability libtorch's kernels dispatch to, and that
/// capability follows `ATEN_CPU_CAPABILITY` (libtorch's own answer, not ours).
#[test]
fn names_the_cpu_and_the_kernels_libtorch_dispatches_to() {
    let model = model_dir("llama");
    let m = model.to_str().unwrap();
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mut settings = vec![("default", "DEFAULT")];
    if info.contains(" avx2") {
        settings.push(("avx2", "AVX2"));
    }
    for (env, name) in settings {
        let o = std::process::Command::new(rlhf_integration_tests::rlhf_bin())
            .args(["check-device", "--model", m, "--dtype", "f32", "--json", "--batch", "1"])
            .env("ATEN_CPU_CAPABILITY", env)
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        let first = out.lines().next().unwrap_or("");
        assert!(first.starts_with("cpu: ") && first.ends_with(&format!("; ATen {name}")), "{first}");
        assert_eq!(json_line(&out)["cpu"].as_str(), first.strip_prefix("cpu: "), "{out}");
    }
}

#[test]
fn bad_input_is_one_clear_line() {
    let model = model_dir("llama");
    let m = model.to_str().unwrap();
    if !tch::Cuda::is_available() {
        let o = rlhf(&["check-device", "--model", m, "--device", "cuda"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.lines().last().unwrap_or("").contains("cuda"), "{err}");
    }
    let o = rlhf(&["check-device", "--model", "/nonexistent/model"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("/nonexistent/model: model directory not found"), "{err}");
    let o = rlhf(&["check-device", "--model", m, "--dtype", "f8"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("f8"));
}
