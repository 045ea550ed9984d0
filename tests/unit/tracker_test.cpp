// The launch tracker without a GPU: argument decoding of synthetic argument buffers (scalars, pointers,
// structs holding pointers, pointer arrays by value, `extra` buffers), the layout cache, the nesting filter
// of runtime/driver callbacks, the region map (alone and fed by the caching allocator on the simulated
// device), the ring under concurrent producers, the tracker core and the trace file.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "allocator/caching_allocator.hpp"
#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/arg_decoder.hpp"
#include "profiler/event_ring.hpp"
#include "profiler/launch_dedupe.hpp"
#include "profiler/launch_recorder.hpp"
#include "profiler/layout_cache.hpp"
#include "profiler/trace_writer.hpp"
#include "profiler/tracker_core.hpp"
#include "runtime/fast_clock.hpp"
#include "runtime/sim_driver.hpp"

using namespace layerswap;
using namespace layerswap::profiler;

namespace {

// Synthetic regions: 2 MiB granules from k_base; granule k is region k + 1 for k < 64.
constexpr std::uint64_t k_base = 0x7f1200000000ULL;
constexpr std::uint64_t k_granule = std::uint64_t{2} << 20;

region_id fake_lookup(std::uint64_t address) noexcept {
  if (address < k_base) return 0;
  const std::uint64_t k = (address - k_base) / k_granule;
  return k < 64 ? static_cast<region_id>(k + 1) : 0;
}

std::uint64_t addr(int region, std::uint64_t offset = 0) { return k_base + (region - 1) * k_granule + offset; }

std::set<region_id> as_set(const region_set& s) { return {s.ids, s.ids + s.count}; }

param_layout layout_of(const std::vector<param_slot>& slots) {
  return param_layout{slots.data(), static_cast<std::uint32_t>(slots.size())};
}

}  // namespace

// ---- decoding ----

TEST(ArgDecoder, ScalarsMatchNothing) {
  const int i = 7;
  const float f = 1.5f;
  const std::uint64_t n = 4096;
  const double d = 3.0e9;
  const std::int64_t minus_one = -1;
  const std::vector<param_slot> slots = {{0, 4}, {4, 4}, {8, 8}, {16, 8}, {24, 8}};
  const void* args[] = {&i, &f, &n, &d, &minus_one};
  region_set out;
  decode_params(layout_of(slots), args, fake_lookup, out);
  EXPECT_EQ(out.count, 0);
  EXPECT_EQ(out.words, 3u);  // the two 4-byte scalars hold no word
}

TEST(ArgDecoder, PointersAnywhereInsideARegion) {
  const std::uint64_t a = addr(3), b = addr(5, k_granule - 8), c = addr(3, 1234 * 8);
  const int n = 10;
  const std::vector<param_slot> slots = {{0, 8}, {8, 4}, {16, 8}, {24, 8}};
  const void* args[] = {&a, &n, &b, &c};
  region_set out;
  decode_params(layout_of(slots), args, fake_lookup, out);
  EXPECT_EQ(as_set(out), (std::set<region_id>{3, 5}));
  EXPECT_FALSE(out.truncated);
}

TEST(ArgDecoder, StructsByValueHoldingPointers) {
  // Like TensorIterator's kernels: a struct with sizes, strides and data pointers, passed by value.
  struct alignas(8) offset_calc {
    int dims;
    int pad;
    std::int64_t sizes[3];
    std::uint64_t data[2];
    float alpha;
  };
  offset_calc s{};
  s.dims = 3;
  s.sizes[0] = 16;
  s.sizes[1] = 1 << 20;
  s.sizes[2] = 3;
  s.data[0] = addr(7, 64);
  s.data[1] = addr(9);
  s.alpha = 2.0f;
  const std::uint64_t out_ptr = addr(11);
  const std::vector<param_slot> slots = {{0, sizeof(offset_calc)}, {sizeof(offset_calc), 8}};
  const void* args[] = {&s, &out_ptr};
  region_set out;
  decode_params(layout_of(slots), args, fake_lookup, out);
  EXPECT_EQ(as_set(out), (std::set<region_id>{7, 9, 11}));
}

TEST(ArgDecoder, PointerArraysByValueAreDeduplicated) {
  // Like foreach kernels' TensorListMetadata: addresses[4][110] by value, many in the same region.
  struct metadata {
    std::uint64_t addresses[4][110];
    std::int64_t numel[110];
    unsigned char block_to_tensor[320];
  };
  auto m = std::make_unique<metadata>();
  std::memset(m.get(), 0, sizeof(metadata));
  for (int list = 0; list < 4; ++list) {
    for (int t = 0; t < 110; ++t) {
      m->addresses[list][t] = addr(1 + (list * 110 + t) % 40, static_cast<std::uint64_t>(t) * 256);
      m->numel[t] = 1000 + t;
    }
  }
  const std::vector<param_slot> slots = {{0, sizeof(metadata)}};
  const void* args[] = {m.get()};
  region_set out;
  decode_params(layout_of(slots), args, fake_lookup, out);
  EXPECT_EQ(out.count, 40);
  EXPECT_EQ(as_set(out).size(), 40u);
}

TEST(ArgDecoder, NullArgumentsAndShortTailsAreSkipped) {
  unsigned char tail[12] = {};
  const std::uint64_t a = addr(2);
  std::memcpy(tail, &a, 8);
  const std::vector<param_slot> slots = {{0, 8}, {8, 12}};
  const void* args[] = {nullptr, tail};
  region_set out;
  decode_params(layout_of(slots), args, fake_lookup, out);
  EXPECT_EQ(as_set(out), (std::set<region_id>{2}));
  region_set none;
  decode_params(layout_of(slots), nullptr, fake_lookup, none);
  EXPECT_EQ(none.count, 0);
}

