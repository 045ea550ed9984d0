// A thread that makes the driver calls of the residency engine, for bench/vmm_interference_probe.py: it maps an
// allocation at a VA of its own, sets the device's access and unmaps it (a remap), or queries or records an event
// (a move's polling and fences), again and again, busy for `duty` of the time, in the process's primary context
// (PyTorch's). No kernel touches that VA or waits for that event, so the calls can only cost the program's threads
// through the driver (its locks, its caches). Built by the probe with g++ on the GPU machine:
//   g++ -O2 -std=c++20 -shared -fPIC vmm_load.cpp -I/usr/local/cuda/include -lcuda -lpthread -o libvmm_load.so
#include <cuda.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>

namespace {

struct load_state {
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> rounds{0};
  std::atomic<std::uint64_t> busy_ns{0};
  int error = 0;
};

load_state* g_state = nullptr;

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// `mode`: 0 maps device memory, 1 host-located memory (map, set access, unmap: one round); 2 queries a completed
// event, 3 records an event on a stream of its own (one call a round). Rounds run back to back for at least
// 100 us, then the thread sleeps for (1 - duty) / duty of that time.
int run(load_state& s, int mode, std::size_t mib, double duty) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    return 1;
  }
  const bool host = mode == 1;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = host ? 0 : dev;
  std::size_t gran = 0;
  if (cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return 2;
  std::size_t size = mib << 20;
  size = (size + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle handle = 0;
  if (cuMemCreate(&handle, size, &prop, 0) != CUDA_SUCCESS) return 3;
  CUdeviceptr va = 0;
  if (cuMemAddressReserve(&va, size, 2 << 20, 0, 0) != CUDA_SUCCESS) return 4;
  CUstream stream = nullptr;
  CUevent event = nullptr;
  if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
      cuEventCreate(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS || cuEventRecord(event, stream) != CUDA_SUCCESS ||
      cuStreamSynchronize(stream) != CUDA_SUCCESS) {
    return 4;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  int error = 0;
  while (!s.stop.load(std::memory_order_relaxed) && error == 0) {
    const std::uint64_t t0 = now_ns();
    std::uint64_t rounds = 0;
    do {
      CUresult r = CUDA_SUCCESS;
      if (mode <= 1) {
        r = cuMemMap(va, size, 0, handle, 0);
        if (r == CUDA_SUCCESS) r = cuMemSetAccess(va, size, &access, 1);
        if (r == CUDA_SUCCESS) r = cuMemUnmap(va, size);
      } else if (mode == 2) {
        r = cuEventQuery(event);
      } else {
        r = cuEventRecord(event, stream);
      }
      if (r != CUDA_SUCCESS) error = 5;
      ++rounds;
    } while (error == 0 && now_ns() - t0 < 100'000);
    const std::uint64_t busy = now_ns() - t0;
    s.busy_ns.fetch_add(busy, std::memory_order_relaxed);
    s.rounds.fetch_add(rounds, std::memory_order_relaxed);
    if (duty < 1.0) {
      const auto idle = static_cast<std::uint64_t>(static_cast<double>(busy) * (1.0 - duty) / duty);
      std::this_thread::sleep_for(std::chrono::nanoseconds(idle));
    }
  }
  cuStreamSynchronize(stream);
  cuEventDestroy(event);
  cuStreamDestroy(stream);
  cuMemAddressFree(va, size);
  cuMemRelease(handle);
  return error;
}

}  // namespace

extern "C" {

// Starts the load in `mode` (run() above). Returns 0, or -1 when a load already runs.
int vmm_load_start(int mode, unsigned long long mib, double duty) {
  if (g_state != nullptr) return -1;
  g_state = new load_state();
  load_state* s = g_state;
  s->thread = std::thread([s, mode, mib, duty] {
    pthread_setname_np(pthread_self(), "layerswap-move");  // so the benchmark pins it where the engine's would be
    s->error = run(*s, mode, static_cast<std::size_t>(mib), duty);
  });
  return 0;
}

// Stops it; writes its rounds and busy seconds, returns its error (0: none; 1-4: setup; 5: a VMM call failed).
int vmm_load_stop(unsigned long long* rounds, double* busy_s) {
  if (g_state == nullptr) return -1;
  g_state->stop.store(true);
  g_state->thread.join();
  *rounds = g_state->rounds.load();
  *busy_s = static_cast<double>(g_state->busy_ns.load()) * 1e-9;
  const int error = g_state->error;
  delete g_state;
  g_state = nullptr;
  return error;
}
}
