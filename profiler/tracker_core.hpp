// The launch tracker without CUPTI: what the CUPTI callback hands its decoded launches to, and everything
// that happens to them afterwards. Plain C++, fed with synthetic launches by the unit tests.
//
// Hot path (record(), from any launching thread): numbers the launch, stamps it (only while a trace is written:
// the trace is the only reader of the time, and a clock read is a fifth of the callback's hot cost), and pushes
// one access event (more when it touched more than k_event_regions regions) into the lock-free ring. No lock,
// no allocation, no logging; a full ring drops the event and counts it.
//
// Note [Consumer pacing]
//   The consumer wakes every millisecond and drains what has accumulated; it goes round again at once only
//   while the ring is more than a quarter full. It must not chase the producers event by event: a consumer in
//   lockstep with a launching thread reads each ring cell right after it is written, so the launching thread
//   meets, launch after launch, cache lines that the consumer's core holds, and on an SMT sibling it competes
//   for the core itself. At a launch per microsecond a millisecond is a thousand events, a thirtieth of the
//   ring; the learner and the residency engine plan in steps of milliseconds or more.
//
// Note [Idle consumer]
//   A process that launches nothing (waiting for data, between runs, a notebook between cells, a side of an
//   interleaved benchmark waiting for its turn) would still wake its consumer a thousand times a second. After
//   k_idle_polls empty polls in a row the consumer marks itself asleep and waits up to options.idle_sleep (then
//   polls once and sleeps again if the ring is still empty: five wakes a second instead of a thousand); the
//   next record() that sees the mark wakes it. The consumer stores the mark, then looks at the ring's tail; a
//   producer claims its cell (a compare-exchange on the tail), then looks at the mark; all four are seq_cst, so
//   either the consumer sees the new event and stays awake or the producer sees the mark and wakes it (through
//   the consumer's mutex, so the wake cannot fall between the consumer's look at the mark and its wait). A wake
//   lost anyway would cost at most idle_sleep of delay, never an event. The producer's look is one load from the
//   line of the launch counter, which it has just written; on x86 the seq_cst claim is the same locked
//   instruction as a relaxed one.
//
// Consumer (a background thread started with start_consumer(), or any caller of consume(), serialized by a
// mutex): drains the ring into the statistics, the bounded recent-events buffer that drain() hands to tests
// and benchmarks, the learner (set_learner(): step period and forecast, learner.hpp), and the trace file.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "profiler/access_event.hpp"
#include "profiler/arg_decoder.hpp"
#include "profiler/event_ring.hpp"
#include "profiler/layout_cache.hpp"
#include "profiler/learner.hpp"
#include "profiler/trace_writer.hpp"
#include "runtime/driver_calls.hpp"