TEST(ArgDecoder, OverflowSetsTruncated) {
  std::vector<std::uint64_t> words;
  for (int round = 0; round < 20; ++round) {
    for (int r = 1; r <= 64; ++r) words.push_back(addr(r) + static_cast<std::uint64_t>(round) * 8);
  }
  region_set out;
  scan_words(words.data(), words.size() * 8, fake_lookup, out);
  EXPECT_EQ(out.count, 64);
  EXPECT_FALSE(out.truncated);
  // A lookup with more regions than the set holds.
  const auto many = [](std::uint64_t address) noexcept -> region_id {
    return static_cast<region_id>((address >> 3) & 0xffff) + 1;
  };
  std::vector<std::uint64_t> distinct;
  for (std::uint64_t i = 0; i < region_set::k_capacity + 10; ++i) distinct.push_back((std::uint64_t{1} << 40) + i * 8);
  region_set big;
  scan_words(distinct.data(), distinct.size() * 8, many, big);
  EXPECT_EQ(big.count, region_set::k_capacity);
  EXPECT_TRUE(big.truncated);
}

TEST(ArgDecoder, ExtraBufferOfACublasLtGemm) {
  // 1,720 bytes with raw operand addresses at arbitrary 8-aligned offsets (the nvjet kernels' layout).
  std::vector<std::uint64_t> buffer(1720 / 8, 0);
  buffer[3] = 128;  // m
  buffer[10] = addr(21);
  buffer[57] = addr(22, 4096);
  buffer[200] = addr(23);
  buffer[201] = 0x3f800000;  // 1.0f
  std::size_t size = 1720;
  const void* extra[] = {reinterpret_cast<void*>(k_launch_param_buffer_pointer), buffer.data(),
                         reinterpret_cast<void*>(k_launch_param_buffer_size), &size,
                         reinterpret_cast<void*>(k_launch_param_end)};
  const extra_buffer parsed = parse_extra(extra);
  ASSERT_EQ(parsed.data, buffer.data());
  EXPECT_EQ(parsed.size, 1720u);
  region_set out;
  scan_words(parsed.data, parsed.size, fake_lookup, out);
  EXPECT_EQ(as_set(out), (std::set<region_id>{21, 22, 23}));
}

TEST(ArgDecoder, ExtraWithoutBufferOrSize) {
  EXPECT_EQ(parse_extra(nullptr).data, nullptr);
  int x = 0;
  const void* no_size[] = {reinterpret_cast<void*>(k_launch_param_buffer_pointer), &x, nullptr};
  EXPECT_EQ(parse_extra(no_size).data, nullptr);
  std::size_t size = 8;
  const void* size_first[] = {reinterpret_cast<void*>(k_launch_param_buffer_size), &size,
                              reinterpret_cast<void*>(k_launch_param_buffer_pointer), &x, nullptr};
  EXPECT_EQ(parse_extra(size_first).data, &x);
  EXPECT_EQ(parse_extra(size_first).size, 8u);
}

TEST(KernelFamily, MangledDemangledAndPlainNames) {
  EXPECT_EQ(kernel_family("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"),
            "vectorized_elementwise_kernel");
  EXPECT_EQ(kernel_family("_ZN2at6native29vectorized_elem"), "vectorized_elem");  // truncated
  EXPECT_EQ(kernel_family("_Z10add_kernelPfS_i"), "add_kernel");
  EXPECT_EQ(kernel_family("_ZN7cutlass7Kernel2INS_4gemm6kernelEEEvNT_6ParamsE"), "Kernel2");
  EXPECT_EQ(kernel_family("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<float>(int, float*)"),
            "multi_tensor_apply_kernel");
  EXPECT_EQ(kernel_family("triton_poi_fused_add_mul_0"), "triton_poi");
  EXPECT_EQ(kernel_family("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNT"), "nvjet_sm90");
  EXPECT_EQ(kernel_family("memcpy"), "memcpy");
}

// ---- the layout cache ----

namespace {

struct fake_functions {
  std::atomic<int> queries{0};
  std::atomic<int> later_left{0};
  // function id -> parameter sizes; id 99 cannot be queried.
  static query_status query(void* context, std::uint64_t function, std::uint32_t index, param_slot& out) noexcept {
    auto& self = *static_cast<fake_functions*>(context);
    self.queries.fetch_add(1);
    if (function == 99) return query_status::error;
    if (index == 0 && self.later_left.load() > 0) {
      self.later_left.fetch_sub(1);
      return query_status::later;
    }
    const std::uint32_t count = static_cast<std::uint32_t>(function % 7);
    if (index >= count) return query_status::end;
    out = param_slot{index * 8, 8};
    return query_status::ok;
  }
};

}  // namespace

TEST(LayoutCache, QueriesOncePerFunctionAndKeepsTheName) {
  layout_cache cache(64);
  fake_functions fake;
  param_slot scratch[k_max_params];
  const layout_lookup first = cache.find_or_add(12, "kernel_twelve", fake_functions::query, &fake, scratch);
  EXPECT_TRUE(first.has_layout);
  EXPECT_EQ(first.layout.count, 5u);
  EXPECT_EQ(first.layout.params[4].offset, 32u);
  const int queries = fake.queries.load();
  EXPECT_EQ(queries, 6);  // 5 parameters and the end
  for (int i = 0; i < 100; ++i) {
    const layout_lookup again = cache.find_or_add(12, "kernel_twelve", fake_functions::query, &fake, scratch);
    EXPECT_EQ(again.kernel, first.kernel);
    EXPECT_EQ(again.layout.count, 5u);
    EXPECT_NE(again.layout.params, scratch);
  }
  EXPECT_EQ(fake.queries.load(), queries);
  EXPECT_EQ(cache.name(first.kernel), "kernel_twelve");
  EXPECT_EQ(cache.functions(), 1u);
}

