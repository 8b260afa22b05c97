//! What CPU a figure came from: its model name, the vector extensions it reports, and the
//! capability libtorch's CPU kernels dispatch to. Float results differ in the last bits between
//! x86-64 kinds (AMD Zen 3 with AVX2, Zen 4/5 with AVX-512, Intel Xeon with AVX-512 and AMX),
//! because libtorch, MKL and oneDNN pick their kernels from the CPU at run time; `rlhf
//! check-device` and every benchmark header print this line so a number names its machine.

use std::ffi::c_char;

extern "C" {
    /// `at::get_cpu_capability()` (`src/aten_capability.cpp`): copies at most `cap` bytes of the
    /// capability's name into `out` and returns how many.
    fn rlhf_aten_cpu_capability(out: *mut c_char, cap: usize) -> usize;
}

/// The capability libtorch's CPU kernels dispatch to in this process, as PyTorch's
/// `torch.backends.cpu.get_cpu_capability()` names it: `DEFAULT` (the portable kernels), `AVX2`
/// or `AVX512`. It follows the CPU unless `ATEN_CPU_CAPABILITY` (`default`, `avx2`, `avx512`) says
/// otherwise.
pub fn aten_cpu_capability() -> String {
    let mut buf = [0u8; 64];
    // SAFETY: the shim writes at most `buf.len()` bytes into `buf` and catches every C++ exception.
    let n = unsafe { rlhf_aten_cpu_capability(buf.as_mut_ptr().cast(), buf.len()) };
    String::from_utf8_lossy(&buf[..n.min(buf.len())]).into_owned()
}

/// The `model name` line of `/proc/cpuinfo`.
pub fn cpu_model_name(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
}

/// The `/proc/cpuinfo` flags that change which kernels run, with the names printed for them.
const EXTENSIONS: [(&str, &str); 6] = [
    ("avx2", "AVX2"),
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_fp16", "AVX512-FP16"),
    ("amx_bf16", "AMX-BF16"),
    ("amx_int8", "AMX-INT8"),
];

/// The vector and matrix extensions of [`EXTENSIONS`] the CPU reports in `/proc/cpuinfo` (its
/// first `flags` line), in that order; empty on other machines. Two CPUs of one model name can
/// differ here (a VM's "AMD EPYC" is Zen 3 or Zen 4), and so do their figures.
pub fn cpu_extensions(cpuinfo: &str) -> Vec<&'static str> {
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect())
        .unwrap_or_default();
    EXTENSIONS.iter().filter(|(flag, _)| flags.contains(flag)).map(|&(_, name)| name).collect()
}

/// One line naming the CPU: `AMD EPYC; AVX2 AVX-512 AVX512-BF16; ATen AVX512`.
pub fn describe_cpu_with(cpuinfo: &str, aten: &str) -> String {
    let cpu = cpu_model_name(cpuinfo).unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let ext = cpu_extensions(cpuinfo);
    let ext = if ext.is_empty() { "no AVX2".to_string() } else { ext.join(" ") };
    format!("{cpu}; {ext}; ATen {aten}")
}

/// [`describe_cpu_with`] for this machine and this process's libtorch.
pub fn describe_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    describe_cpu_with(&info, &aten_cpu_capability())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_name_and_extensions() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  7B13 64-Core Processor\n";
        assert_eq!(cpu_model_name(info).as_deref(), Some("AMD EPYC 7B13 64-Core Processor"));
        assert_eq!(cpu_model_name("processor: 0\n"), None);
        assert_eq!(cpu_extensions("flags\t\t: fpu sse2 avx avx2 fma\n"), ["AVX2"]);
        assert_eq!(cpu_extensions("flags\t: avx2 avx512f avx512bw avx512_bf16\n"), ["AVX2", "AVX-512", "AVX512-BF16"]);
        let sapphire = "flags\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\nflags\t: x\n";
        assert_eq!(cpu_extensions(sapphire), ["AVX2", "AVX-512", "AVX512-BF16", "AVX512-FP16", "AMX-BF16", "AMX-INT8"]);
        assert!(cpu_extensions("flags\t: fp asimd\n").is_empty());
        let zen3 = "model name\t: AMD EPYC\nflags\t: avx avx2 fma\n";
        assert_eq!(describe_cpu_with(zen3, "AVX2"), "AMD EPYC; AVX2; ATen AVX2");
        assert_eq!(
            describe_cpu_with("flags\t: fp asimd\n", "DEFAULT"),
            format!("{}; no AVX2; ATen DEFAULT", std::env::consts::ARCH)
        );
    }

    /// libtorch itself answers, and follows `ATEN_CPU_CAPABILITY` (read once per process, so the
    /// override is checked in a child process: `rlhf check-device` in the CLI tests).
    #[test]
    fn libtorch_names_its_capability() {
        let got = aten_cpu_capability();
        assert!(["DEFAULT", "AVX2", "AVX512"].contains(&got.as_str()), "unexpected capability {got:?}");
    }
}
