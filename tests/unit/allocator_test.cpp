// Allocator invariants on the simulated device: stream-ordered reuse, record_stream, budget, reclaim fences,
// empty_cache, statistics, and long random traces over several streams checked against a shadow model.
#include "allocator/caching_allocator.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <random>
#include <ranges>
#include <thread>
#include <vector>

#include "runtime/error.hpp"
#include "runtime/sim_driver.hpp"

namespace layerswap {
namespace {

constexpr std::size_t k_kib = std::size_t{1} << 10;
constexpr std::size_t k_mib = std::size_t{1} << 20;

device_ptr dp(void* p) { return reinterpret_cast<device_ptr>(p); }

void expect_clean(const sim_driver& sim) {
  const auto v = sim.violations();
  EXPECT_TRUE(v.empty()) << v.size() << " simulator violations, first: " << (v.empty() ? "" : v.front());
}

void write(sim_driver& sim, stream_handle s, void* p, std::size_t bytes, std::uint8_t tag) {
  // Touch the first, middle and last bytes of the block: enough to see overlap, cheap for big blocks.
  const std::size_t span = std::min<std::size_t>(bytes, 64);
  const sim_driver::access a[] = {{dp(p), span, true, tag},
                                  {dp(p) + bytes / 2 - std::min(bytes / 2, span / 2), span, true, tag},
                                  {dp(p) + bytes - span, span, true, tag}};
  sim.launch(s, a);
}

// A simulated device whose launches stay pending until run (not eager), its allocator and two streams.
struct lazy_two_streams {
  static sim_options lazy() {
    sim_options o;
    o.eager = false;
    return o;
  }
  sim_driver sim{lazy()};
  caching_allocator alloc{sim, {}};
  stream_handle a = sim.create_stream();
  stream_handle b = sim.create_stream();
};

TEST(Allocator, SmallAndLargeBlocksAreDistinctAndReadable) {
  sim_driver sim;
  caching_allocator alloc(sim, {});
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t bytes : {std::size_t{1}, 512 * std::size_t{1}, 513 * std::size_t{1}, 4 * k_kib, 100 * k_kib,
                            k_mib, k_mib + 1, 3 * k_mib, 17 * k_mib}) {
    void* p = alloc.allocate(bytes, nullptr);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(dp(p) % 512, 0u);
    blocks.emplace_back(p, bytes);
  }
  for (auto& [p, n] : blocks) {
    std::vector<std::byte> data(n, std::byte{0x5a});
    sim.host_write(dp(p), data);
  }
  for (auto& [p, n] : blocks) {
    std::vector<std::byte> back(n);
    sim.host_read(dp(p), back);
    EXPECT_TRUE(std::all_of(back.begin(), back.end(), [](std::byte b) { return b == std::byte{0x5a}; }));
  }
  alloc.verify();
  const allocator_stats st = alloc.stats();
  EXPECT_EQ(st.all.allocations.current, 9);
  EXPECT_EQ(st.small.allocations.current + st.large.allocations.current, 9);
  for (auto& [p, n] : blocks) EXPECT_TRUE(alloc.deallocate(p));
  alloc.verify();
  EXPECT_EQ(alloc.stats().all.allocated_bytes.current, 0);
  EXPECT_EQ(alloc.stats().all.allocated_bytes.peak, st.all.allocated_bytes.current);
  expect_clean(sim);
}

TEST(Allocator, ForeignPointersAreRefusedAndCounted) {
  sim_driver sim;
  caching_allocator alloc(sim, {});
  void* p = alloc.allocate(4 * k_mib, nullptr);
  int local = 0;
  EXPECT_FALSE(alloc.deallocate(&local));
  EXPECT_FALSE(alloc.deallocate(static_cast<char*>(p) + 512));  // interior pointer
  EXPECT_TRUE(alloc.deallocate(p));
  EXPECT_FALSE(alloc.deallocate(p));  // double free
  EXPECT_EQ(alloc.stats().num_foreign_frees, 3);
  alloc.verify();
}

// Note [Free without a second lock]: in_arena() answers for the VA the allocator reserved, without its mutex (held
// here by another thread, so a locking answer would block); owns() is the exact answer, under the mutex.
TEST(Allocator, InArenaAnswersWithoutTheMutexAndOwnsStaysExact) {
  sim_driver sim;
  allocator_options opts;
  opts.va_reserve = 8 * k_mib;  // small arenas, so that a second one is reserved
  caching_allocator alloc(sim, opts);
  void* small = alloc.allocate(4096, nullptr);
  void* large = alloc.allocate(6 * k_mib, nullptr);
  void* other = alloc.allocate(6 * k_mib, nullptr);  // does not fit beside `large`: a new arena
  int local = 0;
  std::atomic<bool> held{false}, release{false};
  std::thread holder([&] {
    alloc.with_lock_for_test([&] {
      held = true;
      while (!release) std::this_thread::yield();
    });
  });
  while (!held) std::this_thread::yield();
  EXPECT_TRUE(alloc.in_arena(small));
  EXPECT_TRUE(alloc.in_arena(large));
  EXPECT_TRUE(alloc.in_arena(static_cast<char*>(large) + 6 * k_mib - 1));
  EXPECT_TRUE(alloc.in_arena(other));
  EXPECT_FALSE(alloc.in_arena(&local));
  release = true;
  holder.join();
  EXPECT_TRUE(alloc.owns(large));
  EXPECT_TRUE(alloc.deallocate(large));
  alloc.empty_cache();  // the segment is destroyed: its VA stays reserved
  EXPECT_TRUE(alloc.in_arena(large));
  EXPECT_FALSE(alloc.owns(large));
  EXPECT_FALSE(alloc.deallocate(large));  // in the arena, but no live block: refused and counted
  EXPECT_EQ(alloc.stats().num_foreign_frees, 1);
  for (void* p : {small, other}) EXPECT_TRUE(alloc.deallocate(p));
  alloc.verify();
}

TEST(Allocator, FreedBlockIsReusedAtOnceOnItsStreamOnly) {
  lazy_two_streams t;
  auto& [sim, alloc, a, b] = t;
  for (std::size_t bytes : {64 * k_kib, 8 * k_mib}) {
    void* p = alloc.allocate(bytes, a);
    write(sim, a, p, bytes, 1);  // pending on a
    alloc.deallocate(p);
    void* q = alloc.allocate(bytes, b);
    EXPECT_NE(q, p) << "a block freed on stream a with pending work went to stream b";
    EXPECT_FALSE(sim.pending_touches(dp(q), bytes, b));
    void* r = alloc.allocate(bytes, a);
    EXPECT_EQ(r, p) << "same-stream reuse should be immediate";
    alloc.deallocate(q);
    alloc.deallocate(r);
  }
  EXPECT_EQ(alloc.stats().num_host_waits, 0) << "no allocation here needed a host wait";
  sim.run_all();
  alloc.verify();
  expect_clean(sim);
}

// Note [Slabs change class]: a request of a class with no free block takes an idle slab of another class on its own
// stream (no new pages, no driver call); never one of another stream, nor one whose blocks are live or pending.
TEST(Allocator, AnIdleSlabTakesAnotherClassOnItsStreamOnly) {
  lazy_two_streams t;
  auto& [sim, alloc, a, b] = t;
  std::vector<void*> grads;
  for (int i = 0; i < 16; ++i) {  // 16 x 128 KiB: one 2 MiB slab
    grads.push_back(alloc.allocate(128 * k_kib, a));
    write(sim, a, grads.back(), 128 * k_kib, static_cast<std::uint8_t>(i + 1));  // pending on a
  }
  const device_ptr slab_lo = std::ranges::min(grads | std::views::transform(dp));
  void* held = alloc.allocate(128 * k_kib, a);  // a second slab, kept busy
  alloc.record_stream(held, b);
  write(sim, b, held, 128 * k_kib, 0x77);
  for (void* p : grads) alloc.deallocate(p);
  alloc.deallocate(held);  // pending on b: its slab is not idle
  const std::int64_t segments = alloc.stats().all.segments.current;
  const std::int64_t device_allocs = alloc.stats().num_device_alloc;

  void* other = alloc.allocate(512 * k_kib, b);  // stream b: never a's idle slab
  EXPECT_EQ(alloc.stats().num_slab_reuses, 0);
  EXPECT_FALSE(dp(other) >= slab_lo && dp(other) < slab_lo + 2 * k_mib);
  EXPECT_EQ(alloc.stats().all.segments.current, segments + 1);

  void* act = alloc.allocate(512 * k_kib, a);  // stream a: the idle slab, as a slab of 512 KiB blocks
  EXPECT_EQ(alloc.stats().num_slab_reuses, 1);
  EXPECT_TRUE(dp(act) >= slab_lo && dp(act) < slab_lo + 2 * k_mib) << "not the idle slab's memory";
  EXPECT_EQ(alloc.stats().all.segments.current, segments + 1) << "a slab was made for stream a";
  EXPECT_EQ(alloc.stats().num_device_alloc, device_allocs + 1) << "only stream b's slab created pages";
  EXPECT_FALSE(sim.pending_touches(dp(act), 512 * k_kib, a)) << "another stream's work is pending there";
  EXPECT_TRUE(sim.pending_touches(dp(act), 512 * k_kib, b)) << "the old blocks' work done: not a reuse in order";
  write(sim, a, act, 512 * k_kib, 0x42);
  alloc.verify();
  std::vector<void*> more;  // the rest of the slab's 512 KiB blocks, then a new slab
  for (int i = 0; i < 4; ++i) more.push_back(alloc.allocate(512 * k_kib, a));
  EXPECT_EQ(alloc.stats().num_slab_reuses, 1) << "the busy slab (pending on b) was taken";
  alloc.verify();
  for (void* p : more) alloc.deallocate(p);
  alloc.deallocate(act);
  alloc.deallocate(other);
  sim.run_all();
  alloc.verify();
  expect_clean(sim);
}

TEST(Allocator, RecordStreamDelaysReuseUntilTheOtherStreamIsDone) {
  lazy_two_streams t;
  auto& [sim, alloc, a, b] = t;
  for (std::size_t bytes : {100 * k_kib, 6 * k_mib}) {
    void* p = alloc.allocate(bytes, a);
    alloc.record_stream(p, b);
    write(sim, b, p, bytes, 7);  // b still reads/writes it
    alloc.deallocate(p);
    EXPECT_EQ(alloc.stats().all.allocations.current, 0);
    EXPECT_EQ(alloc.stats().all.active.current, 1) << "the block stays active until b is done";
    void* q = alloc.allocate(bytes, a);
    EXPECT_NE(q, p) << "reused while stream b may still use it";
    EXPECT_FALSE(sim.pending_touches(dp(q), bytes, a));
    alloc.verify();
    sim.run_all();  // b finishes
    void* r = alloc.allocate(bytes, a);
    EXPECT_EQ(r, p) << "after b completed the block is free again";
    alloc.deallocate(q);
    alloc.deallocate(r);
    sim.run_all();
  }
  alloc.verify();
  expect_clean(sim);
}

TEST(Allocator, BudgetIsNeverExceededAndOomNamesIt) {
  sim_driver sim;
  allocator_options opts;
  opts.budget = 8 * k_mib;
  caching_allocator alloc(sim, opts);
  void* a = alloc.allocate(3 * k_mib, nullptr);  // 2 pages
  void* b = alloc.allocate(3 * k_mib, nullptr);  // 2 pages
  try {
    (void)alloc.allocate(6 * k_mib, nullptr);
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("LAYERSWAP_BUDGET"), std::string::npos) << m;
    EXPECT_NE(m.find("8.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("6.00 MiB"), std::string::npos) << m;
  }
  EXPECT_EQ(alloc.stats().num_ooms, 1);
  EXPECT_LE(alloc.stats().device_bytes.peak, static_cast<std::int64_t>(opts.budget));
  alloc.deallocate(a);
  alloc.deallocate(b);
  // 8 MiB needs all four pages: the two cached 4 MiB segments must be reclaimed.
  void* c = alloc.allocate(8 * k_mib, nullptr);
  EXPECT_NE(c, nullptr);
  EXPECT_GE(alloc.stats().num_alloc_retries, 1);
  EXPECT_LE(sim.live_device_bytes(), opts.budget);
  alloc.deallocate(c);
  alloc.verify();
  expect_clean(sim);
}

TEST(Allocator, ImpossibleRequestFailsWithoutTouchingTheDevice) {
  sim_driver sim;
  allocator_options opts;
  opts.budget = 8 * k_mib;
  caching_allocator alloc(sim, opts);
  void* keep = alloc.allocate(2 * k_mib, nullptr);
  EXPECT_THROW((void)alloc.allocate(10 * k_mib, nullptr), out_of_memory);
  EXPECT_EQ(alloc.stats().num_device_alloc, 1) << "pages were created for a request that could never fit";
  EXPECT_EQ(sim.live_device_bytes(), 2 * k_mib);
  alloc.deallocate(keep);
  alloc.verify();
}

// A lazy simulated device, an allocator with an 8 MiB budget, and three streams.
struct lazy_8mib {
  static allocator_options budget() {
    allocator_options opts;
    opts.budget = 8 * k_mib;
    return opts;
  }
  sim_driver sim{lazy_two_streams::lazy()};
  caching_allocator alloc{sim, budget()};
  stream_handle a = sim.create_stream();
  stream_handle b = sim.create_stream();
  stream_handle c = sim.create_stream();
};

TEST(Allocator, ReclaimWaitsForPendingWorkBeforeUnmapping) {
  lazy_8mib f;
  auto& [sim, alloc, a, b, c] = f;
  void* p = alloc.allocate(8 * k_mib, a);
  write(sim, a, p, 8 * k_mib, 3);
  alloc.deallocate(p);
  ASSERT_GT(sim.pending(a), 0u);
  void* q = alloc.allocate(4 * k_mib, b);  // must take p's pages: only after a's kernel ran
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(sim.pending(a), 0u) << "the reclaim should have waited for stream a";
  EXPECT_GE(alloc.stats().num_host_waits, 1);
  expect_clean(sim);  // no unmap under a pending launch
  alloc.deallocate(q);
  sim.run_all();
  alloc.verify();
}

// Note [Unmap fences]: a block made on stream a and used on stream b without record_stream, which the program
// orders by events, as FSDP2 does with its reduce-scatter output (made on its reduce-scatter stream, read and
// written by the optimizer on the compute stream, freed by zero_grad). PyTorch hands it out again only on a,
// after the program's own waits; a reclaim unmaps it, and must wait for b too.
TEST(Allocator, ReclaimWaitsForStreamsThatUsedTheBlockWithoutRecordStream) {
  lazy_8mib f;
  auto& [sim, alloc, a, b, c] = f;
  void* held = alloc.allocate(4 * k_kib, b);  // b is a stream the allocator knows: it allocated there
  void* p = alloc.allocate(8 * k_mib - 2 * k_mib, a);
  write(sim, a, p, 64, 3);
  event_handle ready = sim.create_event();
  sim.record(ready, a);
  sim.stream_wait(b, ready);
  write(sim, b, p, 8 * k_mib - 2 * k_mib, 4);  // b's optimizer kernel, still pending, writes the block
  alloc.deallocate(p);                         // freed on the host, no record_stream
  while (sim.pending(a) != 0) sim.run_one(a);  // a is past everything it was given
  void* q = alloc.allocate(6 * k_mib, c);  // another stream: must take p's pages, unmapped from its VA
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(sim.pending(b), 0u) << "the reclaim should have waited for stream b";
  expect_clean(sim);  // no unmap under b's pending write
  alloc.deallocate(q);
  alloc.deallocate(held);
  sim.run_all();
  sim.destroy_event(ready);
  alloc.verify();
}

TEST(Allocator, DeviceFullFallsBackToTheCache) {
  sim_options o;
  o.total_memory = 16 * k_mib;
  sim_driver sim(o);
  caching_allocator alloc(sim, {});  // no budget: the device itself is the limit
  void* a = alloc.allocate(10 * k_mib, nullptr);
  alloc.deallocate(a);
  void* b = alloc.allocate(12 * k_mib, nullptr);  // needs a's pages back
  EXPECT_NE(b, nullptr);
  EXPECT_THROW((void)alloc.allocate(8 * k_mib, nullptr), out_of_memory);
  alloc.deallocate(b);
  alloc.verify();
  expect_clean(sim);
}

TEST(Allocator, EmptyCacheReturnsEverythingNotInUse) {
  sim_driver sim;
  caching_allocator alloc(sim, {});
  std::vector<void*> ps;
  for (int i = 0; i < 20; ++i) ps.push_back(alloc.allocate((i % 2 ? 3 * k_mib : 1000), nullptr));
  void* keep = alloc.allocate(5 * k_mib, nullptr);
  for (void* p : ps) alloc.deallocate(p);
  EXPECT_GT(alloc.stats().cached_bytes, 0);
  alloc.empty_cache();
  alloc.verify();
  const allocator_stats st = alloc.stats();
  EXPECT_EQ(st.device_bytes.current, 6 * static_cast<std::int64_t>(k_mib));
  EXPECT_EQ(st.cached_bytes, 0);  // the 6 MiB segment of `keep` counts as allocated (rounded sizes)
  EXPECT_EQ(sim.live_device_bytes(), 6 * k_mib);
  alloc.deallocate(keep);
  alloc.empty_cache();
  EXPECT_EQ(sim.live_device_bytes(), 0u);
  EXPECT_EQ(alloc.stats().all.reserved_bytes.current, 0);
  expect_clean(sim);
}

TEST(Allocator, PeakAndAccumulatedStatsReset) {
  sim_driver sim;
  caching_allocator alloc(sim, {});
  void* a = alloc.allocate(20 * k_mib, nullptr);
  void* b = alloc.allocate(4 * k_mib, nullptr);
  alloc.deallocate(a);
  EXPECT_EQ(alloc.stats().num_calls, 3) << "two allocations and a free";
  EXPECT_GT(alloc.stats().call_ns, 0);
  EXPECT_GT(alloc.stats().segment_new_ns, 0) << "two segments were made";
  EXPECT_EQ(alloc.stats().all.allocated_bytes.peak, static_cast<std::int64_t>(24 * k_mib));
  alloc.reset_peak_stats();
  EXPECT_EQ(alloc.stats().all.allocated_bytes.peak, static_cast<std::int64_t>(4 * k_mib));
  EXPECT_GT(alloc.stats().all.allocated_bytes.allocated, 0);
  alloc.reset_accumulated_stats();
  EXPECT_EQ(alloc.stats().all.allocated_bytes.allocated, 0);
  EXPECT_EQ(alloc.stats().num_calls, 0);
  EXPECT_EQ(alloc.stats().segment_new_ns, 0);
  EXPECT_EQ(alloc.stats().all.allocated_bytes.current, static_cast<std::int64_t>(4 * k_mib));
  alloc.deallocate(b);
  alloc.verify();
}

TEST(Allocator, SlabsPackSmallBlocks) {
  sim_driver sim;
  caching_allocator alloc(sim, {});
  std::vector<void*> ps;
  for (int i = 0; i < 4096; ++i) ps.push_back(alloc.allocate(512, nullptr));
  // 4096 blocks of 512 B fit in exactly one 2 MiB slab.
  EXPECT_EQ(alloc.stats().small.segments.current, 1);
  EXPECT_EQ(alloc.stats().device_bytes.current, static_cast<std::int64_t>(2 * k_mib));
  std::vector<void*> sorted = ps;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_EQ(dp(sorted.back()) - dp(sorted.front()), 4095u * 512);
  ps.push_back(alloc.allocate(300, nullptr));  // the 4097th needs a second slab
  EXPECT_EQ(alloc.stats().small.segments.current, 2);
  auto [base, size] = alloc.block_of(static_cast<char*>(ps[10]) + 100);
  EXPECT_EQ(base, ps[10]);
  EXPECT_EQ(size, 512u);
  for (void* p : ps) alloc.deallocate(p);
  alloc.verify();
}

// A shadow model of live allocations against which every result of a long random trace is checked.
struct shadow_block {
  std::size_t bytes;
  stream_handle stream;
  std::uint8_t tag;
  bool written;
};

void random_trace(std::uint64_t seed, std::size_t budget, bool eager, int steps) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  sim_options o;
  o.eager = eager;
  o.total_memory = 192 * k_mib;
  sim_driver sim(o);
  allocator_options opts;
  opts.budget = budget;
  caching_allocator alloc(sim, opts);
  std::vector<stream_handle> streams = {nullptr, sim.create_stream(), sim.create_stream()};
  std::map<device_ptr, shadow_block> live;
  std::uint8_t next_tag = 1;
  int ooms = 0;
  std::vector<event_handle> events;

  auto check_content = [&](device_ptr p, const shadow_block& blk) {
    if (!blk.written) return;
    for (device_ptr at : {p, p + blk.bytes - 1, p + blk.bytes / 2}) {
      ASSERT_EQ(sim.byte_at(at), blk.tag) << "lost or foreign write in block at " << std::hex << p;
    }
  };

  for (int step = 0; step < steps; ++step) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 45 || live.empty()) {  // allocate
      const double lg = std::uniform_real_distribution<double>(0, 26)(rng);  // 1 B .. 64 MiB, log-uniform
      const std::size_t bytes = std::max<std::size_t>(1, static_cast<std::size_t>(std::exp2(lg)));
      stream_handle s = streams[rng() % streams.size()];
      void* p = nullptr;
      try {
        p = alloc.allocate(bytes, s);
      } catch (const out_of_memory&) {
        ++ooms;
        continue;
      }
      const device_ptr d = dp(p);
      auto after = live.lower_bound(d);
      ASSERT_TRUE(after == live.end() || after->first >= d + bytes) << "overlaps a live block";
      if (after != live.begin()) {
        auto before = std::prev(after);
        ASSERT_LE(before->first + before->second.bytes, d) << "overlaps a live block";
      }
      ASSERT_FALSE(sim.pending_touches(d, bytes, s)) << "handed out while another stream may still use it";
      live[d] = {bytes, s, next_tag++, false};
      if (next_tag == 0) next_tag = 1;
    } else if (op < 80) {  // launch a kernel that writes a live block on its stream
      auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
      write(sim, it->second.stream, reinterpret_cast<void*>(it->first), it->second.bytes, it->second.tag);
      it->second.written = true;
    } else if (op < 95) {  // free, sometimes after handing it to another stream
      auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
      if (rng() % 4 == 0) {
        // Hand the block to another stream as a correct program does: that stream first waits for the
        // owner's work (an event), then uses the block, and record_stream tells the allocator.
        stream_handle other = streams[rng() % streams.size()];
        event_handle ready = sim.create_event();
        sim.record(ready, it->second.stream);
        sim.stream_wait(other, ready);
        alloc.record_stream(reinterpret_cast<void*>(it->first), other);
        write(sim, other, reinterpret_cast<void*>(it->first), it->second.bytes, it->second.tag);
        it->second.written = true;
        events.push_back(ready);
      }
      if (rng() % 8 == 0) {
        sim.run_all();
        check_content(it->first, it->second);
      }
      ASSERT_TRUE(alloc.deallocate(reinterpret_cast<void*>(it->first)));
      live.erase(it);
    } else if (op < 99) {  // let the device make progress
      for (int k = 0; k < 8; ++k) sim.run_one(streams[rng() % streams.size()]);
    } else {
      alloc.empty_cache();
    }
    if (budget) {
      ASSERT_LE(sim.live_device_bytes(), budget);
    }
    if (step % 97 == 0) {
      ASSERT_NO_THROW(alloc.verify());
    }
  }
  sim.run_all();
  for (event_handle e : events) sim.destroy_event(e);
  for (auto& [p, blk] : live) check_content(p, blk);
  for (auto& [p, blk] : live) alloc.deallocate(reinterpret_cast<void*>(p));
  alloc.verify();
  alloc.empty_cache();
  EXPECT_EQ(sim.live_device_bytes(), 0u) << "leak";
  EXPECT_EQ(alloc.stats().all.allocations.current, 0);
  if (budget) {
    EXPECT_LE(alloc.stats().device_bytes.peak, static_cast<std::int64_t>(budget));
  }
  expect_clean(sim);
  ::testing::Test::RecordProperty("ooms", ooms);
}