// Note [Named late] (layout_cache.cpp): a function whose first launch came with no name takes the name of the first
// launch that has one, and whether it is NCCL's with it; the layout is still queried once.
TEST(LayoutCache, AFunctionFirstLaunchedWithNoNameIsNamedByItsFirstNamedLaunch) {
  layout_cache cache(64);
  fake_functions fake;
  param_slot scratch[k_max_params];
  constexpr const char* nccl = "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE";
  const layout_lookup first = cache.find_or_add(8, nullptr, fake_functions::query, &fake, scratch);
  EXPECT_TRUE(first.has_layout);
  EXPECT_FALSE(first.work_elsewhere) << "nothing tells a nameless launch's function apart";
  EXPECT_EQ(cache.name(first.kernel), "");
  const int queries = fake.queries.load();
  const layout_lookup nameless = cache.find_or_add(8, nullptr, fake_functions::query, &fake, scratch);
  EXPECT_FALSE(nameless.work_elsewhere);
  const layout_lookup named = cache.find_or_add(8, nccl, fake_functions::query, &fake, scratch);
  EXPECT_EQ(named.kernel, first.kernel);
  EXPECT_TRUE(named.work_elsewhere) << "the first named launch decides";
  EXPECT_EQ(cache.name(first.kernel), nccl);
  const layout_lookup after = cache.find_or_add(8, nullptr, fake_functions::query, &fake, scratch);
  EXPECT_TRUE(after.work_elsewhere) << "a nameless launch after it reads the entry's flag";
  const layout_lookup renamed = cache.find_or_add(8, "another_name", fake_functions::query, &fake, scratch);
  EXPECT_TRUE(renamed.work_elsewhere) << "an entry is named once";
  EXPECT_EQ(cache.name(first.kernel), nccl);
  EXPECT_EQ(fake.queries.load(), queries) << "the layout was queried again";
}

TEST(LayoutCache, FailuresAreCachedAndLaterIsRetried) {
  layout_cache cache(64);
  fake_functions fake;
  param_slot scratch[k_max_params];
  EXPECT_FALSE(cache.find_or_add(99, "bad", fake_functions::query, &fake, scratch).has_layout);
  const int after_failure = fake.queries.load();
  EXPECT_FALSE(cache.find_or_add(99, "bad", fake_functions::query, &fake, scratch).has_layout);
  EXPECT_EQ(fake.queries.load(), after_failure);

  fake.later_left = 1;
  const layout_lookup later = cache.find_or_add(13, "k13", fake_functions::query, &fake, scratch);
  EXPECT_FALSE(later.has_layout);
  const layout_lookup retried = cache.find_or_add(13, "k13", fake_functions::query, &fake, scratch);
  EXPECT_TRUE(retried.has_layout);
  EXPECT_EQ(retried.layout.count, 6u);
  EXPECT_EQ(retried.kernel, later.kernel);
}

TEST(LayoutCache, FullTableStillDecodes) {
  layout_cache cache(16);
  fake_functions fake;
  param_slot scratch[k_max_params];
  for (std::uint64_t f = 1; f <= 40; ++f) {
    const layout_lookup l = cache.find_or_add(f * 7 + 3, nullptr, fake_functions::query, &fake, scratch);
    EXPECT_TRUE(l.has_layout);
    EXPECT_EQ(l.layout.count, 3u);
  }
  EXPECT_EQ(cache.functions(), 16u);
  EXPECT_GT(cache.uncached_queries(), 0u);
}

