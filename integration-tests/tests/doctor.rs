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
            "error: 2 of 18 checks failed: check-device qwen2 f32 (cpu), check-device qwen2 bf16 (cpu); see"
        ),
        "{last}"
    );

    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert!(report["machine"]["gpus"].as_array().unwrap().is_empty(), "{}", report["machine"]);
    assert!(report["machine"]["torch"].as_str().is_some_and(|v| v.starts_with("2.11.0")), "{}", report["machine"]);
    assert_eq!(
        (report["passed"].as_u64(), report["failed"].as_u64(), report["skipped"].as_u64()),
        (Some(16), Some(2), Some(1))
    );
    let checks = report["checks"].as_array().unwrap();
    let by_name = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no check {name}"));
    let mut names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    names.sort();
    let mut want = vec!["grpo f32", "grpo bf16", "zero3", "sft-rm", "peak", "step", "nccl 2 ranks"];
    for family in ["llama", "qwen2", "gpt2", "qwen3", "qwen3-moe", "qwen3.5"] {
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
    assert!(md.contains("**16 passed, 2 failed, 1 skipped**"), "{md}");
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

/// Waits up to `secs` for `child`; a doctor still running then is killed and the test fails.
fn finished_within(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if t0.elapsed() > std::time::Duration::from_secs(secs) {
            let _ = child.kill();
            panic!("rlhf doctor still running after {secs} s: it hangs");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn doctor(out: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(rlhf_bin());
    c.args(["doctor", "--device", "cpu", "--fixtures"])
        .arg(model_dir("llama").parent().unwrap())
        .arg("--out")
        .arg(out)
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", "");
    c
}

/// `--out` is never a directory the doctor did not write: one holding other files is refused and
/// left as it was; the doctor's own directory is reused (only its logs and work files replaced,
/// a file beside them kept); an `--only` that names no check is refused before anything exists.
#[test]
fn the_doctor_deletes_only_what_it_wrote() {
    let tmp = tempfile::tempdir().unwrap();
    let mine = tmp.path().join("mine");
    for (f, text) in [("logs/precious.txt", "a"), ("work/data.bin", "b"), ("notes.txt", "c")] {
        std::fs::create_dir_all(mine.join(f).parent().unwrap()).unwrap();
        std::fs::write(mine.join(f), text).unwrap();
    }
    let o = doctor(&mine, &["--quick", "--only", "check-device llama f32"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.lines().last().unwrap().contains("holds files an earlier `rlhf doctor` did not write"), "{err}");
    for (f, text) in [("logs/precious.txt", "a"), ("work/data.bin", "b"), ("notes.txt", "c")] {
        assert_eq!(std::fs::read_to_string(mine.join(f)).unwrap(), text, "{f}");
    }

    let out = tmp.path().join("report");
    for _ in 0..2 {
        let o = doctor(&out, &["--quick", "--only", "check-device llama f32"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::write(out.join("mine.txt"), "kept").unwrap();
    }
    assert_eq!(std::fs::read_to_string(out.join("mine.txt")).unwrap(), "kept");
    assert!(out.join("report.json").is_file() && out.join("logs/check-device-llama-f32-cpu.log").is_file());

    let none = tmp.path().join("none");
    let o = doctor(&none, &["--only", "grpo f64"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.lines().last().unwrap().contains("--only `grpo f64`: no check's name starts with it"), "{err}");
    assert!(!none.exists());
}

/// A `--python` that never answers is given up at the probe's deadline (the report says so and
/// the checks run); SIGTERM to the doctor ends the check it runs (no `rlhf train` left behind)
/// and the doctor, with 128 + 15.
#[test]
fn a_hanging_probe_and_a_signal_end_what_the_doctor_started() {
    let tmp = tempfile::tempdir().unwrap();
    let python = tmp.path().join("python3");
    std::fs::write(&python, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = tmp.path().join("probe");
    let mut child = doctor(&out, &["--only", "check-device llama f32", "--python"])
        .arg(&python)
        .env("RLHF_PROBE_TIMEOUT", "2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(finished_within(&mut child, 180).success());
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("did not answer within 2 s (RLHF_PROBE_TIMEOUT)"), "{md}");

    let out = tmp.path().join("signal");
    let mut child = doctor(&out, &["--no-trl", "--only", "grpo f32"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let doctor_pid = child.id();
    let t0 = std::time::Instant::now();
    let check = loop {
        if let Some(pid) = children(doctor_pid).first() {
            break *pid;
        }
        assert!(t0.elapsed().as_secs() < 120, "the doctor started no check");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // Once the check logs, it runs (its own handlers are installed).
    let log = out.join("logs/grpo-f32-cpu.log");
    while std::fs::metadata(&log).map_or(0, |m| m.len()) == 0 {
        assert!(t0.elapsed().as_secs() < 120, "the check never logged");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Command::new("kill").args(["-TERM", &doctor_pid.to_string()]).status().unwrap();
    let status = finished_within(&mut child, 120);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(err.lines().last().unwrap_or("").starts_with("stopped by SIGTERM during check grpo f32 (cpu)"), "{err}");
    assert!(!std::path::Path::new(&format!("/proc/{check}")).exists(), "the check (pid {check}) was left behind");
}

/// Pids of the live children of `pid` (from `/proc/*/stat`).
fn children(pid: u32) -> Vec<u32> {
    let parent = pid.to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { return false };
            let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
            fields.first().is_some_and(|s| *s != "Z") && fields.get(1) == Some(&parent.as_str())
        })
        .collect()
}
