//! `rlhf bench --profile DIR`: one more run of a section under libtorch's profiler, its Chrome
//! trace written to `DIR/<section>.json`, and the kernels (CUDA) or operators (CPU) that took the
//! most time printed — where a step's time goes, without Python.

use std::path::Path;

use anyhow::Context;
use rlhf_aten::profile::{Profiled, Profiler};
use tch::Device;

/// Rows printed.
const TOP: usize = 12;

/// Runs `f` once under the profiler (CUDA kernels too on a CUDA `device`), writes
/// `dir/<section>.json` and prints the longest kernels or operators against `f`'s wall time.
pub(super) fn profile_once(
    dir: &Path,
    section: &str,
    device: Device,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--profile {}: cannot create the directory", dir.display()))?;
    let trace = dir.join(format!("{section}.json"));
    super::sync(device);
    let profiler = Profiler::start(device.is_cuda())?;
    let started = std::time::Instant::now();
    f()?;
    super::sync(device);
    let wall = started.elapsed().as_secs_f64();
    let rows = profiler.stop(Some(&trace))?;
    print!("{}", table(section, &rows, device.is_cuda(), wall, &trace));
    Ok(())
}

/// The printed table: on CUDA the kernels (their total is the GPU's busy time), on a CPU the
/// operators (inclusive of the operators they call), each against the run's wall time.
fn table(section: &str, rows: &[Profiled], cuda: bool, wall: f64, trace: &Path) -> String {
    let on_device: Vec<&Profiled> = rows.iter().filter(|r| (r.device == "cpu") != cuda).collect();
    let busy: f64 = on_device.iter().map(|r| r.total_s).sum();
    let mut out = if cuda {
        format!(
            "profile {section}: {:.1} ms wall, kernels busy {:.1} ms ({:.0} %); {}\n",
            wall * 1e3,
            busy * 1e3,
            100.0 * busy / wall.max(1e-12),
            trace.display()
        )
    } else {
        format!("profile {section}: {:.1} ms wall; operators, inclusive; {}\n", wall * 1e3, trace.display())
    };
    for r in on_device.iter().take(TOP) {
        let name: String = r.name.chars().take(100).collect();
        out += &format!(
            "  {:5.1} % {:9.3} ms {:6}× {name}\n",
            100.0 * r.total_s / wall.max(1e-12),
            r.total_s * 1e3,
            r.count
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(device: &str, name: &str, count: u64, total_s: f64) -> Profiled {
        Profiled { device: device.into(), name: name.into(), count, total_s }
    }

    #[test]
    fn the_table_shows_the_device_rows_against_the_wall_time() {
        let rows = [row("cuda", "gemm", 4, 0.006), row("cpu", "aten::mm", 4, 0.009), row("cuda", "softmax", 2, 0.002)];
        let t = table("train", &rows, true, 0.010, Path::new("p/train.json"));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "profile train: 10.0 ms wall, kernels busy 8.0 ms (80 %); p/train.json");
        assert_eq!(lines[1], "   60.0 %     6.000 ms      4× gemm");
        assert_eq!(lines.len(), 3, "{t}");
        let t = table("gen", &rows, false, 0.010, Path::new("g.json"));
        assert!(t.lines().nth(1).unwrap().ends_with("4× aten::mm"), "{t}");
    }
}
