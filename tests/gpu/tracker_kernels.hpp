// Test kernels for tests/gpu/tracker_gpu_test.cpp, compiled by nvcc (tracker_kernels.cu) when CMake finds a
// CUDA compiler (LAYERSWAP_TEST_KERNELS=1). No CUDA header here: streams and pointers are plain pointers.
#pragma once

#include <cstddef>

namespace layerswap_test {

// touch(a, {b, n}): reads b, writes a; the second argument is a struct holding a pointer, passed by value.
// Through the runtime (<<<>>>: cudaLaunchKernel).
void launch_touch_runtime(float* a, float* b, int n, void* stream);
// The same kernel through cudaLaunchKernelExC and cudaLaunchCooperativeKernel. False when the launch failed.
bool launch_touch_runtime_ex(float* a, float* b, int n, void* stream);
bool launch_touch_cooperative(float* a, float* b, int n, void* stream);
// The same kernel through the driver (cuLaunchKernel, from cudaGetDriverEntryPointByVersion): with kernelParams
// when `extra` is false, else with a CU_LAUNCH_PARAM_BUFFER_POINTER buffer.
bool launch_touch_driver(float* a, float* b, int n, void* stream, bool extra);
// An empty kernel taking one pointer: the launch-bound loop of the overhead figure.
void launch_empty(float* a, void* stream);
void memset_async(void* p, std::size_t bytes, void* stream);
// cudaMemcpyAsync device to device.
void memcpy_async(void* dst, const void* src, std::size_t bytes, void* stream);
void synchronize();
// The kernel's mangled name (as CUPTI reports it), for checks.
const char* touch_kernel_name();

}  // namespace layerswap_test
