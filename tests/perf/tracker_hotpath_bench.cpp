// Micro benchmark of the launch callback's own work, without a GPU or CUPTI: the code the callback runs
// (profiler/launch_recorder.hpp: decode, residency gate, access event) on a synthetic PyTorch-like launch.
// Not a test (nothing is asserted, CI does not run it): built as layerswap_tracker_bench, run by hand:
//
//     layerswap_tracker_bench [launches]
//
// A synthetic runtime launch looks like at::native's vectorized_elementwise_kernel<4, add, array<char*, 2>>:
// an int, a float functor and two pointers into one region. Each "callback" below is a noinline function that
// does what cupti_tracker.cpp's on_callback does for that callback (one TLS lookup, the generation check, the
// nesting filter, the gate frame), so that a launch costs what it costs in the process:
//   both:   runtime enter (decode + record), nested driver enter (skipped, counted), nested driver exit
//           (skipped), runtime exit (gate close): LAYERSWAP_TRACK_API=both
//   driver: driver enter (decode + record), driver exit (gate close): LAYERSWAP_TRACK_API=driver
// Each figure is measured hot (the same launch in a tight loop, the C++ benchmark's situation) and cold (a walk
// over a buffer between launches evicts the callback's code and data from the caches, as PyTorch's dispatcher
// and Python do between two launches; the walk's own time is measured alone and subtracted). The consumer
// thread runs, as in production. Medians of several runs; ns per launch.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/launch_recorder.hpp"
#include "profiler/tracker_core.hpp"

using namespace layerswap;
using namespace layerswap::profiler;

