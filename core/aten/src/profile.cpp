// libtorch's Kineto profiler (what torch.profiler.profile drives from Python), on the CPU library:
// start it for CPU operators and, when asked, CUDA kernels (through CUPTI, which libtorch_cpu
// links); stop it, write the Chrome trace, and hand back every event aggregated by device and name.
// Errors come back as a malloc'd message in `*err` (freed with rlhf_aten_free_string).
#include <torch/csrc/autograd/profiler_kineto.h>

#include "strings.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace {


namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

}  // namespace

extern "C" {

// Starts the profiler for this process's CPU operators and, with `cuda`, the CUDA kernels.
int rlhf_aten_profile_start(int cuda, char** err) {
  try {
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(ActivityType::CUDA);
    }
    const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    return 0;
  } catch (const std::exception& e) {
    *err = rlhf_dup(e.what());
    return 1;
  }
}

// Stops the profiler; writes the Chrome trace to `path` (none when null) and, into `*table`,
// one line per (device, name): `device \t count \t total ns \t name` (a CPU operator's time
// includes the operators it called).
int rlhf_aten_profile_stop(const char* path, char** table, char** err) {
  try {
    auto result = prof::disableProfiler();
    if (!result) {
      *err = rlhf_dup("the profiler was not running");
      return 1;
    }
    std::map<std::pair<std::string, std::string>, std::pair<uint64_t, uint64_t>> by_name;
    for (const auto& e : result->events()) {
      const std::string device = e.deviceType() == c10::DeviceType::CPU ? "cpu" : c10::DeviceTypeName(e.deviceType(), true);
      auto& slot = by_name[{device, e.name()}];
      slot.first += 1;
      slot.second += e.durationNs();
    }
    std::string out;
    for (const auto& [key, value] : by_name) {
      out += key.first + "\t" + std::to_string(value.first) + "\t" + std::to_string(value.second) + "\t";
      for (char c : key.second) {
        out += (c == '\t' || c == '\n') ? ' ' : c;
      }
      out += '\n';
    }
    if (path != nullptr) {
      result->save(path);
    }
    *table = rlhf_dup(out);
    return 0;
  } catch (const std::exception& e) {
    *err = rlhf_dup(e.what());
    return 1;
  }
}

}  // extern "C"
