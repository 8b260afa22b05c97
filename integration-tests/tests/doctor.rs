//! `rlhf doctor` on a CPU (CI has no GPU): every check runs, the reports list each with its
//! result and figures, and a broken fixture fails its own checks only, with a non-zero exit that
//! names them. On a GPU machine the same command checks the GPUs.

use std::process::Command;

use rlhf_integration_tests::{copy_dir, model_dir, rlhf_bin};
use serde_json::Value;

#[test]
fn every_check_runs_and_a_broken_fixture_fails_only_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = tmp.path().join("fixtures");
    for family in ["llama", "qwen2", "gpt2"] {
        copy_dir(&model_dir(family), &fixtures.join(family));
    }
    // Qwen2's weights cut in half: its checks must fail, the others must not notice.
    let weights = fixtures.join("qwen2/model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let out = tmp.path().join("report");
    let o = Command::new(rlhf_bin())
        .args(["doctor", "--device", "cpu", "--no-trl", "--fixtures"])
        .arg(&fixtures)
        .arg("--out")
        .arg(&out)
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    let last = stderr.lines().last().unwrap_or("");
    assert!(
        last.starts_with(
            "error: 2 of 16 checks failed: check-device qwen2 f32 (cpu), check-device qwen2 bf16 (cpu); see"
        ),
        "{last}"
    );

    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert!(report["machine"]["gpus"].as_array().unwrap().is_empty(), "{}", report["machine"]);
    assert!(report["machine"]["torch"].as_str().is_some_and(|v| v.starts_with("2.11.0")), "{}", report["machine"]);
    assert_eq!(
        (report["passed"].as_u64(), report["failed"].as_u64(), report["skipped"].as_u64()),
        (Some(14), Some(2), Some(1))
    );
    let checks = report["checks"].as_array().unwrap();
    let by_name = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name}"));
    let mut names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    names.sort();
    let mut want = vec!["grpo f32", "grpo bf16", "zero3", "sft-rm", "peak", "step", "nccl 2 ranks"];
    for family in ["llama", "qwen2", "gpt2", "qwen3", "qwen3-moe"] {
        for dtype in ["f32", "bf16"] {
            want.push(Box::leak(format!("check-device {family} {dtype}").into_boxed_str()));
        }
    }
    want.sort();
    assert_eq!(names, want);
    for c in checks {
        let name = c["name"].as_str().unwrap();
        let status = c["status"].as_str().unwrap();
        match name {
            "check-device qwen2 f32" | "check-device qwen2 bf16" => {
                assert_eq!(status, "fail", "{c}");
                assert!(c["summary"].as_str().unwrap().contains("model.safetensors"), "{c}");
            }
            "nccl 2 ranks" => assert_eq!((status, c["summary"].as_str()), ("skip", Some("needs 2 GPUs")), "{c}"),
            _ => {
                assert_eq!(status, "pass", "{c}");
                assert!(!c["figures"].as_object().unwrap().is_empty(), "{c}");
                assert!(out.join(c["log"].as_str().unwrap()).is_file(), "{c}");
            }
        }
    }
    // The CPU computes the same in f32 as the CPU: exactly.
    assert_eq!(by_name("check-device llama f32")["figures"]["relative"].as_f64(), Some(0.0));
    assert!(by_name("grpo f32")["figures"]["gain"].as_f64().unwrap() >= 0.25);
    let sft_rm = &by_name("sft-rm")["figures"];
    assert!(sft_rm["sft_ppl_after"].as_f64() < sft_rm["sft_ppl_before"].as_f64(), "{sft_rm}");
    let step = &by_name("step")["figures"];
    assert_eq!(step["params"].as_i64(), Some(3_870_464), "{step}");
    assert!(step["step_s"].as_f64().unwrap() > 0.0 && step["train_mfu"].as_f64().unwrap() > 0.0, "{step}");
    assert!(by_name("peak")["figures"]["gemm_tflops"].as_f64().unwrap() > 0.0);

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("**No GPU found**"), "{md}");
    assert!(md.contains("**14 passed, 2 failed, 1 skipped**"), "{md}");
    assert!(md.contains("| check-device qwen2 f32 | cpu | **FAIL** |"), "{md}");
    assert!(md.contains("| grpo f32 | cpu | pass |"), "{md}");
    // The work files are gone; the logs stay.
    assert!(!out.join("work").exists());
    assert!(out.join("logs").read_dir().unwrap().count() >= 16);
}

#[test]
fn bad_arguments_are_one_line_errors_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    for (args, want) in [
        (vec!["--device", "cuda:7"], "--device cuda:7: no GPU found"),
        (vec!["--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
    ] {
        let o = Command::new(rlhf_bin())
            .arg("doctor")
            .args(&args)
            .arg("--out")
            .arg(&out)
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        let last = err.lines().last().unwrap_or("");
        assert!(last.starts_with("error: ") && last.contains(want), "{last}");
        assert!(!out.exists(), "nothing is created for bad arguments");
    }
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let o = Command::new(rlhf_bin()).args(["doctor", "--out"]).arg(&file).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("exists and is not a directory"), "{err}");
}
