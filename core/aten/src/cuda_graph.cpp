// CUDA graphs through libtorch (at::cuda::CUDAGraph), behind a C interface that
// src/cuda_graph.rs loads at run time. A graph is captured on a side stream of the device (CUDA
// forbids capturing the legacy default stream), with a memory pool shared by the graphs of one
// decode, in thread-local capture mode so that other threads (the trainer, beside an
// asynchronous generation worker) may allocate and launch while one thread captures. Replays
// launch on the current stream, after the work already queued there.
// Errors come back as a malloc'd message in `*err` (freed with rlhf_cg_free_string).
#include "strings.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace {

// The stream current before rlhf_cg_enter, per thread (the current stream is per thread).
thread_local std::optional<c10::cuda::CUDAStream> previous;

template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    *err = rlhf_dup(e.what());
    return 1;
  }
}

}  // namespace

extern "C" {

void rlhf_cg_free_string(char* s) { std::free(s); }

// A new memory pool id for graphs to share.
int rlhf_cg_pool(unsigned long long* first, unsigned long long* second, char** err) {
  return guarded(err, [&] {
    const auto id = at::cuda::graph_pool_handle();
    *first = id.first;
    *second = id.second;
  });
}

// Makes a side stream of `device` this thread's current stream, once the work queued so far has
// run (a device synchronisation: entering and leaving happen once per captured graph, and this
// file then needs no CUDA runtime calls of its own).
int rlhf_cg_enter(int device, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(!previous.has_value(), "a side stream is already current on this thread");
    const auto idx = static_cast<c10::DeviceIndex>(device);
    auto prev = c10::cuda::getCurrentCUDAStream(idx);
    auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, idx);
    c10::cuda::device_synchronize();
    c10::cuda::setCurrentCUDAStream(side);
    previous = prev;
  });
}

// Restores the stream current before rlhf_cg_enter, once the side stream's work has run.
int rlhf_cg_exit(char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(previous.has_value(), "no side stream is current on this thread");
    c10::cuda::device_synchronize();
    c10::cuda::setCurrentCUDAStream(*previous);
    previous.reset();
  });
}

// Starts capturing the current stream's work into a new graph (`*out`), allocating from `pool`.
int rlhf_cg_begin(unsigned long long first, unsigned long long second, void** out, char** err) {
  return guarded(err, [&] {
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    graph->capture_begin({first, second}, cudaStreamCaptureModeThreadLocal);
    *out = graph.release();
  });
}

// Ends the capture and instantiates the graph. On failure the graph is unusable (free it).
int rlhf_cg_end(void* graph, char** err) {
  return guarded(err, [&] { static_cast<at::cuda::CUDAGraph*>(graph)->capture_end(); });
}

int rlhf_cg_replay(void* graph, char** err) {
  return guarded(err, [&] { static_cast<at::cuda::CUDAGraph*>(graph)->replay(); });
}

void rlhf_cg_free(void* graph) {
  try {
    delete static_cast<at::cuda::CUDAGraph*>(graph);
  } catch (...) {
  }
}

}  // extern "C"