namespace layerswap::profiler {

struct tracker_options {
  std::size_t ring_capacity = std::size_t{1} << 15;    // events
  std::size_t recent_capacity = std::size_t{1} << 18;  // launches kept for drain()
  std::string trace_path;                              // "" = no trace file
  std::uint64_t trace_max_events = 2'000'000;          // about 300 MB of JSON
  std::chrono::milliseconds idle_sleep{200};           // the idle consumer's longest sleep (Note [Idle consumer])
};

// LAYERSWAP_TRACK=attribute: the migration thread's states a launch can meet (none, or in a driver call of one
// of driver_calls' kinds), and the buckets of the launches' driver times (powers of two of fast-clock ticks).
inline constexpr std::size_t k_engine_states = driver_calls::k_kinds + 1;
// An engine state's name in reports and statistics keys: "none", else its driver call's kind (driver_calls).
inline const char* engine_state_name(std::size_t state) noexcept {
  return state == 0 || state >= k_engine_states ? "none" : driver_calls::k_names[state - 1];
}
inline constexpr std::size_t k_launch_hist = 16;
inline constexpr unsigned k_launch_hist_shift = 10;  // bucket 0: below 2^10 ticks (~0.3-0.5 us); then doubling

struct tracker_stats {
  std::uint64_t launches = 0;  // kernel launches, copies, memsets and graph launches seen (counted once)
  std::uint64_t kernels = 0;
  std::uint64_t copies = 0;
  std::uint64_t memsets = 0;
  std::uint64_t graphs = 0;
  std::uint64_t decoded = 0;   // launches whose arguments were read (a layout, an extra buffer, or a hit)
  std::uint64_t undecoded[k_undecoded_reasons] = {};
  std::uint64_t with_regions = 0;     // launches that touched at least one region
  std::uint64_t truncated = 0;        // launches with more regions than recorded
  std::uint64_t dropped = 0;          // events lost to a full ring
  std::uint64_t nested_skipped = 0;   // driver callbacks of runtime calls, not counted again
  // Note [Pointer tables] (launch_recorder.hpp): host copies that held region addresses, and the kernels that took
  // regions from such a table.
  std::uint64_t pointer_tables = 0;
  std::uint64_t table_launches = 0;
  std::uint64_t launch_api_ns = 0;    // time inside kernel launch calls (entry to exit callback), all threads
  std::uint64_t launch_api_calls = 0; // ... over this many launches
  std::uint64_t launch_driver_ns = 0; // the part of launch_api_ns after the tracker's entry callback returned:
                                      // the driver's own work, CUPTI's exit dispatch and any wait in the driver
  // LAYERSWAP_TRACK=attribute (Note [Launches beside the engine's calls], cupti_tracker.cpp): the launches and
  // their driver part (ns) by the migration thread's driver call at the launch's entry or exit ([0]: none; [k + 1]:
  // driver_calls::kind k), and by the driver part's length (bucket b: below launch_hist_upper_ns[b]; the last one
  // is open).
  std::array<std::uint64_t, k_engine_states> launch_engine_calls{};
  std::array<std::uint64_t, k_engine_states> launch_engine_ns{};
  std::array<std::uint64_t, k_launch_hist> launch_hist_calls{};
  std::array<std::uint64_t, k_launch_hist> launch_hist_ns{};
  std::array<std::uint64_t, k_launch_hist> launch_hist_upper_ns{};
  std::uint64_t recent_dropped = 0;   // launches pushed out of the recent buffer before drain()
  std::uint64_t consumer_sleeps = 0;  // times the consumer fell asleep for want of launches (Note [Idle consumer])
  std::uint64_t trace_written = 0;
  std::uint64_t trace_skipped = 0;
  std::size_t functions = 0;          // kernels in the layout cache
  // Launches of kernels where no argument word resolved to a region, by kernel family (decoded or not).
  std::vector<std::pair<std::string, std::uint64_t>> no_region_families;
};

// LAYERSWAP_STATS under LAYERSWAP_TRACK=attribute: one line of the launches' driver time by the migration thread's
// driver call they met (the largest totals first) and of those that took 16 us or more; "" when nothing was
// attributed.
[[nodiscard]] std::string attribution_report(const tracker_stats& s);

struct drained_event {
  std::uint64_t launch_no = 0;
  std::uint64_t stream = 0;
  std::uint32_t kernel = 0;
  launch_kind kind = launch_kind::kernel;
  std::vector<region_id> regions;
};

class tracker_core {
 public:
  explicit tracker_core(tracker_options options = {});
  ~tracker_core();
  tracker_core(const tracker_core&) = delete;
  tracker_core& operator=(const tracker_core&) = delete;

  [[nodiscard]] layout_cache& layouts() noexcept { return layouts_; }

  // ---- hot path: any thread, noexcept, no allocation ----
  // Returns the launch number given to the launch (also when its event was dropped).
  std::uint64_t record(launch_kind kind, std::uint64_t stream, std::uint32_t kernel, undecoded_reason reason,
              const region_set& regions) noexcept;
  void count_nested() noexcept { nested_.fetch_add(1, std::memory_order_relaxed); }
  void count_pointer_table() noexcept { pointer_tables_.fetch_add(1, std::memory_order_relaxed); }
  void count_table_launch() noexcept { table_launches_.fetch_add(1, std::memory_order_relaxed); }
  // Time one kernel launch call took, from its API entry to its exit (the driver's own work and any wait in it),
  // and the part of it after the entry callback returned (`driver_ticks`), in fast-clock ticks
  // (runtime/fast_clock.hpp; stats() converts).
  void add_launch_api_time(std::uint64_t ticks, std::uint64_t driver_ticks) noexcept {
    launch_api_ticks_.fetch_add(ticks, std::memory_order_relaxed);
    launch_driver_ticks_.fetch_add(driver_ticks, std::memory_order_relaxed);
    launch_api_calls_.fetch_add(1, std::memory_order_relaxed);
  }

