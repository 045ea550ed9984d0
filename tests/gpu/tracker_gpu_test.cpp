// The launch tracker on a real GPU, in both callback modes (LAYERSWAP_TRACK_API both and driver, Note
// [Callback domains]): launches through every runtime path (<<<>>>, cudaLaunchKernelExC, cooperative) and straight
// through the driver (kernelParams and `extra`), cudaMemcpyAsync, cudaMemsetAsync and the driver port's copies,
// each seen once with the regions it touches; pause/resume; and the C++ per-launch overhead of every mode against
// the tracker paused (printed as TRACKER_CPP_US_PER_LAUNCH, which bench/tracker.py parses, and one
// TRACKER_CPP_SIDE line per mode). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "allocator/region_map.hpp"
#include "allocator/registry.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/tracker.hpp"
#include "runtime/cuda_driver.hpp"

#if LAYERSWAP_TEST_KERNELS
#include "tracker_kernels.hpp"
#endif

using namespace layerswap;
using namespace layerswap::profiler;

namespace {

const char* api_name(tracker_api api) { return api == tracker_api::driver ? "driver" : "both"; }

class TrackerGpu : public ::testing::Test {
 protected:
  void SetUp() override { start(tracker_api::both); }
  // (Re)subscribes in `api` mode.
  void start(tracker_api api) {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
    alloc_ = &allocator_for(0);
    tracker_stop();
    tracker_set_mode({api, false});
    if (!tracker_start()) FAIL() << "the tracker did not start: " << tracker_problem();
    (void)tracker_instance()->drain(std::size_t{1} << 30);
  }
  void TearDown() override {
    for (void* p : live_) alloc_->deallocate(p);
    tracker_set_mode({});
    if (!tracker_active()) (void)tracker_resume();
  }
  void* allocate(std::size_t bytes) {
    void* p = alloc_->allocate(bytes, nullptr);
    live_.push_back(p);
    return p;
  }
  static region_id region(const void* p) { return region_map::lookup(reinterpret_cast<std::uint64_t>(p)); }
  static std::vector<drained_event> drain() { return tracker_instance()->drain(std::size_t{1} << 30); }

  caching_allocator* alloc_ = nullptr;
  std::vector<void*> live_;
};

// The same checks in each callback mode.
class TrackerGpuApi : public TrackerGpu, public ::testing::WithParamInterface<tracker_api> {
 protected:
  void SetUp() override { start(GetParam()); }
};

std::set<region_id> regions_of(const drained_event& e) { return {e.regions.begin(), e.regions.end()}; }

}  // namespace

INSTANTIATE_TEST_SUITE_P(Apis, TrackerGpuApi, ::testing::Values(tracker_api::both, tracker_api::driver),
                         [](const auto& info) { return std::string(api_name(info.param)); });

TEST_P(TrackerGpuApi, CopiesThroughTheDriverAreTracked) {
  void* a = allocate(8 << 20);
  void* b = allocate(8 << 20);
  ASSERT_NE(region(a), 0u);
  ASSERT_NE(region(a), region(b));
  alloc_->port().copy_async(reinterpret_cast<device_ptr>(a), reinterpret_cast<device_ptr>(b), 4096, nullptr);
  alloc_->port().synchronize(nullptr);
  const auto events = drain();
  bool found = false;
  for (const auto& e : events) {
    if (tracker_instance()->kernel_name(e.kind, e.kernel) == "memcpy" &&
        regions_of(e) == std::set<region_id>{region(a), region(b)}) {
      found = true;
    }
  }
  EXPECT_TRUE(found) << events.size() << " events, none a memcpy touching both regions";
}

// Note [Launch streams]: a stream the tracker saw a launch on is in the residency gate's table under the launch's
// context, the one the allocator's driver port speaks for, until the program destroys it.
TEST_P(TrackerGpuApi, LaunchStreamsAreNotedUntilDestroyed) {
  void* a = allocate(8 << 20);
  void* b = allocate(8 << 20);
  driver& port = alloc_->port();
  const stream_handle s = port.create_stream();
  const auto noted = [&] {
    bool found = false;
    residency_gate::for_each_stream(port.context_id(), [&](std::uint64_t id) {
      found = found || id == reinterpret_cast<std::uint64_t>(s);
    });
    return found;
  };
  EXPECT_FALSE(noted());
  port.copy_async(reinterpret_cast<device_ptr>(a), reinterpret_cast<device_ptr>(b), 4096, s);
  port.synchronize(s);
  EXPECT_TRUE(noted()) << "a copy on a stream of its own did not note the stream";
  port.destroy_stream(s);
  EXPECT_FALSE(noted()) << "a destroyed stream is still noted";
  (void)drain();
}

