//! Compiles `src/ops.cpp` (the operator counter and fused AdamW) and `src/profile.cpp` (the
//! Kineto profiler) against libtorch's CPU library, linked into the crate, and, when libtorch has
//! CUDA and the wheel's CUDA headers are found, `src/cuda_graph.cpp` into `$OUT_DIR/librlhf_cuda_graph.so`, which `src/cuda_graph.rs`
//! loads at run time (`RLHF_CUDA_GRAPH_LIB_BUILT`), so a CPU-only run never needs
//! `libtorch_cuda.so`. Without CUDA the graph library is skipped with a warning and decoding on
//! CUDA would run eagerly; `RLHF_SKIP_CUDA_GRAPHS=1` skips it silently.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/ops.cpp");
    println!("cargo:rerun-if-changed=src/profile.cpp");
    println!("cargo:rerun-if-changed=src/strings.h");
    println!("cargo:rerun-if-changed=src/cuda_graph.cpp");
    println!("cargo:rerun-if-env-changed=RLHF_SKIP_CUDA_GRAPHS");
    let libtorch = rlhf_build_support::libtorch();
    let abi = rlhf_build_support::cxx11_abi();
    let lib = rlhf_build_support::lib_dir(&libtorch);
    rlhf_build_support::cpp(&libtorch, &abi).file("src/ops.cpp").file("src/profile.cpp").compile("rlhf_aten_ops");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    if env::var("RLHF_SKIP_CUDA_GRAPHS").is_ok_and(|v| v == "1") {
        return;
    }
    let cuda = match rlhf_build_support::cuda_headers(&libtorch, &lib) {
        Ok(c) => c,
        Err(why) => {
            println!("cargo:warning=CUDA graph library not built: {why}; decoding on CUDA runs eagerly");
            return;
        }
    };
    let mut build = rlhf_build_support::cpp(&libtorch, &abi);
    // USE_CUDA is how libtorch_cuda was built (it changes the layout of c10's CUDA assertion
    // registry that ATen's CUDA headers reach).
    build.include(&cuda.cuda).flag("-DUSE_CUDA");
    for dir in &cuda.others {
        build.include(dir);
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("librlhf_cuda_graph.so");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let libs = ["torch_cuda", "torch_cpu", "c10_cuda", "c10"];
    rlhf_build_support::compile_shared(&build, &manifest.join("src/cuda_graph.cpp"), &out, &lib, &libs, &[]);
    println!("cargo:rustc-env=RLHF_CUDA_GRAPH_LIB_BUILT={}", out.display());
}