TEST(LayoutCache, ConcurrentFirstLaunches) {
  layout_cache cache(1024);
  fake_functions fake;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      param_slot scratch[k_max_params];
      for (int round = 0; round < 200; ++round) {
        for (std::uint64_t f = 1; f <= 50; ++f) {
          const layout_lookup l = cache.find_or_add(f, "k", fake_functions::query, &fake, scratch);
          if (!l.has_layout || l.layout.count != f % 7) wrong.fetch_add(1);
          for (std::uint32_t i = 0; i < l.layout.count; ++i) {
            if (l.layout.params[i].offset != i * 8) wrong.fetch_add(1);
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(cache.functions(), 50u);
}

// Note [Named late] under threads: each function's launches come with no name for some threads and with one name for
// the others (NCCL's for odd functions). A named launch always gets the flag of its own name; once every thread is
// done, each entry holds its name and flag, whoever named it.
TEST(LayoutCache, ConcurrentNamelessAndNamedLaunchesNameEachEntryOnce) {
  layout_cache cache(1024);
  fake_functions fake;
  const auto name_of = [](std::uint64_t f) {
    return std::string(f % 2 ? "ncclDevKernel_AllGather_" : "elementwise_") + std::to_string(f);
  };
  std::vector<std::string> names;
  for (std::uint64_t f = 0; f <= 50; ++f) names.push_back(name_of(f));
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      param_slot scratch[k_max_params];
      for (int round = 0; round < 200; ++round) {
        for (std::uint64_t f = 1; f <= 50; ++f) {
          const bool named = (t + round + static_cast<int>(f)) % 3 == 0;
          const layout_lookup l =
              cache.find_or_add(f, named ? names[f].c_str() : nullptr, fake_functions::query, &fake, scratch);
          if (!l.has_layout || l.layout.count != f % 7) wrong.fetch_add(1);
          if (named && l.work_elsewhere != (f % 2 == 1)) wrong.fetch_add(1);
          if (!named && l.work_elsewhere && f % 2 == 0) wrong.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(cache.functions(), 50u);
  param_slot scratch[k_max_params];
  for (std::uint64_t f = 1; f <= 50; ++f) {
    const layout_lookup l = cache.find_or_add(f, nullptr, fake_functions::query, &fake, scratch);
    EXPECT_EQ(cache.name(l.kernel), names[f]) << f;
    EXPECT_EQ(l.work_elsewhere, f % 2 == 1) << f;
  }
}

// ---- nested callbacks (Note [Nested launch callbacks]) ----

TEST(LaunchNesting, DriverCallbackInsideARuntimeLaunchCountsOnce) {
  // Plays the callback sequence CUPTI produces and counts launches as the CUPTI callback does.
  launch_nesting n;
  int counted = 0;
  int skipped = 0;
  const auto driver_enter = [&] { n.driver_is_nested() ? ++skipped : ++counted; };
  // cudaLaunchKernel -> cuLaunchKernel nested
  n.runtime_enter();
  ++counted;
  driver_enter();
  n.runtime_exit();
  // a straight cuLaunchKernelEx (cuBLASLt)
  driver_enter();
  // cudaMemcpyAsync with two driver calls underneath, then a runtime call with none
  n.runtime_enter();
  ++counted;
  driver_enter();
  driver_enter();
  n.runtime_exit();
  n.runtime_enter();
  ++counted;
  n.runtime_exit();
  driver_enter();
  EXPECT_EQ(counted, 5);
  EXPECT_EQ(skipped, 3);
  n.runtime_exit();  // an exit without enter (subscribed mid-call) does not underflow
  EXPECT_FALSE(n.driver_is_nested());
}

// ---- the region map ----

TEST(RegionMap, LookupIsExactAtGranuleBoundaries) {
  const std::uint64_t base = 0x7e0000000000ULL;
  const int slot = region_map::register_arena(base, 64 * k_granule, 21);
  ASSERT_GE(slot, 0);
  const region_id a = region_map::next_region_id();
  const region_id b = region_map::next_region_id();
  EXPECT_NE(a, b);
  region_map::publish(slot, 2, 3, a);
  region_map::publish(slot, 5, 1, b);
  EXPECT_EQ(region_map::lookup(base + 2 * k_granule), a);
  EXPECT_EQ(region_map::lookup(base + 5 * k_granule - 1), a);
  EXPECT_EQ(region_map::lookup(base + 5 * k_granule), b);
  EXPECT_EQ(region_map::lookup(base + 6 * k_granule), 0u);
  EXPECT_EQ(region_map::lookup(base + 2 * k_granule - 1), 0u);
  EXPECT_EQ(region_map::lookup(base + 64 * k_granule), 0u);
  EXPECT_EQ(region_map::lookup(42), 0u);
  region_map::publish(slot, 2, 3, 0);
  EXPECT_EQ(region_map::lookup(base + 3 * k_granule), 0u);
  region_map::unregister_arena(slot);
  EXPECT_EQ(region_map::lookup(base + 5 * k_granule), 0u);
}

TEST(RegionMap, CachingAllocatorPublishesItsSegments) {
  sim_driver sim;
  allocator_options options;
  options.va_reserve = std::size_t{64} << 20;
  caching_allocator alloc(sim, options);
  void* big1 = alloc.allocate(5 << 20, nullptr);
  void* big2 = alloc.allocate(3 << 20, nullptr);
  void* small1 = alloc.allocate(1000, nullptr);
  void* small2 = alloc.allocate(1000, nullptr);
  const auto region_of = [](const void* p, std::size_t offset = 0) {
    return region_map::lookup(reinterpret_cast<std::uint64_t>(p) + offset);
  };
  const region_id r1 = region_of(big1);
  EXPECT_NE(r1, 0u);
  EXPECT_EQ(region_of(big1, (5 << 20) - 1), r1);
  EXPECT_NE(region_of(big2), 0u);
  EXPECT_NE(region_of(big2), r1);
  EXPECT_NE(region_of(small1), 0u);
  EXPECT_EQ(region_of(small1), region_of(small2));  // one slab region
  // The block is derivable from the pointer (for a learner), the region is the slab's.
  EXPECT_EQ(alloc.block_of(small2).first, small2);

  // A cached segment keeps its id when reused; a destroyed one is withdrawn.
  alloc.deallocate(big1);
  EXPECT_EQ(region_of(big1), r1);
  void* again = alloc.allocate(5 << 20, nullptr);
  EXPECT_EQ(again, big1);
  EXPECT_EQ(region_of(again), r1);
  alloc.deallocate(again);
  alloc.deallocate(big2);
  alloc.deallocate(small1);
  alloc.deallocate(small2);
  alloc.empty_cache();
  EXPECT_EQ(region_of(big1), 0u);
  EXPECT_EQ(region_of(small1), 0u);
}

// ---- the ring ----

TEST(EventRing, ConcurrentProducersLoseAndReorderNothing) {
  struct item {
    std::uint32_t producer;
    std::uint32_t sequence;
  };
  event_ring<item> ring(256);
  constexpr int k_producers = 4;
  constexpr std::uint32_t k_each = 50'000;
  std::atomic<int> done{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < k_producers; ++p) {
    producers.emplace_back([&, p] {
      for (std::uint32_t i = 0; i < k_each; ++i) {
        while (!ring.try_push(item{static_cast<std::uint32_t>(p), i})) std::this_thread::yield();
      }
      done.fetch_add(1);
    });
  }
  std::vector<std::uint32_t> next(k_producers, 0);
  std::uint64_t received = 0;
  bool in_order = true;
  item it{};
  while (done.load() < k_producers || received < std::uint64_t{k_producers} * k_each) {
    if (ring.try_pop(it)) {
      in_order &= it.sequence == next[it.producer];
      next[it.producer] = it.sequence + 1;
      ++received;
    }
  }
  for (auto& t : producers) t.join();
  EXPECT_TRUE(in_order);
  EXPECT_EQ(received, std::uint64_t{k_producers} * k_each);
  EXPECT_FALSE(ring.try_pop(it));
}

TEST(EventRing, FullRingRefuses) {
  event_ring<int> ring(4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ring.try_push(i));
  EXPECT_FALSE(ring.try_push(5));
  int v = -1;
  EXPECT_TRUE(ring.try_pop(v));
  EXPECT_EQ(v, 0);
  EXPECT_TRUE(ring.try_push(5));
}

// ---- the tracker core ----

namespace {
region_set regions_of(std::initializer_list<region_id> ids) {
  region_set s;
  for (region_id id : ids) s.add(id);
  return s;
}
}  // namespace

TEST(TrackerCore, EventsStatsAndDrain) {
  tracker_core core;
  fake_functions fake;
  param_slot scratch[k_max_params];
  const std::uint32_t k1 = core.layouts().find_or_add(8, "_ZN2at6native18elementwise_kernelEv", fake_functions::query,
                                                      &fake, scratch).kernel;
  const std::uint32_t k2 = core.layouts().find_or_add(15, "triton_red_fused_0", fake_functions::query, &fake,
                                                      scratch).kernel;
  core.record(launch_kind::kernel, 7, k1, undecoded_reason::none, regions_of({1, 2}));
  core.record(launch_kind::kernel, 7, k2, undecoded_reason::none, regions_of({}));
  core.record(launch_kind::kernel, 9, k2, undecoded_reason::no_layout, regions_of({}));
  core.record(launch_kind::memcpy, 7, 0, undecoded_reason::none, regions_of({3}));
  core.record(launch_kind::graph, 7, 0, undecoded_reason::graph, regions_of({}));
  core.count_nested();

  const tracker_stats s = core.stats();
  EXPECT_EQ(s.launches, 5u);
  EXPECT_EQ(s.kernels, 3u);
  EXPECT_EQ(s.copies, 1u);
  EXPECT_EQ(s.graphs, 1u);
  EXPECT_EQ(s.decoded, 3u);
  EXPECT_EQ(s.undecoded[static_cast<int>(undecoded_reason::no_layout)], 1u);
  EXPECT_EQ(s.undecoded[static_cast<int>(undecoded_reason::graph)], 1u);
  EXPECT_EQ(s.with_regions, 2u);
  EXPECT_EQ(s.nested_skipped, 1u);
  EXPECT_EQ(s.dropped, 0u);
  ASSERT_EQ(s.no_region_families.size(), 1u);
  EXPECT_EQ(s.no_region_families[0].first, "triton_red");
  EXPECT_EQ(s.no_region_families[0].second, 2u);

  auto events = core.drain(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].launch_no + 1, events[1].launch_no);
  EXPECT_EQ(events[0].stream, 7u);
  EXPECT_EQ(core.kernel_name(events[0].kind, events[0].kernel), "_ZN2at6native18elementwise_kernelEv");
  EXPECT_EQ(events[0].regions, (std::vector<region_id>{1, 2}));
  events = core.drain(100);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(core.kernel_name(events[1].kind, events[1].kernel), "memcpy");
  EXPECT_EQ(events[1].regions, (std::vector<region_id>{3}));
  EXPECT_TRUE(core.drain(100).empty());
}

// LAYERSWAP_TRACK=attribute: each launch's driver part under the engine state it met, and in its length's bucket.
TEST(TrackerCore, LaunchesAreAttributedToTheEnginesCallAndBucketedByLength) {
  tracker_core core;
  const auto map_state = static_cast<std::uint8_t>(static_cast<int>(driver_calls::kind::map) + 1);
  const auto access_state = static_cast<std::uint8_t>(static_cast<int>(driver_calls::kind::set_access) + 1);
  core.add_launch_attribution(0, 100);                                   // bucket 0
  core.add_launch_attribution(map_state, 5000);                          // 5000 >> 10 = 4: bucket 3
  core.add_launch_attribution(map_state, 3000);                          // 2: bucket 2
  core.add_launch_attribution(access_state, 1024);                       // 1: bucket 1
  core.add_launch_attribution(255, std::uint64_t{1} << 40);              // no such state: none; the open bucket
  const tracker_stats s = core.stats();
  EXPECT_EQ(s.launch_engine_calls[0], 2u);
  EXPECT_EQ(s.launch_engine_calls[map_state], 2u);
  EXPECT_EQ(s.launch_engine_calls[access_state], 1u);
  // to_ns's rate is re-measured as the process runs: equal within a thousandth.
  const auto near = [](std::uint64_t ns, std::uint64_t ticks) {
    const double want = static_cast<double>(fast_clock::to_ns(ticks));
    return std::abs(static_cast<double>(ns) - want) <= 1e-3 * want + 1;
  };
  EXPECT_TRUE(near(s.launch_engine_ns[map_state], 8000)) << s.launch_engine_ns[map_state];
  EXPECT_TRUE(near(s.launch_engine_ns[0], (std::uint64_t{1} << 40) + 100)) << s.launch_engine_ns[0];
  const std::array<std::uint64_t, 5> counts = {1, 1, 1, 1, 0};
  for (std::size_t b = 0; b < counts.size(); ++b) EXPECT_EQ(s.launch_hist_calls[b], counts[b]) << "bucket " << b;
  EXPECT_EQ(s.launch_hist_calls[k_launch_hist - 1], 1u);
  EXPECT_TRUE(near(s.launch_hist_ns[3], 5000)) << s.launch_hist_ns[3];
  // Each bucket's upper bound is the next one's lower: 2^10 ticks doubling; the last has none.
  EXPECT_TRUE(near(s.launch_hist_upper_ns[0], 1024)) << s.launch_hist_upper_ns[0];
  EXPECT_TRUE(near(s.launch_hist_upper_ns[3], 8192)) << s.launch_hist_upper_ns[3];
  EXPECT_EQ(s.launch_hist_upper_ns[k_launch_hist - 1], 0u);
  std::uint64_t total = 0;
  for (std::uint64_t n : s.launch_hist_calls) total += n;
  EXPECT_EQ(total, 5u);
}

// LAYERSWAP_STATS under LAYERSWAP_TRACK=attribute: the states by total time, and the launches of 16 us or more.
TEST(TrackerCore, AttributionReportListsTheStatesByTotalAndTheSlowLaunches) {
  tracker_stats s;
  EXPECT_EQ(attribution_report(s), "") << "nothing attributed: no line";
  const auto map_state = static_cast<std::size_t>(driver_calls::kind::map) + 1;
  s.launch_engine_calls[0] = 4;
  s.launch_engine_ns[0] = 20'000'000;  // 5 ms each
  s.launch_engine_calls[map_state] = 2;
  s.launch_engine_ns[map_state] = 60'000'000;  // 30 ms each: the larger total, first
  for (std::size_t b = 0; b + 1 < k_launch_hist; ++b) s.launch_hist_upper_ns[b] = 500ull << b;  // 0.5, 1, 2, ... us
  s.launch_hist_calls[3] = 4;   // 4-8 us
  s.launch_hist_ns[3] = 20'000;
  s.launch_hist_calls[6] = 2;   // 32-64 us: lower bound 16 us (bucket 5's upper)
  s.launch_hist_ns[6] = 90'000'000;
  EXPECT_EQ(attribution_report(s),
            "layerswap: launches' time in the driver by the migration thread's driver call they met: map 2 x 30000.0 us "
            "= 60.0 ms; none 4 x 5000.0 us = 20.0 ms; 2 launches of 16 us or more (90.0 ms)\n");
}

TEST(TrackerCore, ManyRegionsContinueInFurtherEvents) {
  tracker_core core;
  region_set many;
  for (region_id id = 1; id <= 100; ++id) many.add(id);
  core.record(launch_kind::kernel, 0, 0, undecoded_reason::none, many);
  core.record(launch_kind::kernel, 0, 0, undecoded_reason::none, regions_of({5}));
  const auto events = core.drain(10);
  ASSERT_EQ(events.size(), 2u);
  ASSERT_EQ(events[0].regions.size(), 100u);
  EXPECT_EQ(events[0].regions[99], 100u);
  EXPECT_EQ(core.stats().launches, 2u);
}

TEST(TrackerCore, FullRingDropsAndCounts) {
  tracker_options options;
  options.ring_capacity = 8;
  tracker_core core(options);
  for (int i = 0; i < 20; ++i) core.record(launch_kind::kernel, 0, 0, undecoded_reason::none, regions_of({1}));
  const tracker_stats s = core.stats();
  EXPECT_EQ(s.launches, 8u);
  EXPECT_EQ(s.dropped, 12u);
}

TEST(TrackerCore, ConsumerThreadWithConcurrentProducers) {
  tracker_options options;
  options.ring_capacity = 1024;
  options.recent_capacity = 1000;
  tracker_core core(options);
  core.start_consumer();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      region_set s;
      for (int i = 0; i < 20'000; ++i) {
        s.clear();
        s.add(static_cast<region_id>(t + 1));
        core.record(launch_kind::kernel, static_cast<std::uint64_t>(t), 0, undecoded_reason::none, s);
        if (i % 64 == 0) std::this_thread::yield();
      }
    });
  }
  for (auto& th : threads) th.join();
  core.stop_consumer();
  const tracker_stats s = core.stats();
  EXPECT_EQ(s.launches + s.dropped, 80'000u);
  EXPECT_GT(s.launches, 0u);
  EXPECT_EQ(s.recent_dropped, s.launches - 1000);
  const auto events = core.drain(2000);
  EXPECT_EQ(events.size(), 1000u);
  for (const auto& e : events) {
    ASSERT_EQ(e.regions.size(), 1u);
    EXPECT_EQ(e.regions[0], e.stream + 1);
  }
}

// Note [Idle consumer]: with nothing recorded the consumer falls asleep (and stays asleep: its sleep here is 10 s);
// the next record() wakes it, and it falls asleep again once idle; stopping it does not wait for the sleep's end.
TEST(TrackerCore, IdleConsumerSleepsUntilTheNextLaunch) {
  using namespace std::chrono_literals;
  tracker_options options;
  options.idle_sleep = 10s;
  tracker_core core(options);
  const auto sleeps_reach = [&](std::uint64_t n, std::chrono::milliseconds within) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (core.stats().consumer_sleeps < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(2ms);
    }
    return true;
  };
  core.start_consumer();
  ASSERT_TRUE(sleeps_reach(1, 5000ms)) << "the consumer never fell asleep";
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(core.stats().consumer_sleeps, 1u) << "an idle consumer kept waking";
  core.record(launch_kind::kernel, 0, 0, undecoded_reason::none, regions_of({1}));
  EXPECT_TRUE(sleeps_reach(2, 3000ms)) << "the launch did not wake the consumer";
  const auto start = std::chrono::steady_clock::now();
  core.stop_consumer();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s) << "stopping waited for the sleep";
  EXPECT_EQ(core.stats().launches, 1u);
}

