// Plain statistics counters, in the shape PyTorch reports them: current value, peak since the last reset,
// and the accumulated totals of increases and decreases.
#pragma once

#include <algorithm>
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

// Adds the time from its construction to its destruction to `total` (ns), however the scope is left.
class scoped_ns_timer {
 public:
  explicit scoped_ns_timer(std::atomic<std::int64_t>& total) noexcept : total_(total) {}
  ~scoped_ns_timer() { total_ += elapsed_ns(start_); }
  scoped_ns_timer(const scoped_ns_timer&) = delete;
  scoped_ns_timer& operator=(const scoped_ns_timer&) = delete;

 private:
  std::atomic<std::int64_t>& total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace layerswap
