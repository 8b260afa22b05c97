// A C ABI over libtorch's c10d (the engine under torch.distributed): a TCPStore rendezvous, a
// Gloo process group for CPU tensors, and the collectives the trainer uses. Every entry point
// catches C++ exceptions and returns them as a message (the caller frees it with
// rlhf_c10d_free_string), so no exception crosses into Rust.
//
// Tensors arrive as `at::Tensor*`, which is what tch's `Tensor::as_ptr` points at.

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
  // NCCL: `wait()` orders the caller's CUDA stream after the collective (no CPU block); the
  // backend's watchdog enforces the timeout. A timed wait would poll the GPU to completion.
  bool device_stream = false;
};

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
  } catch (const c10::Error& e) {
    *err = copy_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    *err = copy_string(e.what());
  } catch (...) {
    *err = copy_string("unknown C++ exception");
  }
  return 1;
}

// Waits for `work`, failing after the group's timeout.
void finish(const Group& g, const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  if (g.device_stream) {
    work->wait();
    return;
  }
  if (!work->wait(g.timeout)) {
    throw std::runtime_error(std::string(what) + " did not finish within " +
                             std::to_string(g.timeout.count()) + " ms");
  }
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case 1:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case 2:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    default:
      throw std::invalid_argument("unknown reduce op " + std::to_string(op));
  }
}

}  // namespace

extern "C" {

void rlhf_c10d_free_string(char* s) { std::free(s); }

// Connects to (rank 0 with `host_store` set: hosts) the TCPStore at host:port and waits for
// `size` workers.
int rlhf_c10d_store_new(const char* host, int port, int rank, int size, int host_store,
                        int64_t timeout_ms, void** out, char** err) {
  return guarded(err, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = host_store != 0 && rank == 0;
    opts.numWorkers = static_cast<std::size_t>(size);
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto* boxed = new c10::intrusive_ptr<c10d::Store>(std::move(store));
    *out = boxed;
  });
}

void rlhf_c10d_store_free(void* store) {
  delete static_cast<c10::intrusive_ptr<c10d::Store>*>(store);
}

// A Gloo group over `store` (namespaced by `prefix`). The transport binds `iface` when given,
// else `hostname` when given, else this machine's hostname (falling back to loopback).
int rlhf_c10d_gloo_new(void* store, const char* prefix, int rank, int size, const char* iface,
                       const char* hostname, int threads, int64_t timeout_ms, void** out,
                       char** err) {
  return guarded(err, [&] {
    auto base = *static_cast<c10::intrusive_ptr<c10d::Store>*>(store);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base);
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    if (iface != nullptr && iface[0] != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
    } else if (hostname != nullptr && hostname[0] != '\0') {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = threads;
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, opts);
    *out = new Group{base, backend, timeout};
  });
}

// Wraps a backend made elsewhere (the NCCL library) as a group; takes ownership of `backend`,
// an `intrusive_ptr<Backend>*`.
void* rlhf_c10d_group_from_backend(void* store, void* backend, int64_t timeout_ms) {
  auto* b = static_cast<c10::intrusive_ptr<c10d::Backend>*>(backend);
  auto* g = new Group{*static_cast<c10::intrusive_ptr<c10d::Store>*>(store), *b,
                      std::chrono::milliseconds(timeout_ms), true};
  delete b;
  return g;
}

// Shuts the backend down before dropping it (NCCL otherwise warns and aborts its communicators;
// Gloo's shutdown does nothing).
void rlhf_c10d_group_free(void* group) {
  auto* g = static_cast<Group*>(group);
  try {
    g->backend->shutdown();
  } catch (...) {
  }
  delete g;
}

// In place over all ranks: op 0 sum, 1 max, 2 min.
int rlhf_c10d_allreduce(void* group, void* tensor, int op, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g.timeout;
    finish(g, g.backend->allreduce(ts, opts), "all_reduce");
  });
}

// In place: every rank ends with `root`'s tensor.
int rlhf_c10d_broadcast(void* group, void* tensor, int root, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = g.timeout;
    finish(g, g.backend->broadcast(ts, opts), "broadcast");
  });
}

