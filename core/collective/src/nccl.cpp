// NCCL for CUDA tensors: makes a c10d `ProcessGroupNCCL` over the rendezvous store that the main
// shim (`shim.cpp`) created, and hands it back as a plain `c10d::Backend`, which the shim then
// drives exactly like its Gloo group (`rlhf_c10d_group_from_backend`).
//
// Why a separate library: `ProcessGroupNCCL` lives in `libtorch_cuda.so` (and pulls in
// `libnccl.so.2`, `libcudart.so.13`, ...). The Rust binary must run CPU-only without those, so
// this file is built by `build.rs` into its own `librlhf_nccl.so` (only when the libtorch install
// has CUDA, NCCL and their headers) and `src/nccl.rs` dlopen()s it the first time a collective
// sees a CUDA tensor.
//
// ABI: every object crossing the boundary (`intrusive_ptr<Store>`, `intrusive_ptr<Backend>`,
// `c10::Error`) comes from the same libtorch shared libraries (libc10, libtorch_cpu) that both
// sides link against, so passing them between this library and the binary is safe as long as
// both were compiled against the same libtorch headers with the same `_GLIBCXX_USE_CXX11_ABI`.
// `ProcessGroupNCCL::Options` is allocated here (its size comes from these headers, its
// constructor from libtorch_cuda), so `nccl.h` must be the NCCL release this torch was built
// with: the wheel's pinned `nvidia-nccl` package provides exactly that.
//
// No C++ exception crosses into Rust: failures come back as a non-zero return and a malloc'd
// message in `*err` (the caller frees it with free()).

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace {

// Keys of this group in the shared rendezvous store; the Gloo group uses "rlhf/gloo", so the two
// groups' keys (NCCL unique ids, sequence counters, ...) never collide.
constexpr const char* kStorePrefix = "rlhf/nccl";

// The name NCCL's logs and flight recorder show for this group ("PG GUID" in log prefixes).
constexpr const char* kGroupName = "rlhf_nccl";

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.c_str(), s.size() + 1);
  }
  return out;
}

// Runs `f`, turning any exception into a message in `*err` and a non-zero return.
template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {  // includes c10::DistBackendError and friends
    *err = copy_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = copy_string(e.what());
  } catch (...) {
    *err = copy_string("unknown C++ exception");
  }
  return 1;
}

}  // namespace

extern "C" {

// Makes an NCCL backend for `rank` of `size` on CUDA device `device` (the caller passes
// LOCAL_RANK, as torchrun expects one process per GPU), over `store` (an
// `intrusive_ptr<c10d::Store>*` from rlhf_c10d_store_new; borrowed, not consumed).
//
// On success returns 0 and sets `*out` to a new heap-allocated `intrusive_ptr<c10d::Backend>*`
// whose ownership passes to the caller (rlhf_c10d_group_from_backend takes and deletes it). On
// failure returns non-zero and sets `*err` to a malloc'd message.
//
// This mirrors `torch.distributed.init_process_group("nccl", device_id=torch.device("cuda",
// local_rank), timeout=...)` after `torch.cuda.set_device(local_rank)`, except that the NCCL
// communicator is created lazily (as without `device_id`): constructing the group exchanges
// nothing, and the first collective on this rank's device creates the communicator, with rank 0
// publishing the NCCL unique id through the store. All ranks must therefore make the group and
// then run the same collectives in the same order, as with any c10d group.
__attribute__((visibility("default"))) int rlhf_nccl_backend_new(void* store, int rank, int size,
                                                                   int device, int64_t timeout_ms,
                                                                   void** out, char** err) {
  return guarded(err, [&] {
    // Fail with a readable message rather than ProcessGroupNCCL's "no GPUs found" or an
    // invalid-device CUDA error further down.
    const auto count = static_cast<int>(c10::cuda::device_count());
    if (count == 0) {
      throw std::runtime_error("NCCL needs a CUDA device, but none is visible to this process");
    }
    if (device < 0 || device >= count) {
      throw std::runtime_error("CUDA device " + std::to_string(device) +
                               " (from LOCAL_RANK) does not exist: this process sees " +
                               std::to_string(count) + " CUDA device(s)");
    }

    // What `torch.cuda.set_device(local_rank)` does: make this rank's GPU the calling thread's
    // current device, so that work done on this thread without an explicit device (and the CUDA
    // context NCCL creates) lands on it rather than on GPU 0.
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));

    auto base = *static_cast<c10::intrusive_ptr<c10d::Store>*>(store);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(kStorePrefix), base);

    // The options torch.distributed uses for a default NCCL group: normal-priority streams, the
    // group's timeout, no split parent, and an empty `global_ranks_in_group` (= all ranks, this
    // is the world group). The timeout is what ProcessGroupNCCL's watchdog thread enforces on
    // every collective; with the default TORCH_NCCL_ASYNC_ERROR_HANDLING=3 a collective that
    // overruns it makes the watchdog abort the communicators and take the process down.
    auto opts = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/false);
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    opts->group_name = kGroupName;

    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, opts);
    pg->setGroupDesc(kGroupName);

    // What `init_process_group(device_id=...)` does: bind the group to this rank's GPU. Barrier
    // (an all-reduce of a one-element tensor) then runs on this device instead of one guessed
    // as `rank % device_count`, and a collective on a tensor from another device fails with a
    // clear error instead of silently creating a second communicator.
    pg->setBoundDeviceId(at::Device(at::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));

    // As torch.distributed does after creating any NCCL group (a no-op for NCCL today, whose
    // sequence numbers simply start at 0).
    pg->setSequenceNumberForGroup();

    *out = new c10::intrusive_ptr<c10d::Backend>(std::move(pg));
  });
}

}  // extern "C"
