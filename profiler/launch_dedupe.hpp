// Note [Nested launch callbacks]
//   A launch through the CUDA runtime (cudaLaunchKernel, cudaMemcpyAsync, ...) calls the driver
//   (cuLaunchKernel, ...) underneath, and CUPTI raises a callback for both. The runtime callback is the one
//   to decode (its function handle works with cudaFuncGetParamInfo and names the kernel), so the driver
//   callback nested inside it is skipped. Nesting is per thread: the runtime API's enter callback raises a
//   thread-local depth and its exit callback lowers it; a driver callback at depth > 0 is nested. Launches
//   made straight through the driver (cuBLASLt, Triton) arrive at depth 0 and are decoded there.
#pragma once

#include <cstdint>

namespace layerswap::profiler {

struct launch_nesting {
  std::uint32_t runtime_depth = 0;

  void runtime_enter() noexcept { ++runtime_depth; }
  void runtime_exit() noexcept {
    if (runtime_depth > 0) --runtime_depth;
  }
  // Whether a driver API callback arriving now belongs to a runtime call already counted.
  [[nodiscard]] bool driver_is_nested() const noexcept { return runtime_depth > 0; }
};

}  // namespace layerswap::profiler