#if LAYERSWAP_TEST_KERNELS

TEST_P(TrackerGpuApi, EveryRuntimeAndDriverPathIsDecodedOnce) {
  const char* api = api_name(GetParam());
  auto* a = static_cast<float*>(allocate(4 << 20));
  auto* b = static_cast<float*>(allocate(4 << 20));
  const std::set<region_id> both = {region(a), region(b)};
  const tracker_stats before = tracker_instance()->stats();

  layerswap_test::launch_touch_runtime(a, b, 1024, nullptr);
  ASSERT_TRUE(layerswap_test::launch_touch_runtime_ex(a, b, 1024, nullptr));
  ASSERT_TRUE(layerswap_test::launch_touch_cooperative(a, b, 1024, nullptr));
  ASSERT_TRUE(layerswap_test::launch_touch_driver(a, b, 1024, nullptr, false));
  ASSERT_TRUE(layerswap_test::launch_touch_driver(a, b, 1024, nullptr, true));
  layerswap_test::memset_async(b, 1 << 20, nullptr);
  layerswap_test::memcpy_async(a, b, 1 << 20, nullptr);
  layerswap_test::synchronize();

  const auto events = drain();
  int touches = 0;
  int memsets = 0;
  int memcpys = 0;
  for (const auto& e : events) {
    const std::string name = tracker_instance()->kernel_name(e.kind, e.kernel);
    if (name.find(layerswap_test::touch_kernel_name()) != std::string::npos) {
      ++touches;
      EXPECT_EQ(regions_of(e), both) << api << ": " << name << " launch " << e.launch_no;
    } else if (name == "memset") {
      ++memsets;
      EXPECT_EQ(regions_of(e), std::set<region_id>{region(b)}) << api;
    } else if (name == "memcpy") {
      ++memcpys;
      EXPECT_EQ(regions_of(e), both) << api;
    }
  }
  const tracker_stats after = tracker_instance()->stats();
  std::printf("TRACKER_API_COVERAGE api=%s touches=%d/5 memsets=%d/1 memcpys=%d/1 launches=%llu decoded=%llu "
              "nested_skipped=%llu\n",
              api, touches, memsets, memcpys, static_cast<unsigned long long>(after.launches - before.launches),
              static_cast<unsigned long long>(after.decoded - before.decoded),
              static_cast<unsigned long long>(after.nested_skipped - before.nested_skipped));
  std::fflush(stdout);
  EXPECT_EQ(touches, 5) << api << ": each launch once: <<<>>>, ExC, cooperative, driver, driver+extra";
  EXPECT_EQ(memsets, 1) << api;
  EXPECT_EQ(memcpys, 1) << api;
  EXPECT_EQ(after.launches - before.launches, events.size()) << api;
  EXPECT_EQ(after.decoded - before.decoded, after.launches - before.launches) << api;
  if (GetParam() == tracker_api::both) {
    EXPECT_GE(after.nested_skipped - before.nested_skipped, 1u) << "the runtime calls' driver callbacks are skipped";
  } else {
    EXPECT_EQ(after.nested_skipped, before.nested_skipped) << "no runtime callbacks, so nothing is nested";
  }
  EXPECT_EQ(after.dropped, before.dropped);
}

TEST_P(TrackerGpuApi, PauseReleasesCuptiAndResumeRetakesIt) {
  auto* a = static_cast<float*>(allocate(2 << 20));
  ASSERT_TRUE(tracker_pause());
  EXPECT_FALSE(tracker_active());
  layerswap_test::launch_empty(a, nullptr);
  layerswap_test::synchronize();
  EXPECT_TRUE(drain().empty());
  ASSERT_TRUE(tracker_resume()) << tracker_problem();
  EXPECT_EQ(tracker_get_mode().api, GetParam()) << "resume keeps the mode";
  layerswap_test::launch_empty(a, nullptr);
  layerswap_test::synchronize();
  const auto events = drain();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(regions_of(events[0]), std::set<region_id>{region(a)});
}

