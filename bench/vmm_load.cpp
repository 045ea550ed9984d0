// A thread that makes the driver calls of the residency engine, for bench/vmm_interference_probe.py: it maps an
// allocation at a VA of its own, sets the device's access and unmaps it (a remap), or queries or records an event
// (a move's polling and fences), again and again, busy for `duty` of the time, in the process's primary context
// (PyTorch's), or for the remaps in a context of its own (modes 4 and 5: is what the launches wait for the
// context's or the device's?), in a green context made from the device's SMs (modes 6 and 7: the lighter kind),
// or with no context current at all (modes 8 and 9: the VMM calls name no context). vmm_engine_load_start() runs
// the engine's own pattern instead: several regions evicted to host pages and prefetched back at a set rate, per
// region or over their span, with or without the prefetches' copies (run_engine).
// No kernel touches that VA or waits for that event, so the calls can only cost the program's threads through the
// driver (its locks, its caches). vmm_cross_context_check() says whether a mapping made in a context of its own (or
// a green one, or with none current) serves the primary context. For bench/vmm_ipi_probe.py, vmm_spin() does one
// kind of work on a pinned thread (what does the load take from it?) and vmm_maps_step() walks one allocation through
// its life so that the caller can read /proc/self/maps between the steps. Built by the probes with g++ on the GPU
// machine:
//   g++ -O2 -std=c++20 -shared -fPIC vmm_load.cpp -I/usr/local/cuda/include -lcuda -lpthread -o libvmm_load.so
#include <cuda.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

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

