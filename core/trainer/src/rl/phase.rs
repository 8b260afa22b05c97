//! What a stage of the step costs: wall time (after the device has finished its queued work) and
//! the process's peak resident memory while it ran, reported as `time/<phase>` and
//! `mem/peak_rss_gb/<phase>`.
//!
//! The peak is the kernel's high-water mark of resident memory (`VmHWM` in `/proc/self/status`),
//! reset at the start of each phase by writing `5` to `/proc/self/clear_refs` (Linux ≥ 4.0), so it
//! is the most host memory the process held at any moment of that phase — weights, optimizer
//! state and the allocator's cached pages included, as `ru_maxrss` counts them for TRL. On other
//! systems, or where `/proc` cannot be written, there is no figure. GPU memory is not counted.

use std::time::Instant;

use tch::Device;

use crate::metrics::StepMetrics;

/// A phase being measured.
pub struct PhaseClock {
    start: Instant,
    device: Device,
}

/// Its cost once finished.
#[derive(Debug, Default, Clone, Copy)]
pub struct PhaseCost {
    pub secs: f64,
    /// Peak resident memory during the phase, in GB (10⁹ bytes).
    pub peak_rss_gb: Option<f64>,
}

impl PhaseClock {
    /// Starts the clock and resets the peak-memory mark.
    pub fn start(device: Device) -> Self {
        // Best effort: without the reset the figure is the peak since the last reset (or start).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        PhaseClock { start: Instant::now(), device }
    }

    /// Seconds since the start, once the device has finished the work queued so far: CUDA runs
    /// asynchronously, so without the sync a phase's kernels would be charged to whichever later
    /// phase first waits on them (a no-op on CPU), and the peak memory since the start.
    pub fn stop(&self) -> PhaseCost {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        PhaseCost { secs: self.start.elapsed().as_secs_f64(), peak_rss_gb: peak_rss_gb() }
    }
}

impl PhaseCost {
    /// `other` added to this cost: the times summed, the larger peak kept.
    pub fn add(&mut self, other: &PhaseCost) {
        self.secs += other.secs;
        self.peak_rss_gb = match (self.peak_rss_gb, other.peak_rss_gb) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }

    /// Sets `time/<name>` and, when known, `mem/peak_rss_gb/<name>`; keeps `mem/peak_rss_gb` the
    /// largest peak of the step so far.
    pub fn record(&self, name: &str, m: &mut StepMetrics) {
        m.set(&format!("time/{name}"), self.secs);
        if let Some(gb) = self.peak_rss_gb {
            m.set(&format!("mem/peak_rss_gb/{name}"), gb);
            let step_peak = m.get("mem/peak_rss_gb").map_or(gb, |p| p.max(gb));
            m.set("mem/peak_rss_gb", step_peak);
        }
    }
}

/// The process's peak resident memory (`VmHWM`) in GB, `None` where `/proc` does not say.
pub fn peak_rss_gb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024.0 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase that touches 256 MB shows a peak at least that much above the resident memory
    /// before it; the next phase, after the memory is freed, starts from a lower mark.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_phase_sees_the_memory_it_touched_and_the_next_starts_afresh() {
        let before = peak_rss_gb().expect("VmHWM on Linux");
        let clock = PhaseClock::start(Device::Cpu);
        let big = vec![1u8; 256 << 20];
        std::hint::black_box(&big);
        let cost = clock.stop();
        drop(big);
        let peak = cost.peak_rss_gb.unwrap();
        assert!(peak >= 0.25, "peak {peak} GB after touching 256 MB (before: {before} GB)");
        let next = PhaseClock::start(Device::Cpu).stop().peak_rss_gb.unwrap();
        assert!(next < peak - 0.2, "the mark was reset: {next} GB vs {peak} GB");
        let mut m = StepMetrics::default();
        cost.record("generate", &mut m);
        PhaseCost { secs: 1.0, peak_rss_gb: Some(0.1) }.record("train", &mut m);
        assert_eq!(m.get("mem/peak_rss_gb"), Some(peak));
        assert_eq!(m.get("time/train"), Some(1.0));
    }
}
