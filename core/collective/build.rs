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
    let libtorch = rlhf_build_support::libtorch();
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
    let abi = rlhf_build_support::cxx11_abi();
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
    let lib = rlhf_build_support::lib_dir(&libtorch);
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
    if env::var("RLHF_SKIP_NCCL").is_ok_and(|v| v == "1") {
        return;
    }
    let skip = |why: String| println!("cargo:warning=NCCL support not built: {why}; CUDA tensors cannot be reduced");
    let cuda = match rlhf_build_support::cuda_headers(libtorch, lib) {
        Ok(c) => c,
        Err(why) => return skip(why),
    };
    let nccl_dirs = [cuda.nvidia.join("nccl/include"), cuda.cuda.clone(), PathBuf::from("/usr/include")];
    let Some(nccl_include) = nccl_dirs.into_iter().find(|d| d.join("nccl.h").exists()) else {
        return skip(format!(
            "nccl.h not found in {} or {}",
            cuda.nvidia.join("nccl/include").display(),
            cuda.cuda.display()
        ));
    };
    let mut build = rlhf_build_support::cpp(libtorch, abi);
    build
        .include(&cuda.cuda)
        .include(&nccl_include)
        // ProcessGroupNCCL.hpp and NCCLUtils.hpp are empty without USE_C10D_NCCL; USE_CUDA is how
        // libtorch_cuda was built (it changes the layout of c10's CUDA assertion registry).
        .flag("-DUSE_C10D_NCCL")
        .flag("-DUSE_CUDA");
    // The wheel's other header directories (cuBLAS, cuSPARSE, cuSOLVER live there under CUDA 12),
    // which ATen's CUDA headers include.
    for dir in cuda.others.iter().filter(|d| **d != nccl_include) {
        build.include(dir);
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("librlhf_nccl.so");
    let nccl_lib = nccl_include.with_file_name("lib");
    let rpaths: Vec<PathBuf> = nccl_lib.is_dir().then_some(nccl_lib).into_iter().collect();
    let libs = ["torch_cuda", "torch_cpu", "c10_cuda", "c10"];
    rlhf_build_support::compile_shared(&build, &manifest.join("src/nccl.cpp"), &out, lib, &libs, &rpaths);
    println!("cargo:rustc-env=RLHF_NCCL_LIB_BUILT={}", out.display());
}