// A green context over all of the device's SMs (none set apart: it is made for driver calls, not kernels), and the
// CUcontext that stands for it.
int make_green(CUdevice dev, CUgreenCtx* green, CUcontext* ctx) {
  CUdevResource sms{};
  CUdevResourceDesc desc = nullptr;
  if (cuDeviceGetDevResource(dev, &sms, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS ||
      cuDevResourceGenerateDesc(&desc, &sms, 1) != CUDA_SUCCESS ||
      cuGreenCtxCreate(green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM) != CUDA_SUCCESS ||
      cuCtxFromGreenCtx(ctx, *green) != CUDA_SUCCESS) {
    return 1;
  }
  return 0;
}

// `mode`: 0 maps device memory, 1 host-located memory (map, set access, unmap: one round); 2 queries a completed
// event, 3 records an event on a stream of its own (one call a round); 4 and 5 are 0 and 1 in a context the
// thread creates (not the primary one), 6 and 7 in a green context the thread creates, 8 and 9 with no context
// current (the setup in the primary one, then cuCtxSetCurrent(nullptr)). Rounds run back to back for
// at least 100 us, then the thread sleeps for (1 - duty) / duty of that time.
int run(load_state& s, int mode, std::size_t mib, double duty) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUgreenCtx green = nullptr;
  const bool own = mode == 4 || mode == 5;
  const bool none = mode == 8 || mode == 9;
  const bool is_green = mode == 6 || mode == 7;
  if (own) mode -= 4;
  if (is_green) mode -= 6;
  if (none) mode -= 8;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS) return 1;
  if (is_green) {
    if (make_green(dev, &green, &ctx) != 0 || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return 1;
  } else if (own ? cuCtxCreate(&ctx, nullptr, 0, dev) != CUDA_SUCCESS
                 : (cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS)) {
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
  if (none && cuCtxSetCurrent(nullptr) != CUDA_SUCCESS) return 4;
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
  if (none) cuCtxSetCurrent(ctx);
  cuStreamSynchronize(stream);
  cuEventDestroy(event);
  cuStreamDestroy(stream);
  cuMemAddressFree(va, size);
  cuMemRelease(handle);
  if (own) cuCtxDestroy(ctx);
  if (is_green) cuGreenCtxDestroy(green);
  return error;
}

// The engine's pattern at a set rate: `k` regions of `mib` side by side in one VA span, each with a device and a
// host-located allocation of its own. A round evicts all k (their VAs remapped to their host pages) and then
// prefetches them back (remapped to their device pages), `gbps` GB a second each way (the engine's 25% LoRA step:
// ~3.7 GB each way in ~0.17 s, ~22 GB/s). Per region (`span` false): unmap, map, set access, one region after
// another, as the engine does. As a span (`span` true): one unmap over the k mappings, k maps, one set access over
// them. Same bytes, a third of the calls: is what the launches pay per call or per byte? With `copies`, an H2D copy
// of the round's bytes too (or alone, without `remaps`): what the link's traffic costs beside. With `to_host` false the
// "evictions" map a second device allocation instead (a device remap's price, for comparison). `unmap_span` alone:
// one unmap over the span, a map and a set access per region; `access_span` alone: an unmap and a map per region,
// one set access over the span.
struct engine_pattern {
  bool remaps = true;        // evict and prefetch by remapping
  bool span = false;         // one unmap and one set access over the k regions
  bool unmap_span = false;   // one unmap over them, the rest per region
  bool access_span = false;  // one set access over them, the rest per region
  bool to_host = true;       // evictions map host pages (else a second device allocation)
  bool copies = false;       // an H2D copy of the round's bytes on a stream of its own (the prefetches' traffic)
};

int run_engine(load_state& s, const engine_pattern& p, std::size_t mib, std::size_t k, double gbps) {
  const bool span = p.span;
  const bool to_host = p.to_host;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    return 1;
  }
  const std::size_t size = mib << 20;  // a multiple of 2 MiB: the probe asks for even MiB
  std::vector<CUmemGenericAllocationHandle> device(k), host(k);
  for (std::size_t i = 0; i < k; ++i) {
    for (int where = 0; where < 2; ++where) {
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      const bool on_host = where == 1 && to_host;
      prop.location.type = on_host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = on_host ? 0 : dev;
      if (cuMemCreate(where ? &host[i] : &device[i], size, &prop, 0) != CUDA_SUCCESS) return 3;
    }
  }
  CUdeviceptr va = 0;
  if (cuMemAddressReserve(&va, size * k, 2 << 20, 0, 0) != CUDA_SUCCESS) return 4;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const bool span_unmap = span || p.unmap_span;
  const bool span_access = span || p.access_span;
  auto place = [&](const std::vector<CUmemGenericAllocationHandle>& on, bool unmap_first) {
    CUresult r = CUDA_SUCCESS;
    if (unmap_first && span_unmap) r = cuMemUnmap(va, size * k);
    for (std::size_t i = 0; i < k && r == CUDA_SUCCESS; ++i) {
      if (unmap_first && !span_unmap) r = cuMemUnmap(va + i * size, size);
      if (r == CUDA_SUCCESS) r = cuMemMap(va + i * size, size, 0, on[i], 0);
      if (r == CUDA_SUCCESS && !span_access) r = cuMemSetAccess(va + i * size, size, &access, 1);
    }
    if (r == CUDA_SUCCESS && span_access) r = cuMemSetAccess(va, size * k, &access, 1);
    return r;
  };
  int error = place(device, false) == CUDA_SUCCESS ? 0 : 5;
  void* pinned = nullptr;
  CUdeviceptr target = 0;
  CUstream stream = nullptr;
  CUevent copied = nullptr;
  if (p.copies && (cuMemAllocHost(&pinned, size * k) != CUDA_SUCCESS || cuMemAlloc(&target, size * k) != CUDA_SUCCESS ||
                   cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
                   cuEventCreate(&copied, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)) {
    error = 4;
  }
  const double period_ns = static_cast<double>(size * k) / gbps;  // a round's bytes each way, at gbps GB/s
  std::uint64_t next = now_ns();
  while (!s.stop.load(std::memory_order_relaxed) && error == 0) {
    if (p.copies) {  // the previous round's copy first (not counted as busy): no queue growing behind the link
      if (cuEventSynchronize(copied) != CUDA_SUCCESS ||
          cuMemcpyHtoDAsync(target, pinned, size * k, stream) != CUDA_SUCCESS ||
          cuEventRecord(copied, stream) != CUDA_SUCCESS) {
        error = 5;
      }
    }
    const std::uint64_t t0 = now_ns();
    if (p.remaps && (place(host, true) != CUDA_SUCCESS || place(device, true) != CUDA_SUCCESS)) error = 5;
    s.busy_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    s.rounds.fetch_add(1, std::memory_order_relaxed);
    next += static_cast<std::uint64_t>(period_ns);
    const std::uint64_t now = now_ns();
    if (next > now) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(next - now));
    } else {
      next = now;  // behind: no catching up in a burst
    }
  }
  if (p.copies) {
    if (stream != nullptr) cuStreamSynchronize(stream);
    if (copied != nullptr) cuEventDestroy(copied);
    if (stream != nullptr) cuStreamDestroy(stream);
    if (target != 0) cuMemFree(target);
    if (pinned != nullptr) cuMemFreeHost(pinned);
  }
  cuMemUnmap(va, size * k);
  cuMemAddressFree(va, size * k);
  for (std::size_t i = 0; i < k; ++i) {
    cuMemRelease(device[i]);
    cuMemRelease(host[i]);
  }
  return error;
}

