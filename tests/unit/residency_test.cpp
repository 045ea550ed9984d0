// The residency engine and policy on the simulated device: the tests play the launch tracker (they call the
// residency gate around every simulated launch) and check DESIGN.md's invariants 3, 4 and 6: no lost write,
// never an access to an unmapped range, never a remap under a pending launch, never over the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/forecast.hpp"
#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/access_event.hpp"
#include "profiler/learner.hpp"
#include "runtime/error.hpp"
#include "runtime/sim_driver.hpp"

namespace layerswap {
namespace {

namespace gate = residency_gate;
constexpr std::size_t MiB = std::size_t{1} << 20;

// A forecast the test sets by hand.
class fixed_forecast final : public forecast_source {
 public:
  void set(std::vector<region_id> order, bool learned = true) {
    std::lock_guard lock(mutex_);
    f_.learned = learned;
    ++f_.generation;
    f_.upcoming.clear();
    for (std::size_t i = 0; i < order.size(); ++i) f_.upcoming.push_back({order[i], 0, i + 1});
  }
  // Entries with their distances in launches (Note [Reserve profile]), in the order given.
  void set_entries(const std::vector<std::pair<region_id, std::uint64_t>>& entries) {
    std::lock_guard lock(mutex_);
    f_.learned = true;
    f_.upcoming.clear();
    for (const auto& [id, distance] : entries) f_.upcoming.push_back({id, 0, distance});
  }
  // The learner's position within its learned step, of 1000 launches unless said (Note [Following reserve]).
  void set_position(std::uint64_t step_position, std::uint64_t step_launches = 1000) {
    std::lock_guard lock(mutex_);
    f_.step_position = step_position;
    f_.step_launches = step_launches;
  }
  // ... with the launch number it stands at (the step began at launch - step_position).
  void set_launch(std::uint64_t launch, std::uint64_t step_position) {
    std::lock_guard lock(mutex_);
    f_.position = launch;
    f_.step_position = step_position;
  }
  void current(forecast& out, std::size_t max_regions) override {
    std::lock_guard lock(mutex_);
    out = f_;
    if (out.upcoming.size() > max_regions) out.upcoming.resize(max_regions);
  }

 private:
  std::mutex mutex_;
  forecast f_ = [] {
    forecast f;
    f.step_launches = 1000;
    return f;
  }();
};

// The first access the simulated device found wrong, for a failure message ("" when there is none).
std::string first_violation(const sim_driver& sim) {
  const std::vector<std::string> found = sim.violations();
  return found.empty() ? std::string() : found.front();
}

// Whether every byte of [p, p + bytes) reads `v` through its VA (host_read is checked like a kernel access).
bool sim_holds(sim_driver& sim, void* p, std::size_t bytes, std::uint8_t v) {
  std::vector<std::byte> buf(bytes);
  sim.host_read(reinterpret_cast<device_ptr>(p), buf);
  return std::all_of(buf.begin(), buf.end(), [&](std::byte b) { return b == std::byte{v}; });
}

// A fixed forecast that counts how often the migration thread fetched it.
class counting_forecast final : public forecast_source {
 public:
  explicit counting_forecast(fixed_forecast& inner) : inner_(inner) {}
  void current(forecast& out, std::size_t max_regions) override {
    fetches.fetch_add(1);
    inner_.current(out, max_regions);
  }
  std::atomic<std::int64_t> fetches{0};

 private:
  fixed_forecast& inner_;
};

// Tests that need residency_options::refused_hook set it here (harness::make_options forwards to it).
std::function<void(region_id)> g_refused_hook;
// ... and residency_options::idle_period (Note [Idle engine]); idle_period_for sets it for one test.
std::chrono::microseconds g_idle_period = residency_options{}.idle_period;
struct idle_period_for {
  explicit idle_period_for(std::chrono::microseconds p) { g_idle_period = p; }
  ~idle_period_for() { g_idle_period = residency_options{}.idle_period; }
};
// ... and allocator_options::composites (Note [Composites] in caching_allocator.cpp): on in these tests, though off
// by default (LAYERSWAP_COMPOSITES), so that the stress tests cover it; composites_off for one test.
bool g_composites = true;
struct composites_off {
  composites_off() { g_composites = false; }
  ~composites_off() { g_composites = true; }
};
// ... and allocator_options::split (Note [Split segments]): off, as by default; split_on for one test, and the
// stress tests on half their seeds.
bool g_split = false;
struct split_on {
  split_on() { g_split = true; }
  ~split_on() { g_split = false; }
};
// ... and allocator_options::split_free (Note [Split bound]): no bound in these tests (LAYERSWAP_SPLIT_FREE sets one by
// default); split_free_for for one test, and the stress tests on half of their seeds with splits.
std::size_t g_split_free = std::numeric_limits<std::size_t>::max();
struct split_free_for {
  explicit split_free_for(std::size_t bytes) { g_split_free = bytes; }
  ~split_free_for() { g_split_free = std::numeric_limits<std::size_t>::max(); }
};

// ... and allocator_options::split_peak and split_free_peak (Note [Splits by reserve]): as split and split_free in
// these tests; split_peak_for for one test.
std::optional<std::size_t> g_split_peak;
std::optional<std::size_t> g_split_free_peak;
struct split_peak_for {
  split_peak_for(std::size_t ratio, std::size_t free) {
    g_split_peak = ratio;
    g_split_free_peak = free;
  }
  ~split_peak_for() {
    g_split_peak.reset();
    g_split_free_peak.reset();
  }
};

// ... and residency_options::reserve (Note [Following reserve]): the step's peak unless said; follow_on for one test.
bool g_follow = false;
struct follow_on {
  explicit follow_on(bool on) { g_follow = on; }
  ~follow_on() { g_follow = false; }
};

// ... and reserve_mode::automatic (Note [Automatic reserve]): off in these tests, which keep the step's peak
// unless said; auto_on for one test.
bool g_auto = false;
struct auto_on {
  auto_on() { g_auto = true; }
  ~auto_on() { g_auto = false; }
};

// ... and residency_options::batch_digests (Note [Batched checks]): on, as by default; batch_digests_for for one test.
bool g_batch_digests = true;
struct batch_digests_for {
  explicit batch_digests_for(bool on) { g_batch_digests = on; }
  ~batch_digests_for() { g_batch_digests = true; }
};

// ... and residency_options::prefetch_tune with its clock (Note [Tuned prefetch]): off, as by default;
// prefetch_tune_on for one test, whose clock reads g_tune_ns.
bool g_prefetch_tune = false;
std::uint64_t g_tune_ns = 0;
struct prefetch_tune_on {
  prefetch_tune_on() { g_prefetch_tune = true; }
  ~prefetch_tune_on() { g_prefetch_tune = false; }
};

struct harness {
  explicit harness(std::size_t budget, bool eager = true, bool thread = false, bool without_tracker = true,
                   bool skip_clean = true, bool sim_digests = true, double oversize = 1.0, bool cache_auto = false)
      : sim(make_sim(eager, sim_digests)),
        alloc(sim, make_options(budget, thread, without_tracker, skip_clean, oversize, cache_auto)) {
    s1 = sim.create_stream();
    s2 = sim.create_stream();
    const stream_handle streams[] = {s1, s2};
    alloc.set_streams(streams);
  }
  ~harness() { gate::forget_streams(); }  // the streams its launches noted (the next simulated device reuses ids)
  harness(const harness&) = delete;
  harness& operator=(const harness&) = delete;
  static sim_options make_sim(bool eager, bool digests) {
    sim_options o;
    o.digest = digests;
    o.total_memory = 512 * MiB;
    o.eager = eager;
    return o;
  }
  static allocator_options make_options(std::size_t budget, bool thread, bool without_tracker, bool skip_clean,
                                        double oversize = 1.0, bool cache_auto = false) {
    allocator_options o;
    o.oversize = oversize;
    o.residency.cache_reserve_auto = cache_auto;
    o.residency.skip_clean = skip_clean;
    o.budget = budget;
    o.va_reserve = 1024 * MiB;
    o.residency.enabled = true;
    o.residency.without_tracker = without_tracker;
    o.residency.thread = thread;
    o.residency.refused_hook = [](region_id id) {
      if (g_refused_hook) g_refused_hook(id);
    };
    o.residency.idle_period = g_idle_period;
    o.composites = g_composites;
    o.split = g_split ? 4 : 0;
    o.split_free = g_split_free;
    o.split_peak = g_split_peak;
    o.split_free_peak = g_split_free_peak;
    o.residency.reserve = g_auto ? reserve_mode::automatic : g_follow ? reserve_mode::follow : reserve_mode::peak;
    o.residency.batch_digests = g_batch_digests;
    o.residency.prefetch_tune = g_prefetch_tune;
    if (g_prefetch_tune) o.residency.tune_clock = [] { return g_tune_ns; };
    return o;
  }

  // A simulated launch, framed by the gate as the tracker frames real ones.
  void launch(stream_handle s, std::vector<sim_access> acc) {
    std::vector<region_id> ids;
    for (const auto& a : acc) {
      const region_id id = region_map::lookup(a.va);
      if (id && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    }
    bool missed = false;
    for (region_id id : ids) missed |= gate::enter(id);
    gate::note_stream(reinterpret_cast<std::uint64_t>(s), sim.context_id());  // as the tracker does (Note [Launch streams])
    if (!ids.empty() && gate::counting()) gate::count_launch(missed);  // as the tracker counts (the hit rate)
    sim.launch(s, acc);
    const std::uint64_t n = ++launch_no;
    for (region_id id : ids) gate::exit(id, n);
  }
  // ... framed as a tracker that holds launches on the GPU frames it (residency_gate.hpp, Note [Holding a launch
  // on the GPU]): each hold becomes a stream wait before the launch. Returns the number of holds.
  int launch_holding(stream_handle s, std::vector<sim_access> acc) {
    std::vector<std::pair<region_id, bool>> ids;
    std::vector<residency_gate::hold> holds;
    for (const auto& a : acc) {
      const region_id id = region_map::lookup(a.va);
      if (!id || std::any_of(ids.begin(), ids.end(), [&](const auto& e) { return e.first == id; })) continue;
      residency_gate::hold hd;
      const bool held = gate::enter_holding(id, hd) == residency_gate::entry_state::held;
      if (held) holds.push_back(hd);
      ids.emplace_back(id, held);
    }
    for (const residency_gate::hold& hd : holds) sim.stream_wait_value(s, hd.flag, hd.value);
    gate::note_stream(reinterpret_cast<std::uint64_t>(s), sim.context_id());
    sim.launch(s, acc);
    const std::uint64_t n = ++launch_no;
    for (auto [id, held] : ids) {
      if (held) gate::exit_held(id, n); else gate::exit(id, n);
    }
    return static_cast<int>(holds.size());
  }
  // An allocation of `bytes` on s1 holding `v` (written by a launch on s1).
  void* written(std::size_t bytes, std::uint8_t v) {
    void* a = alloc.allocate(bytes, s1);
    write(s1, a, bytes, v);
    return a;
  }
  // ... evicted (on the host).
  void* evicted(std::size_t bytes, std::uint8_t v) {
    void* a = written(bytes, v);
    go_out(a);
    return a;
  }
  // ... brought back (digested) and evicted again, clean: on the host with its digest known (Note [Write-back]).
  void* evicted_clean(std::size_t bytes, std::uint8_t v) {
    void* a = evicted(bytes, v);
    come_back(a);
    go_out(a);
    return a;
  }
  // ... then with its prefetch started (not yet remapped).
  void* prefetching(std::size_t bytes, std::uint8_t v) {
    void* a = evicted(bytes, v);
    EXPECT_TRUE(alloc.request_prefetch(a));
    EXPECT_EQ(alloc.residency_of(a), region_residency::moving_in);
    return a;
  }
  void write(stream_handle s, void* p, std::size_t bytes, std::uint8_t v) {
    launch(s, {{reinterpret_cast<device_ptr>(p), bytes, true, v}});
  }
  void read(stream_handle s, void* p, std::size_t bytes) { launch(s, {{reinterpret_cast<device_ptr>(p), bytes, false, 0}}); }

  bool holds(void* p, std::size_t bytes, std::uint8_t v) { return sim_holds(sim, p, bytes, v); }
  // An eviction (or a prefetch) of `a` requested and finished by one tick (eager device).
  void go_out(void* a) {
    EXPECT_TRUE(alloc.request_evict(a));
    alloc.residency_tick();
    EXPECT_EQ(alloc.residency_of(a), region_residency::host);
  }
  void come_back(void* a) {
    EXPECT_TRUE(alloc.request_prefetch(a));
    alloc.residency_tick();
    EXPECT_EQ(alloc.residency_of(a), region_residency::device);
  }
  // ... framed by the gate as a launch is: with the migration thread running, it may be remapping the region now.
  // (The read counts as a use of the region, like any launch.)
  bool holds_gated(void* p, std::size_t bytes, std::uint8_t v) {
    const region_id id = id_of(p);
    gate::enter(id);
    const bool held = holds(p, bytes, v);
    gate::exit(id, ++launch_no);
    return held;
  }
  static region_id id_of(void* p) { return region_map::lookup(reinterpret_cast<device_ptr>(p)); }
  void expect_clean() {
    EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
    EXPECT_NO_THROW(alloc.verify());
  }

  sim_driver sim;
  caching_allocator alloc;
  stream_handle s1 = nullptr;
  stream_handle s2 = nullptr;
  std::uint64_t launch_no = 0;
};

TEST(Residency, EvictAndPrefetchRoundTripPreservesBytes) {
  harness h(64 * MiB);
  void* a = h.alloc.allocate(6 * MiB, h.s1);
  h.write(h.s1, a, 6 * MiB, 0x5a);
  ASSERT_TRUE(h.alloc.request_evict(a));
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::moving_out);
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  h.write(h.s1, a, 4 * MiB, 0x21);  // a write through the host mapping (a launch the policy did not foresee)
  ASSERT_TRUE(h.alloc.request_prefetch(a));
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x21));
  EXPECT_TRUE(h.holds(static_cast<char*>(a) + 4 * MiB, 2 * MiB, 0x5a));
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.evictions, 1);
  EXPECT_EQ(st.prefetches, 1);
  EXPECT_EQ(st.bytes_d2h, static_cast<std::int64_t>(6 * MiB));
  EXPECT_EQ(st.bytes_h2d, static_cast<std::int64_t>(6 * MiB));
  EXPECT_EQ(st.writeback_skipped, 0);
  EXPECT_EQ(st.host_bytes, static_cast<std::int64_t>(6 * MiB));  // kept for the region's life
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Chunks]: an eviction unmaps a region's chunk from its VA in one call and keeps it as a spare; a prefetch
// of that size takes it back (mapped once at a home VA of its own, where the copy lands, and at the region's VA); a
// new segment of that size takes a spare too; an allocation that needs the budget releases spare chunks first.
TEST(Residency, ChunksAreReusedBySizeAndReleasedForTheBudget) {
  harness h(16 * MiB);
  void* a = h.written(6 * MiB, 0x5a);
  std::size_t creates = h.sim.num_creates(), maps = h.sim.num_maps(), unmaps = h.sim.num_unmaps();
  h.go_out(a);
  EXPECT_EQ(h.sim.num_unmaps() - unmaps, 1u);  // the chunk, in one call
  EXPECT_EQ(h.sim.num_maps() - maps, 2u);      // the new host backing at its view, then at the region's VA
  EXPECT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(6 * MiB));
  creates = h.sim.num_creates(), maps = h.sim.num_maps(), unmaps = h.sim.num_unmaps();
  h.come_back(a);
  EXPECT_EQ(h.sim.num_creates(), creates);    // the spare chunk again
  EXPECT_EQ(h.sim.num_maps() - maps, 2u);     // its home VA (first prefetch into it) and the region's VA
  EXPECT_EQ(h.sim.num_unmaps() - unmaps, 1u); // the host mapping of the region's VA
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  h.write(h.s1, a, 2 * MiB, 0x21);
  h.go_out(a);
  maps = h.sim.num_maps();
  h.come_back(a);
  EXPECT_EQ(h.sim.num_maps() - maps, 1u);     // the region's VA only: the home mapping stayed
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
  EXPECT_TRUE(h.holds(static_cast<char*>(a) + 2 * MiB, 4 * MiB, 0x5a));
  h.expect_clean();
  // Evicted, a's chunk is spare (6 MiB held of 16). A 6 MiB segment takes it; then a 12 MiB one needs the budget a
  // spare held: the allocator releases spares before it reclaims or evicts anything.
  h.go_out(a);
  creates = h.sim.num_creates();
  const std::int64_t for_segments = h.alloc.residency().chunks_for_segments;
  void* b = h.written(6 * MiB, 0x33);
  EXPECT_EQ(h.sim.num_creates(), creates);
  EXPECT_EQ(h.alloc.residency().chunks_for_segments, for_segments) << "the spare served the segment";
  h.alloc.deallocate(b);
  h.alloc.empty_cache();  // b's chunk becomes a spare, then is released
  EXPECT_EQ(h.alloc.residency().spare_bytes, 0);
  h.come_back(a);
  h.go_out(a);                 // a spare of 6 MiB again
  void* c = h.written(12 * MiB, 0x44);
  const residency_stats st = h.alloc.residency();
  EXPECT_GE(st.chunks_released, 1);
  EXPECT_GE(st.chunks_released_for_size, 1) << "a's spare made room for the 12 MiB chunk";
  EXPECT_EQ(st.chunks_for_segments, for_segments + 1);
  EXPECT_EQ(st.spare_bytes, 0);
  EXPECT_LE(h.sim.live_device_bytes(), 16 * MiB);
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
  EXPECT_TRUE(h.holds(c, 12 * MiB, 0x44));
  h.alloc.deallocate(c);
  h.alloc.deallocate(a);
  h.alloc.empty_cache();
  EXPECT_EQ(h.alloc.residency().spare_bytes, 0);
  h.expect_clean();
}

// Note [Slabs last] (caching_allocator.cpp): a prefetch short of room reclaims a large idle segment before an idle
// slab freed earlier, and stops there: the slab stays cached for the program's next small allocation.
TEST(Residency, APrefetchReclaimsLargeIdleSegmentsBeforeSlabs) {
  harness h(16 * MiB);
  void* p = h.evicted(6 * MiB, 0x11);  // its chunk: a spare of 6 MiB
  void* a = h.written(6 * MiB, 0x22);  // takes it
  void* x = h.alloc.allocate(4096, h.s1);  // a slab of one granule
  h.alloc.deallocate(x);  // idle first
  h.alloc.deallocate(a);  // idle after it
  void* q = h.written(8 * MiB, 0x33);  // 16 of 16 held
  h.alloc.residency_tick();            // fences: both idle segments can go without a host wait
  const std::int64_t slabs = h.alloc.stats().small.segments.current;
  const std::int64_t reclaims = h.alloc.stats().num_engine_reclaims;
  ASSERT_EQ(slabs, 1);
  h.come_back(p);
  EXPECT_EQ(h.alloc.stats().num_engine_reclaims - reclaims, 1) << "a alone made the room";
  EXPECT_EQ(h.alloc.stats().small.segments.current, 1) << "the slab freed before a is still cached";
  const std::int64_t made = h.alloc.stats().small.segments.allocated;
  void* y = h.alloc.allocate(4096, h.s1);
  EXPECT_EQ(h.alloc.stats().small.segments.allocated, made) << "the cached slab served it";
  EXPECT_TRUE(h.holds(p, 6 * MiB, 0x11));
  EXPECT_TRUE(h.holds(q, 8 * MiB, 0x33));
  h.expect_clean();
  h.alloc.deallocate(y);
  h.alloc.deallocate(q);
  h.alloc.deallocate(p);
  h.alloc.empty_cache();
  h.expect_clean();
}

// Note [Chunks]: when the device itself is full (another process; the budget has room), a new segment's chunk is
// made after the spare chunks are released, not after evicting or failing.
TEST(Residency, ADeviceFullOfSparesReleasesThemForANewSegment) {
  harness h(256 * MiB);
  h.sim.set_total_memory(32 * MiB);
  void* a = h.written(16 * MiB, 0x5a);
  h.go_out(a);  // its chunk: a spare of 16 MiB of the device's 32
  void* b = h.written(24 * MiB, 0x6b);
  EXPECT_GE(h.alloc.residency().chunks_released, 1);
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 16 * MiB, 0x5a));
  EXPECT_TRUE(h.holds(b, 24 * MiB, 0x6b));
  h.alloc.deallocate(b);
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Write-back]: a region that comes back and is evicted again unchanged is not copied back; its host copy,
// kept from the first eviction, is what the VA reads afterwards.
TEST(Residency, CleanEvictionSkipsTheCopy) {
  harness h(64 * MiB);
  void* a = h.evicted(6 * MiB, 0x5a);  // the first eviction copies: no digest of the host copy yet
  EXPECT_EQ(h.alloc.residency().writeback_checked, 0);
  h.come_back(a);
  h.read(h.s2, a, 6 * MiB);  // reads do not make it dirty
  const std::size_t digests = h.sim.num_digests();
  h.go_out(a);
  EXPECT_EQ(h.sim.num_digests(), digests + 1);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.evictions, 2);
  EXPECT_EQ(st.writeback_checked, 1);
  EXPECT_EQ(st.writeback_skipped, 1);
  EXPECT_EQ(st.bytes_d2h, static_cast<std::int64_t>(6 * MiB)) << "the clean eviction copied";
  h.come_back(a);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Digest carried over]: a prefetch of a region untouched since a clean eviction enqueues no digest and keeps
// the region's; the next eviction still finds it clean, and a change on the device still makes it dirty.
TEST(Residency, APrefetchAfterACleanEvictionKeepsTheDigest) {
  harness h(64 * MiB);
  void* a = h.evicted_clean(6 * MiB, 0x5a);
  const std::size_t digests = h.sim.num_digests();
  h.come_back(a);  // carried over: no digest
  EXPECT_EQ(h.sim.num_digests(), digests);
  EXPECT_EQ(h.alloc.residency().digests_carried, 1);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  h.go_out(a);  // the check against the carried digest: clean, no copy
  residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.writeback_skipped, 2);
  EXPECT_EQ(st.bytes_d2h, static_cast<std::int64_t>(6 * MiB));
  h.come_back(a);
  h.write(h.s1, a, 2 * MiB, 0x33);
  h.go_out(a);  // dirty against the carried digest: copied
  EXPECT_EQ(h.alloc.residency().bytes_d2h, static_cast<std::int64_t>(12 * MiB));
  h.come_back(a);
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x33));
  EXPECT_TRUE(h.holds(static_cast<char*>(a) + 2 * MiB, 4 * MiB, 0x5a));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// ... but not after a launch wrote the region through its host mapping (a missed access): the host copy is no