// At the end of an idle sleep with nothing recorded the consumer polls once and sleeps again at once, rather than
// polling k_idle_polls times first.
TEST(TrackerCore, IdleConsumerSleepsAgainAtTheEndOfItsSleep) {
  using namespace std::chrono_literals;
  tracker_options options;
  options.idle_sleep = 10ms;
  tracker_core core(options);
  core.start_consumer();
  std::this_thread::sleep_for(500ms);
  core.stop_consumer();
  // About 16 ms of polls, then a sleep every 10 ms: ~48 in 500 ms; with 16 polls before each sleep, ~18.
  EXPECT_GE(core.stats().consumer_sleeps, 30u);
}

// ---- the trace file ----

// The residency engine's own work on its streams (copies, and the digest kernels of residency.cpp's Note
// [Write-back]) is no use of the regions it moves: the recorder leaves it out of the gate and the access stream,
// or every move would abandon itself.
TEST(LaunchRecorder, LaunchesOnTheEngineStreamsAreLeftOut) {
  constexpr std::uint64_t base = std::uint64_t{0x7e} << 40;
  const published_arena arena(base, std::size_t{64} << 20, 21);
  const region_id id = region_map::next_region_id();
  arena.publish(0, 2, id);
  residency_gate::prepare(id);  // as the allocator does for its regions
  tracker_core core;
  fake_functions fake;
  thread_scratch& t = this_thread_scratch();
  std::uint64_t pointer = base + 4096;
  void* args[] = {&pointer};
  constexpr std::uint64_t engine_stream = 0xe1e1e0;
  residency_gate::add_internal_stream(engine_stream);
  const std::uint64_t before = residency_gate::sequence(id);
  for (const std::uint64_t stream : {engine_stream, std::uint64_t{0x5000}}) {
    t.gate.open();
    record_kernel(core, t, fake_functions::query, 1, "kernel_with_one_pointer", stream, args, nullptr);
    t.gate.close();
    t.gate.open();
    record_copy(core, t, launch_kind::memcpy, stream, base + 8192, 0);
    t.gate.close();
    const tracker_stats s = core.stats();
    if (stream == engine_stream) {
      EXPECT_EQ(s.launches, 0u) << "the engine's kernel or copy was recorded";
      EXPECT_EQ(residency_gate::sequence(id), before) << "the engine's kernel or copy counted as a use";
    } else {
      EXPECT_EQ(s.launches, 2u);
      EXPECT_EQ(s.with_regions, 2u);
      EXPECT_EQ(residency_gate::sequence(id), before + 2);
    }
  }
  residency_gate::remove_internal_stream(engine_stream);
}

