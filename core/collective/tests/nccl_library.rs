//! The NCCL library is compiled against this libtorch (when its CUDA headers are installed, as
//! `cargo xtask setup` does) and loads in a process without a GPU: its entry point resolves, and
//! every library it links (libtorch_cuda, NCCL) is found. Running it needs GPUs (docs/gpu.md).

#[test]
fn the_nccl_library_loads_and_exports_its_entry_point() {
    if !rlhf_collective::nccl::built() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI builds through `cargo xtask`, which installs the CUDA headers: the NCCL library must be built"
        );
        eprintln!("NCCL library not built (CUDA headers missing); skipped");
        return;
    }
    let path = rlhf_collective::nccl::check_library().unwrap_or_else(|e| panic!("{e}"));
    assert!(path.is_file(), "{}", path.display());
}
