// LAYERSWAP_PREFETCH=tune: the prefetch distance chosen from the step times the engine sees (residency.cpp,
// Note [Tuned prefetch]).
//
// How far ahead to prefetch is not one answer for every workload. Training's GEMMs read a weight left on the host at
// a few GB/s, so everything the budget allows should come in ahead (auto); one token of generation reads each
// weight once, a matrix-vector product reads host memory about as fast as a copy would, and the host mappings of
// moving every weight cost more than the link (session 58: at 25% of a 1.1B Llama's weights, `LAYERSWAP_PREFETCH=16`
// took 37.8 ms a token against auto's 56.5 ms; in training 16 was 1.107x slower). The tuner tries, per learned step
// length, auto and then shorter distances (each half the last one, or half the regions its wanted set held if fewer),
// a few steps each, and keeps the fastest; a shorter distance only when its step is at least k_gain faster than
// auto's. It stops going shorter once a distance is k_worse slower than the best so far, or no longer shrinks the
// wanted set (the policy wants whole groups, so a distance below a group's size wants the group). Pure logic: the
// engine calls it from its policy rounds, under the allocator mutex, with the forecast's step and a clock; no
// allocation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace layerswap {

class prefetch_tuner {
 public:
  static constexpr std::size_t k_auto = 0;                // no count limit (LAYERSWAP_PREFETCH=auto)
  static constexpr unsigned k_warm_steps = 3;             // steps of auto before it is timed
  static constexpr unsigned k_settle_steps = 1;           // steps after a distance is set that are not timed
  static constexpr unsigned k_timed_steps = 3;            // steps timed per distance (their median counts)
  static constexpr std::size_t k_max_candidates = 5;      // auto and up to four shorter distances
  static constexpr std::size_t k_min_regions = 2;         // the shortest distance tried
  static constexpr double k_gain = 0.05;                  // a shorter distance must be this much faster than auto
  static constexpr double k_worse = 0.10;                 // ... and the trial stops at one this much slower
  static constexpr std::size_t k_remembered = 8;          // step lengths whose choice is kept
  static constexpr unsigned k_untimed_most = 12;          // steps in a row that cannot be timed before a trial ends

  struct trial {
    std::size_t regions = k_auto;  // the distance (k_auto: auto)
    std::uint64_t step_ns = 0;     // the median of its timed steps; 0: not timed
    std::size_t wanted = 0;        // the most regions a wanted set held under it
    bool same_set = false;         // it wanted no fewer regions than the distance before: not a choice
  };
  // The last finished tuning, for the log and the stats.
  struct outcome {
    std::uint64_t step_launches = 0;
    std::size_t chosen = k_auto;
    std::array<trial, k_max_candidates> trials{};
    std::size_t count = 0;  // trials used; the first is auto's
  };

  // A policy round with a learned forecast: the step's length in launches, the launch number the current step
  // began at, the forecast's generation and the time the forecast was read. Returns the distance to apply (k_auto:
  // none). Sets `finished` when this call ended a tuning (last() holds it).
  std::size_t observe(std::uint64_t generation, std::uint64_t step_launches, std::uint64_t step_start,
                      std::uint64_t now_ns, bool& finished) noexcept;
  // The wanted set the round built under the distance in force held `regions` regions.
  void note_wanted(std::size_t regions) noexcept;
  // The distance in force (k_auto when none).
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }
  [[nodiscard]] bool tuning() const noexcept { return phase_ == phase::settle || phase_ == phase::timed; }
  [[nodiscard]] const outcome& last() const noexcept { return last_; }
  [[nodiscard]] std::uint64_t tunings() const noexcept { return tunings_; }
  // Steps timed by tunings, finished or abandoned; tunings abandoned for another step length.
  [[nodiscard]] std::uint64_t timed_steps() const noexcept { return timed_steps_; }
  [[nodiscard]] std::uint64_t abandoned() const noexcept { return abandoned_; }

 private:
  enum class phase : std::uint8_t { none, settle, timed, done };
  void begin(std::uint64_t step_launches) noexcept;
  void on_step(std::uint64_t step_ns, bool valid, bool& finished) noexcept;
  void restart_timing(std::uint64_t step_start, std::uint64_t now_ns) noexcept;
  void next_candidate(bool& finished) noexcept;
  void finish(bool& finished) noexcept;
  void set_phase(phase p, unsigned steps) noexcept { phase_ = p, steps_left_ = steps; }

  phase phase_ = phase::none;
  unsigned steps_left_ = 0;
  std::size_t limit_ = k_auto;
  std::uint64_t generation_ = 0;
  std::uint64_t key_launches_ = 0;   // the step length the trial or the choice in force belongs to
  std::uint64_t step_launches_ = 0;  // the length the learner gives now (within a 64th of key_launches_)
  std::uint64_t step_start_ = 0;
  std::uint64_t step_seen_ns_ = 0;  // when a round first saw the current step
  bool untimed_ = false;            // the next step seen began at no boundary (a relearn, a re-sync)
  std::array<std::uint64_t, k_timed_steps> timed_{};
  std::size_t timed_count_ = 0;
  unsigned untimed_run_ = 0;        // steps in a row the timed phase could not time
  outcome current_{};
  outcome last_{};
  struct memo {
    std::uint64_t step_launches = 0;  // the length tuned (0: empty); later lengths within a 64th of it share it
    std::size_t chosen = k_auto;
    std::uint64_t used = 0;
  };
  std::array<memo, k_remembered> memos_{};
  std::uint64_t memo_clock_ = 0;
  std::uint64_t tunings_ = 0;
  std::uint64_t timed_steps_ = 0;
  std::uint64_t abandoned_ = 0;
};

}  // namespace layerswap
