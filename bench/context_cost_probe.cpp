// How much device memory a second CUDA context costs a process, and how much of it the context's limits give back
// (stack, printf FIFO, malloc heap set low), before and after a VMM cycle (host-located memory mapped, access
// granted) made in it; then the same for a green context. For the question in docs/history.md (sessions 17 and 18):
// would a context of the migration thread's own, for its VMM calls, be affordable? Build and run on a GPU machine:
//   g++ -O2 -std=c++20 bench/context_cost_probe.cpp -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs
//       -lcuda -o /tmp/context_cost_probe && /tmp/context_cost_probe
// On the H200 (driver 580.159): 523.6 MiB per context, 263.6 MiB with the limits low, nothing more after the cycle;
// a green context over all the SMs (it shares the primary context's memory) 6.0 MiB.
#include <cuda.h>

#include <cstdio>

namespace {

bool ok(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  std::fprintf(stderr, "%s failed: %d\n", what, static_cast<int>(r));
  return false;
}

double mib(std::size_t before, std::size_t after) {
  return static_cast<double>(before - after) / (1024.0 * 1024.0);
}

// A VMM cycle in the current context: host-located memory created, mapped, given the device's access, and gone.
bool cycle(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
  prop.location.id = 0;
  constexpr std::size_t size = 4 << 20;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!ok(cuMemCreate(&handle, size, &prop, 0), "cuMemCreate") ||
      !ok(cuMemAddressReserve(&va, size, 2 << 20, 0, 0), "cuMemAddressReserve") ||
      !ok(cuMemMap(va, size, 0, handle, 0), "cuMemMap") ||
      !ok(cuMemSetAccess(va, size, &access, 1), "cuMemSetAccess")) {
    return false;
  }
  cuMemUnmap(va, size);
  cuMemAddressFree(va, size);
  cuMemRelease(handle);
  return true;
}

}  // namespace

int main() {
  CUdevice dev = 0;
  CUcontext primary = nullptr;
  if (!ok(cuInit(0), "cuInit") || !ok(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
      !ok(cuDevicePrimaryCtxRetain(&primary, dev), "cuDevicePrimaryCtxRetain") ||
      !ok(cuCtxSetCurrent(primary), "cuCtxSetCurrent")) {
    return 1;
  }
  CUdeviceptr warm = 0;  // the primary context fully up before anything is counted
  if (!ok(cuMemAlloc(&warm, 1 << 20), "cuMemAlloc")) return 1;
  for (int limits = 0; limits < 2; ++limits) {
    std::size_t before = 0, created = 0, limited = 0, cycled = 0, total = 0;
    cuMemGetInfo(&before, &total);
    CUcontext own = nullptr;
    if (!ok(cuCtxCreate(&own, nullptr, 0, dev), "cuCtxCreate")) return 1;  // now current
    cuMemGetInfo(&created, &total);
    if (limits) {
      cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 16);
      cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 4096);
      cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 4096);
    }
    cuMemGetInfo(&limited, &total);
    if (!cycle(dev)) return 1;
    cuMemGetInfo(&cycled, &total);
    std::printf("limits %s: the context took %.1f MiB when made, %.1f MiB with its limits set, %.1f MiB after a "
                "VMM cycle\n",
                limits ? "low" : "default", mib(before, created), mib(before, limited), mib(before, cycled));
    cuCtxDestroy(own);
    cuCtxSetCurrent(primary);
  }
  {  // a green context over all the SMs (bench/vmm_load.cpp, make_green): it shares the primary context's memory
    std::size_t before = 0, created = 0, cycled = 0, total = 0;
    cuMemGetInfo(&before, &total);
    CUdevResource sms{};
    CUdevResourceDesc desc = nullptr;
    CUgreenCtx green = nullptr;
    CUcontext ctx = nullptr;
    if (!ok(cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource") ||
        !ok(cuDevResourceGenerateDesc(&desc, &sms, 1), "cuDevResourceGenerateDesc") ||
        !ok(cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate") ||
        !ok(cuCtxFromGreenCtx(&ctx, green), "cuCtxFromGreenCtx") || !ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent")) {
      return 1;
    }
    cuMemGetInfo(&created, &total);
    if (!cycle(dev)) return 1;
    cuMemGetInfo(&cycled, &total);
    std::printf("green context: %.1f MiB when made, %.1f MiB after a VMM cycle\n", mib(before, created),
                mib(before, cycled));
    cuCtxSetCurrent(primary);
    cuGreenCtxDestroy(green);
  }
  cuMemFree(warm);
  return 0;
}