// longer what the digest describes. Were the digest kept, writing the old content back on the device would look
// clean at the next eviction and the host copy would keep the missed write: the content read last would be wrong.
TEST(Residency, APrefetchAfterAWriteOnTheHostDigestsAgain) {
  harness h(64 * MiB);
  void* a = h.evicted_clean(6 * MiB, 0x5a);  // the digest describes 0x5a
  h.write(h.s1, a, 6 * MiB, 0x33);           // on the host: a missed access writes the host copy
  const std::size_t digests = h.sim.num_digests();
  h.come_back(a);
  EXPECT_EQ(h.sim.num_digests(), digests + 1) << "the prefetch kept a digest the host copy no longer matches";
  EXPECT_EQ(h.alloc.residency().digests_carried, 0);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x33));
  h.write(h.s1, a, 6 * MiB, 0x5a);           // back to the content of the old digest, on the device
  h.go_out(a);                               // must copy: the host copy holds 0x33
  h.come_back(a);
  EXPECT_TRUE(h.holds(a, 6 * MiB, 0x5a));
  h.alloc.deallocate(a);
  h.expect_clean();
}

TEST(Residency, DirtyEvictionCopiesTheNewContent) {
  harness h(64 * MiB);
  void* a = h.evicted(6 * MiB, 0x5a);
  h.come_back(a);
  h.write(h.s1, a, 2 * MiB, 0x33);  // one granule of three changes
  h.go_out(a);  // the check finds it dirty, the copy follows (at once on the eager device)
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x33));
  EXPECT_TRUE(h.holds(static_cast<char*>(a) + 2 * MiB, 4 * MiB, 0x5a));
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.writeback_checked, 1);
  EXPECT_EQ(st.writeback_skipped, 0);
  EXPECT_EQ(st.bytes_d2h, static_cast<std::int64_t>(12 * MiB));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// The check read the region before a launch changed it: the digest matched, but the gate refuses the remap, so the
// write is not lost; the next eviction finds the region dirty and copies it.
TEST(Residency, WriteAfterACleanCheckAbandonsTheEviction) {
  harness h(64 * MiB);
  void* a = h.evicted(4 * MiB, 0x5a);
  h.come_back(a);
  ASSERT_TRUE(h.alloc.request_evict(a));  // eager: the check has run, on the unchanged region
  h.write(h.s2, a, 4 * MiB, 0x44);
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_EQ(h.alloc.residency().abandoned, 1);
  EXPECT_EQ(h.alloc.residency().writeback_skipped, 0);
  h.go_out(a);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x44)) << "the write after the check was lost";
  EXPECT_EQ(h.alloc.residency().writeback_skipped, 0);
  h.alloc.deallocate(a);
  h.expect_clean();
}

// A region found dirty by two checks in a row is copied without a check for the next k_unchecked_evictions (8).
TEST(Residency, OftenDirtyRegionIsCopiedWithoutACheck) {
  harness h(64 * MiB);
  void* a = h.evicted(2 * MiB, 1);
  for (std::uint8_t round = 2; round < 6; ++round) {
    h.come_back(a);
    h.write(h.s1, a, 2 * MiB, round);
    h.go_out(a);
    EXPECT_TRUE(h.holds(a, 2 * MiB, round));
  }
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.writeback_checked, 2) << "rounds 2 and 3 check, rounds 4 and 5 copy at once";
  EXPECT_EQ(st.writeback_skipped, 0);
  EXPECT_EQ(st.bytes_d2h, static_cast<std::int64_t>(5 * 2 * MiB));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// A simulated device whose copy_async throws while `fail_copies` is positive (a driver call failing mid-move).
class faulty_driver final : public driver {
 public:
  explicit faulty_driver(sim_driver& sim) : sim_(sim) {}
  int fail_copies = 0;
  int fail_releases = 0;  // release() throws while positive
  int fail_digests = 0;   // digest_async and digest_many_async throw while positive
  std::atomic<int> query_error{0};  // query() throws cuda_error with this code while nonzero
  std::function<void()> on_stream_wait;  // before each stream_wait (may throw)
  std::function<void(std::size_t, memory_location)> on_create;  // before each create
  std::function<void(phys_handle)> on_release;                   // before each release
  int fail_maps_after = -1;  // map() throws once this many more calls have succeeded (-1: never)
  [[nodiscard]] int device() const noexcept override { return sim_.device(); }
  [[nodiscard]] std::uint64_t context_id() const noexcept override { return sim_.context_id(); }
  [[nodiscard]] std::size_t granularity() override { return sim_.granularity(); }
  [[nodiscard]] std::size_t total_memory() override { return sim_.total_memory(); }
  [[nodiscard]] std::size_t free_memory() override { return sim_.free_memory(); }
  [[nodiscard]] device_ptr reserve(std::size_t b, std::size_t a) override { return sim_.reserve(b, a); }
  void unreserve(device_ptr va, std::size_t b) override { sim_.unreserve(va, b); }
  [[nodiscard]] phys_handle create(std::size_t b, memory_location w) override {
    if (on_create) on_create(b, w);
    return sim_.create(b, w);
  }
  void release(phys_handle h) override {
    if (on_release) on_release(h);
    if (fail_releases > 0) {
      --fail_releases;
      throw cuda_error(999, "faulty_driver: release failed on purpose");
    }
    sim_.release(h);
  }
  void map(device_ptr va, std::size_t b, phys_handle h, std::size_t o) override {
    if (fail_maps_after == 0) {
      fail_maps_after = -1;
      throw cuda_error(999, "faulty_driver: map failed on purpose");
    }
    if (fail_maps_after > 0) --fail_maps_after;
    sim_.map(va, b, h, o);
  }
  void unmap(device_ptr va, std::size_t b) override { sim_.unmap(va, b); }
  void set_access(device_ptr va, std::size_t b) override { sim_.set_access(va, b); }
  [[nodiscard]] stream_handle create_stream() override { return sim_.create_stream(); }
  void destroy_stream(stream_handle s) override { sim_.destroy_stream(s); }
  void synchronize(stream_handle s) override { sim_.synchronize(s); }
  [[nodiscard]] event_handle create_event() override { return sim_.create_event(); }
  void destroy_event(event_handle e) override { sim_.destroy_event(e); }
  void record(event_handle e, stream_handle s) override { sim_.record(e, s); }
  [[nodiscard]] bool query(event_handle e) override {
    if (const int code = query_error.load()) throw cuda_error(code, "faulty_driver: query failed on purpose");
    return sim_.query(e);
  }
  void wait(event_handle e) override { sim_.wait(e); }
  void stream_wait(stream_handle s, event_handle e) override {
    if (on_stream_wait) on_stream_wait();
    sim_.stream_wait(s, e);
  }
  void stream_write_value(stream_handle s, device_ptr a, std::uint32_t v) override { sim_.stream_write_value(s, a, v); }
  void stream_wait_value(stream_handle s, device_ptr a, std::uint32_t v) override { sim_.stream_wait_value(s, a, v); }
  [[nodiscard]] bool can_digest() override { return sim_.can_digest(); }
  void digest_async(device_ptr va, std::size_t b, std::uint64_t* out, stream_handle s) override {
    fail_digest("digest_async");
    sim_.digest_async(va, b, out, s);
  }
  void digest_many_async(std::span<const digest_range> ranges, stream_handle s) override {
    fail_digest("digest_many_async");
    sim_.digest_many_async(ranges, s);
  }
  [[nodiscard]] std::uint64_t* alloc_host_words(std::size_t n) override { return sim_.alloc_host_words(n); }
  void free_host_words(std::uint64_t* w) override { sim_.free_host_words(w); }
  void copy_async(device_ptr dst, device_ptr src, std::size_t b, stream_handle s) override {
    if (fail_copies > 0) {
      --fail_copies;
      throw cuda_error(999, "faulty_driver: copy_async failed on purpose");
    }
    sim_.copy_async(dst, src, b, s);
  }
  void copy_to_host(void* dst, device_ptr src, std::size_t b) override { sim_.copy_to_host(dst, src, b); }
  void copy_from_host(device_ptr dst, const void* src, std::size_t b) override { sim_.copy_from_host(dst, src, b); }

 private:
  void fail_digest(const char* call) {
    if (fail_digests > 0) {
      --fail_digests;
      throw cuda_error(999, std::string("faulty_driver: ") + call + " failed on purpose");
    }
  }
  sim_driver& sim_;
};

// Note [Driver shut down]: at process exit the CUDA driver can be deinitialized while the migration thread still
// runs; the thread then stops without a warning (any other driver error is reported, once).
TEST(Residency, TheMigrationThreadStopsQuietlyWhenTheDriverShutsDown) {
  for (const int code : {k_cuda_deinitialized, 999}) {
    sim_driver sim(harness::make_sim(/*eager=*/false, true));
    faulty_driver port(sim);
    caching_allocator alloc(port, harness::make_options(64 * MiB, /*thread=*/true, true, true));
    void* a = alloc.allocate(4 * MiB, nullptr);
    ASSERT_TRUE(alloc.request_evict(a));  // its copy pending: the thread polls its event
    testing::internal::CaptureStderr();
    port.query_error = code;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    port.query_error = 0;
    const std::string err = testing::internal::GetCapturedStderr();
    if (code == k_cuda_deinitialized) {
      EXPECT_EQ(err.find("residency engine"), std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("residency engine: faulty_driver: query failed on purpose"), std::string::npos) << err;
    }
    sim.run_all();
    alloc.deallocate(a);
  }
}

// A prefetch whose copy fails to start is undone: the region stays on the host with its bytes, and is never remapped
// to device pages the copy did not fill.
TEST(Residency, PrefetchWhoseCopyFailsToStartIsUndone) {
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(64 * MiB, false, true, true));
  void* a = alloc.allocate(4 * MiB, nullptr);
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x5a}});
  ASSERT_TRUE(alloc.request_evict(a));
  alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(a), region_residency::host);
  port.fail_copies = 1;
  EXPECT_THROW((void)alloc.request_prefetch(a), cuda_error);
  EXPECT_EQ(alloc.residency_of(a), region_residency::host);
  alloc.residency_tick();
  EXPECT_EQ(alloc.residency_of(a), region_residency::host) << "a prefetch with no copy went on";
  ASSERT_TRUE(alloc.request_prefetch(a));
  alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(a), region_residency::device);
  EXPECT_TRUE(sim_holds(sim, a, 4 * MiB, 0x5a));
  EXPECT_NO_THROW(alloc.verify());
  alloc.deallocate(a);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Remaps outside the lock]: an eviction the policy starts is enqueued by tick() without the mutex; when its
// copy fails to start, end_start undoes it (the region stays on the device, whole) and a later round evicts it.
TEST(Residency, PolicyEvictionWhoseCopyFailsToStartIsUndone) {
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(12 * MiB, false, true, true));
  fixed_forecast f;
  alloc.set_forecast_source(&f);
  std::vector<void*> w;
  for (std::uint8_t v = 1; v <= 3; ++v) {
    w.push_back(alloc.allocate(4 * MiB, nullptr));
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(w.back()), 4 * MiB, true, v}});
  }
  for (void* p : {w[1], w[2]}) ASSERT_TRUE(alloc.request_evict(p));
  alloc.residency_tick();
  void* act = alloc.allocate(4 * MiB, nullptr);  // an activation: the reserve leaves room for two regions
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(act), 4 * MiB, true, 0x0a}});
  f.set({harness::id_of(w[1]), harness::id_of(w[0]), harness::id_of(w[2])});
  for (int i = 0; i < 4; ++i) alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(w[0]), region_residency::device);
  ASSERT_EQ(alloc.residency_of(w[1]), region_residency::device);
  // w2 is next and w0 is used last: the policy evicts w0, whose copy fails to start.
  f.set({harness::id_of(w[2]), harness::id_of(w[1]), harness::id_of(w[0])});
  port.fail_copies = 1;
  EXPECT_THROW(alloc.residency_tick(), cuda_error);
  EXPECT_EQ(alloc.residency_of(w[0]), region_residency::device) << "the eviction was undone";
  EXPECT_NO_THROW(alloc.verify());
  for (int i = 0; i < 6; ++i) alloc.residency_tick();
  EXPECT_EQ(alloc.residency_of(w[0]), region_residency::host);
  EXPECT_EQ(alloc.residency_of(w[2]), region_residency::device);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(sim_holds(sim, w[i], 4 * MiB, static_cast<std::uint8_t>(i + 1))) << "region " << i;
  }
  EXPECT_TRUE(sim_holds(sim, act, 4 * MiB, 0x0a));
  EXPECT_NO_THROW(alloc.verify());
  for (void* p : w) alloc.deallocate(p);
  alloc.deallocate(act);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Write-back]: a digest that never writes its result (a launch that failed) must read as dirty: the words
// still hold what the prefetch's digest left there, which equals the known digest.
TEST(Residency, CheckWhoseDigestNeverRanCopies) {
  sim_options so = harness::make_sim(true, true);
  so.digest_drops_results = true;
  sim_driver sim(so);
  caching_allocator alloc(sim, harness::make_options(64 * MiB, false, true, true));
  void* a = alloc.allocate(4 * MiB, nullptr);
  for (const std::uint8_t v : {0x11, 0x22, 0x33}) {
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, v}});
    ASSERT_TRUE(alloc.request_evict(a));
    alloc.residency_tick();
    ASSERT_EQ(alloc.residency_of(a), region_residency::host);
    EXPECT_TRUE(sim_holds(sim, a, 4 * MiB, v)) << "the write of " << int(v) << " was lost";
    ASSERT_TRUE(alloc.request_prefetch(a));
    alloc.residency_tick();
  }
  EXPECT_EQ(alloc.residency().writeback_skipped, 0);
  alloc.deallocate(a);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Batched checks]: the scene of the tests below. `n` weights of 4 MiB on the device, weight i holding i + 1,
// with their digests known (evicted once and brought back), n regions of 4 MiB on the host, a budget of 4n MiB, and
// a forecast that wants the regions on the host first: the next policy round evicts every weight, each with a check.
// The program's launches go to the legacy stream, unframed (the engine runs without a tracker).
struct check_scene {
  std::vector<void*> w;  // on the device, clean
  std::vector<void*> x;  // on the host
};
check_scene make_check_scene(caching_allocator& alloc, sim_driver& sim, fixed_forecast& f, std::size_t n) {
  check_scene scene;
  const auto write = [&](void* p, std::uint8_t v) {
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(p), 4 * MiB, true, v}});
  };
  for (std::size_t i = 0; i < n; ++i) {
    scene.x.push_back(alloc.allocate(4 * MiB, nullptr));
    write(scene.x.back(), static_cast<std::uint8_t>(0x80 + i));
  }
  for (void* p : scene.x) {
    EXPECT_TRUE(alloc.request_evict(p));
    alloc.residency_tick();
    EXPECT_EQ(alloc.residency_of(p), region_residency::host);
  }
  for (std::size_t i = 0; i < n; ++i) {
    scene.w.push_back(alloc.allocate(4 * MiB, nullptr));
    write(scene.w.back(), static_cast<std::uint8_t>(i + 1));
  }
  for (void* p : scene.w) {
    EXPECT_TRUE(alloc.request_evict(p));
    alloc.residency_tick();
    EXPECT_TRUE(alloc.request_prefetch(p));  // digested: its next eviction checks
    alloc.residency_tick();
    EXPECT_EQ(alloc.residency_of(p), region_residency::device);
  }
  std::vector<region_id> order;
  for (void* p : scene.x) order.push_back(harness::id_of(p));
  for (void* p : scene.w) order.push_back(harness::id_of(p));
  f.set(order);
  alloc.set_forecast_source(&f);
  return scene;
}

// Note [Batched checks]: the checks of the evictions one policy round starts share one digest launch, and the clean
// regions still skip their copies; with batching off (batch_digests), a launch each.
TEST(Residency, TheChecksOfOneRoundShareOneDigestLaunch) {
  for (const bool batch : {true, false}) {
    SCOPED_TRACE(batch ? "batched" : "batch_digests off");
    batch_digests_for b(batch);
    harness h(16 * MiB);
    fixed_forecast f;
    const check_scene scene = make_check_scene(h.alloc, h.sim, f, 4);
    const residency_stats before = h.alloc.residency();
    const std::size_t launches = h.sim.num_digest_launches();
    const std::size_t digests = h.sim.num_digests();
    h.alloc.residency_tick();
    for (void* p : scene.w) ASSERT_EQ(h.alloc.residency_of(p), region_residency::moving_out);
    EXPECT_EQ(h.sim.num_digests() - digests, 4u);
    EXPECT_EQ(h.sim.num_digest_launches() - launches, batch ? 1u : 4u);
    for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
    const residency_stats st = h.alloc.residency();
    EXPECT_EQ(st.writeback_checked - before.writeback_checked, 4);
    EXPECT_EQ(st.writeback_skipped - before.writeback_skipped, 4) << "a clean region was copied";
    EXPECT_EQ(st.bytes_d2h, before.bytes_d2h);
    for (std::size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(h.alloc.residency_of(scene.w[i]), region_residency::host) << "weight " << i;
      EXPECT_TRUE(h.holds(scene.w[i], 4 * MiB, static_cast<std::uint8_t>(i + 1))) << "weight " << i;
      EXPECT_EQ(h.alloc.residency_of(scene.x[i]), region_residency::device) << "region " << i;
      EXPECT_TRUE(h.holds(scene.x[i], 4 * MiB, static_cast<std::uint8_t>(0x80 + i))) << "region " << i;
    }
    for (void* p : scene.w) h.alloc.deallocate(p);
    for (void* p : scene.x) h.alloc.deallocate(p);
    h.expect_clean();
  }
}

// Note [Batched checks]: each check's digest waits for that region's own fences. A write enqueued before the round,
// still queued behind a gate when the batch is enqueued, is what the batch's digest of that region reads: the region
// is dirty and copied (no lost write, no remap under the pending launch); the others stay clean.
TEST(Residency, ABatchedCheckWaitsForAWriteQueuedBeforeIt) {
  harness h(16 * MiB);
  fixed_forecast f;
  const check_scene scene = make_check_scene(h.alloc, h.sim, f, 4);
  const residency_stats before = h.alloc.residency();
  const std::uint64_t gate_id = h.sim.launch_gate(h.s1);
  h.write(h.s1, scene.w[2], 4 * MiB, 0x77);  // pending behind the gate
  h.alloc.residency_tick();
  for (void* p : scene.w) ASSERT_EQ(h.alloc.residency_of(p), region_residency::moving_out);
  for (int i = 0; i < 2; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(scene.w[2]), region_residency::moving_out) << "evicted before its fences passed";
  h.sim.open_gate(gate_id);
  for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.writeback_checked - before.writeback_checked, 4);
  EXPECT_EQ(st.writeback_skipped - before.writeback_skipped, 3);
  EXPECT_EQ(st.bytes_d2h - before.bytes_d2h, static_cast<std::int64_t>(4 * MiB));
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(h.alloc.residency_of(scene.w[i]), region_residency::host) << "weight " << i;
    EXPECT_TRUE(h.holds(scene.w[i], 4 * MiB, i == 2 ? 0x77 : static_cast<std::uint8_t>(i + 1))) << "weight " << i;
  }
  for (void* p : scene.w) h.alloc.deallocate(p);
  for (void* p : scene.x) h.alloc.deallocate(p);
  h.expect_clean();
}

// The end of a check scene's test: every weight on the host with the bytes it was written with, the books sound, and
// no invalid access on the simulated device; then the scene's memory is freed.
void expect_scene_evicted_whole(caching_allocator& alloc, sim_driver& sim, const check_scene& scene) {
  for (std::size_t i = 0; i < scene.w.size(); ++i) {
    EXPECT_EQ(alloc.residency_of(scene.w[i]), region_residency::host) << "weight " << i;
    EXPECT_TRUE(sim_holds(sim, scene.w[i], 4 * MiB, static_cast<std::uint8_t>(i + 1))) << "weight " << i;
  }
  EXPECT_NO_THROW(alloc.verify());
  for (void* p : scene.w) alloc.deallocate(p);
  for (void* p : scene.x) alloc.deallocate(p);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Batched checks]: when the batch's digest launch fails, every eviction of the batch copies instead, as a single
// check's failed launch does (no check is resolved, nothing reads as clean), and digests are off from then on.
TEST(Residency, AFailedBatchedDigestCopiesEveryRegionOfTheBatch) {
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(16 * MiB, false, true, true));
  fixed_forecast f;
  const check_scene scene = make_check_scene(alloc, sim, f, 4);
  const residency_stats before = alloc.residency();
  const std::size_t launches = sim.num_digest_launches();
  port.fail_digests = 1;
  alloc.residency_tick();  // the failure is the engine's to handle: nothing thrown
  EXPECT_EQ(port.fail_digests, 0) << "no digest was tried";
  for (int i = 0; i < 4; ++i) alloc.residency_tick();
  const residency_stats st = alloc.residency();
  EXPECT_EQ(sim.num_digest_launches(), launches);
  EXPECT_EQ(st.writeback_checked, before.writeback_checked) << "a check was resolved on words no digest wrote";
  EXPECT_EQ(st.writeback_skipped, before.writeback_skipped);
  EXPECT_EQ(st.bytes_d2h - before.bytes_d2h, static_cast<std::int64_t>(16 * MiB));
  expect_scene_evicted_whole(alloc, sim, scene);
}

// Note [Batched checks]: a check whose own fence fails to enqueue is undone alone (it stays on the device, whole);
// the others of the batch share the digest launch and go on, and a later round evicts the undone one.
TEST(Residency, ABatchedCheckWhoseFenceFailsIsUndoneAlone) {
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(16 * MiB, false, true, true));
  fixed_forecast f;
  const check_scene scene = make_check_scene(alloc, sim, f, 4);
  const residency_stats before = alloc.residency();
  const std::size_t launches = sim.num_digest_launches();
  const std::size_t digests = sim.num_digests();
  int waits = 0;
  port.on_stream_wait = [&] {  // one fence per check (the legacy stream): the second check's fails
    if (++waits == 2) throw cuda_error(999, "faulty_driver: stream_wait failed on purpose");
  };
  EXPECT_THROW(alloc.residency_tick(), cuda_error);
  port.on_stream_wait = nullptr;
  ASSERT_EQ(waits, 4);
  std::size_t undone = 0;
  for (void* p : scene.w) {
    const region_residency state = alloc.residency_of(p);
    EXPECT_TRUE(state == region_residency::moving_out || state == region_residency::device);
    undone += state == region_residency::device;
  }
  EXPECT_EQ(undone, 1u) << "the failure undid other checks of the batch, or none";
  EXPECT_EQ(sim.num_digest_launches() - launches, 1u);
  EXPECT_EQ(sim.num_digests() - digests, 3u);
  EXPECT_NO_THROW(alloc.verify());
  for (int i = 0; i < 8; ++i) alloc.residency_tick();
  const residency_stats st = alloc.residency();
  EXPECT_EQ(st.writeback_skipped - before.writeback_skipped, 4);
  EXPECT_EQ(st.bytes_d2h, before.bytes_d2h);
  expect_scene_evicted_whole(alloc, sim, scene);
}