// Maps device memory and host-located memory at VAs of their own from a context created here (a green one when
// `green`; with `none`, no context current at all), then, in the primary context (current on the calling thread),
// fills each through its VA with cuMemsetD32 and reads it back.
// Returns 0 when both read back right; 10+ a setup failure, 20+ a wrong read; writes the device memory the
// context took (cuMemGetInfo's free before and after it was made and used) to *ctx_bytes.
int check_cross_context(long long* ctx_bytes, bool green, bool none) {
  CUdevice dev = 0;
  CUcontext primary = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS || cuCtxSetCurrent(primary) != CUDA_SUCCESS) {
    return 10;
  }
  std::size_t free0 = 0, free1 = 0, total = 0;
  cuMemGetInfo(&free0, &total);
  CUcontext own = nullptr;
  CUgreenCtx green_ctx = nullptr;
  if (none) {
    if (cuCtxSetCurrent(nullptr) != CUDA_SUCCESS) return 11;
  } else if (green ? make_green(dev, &green_ctx, &own) != 0 || cuCtxSetCurrent(own) != CUDA_SUCCESS
            : cuCtxCreate(&own, nullptr, 0, dev) != CUDA_SUCCESS) {  // now current
    return 11;
  }
  constexpr std::size_t size = 4 << 20;
  CUmemGenericAllocationHandle handles[2] = {0, 0};
  CUdeviceptr vas[2] = {0, 0};
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (int i = 0; i < 2; ++i) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = i == 1 ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = i == 1 ? 0 : dev;
    if (cuMemCreate(&handles[i], size, &prop, 0) != CUDA_SUCCESS) return 12;
    if (cuMemAddressReserve(&vas[i], size, 2 << 20, 0, 0) != CUDA_SUCCESS) return 13;
    if (cuMemMap(vas[i], size, 0, handles[i], 0) != CUDA_SUCCESS) return 14;
    if (cuMemSetAccess(vas[i], size, &access, 1) != CUDA_SUCCESS) return 15;
  }
  if (!none) cuCtxSynchronize();
  if (!green && !none) {
    CUcontext popped = nullptr;
    cuCtxPopCurrent(&popped);
  }
  cuCtxSetCurrent(primary);
  cuMemGetInfo(&free1, &total);
  *ctx_bytes = static_cast<long long>(free0) - static_cast<long long>(free1) - static_cast<long long>(size);
  int result = 0;
  static std::uint32_t back[size / 4];
  for (int i = 0; i < 2 && result == 0; ++i) {
    const std::uint32_t value = 0x5a5a0000u + static_cast<std::uint32_t>(i);
    if (cuMemsetD32(vas[i], value, size / 4) != CUDA_SUCCESS || cuCtxSynchronize() != CUDA_SUCCESS ||
        cuMemcpyDtoH(back, vas[i], size) != CUDA_SUCCESS) {
      result = 20 + i;
      break;
    }
    for (std::size_t k = 0; k < size / 4; ++k) {
      if (back[k] != value) {
        result = 22 + i;
        break;
      }
    }
  }
  for (int i = 0; i < 2; ++i) {
    cuMemUnmap(vas[i], size);
    cuMemAddressFree(vas[i], size);
    cuMemRelease(handles[i]);
  }
  if (green) {
    cuGreenCtxDestroy(green_ctx);
  } else if (!none) {
    cuCtxDestroy(own);
  }
  cuCtxSetCurrent(primary);
  return result;
}