// The clock the tracker reads per launch while a trace is written, and the kernel's clock source: on a VM whose
// clock source is not the TSC (xen, hpet, acpi_pm) a clock read is a system call.
TEST_F(TrackerGpu, ClockCost) {
  constexpr int k_reads = 1'000'000;
  std::uint64_t sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < k_reads; ++i) sink += now_ns();
  const auto t1 = std::chrono::steady_clock::now();
  std::string source = "?";
  std::ifstream("/sys/devices/system/clocksource/clocksource0/current_clocksource") >> source;
  std::printf("TRACKER_CLOCK now_ns=%.1fns clocksource=%s (%llu)\n",
              std::chrono::duration<double, std::nano>(t1 - t0).count() / k_reads, source.c_str(),
              static_cast<unsigned long long>(sink % 10));
  std::fflush(stdout);
}

// Per-launch cost of an empty kernel through cudaLaunchKernel, in every mode, against the tracker paused. The
// sides are interleaved (the order rotates every round) so that clock drift hits them alike; medians of rounds.
TEST_F(TrackerGpu, OverheadPerLaunchInCpp) {
  auto* a = static_cast<float*>(allocate(2 << 20));
  void* stream = alloc_->port().create_stream();
  constexpr int k_launches = 20'000;
  constexpr int k_rounds = 9;
  const auto time_loop = [&] {
    layerswap_test::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < k_launches; ++i) layerswap_test::launch_empty(a, stream);
    const auto t1 = std::chrono::steady_clock::now();
    layerswap_test::synchronize();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / k_launches;
  };
  struct side {
    const char* name;
    bool paused;
    tracker_mode mode;
    std::vector<double> us;
  };
  std::vector<side> sides = {
      {"paused", true, {}, {}},
      {"subscribe-only-both", false, {tracker_api::both, true}, {}},
      {"subscribe-only-driver", false, {tracker_api::driver, true}, {}},
      {"both", false, {tracker_api::both, false}, {}},
      {"driver", false, {tracker_api::driver, false}, {}},
  };
  const auto switch_to = [&](const side& s) {
    if (tracker_active()) {
      ASSERT_TRUE(tracker_pause());
    }
    if (s.paused) return;
    tracker_set_mode(s.mode);
    ASSERT_TRUE(tracker_resume()) << tracker_problem();
  };
  for (const side& s : sides) {  // warm-up: the layout cache, lazy module loading, each mode once
    switch_to(s);
    time_loop();
  }
  for (int r = 0; r < k_rounds; ++r) {
    for (std::size_t i = 0; i < sides.size(); ++i) {
      side& s = sides[(i + static_cast<std::size_t>(r)) % sides.size()];
      switch_to(s);
      s.us.push_back(time_loop());
      (void)tracker_instance()->drain(std::size_t{1} << 30);
    }
  }
  switch_to(sides[3]);
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double paused = median(sides[0].us);
  for (const side& s : sides) {
    std::printf("TRACKER_CPP_SIDE side=%s us=%.4f added=%.4f min=%.4f max=%.4f\n", s.name, median(s.us),
                median(s.us) - paused, *std::min_element(s.us.begin(), s.us.end()),
                *std::max_element(s.us.begin(), s.us.end()));
  }
  const double w = median(sides[3].us);
  std::printf("TRACKER_CPP_US_PER_LAUNCH with=%.4f without=%.4f added=%.4f\n", w, paused, w - paused);
  std::fflush(stdout);
  const tracker_stats s = tracker_instance()->stats();
  EXPECT_EQ(s.dropped, 0u);
  EXPECT_LE(w - paused, 1.0) << "the tracker adds more than 1 us per launch";
  alloc_->port().destroy_stream(stream);
}

#else

TEST_F(TrackerGpu, KernelTestsNeedNvcc) { GTEST_SKIP() << "built without a CUDA compiler: kernel tests skipped"; }

#endif
