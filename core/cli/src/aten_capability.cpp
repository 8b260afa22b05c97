// The CPU capability libtorch's kernels dispatch to, as `torch.backends.cpu.get_cpu_capability()`
// reports it in Python ("DEFAULT", "AVX2", "AVX512"): ATen's choice from the CPU and the
// `ATEN_CPU_CAPABILITY` environment variable, made once per process. tch has no binding for it.
#include <cstddef>
#include <cstring>
#include <string>

namespace at {
// Declared in ATen/Version.h and exported by libtorch_cpu; declared here rather than included so
// this file needs none of ATen's headers (a wrong signature fails at link time).
std::string get_cpu_capability();
}  // namespace at

// Copies at most `cap` bytes of the capability's name into `out`; returns how many (0 on error).
extern "C" size_t rlhf_aten_cpu_capability(char* out, size_t cap) noexcept {
  try {
    const std::string name = at::get_cpu_capability();
    const size_t n = name.size() < cap ? name.size() : cap;
    std::memcpy(out, name.data(), n);
    return n;
  } catch (...) {
    return 0;
  }
}