// The spinner's work (vmm_spin): what kind of progress does a load on another core take from a thread?
//   0 integer arithmetic in registers (the core's speed alone);
//   1 a dependent walk over a 256 MiB buffer in 4 KiB pages (transparent huge pages refused), one page a step in a
//     random order: nearly every step misses the TLB, so TLB flushes sent to this core cost it directly;
//   2 the same walk over 16 pages (cache- and TLB-resident);
//   3 cuMemsetD32Async of one word on a stream of its own, synchronized every 256: the driver's submission path,
//     as a kernel launch takes it;
//   4 page faults: 16 MiB mapped, each 4 KiB page touched, unmapped, again (the process's mmap lock);
//   5 a token handed back and forth with a second thread (pinned two cores up) through a condition variable: the
//     wake-ups between threads, as the Python and autograd threads hand work to each other.
double spin(int kind, double seconds, int partner_cpu) {
  const auto deadline = now_ns() + static_cast<std::uint64_t>(seconds * 1e9);
  std::uint64_t units = 0;
  if (kind == 0) {
    std::uint64_t x = 88172645463325252ull;
    while (now_ns() < deadline) {
      for (int i = 0; i < 4096; ++i) {  // xorshift: dependent, no memory
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
      }
      units += 4096;
    }
    return x == 0 ? -1.0 : static_cast<double>(units);
  }
  if (kind == 1 || kind == 2) {
    const std::size_t pages = kind == 1 ? (256u << 20) / 4096 : 16;
    void* mem = mmap(nullptr, pages * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return -1.0;
    madvise(mem, pages * 4096, MADV_NOHUGEPAGE);
    auto* words = static_cast<std::uint32_t*>(mem);
    std::vector<std::uint32_t> order(pages);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin() + 1, order.end(), std::mt19937(7));
    for (std::size_t i = 0; i < pages; ++i) words[order[i] * 1024] = order[(i + 1) % pages];  // one cycle
    std::uint32_t at = 0;
    while (now_ns() < deadline) {
      for (int i = 0; i < 1024; ++i) at = words[static_cast<std::size_t>(at) * 1024];
      units += 1024;
    }
    munmap(mem, pages * 4096);
    return at == 0xffffffffu ? -1.0 : static_cast<double>(units);
  }
  if (kind == 4) {
    while (now_ns() < deadline) {
      constexpr std::size_t bytes = 16u << 20;
      void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) return -1.0;
      madvise(mem, bytes, MADV_NOHUGEPAGE);
      for (std::size_t at = 0; at < bytes; at += 4096) static_cast<volatile char*>(mem)[at] = 1;
      munmap(mem, bytes);
      units += bytes / 4096;
    }
    return static_cast<double>(units);
  }
  if (kind == 5) {  // two threads hand a token back and forth through a condition variable
    std::mutex mu;
    std::condition_variable cv;
    int turn = 0;
    bool done = false;
    std::thread other([&] {
      if (partner_cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(partner_cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      }
      std::unique_lock lock(mu);
      for (;;) {
        cv.wait(lock, [&] { return turn == 1 || done; });
        if (done) return;
        turn = 0;
        cv.notify_all();
      }
    });
    {
      std::unique_lock lock(mu);
      while (now_ns() < deadline) {
        turn = 1;
        cv.notify_all();
        cv.wait(lock, [&] { return turn == 0; });
        ++units;
      }
      done = true;
      cv.notify_all();
    }
    other.join();
    return static_cast<double>(units);
  }
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    return -1.0;
  }
  CUstream stream = nullptr;
  CUdeviceptr word = 0;
  if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS || cuMemAlloc(&word, 4) != CUDA_SUCCESS) {
    return -1.0;
  }
  while (now_ns() < deadline) {
    for (int i = 0; i < 256; ++i) {
      if (cuMemsetD32Async(word, static_cast<unsigned>(i), 1, stream) != CUDA_SUCCESS) return -1.0;
    }
    if (cuStreamSynchronize(stream) != CUDA_SUCCESS) return -1.0;
    units += 256;
  }
  cuMemFree(word);
  cuStreamDestroy(stream);
  return static_cast<double>(units);
}