// Note [Work elsewhere] (launch_recorder.hpp): an NCCL kernel whose arguments name no region reads its work from
// NCCL's FIFO, so it may touch any region: an unknown launch. One whose arguments name a region, and any other
// kernel naming none, are recorded as usual. The name is read once, by the function's first named launch.
TEST(LaunchRecorder, AnNcclKernelWhoseArgumentsNameNoRegionIsAnUnknownLaunch) {
  constexpr std::uint64_t base = std::uint64_t{0x7c} << 40;
  const published_arena arena(base, std::size_t{64} << 20, 21);
  const region_id id = region_map::next_region_id();
  const region_id other = region_map::next_region_id();
  arena.publish(0, 2, id);
  arena.publish(2, 2, other);
  residency_gate::prepare(id);
  residency_gate::prepare(other);
  tracker_core core;
  fake_functions fake;
  thread_scratch& t = this_thread_scratch();
  constexpr const char* nccl = "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE";
  constexpr const char* old_nccl = "ncclKernel_AllReduce_RING_LL_Sum_float";
  EXPECT_TRUE(takes_work_elsewhere(nccl));
  EXPECT_TRUE(takes_work_elsewhere(old_nccl));
  EXPECT_FALSE(takes_work_elsewhere("_ZN2at6native29vectorized_elementwise_kernelILi4EEEvv"));
  EXPECT_FALSE(takes_work_elsewhere(nullptr));
  const std::uint64_t in_region = base + 4096;
  const std::uint64_t outside = 0x1234'5678;  // pinned host memory: NCCL's FIFO
  // One 8-byte parameter (function ids 1 and 8: id % 7 parameters).
  const auto launch = [&](std::uint64_t function, const char* name, std::uint64_t pointer) {
    void* args[] = {&pointer};
    t.gate.open();
    record_kernel(core, t, fake_functions::query, function, name, 0x5000, args, nullptr);
    t.gate.close();
  };
  const auto unknown_launches = [&] {
    return core.stats().undecoded[static_cast<int>(undecoded_reason::work_elsewhere)];
  };
  for (int round = 0; round < 2; ++round) {  // the first fills the layout cache, the second reads it
    const std::uint64_t id_before = residency_gate::sequence(id);
    const std::uint64_t other_before = residency_gate::sequence(other);
    const std::uint64_t unknown_before = unknown_launches();
    launch(8, nccl, outside);
    EXPECT_EQ(unknown_launches(), unknown_before + 1) << "round " << round;
    EXPECT_EQ(residency_gate::sequence(id), id_before + 1) << "an NCCL kernel naming no region may touch any region";
    EXPECT_EQ(residency_gate::sequence(other), other_before + 1);
    launch(8, nccl, in_region);
    EXPECT_EQ(unknown_launches(), unknown_before + 1) << "an NCCL kernel naming its buffer is decoded";
    EXPECT_EQ(residency_gate::sequence(id), id_before + 2);
    EXPECT_EQ(residency_gate::sequence(other), other_before + 1);
    launch(1, "kernel_with_one_pointer", outside);
    EXPECT_EQ(unknown_launches(), unknown_before + 1) << "another kernel naming no region is not unknown";
    EXPECT_EQ(residency_gate::sequence(other), other_before + 1);
  }
  const tracker_stats s = core.stats();
  EXPECT_EQ(s.launches, 6u);
  EXPECT_EQ(s.decoded, 4u);
}