namespace {

constexpr std::uint64_t k_base = std::uint64_t{0x7f12} << 32;  // a plausible device address, 2 MiB-aligned
constexpr unsigned k_shift = 21;

// The synthetic kernel's layout: int n, a float functor, array<char*, 2>.
constexpr param_slot k_layout[] = {{0, 4}, {8, 4}, {16, 16}};

query_status query(void*, std::uint64_t, std::uint32_t index, param_slot& out) noexcept {
  if (index >= std::size(k_layout)) return query_status::end;
  out = k_layout[index];
  return query_status::ok;
}

tracker_core* g_core = nullptr;
std::atomic<std::uint32_t> g_generation{1};

struct launch_args {
  int n = 16;
  float alpha = 1;
  std::uint64_t data[2] = {k_base + 4096, k_base + 8192};
  void* args[3] = {&n, &alpha, &data};
};
launch_args g_args;

enum class domain { runtime, driver };
enum class site { enter, exit };

// cupti_tracker.cpp's on_callback, minus CUPTI: the same per-callback work for a kernel launch.
__attribute__((noinline)) void callback(domain d, site s) noexcept {
  tracker_core* core = g_core;
  if (core == nullptr) return;
  thread_scratch& t = this_thread_scratch();
  const std::uint32_t generation = g_generation.load(std::memory_order_relaxed);
  if (t.generation != generation) {
    t.generation = generation;
    t.nesting = launch_nesting{};
    t.gate.close_all();
  }
  if (d == domain::runtime) {
    if (s == site::exit) {
      t.gate.close();
      t.nesting.runtime_exit();
      return;
    }
    t.nesting.runtime_enter();
    t.gate.open();
    record_kernel(*core, t, query, 0x5000, "vectorized_elementwise_kernel", 0, g_args.args, nullptr);
  } else {
    if (t.nesting.driver_is_nested()) {
      if (s == site::enter) core->count_nested();
      return;
    }
    if (s == site::exit) {
      t.gate.close();
      return;
    }
    t.gate.open();
    record_kernel(*core, t, query, 0x6000, "vectorized_elementwise_kernel", 0, g_args.args, nullptr);
  }
}

void launch_both() {
  callback(domain::runtime, site::enter);
  callback(domain::driver, site::enter);
  callback(domain::driver, site::exit);
  callback(domain::runtime, site::exit);
}

void launch_driver() {
  callback(domain::driver, site::enter);
  callback(domain::driver, site::exit);
}

std::vector<unsigned char> g_evict;
__attribute__((noinline)) void evict() {
  for (std::size_t i = 0; i < g_evict.size(); i += 64) g_evict[i] = static_cast<unsigned char>(g_evict[i] + 1);
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class Fn>
double ns_per(Fn&& fn, int n) {
  const double t0 = seconds_now();
  for (int i = 0; i < n; ++i) fn();
  return (seconds_now() - t0) / n * 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over `runs` of fn's ns per call, `n` calls a run. The ring is drained between runs (untimed) so that
// no event is dropped: a dropped event would skip the writes that a real launch pays for.
template <class Fn>
double median_ns(Fn&& fn, int n, int runs = 15) {
  std::vector<double> v;
  for (int r = 0; r < runs; ++r) {
    g_core->consume();
    v.push_back(ns_per(fn, n));
  }
  return median(v);
}

// fn's cost with the caches evicted before each call: the median of per-call times (evict, then time fn alone),
// less the median time of an empty call timed the same way (the clock's own cost).
template <class Fn>
double cold_ns(Fn&& fn, int n) {
  std::vector<double> with, alone;
  with.reserve(n);
  alone.reserve(n);
  for (int i = 0; i < n; ++i) {
    if (i % 4096 == 0) g_core->consume();
    evict();
    const double t0 = seconds_now();
    fn();
    const double t1 = seconds_now();
    evict();
    const double t2 = seconds_now();
    const double t3 = seconds_now();
    with.push_back(t1 - t0);
    alone.push_back(t3 - t2);
  }
  return (median(with) - median(alone)) * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 20'000;  // launches per timed run (fits the ring)
  const int n_cold = argc > 2 ? std::atoi(argv[2]) : 2'000;

  // One arena of 64 granules; the launch's two pointers land in region 1 (granule 0).
  const int slot = region_map::register_arena(k_base, std::size_t{64} << k_shift, k_shift);
  for (std::size_t g = 0; g < 64; ++g) {
    const region_id id = region_map::next_region_id();
    residency_gate::prepare(id);
    region_map::publish(slot, g, 1, id);
  }
  residency_gate::set_fed(true);

  tracker_core core;
  core.start_consumer();
  g_core = &core;

  for (int i = 0; i < 1000; ++i) launch_both();  // fill the layout cache
  for (int i = 0; i < 1000; ++i) launch_driver();

  region_set one;
  one.add(1);
  volatile std::uint64_t sink = 0;
  std::printf("ns per launch (hot: median of 15 runs of %d; cold: median of %d)\n", n, n_cold);
  std::printf("  %-44s %8.1f\n", "both:   4 callbacks, hot", median_ns(launch_both, n));
  std::printf("  %-44s %8.1f\n", "driver: 2 callbacks, hot", median_ns(launch_driver, n));
  std::printf("  pieces, hot:\n");
  std::printf("  %-44s %8.1f\n", "  now_ns() (steady_clock)", median_ns([&] { sink = sink + now_ns(); }, n));
  std::printf("  %-44s %8.1f\n", "  tracker_core::record (1 region)",
              median_ns([&] { sink = sink + core.record(launch_kind::kernel, 0, 1, undecoded_reason::none, one); }, n));
  std::printf("  %-44s %8.1f\n", "  residency_gate enter + exit (1 region)", median_ns([&] {
                residency_gate::enter(1);
                residency_gate::exit(1, 7);
              }, n));
  std::printf("  %-44s %8.1f\n", "  layout_cache::find_or_add (cached)", median_ns([&] {
                sink = sink + core.layouts().find_or_add(0x5000, "x", query, nullptr, this_thread_scratch().params).kernel;
              }, n));
  std::printf("  %-44s %8.1f\n", "  decode_params (3 params, 2 pointers)", median_ns([&] {
                region_set& r = this_thread_scratch().regions;
                r.clear();
                decode_params(param_layout{k_layout, 3}, g_args.args, region_map::lookup, r);
                sink = sink + static_cast<std::uint64_t>(r.count);
              }, n));
  std::printf("  %-44s %8.1f\n", "  empty noinline call x4 (dispatch floor)", median_ns([&] {
                for (int i = 0; i < 4; ++i) callback(domain::driver, site::exit);
              }, n));

  for (const std::size_t mib : {1, 4, 32}) {
    g_evict.assign(mib << 20, 0);
    std::printf("  cold, %2zu MiB walked between launches:\n", mib);
    std::printf("  %-44s %8.1f\n", "  both:   4 callbacks", cold_ns(launch_both, n_cold));
    std::printf("  %-44s %8.1f\n", "  driver: 2 callbacks", cold_ns(launch_driver, n_cold));
    std::printf("  %-44s %8.1f\n", "  tracker_core::record alone",
                cold_ns([&] { sink = sink + core.record(launch_kind::kernel, 0, 1, undecoded_reason::none, one); },
                        n_cold));
    std::printf("  %-44s %8.1f\n", "  now_ns() alone", cold_ns([&] { sink = sink + now_ns(); }, n_cold));
  }
  const tracker_stats s = core.stats();
  std::printf("events %llu, dropped %llu\n", static_cast<unsigned long long>(s.launches),
              static_cast<unsigned long long>(s.dropped));
  g_core = nullptr;
  core.stop_consumer();
  return 0;
}
