//! What the machine is, as this process sees it: the libtorch it loaded and its version, CUDA and
//! the GPUs it sees (or why none), the NCCL library, the CPU, and a Python with TRL.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// One visible GPU.
#[derive(Debug, Clone, Serialize)]
pub struct Gpu {
    pub device: String,
    pub name: String,
}

/// The machine's software and devices.
#[derive(Debug, Clone, Serialize)]
pub struct Facts {
    pub rlhf: String,
    /// The version libtorch's own files give (`torch/version.py` or `build-version`).
    pub torch: Option<String>,
    /// The directory libtorch was loaded from.
    pub libtorch: Option<String>,
    /// CUDA runtime and cuDNN versions libtorch was built with (when CUDA loaded).
    pub cuda: Option<String>,
    pub cudnn: Option<String>,
    pub gpus: Vec<Gpu>,
    /// Why no GPU is usable, when none is.
    pub no_gpu: Option<String>,
    /// The NCCL library for multi-GPU runs: its path, or why it cannot be used.
    pub nccl: String,
    pub cpu: String,
    pub threads: i32,
    /// TRL, transformers and torch of the Python that would run TRL's step; or why not.
    pub trl: Result<String, String>,
}

/// The libtorch directory this process mapped `libtorch_cpu.so` from (`.../lib/..`), read from
/// `/proc/self/maps`.
pub fn libtorch_dir_from_maps(maps: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent()?.parent().map(Path::to_path_buf))
}

/// The version a torch package (`version.py`: `__version__ = '2.11.0+cu130'`) or a libtorch
/// archive (`build-version`) declares.
pub fn torch_version(dir: &Path) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(dir.join("version.py")) {
        let line = text.lines().find(|l| l.trim_start().starts_with("__version__"))?;
        let value = line.split_once('=')?.1.trim().trim_matches(|c| c == '\'' || c == '"');
        return Some(value.to_string());
    }
    std::fs::read_to_string(dir.join("build-version")).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// `13000` → `13.0`; cuDNN's `91300` → `9.13.0`.
fn cuda_version(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}
fn cudnn_version(v: i64) -> String {
    format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
}

/// Whether `python` can run TRL's step (`None`: not looked for); `work` takes the driver script.
pub fn trl(python: Option<&Path>, work: &Path) -> Result<String, String> {
    match python {
        Some(py) => crate::bench::trl::check(py, None, work).map_err(|e| format!("{e:#}")),
        None => Err("not looked for (--quick or --no-trl)".to_string()),
    }
}

/// Probes the machine, writing nothing; `trl` is left for [`trl`] to fill in.
pub fn probe() -> Facts {
    let libtorch = std::fs::read_to_string("/proc/self/maps").ok().and_then(|m| libtorch_dir_from_maps(&m));
    let torch = libtorch.as_deref().and_then(torch_version);
    let (mut gpus, mut no_gpu, mut cuda, mut cudnn) = (Vec::new(), None, None, None);
    match rlhf_models::parse_device("cuda") {
        Ok(_) => {
            let n = tch::Cuda::device_count().max(0) as usize;
            for i in 0..n {
                let name = crate::bench::machine::cuda_name(i).unwrap_or_else(|| format!("CUDA device {i}"));
                gpus.push(Gpu { device: format!("cuda:{i}"), name });
            }
            // Versions through libtorch's CUDA hooks, which exist once libtorch_cuda is loaded.
            let versions = std::panic::catch_unwind(|| (tch::utils::version_cudart(), tch::utils::version_cudnn()));
            if let Ok((rt, dnn)) = versions {
                cuda = (rt > 0).then(|| cuda_version(rt));
                cudnn = (dnn > 0).then(|| cudnn_version(dnn));
            }
        }
        Err(e) => no_gpu = Some(e.to_string()),
    }
    let nccl = match rlhf_collective::nccl::check_library() {
        Ok(path) => format!("loads ({})", path.display()),
        Err(e) => e.to_string(),
    };
    Facts {
        rlhf: env!("CARGO_PKG_VERSION").to_string(),
        torch,
        libtorch: libtorch.map(|d| d.display().to_string()),
        cuda,
        cudnn,
        gpus,
        no_gpu,
        nccl,
        cpu: crate::machine::describe_cpu(),
        threads: tch::get_num_threads(),
        trl: Err("not looked for".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_and_its_version_are_found() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n\
                    7f02-7f03 r-xp 00000000 08:01 456 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so\n";
        assert_eq!(libtorch_dir_from_maps(maps), Some(PathBuf::from("/venv/lib/python3.11/site-packages/torch")));
        assert_eq!(libtorch_dir_from_maps("7f00-7f01 r-xp 0 0 1 /usr/lib/libc.so.6\n"), None);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("version.py"), "# generated\n__version__ = '2.11.0+cu130'\ngit = 'x'\n")
            .unwrap();
        assert_eq!(torch_version(dir.path()).as_deref(), Some("2.11.0+cu130"));
        let lib = tempfile::tempdir().unwrap();
        std::fs::write(lib.path().join("build-version"), "2.11.0+cpu\n").unwrap();
        assert_eq!(torch_version(lib.path()).as_deref(), Some("2.11.0+cpu"));
        assert_eq!((cuda_version(13000), cudnn_version(91300)), ("13.0".to_string(), "9.13.0".to_string()));
    }

    /// This test process loaded libtorch from a torch package or a libtorch directory that says
    /// its version.
    #[test]
    fn this_process_knows_its_libtorch() {
        let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let dir = libtorch_dir_from_maps(&maps).expect("libtorch_cpu.so mapped");
        assert!(torch_version(&dir).is_some_and(|v| v.starts_with("2.")), "{}", dir.display());
    }
}