// Note [Chunks]: a large segment is one physical allocation mapped in one call, so an eviction unmaps it in one
// call even on a driver that unmaps one mapping per call.
TEST(Residency, ALargeSegmentIsOneMapping) {
  for (const bool one_per_call : {false, true}) {
    SCOPED_TRACE(one_per_call ? "a driver that unmaps one mapping per call" : "batched");
    sim_options so = harness::make_sim(true, true);
    so.unmap_one_mapping = one_per_call;
    sim_driver sim(so);
    caching_allocator alloc(sim, harness::make_options(64 * MiB, false, true, true));
    std::size_t creates = sim.num_creates(), maps = sim.num_maps();
    void* a = alloc.allocate(8 * MiB, nullptr);
    EXPECT_EQ(sim.num_creates() - creates, 1u);
    EXPECT_EQ(sim.num_maps() - maps, 1u);
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 8 * MiB, true, 0x42}});
    const std::size_t before = sim.num_unmaps();
    ASSERT_TRUE(alloc.request_evict(a));
    alloc.residency_tick();
    ASSERT_EQ(alloc.residency_of(a), region_residency::host);
    EXPECT_EQ(sim.num_unmaps() - before, 1u);
    ASSERT_TRUE(alloc.request_prefetch(a));
    alloc.residency_tick();
    ASSERT_EQ(alloc.residency_of(a), region_residency::device);
    EXPECT_TRUE(sim_holds(sim, a, 8 * MiB, 0x42));
    alloc.deallocate(a);
    EXPECT_NO_THROW(alloc.verify());
    EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  }
}

// Note [Oversize reuse]: with no room for a new segment, a request takes a larger idle segment of its stream (no
// driver call) when LAYERSWAP_OVERSIZE allows it; otherwise it reclaims that segment and makes one of its size.
TEST(Residency, OversizeReuseTakesALargerIdleSegmentUnderPressure) {
  for (const double oversize : {1.0, 2.0}) {
    SCOPED_TRACE(oversize == 1.0 ? "off" : "up to twice the size");
    sim_driver sim(harness::make_sim(true, true));
    allocator_options o = harness::make_options(16 * MiB, false, true, true);
    o.oversize = oversize;
    caching_allocator alloc(sim, o);
    void* big = alloc.allocate(6 * MiB, nullptr);
    void* fill = alloc.allocate(10 * MiB, nullptr);  // the budget is full
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(fill), 10 * MiB, true, 0x17}});
    alloc.deallocate(big);  // idle, 6 MiB
    const std::size_t creates = sim.num_creates(), maps = sim.num_maps();
    void* a = alloc.allocate(4 * MiB, nullptr);
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x29}});
    const allocator_stats st = alloc.stats();
    if (oversize > 1.0) {
      EXPECT_EQ(a, big) << "the idle 6 MiB segment serves the 4 MiB request";
      EXPECT_EQ(st.num_oversize_reuses, 1);
      EXPECT_EQ(st.num_reclaims, 0);
      EXPECT_EQ(sim.num_creates(), creates);
      EXPECT_EQ(sim.num_maps(), maps);
    } else {
      EXPECT_EQ(st.num_oversize_reuses, 0);
      EXPECT_EQ(st.num_reclaims, 1) << "the idle segment was reclaimed for a new one";
      EXPECT_EQ(sim.num_maps() - maps, 1u);
    }
    EXPECT_TRUE(sim_holds(sim, a, 4 * MiB, 0x29));
    EXPECT_TRUE(sim_holds(sim, fill, 10 * MiB, 0x17));
    EXPECT_LE(alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
    alloc.deallocate(a);
    // With room in the budget, even oversize > 1 makes a segment of the size: the reuse is for pressure only.
    alloc.deallocate(fill);
    alloc.empty_cache();
    void* b = alloc.allocate(6 * MiB, nullptr);
    alloc.deallocate(b);
    const std::int64_t reuses = alloc.stats().num_oversize_reuses;
    void* c = alloc.allocate(4 * MiB, nullptr);
    EXPECT_NE(c, b);
    EXPECT_EQ(alloc.stats().num_oversize_reuses, reuses);
    alloc.deallocate(c);
    EXPECT_NO_THROW(alloc.verify());
    EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  }
}

// LAYERSWAP_WRITEBACK=always, or a device that cannot digest: every eviction copies.
TEST(Residency, WithoutDigestsEveryEvictionCopies) {
  for (const bool skip_clean : {false, true}) {
    SCOPED_TRACE(skip_clean ? "a device without digests" : "LAYERSWAP_WRITEBACK=always");
    harness h(64 * MiB, true, false, true, skip_clean, /*sim_digests=*/!skip_clean);
    void* a = h.evicted(4 * MiB, 0x5a);
    h.come_back(a);
    h.go_out(a);
    EXPECT_TRUE(h.holds(a, 4 * MiB, 0x5a));
    EXPECT_EQ(h.alloc.residency().writeback_checked, 0);
    EXPECT_EQ(h.alloc.residency().bytes_d2h, static_cast<std::int64_t>(8 * MiB));
    EXPECT_EQ(h.sim.num_digests(), 0u);
    h.alloc.deallocate(a);
    h.expect_clean();
  }
}

TEST(Residency, WriteDuringEvictionCopyAbandonsTheMove) {
  harness h(64 * MiB, /*eager=*/false);
  void* a = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, a, 4 * MiB, 0x11);
  h.sim.run_all();
  ASSERT_TRUE(h.alloc.request_evict(a));
  h.write(h.s2, a, 4 * MiB, 0x33);  // after the snapshot: the copy may miss it
  h.sim.run_all();
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_EQ(h.alloc.residency().abandoned, 1);
  EXPECT_EQ(h.alloc.residency().evictions, 0);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x33));
  // Untouched now: the next attempt goes through, with the last write.
  ASSERT_TRUE(h.alloc.request_evict(a));
  h.sim.run_all();
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x33));
  h.expect_clean();
}

// Note [Launch streams]: a stream the program launches on but never allocates on (NCCL's under
// DistributedDataParallel) is fenced too: the eviction's copy waits for a write queued there before it, and the
// remap comes after it (unfenced, the copy took the old bytes and the remap ran under the pending write).
TEST(Residency, EvictionWaitsForAStreamKnownOnlyFromItsLaunches) {
  harness h(64 * MiB);
  void* a = h.written(4 * MiB, 0x11);
  const stream_handle s3 = h.sim.create_stream();    // no allocation on it, not given to set_streams
  const std::uint64_t running = h.sim.launch_gate(s3);  // a kernel still running there...
  h.write(s3, a, 4 * MiB, 0x55);                        // ... ahead of a write to `a`
  ASSERT_TRUE(h.alloc.request_evict(a));
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::moving_out);  // its copy waits for s3
  h.sim.open_gate(running);
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x55));
  h.expect_clean();
  // Destroyed, it is forgotten: the next moves do not fence it (a fence on it would be an invalid handle).
  gate::forget_stream(reinterpret_cast<std::uint64_t>(s3));
  h.sim.destroy_stream(s3);
  h.come_back(a);
  h.go_out(a);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x55));
  h.expect_clean();
}

TEST(Residency, EvictionWaitsForLaunchesEnqueuedBeforeIt) {
  harness h(64 * MiB, /*eager=*/false);
  void* a = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, a, 4 * MiB, 0x77);  // still pending when the eviction starts
  ASSERT_TRUE(h.alloc.request_evict(a));
  h.alloc.residency_tick();  // copy not done: nothing happens
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::moving_out);
  h.sim.run_all();
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x77));
  h.expect_clean();
}

TEST(Residency, LaunchWaitsInEnterDuringARemap) {
  std::atomic<bool> entered{false};
  std::thread launcher;
  harness* hp = nullptr;
  void* a = nullptr;
  sim_options so;
  so.total_memory = 512 * MiB;
  sim_driver sim(so);
  allocator_options o = harness::make_options(64 * MiB, false, true, true);
  std::atomic<bool> hook_saw_entered{false};
  o.residency.remap_hook = [&](region_id id) {
    launcher = std::thread([&, id] {
      gate::enter(id);
      entered = true;
      sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 2 * MiB, true, 0x44}});
      gate::exit(id, 1000);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    hook_saw_entered = entered.load();
  };
  caching_allocator alloc(sim, o);
  (void)hp;
  a = alloc.allocate(2 * MiB, nullptr);
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 2 * MiB, true, 0x10}});
  ASSERT_TRUE(alloc.request_evict(a));
  alloc.residency_tick();
  launcher.join();
  EXPECT_FALSE(hook_saw_entered.load());  // the launch waited for end_remap()
  EXPECT_TRUE(entered.load());
  EXPECT_EQ(alloc.residency_of(a), region_residency::host);
  EXPECT_EQ(sim.byte_at(reinterpret_cast<device_ptr>(a)), 0x44);  // written through the new host mapping
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  alloc.verify();
}

// Note [Remaps outside the lock]: while the migration thread remaps a region, the program allocates freely; one
// that frees the region being remapped waits for the remap and then finds the region's final state.
TEST(Residency, AllocatorIsFreeDuringARemap) {
  sim_options so;
  so.total_memory = 512 * MiB;
  sim_driver sim(so);
  allocator_options o = harness::make_options(64 * MiB, false, true, true);
  caching_allocator* alloc_ptr = nullptr;
  void* a = nullptr;
  std::atomic<bool> allocated{false};
  std::atomic<bool> freed{false};
  bool hook_saw_allocation = false;
  bool hook_saw_free = true;
  std::thread freer;
  o.residency.remap_hook = [&](region_id) {
    std::thread allocator_user([&] {
      void* q = alloc_ptr->allocate(3 * MiB, nullptr);
      allocated = true;
      alloc_ptr->deallocate(q);
    });
    for (int i = 0; i < 1000 && !allocated.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    hook_saw_allocation = allocated.load();
    allocator_user.join();
    freer = std::thread([&] {
      alloc_ptr->deallocate(a);  // the region being remapped: waits for the remap
      freed = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    hook_saw_free = freed.load();
  };
  caching_allocator alloc(sim, o);
  alloc_ptr = &alloc;
  a = alloc.allocate(4 * MiB, nullptr);
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x66}});
  ASSERT_TRUE(alloc.request_evict(a));
  alloc.residency_tick();
  freer.join();
  EXPECT_TRUE(hook_saw_allocation) << "an allocation waited for a remap (the mutex was held)";
  EXPECT_FALSE(hook_saw_free) << "a region was freed in the middle of its remap";
  EXPECT_TRUE(freed.load());
  for (int i = 0; i < 4; ++i) alloc.residency_tick();  // the freed, host-backed region is retired
  EXPECT_EQ(alloc.residency().evictions, 1);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  alloc.verify();
}

TEST(Residency, AllocationUnderPressureEvictsTheFarthestRegion) {
  fixed_forecast f;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&f);
  void* a = h.written(4 * MiB, 1);
  void* b = h.written(4 * MiB, 2);
  void* c = h.written(4 * MiB, 3);
  f.set({harness::id_of(b), harness::id_of(a), harness::id_of(c)});  // c is used last
  h.alloc.residency_tick();
  void* d = h.alloc.allocate(8 * MiB, h.s1);  // needs 4 MiB more than the budget has
  EXPECT_EQ(h.alloc.residency_of(c), region_residency::host);
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::device);
  EXPECT_EQ(h.alloc.residency().stall_evictions, 1);
  EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  EXPECT_TRUE(h.holds(c, 4 * MiB, 3));
  // Nothing movable left but a and b (d is the target of nothing now: it is swappable too).
  void* e = h.alloc.allocate(12 * MiB, h.s1);
  EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  EXPECT_TRUE(h.holds(a, 4 * MiB, 1));
  EXPECT_TRUE(h.holds(b, 4 * MiB, 2));
  EXPECT_THROW((void)h.alloc.allocate(18 * MiB, h.s1), out_of_memory);
  for (void* p : {a, b, c, d, e}) h.alloc.deallocate(p);
  h.expect_clean();
}

// Note [Allocation under pressure]: with evictions in flight, the allocation waits for the oldest one alone, not
// for the other moves (a prefetch's copy, which frees nothing, or a younger eviction).
TEST(Residency, AllocationUnderPressureWaitsForTheOldestEvictionOnly) {
  harness h(12 * MiB, /*eager=*/false);
  void* a = h.written(4 * MiB, 1);
  void* b = h.written(4 * MiB, 2);
  void* c = h.written(4 * MiB, 3);
  h.sim.run_all();
  ASSERT_TRUE(h.alloc.request_evict(c));
  h.sim.run_all();
  h.alloc.residency_tick();
  ASSERT_EQ(h.alloc.residency_of(c), region_residency::host);
  ASSERT_TRUE(h.alloc.request_prefetch(c));  // takes c's pooled pages back: 12 MiB held, nothing free
  ASSERT_TRUE(h.alloc.request_evict(a));
  ASSERT_TRUE(h.alloc.request_evict(b));
  void* d = h.alloc.allocate(4 * MiB, h.s1);  // does not fit: a's eviction ends, and only it
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::moving_out) << "waited for a younger eviction too";
  EXPECT_EQ(h.alloc.residency_of(c), region_residency::moving_in) << "waited for a prefetch, which frees nothing";
  h.sim.run_all();
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::host);
  EXPECT_EQ(h.alloc.residency_of(c), region_residency::device);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 1));
  EXPECT_TRUE(h.holds(b, 4 * MiB, 2));
  EXPECT_TRUE(h.holds(c, 4 * MiB, 3));
  for (void* p : {a, b, c, d}) h.alloc.deallocate(p);
  h.sim.run_all();
  h.expect_clean();
}

TEST(Residency, PolicyPrefetchesInForecastOrderWithinTheBudget) {
  fixed_forecast f;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&f);
  std::vector<void*> p;
  for (int i = 0; i < 4; ++i) {
    p.push_back(h.alloc.allocate(4 * MiB, h.s1));
    h.write(h.s1, p.back(), 4 * MiB, static_cast<std::uint8_t>(10 + i));
  }
  for (void* q : p) ASSERT_TRUE(h.alloc.request_evict(q));
  h.alloc.residency_tick();
  for (void* q : p) ASSERT_EQ(h.alloc.residency_of(q), region_residency::host);
  // Use order 3, 1, 0, 2; room (16 MiB, no transient usage) for all four, so all come in, 3 and 1 first.
  f.set({harness::id_of(p[3]), harness::id_of(p[1]), harness::id_of(p[0]), harness::id_of(p[2])});
  for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(h.alloc.residency_of(p[i]), region_residency::device) << i;
    EXPECT_TRUE(h.holds(p[i], 4 * MiB, static_cast<std::uint8_t>(10 + i)));
  }
  // A 4 MiB transient allocation: the policy keeps room for it from now on, evicting the farthest (p[2]).
  void* t = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(h.alloc.residency_of(p[2]), region_residency::host);
  h.alloc.deallocate(t);
  for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
  EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  h.expect_clean();
  for (void* q : p) h.alloc.deallocate(q);
}

// LAYERSWAP_PREFETCH=tune (Note [Tuned prefetch]): the engine times steps of a learned forecast by the rounds that see
// each begin, tries auto and then halvings of the regions auto wanted, and keeps the fastest; the wanted set then
// holds no more regions than the distance chosen.
TEST(Residency, ATunedPrefetchKeepsTheFastestDistanceAndPrefetchesNoFurther) {
  prefetch_tune_on tune;
  fixed_forecast f;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&f);
  std::vector<void*> p;
  std::vector<region_id> order;
  for (int i = 0; i < 8; ++i) {
    p.push_back(h.alloc.allocate(2 * MiB, h.s1));
    h.write(h.s1, p.back(), 2 * MiB, static_cast<std::uint8_t>(20 + i));
    order.push_back(harness::id_of(p.back()));
  }
  for (void* q : p) ASSERT_TRUE(h.alloc.request_evict(q));
  h.alloc.residency_tick();
  f.set(order);  // all eight fit the budget: auto wants eight, the tuner then tries 4 and 2
  // A step at 4 regions takes 30 ms, at 2 40 ms, with auto 50 ms; a policy round at each step's start.
  // Everything on the host, then rounds within one step (no step passes): the forecast's first `n` come in.
  const auto expect_brought_in = [&](std::size_t n, const char* when) {
    for (void* q : p) {
      if (h.alloc.residency_of(q) == region_residency::device) {
        ASSERT_TRUE(h.alloc.request_evict(q));
      }
    }
    for (int i = 0; i < 8; ++i) h.alloc.residency_tick();
    for (std::size_t i = 0; i < p.size(); ++i) {
      EXPECT_EQ(h.alloc.residency_of(p[i]), i < n ? region_residency::device : region_residency::host) << when << i;
      EXPECT_TRUE(h.holds(p[i], 2 * MiB, static_cast<std::uint8_t>(20 + i))) << when << i;
    }
  };
  std::vector<std::int64_t> limits;
  for (std::uint64_t step = 0; step < 40; ++step) {
    f.set_launch(1000 * (step + 1), 0);
    h.alloc.residency_tick();
    const std::int64_t limit = h.alloc.residency().prefetch_limit;
    if (limits.empty() || limits.back() != limit) {
      limits.push_back(limit);
      if (limit == 2) expect_brought_in(2, "while 2 is timed: region ");
    }
    g_tune_ns += static_cast<std::uint64_t>(limit == 0 ? 50 : limit == 4 ? 30 : 40) * 1'000'000;
  }
  EXPECT_EQ(limits, (std::vector<std::int64_t>{0, 4, 2, 4})) << "auto, 4, 2, then 4 kept";
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.prefetch_tunings, 1);
  EXPECT_EQ(st.prefetch_tune_steps, 9);
  EXPECT_EQ(st.prefetch_tune_abandoned, 0);
  expect_brought_in(4, "the choice made: region ");
  h.expect_clean();
  for (void* q : p) h.alloc.deallocate(q);
}

// The same with the learner as the forecast: launches fed to it as the tracker's consumer would, a policy round every
// 15 launches, the test's clock moving by each launch's share of a step that costs what the distance in force makes
// it cost. The learner must find the step, its rounds the step's starts, and the tuner the fastest distance.
TEST(Residency, ATunedPrefetchFollowsTheLearnersSteps) {
  prefetch_tune_on tune;
  profiler::learner l;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&l);
  std::vector<void*> p;
  for (int i = 0; i < 8; ++i) {
    p.push_back(h.alloc.allocate(2 * MiB, h.s1));
    h.write(h.s1, p.back(), 2 * MiB, static_cast<std::uint8_t>(40 + i));
  }
  // A step: each region used by three launches, then twelve launches on activations (fresh ids, never recurring),
  // so that the regions' uses lie too far apart to be one group.
  constexpr std::uint64_t k_step = 8 * 15;
  std::uint64_t launch_no = 0;
  region_id fresh = 1'000'000;
  std::vector<std::int64_t> limits;
  for (int step = 0; step < 60; ++step) {
    const std::int64_t limit = h.alloc.residency().prefetch_limit;
    const std::uint64_t step_ns = static_cast<std::uint64_t>(limit == 0 ? 50 : limit == 4 ? 30 : 40) * 1'000'000;
    for (std::uint64_t k = 0; k < k_step; ++k) {
      profiler::access_event e;
      e.launch_no = ++launch_no;
      e.kernel = static_cast<std::uint32_t>(100 + k);
      e.nregions = 1;
      e.flags = 0;
      e.regions[0] = k % 15 < 3 ? harness::id_of(p[k / 15]) : fresh++;
      l.on_event(e);
      g_tune_ns += step_ns / k_step;
      if (k % 15 == 14) h.alloc.residency_tick();
    }
    const std::int64_t now = h.alloc.residency().prefetch_limit;
    if (limits.empty() || limits.back() != now) limits.push_back(now);
  }
  l.flush();
  const profiler::learner_stats ls = l.stats();
  EXPECT_TRUE(ls.learned);
  EXPECT_EQ(ls.period, k_step);
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.prefetch_tunings, 1);
  EXPECT_EQ(st.prefetch_tune_abandoned, 0);
  EXPECT_EQ(st.prefetch_limit, 4);
  EXPECT_EQ(limits, (std::vector<std::int64_t>{0, 4, 2, 4})) << "auto, 4, 2, then 4 kept";
  h.alloc.set_forecast_source(nullptr);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(h.holds(p[i], 2 * MiB, static_cast<std::uint8_t>(40 + i))) << i;
  h.expect_clean();
  for (void* q : p) h.alloc.deallocate(q);
}

// A program thread that finds the mutex taken spins for it, and the waits are counted either way.
TEST(Residency, AProgramCallWaitsForTheMutexAndIsCounted) {
  harness h(16 * MiB);
  std::atomic<bool> done{false};
  std::thread t;
  h.alloc.with_lock_for_test([&] {
    t = std::thread([&] {
      void* a = h.alloc.allocate(1024, h.s1);
      h.alloc.deallocate(a);
      done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(done.load()) << "the call did not wait for the mutex";
  });
  t.join();
  EXPECT_TRUE(done.load());
  const allocator_stats s = h.alloc.stats();
  EXPECT_GE(s.num_lock_waits, 1);
  EXPECT_LE(s.num_lock_spins, s.num_lock_waits);
  EXPECT_GE(s.lock_wait_us, 15'000) << "20 ms held: longer than the spin, so it slept";
}

// The allocator's cache (freed segments, still mapped) is room for prefetches: the policy reclaims it without a
// host wait, once an event says the segments' last launches are done.
TEST(Residency, PolicyReclaimsTheIdleCacheForPrefetches) {
  fixed_forecast f;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&f);
  void* w0 = h.evicted(4 * MiB, 0x31);
  void* w1 = h.evicted(4 * MiB, 0x32);
  void* t = h.alloc.allocate(16 * MiB, h.s1);  // activations fill the budget, then go to the cache
  h.write(h.s1, t, 16 * MiB, 0x01);
  h.alloc.deallocate(t);
  ASSERT_EQ(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  const std::int64_t waits = h.alloc.stats().num_host_waits;
  f.set({harness::id_of(w0), harness::id_of(w1)});
  for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w0), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w1), region_residency::device);
  EXPECT_TRUE(h.holds(w0, 4 * MiB, 0x31));
  EXPECT_TRUE(h.holds(w1, 4 * MiB, 0x32));
  EXPECT_EQ(h.alloc.stats().num_host_waits, waits) << "the policy waited on the host to reclaim the cache";
  EXPECT_GE(h.alloc.stats().num_engine_reclaims, 1);
  EXPECT_EQ(h.alloc.stats().num_reclaims, 0) << "no allocation reclaimed anything";
  EXPECT_GT(h.alloc.stats().segment_destroy_ns, 0);
  const residency_stats r = h.alloc.residency();
  EXPECT_LE(r.room_us + r.maintain_us, r.policy_us) << "both are parts of the policy's rounds here";
  EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  h.expect_clean();
  for (void* w : {w0, w1}) h.alloc.deallocate(w);
}

