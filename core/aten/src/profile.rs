//! libtorch's Kineto profiler (`torch.profiler.profile` without Python): a [`Profiler`] records
//! the CPU operators of the process and, on CUDA, the kernels the GPU ran, then writes a Chrome
//! trace (open it in Perfetto or `chrome://tracing`) and returns the time spent per operator and
//! per kernel, so a benchmark can print where a step's time goes.

use std::ffi::{c_char, CString};
use std::path::Path;

use crate::{one_line, take_string, AtenError, Result};

extern "C" {
    fn rlhf_aten_free_string(s: *mut c_char);
    fn rlhf_aten_profile_start(cuda: i32, err: *mut *mut c_char) -> i32;
    fn rlhf_aten_profile_stop(path: *const c_char, table: *mut *mut c_char, err: *mut *mut c_char) -> i32;
}

/// The events of one name on one device.
#[derive(Debug, Clone, PartialEq)]
pub struct Profiled {
    /// `cpu` for operators (and other host events), `cuda` for kernels and copies.
    pub device: String,
    /// Operator (`aten::mm`) or kernel name.
    pub name: String,
    /// How many events.
    pub count: u64,
    /// Their total time in seconds (an operator's includes the operators it called).
    pub total_s: f64,
}

/// A running profiler; [`Profiler::stop`] ends it (dropping it stops it too, discarding the
/// events). One at a time per process.
pub struct Profiler {
    running: bool,
}

impl Profiler {
    /// Starts recording this process's CPU operators and, with `cuda`, the CUDA kernels.
    pub fn start(cuda: bool) -> Result<Self> {
        let mut err = std::ptr::null_mut();
        // SAFETY: plain C call; `err` is written on failure only.
        if unsafe { rlhf_aten_profile_start(i32::from(cuda), &mut err) } != 0 {
            // SAFETY: written by the callee.
            return Err(AtenError::Torch(one_line(&unsafe { take_string(err, rlhf_aten_free_string) })));
        }
        Ok(Profiler { running: true })
    }

    /// Stops recording; writes the Chrome trace to `trace` when given; returns the events
    /// aggregated by device and name, the longest total first.
    pub fn stop(mut self, trace: Option<&Path>) -> Result<Vec<Profiled>> {
        self.running = false;
        stop(trace)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if self.running {
            let _ = stop(None);
        }
    }
}

fn stop(trace: Option<&Path>) -> Result<Vec<Profiled>> {
    let path = match trace {
        Some(p) => Some(
            CString::new(p.to_string_lossy().as_bytes())
                .map_err(|_| AtenError::Input(format!("{}: a path with a NUL byte", p.display())))?,
        ),
        None => None,
    };
    let (mut table, mut err) = (std::ptr::null_mut(), std::ptr::null_mut());
    let path_ptr = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
    // SAFETY: `path_ptr` is null or a NUL-terminated string alive for the call; `table` and `err`
    // receive malloc'd strings.
    let rc = unsafe { rlhf_aten_profile_stop(path_ptr, &mut table, &mut err) };
    // SAFETY: written by the callee (or still null).
    let (table, err) = unsafe { (take_string(table, rlhf_aten_free_string), take_string(err, rlhf_aten_free_string)) };
    if rc != 0 {
        return Err(AtenError::Torch(one_line(&err)));
    }
    let mut rows: Vec<Profiled> = table
        .lines()
        .filter_map(|line| {
            let mut f = line.splitn(4, '\t');
            let (device, count, ns, name) = (f.next()?, f.next()?, f.next()?, f.next()?);
            Some(Profiled {
                device: device.to_string(),
                name: name.to_string(),
                count: count.parse().ok()?,
                total_s: ns.parse::<u64>().ok()? as f64 * 1e-9,
            })
        })
        .collect();
    rows.sort_by(|a, b| b.total_s.total_cmp(&a.total_s));
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn records_the_operators_and_writes_a_trace() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("trace.json");
        let a = Tensor::ones([64, 64], (Kind::Float, Device::Cpu));
        let p = Profiler::start(false).unwrap();
        for _ in 0..3 {
            let _ = a.matmul(&a).relu();
        }
        let rows = p.stop(Some(&trace)).unwrap();
        let relu = rows.iter().find(|r| r.name == "aten::relu").expect("aten::relu recorded");
        assert_eq!((relu.device.as_str(), relu.count), ("cpu", 3));
        assert!(relu.total_s > 0.0);
        assert!(rows.windows(2).all(|w| w[0].total_s >= w[1].total_s));
        let text = std::fs::read_to_string(&trace).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).expect("the trace is JSON");
        assert!(json["traceEvents"].as_array().is_some_and(|e| e.iter().any(|e| e["name"] == "aten::relu")));
        // Nothing is recorded once stopped; a second profiler starts afresh.
        let again = Profiler::start(false).unwrap();
        let _ = a.relu();
        let rows = again.stop(None).unwrap();
        assert_eq!(rows.iter().find(|r| r.name == "aten::relu").map(|r| r.count), Some(1));
    }
}