// `outputs[r]` (one tensor per rank, each shaped like `input`) receives rank r's `input`.
int rlhf_c10d_allgather(void* group, void** outputs, int n, void* input, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    std::vector<at::Tensor> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(*static_cast<at::Tensor*>(outputs[i]));
    }
    std::vector<std::vector<at::Tensor>> outs{out};
    std::vector<at::Tensor> in{*static_cast<at::Tensor*>(input)};
    c10d::AllgatherOptions opts;
    opts.timeout = g.timeout;
    finish(g, g.backend->allgather(outs, in, opts), "all_gather");
  });
}

}  // extern "C"

namespace {

// `output` (one rank's share, contiguous) receives its part of the sum over ranks of `input`
// (world size × the share, contiguous): c10d's `_reduce_scatter_base`, which
// `torch.distributed.reduce_scatter_tensor` calls (NCCL's ncclReduceScatter; Gloo's own).
c10::intrusive_ptr<c10d::Work> start_reduce_scatter(Group& g, void* output, void* input) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  opts.timeout = g.timeout;
  return g.backend->_reduce_scatter_base(*static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), opts);
}

// `output` (world size × the share, contiguous) receives every rank's `input` (the share) in
// rank order: c10d's `_allgather_base` (`torch.distributed.all_gather_into_tensor`).
c10::intrusive_ptr<c10d::Work> start_allgather_into(Group& g, void* output, void* input) {
  c10d::AllgatherOptions opts;
  opts.timeout = g.timeout;
  return g.backend->_allgather_base(*static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), opts);
}

}  // namespace

extern "C" {

int rlhf_c10d_reduce_scatter(void* group, void* output, void* input, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    finish(g, start_reduce_scatter(g, output, input), "reduce_scatter");
  });
}

int rlhf_c10d_allgather_into(void* group, void* output, void* input, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    finish(g, start_allgather_into(g, output, input), "all_gather_into");
  });
}

// The two above without waiting: `*work` receives the work handle (a heap copy of the intrusive
// pointer), to be waited on with `rlhf_c10d_work_wait` and freed with `rlhf_c10d_work_free`. The
// trainer prefetches the next sharded layer and reduces a layer's gradients while the layer
// below computes with them.
int rlhf_c10d_allgather_into_async(void* group, void* output, void* input, void** work, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    *work = new c10::intrusive_ptr<c10d::Work>(start_allgather_into(g, output, input));
  });
}

int rlhf_c10d_reduce_scatter_async(void* group, void* output, void* input, void** work, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    *work = new c10::intrusive_ptr<c10d::Work>(start_reduce_scatter(g, output, input));
  });
}

// Waits for a work handle of an `*_async` call (with the group's timeout); `what` names it.
int rlhf_c10d_work_wait(void* group, void* work, const char* what, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    finish(g, *static_cast<c10::intrusive_ptr<c10d::Work>*>(work), what);
  });
}

void rlhf_c10d_work_free(void* work) {
  delete static_cast<c10::intrusive_ptr<c10d::Work>*>(work);
}

int rlhf_c10d_barrier(void* group, char** err) {
  return guarded(err, [&] {
    auto& g = *static_cast<Group*>(group);
    c10d::BarrierOptions opts;
    opts.timeout = g.timeout;
    finish(g, g.backend->barrier(opts), "barrier");
  });
}

}  // extern "C"

extern "C" {

// Gives a parameter a zero gradient when it has none.
int rlhf_c10d_ensure_grad(void* tensor, char** err) {
  return guarded(err, [&] {
    auto& p = *static_cast<at::Tensor*>(tensor);
    if (!p.grad().defined()) {
      p.mutable_grad() = at::zeros_like(p);
    }
  });
}

// Drops a parameter's gradient (`zero_grad(set_to_none=True)`, PyTorch's default): the next
// backward allocates it afresh as the activations it needs are freed, instead of a zeroed
// buffer of every parameter's size being held through the forward.
int rlhf_c10d_release_grad(void* tensor, char** err) {
  return guarded(err, [&] { static_cast<at::Tensor*>(tensor)->mutable_grad().reset(); });
}

}  // extern "C"

extern "C" {

// c10d logs its failures (with C++ backtraces) before throwing them; the thrown message reaches
// the caller as a one-line error, so the log is silenced unless TORCH_CPP_LOG_LEVEL asks for it.
void rlhf_c10d_quiet_logs() {
  FLAGS_caffe2_log_level = 3;  // FATAL only
  c10::UpdateLoggingLevelsFromFlags();
}

}  // extern "C"