// Forecast regions never hold more than the budget less the reserve for memory that cannot move, even when the
// cache has free pages: the next step's activations find their room without evicting anything synchronously.
TEST(Residency, PolicyKeepsTheReserveForActivations) {
  fixed_forecast f;
  harness h(16 * MiB);
  h.alloc.set_forecast_source(&f);
  std::vector<void*> w;
  for (int i = 0; i < 4; ++i) w.push_back(h.evicted(4 * MiB, static_cast<std::uint8_t>(0x40 + i)));
  auto ids = [&](std::initializer_list<int> order) {
    std::vector<region_id> out;
    for (int i : order) out.push_back(harness::id_of(w[static_cast<std::size_t>(i)]));
    return out;
  };
  void* act = h.alloc.allocate(8 * MiB, h.s1);  // the step's activations: 8 MiB that cannot move
  h.write(h.s1, act, 8 * MiB, 0x01);
  f.set(ids({0, 1, 2, 3}));
  for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w[0]), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w[1]), region_residency::device);
  h.alloc.deallocate(act);  // the step ends: its activations go to the cache
  f.set(ids({2, 3, 0, 1}));  // the next layers come up
  for (int i = 0; i < 8; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w[2]), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w[3]), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w[0]), region_residency::host) << "forecast regions took the activations' room";
  EXPECT_EQ(h.alloc.residency_of(w[1]), region_residency::host);
  act = h.alloc.allocate(8 * MiB, h.s1);
  EXPECT_EQ(h.alloc.residency().stall_evictions, 0) << "the activations had to evict synchronously";
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(h.holds(w[static_cast<std::size_t>(i)], 4 * MiB, 0x40 + i));
  h.expect_clean();
  h.alloc.deallocate(act);
  for (void* p : w) h.alloc.deallocate(p);
}

// Note [Following reserve]: a step whose activations need 4 MiB in its first half and 20 MiB in its second. With the
// step's peak as the reserve, the weights get 32 - 20 MiB at every moment; with LAYERSWAP_RESERVE=follow, once every
// 64th of the step has been seen, they get the whole first half's room and are evicted ahead of the second half's
// activations, which then find their room without evicting synchronously.
// With `gaps`, no round ever lands in eight 64ths of the step (as in a burst of launches within a millisecond): the
// reserve follows the step after four steps all the same, with those 64ths counted as the step's peak.
TEST(Residency, FollowingReserveGivesTheWeightsTheRoomActivationsLeave) {
  for (const auto& [follow, gaps] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    SCOPED_TRACE(std::string(follow ? "follow" : "peak") + (gaps ? ", gaps" : ""));
    follow_on mode(follow);
    fixed_forecast f;
    harness h(32 * MiB);
    h.alloc.set_forecast_source(&f);
    std::vector<void*> w;
    for (int i = 0; i < 4; ++i) w.push_back(h.written(4 * MiB, static_cast<std::uint8_t>(0x60 + i)));
    std::vector<region_id> order;
    for (void* p : w) order.push_back(harness::id_of(p));
    f.set(order);
    void* small = h.written(4 * MiB, 0x01);  // live all step
    void* big = nullptr;                   // live in the step's second half
    std::size_t weights_at_start = 0;
    std::int64_t stalls_after_learning = 0;
    const int steps = gaps ? 6 : 3;
    for (int step = 0; step < steps; ++step) {
      if (step == steps - 1) stalls_after_learning = h.alloc.residency().stall_evictions;
      for (std::uint64_t phase = 0; phase < 64; ++phase) {
        f.set_position(phase * 1000 / 64 + 1);
        if (phase == 32) big = h.written(16 * MiB, static_cast<std::uint8_t>(0x10 + step));
        if (!gaps || phase < 40 || phase >= 48) {
          for (int i = 0; i < 3; ++i) h.alloc.residency_tick();
        }
        if (phase == 2 && step == steps - 1) {
          for (void* p : w) weights_at_start += h.alloc.residency_of(p) == region_residency::device ? 4 * MiB : 0;
        }
        EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(32 * MiB));
      }
      ASSERT_TRUE(h.holds(big, 16 * MiB, static_cast<std::uint8_t>(0x10 + step)));
      h.alloc.deallocate(big);
    }
    const residency_stats r = h.alloc.residency();
    if (follow) {
      EXPECT_EQ(weights_at_start, 16 * MiB) << "the first half's room held every weight";
      EXPECT_GT(r.reserve_followed, 0);
      EXPECT_EQ(r.stall_evictions, stalls_after_learning) << "the weights were evicted ahead of the activations";
    } else {
      EXPECT_LE(weights_at_start, 12 * MiB) << "the step's peak is reserved at every moment";
      EXPECT_EQ(r.reserve_followed, 0);
    }
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(h.holds(w[static_cast<std::size_t>(i)], 4 * MiB, 0x60 + i));
    EXPECT_TRUE(h.holds(small, 4 * MiB, 0x01));
    h.expect_clean();
    h.alloc.deallocate(small);
    for (void* p : w) h.alloc.deallocate(p);
  }
}

// Note [Reserve profile]: a step of 1000 launches under a 32 MiB budget whose activations need 20 MiB in its first
// third and 4 MiB after, and four 4 MiB weights: two used in its first third (at 64ths 4 and 12), two after it (at 30
// and 40). The first two and one of the others fit beside the first third's activations. Met 64th by 64th, a weight
// on the host takes room only from two 64ths before its use, so the fourth weight stays on the host in the first
// third, comes in after it and leaves after its use: one round trip a step. Setting aside at once the room of every
// weight due next (the rule before session 52) evicted the weights used first as soon as those after them came due:
// three a step.
TEST(Residency, AReserveMetSixtyFourthBySixtyFourthMovesOnlyWhatThePeakLacks) {
  follow_on mode(true);
  fixed_forecast f;
  harness h(32 * MiB);
  h.alloc.set_forecast_source(&f);
  std::vector<void*> w;
  for (int i = 0; i < 4; ++i) w.push_back(h.written(4 * MiB, static_cast<std::uint8_t>(0x70 + i)));
  const std::array<std::uint64_t, 4> use_at = {4, 12, 30, 40};  // in 64ths
  void* small = h.written(4 * MiB, 0x02);  // live all step
  void* big = h.written(16 * MiB, 0x20);   // live in the step's first third
  residency_stats before{};
  const int steps = 5;
  for (int step = 0; step < steps; ++step) {
    if (step == steps - 1) before = h.alloc.residency();
    for (std::uint64_t phase = 0; phase < 64; ++phase) {
      const std::uint64_t position = phase * 1000 / 64 + 1;
      std::vector<std::pair<region_id, std::uint64_t>> entries;
      for (std::size_t i = 0; i < w.size(); ++i) {
        const std::uint64_t use = use_at[i] * 1000 / 64;
        const std::uint64_t d = use >= position ? use - position : use + 1000 - position;
        entries.emplace_back(harness::id_of(w[i]), d);
      }
      std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
      f.set_entries(entries);
      f.set_position(position);
      if (phase == 21) {
        ASSERT_TRUE(h.holds(big, 16 * MiB, static_cast<std::uint8_t>(0x20 + step)));
        h.alloc.deallocate(big);
      }
      if (phase == 0 && step > 0) big = h.written(16 * MiB, static_cast<std::uint8_t>(0x20 + step));
      for (int i = 0; i < 3; ++i) h.alloc.residency_tick();
      EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(32 * MiB));
    }
  }
  const residency_stats r = h.alloc.residency();
  EXPECT_GT(r.reserve_followed, 0);
  EXPECT_EQ(r.stall_evictions, before.stall_evictions) << "the weights made room ahead of the activations";
  EXPECT_EQ(r.prefetches - before.prefetches, 1) << "one round trip in the last step";
  EXPECT_EQ(r.bytes_h2d - before.bytes_h2d, static_cast<std::int64_t>(4 * MiB));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(h.holds(w[static_cast<std::size_t>(i)], 4 * MiB, 0x70 + i));
  EXPECT_TRUE(h.holds(small, 4 * MiB, 0x02));
  h.expect_clean();
  h.alloc.deallocate(small);
  h.alloc.deallocate(big);
  for (void* p : w) h.alloc.deallocate(p);
}

// Note [Automatic reserve]: a step that uses four 4 MiB weights in turn in its first half, whose activations need 4 MiB
// then and 20 MiB in its second half, under a 32 MiB budget and LAYERSWAP_RESERVE=auto. The forecast names the weights
// in the order of their next uses, so with the step's peak reserved (12 MiB for weights) they are evicted and
// prefetched every step. Frozen weights (only read) are evicted clean once their first round trip gave them a digest,
// so the reserve comes to follow the step and the first half's room holds every weight; weights written at each use
// are evicted dirty (copied back), so it stays the step's peak, as it does for frozen weights under
// LAYERSWAP_WRITEBACK=always (no eviction is checked, so none is clean). Either way no byte is lost.
TEST(Residency, AutomaticReserveFollowsTheStepWhileEvictionsAreClean) {
  for (const auto& [trained, skip_clean] : {std::pair{false, true}, std::pair{true, true}, std::pair{false, false}}) {
    SCOPED_TRACE(std::string(trained ? "weights written at each use" : "frozen weights") +
                 (skip_clean ? "" : ", write-back always"));
    auto_on mode;
    fixed_forecast f;
    harness h(32 * MiB, true, false, true, skip_clean);
    h.alloc.set_forecast_source(&f);
    std::vector<void*> w;
    for (int i = 0; i < 4; ++i) w.push_back(h.written(4 * MiB, static_cast<std::uint8_t>(0x60 + i)));
    // The weights by next use after weight `used`'s use: the ones after it, then it.
    const auto upcoming_after = [&](std::size_t used) {
      std::vector<region_id> order;
      for (std::size_t k = 1; k <= w.size(); ++k) order.push_back(harness::id_of(w[(used + k) % w.size()]));
      return order;
    };
    f.set(upcoming_after(w.size() - 1));
    void* small = h.written(4 * MiB, 0x01);  // live all step
    std::vector<std::uint8_t> value{0x60, 0x61, 0x62, 0x63};
    std::size_t weights_at_start = 0;
    std::int64_t stalls_before_last = 0;
    int turned_on = -1;  // the first step by whose end following was on
    const int steps = 8;
    for (int step = 0; step < steps; ++step) {
      if (step == steps - 1) stalls_before_last = h.alloc.residency().stall_evictions;
      void* big = nullptr;
      for (std::uint64_t phase = 0; phase < 64; ++phase) {
        f.set_position(phase * 1000 / 64 + 1);
        if (phase == 2 && step == steps - 1) {
          for (void* p : w) weights_at_start += h.alloc.residency_of(p) == region_residency::device ? 4 * MiB : 0;
        }
        if (phase % 8 == 4 && phase < 32) {  // weight i's use
          const std::size_t i = phase / 8;
          if (trained) {
            value[i] = static_cast<std::uint8_t>(0x80 + 4 * step + static_cast<int>(i));
            h.write(h.s1, w[i], 4 * MiB, value[i]);
          } else {
            h.read(h.s1, w[i], 4 * MiB);
          }
          f.set(upcoming_after(i));
        }
        if (phase == 32) big = h.written(16 * MiB, static_cast<std::uint8_t>(0x10 + step));
        for (int t = 0; t < 3; ++t) h.alloc.residency_tick();
        EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(32 * MiB));
      }
      ASSERT_TRUE(h.holds(big, 16 * MiB, static_cast<std::uint8_t>(0x10 + step)));
      h.alloc.deallocate(big);
      if (turned_on < 0 && h.alloc.residency().reserve_auto_changes > 0) turned_on = step;
    }
    const residency_stats r = h.alloc.residency();
    EXPECT_GE(r.evictions, steps) << "the weights did not move every step: the test proves nothing";
    if (trained || !skip_clean) {
      EXPECT_EQ(r.writeback_skipped, 0);
      EXPECT_EQ(r.reserve_followed, 0) << "dirty or unchecked evictions keep the step's peak";
      EXPECT_EQ(r.reserve_auto_changes, 0);
      EXPECT_LE(weights_at_start, 12 * MiB);
    } else {
      EXPECT_GT(r.writeback_skipped, 0);
      EXPECT_EQ(r.reserve_auto_changes, 1) << "clean evictions turn following on, once";
      // Step 0's evictions are the weights' first: with no digest yet they copy, and tell nothing. Step 1's are
      // checked and clean, so following is on from step 2 (judged as step 2 begins), not a step later.
      EXPECT_EQ(turned_on, 2) << "a region's first eviction counted as dirty";
      EXPECT_GT(r.reserve_followed, 0);
      EXPECT_EQ(weights_at_start, 16 * MiB) << "the first half's room held every weight";
      EXPECT_EQ(r.stall_evictions, stalls_before_last) << "the weights were evicted ahead of the activations";
    }
    for (std::size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(h.holds(w[i], 4 * MiB, value[i])) << "weight " << i;
    EXPECT_TRUE(h.holds(small, 4 * MiB, 0x01));
    h.expect_clean();
    h.alloc.deallocate(small);
    for (void* p : w) h.alloc.deallocate(p);
  }
}

// Note [Following reserve]: with a following reserve, a prefetch that finds no spare of its size and no room takes
// the chunk of an idle segment of exactly its size, leaving the cached segments of other sizes (the next requests'
// cache hits); with the step's peak it reclaims least recently freed first, as before.
TEST(Residency, FollowingReservePrefetchReclaimsAnIdleSegmentOfItsSize) {
  for (const bool follow : {false, true}) {
    SCOPED_TRACE(follow ? "follow" : "peak");
    follow_on mode(follow);
    fixed_forecast f;
    harness h(16 * MiB);
    void* a = h.written(4 * MiB, 0x01);  // live all along
    void* w = h.written(8 * MiB, 0x71);
    h.go_out(w);
    void* b = h.written(8 * MiB, 0x02);  // w's chunk
    void* c = h.written(4 * MiB, 0x03);  // the budget is full
    h.alloc.deallocate(c);               // least recently freed
    h.alloc.deallocate(b);
    h.alloc.set_forecast_source(&f);
    f.set({harness::id_of(w)});
    for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
    ASSERT_EQ(h.alloc.residency_of(w), region_residency::device);
    EXPECT_TRUE(h.holds(w, 8 * MiB, 0x71));
    const std::int64_t reclaims = h.alloc.stats().num_engine_reclaims;
    void* again = h.alloc.allocate(4 * MiB, h.s1);
    if (follow) {
      EXPECT_EQ(reclaims, 1) << "only the segment of the prefetch's size";
      EXPECT_EQ(again, c) << "the cached 4 MiB segment was kept for the next request of its size";
    } else {
      EXPECT_EQ(reclaims, 2) << "least recently freed first";
    }
    h.alloc.deallocate(again);
    EXPECT_TRUE(h.holds(a, 4 * MiB, 0x01));
    h.expect_clean();
    for (void* p : {a, w}) h.alloc.deallocate(p);
  }
}

// Note [Reclaiming for a prefetch]: while a prefetch is in flight and no launch waits, the next one short of room does
// not take the allocator's idle cache (the program's next requests of those sizes would make their segments again);
// once no copy is left in flight, it does.
TEST(Residency, APrefetchTakesTheIdleCacheOnlyWhenTheCopiesWouldStop) {
  fixed_forecast f;  // outlives the allocator
  harness h(16 * MiB, /*eager=*/false);
  void* w0 = h.written(4 * MiB, 0x31);
  void* w1 = h.written(4 * MiB, 0x32);
  h.sim.run_all();
  for (void* w : {w0, w1}) {
    ASSERT_TRUE(h.alloc.request_evict(w));
    h.sim.run_all();
    h.alloc.residency_tick();
    ASSERT_EQ(h.alloc.residency_of(w), region_residency::host);
  }
  std::vector<void*> acts;  // four segments of 4 MiB: the budget is full, then all of it idle in the cache
  for (std::uint8_t v = 0x41; v < 0x45; ++v) acts.push_back(h.written(4 * MiB, v));
  for (void* a : acts) h.alloc.deallocate(a);
  h.sim.run_all();
  h.alloc.residency_tick();  // fences for the idle segments
  h.sim.run_all();
  ASSERT_EQ(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  const std::int64_t reclaims = h.alloc.stats().num_engine_reclaims;
  const std::int64_t segments = h.alloc.stats().large.segments.current;  // w0, w1 and the four idle ones
  h.alloc.set_forecast_source(&f);
  f.set({harness::id_of(w0), harness::id_of(w1)});
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w0), region_residency::moving_in);
  EXPECT_EQ(h.alloc.residency_of(w1), region_residency::host) << "w1 took the cache while w0's copy was in flight";
  EXPECT_EQ(h.alloc.stats().num_engine_reclaims - reclaims, 1);
  EXPECT_EQ(h.alloc.stats().large.segments.current, segments - 1) << "three idle segments left for the program";
  for (int i = 0; i < 6 && h.alloc.residency_of(w1) != region_residency::device; ++i) {
    h.sim.run_all();
    h.alloc.residency_tick();
  }
  EXPECT_EQ(h.alloc.residency_of(w0), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w1), region_residency::device) << "no copy in flight: w1 takes the cache";
  EXPECT_EQ(h.alloc.stats().num_engine_reclaims - reclaims, 2);
  EXPECT_TRUE(h.holds(w0, 4 * MiB, 0x31));
  EXPECT_TRUE(h.holds(w1, 4 * MiB, 0x32));
  EXPECT_LE(h.sim.live_device_bytes(), 16 * MiB);
  h.expect_clean();
  for (void* p : {w0, w1}) h.alloc.deallocate(p);
  h.sim.run_all();
}

// Note [Reclaiming for a prefetch]: a prefetch that releasing every spare chunk would not make room for releases none:
// the spare stays for the next request of its size.
TEST(Residency, APrefetchReleasesNoSpareThatCannotMakeItsRoom) {
  harness h(16 * MiB);
  void* x = h.evicted(4 * MiB, 0x11);  // its chunk: a spare of 4 MiB
  void* w = h.evicted(8 * MiB, 0x12);  // ... and one of 8 MiB
  void* a = h.written(8 * MiB, 0x13);  // takes w's chunk
  void* c1 = h.written(2 * MiB, 0x14);
  void* c2 = h.written(2 * MiB, 0x15);  // 16 MiB held: 4 MiB of it the spare
  ASSERT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(4 * MiB));
  const std::int64_t released = h.alloc.residency().chunks_released;
  EXPECT_FALSE(h.alloc.request_prefetch(w)) << "8 MiB cannot fit: 4 MiB spare, no headroom, no idle cache";
  EXPECT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(h.alloc.residency().chunks_released, released);
  const std::size_t creates = h.sim.num_creates();
  void* y = h.written(4 * MiB, 0x16);
  EXPECT_EQ(h.sim.num_creates(), creates) << "the kept spare served the next request of its size";
  EXPECT_EQ(h.alloc.residency_of(w), region_residency::host);
  EXPECT_TRUE(h.holds(w, 8 * MiB, 0x12));
  EXPECT_TRUE(h.holds(x, 4 * MiB, 0x11));
  h.expect_clean();
  for (void* p : {x, w, a, c1, c2, y}) h.alloc.deallocate(p);
  h.alloc.empty_cache();
  h.expect_clean();
}

// Note [Releasing spares outside the lock]: a policy prefetch whose room is a spare chunk of another size frees that
// spare without the allocator's mutex, before it creates its own chunk (the device never holds more than the
// budget), and gives back what the spare had beyond its chunk.
TEST(Residency, APolicyPrefetchReleasesSparesWithoutTheMutex) {
  fixed_forecast f;  // outlives the allocator
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(16 * MiB, false, true, true));
  const auto written = [&](std::size_t bytes, std::uint8_t v) {
    void* p = alloc.allocate(bytes, nullptr);
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(p), bytes, true, v}});
    return p;
  };
  const auto evicted = [&](std::size_t bytes, std::uint8_t v) {
    void* p = written(bytes, v);
    EXPECT_TRUE(alloc.request_evict(p));
    alloc.residency_tick();
    EXPECT_EQ(alloc.residency_of(p), region_residency::host);
    return p;
  };
  void* x = evicted(8 * MiB, 0x21);  // a spare of 8 MiB
  void* w = evicted(4 * MiB, 0x22);  // ... and one of 4 MiB
  void* a = written(4 * MiB, 0x23);  // takes w's chunk
  void* c = written(4 * MiB, 0x24);  // 16 MiB held: 8 MiB of it the spare
  ASSERT_EQ(alloc.residency().spare_bytes, static_cast<std::int64_t>(8 * MiB));
  ASSERT_EQ(alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
  int releases = 0, held_releases = 0, creates = 0;
  std::size_t most_live = 0;
  std::vector<std::future<void>> probes;
  const auto mutex_taken = [&] {  // whether another thread finds the allocator's mutex taken for a second
    auto probe = std::async(std::launch::async, [&] { alloc.with_lock_for_test([] {}); });
    const bool taken = probe.wait_for(std::chrono::seconds(1)) != std::future_status::ready;
    probes.push_back(std::move(probe));  // a taken one completes once the tick lets the mutex go
    return taken;
  };
  port.on_release = [&](phys_handle) {
    ++releases;
    if (mutex_taken()) ++held_releases;
  };
  port.on_create = [&](std::size_t bytes, memory_location where) {
    if (where != memory_location::device) return;
    ++creates;
    most_live = std::max(most_live, sim.live_device_bytes() + bytes);
  };
  alloc.set_forecast_source(&f);
  f.set({harness::id_of(w)});
  alloc.residency_tick();  // the policy prefetches w: room from the 8 MiB spare
  port.on_release = nullptr;
  port.on_create = nullptr;
  for (auto& p : probes) p.get();
  EXPECT_EQ(releases, 1) << "the 8 MiB spare, once";
  EXPECT_EQ(held_releases, 0) << "the spare was released with the allocator's mutex held";
  EXPECT_EQ(creates, 1) << "w's chunk";
  EXPECT_LE(most_live, 16 * MiB) << "w's chunk was created before the spare was released";
  for (int i = 0; i < 4 && alloc.residency_of(w) != region_residency::device; ++i) alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(w), region_residency::device);
  const residency_stats st = alloc.residency();
  EXPECT_EQ(st.spare_bytes, 0);
  EXPECT_EQ(st.chunks_released_for_size, 1);
  EXPECT_EQ(alloc.stats().device_bytes.current, static_cast<std::int64_t>(12 * MiB)) << "the 4 MiB beyond w's chunk";
  EXPECT_TRUE(sim_holds(sim, w, 4 * MiB, 0x22));
  EXPECT_TRUE(sim_holds(sim, x, 8 * MiB, 0x21));
  EXPECT_NO_THROW(alloc.verify());
  alloc.set_forecast_source(nullptr);
  for (void* p : {x, w, a, c}) alloc.deallocate(p);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// ... and when that release fails, the prefetch is undone: the region stays on the host, whole, and the spare's pages
