//! Compiles the c10d shim (`src/shim.cpp`) with torch-sys's own recipe (C++17, the libtorch
//! include dirs, the C++11 ABI libtorch was built with) plus `USE_C10D_GLOO` and the vendored
//! gloo headers that `ProcessGroupGloo.hpp` includes but the torch wheel does not ship.
//!
//! When libtorch has CUDA (`libtorch_cuda.so`) and the CUDA runtime and NCCL headers can be
//! found, it also builds `src/nccl.cpp` into a separate shared library, `$OUT_DIR/librlhf_nccl.so`
//! (see `build_nccl`), which `src/nccl.rs` loads at run time, so that this crate does not make
//! the binary need `libtorch_cuda.so`.

use std::env;
use std::path::{Path, PathBuf};

/// The PyTorch release whose `third_party/gloo` the vendored headers come from.
const PINNED_TORCH: &str = "2.11.";

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=vendor");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let Some(libtorch) = env::var_os("LIBTORCH").map(PathBuf::from) else {
        panic!("LIBTORCH is not set: run through `cargo xtask` (which installs libtorch and sets it), or export LIBTORCH=<site-packages>/torch");
    };
    let include = libtorch.join("include");
    let header = include.join("torch/csrc/distributed/c10d/ProcessGroupGloo.hpp");
    if !header.exists() {
        panic!("{}: missing; this libtorch does not ship the c10d headers", header.display());
    }
    // The vendored gloo headers match the gloo commit PyTorch 2.11 builds with; another libtorch
    // may embed another gloo (different class layouts), so refuse rather than miscompile.
    let version = std::fs::read_to_string(libtorch.join("version.py")).unwrap_or_default();
    let found =
        version.lines().find_map(|l| l.strip_prefix("__version__ = ")).map(|v| v.trim_matches(['\'', '"']).to_string());
    match found {
        Some(v) if v.starts_with(PINNED_TORCH) => {}
        other => panic!(
            "core/collective/vendor/gloo is pinned to the gloo of PyTorch {PINNED_TORCH}x, but {} says {}: refresh the vendored headers (see vendor/gloo/README.md)",
            libtorch.join("version.py").display(),
            other.as_deref().unwrap_or("no version")
        ),
    }
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(manifest.join("vendor"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-DUSE_C10D_GLOO")
        .file("src/shim.cpp")
        .compile("rlhf_c10d");
    let lib = env::var("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from).unwrap_or_else(|_| libtorch.join("lib"));
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    build_nccl(&libtorch, &lib, &abi, &manifest);
}

/// Builds `src/nccl.cpp` (c10d's `ProcessGroupNCCL` behind a C entry point) into
/// `$OUT_DIR/librlhf_nccl.so` and tells `src/nccl.rs` where it is through the compile-time env
/// `RLHF_NCCL_LIB_BUILT`. Skipped, with a warning, when this libtorch has no CUDA or the CUDA /
/// NCCL headers are missing (CUDA tensors then cannot be reduced, CPU ones still can); skipped
/// silently when `RLHF_SKIP_NCCL=1`. A failed compile fails the build.
///
/// `lib` is the libtorch library directory the binary links against. The library links
/// `torch_cuda`, `torch_cpu`, `c10_cuda` and `c10` from there, with an rpath to it and to the
/// wheel's NCCL library, so loading it needs no `LD_LIBRARY_PATH`.
fn build_nccl(libtorch: &Path, lib: &Path, abi: &str, manifest: &Path) {
    println!("cargo:rerun-if-changed=src/nccl.cpp");
    println!("cargo:rerun-if-env-changed=RLHF_SKIP_NCCL");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    if env::var("RLHF_SKIP_NCCL").is_ok_and(|v| v == "1") {
        return;
    }
    let skip = |why: String| println!("cargo:warning=NCCL support not built: {why}; CUDA tensors cannot be reduced");
    if !lib.join("libtorch_cuda.so").exists() {
        return skip(format!("{} has no libtorch_cuda.so (a CPU-only libtorch)", lib.display()));
    }
    // The pip wheel keeps the CUDA and NCCL headers in sibling `nvidia/*` packages (`nvidia/cu13`
    // for CUDA 13; `nvidia/cuda_runtime`, `nvidia/cublas`, ... for CUDA 12); a libtorch zip
    // relies on a system CUDA toolkit.
    let nvidia = libtorch.parent().map(|p| p.join("nvidia")).unwrap_or_default();
    let mut cuda_dirs = vec![nvidia.join("cu13/include"), nvidia.join("cuda_runtime/include")];
    cuda_dirs
        .extend(["CUDA_HOME", "CUDA_PATH"].iter().filter_map(env::var_os).map(|d| PathBuf::from(d).join("include")));
    cuda_dirs.push(PathBuf::from("/usr/local/cuda/include"));
    let Some(cuda_include) = cuda_dirs.iter().find(|d| d.join("cuda_runtime_api.h").exists()).cloned() else {
        return skip(
            "cuda_runtime_api.h not found in the wheel's nvidia/ packages, $CUDA_HOME or /usr/local/cuda".into(),
        );
    };
    // ATen's CUDA headers include `cuda_runtime.h` and `cuda_fp16.h`, which need the `crt/`
    // headers and CCCL's `nv/target`: a toolkit has them, but the CUDA 13 wheels ship them in
    // packages of their own, `nvidia-cuda-crt` and `nvidia-cuda-cccl`, that torch does not
    // depend on (install the versions matching `nvidia-cuda-runtime`).
    let missing: Vec<&str> =
        ["crt/host_config.h", "nv/target"].into_iter().filter(|h| !cuda_include.join(h).exists()).collect();
    if !missing.is_empty() {
        // Installing them adds to this directory: have cargo rerun this script then.
        println!("cargo:rerun-if-changed={}", cuda_include.display());
        // CUDART_VERSION 13000 -> "13.0", the release the two packages must match.
        let api = std::fs::read_to_string(cuda_include.join("cuda_runtime_api.h")).unwrap_or_default();
        let release = api
            .lines()
            .find_map(|l| l.strip_prefix("#define CUDART_VERSION"))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .map_or_else(|| "<CUDA major.minor>".to_string(), |v| format!("{}.{}", v / 1000, v % 1000 / 10));
        return skip(format!(
            "{} lacks {} (for the CUDA 13 wheels: pip install 'nvidia-cuda-crt=={release}.*' 'nvidia-cuda-cccl=={release}.*')",
            cuda_include.display(),
            missing.join(" and ")
        ));
    }
    let nccl_dirs = [nvidia.join("nccl/include"), cuda_include.clone(), PathBuf::from("/usr/include")];
    let Some(nccl_include) = nccl_dirs.into_iter().find(|d| d.join("nccl.h").exists()) else {
        return skip(format!(
            "nccl.h not found in {} or {}",
            nvidia.join("nccl/include").display(),
            cuda_include.display()
        ));
    };
    // The wheel's other header directories (cuBLAS, cuSPARSE, cuSOLVER live there under CUDA 12),
    // which ATen's CUDA headers include.
    let mut extra: Vec<PathBuf> = std::fs::read_dir(&nvidia)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path().join("include")).filter(|d| d.is_dir()).collect())
        .unwrap_or_default();
    extra.sort();
    extra.retain(|d| *d != cuda_include && *d != nccl_include);

    let include = libtorch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        // Glue code: no debug info (the torch headers would make it huge) and one optimisation
        // level whatever the cargo profile, so the command (and its time) is always the same.
        .debug(false)
        .opt_level(2)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&cuda_include)
        .include(&nccl_include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        // ProcessGroupNCCL.hpp and NCCLUtils.hpp are empty without USE_C10D_NCCL; USE_CUDA is how
        // libtorch_cuda was built (it changes the layout of c10's CUDA assertion registry).
        .flag("-DUSE_C10D_NCCL")
        .flag("-DUSE_CUDA");
    for dir in &extra {
        build.include(dir);
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("librlhf_nccl.so");
    let mut cmd = build.get_compiler().to_command();
    cmd.arg("-shared").arg("-o").arg(&out).arg(manifest.join("src/nccl.cpp"));
    cmd.arg(format!("-L{}", lib.display())).arg(format!("-Wl,-rpath,{}", lib.display()));
    let nccl_lib = nccl_include.with_file_name("lib");
    if nccl_lib.is_dir() {
        cmd.arg(format!("-Wl,-rpath,{}", nccl_lib.display()));
    }
    // Every symbol must resolve now, against these libraries, rather than at dlopen time.
    cmd.arg("-Wl,--no-undefined");
    cmd.args(["-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10"]);
    // The command line alone (its Debug form would list the whole environment too).
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let output = cmd.output().unwrap_or_else(|e| panic!("cannot run the C++ compiler ({e}): {shown}"));
    if !output.status.success() {
        panic!(
            "compiling src/nccl.cpp into {} failed ({}):\n{shown}\n{}{}",
            out.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    println!("cargo:rustc-env=RLHF_NCCL_LIB_BUILT={}", out.display());
}
