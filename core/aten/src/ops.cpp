// libtorch entry points tch does not bind, on the CPU library only (linked into the crate):
//  - counting the ATen operators a piece of code dispatches, through a thread-local
//    RecordFunction callback (what torch.profiler records, without the profiler);
//  - the fused AdamW step at::_fused_adamw_ (one kernel over every parameter on CUDA, a fused
//    loop on the CPU), reached through the dispatcher so this file needs no CUDA headers.
// Tensors arrive as `at::Tensor*`, which is what tch's `Tensor::as_ptr` points at. Errors come
// back as a malloc'd message in `*err` (freed with rlhf_aten_free_string).
#include "strings.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

thread_local bool counting = false;
// Every operator dispatched, and those dispatched by the caller itself (not from inside another
// operator: the depth of the RecordFunction stack was 0 when they started).
thread_local std::vector<std::string> names;
thread_local std::vector<std::string> top;
thread_local int depth = 0;
thread_local at::CallbackHandle handle = 0;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (counting) {
    names.emplace_back(fn.name());
    if (depth == 0) {
      top.emplace_back(fn.name());
    }
  }
  ++depth;
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) { --depth; }

char* joined(std::vector<std::string>& list) {
  std::string out;
  for (const auto& n : list) {
    out += n;
    out += '\n';
  }
  list.clear();
  return rlhf_dup(out);
}

}  // namespace

extern "C" {

void rlhf_aten_free_string(char* s) { std::free(s); }

// Starts counting the operators this thread dispatches (restarting a count under way).
int rlhf_aten_count_start(char** err) {
  try {
    names.clear();
    top.clear();
    depth = 0;
    if (handle == 0) {
      handle = at::addThreadLocalCallback(
          at::RecordFunctionCallback(&on_start, &on_end).scopes({at::RecordScope::FUNCTION}));
    }
    counting = true;
    return 0;
  } catch (const std::exception& e) {
    *err = rlhf_dup(e.what());
    return 1;
  }
}

// Stops counting; returns how many operators were dispatched and writes their names, one per
// line, into `*all` and those the caller dispatched itself into `*outer` (both malloc'd).
int64_t rlhf_aten_count_stop(char** all, char** outer) {
  counting = false;
  if (handle != 0) {
    at::removeCallback(handle);
    handle = 0;
  }
  const auto n = static_cast<int64_t>(names.size());
  *all = joined(names);
  *outer = joined(top);
  return n;
}

// One AdamW step over `n` parameters (torch.optim.AdamW(fused=True)): params, grads, the two
// moments and the per-parameter step counts (f32 scalars, already incremented), updated in place.
int rlhf_aten_fused_adamw(void** params, void** grads, void** exp_avgs, void** exp_avg_sqs, void** steps,
                          int64_t n, double lr, double beta1, double beta2, double weight_decay, double eps,
                          char** err) {
  try {
    auto list = [n](void** ts) {
      std::vector<at::Tensor> v;
      v.reserve(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        v.push_back(*static_cast<at::Tensor*>(ts[i]));
      }
      return v;
    };
    auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs), s = list(steps);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                      /*found_inf=*/std::nullopt);
    return 0;
  } catch (const std::exception& e) {
    *err = rlhf_dup(e.what());
    return 1;
  }
}

}  // extern "C"