// Note [Pointer tables] (launch_recorder.hpp): PyTorch's split_with_sizes_copy and _chunk_cat (FSDP2's copy-out
// and copy-in) copy a pack of tensor addresses from pinned host memory to the device and pass the kernel only the
// pack's address. The tensors must reach the gate and the access stream with the kernel's own regions.
TEST(LaunchRecorder, APackOfAddressesCopiedFromTheHostAddsItsRegionsToTheKernelThatReadsIt) {
  constexpr std::uint64_t base = std::uint64_t{0x7d} << 40;
  constexpr std::uint64_t gran = std::uint64_t{2} << 20;
  const published_arena arena(base, std::size_t{128} << 20, 21);
  std::vector<region_id> ids;  // 0: the pack's (a slab), 1..3: tensors, 4: a bystander, 5..44: many more
  for (int i = 0; i < 45; ++i) {
    ids.push_back(region_map::next_region_id());
    arena.publish(static_cast<std::size_t>(i), 1, ids.back());
    residency_gate::prepare(ids.back());
  }
  const auto at = [&](int i, std::uint64_t offset = 0) { return base + static_cast<std::uint64_t>(i) * gran + offset; };
  tracker_core core;
  thread_scratch& t = this_thread_scratch();
  constexpr std::uint64_t stream = 0x5100;
  const std::uint64_t pack_dst = at(0, 4096);
  // The pack as split_with_sizes_copy lays it out: addresses among sizes and strides.
  const std::uint64_t pack[] = {at(1), 4096, at(2, 512), 1, 0, at(3, 8)};
  const auto copy = [&](std::uint64_t dst, const void* host, std::size_t bytes) {
    t.gate.open();
    record_host_copy(core, t, stream, dst, host, bytes);
    t.gate.close();
  };
  const auto kernel = [&](std::uint64_t pointer) {  // function 2: two 8-byte parameters, the pointer and a count
    std::uint64_t count = 9;
    void* args[] = {&pointer, &count};
    t.gate.open();
    record_kernel(core, t, fake_functions::query, 2, "split_with_sizes_copy_out_contiguous_no_cast_kernel", stream,
                  args, nullptr);
    t.gate.close();
    const auto events = core.drain(10);
    return events.empty() ? std::set<region_id>{} : std::set<region_id>(events.back().regions.begin(),
                                                                          events.back().regions.end());
  };
  (void)core.drain(100);
  const std::uint64_t tensor_uses = residency_gate::sequence(ids[2]);
  copy(pack_dst, pack, sizeof pack);
  EXPECT_EQ(t.tables_live, 1u);
  EXPECT_EQ(kernel(pack_dst), (std::set<region_id>{ids[0], ids[1], ids[2], ids[3]}));
  EXPECT_EQ(residency_gate::sequence(ids[2]), tensor_uses + 1) << "the tensor did not enter the gate";
  EXPECT_EQ(core.stats().pointer_tables, 1u);
  EXPECT_EQ(core.stats().table_launches, 1u);
  // The same slab outside the pack's range, and another region: only what the arguments point at.
  EXPECT_EQ(kernel(at(0, 65536)), (std::set<region_id>{ids[0]}));
  EXPECT_EQ(kernel(at(4)), (std::set<region_id>{ids[4]}));
  // A copy of data (token ids) into the same range: the pack is gone, and no table is made of it.
  const std::uint64_t tokens[] = {17, 4242, 31999, 0};
  copy(pack_dst, tokens, sizeof tokens);
  EXPECT_EQ(t.tables_live, 0u);
  EXPECT_EQ(kernel(pack_dst), (std::set<region_id>{ids[0]}));
  // A table applies to the next k_table_lifetime kernels of the thread only.
  copy(pack_dst, pack, sizeof pack);
  for (std::uint64_t i = 1; i < k_table_lifetime; ++i) (void)kernel(at(4));
  EXPECT_EQ(kernel(pack_dst).size(), 4u);  // the k_table_lifetime-th
  EXPECT_EQ(kernel(pack_dst), (std::set<region_id>{ids[0]}));
  EXPECT_EQ(t.tables_live, 0u);
  // A pack as large as split_with_sizes_copy's on a big layer: the addresses first, then a word per thread block.
  std::vector<std::uint64_t> big(4400, 2);
  big[0] = at(1);
  big[1] = at(2);
  big.back() = at(3);  // past the scanned words: not seen
  copy(at(0, 1 << 20), big.data(), big.size() * sizeof(std::uint64_t));
  EXPECT_EQ(kernel(at(0, (1 << 20) + 8 * 4000)), (std::set<region_id>{ids[0], ids[1], ids[2]}));
  // More tables than a thread keeps: the oldest goes.
  for (int i = 0; i <= k_pointer_tables; ++i) copy(at(0, 4096 + 64 * static_cast<std::uint64_t>(i)), pack, 16);
  EXPECT_EQ(t.tables_live, static_cast<std::uint32_t>(k_pointer_tables));
  EXPECT_EQ(kernel(at(0, 4096)), (std::set<region_id>{ids[0]}));
  EXPECT_EQ(kernel(at(0, 4096 + 64)), (std::set<region_id>{ids[0], ids[1]}));
  // A pack with more regions than a table holds: its kernel is an unknown launch (every region's sequence moves).
  std::vector<std::uint64_t> many;
  for (int i = 5; i < 45; ++i) many.push_back(at(i));
  copy(at(0, 8192), many.data(), many.size() * sizeof(std::uint64_t));
  const std::uint64_t bystander = residency_gate::sequence(ids[4]);
  EXPECT_EQ(kernel(at(0, 8192)).size(), 1u + k_table_regions);
  EXPECT_EQ(residency_gate::sequence(ids[4]), bystander + 1) << "the overflowing table's kernel was not unknown";
  // A copy on the engine's own stream is not the program's: no table.
  for (int i = 0; i < 3 * static_cast<int>(k_table_lifetime); ++i) (void)kernel(at(4));
  EXPECT_EQ(t.tables_live, 0u);
  residency_gate::add_internal_stream(stream + 1);
  t.gate.open();
  record_host_copy(core, t, stream + 1, pack_dst, pack, sizeof pack);
  t.gate.close();
  residency_gate::remove_internal_stream(stream + 1);
  EXPECT_EQ(t.tables_live, 0u);
}