// One allocation's life at a VA of its own, a step at a time, so that the caller can read /proc/self/maps between
// the steps: 0 creates it (host-located when `host`) and reserves a VA (written to *va), 1 maps it and grants the
// device access, 2 unmaps it, 3 frees it all.
struct maps_probe {
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
  std::size_t size = 64u << 20;
} g_maps;

int maps_step(int step, bool host, unsigned long long* va) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    return 1;
  }
  CUresult r = CUDA_SUCCESS;
  if (step == 0) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = host ? 0 : dev;
    r = cuMemCreate(&g_maps.handle, g_maps.size, &prop, 0);
    if (r == CUDA_SUCCESS) r = cuMemAddressReserve(&g_maps.va, g_maps.size, 2 << 20, 0, 0);
  } else if (step == 1) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = cuMemMap(g_maps.va, g_maps.size, 0, g_maps.handle, 0);
    if (r == CUDA_SUCCESS) r = cuMemSetAccess(g_maps.va, g_maps.size, &access, 1);
  } else if (step == 2) {
    r = cuMemUnmap(g_maps.va, g_maps.size);
  } else {
    r = cuMemAddressFree(g_maps.va, g_maps.size);
    if (r == CUDA_SUCCESS) r = cuMemRelease(g_maps.handle);
  }
  *va = g_maps.va;
  return static_cast<int>(r);
}

}  // namespace

extern "C" {

// Spins on the calling thread (pinned to `cpu` first, when >= 0) for `seconds` doing `kind` work (spin() above);
// returns the units of work done, or -1 on a failure.
double vmm_spin(int cpu, double seconds, int kind) {
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) return -1.0;
  }
  return spin(kind, seconds, cpu >= 0 ? cpu + 2 : -1);
}

// maps_step() above; returns 0 or the failing call's CUresult.
int vmm_maps_step(int step, int host, unsigned long long* va) { return maps_step(step, host != 0, va); }


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

// Starts the engine-pattern load (run_engine() above; `gbps` > 0): `kind` 0 per region, 1 as a span, 2 per region
// with device memory in place of the host's, 3 one unmap over the span, 4 one set access over the span, 5 the H2D
// copies alone (no remap), 6 per region and the copies. Returns 0, or -1 when a load already runs.
int vmm_engine_load_start(int kind, unsigned long long mib, unsigned long long k, double gbps) {
  if (g_state != nullptr) return -1;
  g_state = new load_state();
  load_state* s = g_state;
  s->thread = std::thread([s, kind, mib, k, gbps] {
    pthread_setname_np(pthread_self(), "layerswap-move");
    engine_pattern p;
    p.remaps = kind != 5;
    p.span = kind == 1;
    p.unmap_span = kind == 3;
    p.access_span = kind == 4;
    p.to_host = kind != 2;
    p.copies = kind == 5 || kind == 6;
    s->error = run_engine(*s, p, static_cast<std::size_t>(mib), static_cast<std::size_t>(k), gbps);
  });
  return 0;
}

// `kind`: 0 a context of its own, 1 a green one, 2 none current.
int vmm_cross_context_check(long long* ctx_bytes, int kind) {
  return check_cross_context(ctx_bytes, kind == 1, kind == 2);
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
