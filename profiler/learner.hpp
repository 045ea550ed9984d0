// The learner: from the tracker's access events, the step period of a training loop, the order in which each
// step uses its long-lived regions, groups of regions used together, and a forecast of each region's next use
// (layerswap::forecast_source, read by the residency policy). See learner.cpp for the algorithm.
//
// Threads: on_event() and flush() are the consumer side (tracker_core's consumer, under its mutex: one thread
// at a time). current(), stats(), step_order() and group_of() may be called from any thread at any time: they
// read a snapshot published under a small mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "allocator/forecast.hpp"
#include "profiler/access_event.hpp"

namespace layerswap::profiler {

struct learner_options {
  // Launches remembered (their kernels and regions). Bounds the period that can be learned (half of it) and
  // most of the memory (about 24 bytes per launch plus 12 per region use, region_slots_per_launch of them).
  std::size_t history = std::size_t{1} << 17;
  std::size_t region_slots_per_launch = 4;
  std::uint64_t min_period = 8;  // launches
  // A candidate period is accepted when, over one whole period, at most this share of launches differ from
  // the launch one period earlier (an inserted or removed launch is forgiven within `slack` positions).
  double max_mismatch = 0.05;
  std::uint32_t slack = 2;
  // Weighted comparisons an evaluation epoch needs before its mismatch rate counts (the epoch stretches over
  // further periods until it has them).
  std::uint64_t min_compared = 64;
  // Following a learned order: a launch that matches none of the positions within `resync` of the expected
  // one is a miss; a block of launches (max(64, period / 8)) with more than half missed drops the order.
  std::uint32_t resync = 8;
  // Groups (learner.cpp, Note [Groups]): uses closer than burst_gap launches form one burst; regions whose
  // uses all lie within group_window launches of the group leader's (and the other way round) join it.
  std::uint32_t burst_gap = 8;
  std::uint32_t group_window = 16;
  // At most one info line about (re)learning per this many seconds; the others are counted in it.
  double log_interval_s = 30.0;
  // Regions the learner considers; nullptr = all. The tracker passes residency_gate::persistent, so that
  // activation segments, reused from the cache under the same region id layer after layer, do not make a
  // layer look like a step.
  bool (*keep)(region_id) = nullptr;
};

struct learner_stats {
  bool learned = false;
  std::uint64_t generation = 0;
  std::uint64_t launches = 0;           // launches consumed
  std::uint64_t steps = 0;              // whole steps followed while learned
  std::uint64_t period = 0;             // launches per step (0 while not learned)
  std::uint64_t recurring_regions = 0;  // regions in the learned step
  std::uint64_t groups = 0;
  std::uint64_t learns = 0;             // times an order was learned
  std::uint64_t relearns = 0;           // times a learned order broke
  std::uint64_t predicted = 0;          // launches consumed while learned
  std::uint64_t hits = 0;               // launches whose recurring regions were the forecast ones
  std::uint64_t late_continued = 0;     // continuation events that arrived after their launch was closed
  std::size_t tracked_regions = 0;      // bounded-memory bookkeeping (tests)
  std::size_t tracked_pairs = 0;
  // Share of all consumed launches that were hits.
  [[nodiscard]] double hit_rate() const noexcept {
    return launches == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(launches);
  }
};

class learner final : public forecast_source {
 public:
  explicit learner(learner_options options = {});
  ~learner() override;
  learner(const learner&) = delete;
  learner& operator=(const learner&) = delete;

  // ---- consumer side (one thread at a time) ----
  // One access event, in consumption order. Events with k_flag_continued extend the launch before them.
  void on_event(const access_event& event);
  // Closes the launch still open (waiting for a possible continuation event).
  void flush();

  // ---- any thread ----
  void current(forecast& out, std::size_t max_regions) override;
  [[nodiscard]] learner_stats stats() const;
  // The recurring regions of the learned step in order of first use from the step's origin (empty when not
  // learned), and the group of a region (0: none or not learned).
  [[nodiscard]] std::vector<region_id> step_order() const;
  [[nodiscard]] std::uint32_t group_of(region_id id) const;

  struct step_template;  // learner.cpp

  struct region_info {
    std::uint64_t first_seen = 0;  // launch index (the learner's own count)
    std::uint64_t last_seen = 0;
  };

 private:
  struct launch_rec {
    std::uint64_t launch_no = 0;
    std::uint64_t region_begin = 0;  // absolute index into the region ring
    std::uint32_t kernel_key = 0;
    std::uint32_t nregions = 0;
  };
  struct lag {
    std::uint64_t period = 0;
    std::uint64_t seen = 0;      // launches in the current epoch
    std::uint64_t compared = 0;  // recurring region uses compared (the weights of the launches)
    std::uint64_t mismatched = 0;
    std::uint64_t epochs = 0;   // whole periods compared
    double last_rate = 1.0;     // mismatch share of the last whole period
  };
  struct distance_counter {
    std::uint64_t distance = 0;
    std::uint64_t count = 0;
  };

  void close_launch();
  void process(std::uint64_t index);
  void count_distance(std::uint64_t distance);
  void refresh_lags();
  void evaluate_lags(std::uint64_t index);
  [[nodiscard]] bool same_at_lag(std::uint64_t a, std::uint64_t b, std::uint64_t period) const;
  [[nodiscard]] std::uint64_t recent_hash(std::uint64_t index, std::uint64_t period, std::uint32_t* count) const;
  [[nodiscard]] std::uint64_t earlier_hash(std::uint64_t index, std::uint64_t now) const;
  [[nodiscard]] bool in_history(std::uint64_t index) const noexcept;
  void learn(std::uint64_t index, std::uint64_t period);
  void follow(std::uint64_t index);
  void drop(const char* why);
  void sweep(std::uint64_t index);
  void publish_locked();
  void maybe_log(const char* what);

  learner_options options_;
  // ---- consumer side ----
  std::vector<launch_rec> launches_;      // ring: launch index i at i % size
  std::vector<region_id> region_ring_;    // ring of region ids, parallel to info_ring_
  std::vector<region_info*> info_ring_;   // the regions_ entry of each (stable: Note [Region bookkeeping])
  std::uint64_t next_index_ = 0;          // launches closed so far
  std::uint64_t region_total_ = 0;        // region slots written so far
  bool open_ = false;                     // the launch at next_index_ is still collecting regions
  std::unordered_map<region_id, region_info> regions_;
  std::unordered_map<std::uint64_t, std::uint64_t> pair_last_;  // (kernel, region) -> last launch index
  std::vector<distance_counter> distances_;                     // space-saving top distances
  std::vector<lag> lags_;
  std::uint64_t since_refresh_ = 0;
  std::uint64_t last_sweep_ = 0;
  // Following a learned step.
  std::shared_ptr<const step_template> template_;
  std::uint64_t origin_index_ = 0;  // a launch index at step position 0
  std::uint64_t position_ = 0;      // step position of the newest launch
  std::uint64_t block_launches_ = 0;
  std::uint64_t block_misses_ = 0;
  learner_stats counters_;
  // Logging.
  std::chrono::steady_clock::time_point last_log_{};
  bool logged_ = false;
  std::uint64_t unlogged_ = 0;

  // ---- published (any thread) ----
  mutable std::mutex publish_mutex_;
  std::shared_ptr<const step_template> published_template_;
  std::uint64_t published_position_ = 0;
  std::uint64_t published_launch_no_ = 0;
  learner_stats published_;
};

}  // namespace layerswap::profiler
