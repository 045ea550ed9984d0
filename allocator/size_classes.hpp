// Size classes for small allocations, packed into slabs.
//
// Requests up to 4 KiB round up to a multiple of 512 B (8 classes). Above that, each power-of-two interval
// (p, 2p] is cut into 8 equal steps of p/8, so a block is never more than 12.5% larger than its request.
// A class's slab is the smallest multiple of the mapping granularity (at most 8 of them) whose unusable
// tail is at most 1/8 of the slab. Every block is 512-byte aligned, like PyTorch's.
#pragma once

#include <cstddef>
#include <cstdint>

namespace layerswap {

inline constexpr std::size_t k_min_block = 512;

// Index of the smallest class that holds `bytes` (bytes >= 1).
[[nodiscard]] std::uint32_t size_class_index(std::size_t bytes) noexcept;
// Block size of class `index`.
[[nodiscard]] std::size_t size_class_bytes(std::uint32_t index) noexcept;
// Number of classes needed to cover requests up to `max_bytes`.
[[nodiscard]] std::uint32_t size_class_count(std::size_t max_bytes) noexcept;
// Slab size for blocks of `block` bytes with mapping granularity `granularity`.
[[nodiscard]] std::size_t slab_bytes_for(std::size_t block, std::size_t granularity) noexcept;

}  // namespace layerswap