// stay counted as held (whatever the driver did with them, the budget is never exceeded); the books still add up.
TEST(Residency, APrefetchWhoseSpareFailsToReleaseIsUndone) {
  fixed_forecast f;  // outlives the allocator
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(16 * MiB, false, true, true));
  std::vector<void*> held;
  for (const auto& [bytes, v] : {std::pair{8 * MiB, 0x31}, std::pair{4 * MiB, 0x32}}) {
    held.push_back(alloc.allocate(bytes, nullptr));
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(held.back()), bytes, true, static_cast<std::uint8_t>(v)}});
    ASSERT_TRUE(alloc.request_evict(held.back()));
    alloc.residency_tick();
  }
  void* w = held.back();
  for (int i = 0; i < 2; ++i) held.push_back(alloc.allocate(4 * MiB, nullptr));  // the 4 MiB spare, then new
  ASSERT_EQ(alloc.residency().spare_bytes, static_cast<std::int64_t>(8 * MiB));
  alloc.set_forecast_source(&f);
  f.set({harness::id_of(w)});
  port.fail_releases = 1;
  EXPECT_THROW(alloc.residency_tick(), cuda_error);
  EXPECT_EQ(alloc.residency_of(w), region_residency::host);
  EXPECT_NO_THROW(alloc.verify());
  EXPECT_EQ(alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB)) << "the spare's pages, still held";
  for (int i = 0; i < 4; ++i) alloc.residency_tick();
  EXPECT_EQ(alloc.residency_of(w), region_residency::host) << "no room is left for it";
  EXPECT_TRUE(sim_holds(sim, w, 4 * MiB, 0x32));
  EXPECT_TRUE(sim_holds(sim, held[0], 8 * MiB, 0x31));
  EXPECT_LE(sim.live_device_bytes(), 16 * MiB);
  EXPECT_NO_THROW(alloc.verify());
  alloc.set_forecast_source(nullptr);
  for (void* p : held) alloc.deallocate(p);
  EXPECT_NO_THROW(alloc.verify());
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Cache reserve]: an allocation that finds no cached segment of its size and destroys another's grows the
// automatic cache reserve, and the policy then keeps that much of its room free for the cache (evicting a forecast
// region to make it). Without the reserve the forecast regions keep the room.
TEST(Residency, CacheMissGrowsTheCacheReserve) {
  for (const bool automatic : {false, true}) {
    SCOPED_TRACE(automatic ? "auto" : "none");
    fixed_forecast f;
    harness h(32 * MiB, true, false, true, true, true, 1.0, automatic);
    h.alloc.set_forecast_source(&f);
    std::vector<void*> w;
    for (int i = 0; i < 4; ++i) w.push_back(h.evicted(4 * MiB, static_cast<std::uint8_t>(0x50 + i)));
    std::vector<region_id> order;
    for (void* p : w) order.push_back(harness::id_of(p));
    void* act = h.alloc.allocate(8 * MiB, h.s1);  // activations that cannot move
    h.write(h.s1, act, 8 * MiB, 0x01);
    f.set(order);
    for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
    for (void* p : w) ASSERT_EQ(h.alloc.residency_of(p), region_residency::device);
    h.alloc.deallocate(act);  // to the cache: 16 MiB of weights and 8 MiB cached, 8 MiB left in the budget
    EXPECT_EQ(h.alloc.residency().cache_misses, 0);
    void* other = h.alloc.allocate(10 * MiB, h.s1);  // another size: the cached 8 MiB segment is destroyed for it
    h.write(h.s1, other, 10 * MiB, 0x02);
    const allocator_stats a = h.alloc.stats();
    EXPECT_EQ(a.num_reclaims + a.num_composites, 1) << "the 8 MiB segment reclaimed, or taken by a composite";
    EXPECT_EQ(h.alloc.residency().cache_misses, 1);
    for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
    const residency_stats r = h.alloc.residency();
    std::size_t on_device = 0;
    for (void* p : w) on_device += h.alloc.residency_of(p) == region_residency::device ? 4 * MiB : 0;
    if (automatic) {
      // capacity = 32 - 10 (transient) = 22 MiB; reserve min(10, 22 / 2) = 10 MiB; 12 MiB left for weights.
      EXPECT_EQ(r.cache_reserve_bytes, static_cast<std::int64_t>(10 * MiB));
      EXPECT_LE(on_device, 12 * MiB);
      EXPECT_EQ(h.alloc.residency_of(w[3]), region_residency::host) << "the farthest weight makes the room";
    } else {
      EXPECT_EQ(r.cache_reserve_bytes, 0);
      EXPECT_EQ(on_device, 16 * MiB);
    }
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(h.holds(w[static_cast<std::size_t>(i)], 4 * MiB, 0x50 + i));
    EXPECT_TRUE(h.holds(other, 10 * MiB, 0x02));
    EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(32 * MiB));
    h.expect_clean();
    h.alloc.deallocate(other);
    for (void* p : w) h.alloc.deallocate(p);
  }
}

// Memory that cannot move usefully (a live region absent from the forecast: an activation) is never the policy's
// victim while forecast regions can make the room.
TEST(Residency, PolicyEvictsForecastRegionsNotActivations) {
  fixed_forecast f;
  harness h(12 * MiB);
  h.alloc.set_forecast_source(&f);
  void* w0 = h.written(4 * MiB, 1);
  void* w1 = h.written(4 * MiB, 2);
  void* w2 = h.written(4 * MiB, 3);
  for (void* w : {w1, w2}) ASSERT_TRUE(h.alloc.request_evict(w));
  h.alloc.residency_tick();
  void* act = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, act, 4 * MiB, 0x0a);
  f.set({harness::id_of(w1), harness::id_of(w0), harness::id_of(w2)});
  for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w1), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w0), region_residency::device);
  // The step moves on: w2 is next, w0 is used last. w0 makes the room; the activation stays.
  f.set({harness::id_of(w2), harness::id_of(w1), harness::id_of(w0)});
  for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(act), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w2), region_residency::device);
  EXPECT_EQ(h.alloc.residency_of(w0), region_residency::host);
  for (auto [p, v] : {std::pair{w0, 1}, {w1, 2}, {w2, 3}, {act, 0x0a}}) {
    EXPECT_TRUE(h.holds(p, 4 * MiB, static_cast<std::uint8_t>(v)));
  }
  EXPECT_EQ(h.alloc.residency().stall_evictions, 0);
  h.expect_clean();
  for (void* p : {w0, w1, w2, act}) h.alloc.deallocate(p);
}

// Note [Unfenced prefetch]: a region no launch touched since its eviction has no pending work anywhere, so its
// prefetch does not wait for the program's streams; one touched on the host waits for them.
TEST(Residency, PrefetchOfAnUntouchedRegionDoesNotWaitForTheStreams) {
  harness h(64 * MiB);
  void* a = h.evicted(4 * MiB, 0x51);
  void* b = h.evicted(4 * MiB, 0x52);
  h.write(h.s2, b, 2 * MiB, 0x53);  // b is touched while on the host
  const std::uint64_t busy = h.sim.launch_gate(h.s1);  // the program's streams are busy
  const std::uint64_t busy2 = h.sim.launch_gate(h.s2);
  ASSERT_TRUE(h.alloc.request_prefetch(a));
  ASSERT_TRUE(h.alloc.request_prefetch(b));
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device) << "an untouched region's prefetch waited";
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::moving_in) << "a touched region's prefetch did not wait";
  h.sim.open_gate(busy);
  h.sim.open_gate(busy2);
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::device);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x51));
  EXPECT_TRUE(h.holds(b, 2 * MiB, 0x53));
  EXPECT_TRUE(h.holds(static_cast<char*>(b) + 2 * MiB, 2 * MiB, 0x52));
  h.expect_clean();
  for (void* p : {a, b}) h.alloc.deallocate(p);
}

TEST(Residency, FreeingASwappedOutRegion) {
  harness h(32 * MiB);
  void* a = h.evicted(4 * MiB, 9);
  EXPECT_TRUE(h.alloc.deallocate(a));
  h.expect_clean();
  h.alloc.residency_tick();  // retired: destroyed once its stream is past its launches
  EXPECT_FALSE(h.alloc.owns(a));
  EXPECT_EQ(h.alloc.residency().host_bytes, static_cast<std::int64_t>(4 * MiB));  // pooled for the next one
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(h.alloc.residency_of(b), region_residency::device);
  h.write(h.s1, b, 4 * MiB, 1);
  EXPECT_TRUE(h.holds(b, 4 * MiB, 1));
  h.alloc.deallocate(b);
  h.expect_clean();
}

TEST(Residency, FreeingARegionWhileItMoves) {
  harness h(32 * MiB, /*eager=*/false);
  void* a = h.alloc.allocate(4 * MiB, h.s1);
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, a, 4 * MiB, 1);
  h.write(h.s1, b, 4 * MiB, 2);
  h.sim.run_all();
  ASSERT_TRUE(h.alloc.request_evict(b));
  h.sim.run_all();
  h.alloc.residency_tick();
  ASSERT_EQ(h.alloc.residency_of(b), region_residency::host);
  ASSERT_TRUE(h.alloc.request_evict(a));  // moving out
  ASSERT_TRUE(h.alloc.request_prefetch(b));  // moving in
  h.alloc.deallocate(a);
  h.alloc.deallocate(b);
  h.expect_clean();
  h.sim.run_all();
  h.alloc.residency_tick();
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency().cancelled, 2);
  // a is cached on the device and handed out again; b is gone.
  void* c = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(c, a);
  EXPECT_EQ(h.alloc.residency_of(c), region_residency::device);
  EXPECT_FALSE(h.alloc.owns(b));
  h.alloc.empty_cache();
  h.alloc.deallocate(c);
  h.alloc.empty_cache();
  h.sim.run_all();
  h.expect_clean();
}

TEST(Residency, WithoutATrackerNothingMoves) {
  harness h(8 * MiB, true, false, /*without_tracker=*/false);
  gate::set_fed(false);
  void* a = h.alloc.allocate(4 * MiB, h.s1);
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_FALSE(h.alloc.request_evict(a));
  EXPECT_THROW((void)h.alloc.allocate(4 * MiB, h.s1), out_of_memory);
  EXPECT_FALSE(h.alloc.residency().active);
  h.alloc.deallocate(a);
  h.alloc.deallocate(b);
  h.expect_clean();
}

TEST(Residency, PinnedGroupsAreNeverEvicted) {
  sim_options so;
  so.total_memory = 512 * MiB;
  sim_driver sim(so);
  allocator_options o = harness::make_options(12 * MiB, false, true, true);
  o.residency.pin.first = 1;
  fixed_forecast f;
  caching_allocator alloc(sim, o);
  alloc.set_forecast_source(&f);
  void* a = alloc.allocate(4 * MiB, nullptr);
  void* b = alloc.allocate(4 * MiB, nullptr);
  f.set({harness::id_of(a), harness::id_of(b)});
  alloc.residency_tick();
  EXPECT_FALSE(alloc.request_evict(a));  // first group of the step
  void* c = alloc.allocate(8 * MiB, nullptr);
  EXPECT_EQ(alloc.residency_of(a), region_residency::device);
  EXPECT_EQ(alloc.residency_of(b), region_residency::host);
  for (void* p : {a, b, c}) alloc.deallocate(p);
  alloc.verify();
}

TEST(Residency, HostLimitCapsHostBacking) {
  sim_options so;
  so.total_memory = 512 * MiB;
  sim_driver sim(so);
  allocator_options o = harness::make_options(64 * MiB, false, true, true);
  o.residency.host_limit = 6 * MiB;
  caching_allocator alloc(sim, o);
  void* a = alloc.allocate(4 * MiB, nullptr);
  void* b = alloc.allocate(4 * MiB, nullptr);
  EXPECT_TRUE(alloc.request_evict(a));
  EXPECT_FALSE(alloc.request_evict(b));  // 8 MiB of host backing would exceed 6 MiB
  alloc.residency_tick();
  EXPECT_EQ(alloc.residency().host_bytes, static_cast<std::int64_t>(4 * MiB));
  alloc.deallocate(a);
  alloc.deallocate(b);
  alloc.verify();
}

// ---- randomized stress ----

struct live_alloc {
  void* p = nullptr;
  std::size_t bytes = 0;
  stream_handle home = nullptr;
  int value = -1;  // last value written (in the home stream's order); -1: never written
  event_handle side_write = nullptr;  // recorded after its last write on the side stream (stress, Note [Launch streams])
};

enum class forecast_mode { right, wrong, absent };

// `holding`: launches are held on the GPU for prefetches in flight (Note [Holding a launch on the GPU]), on an
// eager device without the migration thread, so that the test's ticks finish the prefetches they wait for.
void stress(std::uint32_t seed, forecast_mode mode, bool thread, residency_stats& out, std::int64_t& reuses,
            std::int64_t& composites, std::int64_t& spare_composites, std::int64_t& splits, std::int64_t& homes,
            bool holding = false, bool one_stream = false) {
  std::mt19937 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  const std::size_t budget = (6 + pick(14)) * 2 * MiB;
  const bool eager = pick(2) == 0 || holding;
  residency_gate::set_holding(holding);
  struct holding_off {
    ~holding_off() { residency_gate::set_holding(false); }
  } restore;
  fixed_forecast f;  // outlives the allocator (and its migration thread)
  const double oversize = seed % 2 == 0 ? 2.0 : 1.0;  // Note [Oversize reuse] on every other seed
  const bool cache_auto = (seed / 2) % 2 == 1;         // Note [Cache reserve] on half the seeds, both oversizes
  g_composites = seed % 3 != 0;                       // Note [Composites] on two seeds in three
  g_split = seed % 4 == 1 || seed % 4 == 2;           // Note [Split segments] on half the seeds, both oversizes
  if (g_split && seed % 8 < 4) g_split_free = budget / 4;  // Note [Split bound] on half of those
  if (g_split && seed % 3 != 1) {  // Note [Splits by reserve]: wider under the peak on two in three of those
    g_split_peak = 16;
    if (g_split_free != std::numeric_limits<std::size_t>::max()) g_split_free_peak = budget / 2;
  }
  g_follow = seed % 5 >= 2;                            // Note [Following reserve] on three seeds in five
  g_auto = seed % 5 == 1;                              // Note [Automatic reserve] on one in five
  struct composites_on {
    ~composites_on() {
      g_composites = true;
      g_split = false;
      g_split_free = std::numeric_limits<std::size_t>::max();
      g_split_peak.reset();
      g_split_free_peak.reset();
      g_follow = false;
      g_auto = false;
    }
  } restore_composites;
  harness h(budget, eager, thread, true, true, true, oversize, cache_auto);
  stream_handle streams[] = {h.s1, one_stream ? h.s1 : h.s2, one_stream ? h.s1 : nullptr};
  // Note [Launch streams]: a stream the allocator never allocates on and is never told of, only launched on, as
  // NCCL's under DistributedDataParallel: it waits for the allocation's stream, writes the allocation in place (a
  // gradient bucket's all-reduce), and is waited for only by the next write of that allocation, whichever stream
  // it is on; record_stream keeps the allocation's memory from reuse meanwhile, as PyTorch's NCCL process group does.
  const stream_handle side = h.sim.create_stream();
  const event_handle to_side = h.sim.create_event();
  std::vector<event_handle> side_events;  // destroyed at the end (a wait on one may still be pending until then)
  std::mt19937 side_rng(seed);  // apart, so that the traces of `rng` stay those the seeds were chosen for
  if (mode != forecast_mode::absent) h.alloc.set_forecast_source(&f);
  std::vector<live_alloc> live;
  std::vector<std::size_t> plan;  // indices into `live` of the next launches (the "right" forecast)
  std::size_t ooms = 0;
  SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget >> 20) + " MiB eager " +
               std::to_string(eager) + " thread " + std::to_string(thread) + " oversize " + std::to_string(oversize) +
               " cache reserve " + (cache_auto ? "auto" : "none") + " composites " + std::to_string(g_composites) +
               " split " + std::to_string(g_split) + " split free " +
               (g_split_free == std::numeric_limits<std::size_t>::max() ? "none" : std::to_string(g_split_free >> 20)) +
               " split peak " + (g_split_peak ? std::to_string(*g_split_peak) : "as split") + " follow " + std::to_string(g_follow) + " auto " +
               std::to_string(g_auto));

  auto refresh_forecast = [&] {
    if (mode == forecast_mode::absent) return;
    std::vector<region_id> order;
    if (mode == forecast_mode::right) {
      for (std::size_t i : plan) {
        if (i >= live.size()) continue;
        const region_id id = harness::id_of(live[i].p);
        if (std::find(order.begin(), order.end(), id) == order.end()) order.push_back(id);
      }
    } else {
      for (const live_alloc& l : live) order.push_back(harness::id_of(l.p));
      std::shuffle(order.begin(), order.end(), rng);
    }
    f.set(order);
  };
  // The learner's position moves on a 64th of a 64-launch step before each tick (Note [Following reserve]), so that
  // the policy sees every 64th and then follows (on the seeds where it does).
  std::uint64_t position = 0;
  auto advance = [&] { f.set_position(position++ % 64, 64); };

  auto launch = [&](stream_handle s, std::vector<sim_access> acc) {
    if (holding) {
      h.launch_holding(s, std::move(acc));
    } else {
      h.launch(s, std::move(acc));
    }
  };
  auto check_contents = [&] {
    // Finishes the prefetches held launches wait for (a prefetch fenced behind a launch held on another lands a
    // tick after that one), as the migration thread would.
    for (int i = 0; holding && i < 6; ++i) h.alloc.residency_tick();
    h.sim.run_all();
    for (const live_alloc& l : live) {
      if (l.value < 0) continue;
      ASSERT_TRUE(h.holds_gated(l.p, l.bytes, static_cast<std::uint8_t>(l.value)))
          << "lost write: " << l.bytes << " bytes at " << l.p << " should hold " << l.value;
    }
  };

  for (int step = 0; step < 400; ++step) {
    const std::size_t op = pick(100);
    if (op < 14 || live.size() < 2) {  // allocate
      const bool small = pick(5) == 0;
      const std::size_t bytes = small ? 4096 + pick(200000) : (1 + pick(3)) * 2 * MiB - pick(2) * 4096;
      stream_handle s = streams[pick(3)];
      try {
        void* p = h.alloc.allocate(bytes, s);
        live.push_back({p, bytes, s, -1});
      } catch (const out_of_memory&) {
        ++ooms;
      }
    } else if (op < 22) {  // free
      const std::size_t i = pick(live.size());
      EXPECT_TRUE(h.alloc.deallocate(live[i].p));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      plan.clear();
    } else if (op < 70) {  // launch: write one allocation on its home stream, read up to two others anywhere
      std::size_t w = plan.empty() ? pick(live.size()) : plan.front();
      if (!plan.empty()) plan.erase(plan.begin());
      if (w >= live.size()) w = pick(live.size());
      live_alloc& target = live[w];
      const auto v = static_cast<std::uint8_t>(1 + pick(250));
      std::vector<sim_access> acc{{reinterpret_cast<device_ptr>(target.p), target.bytes, true, v}};
      target.value = v;
      if (!one_stream && side_rng() % 6 == 0) {  // on the side stream
        if (target.side_write) h.sim.stream_wait(side, target.side_write);  // (in its own order anyway)
        h.sim.record(to_side, target.home);
        h.sim.stream_wait(side, to_side);
        launch(side, acc);
        h.alloc.record_stream(target.p, side);
        target.side_write = side_events.emplace_back(h.sim.create_event());
        h.sim.record(target.side_write, side);
      } else {
        if (target.side_write) h.sim.stream_wait(target.home, target.side_write);
        launch(target.home, acc);
      }
      for (int k = 0; k < 2; ++k) {
        const live_alloc& r = live[pick(live.size())];
        if (r.p == target.p) continue;
        stream_handle s = streams[pick(3)];
        launch(s, {{reinterpret_cast<device_ptr>(r.p), r.bytes, false, 0}});
        if (s != r.home) h.alloc.record_stream(r.p, s);
      }
    } else if (op < 80) {  // plan the next launches (what a right forecast knows)
      plan.clear();
      for (int k = 0; k < 8; ++k) plan.push_back(pick(live.size()));
      refresh_forecast();
    } else if (op < 88) {
      const bool following = g_follow && mode != forecast_mode::absent;
      for (int i = 0; i < (following ? 4 : 1); ++i) {  // following seeds: enough rounds to see every 64th
        advance();
        if (!thread) h.alloc.residency_tick();
      }
    } else if (op < 92) {  // forced moves, as a confused policy would make them
      const live_alloc& l = live[pick(live.size())];
      if (pick(2)) (void)h.alloc.request_evict(l.p); else (void)h.alloc.request_prefetch(l.p);
    } else if (op < 97) {
      const stream_handle s = streams[pick(3)];
      if (!eager) (void)h.sim.run_one(!one_stream && side_rng() % 4 == 0 ? side : s);
    } else {
      check_contents();
    }
    if (mode == forecast_mode::wrong && pick(10) == 0) refresh_forecast();
    ASSERT_TRUE(h.sim.violations().empty()) << "step " << step << ": " << first_violation(h.sim);
    ASSERT_NO_THROW(h.alloc.verify()) << "step " << step;
    ASSERT_LE(h.sim.live_device_bytes(), budget) << "step " << step;
    if (::testing::Test::HasFatalFailure()) return;
  }
  check_contents();
  for (const live_alloc& l : live) h.alloc.deallocate(l.p);
  for (int i = 0; holding && i < 6; ++i) h.alloc.residency_tick();
  h.sim.run_all();
  h.alloc.residency_tick();
  h.alloc.empty_cache();
  EXPECT_TRUE(h.sim.violations().empty());
  h.alloc.verify();
  h.sim.destroy_event(to_side);
  for (event_handle e : side_events) h.sim.destroy_event(e);
  (void)ooms;
  out = h.alloc.residency();
  reuses = h.alloc.stats().num_oversize_reuses;
  composites = h.alloc.stats().num_composites;
  spare_composites = h.alloc.stats().num_spare_composites;  // Note [Spare composites]
  splits = h.alloc.stats().num_splits;
  homes = h.alloc.stats().num_home_segments;
}