  // LAYERSWAP_TRACK=attribute: one launch's driver part, and the engine state it met (0: none; k + 1: in a
  // driver call of driver_calls kind k; larger values count as none).
  void add_launch_attribution(std::uint8_t engine_state, std::uint64_t driver_ticks) noexcept {
    const std::size_t state = engine_state < k_engine_states ? engine_state : 0;
    launch_engine_calls_[state].fetch_add(1, std::memory_order_relaxed);
    launch_engine_ticks_[state].fetch_add(driver_ticks, std::memory_order_relaxed);
    const std::size_t bucket =
        std::min<std::size_t>(std::bit_width(driver_ticks >> k_launch_hist_shift), k_launch_hist - 1);
    launch_hist_calls_[bucket].fetch_add(1, std::memory_order_relaxed);
    launch_hist_ticks_[bucket].fetch_add(driver_ticks, std::memory_order_relaxed);
  }

  // ---- consumer side ----
  void start_consumer();
  void stop_consumer() noexcept;
  // Drains the ring now; returns the events consumed.
  std::size_t consume();
  [[nodiscard]] tracker_stats stats();
  // Consumes, then hands out (and forgets) up to `max` of the oldest recent launches.
  [[nodiscard]] std::vector<drained_event> drain(std::size_t max);
  // A printable name for an event's kernel ("memcpy", "memset", "graph", or the kernel's name, or "kernel#N").
  [[nodiscard]] std::string kernel_name(launch_kind kind, std::uint32_t kernel) const;
  // Flushes and closes the trace file (at stop and at exit).
  void close_trace();
  // The learner fed with every consumed event (not owned; nullptr: none). Set before start_consumer() or at
  // any time: the consumer's mutex orders it with consumption.
  void set_learner(learner* l);
  [[nodiscard]] learner* get_learner();

 private:
  void consume_one_locked(const access_event& event);
  void wake_consumer() noexcept;  // record() found the consumer asleep
  bool ring_empty();
  static constexpr int k_idle_polls = 16;  // empty polls in a row (about 16 ms) before the consumer sleeps

  tracker_options options_;
  layout_cache layouts_;
  event_ring<access_event> ring_;
  std::atomic<std::uint64_t> next_launch_{1};
  // Note [Idle consumer]: set by the consumer as it falls asleep, cleared by whoever wakes it. Beside the launch
  // counter, whose line every record() writes anyway: looking at the mark touches no other line.
  std::atomic<bool> consumer_asleep_{false};
  std::atomic<std::uint64_t> dropped_{0};
  std::atomic<std::uint64_t> nested_{0};
  std::atomic<std::uint64_t> pointer_tables_{0};
  std::atomic<std::uint64_t> table_launches_{0};
  std::atomic<std::uint64_t> launch_api_ticks_{0};
  std::atomic<std::uint64_t> launch_api_calls_{0};
  std::atomic<std::uint64_t> launch_driver_ticks_{0};
  std::array<std::atomic<std::uint64_t>, k_engine_states> launch_engine_calls_{};
  std::array<std::atomic<std::uint64_t>, k_engine_states> launch_engine_ticks_{};
  std::array<std::atomic<std::uint64_t>, k_launch_hist> launch_hist_calls_{};
  std::array<std::atomic<std::uint64_t>, k_launch_hist> launch_hist_ticks_{};
  std::uint64_t origin_ns_ = 0;
  bool stamp_ = false;  // whether record() reads the clock (a trace is written)
  std::atomic<std::uint64_t> consumer_sleeps_{0};

  std::mutex mutex_;  // the consumer side
  tracker_stats stats_;
  std::deque<drained_event> recent_;
  std::unordered_map<std::uint32_t, std::uint64_t> no_region_by_kernel_;
  trace_writer trace_;
  learner* learner_ = nullptr;

  std::mutex thread_mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

// Steady-clock nanoseconds (the hot path's timestamp).
[[nodiscard]] std::uint64_t now_ns() noexcept;

}  // namespace layerswap::profiler
