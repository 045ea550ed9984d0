// The launch tracker on a real GPU: launches through the runtime and straight through the driver (kernelParams
// and `extra`), memcpy and memset, each seen once with the regions it touches; pause/resume; and the C++
// per-launch overhead with and without the tracker (printed as TRACKER_CPP_US_PER_LAUNCH, which
// bench/tracker.py parses). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <vector>

#include "allocator/region_map.hpp"
#include "allocator/registry.hpp"
#include "profiler/tracker.hpp"
#include "runtime/cuda_driver.hpp"

#if LAYERSWAP_TEST_KERNELS
#include "tracker_kernels.hpp"
#endif

using namespace layerswap;
using namespace layerswap::profiler;

namespace {

class TrackerGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped";
    alloc_ = &allocator_for(0);
    if (!tracker_start()) FAIL() << "the tracker did not start: " << tracker_problem();
    (void)tracker_instance()->drain(std::size_t{1} << 30);
  }
  void TearDown() override {
    for (void* p : live_) alloc_->deallocate(p);
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

std::set<region_id> regions_of(const drained_event& e) { return {e.regions.begin(), e.regions.end()}; }

}  // namespace

TEST_F(TrackerGpu, CopiesThroughTheDriverAreTracked) {
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

#if LAYERSWAP_TEST_KERNELS

TEST_F(TrackerGpu, KernelsThroughRuntimeAndDriverAreDecodedOnce) {
  auto* a = static_cast<float*>(allocate(4 << 20));
  auto* b = static_cast<float*>(allocate(4 << 20));
  const std::set<region_id> both = {region(a), region(b)};
  const tracker_stats before = tracker_instance()->stats();

  layerswap_test::launch_touch_runtime(a, b, 1024, nullptr);
  ASSERT_TRUE(layerswap_test::launch_touch_driver(a, b, 1024, nullptr, false));
  ASSERT_TRUE(layerswap_test::launch_touch_driver(a, b, 1024, nullptr, true));
  layerswap_test::memset_async(b, 1 << 20, nullptr);
  layerswap_test::synchronize();

  const auto events = drain();
  int touches = 0;
  int memsets = 0;
  for (const auto& e : events) {
    const std::string name = tracker_instance()->kernel_name(e.kind, e.kernel);
    if (name.find(layerswap_test::touch_kernel_name()) != std::string::npos) {
      ++touches;
      EXPECT_EQ(regions_of(e), both) << name << " launch " << e.launch_no;
    } else if (name == "memset") {
      ++memsets;
      EXPECT_EQ(regions_of(e), std::set<region_id>{region(b)});
    }
  }
  EXPECT_EQ(touches, 3) << "each launch once: runtime (its nested driver callback skipped), driver, driver+extra";
  EXPECT_EQ(memsets, 1);
  const tracker_stats after = tracker_instance()->stats();
  EXPECT_EQ(after.launches - before.launches, events.size());
  EXPECT_EQ(after.decoded - before.decoded, after.launches - before.launches);
  EXPECT_GE(after.nested_skipped - before.nested_skipped, 1u);
  EXPECT_EQ(after.dropped, before.dropped);
}

TEST_F(TrackerGpu, PauseReleasesCuptiAndResumeRetakesIt) {
  auto* a = static_cast<float*>(allocate(2 << 20));
  ASSERT_TRUE(tracker_pause());
  EXPECT_FALSE(tracker_active());
  layerswap_test::launch_empty(a, nullptr);
  layerswap_test::synchronize();
  EXPECT_TRUE(drain().empty());
  ASSERT_TRUE(tracker_resume()) << tracker_problem();
  layerswap_test::launch_empty(a, nullptr);
  layerswap_test::synchronize();
  const auto events = drain();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(regions_of(events[0]), std::set<region_id>{region(a)});
}

TEST_F(TrackerGpu, OverheadPerLaunchInCpp) {
  auto* a = static_cast<float*>(allocate(2 << 20));
  void* stream = alloc_->port().create_stream();
  constexpr int k_launches = 20'000;
  constexpr int k_repeats = 7;
  const auto time_loop = [&] {
    layerswap_test::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < k_launches; ++i) layerswap_test::launch_empty(a, stream);
    const auto t1 = std::chrono::steady_clock::now();
    layerswap_test::synchronize();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / k_launches;
  };
  for (int i = 0; i < 2; ++i) time_loop();  // warm-up (layout cache, lazy module loading)
  std::vector<double> with, without;
  for (int r = 0; r < k_repeats; ++r) {  // interleaved, so that clock drift hits both sides alike
    ASSERT_TRUE(tracker_resume() || tracker_active());
    with.push_back(time_loop());
    (void)tracker_instance()->drain(std::size_t{1} << 30);
    ASSERT_TRUE(tracker_pause());
    without.push_back(time_loop());
  }
  ASSERT_TRUE(tracker_resume());
  std::sort(with.begin(), with.end());
  std::sort(without.begin(), without.end());
  const double w = with[k_repeats / 2];
  const double wo = without[k_repeats / 2];
  std::printf("TRACKER_CPP_US_PER_LAUNCH with=%.4f without=%.4f added=%.4f\n", w, wo, w - wo);
  std::fflush(stdout);
  const tracker_stats s = tracker_instance()->stats();
  EXPECT_EQ(s.dropped, 0u);
  EXPECT_LE(w - wo, 1.0) << "the tracker adds more than 1 us per launch";
  alloc_->port().destroy_stream(stream);
}

#else

TEST_F(TrackerGpu, KernelTestsNeedNvcc) { GTEST_SKIP() << "built without a CUDA compiler: kernel tests skipped"; }

#endif
