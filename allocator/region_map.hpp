// The region map: pointer -> region id in O(1), lock-free, for the launch tracker's hot path.
//
// A region is a segment of the caching allocator: a granule-aligned VA range (2 MiB granules on the H100)
// holding one large allocation or one slab of small blocks. Every segment gets a process-wide 32-bit id
// (next_region_id(); 0 means "no region") when it is first published. The allocator publishes each VA
// arena it reserves (register_arena) and, whenever its owner table changes, the ids of the granules that
// changed (publish). A lookup checks the few registered arenas (usually one per device) and does one
// atomic load: no lock, no allocation, safe from any thread, including a CUPTI callback.
//
// Small allocations share slab regions: a lookup answers with the slab's id, not the block's. The block
// is derivable later (off the hot path) through caching_allocator::block_of(ptr).
//
// Note [Region map lifetime]
//   An arena's id array is freed by unregister_arena(), which the allocator calls when it is destroyed.
//   The process-wide allocators (registry.hpp) are never destroyed, so lookups racing with an unregister
//   only happen in tests that destroy allocators while a tracker runs, which none do.
#pragma once

#include <cstddef>
#include <cstdint>

namespace layerswap {

using region_id = std::uint32_t;

namespace region_map {

// Arenas the map can hold at once (all devices together); arenas beyond it are not tracked (counted).
inline constexpr int k_max_arenas = 64;

// A new, never used region id (1, 2, ...). Thread-safe.
[[nodiscard]] region_id next_region_id() noexcept;

// Publishes an arena of `bytes` at `base`, in granules of 1 << `granule_shift` bytes, all ids 0. Returns its
// slot, or -1 when k_max_arenas are registered (lookups then miss it). Not on a hot path (allocates).
[[nodiscard]] int register_arena(std::uint64_t base, std::size_t bytes, unsigned granule_shift);
// Withdraws the arena in `slot` (Note [Region map lifetime]). No-op for -1.
void unregister_arena(int slot) noexcept;
// Sets granules [first, first + count) of the arena in `slot` to `id`. No-op for -1.
void publish(int slot, std::size_t first, std::size_t count, region_id id) noexcept;

// The region holding `address`, or 0. Lock-free; a handful of loads.
[[nodiscard]] region_id lookup(std::uint64_t address) noexcept;

// Arenas that could not be registered because the table was full.
[[nodiscard]] std::uint64_t arenas_refused() noexcept;

}  // namespace region_map

// An arena's slot in the region map, withdrawn when destroyed (the allocator keeps one per arena).
class published_arena {
 public:
  published_arena() = default;
  published_arena(std::uint64_t base, std::size_t bytes, unsigned granule_shift)
      : slot_(region_map::register_arena(base, bytes, granule_shift)) {}
  ~published_arena() { region_map::unregister_arena(slot_); }
  published_arena(const published_arena&) = delete;
  published_arena& operator=(const published_arena&) = delete;

  void publish(std::size_t first, std::size_t count, region_id id) const noexcept {
    region_map::publish(slot_, first, count, id);
  }
  [[nodiscard]] int slot() const noexcept { return slot_; }

 private:
  int slot_ = -1;
};

}  // namespace layerswap
