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

// The residency engine on the real driver (Note [Chunks] in allocator/residency.cpp), moves requested by hand
// (no tracker: residency_options::without_tracker): a large segment is one chunk; it goes to host pages and back,
// twice (the second prefetch reuses the spare chunk and its home VA), then a new segment of the same size takes a
// spare, and one that needs the budget makes the allocator release spares. The bytes survive every move.
TEST(AllocatorGpu, RegionsMoveAsChunksAndKeepTheirBytes) {
  REQUIRE_GPU();
  auto port = make_cuda_driver(0);
  allocator_options opts;
  opts.budget = 64 * k_mib;
  opts.residency.enabled = true;
  opts.residency.without_tracker = true;
  opts.residency.thread = false;
  caching_allocator alloc(*port, opts);
  const std::size_t bytes = 24 * k_mib;
  auto fill = [&](void* p, std::uint8_t seed) {
    std::vector<std::uint8_t> data(bytes);
    for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::uint8_t>(i * 7 + seed + (i >> 13));
    port->copy_from_host(reinterpret_cast<device_ptr>(p), data.data(), bytes);
    return data;
  };
  auto back = [&](void* p) {
    std::vector<std::uint8_t> out(bytes);
    port->copy_to_host(out.data(), reinterpret_cast<device_ptr>(p), bytes);
    return out;
  };
  auto settle = [&](void* p, region_residency want) {
    for (int i = 0; i < 2000 && alloc.residency_of(p) != want; ++i) alloc.residency_tick();
    return alloc.residency_of(p);
  };
  void* a = alloc.allocate(bytes, nullptr);
  std::vector<std::uint8_t> data = fill(a, 1);
  const std::int64_t created = alloc.residency().chunks_created;  // a's chunk
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_TRUE(alloc.request_evict(a));
    ASSERT_EQ(settle(a, region_residency::host), region_residency::host);
    EXPECT_EQ(back(a), data) << "read through the host mapping";
    if (round == 1) data = fill(a, 2);  // a write while on the host: the prefetch must bring it
    ASSERT_TRUE(alloc.request_prefetch(a));
    ASSERT_EQ(settle(a, region_residency::device), region_residency::device);
    EXPECT_EQ(back(a), data);
  }
  EXPECT_EQ(alloc.residency().chunks_created, created) << "a's own chunk, spare while a was on the host, came back";
  ASSERT_TRUE(alloc.request_evict(a));
  ASSERT_EQ(settle(a, region_residency::host), region_residency::host);
  void* b = alloc.allocate(bytes, nullptr);  // takes a's spare chunk
  EXPECT_EQ(alloc.residency().chunks_created, created);
  const std::vector<std::uint8_t> b_data = fill(b, 3);
  // 24 MiB of b and 48 MiB more exceed the 64 MiB budget: b is evicted on the allocation path, and its chunk,
  // spare then, is released to make room.
  void* c = alloc.allocate(48 * k_mib, nullptr);
  EXPECT_EQ(alloc.residency_of(b), region_residency::host);
  EXPECT_EQ(back(a), data);
  EXPECT_EQ(back(b), b_data);
  const residency_stats st = alloc.residency();
  EXPECT_EQ(st.spare_bytes, 0);
  EXPECT_GE(st.chunks_released, 1);
  EXPECT_LE(alloc.stats().device_bytes.peak, static_cast<std::int64_t>(opts.budget));
  alloc.verify();
  alloc.deallocate(c);
  alloc.deallocate(b);
  alloc.deallocate(a);
  alloc.empty_cache();
  alloc.verify();
}

}  // namespace
}  // namespace layerswap