TEST(TraceWriter, WritesBoundedChromeJson) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  // Keep our own handle to read back: write through a duplicate.
  const int fd = dup(fileno(f));
  std::FILE* w = fdopen(fd, "w");
  ASSERT_NE(w, nullptr);
  trace_writer trace;
  trace.open(w, 2);
  access_event e;
  e.launch_no = 41;
  e.stream = 0x10;
  e.time_ns = 5'000'250;
  e.nregions = 2;
  e.regions[0] = 3;
  e.regions[1] = 4;
  trace.write(e, "kern\"el", 1'000'000);
  e.launch_no = 42;
  e.kind = launch_kind::memcpy;
  e.nregions = 0;
  trace.write(e, "memcpy", 1'000'000);
  trace.write(e, "memcpy", 1'000'000);
  EXPECT_EQ(trace.written(), 2u);
  EXPECT_EQ(trace.skipped(), 1u);
  trace.close();
  std::rewind(f);
  std::string text;
  char chunk[512];
  std::size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) text.append(chunk, n);
  std::fclose(f);
  EXPECT_EQ(text.rfind("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[", 0), 0u) << text;
  EXPECT_NE(text.find("\"name\":\"kern\\\"el\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"ts\":4000.250"), std::string::npos) << text;
  EXPECT_NE(text.find("\"launch\":41,\"regions\":[3,4]"), std::string::npos) << text;
  EXPECT_NE(text.find("\"cat\":\"memcpy\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"events_not_written\":1}}"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '{'), std::count(text.begin(), text.end(), '}'));
}
