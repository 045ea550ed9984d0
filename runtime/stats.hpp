// Plain statistics counters, in the shape PyTorch reports them: current value, peak since the last reset,
// and the accumulated totals of increases and decreases.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace layerswap {

struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // sum of increases
  std::int64_t freed = 0;      // sum of decreases

  void increase(std::int64_t amount) noexcept {
    current += amount;
    allocated += amount;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t amount) noexcept {
    current -= amount;
    freed += amount;
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept { allocated = freed = 0; }
};

// Time since `start` on the steady clock, for the time counters of the statistics.
inline std::int64_t elapsed_us(std::chrono::steady_clock::time_point start) noexcept {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
}
inline std::int64_t elapsed_ns(std::chrono::steady_clock::time_point start) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

// Adds the time from its construction to its destruction to each of its totals (ns), however the scope is left: one
// interval read once, for a total and the parts it is split into.
class scoped_ns_timer {
 public:
  template <class... Totals>
  explicit scoped_ns_timer(std::atomic<std::int64_t>& total, Totals&... more) noexcept : totals_{&total, &more...} {}
  ~scoped_ns_timer() {
    const std::int64_t ns = elapsed_ns(start_);
    for (std::atomic<std::int64_t>* t : totals_) {
      if (t) *t += ns;
    }
  }
  scoped_ns_timer(const scoped_ns_timer&) = delete;
  scoped_ns_timer& operator=(const scoped_ns_timer&) = delete;

 private:
  std::array<std::atomic<std::int64_t>*, 3> totals_;  // unused slots null
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace layerswap
