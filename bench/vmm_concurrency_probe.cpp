// Does the driver run two threads' VMM remaps side by side, or one after the other?
//
// The residency engine remaps an evicted region to its host copy (unmap the chunk, map the host pages, set access:
// 8-13 us per MiB, bench/results/vmm_host_probe.json) and a landed prefetch to its chunk (unmap the host pages, map
// the chunk, set access: a few us per MiB) on one thread, so a prefetch that a launch waits for can land behind a
// few host remaps (`late_remap_wait_s`). A second thread for the host remaps helps only if the driver does not
// serialize them with the device remaps. This probe times thread B's remaps of a region between two device chunks,
// and its remaps of a region from host pages to a chunk (a prefetch's remap), alone and while thread A remaps other
// regions between chunks and host pages as an eviction-heavy engine does, without pause.
//
//   g++ -O2 -std=c++20 vmm_concurrency_probe.cpp -I/usr/local/cuda/include -lcuda -lpthread -o vmm_concurrency_probe
//   ./vmm_concurrency_probe [MiB=22] [seconds per row=2]
//
// Rows "... turns": B announces each remap (an atomic count, raised before its first call and lowered after its
// last) and A, before each of its calls, waits while the count is raised: the program's calls go first, and wait
// for at most the one call A has in the driver.
//
// Prints one JSON object: per row, B's latency percentiles (us) and A's remaps per second.
//
// On the H200 (session 30, bench/results/vmm_concurrency_s30.json) the driver runs them one after the other, and a
// thread making calls back to back keeps the driver: B's 22 MiB device remap took 36-47 us alone and 4-23 ms on
// average beside A (p50 0.3-11.6 ms, p99 46-120 ms); with turns, 182-210 us on average (p99 0.36-0.42 ms), while A
// kept 70-100% of its rate. So a second engine thread for the host remaps would not speed the prefetches' remaps; the
// turns became Note [Program first] (runtime/driver_calls.hpp), for the program's own VMM calls.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

#define CHECK(call)                                                                 \
  do {                                                                              \
    CUresult rc_ = (call);                                                          \
    if (rc_ != CUDA_SUCCESS) {                                                      \
      std::fprintf(stderr, "%s failed: %d (line %d)\n", #call, int(rc_), __LINE__); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

CUmemGenericAllocationHandle make(std::size_t bytes, bool host) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle h{};
  CHECK(cuMemCreate(&h, bytes, &prop, 0));
  return h;
}

void set_access(CUdeviceptr va, std::size_t bytes) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK(cuMemSetAccess(va, bytes, &access, 1));
}

void map_access(CUdeviceptr va, std::size_t bytes, CUmemGenericAllocationHandle h) {
  CHECK(cuMemMap(va, bytes, 0, h, 0));
  set_access(va, bytes);
}

struct region {
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle dev = 0, dev2 = 0, host = 0;
};

region make_region(std::size_t bytes, bool with_host, bool with_second) {
  region r;
  CHECK(cuMemAddressReserve(&r.va, bytes, 0, 0, 0));
  r.dev = make(bytes, false);
  if (with_second) r.dev2 = make(bytes, false);
  if (with_host) r.host = make(bytes, true);
  map_access(r.va, bytes, r.dev);
  return r;
}

struct percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
  std::size_t n = 0;
};

