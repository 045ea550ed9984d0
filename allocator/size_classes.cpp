#include "allocator/size_classes.hpp"

#include <bit>

namespace layerswap {

namespace {
constexpr std::size_t k_linear_max = 4096;                                 // 512 B steps up to here
constexpr std::uint32_t k_linear_classes = k_linear_max / k_min_block;     // 8: 512 .. 4096
constexpr std::uint32_t k_steps = 8;                                       // classes per doubling above
constexpr std::uint32_t k_linear_log2 = 12;                                // log2(4096)
}  // namespace

std::uint32_t size_class_index(std::size_t bytes) noexcept {
  if (bytes <= k_linear_max) {
    const std::size_t units = (bytes + k_min_block - 1) / k_min_block;
    return static_cast<std::uint32_t>(units == 0 ? 0 : units - 1);
  }
  // bytes lies in (p, 2p] with p = 2^e.
  const auto e = static_cast<std::uint32_t>(std::bit_width(bytes - 1) - 1);
  const std::size_t p = std::size_t{1} << e;
  const std::size_t step = p / k_steps;
  const auto j = static_cast<std::uint32_t>((bytes - p + step - 1) / step);  // 1..8
  return k_linear_classes + (e - k_linear_log2) * k_steps + (j - 1);
}

std::size_t size_class_bytes(std::uint32_t index) noexcept {
  if (index < k_linear_classes) return (index + 1) * k_min_block;
  const std::uint32_t rest = index - k_linear_classes;
  const std::size_t p = std::size_t{1} << (k_linear_log2 + rest / k_steps);
  return p + (rest % k_steps + 1) * (p / k_steps);
}

std::uint32_t size_class_count(std::size_t max_bytes) noexcept {
  return size_class_index(max_bytes) + 1;
}

std::size_t slab_bytes_for(std::size_t block, std::size_t granularity) noexcept {
  for (std::size_t k = 1; k <= 8; ++k) {
    const std::size_t slab = k * granularity;
    if (slab < block) continue;
    if ((slab % block) * 8 <= slab) return slab;
  }
  // Unreachable for blocks up to 4 granules; fall back to an exact fit.
  return (block + granularity - 1) / granularity * granularity;
}

}  // namespace layerswap