TEST(AllocatorStress, RandomTracesDeferredStreamsWithBudgets) {
  const std::size_t budgets[] = {0, 48 * k_mib, 96 * k_mib, 130 * k_mib};
  for (std::uint64_t seed = 1; seed <= 8; ++seed) random_trace(seed, budgets[seed % 4], false, 15000);
}

TEST(AllocatorStress, RandomTracesEagerDevice) {
  for (std::uint64_t seed = 100; seed < 104; ++seed) random_trace(seed, seed % 2 ? 64 * k_mib : 0, true, 6000);
}

TEST(AllocatorStress, ConcurrentThreadsOnTheirOwnStreams) {
  sim_driver sim;
  allocator_options opts;
  opts.budget = 128 * k_mib;
  caching_allocator alloc(sim, opts);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      stream_handle s = sim.create_stream();
      std::mt19937_64 rng(1000 + t);
      std::vector<std::pair<void*, std::size_t>> mine;
      for (int i = 0; i < 3000; ++i) {
        if (mine.size() < 20 && rng() % 2) {
          const std::size_t bytes = 1 + rng() % (rng() % 4 ? 64 * k_kib : 6 * k_mib);
          try {
            void* p = alloc.allocate(bytes, s);
            const std::uint8_t tag = static_cast<std::uint8_t>(t + 1);
            sim_driver::access a[] = {{dp(p), 1, true, tag}, {dp(p) + bytes - 1, 1, true, tag}};
            sim.launch(s, a);
            mine.emplace_back(p, bytes);
          } catch (const out_of_memory&) {
          }
        } else if (!mine.empty()) {
          auto [p, bytes] = mine.back();
          mine.pop_back();
          if (sim.byte_at(dp(p)) != t + 1 || sim.byte_at(dp(p) + bytes - 1) != t + 1) ++failures;
          alloc.deallocate(p);
        }
      }
      for (auto [p, bytes] : mine) alloc.deallocate(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "a block was written by another thread while owned";
  alloc.verify();
  EXPECT_LE(alloc.stats().device_bytes.peak, static_cast<std::int64_t>(opts.budget));
  expect_clean(sim);
}

}  // namespace
}  // namespace layerswap
