// The caching allocator over the real driver port. Every test skips, saying so, without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "runtime/cuda_driver.hpp"
#include "runtime/error.hpp"

namespace layerswap {
namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU: skipped"

TEST(AllocatorGpu, DataSurvivesInEveryBlockShape) {
  REQUIRE_GPU();
  auto port = make_cuda_driver(0);
  caching_allocator alloc(*port, {});
  std::mt19937 rng(1);
  std::vector<std::pair<void*, std::vector<std::uint8_t>>> blocks;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{700}, std::size_t{4096}, 300 * std::size_t{1024}, k_mib,
                            k_mib + 1, 5 * k_mib, 64 * k_mib}) {
    void* p = alloc.allocate(bytes, nullptr);
    std::vector<std::uint8_t> data(bytes);
    for (auto& b : data) b = static_cast<std::uint8_t>(rng());
    port->copy_from_host(reinterpret_cast<device_ptr>(p), data.data(), bytes);
    blocks.emplace_back(p, std::move(data));
  }
  for (auto& [p, data] : blocks) {
    std::vector<std::uint8_t> back(data.size());
    port->copy_to_host(back.data(), reinterpret_cast<device_ptr>(p), back.size());
    EXPECT_EQ(back, data);
  }
  for (auto& [p, data] : blocks) alloc.deallocate(p);
  alloc.verify();
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().device_bytes.current, 0);
}

TEST(AllocatorGpu, StreamCopiesThroughReusedBlocks) {
  REQUIRE_GPU();
  auto port = make_cuda_driver(0);
  caching_allocator alloc(*port, {});
  stream_handle s = port->create_stream();
  const std::size_t bytes = 32 * k_mib;
  std::vector<std::uint8_t> pattern(bytes);
  std::iota(pattern.begin(), pattern.end(), std::uint8_t{3});
  void* src = alloc.allocate(bytes, s);
  port->copy_from_host(reinterpret_cast<device_ptr>(src), pattern.data(), bytes);
  void* last = nullptr;
  for (int i = 0; i < 50; ++i) {  // each hop reuses the previous hop's freed block on the same stream
    void* dst = alloc.allocate(bytes, s);
    port->copy_async(reinterpret_cast<device_ptr>(dst), reinterpret_cast<device_ptr>(src), bytes, s);
    alloc.deallocate(src);
    src = dst;
    last = dst;
  }
  port->synchronize(s);
  std::vector<std::uint8_t> back(bytes);
  port->copy_to_host(back.data(), reinterpret_cast<device_ptr>(last), bytes);
  EXPECT_EQ(back, pattern);
  alloc.deallocate(last);
  EXPECT_LE(alloc.stats().all.segments.peak, 2) << "same-stream reuse should need only two segments";
  alloc.verify();
  port->destroy_stream(s);
}

TEST(AllocatorGpu, BudgetReclaimAndOom) {
  REQUIRE_GPU();
  auto port = make_cuda_driver(0);
  allocator_options opts;
  opts.budget = 256 * k_mib;
  caching_allocator alloc(*port, opts);
  std::vector<void*> ps;
  for (int i = 0; i < 12; ++i) ps.push_back(alloc.allocate(20 * k_mib, nullptr));  // 240 MiB
  EXPECT_THROW((void)alloc.allocate(40 * k_mib, nullptr), out_of_memory);
  for (void* p : ps) alloc.deallocate(p);
  void* big = alloc.allocate(250 * k_mib, nullptr);  // reclaims the cached 20 MiB segments
  EXPECT_NE(big, nullptr);
  EXPECT_GE(alloc.stats().num_alloc_retries, 1);
  EXPECT_LE(alloc.stats().device_bytes.peak, static_cast<std::int64_t>(opts.budget));
  alloc.deallocate(big);
  const std::size_t free_before = port->free_memory();
  alloc.empty_cache();
  EXPECT_GE(port->free_memory(), free_before + 200 * k_mib) << "empty_cache should give the pages back";
  alloc.verify();
}

}  // namespace
}  // namespace layerswap
