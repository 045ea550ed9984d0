// Plain statistics counters, in the shape PyTorch reports them: current value, peak since the last reset,
// and the accumulated totals of increases and decreases.
#pragma once

#include <algorithm>
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

}  // namespace layerswap