// Runs seeds [first, last] and checks that they swapped at all (a stress test that moves nothing proves nothing).
// `one_stream`: every launch and allocation on one stream, where composites (Note [Composites]) are most frequent.
void stress_seeds(std::uint32_t first, std::uint32_t last, forecast_mode mode, bool thread, bool holding = false,
                  bool one_stream = false) {
  residency_stats sum;
  std::int64_t reuses = 0, composites = 0, spare_composites = 0, splits = 0, homes = 0;
  const std::uint64_t holds_before = residency_gate::waits().holds;
  for (std::uint32_t seed = first; seed <= last; ++seed) {
    residency_stats st;
    std::int64_t seed_reuses = 0, seed_composites = 0, seed_spare_composites = 0, seed_splits = 0, seed_homes = 0;
    stress(seed, mode, thread, st, seed_reuses, seed_composites, seed_spare_composites, seed_splits, seed_homes,
           holding, one_stream);
    reuses += seed_reuses;
    homes += seed_homes;
    composites += seed_composites;
    spare_composites += seed_spare_composites;
    splits += seed_splits;
    if (::testing::Test::HasFatalFailure()) return;
    sum.evictions += st.evictions;
    sum.prefetches += st.prefetches;
    sum.abandoned += st.abandoned;
    sum.cancelled += st.cancelled;
    sum.stall_evictions += st.stall_evictions;
    sum.writeback_checked += st.writeback_checked;
    sum.writeback_skipped += st.writeback_skipped;
    sum.cache_misses += st.cache_misses;
    sum.cache_reserve_bytes = std::max(sum.cache_reserve_bytes, st.cache_reserve_bytes);
    sum.reserve_followed += st.reserve_followed;
    sum.chunks_released_for_size += st.chunks_released_for_size;
  }
  std::printf("  swapped: %lld evictions (%lld synchronous), %lld prefetches, %lld abandoned, %lld cancelled\n",
              static_cast<long long>(sum.evictions), static_cast<long long>(sum.stall_evictions),
              static_cast<long long>(sum.prefetches), static_cast<long long>(sum.abandoned),
              static_cast<long long>(sum.cancelled));
  std::printf("  write-backs: %lld checked, %lld skipped (clean); oversize reuses: %lld; composites: %lld (of spares %lld); "
              "splits: %lld (home segments %lld); cache misses %lld, largest cache reserve at a seed's end %lld bytes; rounds "
              "with a following reserve %lld; spare chunks released for another size %lld\n",
              static_cast<long long>(sum.writeback_checked), static_cast<long long>(sum.writeback_skipped),
              static_cast<long long>(reuses), static_cast<long long>(composites),
              static_cast<long long>(spare_composites), static_cast<long long>(splits),
              static_cast<long long>(homes), static_cast<long long>(sum.cache_misses),
              static_cast<long long>(sum.cache_reserve_bytes), static_cast<long long>(sum.reserve_followed),
              static_cast<long long>(sum.chunks_released_for_size));
  EXPECT_GT(sum.evictions, 0);
  // Note [Releasing spares outside the lock]: the random sizes make prefetches release spares of other sizes, so the
  // budget and lost-write checks cover the policy's frees without the mutex.
  EXPECT_GT(sum.chunks_released_for_size, 0);
  EXPECT_GT(sum.prefetches, 0);
  // Note [Write-back]: the random traces leave some regions unwritten between a prefetch and an eviction and write
  // others; both sides of the check must be exercised for the lost-write checks above to cover the skip. With the
  // migration thread running, the counts depend on timing (a few dozen checks): the runs without it make sure.
  if (!thread) {
    EXPECT_GT(sum.writeback_skipped, 0);
    EXPECT_GT(sum.writeback_checked, sum.writeback_skipped);
    EXPECT_GT(reuses, 0) << "no oversize reuse (Note [Oversize reuse]) happened under the checks";
  }
  if (!thread && !holding) {
    EXPECT_GT(composites, 0) << "no composite (Note [Composites]) was made under the checks";
  }
  if (!thread) {
    EXPECT_GT(splits, 0) << "no split segment (Note [Split segments]) served an allocation under the checks";
  }
  if (!thread && mode != forecast_mode::absent) {
    EXPECT_GT(sum.reserve_followed, 0) << "no round followed the step (Note [Following reserve]) under the checks";
  }
  if (holding) {
    const std::uint64_t holds = residency_gate::waits().holds - holds_before;
    std::printf("  held launches: %llu\n", static_cast<unsigned long long>(holds));
    EXPECT_GT(holds, 0u) << "no launch was ever held: the test proves nothing about holds";
  }
}

TEST(ResidencyStress, RightForecast) {
  stress_seeds(1, 12, forecast_mode::right, false);
}

TEST(ResidencyStress, WrongForecast) {
  stress_seeds(101, 112, forecast_mode::wrong, false);
}

TEST(ResidencyStress, NoForecast) {
  stress_seeds(201, 212, forecast_mode::absent, false);
}

TEST(ResidencyStress, OneStream) {
  stress_seeds(501, 512, forecast_mode::right, false, false, true);
  stress_seeds(513, 518, forecast_mode::wrong, false, false, true);
}

TEST(ResidencyStress, HeldLaunches) {
  stress_seeds(401, 412, forecast_mode::right, false, true);
  stress_seeds(413, 418, forecast_mode::wrong, false, true);
}

TEST(ResidencyStress, MigrationThreadRunning) {
  stress_seeds(301, 303, forecast_mode::right, true);
  stress_seeds(304, 306, forecast_mode::wrong, true);
}

}  // namespace
}  // namespace layerswap

namespace layerswap {
namespace {

// On the H100: 8 x 600 MiB written under a 1 GiB budget (7 swapped out), all freed, then one more 600 MiB failed
// with 604 MiB cached and nothing live. Scaled down: 8 x 12 MiB under 20 MiB, everything freed, allocate again.
class MemoryFreedAfterSwapping : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(MemoryFreedAfterSwapping, IsUsableAgain) {
  const auto [eager, thread] = GetParam();
  harness h(20 * MiB, eager, thread);
  std::vector<void*> held;
  for (int i = 0; i < 8; ++i) {
    void* p = h.alloc.allocate(12 * MiB, h.s1);
    h.write(h.s1, p, 12 * MiB, static_cast<std::uint8_t>(10 + i));
    held.push_back(p);
  }
  for (int i = 0; i < 8; ++i) {
    h.read(h.s1, held[i], 12 * MiB);
    h.sim.run_all();
    EXPECT_TRUE(h.holds_gated(held[i], 12 * MiB, static_cast<std::uint8_t>(10 + i))) << i;
  }
  for (void* p : held) EXPECT_TRUE(h.alloc.deallocate(p));
  h.alloc.residency_tick();
  void* again = nullptr;
  EXPECT_NO_THROW(again = h.alloc.allocate(12 * MiB, h.s1)) << "memory freed after swapping is not usable again";
  if (again) {
    h.write(h.s1, again, 12 * MiB, 0x77);
    h.sim.run_all();
    EXPECT_TRUE(h.holds_gated(again, 12 * MiB, 0x77));
    h.alloc.deallocate(again);
  }
  h.sim.run_all();
  h.expect_clean();
}

INSTANTIATE_TEST_SUITE_P(Residency, MemoryFreedAfterSwapping,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

}  // namespace
}  // namespace layerswap

namespace layerswap {
namespace {

// The engine's copy streams are registered as internal: the tracker leaves copies on them out of the gate, so a
// move's own copy never counts as a use of the region it moves.
TEST(ResidencyGate, EngineCopyStreamsAreInternal) {
  sim_driver port;
  std::mutex mutex;
  struct no_pages final : detail::page_source {
    bool take_pages(std::size_t, std::vector<phys_handle>&) override { return false; }
    void give_pages(std::vector<phys_handle>&) override {}
    bool take_room(std::size_t) override { return false; }
    void give_room(std::size_t) override {}
    [[nodiscard]] std::size_t budget() const override { return 0; }
    [[nodiscard]] std::size_t held_bytes() const override { return 0; }
    [[nodiscard]] std::size_t pooled_bytes() const override { return 0; }
    [[nodiscard]] std::size_t idle_bytes() const override { return 0; }
    void reclaim_idle(std::size_t) override {}
    void maintain() override {}
  } pages;
  const stream_handle program = port.create_stream();
  {
    detail::residency_engine engine(port, mutex, pages, residency_options{});
    const auto [d2h, h2d] = engine.copy_streams();
    EXPECT_TRUE(residency_gate::internal_stream(reinterpret_cast<std::uint64_t>(d2h)));
    EXPECT_TRUE(residency_gate::internal_stream(reinterpret_cast<std::uint64_t>(h2d)));
    EXPECT_FALSE(residency_gate::internal_stream(reinterpret_cast<std::uint64_t>(program)));
    EXPECT_FALSE(residency_gate::internal_stream(0));
    // Streams created after the engine's are the program's too.
    const stream_handle later = port.create_stream();
    EXPECT_FALSE(residency_gate::internal_stream(reinterpret_cast<std::uint64_t>(later)));
    port.destroy_stream(later);
  }
  port.destroy_stream(program);
}


// Note [Unknown launches]: a launch whose arguments were not read may touch any region, so it blocks every
// remap while it is issued, abandons every move it overlaps, and waits while any remap is in progress.
// Note [Launch streams]: the streams known from launches, by context, until forgotten; a stream being destroyed
// waits for a fence being recorded on it.
TEST(ResidencyGate, LaunchStreamsAreVisitedByContextUntilForgotten) {
  gate::forget_streams();
  const auto seen = [](std::uint64_t context) {
    std::vector<std::uint64_t> out;
    gate::for_each_stream(context, [&](std::uint64_t s) { out.push_back(s); });
    std::sort(out.begin(), out.end());
    return out;
  };
  using list = std::vector<std::uint64_t>;
  const std::uint64_t epoch = gate::streams_epoch();
  gate::note_stream(0x100, 7);
  gate::note_stream(0x100, 7);  // once
  gate::note_stream(0x200, 7);
  gate::note_stream(0x300, 8);  // another context's
  gate::note_stream(0, 7);      // the legacy stream: the engine always fences it
  EXPECT_EQ(seen(7), (list{0x100, 0x200}));
  EXPECT_EQ(seen(8), (list{0x300}));
  gate::forget_stream(0x100);
  EXPECT_NE(gate::streams_epoch(), epoch);  // threads that noted it note again
  EXPECT_EQ(seen(7), (list{0x200}));
  gate::note_stream(0x400, 7);
  EXPECT_EQ(seen(7), (list{0x200, 0x400}));

  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::atomic<bool> forgotten{false};
  std::thread engine([&] {
    gate::for_each_stream(7, [&](std::uint64_t s) {
      if (s != 0x200) return;
      inside = true;
      while (!release) std::this_thread::yield();
    });
  });
  while (!inside) std::this_thread::yield();
  std::thread destroyer([&] {
    gate::forget_stream(0x200);
    forgotten = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(forgotten);  // the fence on it is still being recorded
  release = true;
  engine.join();
  destroyer.join();
  EXPECT_TRUE(forgotten);
  EXPECT_EQ(seen(7), (list{0x400}));

  // A full table takes no more (and says so once); forgetting every stream empties it.
  for (std::uint64_t s = 1; s <= gate::k_max_streams + 1; ++s) gate::note_stream(0x10000 + s, 9);
  EXPECT_EQ(seen(9).size(), gate::k_max_streams - 2);  // 0x300 and 0x400 hold two slots
  gate::forget_streams();
  EXPECT_TRUE(seen(7).empty());
  EXPECT_TRUE(seen(8).empty());
  EXPECT_TRUE(seen(9).empty());
}

TEST(ResidencyGate, UnknownLaunchesBlockEveryRemap) {
  const region_id id = region_map::next_region_id();
  residency_gate::prepare(id);
  const std::uint64_t s = residency_gate::sequence(id);
  residency_gate::enter(residency_gate::k_unknown_region);
  EXPECT_FALSE(residency_gate::try_begin_remap(id, s)) << "a remap started while an unknown launch was issued";
  residency_gate::exit(residency_gate::k_unknown_region, 1);
  EXPECT_FALSE(residency_gate::try_begin_remap(id, s)) << "a move overlapped by an unknown launch was not abandoned";
  const std::uint64_t s2 = residency_gate::sequence(id);
  EXPECT_GT(s2, s);
  ASSERT_TRUE(residency_gate::try_begin_remap(id, s2));
  std::atomic<bool> entered{false};
  std::thread launcher([&] {
    residency_gate::enter(residency_gate::k_unknown_region);
    entered = true;
    residency_gate::exit(residency_gate::k_unknown_region, 2);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(entered.load()) << "an unknown launch was issued during a remap";
  residency_gate::end_remap(id);
  launcher.join();
  EXPECT_TRUE(entered.load());
}

}  // namespace
}  // namespace layerswap

namespace layerswap {
namespace {

// Note [Waiting for a prefetch]: a launch touching a region whose prefetch is in flight waits in enter() until it
// lands, without counting as issuing (the remap must be able to start), and the waker is called.
TEST(ResidencyGate, LaunchWaitsForAnIncomingPrefetch) {
  const region_id id = region_map::next_region_id();
  residency_gate::prepare(id);
  std::atomic<int> woken{0};
  int context = 0;
  residency_gate::set_waiter_wake([](void* c) { ++*static_cast<std::atomic<int>*>(c); }, &woken);
  const residency_gate::wait_counts before = residency_gate::waits();
  residency_gate::set_incoming(id, true);
  residency_gate::set_on_host(id, true);
  std::atomic<bool> entered{false};
  std::atomic<bool> on_host{true};
  std::thread launcher([&] {
    on_host = residency_gate::enter(id);
    entered = true;
    residency_gate::exit(id, 1);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  EXPECT_FALSE(entered.load()) << "a launch was issued while its region's prefetch was in flight";
  EXPECT_EQ(residency_gate::waiting(), 1u);
  EXPECT_EQ(residency_gate::issuing(id), 0u) << "a waiting launch counts as issuing: the remap could never start";
  EXPECT_GE(woken.load(), 1);
  const std::uint64_t s = residency_gate::sequence(id);
  ASSERT_TRUE(residency_gate::try_begin_remap(id, s));
  residency_gate::set_on_host(id, false);
  residency_gate::end_remap(id);
  residency_gate::set_incoming(id, false);
  launcher.join();
  EXPECT_TRUE(entered.load());
  EXPECT_FALSE(on_host.load()) << "the launch saw the region on the host after its prefetch landed";
  const residency_gate::wait_counts after = residency_gate::waits();
  EXPECT_EQ(after.waits, before.waits + 1);
  EXPECT_GE(after.ns - before.ns, 30'000'000u);
  EXPECT_EQ(after.timeouts, before.timeouts);
  residency_gate::clear_waiter_wake(&context);  // not the registered one: no effect
  residency_gate::clear_waiter_wake(&woken);
}

// Turns holding on for one test (the tracker does it when it finds cuStreamWaitValue32).
struct holding_on {
  holding_on() { residency_gate::set_holding(true); }
  ~holding_on() { residency_gate::set_holding(false); }
};

// Note [Holding a launch on the GPU]: a launch touching a region whose prefetch is in flight is held on the GPU
// instead of waiting on the host; it runs only after the remap, on the device pages, and does not make the engine
// abandon the prefetch.
TEST(Residency, HeldLaunchRunsAfterThePrefetchLands) {
  holding_on on;
  harness h(64 * MiB);
  void* a = h.prefetching(4 * MiB, 0x5a);  // eager: its copy has run, its remap waits for the next tick
  const std::uint64_t holds_before = h.alloc.residency().launch_holds;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(h.launch_holding(h.s1, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x77}}), 1);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100)) << "the launch waited on the host";
  EXPECT_EQ(h.alloc.residency().launch_holds, holds_before + 1);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x5a)) << "the held launch ran before the prefetch landed";
  h.alloc.residency_tick();  // remap, then the flag: the held launch runs (eager) on the device pages
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x77)) << "the held launch's write was lost";
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.prefetches, 1);
  EXPECT_EQ(st.abandoned, 0) << "a held launch made the engine abandon its prefetch";
  // The next eviction counts the held launch as a use like any other: its copy holds the write.
  ASSERT_TRUE(h.alloc.request_evict(a));
  h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::host);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x77));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Late prefetches]: a prefetch a launch waited for is counted, with its bytes and the wait (here ~30 ms
// until the tick that remaps it), split into before and after its copy was seen complete; a prefetch nobody waited
// for is not counted, and a stale wait stamp does not reach the next prefetch of the region.
TEST(Residency, APrefetchALaunchWaitedForIsCountedLate) {
  harness h(64 * MiB);
  void* b = h.prefetching(2 * MiB, 0x21);
  h.alloc.residency_tick();  // lands: nobody waited
  EXPECT_EQ(h.alloc.residency().late_prefetches, 0);
  void* a = h.prefetching(4 * MiB, 0x5a);  // eager: its copy has run, its remap waits for the next tick
  std::atomic<bool> entered{false};
  std::thread launcher([&] {
    const region_id id = harness::id_of(a);
    gate::enter(id);
    entered = true;
    gate::exit(id, 1000);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(entered.load()) << "the launch did not wait for the prefetch";
  h.alloc.residency_tick();  // remaps: the launch goes on
  launcher.join();
  const residency_stats st = h.alloc.residency();
  EXPECT_EQ(st.prefetches, 2);
  EXPECT_EQ(st.late_prefetches, 1);
  EXPECT_EQ(st.late_bytes, static_cast<std::int64_t>(4 * MiB));
  EXPECT_GE(st.late_copy_wait_us + st.late_remap_wait_us, 25'000);
  std::int64_t by_phase = 0;
  for (const std::int64_t us : st.late_wait_us_by_phase) by_phase += us;
  EXPECT_EQ(by_phase, st.late_copy_wait_us + st.late_remap_wait_us);
  EXPECT_EQ(gate::take_wait_start(harness::id_of(a)), 0u) << "the engine left the wait stamp behind";
  // The region goes out and comes back with nobody waiting: still one late prefetch.
  h.go_out(a);
  h.come_back(a);
  EXPECT_EQ(h.alloc.residency().late_prefetches, 1);
  for (void* p : {a, b}) h.alloc.deallocate(p);
  h.expect_clean();
}

// The migration thread's remap time, split by the eighth of the step it fell in (residency_stats::remap_us_by_phase):
// with no learned step, all of it in the first eighth, and the eighths add up to the whole.
TEST(Residency, RemapTimeIsSplitByTheStepsEighth) {
  sim_driver sim(harness::make_sim(true, true));
  allocator_options o = harness::make_options(64 * MiB, false, true, true);
  o.residency.remap_hook = [](region_id) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); };
  caching_allocator alloc(sim, o);
  void* a = alloc.allocate(2 * MiB, nullptr);
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 2 * MiB, true, 0x42}});
  ASSERT_TRUE(alloc.request_evict(a));
  alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(a), region_residency::host);
  const residency_stats st = alloc.residency();
  EXPECT_GE(st.remap_us, 3000);
  EXPECT_GE(st.remap_us_by_phase[0], 3000);
  std::int64_t by_phase = 0;
  for (const std::int64_t us : st.remap_us_by_phase) by_phase += us;
  EXPECT_LE(st.remap_us - by_phase, 8) << "each eighth rounds down to a microsecond";
  EXPECT_LE(by_phase, st.remap_us);
  // The bytes moved, by the eighth their move ended in: the eviction's, then the prefetch's, all in the first.
  EXPECT_EQ(st.evicted_bytes_by_phase[0], static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(st.prefetched_bytes_by_phase[0], 0);
  ASSERT_TRUE(alloc.request_prefetch(a));
  for (int i = 0; i < 200 && alloc.residency_of(a) != region_residency::device; ++i) alloc.residency_tick();
  ASSERT_EQ(alloc.residency_of(a), region_residency::device);
  const residency_stats back = alloc.residency();
  EXPECT_EQ(back.prefetched_bytes_by_phase[0], back.bytes_h2d);
  EXPECT_EQ(back.prefetched_bytes_by_phase[0], static_cast<std::int64_t>(2 * MiB));
  for (std::size_t i = 1; i < 8; ++i) {
    EXPECT_EQ(back.evicted_bytes_by_phase[i], 0);
    EXPECT_EQ(back.prefetched_bytes_by_phase[i], 0);
  }
  alloc.deallocate(a);
  alloc.verify();
}

// Note [Waited prefetches first]: of the prefetches that land in one tick, the one a launch waits for remaps first.
TEST(Residency, AWaitedPrefetchRemapsFirstInItsBatch) {
  sim_driver sim(harness::make_sim(true, true));
  allocator_options o = harness::make_options(64 * MiB, false, true, true);
  std::vector<region_id> remapped;
  o.residency.remap_hook = [&](region_id id) { remapped.push_back(id); };
  caching_allocator alloc(sim, o);
  std::vector<void*> p;
  for (int i = 0; i < 3; ++i) {
    p.push_back(alloc.allocate(2 * MiB, nullptr));
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(p.back()), 2 * MiB, true, static_cast<std::uint8_t>(0x30 + i)}});
    ASSERT_TRUE(alloc.request_evict(p.back()));
  }
  alloc.residency_tick();
  for (void* q : p) {
    ASSERT_EQ(alloc.residency_of(q), region_residency::host);
    ASSERT_TRUE(alloc.request_prefetch(q));  // eager: each copy has run; the remaps wait for the next tick
  }
  const region_id last = harness::id_of(p.back());
  std::thread launcher([&] {
    gate::enter(last);  // waits for its prefetch
    gate::exit(last, 1000);
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (gate::waiting() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_EQ(gate::waiting(), 1u);
  remapped.clear();
  alloc.residency_tick();
  launcher.join();
  ASSERT_EQ(remapped.size(), 3u);
  EXPECT_EQ(remapped.front(), last) << "the prefetch a launch waited for remapped behind others of its batch";
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(alloc.residency_of(p[i]), region_residency::device);
    EXPECT_TRUE(sim_holds(sim, p[i], 2 * MiB, static_cast<std::uint8_t>(0x30 + i)));
  }
  EXPECT_EQ(alloc.residency().late_prefetches, 1);
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  alloc.verify();
  for (void* q : p) alloc.deallocate(q);
}

// An ordinary launch (one the tracker could not hold) during the prefetch still makes the engine abandon it; a
// launch held on it meanwhile then runs on the host copy, which is current.
TEST(Residency, AbandonedPrefetchReleasesItsHeldLaunches) {
  holding_on on;
  harness h(64 * MiB);
  void* a = h.prefetching(4 * MiB, 0x5a);
  EXPECT_EQ(h.launch_holding(h.s2, {{reinterpret_cast<device_ptr>(a), 4 * MiB, false, 0}}), 1);
  gate::set_incoming(harness::id_of(a), false);  // as if the launch below came through a path that cannot hold
  h.write(h.s1, a, 2 * MiB, 0x31);
  h.alloc.residency_tick();  // abandons the prefetch (then, without a forecast, starts it again: touched on host)
  EXPECT_EQ(h.alloc.residency().abandoned, 1);
  EXPECT_EQ(h.alloc.residency().prefetches, 0);
  EXPECT_NO_THROW(h.sim.run_all()) << "the launch held on the abandoned prefetch was never released";
  for (int i = 0; i < 4 && h.alloc.residency_of(a) != region_residency::device; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x31));
  EXPECT_TRUE(h.holds(static_cast<char*>(a) + 2 * MiB, 2 * MiB, 0x5a));
  h.alloc.deallocate(a);
  h.expect_clean();
}

