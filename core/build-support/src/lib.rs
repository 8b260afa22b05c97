//! Helpers for the build scripts that compile C++ against libtorch (`core/collective`,
//! `core/aten`): the libtorch directory and C++ ABI, the CUDA headers of the torch wheel, and a
//! shared library compiled against `libtorch_cuda` that a crate loads at run time, so that a
//! CPU-only run never needs `libtorch_cuda.so`.

use std::env;
use std::path::{Path, PathBuf};

/// The libtorch directory (`LIBTORCH`, set by `cargo xtask`), with a hint when it is unset.
pub fn libtorch() -> PathBuf {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    match env::var_os("LIBTORCH") {
        Some(dir) => PathBuf::from(dir),
        None => panic!(
            "LIBTORCH is not set: run through `cargo xtask` (which installs libtorch and sets it), or export LIBTORCH=<site-packages>/torch"
        ),
    }
}

/// The C++ ABI libtorch was built with (torch-sys's default).
pub fn cxx11_abi() -> String {
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into())
}

/// The library directory the binary links libtorch from.
pub fn lib_dir(libtorch: &Path) -> PathBuf {
    env::var("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from).unwrap_or_else(|_| libtorch.join("lib"))
}

/// A C++17 build against libtorch's headers with its ABI, no debug info and one optimisation
/// level whatever the cargo profile (glue code: the torch headers would make debug info huge).
pub fn cpp(libtorch: &Path, abi: &str) -> cc::Build {
    let include = libtorch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .debug(false)
        .opt_level(2)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT");
    build
}

/// Where the CUDA headers that ATen's CUDA headers need are.
pub struct CudaHeaders {
    /// The CUDA runtime's include directory.
    pub cuda: PathBuf,
    /// The wheel's other `nvidia/*/include` directories (cuBLAS, cuSPARSE, NCCL...), sorted.
    pub others: Vec<PathBuf>,
    /// The wheel's `nvidia` directory (may not exist for a libtorch zip).
    pub nvidia: PathBuf,
}

/// Finds the CUDA headers for `libtorch`, or says why they cannot be used (a CPU-only libtorch,
/// missing headers). The pip wheel keeps them in sibling `nvidia/*` packages (`nvidia/cu13` for
/// CUDA 13; `nvidia/cuda_runtime`, `nvidia/cublas`, ... for CUDA 12); a libtorch zip relies on a
/// system CUDA toolkit.
pub fn cuda_headers(libtorch: &Path, lib: &Path) -> Result<CudaHeaders, String> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    if !lib.join("libtorch_cuda.so").exists() {
        return Err(format!("{} has no libtorch_cuda.so (a CPU-only libtorch)", lib.display()));
    }
    let nvidia = libtorch.parent().map(|p| p.join("nvidia")).unwrap_or_default();
    let mut cuda_dirs = vec![nvidia.join("cu13/include"), nvidia.join("cuda_runtime/include")];
    cuda_dirs
        .extend(["CUDA_HOME", "CUDA_PATH"].iter().filter_map(env::var_os).map(|d| PathBuf::from(d).join("include")));
    cuda_dirs.push(PathBuf::from("/usr/local/cuda/include"));
    let Some(cuda) = cuda_dirs.iter().find(|d| d.join("cuda_runtime_api.h").exists()).cloned() else {
        return Err(
            "cuda_runtime_api.h not found in the wheel's nvidia/ packages, $CUDA_HOME or /usr/local/cuda".into()
        );
    };
    // ATen's CUDA headers include `cuda_runtime.h` and `cuda_fp16.h`, which need the `crt/`
    // headers and CCCL's `nv/target`: a toolkit has them, but the CUDA 13 wheels ship them in
    // packages of their own, `nvidia-cuda-crt` and `nvidia-cuda-cccl`, that torch does not
    // depend on (install the versions matching `nvidia-cuda-runtime`).
    let missing: Vec<&str> =
        ["crt/host_config.h", "nv/target"].into_iter().filter(|h| !cuda.join(h).exists()).collect();
    if !missing.is_empty() {
        // Installing them adds to this directory: have cargo rerun the build script then.
        println!("cargo:rerun-if-changed={}", cuda.display());
        // CUDART_VERSION 13000 -> "13.0", the release the two packages must match.
        let api = std::fs::read_to_string(cuda.join("cuda_runtime_api.h")).unwrap_or_default();
        let release = api
            .lines()
            .find_map(|l| l.strip_prefix("#define CUDART_VERSION"))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .map_or_else(|| "<CUDA major.minor>".to_string(), |v| format!("{}.{}", v / 1000, v % 1000 / 10));
        return Err(format!(
            "{} lacks {} (for the CUDA 13 wheels: pip install 'nvidia-cuda-crt=={release}.*' 'nvidia-cuda-cccl=={release}.*')",
            cuda.display(),
            missing.join(" and ")
        ));
    }
    let mut others: Vec<PathBuf> = std::fs::read_dir(&nvidia)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path().join("include")).filter(|d| d.is_dir()).collect())
        .unwrap_or_default();
    others.sort();
    others.retain(|d| *d != cuda);
    Ok(CudaHeaders { cuda, others, nvidia })
}

/// Compiles `source` with `build`'s flags into the shared library `out`, linked against `libs`
/// in `lib` with an rpath to `lib` and to each of `rpaths`, every symbol resolved at link time.
/// Panics with the command and the compiler's output when it fails.
pub fn compile_shared(build: &cc::Build, source: &Path, out: &Path, lib: &Path, libs: &[&str], rpaths: &[PathBuf]) {
    let mut cmd = build.get_compiler().to_command();
    cmd.arg("-shared").arg("-o").arg(out).arg(source);
    cmd.arg(format!("-L{}", lib.display())).arg(format!("-Wl,-rpath,{}", lib.display()));
    for dir in rpaths {
        cmd.arg(format!("-Wl,-rpath,{}", dir.display()));
    }
    // Every symbol must resolve now, against these libraries, rather than at dlopen time.
    cmd.arg("-Wl,--no-undefined");
    cmd.args(libs.iter().map(|l| format!("-l{l}")));
    // The command line alone (its Debug form would list the whole environment too).
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let output = cmd.output().unwrap_or_else(|e| panic!("cannot run the C++ compiler ({e}): {shown}"));
    if !output.status.success() {
        panic!(
            "compiling {} into {} failed ({}):\n{shown}\n{}{}",
            source.display(),
            out.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
