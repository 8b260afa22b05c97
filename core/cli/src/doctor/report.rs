//! `report.md` and `report.json`: the machine, then every check with its result, time and figures.

use std::path::Path;

use serde_json::json;

use super::checks::{Outcome, Status};
use super::probe::Facts;

/// Counts of passed, failed and skipped checks.
pub fn counts(outcomes: &[Outcome]) -> (usize, usize, usize) {
    let n = |s: Status| outcomes.iter().filter(|o| o.status == s).count();
    (n(Status::Pass), n(Status::Fail), n(Status::Skip))
}

/// `HH:MM:SS` of a UTC time of day, from seconds since the epoch.
fn utc_time(unix_secs: u64) -> String {
    let s = unix_secs % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, (s % 3600) / 60, s % 60)
}

/// The Markdown report.
pub fn markdown(facts: &Facts, outcomes: &[Outcome], started_unix: u64, seconds: f64, quick: bool) -> String {
    let date = crate::bench::report::utc_date(started_unix);
    let mut s = format!("# rlhf doctor, {date} {} UTC\n\n", utc_time(started_unix));
    let or_unknown = |x: &Option<String>| x.clone().unwrap_or_else(|| "unknown".into());
    s.push_str(&format!(
        "- rlhf {}; torch {} from {}\n",
        facts.rlhf,
        or_unknown(&facts.torch),
        or_unknown(&facts.libtorch)
    ));
    if facts.gpus.is_empty() {
        s.push_str(&format!(
            "- **No GPU found** ({}): the CPU checks ran\n",
            facts.no_gpu.as_deref().unwrap_or("no CUDA device")
        ));
    } else {
        let gpus: Vec<String> = facts.gpus.iter().map(|g| format!("{} {}", g.device, g.name)).collect();
        s.push_str(&format!(
            "- GPUs: {}; CUDA {}, cuDNN {}\n",
            gpus.join(", "),
            or_unknown(&facts.cuda),
            or_unknown(&facts.cudnn)
        ));
    }
    s.push_str(&format!("- NCCL library: {}\n", facts.nccl));
    s.push_str(&format!("- CPU: {} ({} threads)\n", facts.cpu, facts.threads));
    match &facts.trl {
        Ok(v) => s.push_str(&format!("- TRL for the side-by-side step: {v}\n")),
        Err(why) => s.push_str(&format!("- TRL: not run: {why}\n")),
    }
    let (pass, fail, skip) = counts(outcomes);
    s.push_str(&format!(
        "\n**{pass} passed, {fail} failed, {skip} skipped** in {:.0} s{}\n\n",
        seconds,
        if quick { " (`--quick`)" } else { "" }
    ));
    s.push_str("| check | device | result | time | figures |\n| --- | --- | --- | --- | --- |\n");
    for o in outcomes {
        let result = match o.status {
            Status::Pass => "pass",
            Status::Fail => "**FAIL**",
            Status::Skip => "skipped",
        };
        let log = o.log.as_ref().map(|l| format!(" ([log]({l}))")).unwrap_or_default();
        s.push_str(&format!(
            "| {} | {} | {result} | {:.1} s | {}{log} |\n",
            o.name,
            o.device,
            o.seconds,
            o.summary.replace('|', "\\|").replace('\n', " ")
        ));
    }
    s
}

/// The JSON report.
pub fn json(facts: &Facts, outcomes: &[Outcome], started_unix: u64, seconds: f64, quick: bool) -> serde_json::Value {
    let (pass, fail, skip) = counts(outcomes);
    let trl = match &facts.trl {
        Ok(v) => json!({"available": true, "versions": v}),
        Err(why) => json!({"available": false, "why": why}),
    };
    json!({
        "date": format!("{}T{}Z", crate::bench::report::utc_date(started_unix), utc_time(started_unix)),
        "quick": quick, "seconds": seconds, "passed": pass, "failed": fail, "skipped": skip,
        "machine": {"rlhf": facts.rlhf, "torch": facts.torch, "libtorch": facts.libtorch, "cuda": facts.cuda,
                    "cudnn": facts.cudnn, "gpus": facts.gpus, "no_gpu": facts.no_gpu, "nccl": facts.nccl,
                    "cpu": facts.cpu, "threads": facts.threads, "trl": trl},
        "checks": outcomes,
    })
}

/// Writes both reports into `out` (each replaced whole, so a reader never sees half a file).
pub fn write(
    out: &Path,
    facts: &Facts,
    outcomes: &[Outcome],
    started_unix: u64,
    seconds: f64,
    quick: bool,
) -> std::io::Result<()> {
    let md = markdown(facts, outcomes, started_unix, seconds, quick);
    let js = serde_json::to_string_pretty(&json(facts, outcomes, started_unix, seconds, quick)).unwrap_or_default();
    for (name, text) in [("report.md", md), ("report.json", js + "\n")] {
        let tmp = out.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, out.join(name))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::probe::Gpu;

    fn facts(gpus: Vec<Gpu>) -> Facts {
        Facts {
            rlhf: "0.1.0".into(),
            torch: Some("2.11.0+cu130".into()),
            libtorch: Some("/t".into()),
            cuda: None,
            cudnn: None,
            no_gpu: gpus.is_empty().then(|| "no CUDA device is available".into()),
            gpus,
            nccl: "loads (/x/librlhf_nccl.so)".into(),
            cpu: "AMD EPYC; AVX2; ATen AVX2".into(),
            threads: 2,
            trl: Err("not looked for (--quick or --no-trl)".into()),
        }
    }

    #[test]
    fn reports_list_every_check_and_say_when_no_gpu_was_found() {
        let o = |name: &str, status, summary: &str| Outcome {
            name: name.into(),
            device: "cpu".into(),
            status,
            seconds: 1.25,
            summary: summary.into(),
            figures: Default::default(),
            log: Some(format!("logs/{name}.log")),
        };
        let outcomes = vec![
            o("check-device llama f32", Status::Pass, "max |Δlogit| 1e-6"),
            o("grpo bf16", Status::Fail, "did not learn"),
            o("step", Status::Skip, "--quick"),
        ];
        let md = markdown(&facts(vec![]), &outcomes, 1_795_766_400, 12.0, true);
        assert!(md.contains("**No GPU found** (no CUDA device is available): the CPU checks ran"), "{md}");
        assert!(md.contains("**1 passed, 1 failed, 1 skipped** in 12 s (`--quick`)"), "{md}");
        assert!(md.contains("| check-device llama f32 | cpu | pass | 1.2 s | max \\|Δlogit\\| 1e-6 ([log](logs/check-device llama f32.log)) |"), "{md}");
        assert!(md.contains("| grpo bf16 | cpu | **FAIL** |"), "{md}");
        let js =
            json(&facts(vec![Gpu { device: "cuda:0".into(), name: "NVIDIA H200".into() }]), &outcomes, 0, 1.0, false);
        assert_eq!((js["passed"].as_u64(), js["failed"].as_u64(), js["skipped"].as_u64()), (Some(1), Some(1), Some(1)));
        assert_eq!(js["checks"][1]["status"], "fail");
        assert_eq!(js["machine"]["gpus"][0]["name"], "NVIDIA H200");
        assert_eq!(js["date"], "1970-01-01T00:00:00Z");
    }
}