// A region `a` (4 MiB of 0x5a) evicted, its prefetch started (its copy has run: eager device; the remap waits for
// the next tick), a launch writing 0x66 over it held on s1, and a cached 4 MiB segment b whose fence is behind that
// launch: reclaiming b waits on the host for the held launch.
void* held_behind_a_cached_fence(harness& h) {
  void* a = h.evicted(4 * MiB, 0x5a);
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, b, 4 * MiB, 0x11);
  EXPECT_TRUE(h.alloc.request_prefetch(a));
  EXPECT_EQ(h.launch_holding(h.s1, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x66}}), 1);
  h.alloc.deallocate(b);
  return a;
}

// Note [Holds] (residency.cpp): a host wait the allocator makes with its mutex held (here the fence of an idle
// segment to reclaim) may reach a launch held on a prefetch; the allocator finishes such prefetches first, or the
// wait would never end (the simulated device reports the deadlock).
TEST(Residency, AllocatorHostWaitDoesNotDeadlockOnAHeldLaunch) {
  holding_on on;
  composites_off off;  // with them, c is made from b's chunk at once: no host wait (the test below)
  harness h(14 * MiB);  // a, b, the prefetch's pages and the hold flags' page
  void* a = held_behind_a_cached_fence(h);
  void* c = nullptr;
  ASSERT_NO_THROW(c = h.alloc.allocate(8 * MiB, h.s1));  // reclaims b: a host wait on s1
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x66));
  h.alloc.deallocate(c);
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Composites]: the same scene with composites on: c is made at once from b's chunk and a new one, with no
// host wait; the launch held on a's prefetch runs once the migration thread remaps it.
TEST(Residency, CompositeNeedsNoHostWaitBehindAHeldLaunch) {
  holding_on on;
  harness h(14 * MiB);
  void* a = held_behind_a_cached_fence(h);
  const std::int64_t waits = h.alloc.stats().num_host_waits;
  void* c = nullptr;
  ASSERT_NO_THROW(c = h.alloc.allocate(8 * MiB, h.s1));
  EXPECT_EQ(h.alloc.stats().num_host_waits, waits);
  EXPECT_EQ(h.alloc.stats().num_composites, 1);
  for (int i = 0; i < 4 && h.alloc.residency_of(a) != region_residency::device; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(a), region_residency::device);
  h.write(h.s1, c, 8 * MiB, 0x77);
  h.sim.run_all();
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x66));
  EXPECT_TRUE(h.holds(c, 8 * MiB, 0x77));
  h.alloc.deallocate(c);
  h.alloc.deallocate(a);
  h.expect_clean();
}

// Note [Composites]: segments freed with their launches still queued are the next request's memory at once, on
// their stream, whatever its size. Their VAs are unmapped only once those launches ran (the simulated device
// records an unmap under queued work as a violation), and a destroyed composite's chunks serve later requests.
TEST(Residency, CompositeTakesChunksFreedMomentsBefore) {
  for (const std::size_t budget : {12 * MiB, 14 * MiB}) {  // 14: the donors' 12 MiB and a new chunk of 2
    SCOPED_TRACE(std::to_string(budget >> 20) + " MiB");
    harness h(budget, /*eager=*/false);
    void* x = h.alloc.allocate(8 * MiB, h.s1);
    void* y = h.alloc.allocate(4 * MiB, h.s1);
    h.write(h.s1, x, 8 * MiB, 0x11);  // queued, not run
    h.write(h.s1, y, 4 * MiB, 0x22);
    h.alloc.deallocate(x);
    h.alloc.deallocate(y);
    const allocator_stats before = h.alloc.stats();
    void* z = nullptr;
    ASSERT_NO_THROW(z = h.alloc.allocate(budget, h.s1));
    allocator_stats s = h.alloc.stats();
    EXPECT_EQ(s.num_host_waits, before.num_host_waits) << "the composite waited for the GPU";
    EXPECT_EQ(s.num_composites, 1);
    EXPECT_EQ(s.composite_donors, 2);
    EXPECT_EQ(s.num_zombies_reaped, 0) << "a donor's VA was unmapped before its launches ran";
    EXPECT_EQ(h.alloc.block_of(z).second, budget);
    EXPECT_EQ(h.alloc.residency_of(z), region_residency::none) << "a composite is not swappable";
    EXPECT_EQ(h.alloc.request_evict(z), false);
    h.write(h.s1, z, budget, 0x33);
    h.expect_clean();
    EXPECT_LE(h.sim.live_device_bytes(), budget);
    h.sim.run_all();  // the donors' launches, then z's
    EXPECT_TRUE(h.holds(z, budget, 0x33));
    h.alloc.residency_tick();  // housekeeping: fences recorded
    h.sim.run_all();
    h.alloc.residency_tick();  // ... and seen complete: the zombies are reaped
    EXPECT_EQ(h.alloc.stats().num_zombies_reaped, 2);
    h.expect_clean();
    h.alloc.deallocate(z);
    h.sim.run_all();
    h.alloc.residency_tick();
    h.sim.run_all();
    h.alloc.residency_tick();
    const std::int64_t chunks = h.alloc.residency().chunks_created;
    void* w = h.alloc.allocate(8 * MiB, h.s1);  // z reclaimed (fenced): its 8 MiB chunk serves w
    EXPECT_EQ(h.alloc.residency().chunks_created, chunks) << "the composite's chunk was not reused";
    h.write(h.s1, w, 8 * MiB, 0x44);
    h.sim.run_all();
    EXPECT_TRUE(h.holds(w, 8 * MiB, 0x44));
    h.alloc.deallocate(w);
    h.expect_clean();
  }
}

// Note [Composites]: with LAYERSWAP_COMPOSITES=0 the same request waits for the GPU and reclaims.
TEST(Residency, CompositesOffReclaimsAfterAHostWait) {
  composites_off off;
  harness h(12 * MiB, /*eager=*/false);
  void* x = h.alloc.allocate(8 * MiB, h.s1);
  void* y = h.alloc.allocate(4 * MiB, h.s1);
  h.write(h.s1, x, 8 * MiB, 0x11);
  h.write(h.s1, y, 4 * MiB, 0x22);
  h.alloc.deallocate(x);
  h.alloc.deallocate(y);
  const std::int64_t waits = h.alloc.stats().num_host_waits;
  void* z = h.alloc.allocate(12 * MiB, h.s1);
  EXPECT_GT(h.alloc.stats().num_host_waits, waits);
  EXPECT_EQ(h.alloc.stats().num_composites, 0);
  EXPECT_EQ(h.alloc.stats().num_reclaims, 2);
  h.alloc.deallocate(z);
  h.expect_clean();
}

// Note [Reclaim by fit]: a request without room destroys the smallest fenced idle segment that covers it, not the
// oldest, so the big one stays cached for the next big request; LAYERSWAP_RECLAIM=oldest destroys the oldest.
TEST(Residency, ARequestReclaimsTheSmallestIdleSegmentThatCoversIt) {
  for (const bool fit : {true, false}) {
    SCOPED_TRACE(fit ? "fit" : "oldest");
    sim_driver sim(harness::make_sim(true, true));
    allocator_options o = harness::make_options(20 * MiB, false, true, true);
    o.reclaim_fit = fit;
    caching_allocator alloc(sim, o);
    void* big = alloc.allocate(12 * MiB, nullptr);
    void* mid = alloc.allocate(6 * MiB, nullptr);
    void* fill = alloc.allocate(2 * MiB, nullptr);  // the budget is full
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(fill), 2 * MiB, true, 0x5a}});
    alloc.deallocate(big);  // the oldest idle segment
    alloc.deallocate(mid);
    alloc.residency_tick();  // fences recorded (the eager device runs them at once) ...
    alloc.residency_tick();  // ... and seen complete: both reclaimable without a wait
    const std::int64_t waits = alloc.stats().num_host_waits;
    void* a = alloc.allocate(4 * MiB, nullptr);  // no cached segment within 1/8 of 4 MiB, no room
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 4 * MiB, true, 0x6b}});
    EXPECT_EQ(alloc.stats().num_reclaims, 1);
    EXPECT_EQ(alloc.stats().num_host_waits, waits);
    alloc.deallocate(a);
    const std::size_t creates = sim.num_creates();
    void* again = alloc.allocate(fit ? 12 * MiB : 6 * MiB, nullptr);  // the segment that survived, from the cache
    EXPECT_EQ(again, fit ? big : mid);
    EXPECT_EQ(sim.num_creates(), creates);
    EXPECT_TRUE(sim_holds(sim, fill, 2 * MiB, 0x5a));
    alloc.deallocate(again);
    alloc.deallocate(fill);
    EXPECT_NO_THROW(alloc.verify());
    EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  }
}

// The split-spare and home-segment tests: LAYERSWAP_SPLIT on, a 16 MiB budget full with `w` (8 MiB of 0x31, evicted,
// its chunk a spare) and `fill` (8 MiB of 0x32).
struct spare_case {
  split_on on;
  fixed_forecast f;  // outlives the allocator; set once w's prefetch is due
  harness h{16 * MiB};
  void* w = h.written(8 * MiB, 0x31);
  void* fill = h.written(8 * MiB, 0x32);
  spare_case() { h.go_out(w); }
  // The end: `w` comes up next, so the policy reclaims the idle segment that holds its chunk and prefetches into that
  // chunk, making none (`creates`: the chunks made before); both keep their bytes within the budget. Frees both.
  void expect_prefetch_takes_the_chunk_back(std::size_t creates) {
    h.alloc.set_forecast_source(&f);
    f.set({harness::id_of(w)});
    for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
    EXPECT_EQ(h.alloc.residency_of(w), region_residency::device);
    EXPECT_EQ(h.sim.num_creates(), creates) << "the prefetch made a chunk";
    EXPECT_TRUE(h.holds(w, 8 * MiB, 0x31));
    EXPECT_TRUE(h.holds(fill, 8 * MiB, 0x32));
    EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(16 * MiB));
    h.expect_clean();
    for (void* p : {w, fill}) h.alloc.deallocate(p);
  }
};

// Note [Split spares]: under a full budget, a request with no segment to split takes an evicted region's spare chunk
// as a segment of its own pool and a range of it, with no chunk made or released; the next request of the pool takes
// the rest; freed, the segment is idle whole, and the evicted region's prefetch gets that chunk back.
TEST(Residency, SplitSparesServeRequestsFromAnEvictedRegionsChunk) {
  spare_case c;
  harness& h = c.h;
  void* w = c.w;
  ASSERT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(8 * MiB)) << "its chunk is a spare";
  const std::size_t creates = h.sim.num_creates();
  const std::int64_t released = h.alloc.residency().chunks_released;
  auto* a = static_cast<char*>(h.alloc.allocate(4 * MiB, h.s1));
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(b, a + 4 * MiB) << "the rest of the spare's segment serves the next request";
  allocator_stats st = h.alloc.stats();
  EXPECT_EQ(st.num_spare_splits, 1);
  EXPECT_EQ(st.num_splits, 2);
  EXPECT_EQ(h.sim.num_creates(), creates) << "a chunk was made";
  EXPECT_EQ(h.alloc.residency().chunks_released, released) << "a spare was released";
  h.write(h.s1, a, 4 * MiB, 0x41);
  h.write(h.s1, b, 4 * MiB, 0x42);
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x41));
  EXPECT_TRUE(h.holds(b, 4 * MiB, 0x42));
  EXPECT_TRUE(h.holds(w, 8 * MiB, 0x31)) << "the evicted region reads its host copy";
  EXPECT_TRUE(gate::persistent(harness::id_of(b))) << "a new large segment is persistent until a free";
  h.alloc.deallocate(a);
  EXPECT_FALSE(gate::persistent(harness::id_of(b)))
      << "a split segment whose range was freed keys the learner's step (residency_gate.hpp)";
  h.alloc.deallocate(b);
  c.expect_prefetch_takes_the_chunk_back(creates);
}

// Note [Home segments]: with LAYERSWAP_SPLIT on, a request of a spare chunk's size gets a segment at the chunk's home
// VA, where the chunk is mapped since its first prefetch: no chunk made, no mapping; freed and reclaimed for the
// evicted region's prefetch, the chunk is a spare again and the prefetch stages into it there.
TEST(Residency, HomeSegmentsServeRequestsAtASparesHomeWithNoDriverCall) {
  spare_case c;
  harness& h = c.h;
  void* w = c.w;
  h.come_back(w);  // its chunk gets a home VA at this prefetch
  h.go_out(w);
  ASSERT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(8 * MiB)) << "its chunk is a spare";
  const std::size_t creates = h.sim.num_creates(), maps = h.sim.num_maps();
  auto* a = static_cast<char*>(h.alloc.allocate(8 * MiB, h.s1));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(h.alloc.stats().num_home_segments, 1);
  EXPECT_EQ(h.alloc.stats().num_spare_splits, 0) << "a spare of the request's size is taken whole";
  EXPECT_EQ(h.sim.num_maps(), maps) << "the segment was mapped";
  EXPECT_EQ(h.sim.num_creates(), creates) << "a chunk was made";
  EXPECT_EQ(h.alloc.residency().spare_bytes, 0);
  EXPECT_EQ(h.alloc.block_of(a + 4096).first, a);
  h.write(h.s1, a, 8 * MiB, 0x41);
  EXPECT_TRUE(h.holds(a, 8 * MiB, 0x41));
  EXPECT_TRUE(h.holds(w, 8 * MiB, 0x31)) << "the evicted region reads its host copy";
  h.expect_clean();
  h.alloc.deallocate(a);
  c.expect_prefetch_takes_the_chunk_back(creates);
}

// Note [Spare composites]: under a following reserve, a request larger than any spare, with no headroom, maps
// evicted regions' spare chunks side by side at a new VA: no chunk made or released, each evicted region still reads
// its host copy. Freed and reclaimed for a prefetch, the composite's chunks are spares again and the prefetch takes
// its region's back as it is. With the step's peak as the reserve, the request releases the spares and makes a chunk.
TEST(Residency, UnderAFollowingReserveALargeRequestMapsSparesSideBySide) {
  for (const bool split : {false, true}) {
    for (const bool follow : {true, false}) {
      SCOPED_TRACE(std::string(follow ? "follow" : "peak") + (split ? ", split" : ""));
      std::optional<split_on> on;
      if (split) on.emplace();
      follow_on mode(follow);
      fixed_forecast f;  // outlives the allocator
      harness h(24 * MiB);
      void* w1 = h.written(8 * MiB, 0x31);
      void* w2 = h.written(6 * MiB, 0x32);
      void* fill = h.written(10 * MiB, 0x33);  // the budget is full
      h.go_out(w1);
      h.go_out(w2);
      ASSERT_EQ(h.alloc.residency().spare_bytes, static_cast<std::int64_t>(14 * MiB));
      const std::size_t creates = h.sim.num_creates();
      const std::int64_t released = h.alloc.residency().chunks_released;
      auto* a = static_cast<char*>(h.alloc.allocate(13 * MiB, h.s1));  // 14 MiB is within its reuse window
      ASSERT_NE(a, nullptr);
      const allocator_stats st = h.alloc.stats();
      if (follow) {
        EXPECT_EQ(st.num_spare_composites, 1);
        EXPECT_EQ(st.spare_composite_parts, 2);
        EXPECT_EQ(h.sim.num_creates(), creates) << "a chunk was made";
        EXPECT_EQ(h.alloc.residency().chunks_released, released) << "a spare was released";
        EXPECT_EQ(h.alloc.residency().spare_bytes, 0);
        EXPECT_EQ(h.alloc.block_of(a + 9 * MiB).first, a) << "one segment across both chunks";
        EXPECT_EQ(h.alloc.residency_of(a), region_residency::none) << "a composite is not swappable";
      } else {
        EXPECT_EQ(st.num_spare_composites, 0);
        EXPECT_GT(h.sim.num_creates(), creates);
        EXPECT_GT(h.alloc.residency().chunks_released, released);
      }
      EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(24 * MiB));
      h.write(h.s1, a, 13 * MiB, 0x41);
      EXPECT_TRUE(h.holds(a, 13 * MiB, 0x41));
      EXPECT_TRUE(h.holds(w1, 8 * MiB, 0x31)) << "the evicted region reads its host copy";
      EXPECT_TRUE(h.holds(w2, 6 * MiB, 0x32));
      h.expect_clean();
      h.alloc.deallocate(a);
      const std::size_t before = h.sim.num_creates();
      h.alloc.set_forecast_source(&f);
      f.set({harness::id_of(w1), harness::id_of(w2)});
      for (int i = 0; i < 6; ++i) h.alloc.residency_tick();
      EXPECT_EQ(h.alloc.residency_of(w1), region_residency::device);
      EXPECT_EQ(h.alloc.residency_of(w2), region_residency::device);
      if (follow) {
        EXPECT_EQ(h.sim.num_creates(), before) << "a prefetch made a chunk: the composite's were not reused";
      }
      EXPECT_TRUE(h.holds(w1, 8 * MiB, 0x31));
      EXPECT_TRUE(h.holds(w2, 6 * MiB, 0x32));
      EXPECT_TRUE(h.holds(fill, 10 * MiB, 0x33));
      EXPECT_LE(h.alloc.stats().device_bytes.current, static_cast<std::int64_t>(24 * MiB));
      h.expect_clean();
      for (void* p : {w1, w2, fill}) h.alloc.deallocate(p);
      h.alloc.set_forecast_source(nullptr);
    }
  }
}

// Note [Spare composites]: when the driver fails to map the second spare, what was mapped is unmapped, the VA
// released and both spares go back to the pool; the request fails with the driver's error, the books add up, and the
// next request makes the composite.
TEST(Residency, ASpareCompositeWhoseMapFailsGivesItsSparesBack) {
  follow_on mode(true);
  sim_driver sim(harness::make_sim(true, true));
  faulty_driver port(sim);
  caching_allocator alloc(port, harness::make_options(24 * MiB, false, true, true));
  std::vector<void*> held;
  for (const auto& [bytes, v] : {std::pair{8 * MiB, 0x31}, std::pair{6 * MiB, 0x32}, std::pair{10 * MiB, 0x33}}) {
    held.push_back(alloc.allocate(bytes, nullptr));
    sim.launch(nullptr, {{reinterpret_cast<device_ptr>(held.back()), bytes, true, static_cast<std::uint8_t>(v)}});
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(alloc.request_evict(held[i]));
    alloc.residency_tick();
  }
  ASSERT_EQ(alloc.residency().spare_bytes, static_cast<std::int64_t>(14 * MiB));
  port.fail_maps_after = 1;
  EXPECT_THROW((void)alloc.allocate(13 * MiB, nullptr), cuda_error);
  EXPECT_EQ(alloc.residency().spare_bytes, static_cast<std::int64_t>(14 * MiB)) << "a spare was lost";
  EXPECT_EQ(alloc.stats().num_spare_composites, 0);
  EXPECT_NO_THROW(alloc.verify());
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
  void* a = alloc.allocate(13 * MiB, nullptr);
  EXPECT_EQ(alloc.stats().num_spare_composites, 1);
  sim.launch(nullptr, {{reinterpret_cast<device_ptr>(a), 13 * MiB, true, 0x41}});
  EXPECT_TRUE(sim_holds(sim, a, 13 * MiB, 0x41));
  EXPECT_TRUE(sim_holds(sim, held[0], 8 * MiB, 0x31)) << "the evicted region reads its host copy";
  EXPECT_TRUE(sim_holds(sim, held[1], 6 * MiB, 0x32));
  EXPECT_TRUE(sim_holds(sim, held[2], 10 * MiB, 0x33));
  EXPECT_LE(sim.live_device_bytes(), 24 * MiB);
  held.push_back(a);
  for (void* p : held) alloc.deallocate(p);
  EXPECT_NO_THROW(alloc.verify());
  EXPECT_TRUE(sim.violations().empty()) << first_violation(sim);
}

// Note [Home segments]: a home segment's chunk becomes a spare again only once its stream is past the segment's last
// launches (a fenced reclaim), so a prefetch never stages into it under an activation's queued work.
TEST(Residency, HomeSegmentsChunkTakesAPrefetchOnlyAfterItsQueuedWork) {
  split_on on;
  fixed_forecast f;  // outlives the allocator
  harness h(16 * MiB, /*eager=*/false);
  void* w = h.written(8 * MiB, 0x31);
  void* fill = h.written(8 * MiB, 0x32);  // the budget is full
  h.sim.run_all();
  for (const bool out : {true, false, true}) {  // out, back (its chunk gets a home VA), out again
    ASSERT_TRUE(out ? h.alloc.request_evict(w) : h.alloc.request_prefetch(w));
    h.sim.run_all();
    h.alloc.residency_tick();
    ASSERT_EQ(h.alloc.residency_of(w), out ? region_residency::host : region_residency::device);
  }
  void* a = h.alloc.allocate(8 * MiB, h.s1);
  ASSERT_EQ(h.alloc.stats().num_home_segments, 1);
  h.write(h.s1, a, 8 * MiB, 0x41);  // queued: the GPU has not run it
  h.alloc.deallocate(a);
  h.alloc.set_forecast_source(&f);
  f.set({harness::id_of(w)});
  for (int i = 0; i < 4; ++i) h.alloc.residency_tick();
  EXPECT_EQ(h.alloc.residency_of(w), region_residency::host) << "the prefetch took the chunk under queued work";
  for (int i = 0; i < 6 && h.alloc.residency_of(w) != region_residency::device; ++i) {
    h.sim.run_all();
    h.alloc.residency_tick();
  }
  EXPECT_EQ(h.alloc.residency_of(w), region_residency::device);
  EXPECT_TRUE(h.holds(w, 8 * MiB, 0x31));
  EXPECT_TRUE(h.holds(fill, 8 * MiB, 0x32));
  h.expect_clean();
  for (void* p : {w, fill}) h.alloc.deallocate(p);
  h.sim.run_all();
}

