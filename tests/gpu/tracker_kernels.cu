// Test kernels for the launch tracker's GPU test (tracker_kernels.hpp).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "tracker_kernels.hpp"

namespace {

struct view {
  const float* data;
  int n;
};

__global__ void touch(float* a, view b) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < b.n) a[i] += b.data[i];
}

__global__ void empty(float* a) {}

}  // namespace

namespace layerswap_test {

void launch_touch_runtime(float* a, float* b, int n, void* stream) {
  touch<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(a, view{b, n});
}

bool launch_touch_runtime_ex(float* a, float* b, int n, void* stream) {
  view v{b, n};
  void* args[] = {&a, &v};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>((n + 255) / 256));
  config.blockDim = dim3(256);
  config.stream = static_cast<cudaStream_t>(stream);
  return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(&touch), args) == cudaSuccess;
}

bool launch_touch_cooperative(float* a, float* b, int n, void* stream) {
  view v{b, n};
  void* args[] = {&a, &v};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&touch), dim3((n + 255) / 256), dim3(256), args,
                                     0, static_cast<cudaStream_t>(stream)) == cudaSuccess;
}

bool launch_touch_driver(float* a, float* b, int n, void* stream, bool extra) {
  using launch_fn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 CUstream, void**, void**);
  static launch_fn launch = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernel", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess) {
      return static_cast<launch_fn>(nullptr);
    }
    return reinterpret_cast<launch_fn>(fn);
  }();
  cudaFunction_t f = nullptr;
  if (launch == nullptr || cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(&touch)) != cudaSuccess) return false;
  view v{b, n};
  const unsigned grid = static_cast<unsigned>((n + 255) / 256);
  if (!extra) {
    void* params[] = {&a, &v};
    return launch(reinterpret_cast<CUfunction>(f), grid, 1, 1, 256, 1, 1, 0, static_cast<CUstream>(stream), params,
                  nullptr) == CUDA_SUCCESS;
  }
  alignas(8) unsigned char buffer[sizeof(float*) + sizeof(view)];
  std::memcpy(buffer, &a, sizeof a);
  std::memcpy(buffer + sizeof a, &v, sizeof v);
  std::size_t size = sizeof buffer;
  void* config[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buffer, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
  return launch(reinterpret_cast<CUfunction>(f), grid, 1, 1, 256, 1, 1, 0, static_cast<CUstream>(stream), nullptr,
                config) == CUDA_SUCCESS;
}

void launch_empty(float* a, void* stream) { empty<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(a); }

void memset_async(void* p, std::size_t bytes, void* stream) {
  cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream));
}

void memcpy_async(void* dst, const void* src, std::size_t bytes, void* stream) {
  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
}

void synchronize() { cudaDeviceSynchronize(); }

const char* touch_kernel_name() { return "touch"; }

}  // namespace layerswap_test