percentiles summarize(std::vector<double> v) {
  percentiles p;
  p.n = v.size();
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  const auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<std::size_t>(q * v.size()))]; };
  p.p50 = at(0.5), p.p90 = at(0.9), p.p99 = at(0.99);
  double s = 0;
  for (double x : v) s += x;
  p.mean = s / v.size();
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 22;
  const double seconds = argc > 2 ? std::strtod(argv[2], nullptr) : 2.0;
  const std::size_t bytes = mib << 20;
  CHECK(cuInit(0));
  CUdevice dev;
  CHECK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));
  char name[128] = {};
  CHECK(cuDeviceGetName(name, sizeof name, dev));

  // B's regions: one between two chunks (device remaps), one between host pages and a chunk (a prefetch's remap).
  region b_dev = make_region(bytes, false, true);
  region b_host = make_region(bytes, true, false);
  // A's regions, evicted and brought back in turn.
  std::vector<region> a_regions;
  for (int i = 0; i < 4; ++i) a_regions.push_back(make_region(bytes, true, false));

  std::atomic<bool> a_run{false}, a_stop{false};
  std::atomic<int> b_in{0};  // B's remaps in progress (rows with turns)
  std::atomic<bool> turns{false};
  const auto a_turn = [&] {
    if (!turns.load(std::memory_order_relaxed)) return;
    while (b_in.load() != 0) std::this_thread::yield();
  };
  std::atomic<std::uint64_t> a_ops{0};
  std::atomic<double> a_busy_us{0};
  std::thread a([&] {
    CHECK(cuCtxSetCurrent(ctx));
    std::size_t i = 0;
    bool on_host[4] = {};
    while (!a_stop.load()) {
      if (!a_run.load()) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      region& r = a_regions[i % a_regions.size()];
      bool& h = on_host[i % a_regions.size()];
      const double t0 = now_us();
      a_turn();
      CHECK(cuMemUnmap(r.va, bytes));
      a_turn();
      CHECK(cuMemMap(r.va, bytes, 0, h ? r.dev : r.host, 0));
      a_turn();
      set_access(r.va, bytes);
      h = !h;
      a_busy_us.store(a_busy_us.load() + (now_us() - t0));
      a_ops.fetch_add(1);
      ++i;
    }
  });

  // One row: B remaps for `seconds`, with A running or not.
  std::string rows;
  auto row = [&](const char* kind, bool with_a, bool with_turns) {
    turns = with_turns;
    a_ops = 0;
    a_busy_us = 0;
    a_run = with_a;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<double> lat;
    const bool host_kind = std::string(kind) == "prefetch";
    bool second = false;
    const double end = now_us() + seconds * 1e6;
    const double a_from = now_us();
    const std::uint64_t a_ops0 = a_ops.load();
    while (now_us() < end) {
      if (host_kind) {
        // host pages -> chunk, timed (a prefetch's remap); then back to the host pages, untimed
        const double t0 = now_us();
        b_in.fetch_add(1);
        CHECK(cuMemUnmap(b_host.va, bytes));
        map_access(b_host.va, bytes, b_host.dev);
        b_in.fetch_sub(1);
        lat.push_back(now_us() - t0);
        CHECK(cuMemUnmap(b_host.va, bytes));
        map_access(b_host.va, bytes, b_host.host);
      } else {
        const double t0 = now_us();
        b_in.fetch_add(1);
        CHECK(cuMemUnmap(b_dev.va, bytes));
        map_access(b_dev.va, bytes, second ? b_dev.dev : b_dev.dev2);
        b_in.fetch_sub(1);
        second = !second;
        lat.push_back(now_us() - t0);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));  // B is not the busy one
    }
    const double a_window_s = (now_us() - a_from) / 1e6;
    const double a_rate = (a_ops.load() - a_ops0) / a_window_s;
    a_run = false;
    const percentiles p = summarize(lat);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s{\"b\": \"%s\", \"with_a\": %s, \"turns\": %s, \"n\": %zu, \"p50_us\": %.1f, "
                  "\"p90_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"a_remaps_per_s\": %.0f, "
                  "\"a_busy_share\": %.3f}",
                  rows.empty() ? "" : ",\n  ", kind, with_a ? "true" : "false", with_turns ? "true" : "false", p.n,
                  p.p50, p.p90, p.p99, p.mean, a_rate, a_busy_us.load() / 1e6 / a_window_s);
    rows += buf;
  };
  // A alone, for its own rate: B idle.
  a_ops = 0;
  a_busy_us = 0;
  a_run = true;
  const double t0 = now_us();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double a_alone_rate = a_ops.load() / ((now_us() - t0) / 1e6);
  a_run = false;
  for (int rep = 0; rep < 2; ++rep) {
    row("device", false, false);
    row("device", true, false);
    row("device", true, true);
    row("prefetch", false, false);
    row("prefetch", true, false);
    row("prefetch", true, true);
  }
  a_stop = true;
  a.join();
  std::printf("{\"device\": \"%s\", \"mib\": %zu, \"a_alone_remaps_per_s\": %.0f, \"rows\": [\n  %s]}\n", name, mib,
              a_alone_rate, rows.c_str());
  return 0;
}