// Note [Split segments]: under a full budget a large request takes a range of a larger segment its stream freed, at
// once (its queued work still to run), with no driver call; a range freed while another stream reads it stays taken
// until that stream is past it; the last range freed makes the segment whole again, cached for its size.
TEST(Residency, SplitServesARequestFromASegmentItsStreamFreed) {
  split_on on;
  harness h(16 * MiB, /*eager=*/false);
  auto* big = static_cast<char*>(h.alloc.allocate(8 * MiB, h.s1));
  void* fill = h.alloc.allocate(8 * MiB, h.s1);  // the budget is full
  h.write(h.s1, big, 8 * MiB, 0x11);              // queued, not run
  h.write(h.s1, fill, 8 * MiB, 0x12);
  h.alloc.deallocate(big);
  const std::size_t creates = h.sim.num_creates(), maps = h.sim.num_maps();
  const std::int64_t waits = h.alloc.stats().num_host_waits;
  void* a = h.alloc.allocate(2 * MiB, h.s1);
  void* b = h.alloc.allocate(4 * MiB - 4096, h.s1);
  EXPECT_EQ(a, big);
  EXPECT_EQ(b, big + 2 * MiB) << "the free rest of the segment serves the next request";
  allocator_stats st = h.alloc.stats();
  EXPECT_EQ(st.num_splits, 2);
  EXPECT_EQ(st.num_reclaims, 0);
  EXPECT_EQ(st.num_host_waits, waits) << "a split waited for the GPU";
  EXPECT_EQ(h.sim.num_creates(), creates);
  EXPECT_EQ(h.sim.num_maps(), maps);
  EXPECT_EQ(st.large.allocated_bytes.current, static_cast<std::int64_t>(14 * MiB));
  EXPECT_EQ(h.alloc.block_of(static_cast<char*>(b) + 4096).first, b);
  EXPECT_EQ(h.alloc.block_of(b).second, 4 * MiB);
  h.write(h.s1, a, 2 * MiB, 0x21);
  h.write(h.s1, b, 4 * MiB - 4096, 0x22);
  h.expect_clean();
  h.sim.run_all();  // big's write, then a's and b's over it
  EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
  EXPECT_TRUE(h.holds(b, 4 * MiB - 4096, 0x22));
  EXPECT_TRUE(h.holds(fill, 8 * MiB, 0x12));
  h.read(h.s2, a, 2 * MiB);  // queued on another stream
  h.alloc.record_stream(a, h.s2);
  EXPECT_TRUE(h.alloc.deallocate(a));
  EXPECT_FALSE(h.alloc.deallocate(a)) << "a range freed twice";
  h.expect_clean();
  void* c = h.alloc.allocate(2 * MiB, h.s1);
  EXPECT_EQ(c, big + 6 * MiB) << "the range s2 still reads was handed out again";
  h.write(h.s1, c, 2 * MiB, 0x23);
  h.sim.run_all();
  EXPECT_TRUE(h.holds(c, 2 * MiB, 0x23));
  EXPECT_TRUE(h.holds(b, 4 * MiB - 4096, 0x22));
  h.alloc.deallocate(b);
  h.alloc.deallocate(c);
  h.expect_clean();
  void* d = h.alloc.allocate(8 * MiB, h.s1);  // the pending range released first: the segment whole again
  EXPECT_EQ(d, big);
  EXPECT_EQ(h.sim.num_creates(), creates);
  EXPECT_EQ(h.alloc.stats().num_splits, 3);
  h.alloc.deallocate(d);
  h.alloc.deallocate(fill);
  h.expect_clean();
}

// Note [Split segments]: off by default; on, a request takes no range of another stream's segment, nor of a segment
// more than LAYERSWAP_SPLIT times its size (4 here): those reclaim as before.
TEST(Residency, SplitOnlyFromItsStreamAndWithinTheBound) {
  struct variant {
    const char* what;
    bool split;
    std::size_t idle;  // the freed segment's size, the rest of the 16 MiB budget filled
    bool other_stream;
  };
  for (const variant v : {variant{"off", false, 8 * MiB, false}, variant{"another stream", true, 8 * MiB, true},
                          variant{"five times the size", true, 10 * MiB, false}}) {
    SCOPED_TRACE(v.what);
    std::optional<split_on> on;
    if (v.split) on.emplace();
    harness h(16 * MiB, /*eager=*/false);
    void* big = h.alloc.allocate(v.idle, h.s1);
    void* fill = h.alloc.allocate(16 * MiB - v.idle, h.s1);
    h.write(h.s1, big, v.idle, 0x11);
    h.alloc.deallocate(big);
    void* a = h.alloc.allocate(2 * MiB, v.other_stream ? h.s2 : h.s1);
    const allocator_stats st = h.alloc.stats();
    EXPECT_EQ(st.num_splits, 0);
    EXPECT_EQ(st.num_reclaims, 1) << "the idle segment was reclaimed for a new one";
    h.write(v.other_stream ? h.s2 : h.s1, a, 2 * MiB, 0x21);
    h.sim.run_all();
    EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
    h.alloc.deallocate(a);
    h.alloc.deallocate(fill);
    h.expect_clean();
  }
}

// Note [Split bound]: a split that takes a whole segment is refused when the free ranges of split segments would then
// hold more than allocator_options::split_free (2 MiB here, of a 16 MiB budget): the request reclaims and makes a
// segment as without splits. Within the bound it splits; a free range of a split segment is taken whatever the bound.
TEST(Residency, SplitBoundRefusesSplitsThatLeaveTooMuchFree) {
  split_on on;
  split_free_for bound(2 * MiB);
  {
    SCOPED_TRACE("an idle segment: 6 MiB free would be left");
    harness h(16 * MiB, /*eager=*/false);
    void* big = h.alloc.allocate(8 * MiB, h.s1);
    void* fill = h.alloc.allocate(8 * MiB, h.s1);
    h.write(h.s1, big, 8 * MiB, 0x11);
    h.write(h.s1, fill, 8 * MiB, 0x12);
    h.alloc.deallocate(big);
    void* a = h.alloc.allocate(2 * MiB, h.s1);
    allocator_stats st = h.alloc.stats();
    EXPECT_EQ(st.num_splits, 0);
    EXPECT_EQ(st.num_reclaims, 1) << "the idle segment was reclaimed for a new one";
    h.write(h.s1, a, 2 * MiB, 0x21);
    h.sim.run_all();
    EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
    EXPECT_TRUE(h.holds(fill, 8 * MiB, 0x12));
    EXPECT_NO_THROW(h.alloc.verify());
    h.alloc.deallocate(a);
    h.alloc.deallocate(fill);
    h.expect_clean();
  }
  {
    SCOPED_TRACE("an idle segment: 2 MiB free would be left, then that range taken");
    harness h(16 * MiB, /*eager=*/false);
    auto* big = static_cast<char*>(h.alloc.allocate(8 * MiB, h.s1));
    void* fill = h.alloc.allocate(8 * MiB, h.s1);
    h.alloc.deallocate(big);
    void* a = h.alloc.allocate(6 * MiB, h.s1);
    EXPECT_EQ(a, big);
    EXPECT_EQ(h.alloc.stats().num_splits, 1);
    EXPECT_NO_THROW(h.alloc.verify());
    void* b = h.alloc.allocate(2 * MiB, h.s1);
    EXPECT_EQ(b, big + 6 * MiB) << "the free range of the split segment was not taken";
    EXPECT_EQ(h.alloc.stats().num_splits, 2);
    EXPECT_EQ(h.alloc.stats().num_reclaims, 0);
    h.write(h.s1, a, 6 * MiB, 0x31);
    h.write(h.s1, b, 2 * MiB, 0x32);
    h.sim.run_all();
    EXPECT_TRUE(h.holds(a, 6 * MiB, 0x31));
    EXPECT_TRUE(h.holds(b, 2 * MiB, 0x32));
    EXPECT_NO_THROW(h.alloc.verify());
    for (void* p : {a, b, fill}) h.alloc.deallocate(p);
    h.expect_clean();
  }
  {
    SCOPED_TRACE("an evicted region's spare chunk: 4 MiB free would be left");
    spare_case c;
    harness& h = c.h;
    const std::size_t creates = h.sim.num_creates();
    void* a = h.alloc.allocate(4 * MiB, h.s1);
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(h.alloc.stats().num_spare_splits, 0) << "the spare was split past the bound";
    EXPECT_EQ(h.alloc.stats().num_splits, 0);
    EXPECT_GT(h.sim.num_creates(), creates) << "the request made no chunk of its own";
    h.write(h.s1, a, 4 * MiB, 0x41);
    EXPECT_TRUE(h.holds(a, 4 * MiB, 0x41));
    EXPECT_TRUE(h.holds(c.w, 8 * MiB, 0x31)) << "the evicted region reads its host copy";
    EXPECT_TRUE(h.holds(c.fill, 8 * MiB, 0x32));
    EXPECT_NO_THROW(h.alloc.verify());
    h.alloc.deallocate(a);
    for (void* p : {c.w, c.fill}) h.alloc.deallocate(p);
    h.expect_clean();
  }
}

// Note [Splits by reserve]: while the reserve is the step's peak, a request with no room splits an idle segment up to
// split_peak times its size and within split_free_peak; under a following reserve the same request is held to split
// and split_free (4 times, 2 MiB here) and reclaims the segment to make one of its own.
TEST(Residency, SplitsReachFurtherWhileTheReserveIsTheStepsPeak) {
  struct variant {
    const char* what;
    std::size_t idle;  // the freed segment's size, the rest of the 16 MiB budget filled
  };
  for (const variant v : {variant{"five times the size", 10 * MiB}, variant{"6 MiB left free", 8 * MiB}}) {
    for (const bool follow : {false, true}) {
      SCOPED_TRACE(std::string(v.what) + (follow ? ", follow" : ", peak"));
      split_on on;
      split_free_for bound(2 * MiB);
      split_peak_for peak(8, 8 * MiB);
      follow_on mode(follow);
      harness h(16 * MiB, /*eager=*/false);
      auto* big = static_cast<char*>(h.alloc.allocate(v.idle, h.s1));
      void* fill = h.alloc.allocate(16 * MiB - v.idle, h.s1);
      h.write(h.s1, big, v.idle, 0x11);
      h.write(h.s1, fill, 16 * MiB - v.idle, 0x12);
      h.alloc.deallocate(big);
      const std::size_t creates = h.sim.num_creates();
      void* a = h.alloc.allocate(2 * MiB, h.s1);
      const allocator_stats st = h.alloc.stats();
      if (follow) {
        EXPECT_EQ(st.num_splits, 0);
        EXPECT_EQ(st.num_reclaims, 1) << "the idle segment was not reclaimed for a new one";
        EXPECT_GT(h.sim.num_creates(), creates);
      } else {
        EXPECT_EQ(a, big) << "a range of the idle segment";
        EXPECT_EQ(st.num_splits, 1);
        EXPECT_EQ(st.num_reclaims, 0);
        EXPECT_EQ(h.sim.num_creates(), creates);
      }
      h.write(h.s1, a, 2 * MiB, 0x21);
      h.sim.run_all();
      EXPECT_TRUE(h.holds(a, 2 * MiB, 0x21));
      EXPECT_TRUE(h.holds(fill, 16 * MiB - v.idle, 0x12));
      EXPECT_NO_THROW(h.alloc.verify());
      h.alloc.deallocate(a);
      h.alloc.deallocate(fill);
      h.expect_clean();
    }
  }
}

// Note [Idle segments before chunks]: under a following reserve, a request that has room but no cached segment of its
// size, no free range and no spare splits an idle segment of its stream instead of making a chunk, and leaves the room
// to the weights; with the step's peak, the idle segment is kept whole and the request makes a chunk of its own.
TEST(Residency, UnderAFollowingReserveARequestSplitsAnIdleSegmentBeforeItMakesAChunk) {
  for (const bool follow : {false, true}) {
    SCOPED_TRACE(follow ? "follow" : "peak");
    split_on on;
    follow_on mode(follow);
    harness h(24 * MiB, /*eager=*/false);
    void* idle = h.written(4 * MiB, 0x31);
    h.alloc.deallocate(idle);  // cached whole: 20 MiB of room left
    const std::size_t creates = h.sim.num_creates(), maps = h.sim.num_maps();
    const std::int64_t held = h.alloc.stats().device_bytes.current;
    void* a = h.alloc.allocate(2 * MiB, h.s1);
    h.write(h.s1, a, 2 * MiB, 0x32);
    if (follow) {
      EXPECT_EQ(a, idle) << "a range of the idle segment";
      EXPECT_EQ(h.sim.num_creates(), creates);
      EXPECT_EQ(h.sim.num_maps(), maps);
      EXPECT_EQ(h.alloc.stats().device_bytes.current, held) << "the room was taken";
      EXPECT_EQ(h.alloc.stats().num_splits, 1);
    } else {
      EXPECT_NE(a, idle);
      EXPECT_GT(h.sim.num_creates(), creates) << "a chunk of its own, the idle segment kept whole";
      EXPECT_EQ(h.alloc.stats().num_splits, 0);
      void* again = h.alloc.allocate(4 * MiB, h.s1);
      EXPECT_EQ(again, idle) << "kept for a request of its size";
      h.alloc.deallocate(again);
    }
    h.sim.run_all();
    EXPECT_TRUE(h.holds(a, 2 * MiB, 0x32));
    EXPECT_NO_THROW(h.alloc.verify());
    h.alloc.deallocate(a);
    h.expect_clean();
  }
}

// Note [Free ranges first]: a request that has room for a new segment takes a free range of a segment its stream split
// instead, with no chunk made and no mapping, and leaves the room; a segment of its own size cached, or a whole idle
// segment, is not touched that way (the first is a plain hit, the second is split only when there is no room).
TEST(Residency, FreeRangesServeARequestBeforeItMakesASegment) {
  split_on on;
  harness h(24 * MiB, /*eager=*/false);
  auto* big = static_cast<char*>(h.alloc.allocate(8 * MiB, h.s1));
  void* fill = h.alloc.allocate(16 * MiB, h.s1);  // the budget is full
  h.alloc.deallocate(big);
  void* a = h.alloc.allocate(2 * MiB, h.s1);  // no room: a range of big, 6 MiB of it left free
  ASSERT_EQ(a, big);
  h.write(h.s1, a, 2 * MiB, 0x21);
  h.alloc.deallocate(fill);
  h.alloc.empty_cache();  // fill's memory is room now
  const std::size_t creates = h.sim.num_creates(), maps = h.sim.num_maps();
  const std::int64_t held = h.alloc.stats().device_bytes.current;
  void* b = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(b, big + 2 * MiB) << "the request made a segment beside a free range that holds it";
  EXPECT_EQ(h.sim.num_creates(), creates);
  EXPECT_EQ(h.sim.num_maps(), maps);
  EXPECT_EQ(h.alloc.stats().device_bytes.current, held) << "the room was taken";
  EXPECT_EQ(h.alloc.stats().num_splits, 2);
  h.write(h.s1, b, 4 * MiB, 0x22);
  void* c = h.alloc.allocate(4 * MiB, h.s1);  // 2 MiB free is left in big: too little, a segment of its own
  EXPECT_NE(static_cast<char*>(c) - big, 6 * MiB);
  EXPECT_GT(h.sim.num_creates(), creates);
  h.write(h.s1, c, 4 * MiB, 0x23);
  h.alloc.deallocate(c);  // cached whole, 4 MiB
  void* d = h.alloc.allocate(4 * MiB, h.s1);
  EXPECT_EQ(d, c) << "a cached segment of the request's size comes first";
  h.alloc.deallocate(d);
  const std::size_t before = h.sim.num_creates();
  void* e = h.alloc.allocate(2 * MiB, h.s1);  // the free range of big (2 MiB), not the idle 4 MiB segment
  EXPECT_EQ(e, big + 6 * MiB);
  h.write(h.s1, e, 2 * MiB, 0x24);
  void* f = h.alloc.allocate(2 * MiB, h.s1);  // room left and no free range: a new segment, the idle one kept whole
  EXPECT_NE(f, d);
  EXPECT_GT(h.sim.num_creates(), before);
  EXPECT_EQ(h.alloc.stats().num_splits, 3);
  h.write(h.s1, f, 2 * MiB, 0x25);
  h.sim.run_all();
  const std::tuple<void*, std::size_t, std::uint8_t> written[] = {
      {a, 2 * MiB, 0x21}, {b, 4 * MiB, 0x22}, {e, 2 * MiB, 0x24}, {f, 2 * MiB, 0x25}};
  for (const auto& [p, bytes, value] : written) EXPECT_TRUE(h.holds(p, bytes, value));
  EXPECT_NO_THROW(h.alloc.verify());
  for (const auto& w : written) h.alloc.deallocate(std::get<0>(w));
  h.expect_clean();
}

// Note [Holds], the migration thread's side: the gate refuses the remap of a prefetch that has a launch held on it
// (an ordinary launch touched the region meanwhile), and the migration thread, remapping without the mutex, must
// release the held launch at once. A program thread may hold the mutex meanwhile, waiting on the host for work
// queued behind that launch (here the fence of a cached segment it reclaims), and release_holds() skips the region
// (busy). Released only once the migration thread had the mutex back, the two waited for each other: the 1.1B LoRA
// run at 25% with LAYERSWAP_HOLD=1 hung so on the H200 (the simulated device reports the deadlock).
TEST(Residency, RefusedPrefetchReleasesItsHeldLaunchWithoutTheMutex) {
  holding_on on;
  harness h(14 * MiB);  // a, b, the prefetch's pages and the hold flags' page
  void* a = held_behind_a_cached_fence(h);
  gate::set_incoming(harness::id_of(a), false);  // as if the launch below came through a path that cannot hold
  h.write(h.s2, a, 2 * MiB, 0x31);                // an ordinary launch: the gate will refuse a's remap
  int refusals = 0;
  bool allocated = false;
  std::string error;
  g_refused_hook = [&](region_id id) {
    ++refusals;
    EXPECT_EQ(id, harness::id_of(a));
    std::thread program([&] {  // the mutex is free: the migration thread's tick remaps without it
      try {
        void* c = h.alloc.allocate(8 * MiB, h.s1);  // reclaims b: a host wait on s1, behind the held launch
        allocated = true;
        h.alloc.deallocate(c);
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    program.join();
  };
  struct hook_off {
    ~hook_off() { g_refused_hook = nullptr; }
  } off;
  h.alloc.residency_tick();
  EXPECT_EQ(refusals, 1);
  EXPECT_TRUE(allocated) << "the host wait behind the held launch failed: " << error;
  EXPECT_EQ(h.alloc.residency().abandoned, 1);
  EXPECT_NO_THROW(h.sim.run_all());
  EXPECT_TRUE(h.holds(a, 4 * MiB, 0x66)) << "the held launch's write was lost";
  h.alloc.deallocate(a);
  h.expect_clean();
}

// A prefetch that never lands (stuck behind work that never completes) lets the launch run on the host copy.
TEST(ResidencyGate, WaitForAPrefetchIsBounded) {
  const region_id id = region_map::next_region_id();
  residency_gate::prepare(id);
  residency_gate::set_incoming(id, true);
  residency_gate::set_on_host(id, true);
  const residency_gate::wait_counts before = residency_gate::waits();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(residency_gate::enter(id));
  const auto waited = std::chrono::steady_clock::now() - start;
  residency_gate::exit(id, 1);
  EXPECT_GE(waited, std::chrono::microseconds(residency_gate::k_incoming_wait_us));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_EQ(residency_gate::waits().timeouts, before.timeouts + 1);
  residency_gate::set_incoming(id, false);
  residency_gate::set_on_host(id, false);
}

// Note [Forecast when due]: the migration thread ticks every 200 us but runs the policy at most every 1 ms when
// nothing finishes and no launch waits; it fetches the forecast only for a round, not at every tick.
TEST(Residency, TheMigrationThreadFetchesTheForecastOnlyForAPolicyRound) {
  const idle_period_for never_idle(residency_options{}.period);  // no launch comes: it would sleep (Note [Idle engine])
  fixed_forecast inner;  // outlive the allocator (and its migration thread)
  counting_forecast f(inner);
  harness h(64 * MiB, true, /*thread=*/true);
  void* a = h.written(8 * MiB, 1);
  inner.set({h.id_of(a)});
  h.alloc.set_forecast_source(&f);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  h.alloc.set_forecast_source(nullptr);
  const std::int64_t rounds = h.alloc.residency().policy_rounds;
  const std::int64_t fetches = f.fetches.load();
  EXPECT_GE(rounds, 5) << "the migration thread ran too few rounds to tell";
  EXPECT_LE(fetches, rounds + 1) << "fetched " << fetches << " times for " << rounds << " rounds";
  h.alloc.deallocate(a);
}

// Note [Idle engine]: with nothing moving and no launch counted, the migration thread sleeps (here for a minute, so
// that only a wake can end the sleep); a counted launch wakes it at once, and so does a free.
std::int64_t rounds_after_wake(harness& h, const std::function<void()>& act) {
  const auto asleep_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (h.alloc.residency().idle_sleeps == 0 && std::chrono::steady_clock::now() < asleep_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_GE(h.alloc.residency().idle_sleeps, 1) << "the idle migration thread never slept";
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // well into its sleep
  const std::int64_t before = h.alloc.residency().policy_rounds;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(h.alloc.residency().policy_rounds, before) << "an engine asleep ran policy rounds";
  act();
  const auto woken_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (h.alloc.residency().policy_rounds == before && std::chrono::steady_clock::now() < woken_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return h.alloc.residency().policy_rounds - before;
}

TEST(Residency, AnIdleMigrationThreadSleepsUntilALaunchIsCounted) {
  const idle_period_for minute(std::chrono::minutes(1));
  harness h(64 * MiB, true, /*thread=*/true);
  void* a = h.written(8 * MiB, 1);
  const std::int64_t woke =
      rounds_after_wake(h, [&] { h.launch(h.s1, {{reinterpret_cast<device_ptr>(a), 4096, false}}); });
  EXPECT_GE(woke, 1) << "a counted launch did not wake the migration thread";
  h.alloc.deallocate(a);
}

TEST(Residency, AnIdleMigrationThreadWakesForAFree) {
  const idle_period_for minute(std::chrono::minutes(1));
  harness h(64 * MiB, true, /*thread=*/true);
  void* a = h.written(8 * MiB, 1);
  void* b = h.written(8 * MiB, 2);
  const std::int64_t woke = rounds_after_wake(h, [&] { h.alloc.deallocate(b); });
  EXPECT_GE(woke, 1) << "a free did not wake the migration thread";
  h.alloc.deallocate(a);
}

}  // namespace
}  // namespace layerswap
