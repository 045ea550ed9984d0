// A caching device allocator on CUDA virtual memory (one per device). See caching_allocator.cpp for the
// algorithm and the notes on its invariants.
//
// Stream contract (as PyTorch's): memory returned by allocate(bytes, S) may be used at once by work
// enqueued on S. After deallocate(), the block is reused on S at once (stream order keeps it safe), and on
// any other stream, or unmapped, only after the work that S (and every stream given to record_stream) had
// enqueued by then has completed. Nothing on the allocate/deallocate path synchronizes the device; a host
// wait on one stream's event happens only when memory must move between streams or back to the driver
// (cache reclaim under the budget, empty_cache()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "allocator/forecast.hpp"
#include "allocator/residency.hpp"
#include "runtime/driver.hpp"
#include "runtime/stats.hpp"

namespace layerswap {

struct allocator_options {
  std::size_t budget = 0;                         // cap on device memory held, bytes; 0 = no cap
  std::size_t va_reserve = std::size_t{1} << 40;  // virtual address space per arena
  std::size_t small_max = std::size_t{1} << 20;   // requests up to this are packed into slabs
  double oversize = 1.0;  // LAYERSWAP_OVERSIZE: Note [Oversize reuse] in caching_allocator.cpp; 1 = off
  bool composites = false;  // LAYERSWAP_COMPOSITES: Note [Composites] in caching_allocator.cpp (residency only)
  // Note [Spare composites] in caching_allocator.cpp (residency only): no setting; off in tests that say so, and
  // with the development switch LSDEV_SPARE_COMPOSITES=0 (read by the allocator itself, for A/B runs).
  bool spare_composites = true;
  // LAYERSWAP_SPLIT: Note [Split segments] in caching_allocator.cpp (residency only): 0 = off, else the most times
  // its size a segment is that a large request takes a range of; while the reserve for activations is the step's
  // peak, `split_peak` instead when set (Note [Splits by reserve]).
  std::size_t split = 0;
  std::optional<std::size_t> split_peak;
  // LAYERSWAP_SPLIT_FREE: Note [Split bound] in caching_allocator.cpp: the most bytes split segments' free ranges may
  // hold after a split that takes a whole segment (only under a budget); the maximum = no bound. While the reserve
  // is the step's peak, `split_free_peak` instead when set.
  std::size_t split_free = std::numeric_limits<std::size_t>::max();
  std::optional<std::size_t> split_free_peak;
  bool reclaim_fit = true;  // LAYERSWAP_RECLAIM: Note [Reclaim by fit] in caching_allocator.cpp; false = oldest first
  residency_options residency;                    // swapping (allocator/residency.hpp); off by default
};

// Statistics of one pool: `small` holds slab-packed blocks, `large` the allocations with their own region.
struct pool_stats {
  stat allocations;      // live allocations (count)
  stat allocated_bytes;  // bytes of live blocks (rounded sizes)
  stat requested_bytes;  // bytes asked for by live allocations
  stat active;           // live allocations plus frees waiting on other streams (count)
  stat active_bytes;
  stat segments;         // regions (large) or slabs (small) in existence (count)
  stat reserved_bytes;   // physical bytes mapped into those segments; pooled free pages count as large
};

struct allocator_stats {
  int device = 0;
  std::size_t budget = 0;             // 0 = no cap
  std::size_t granularity = 0;
  pool_stats small;
  pool_stats large;
  pool_stats all;                     // both pools together (its peaks are true peaks of the sum)
  stat device_bytes;                  // all physical device memory held (mapped + pooled); <= budget
  std::int64_t cached_bytes = 0;      // held but not in a live allocation
  std::int64_t num_alloc_retries = 0; // allocations that had to reclaim cached memory first
  std::int64_t num_ooms = 0;
  std::int64_t num_device_alloc = 0;  // physical allocations created (2 MiB pages, or chunks: residency.cpp)
  std::int64_t num_device_free = 0;   // ... released to the driver
  std::int64_t num_host_waits = 0;    // times the allocator waited for a stream's event
  std::int64_t host_wait_us = 0;      // ... the time those waits took, with the synchronous evictions' (below)
  std::int64_t stall_us = 0;          // time allocations spent in synchronous evictions (residency.cpp)
  std::int64_t num_lock_waits = 0;    // allocate/deallocate calls that found the allocator's mutex taken
  std::int64_t lock_wait_us = 0;      // ... and the time they waited for it
  std::int64_t num_lock_spins = 0;    // ... of which got it while spinning, before sleeping (Note [Waiting for the mutex])
  std::int64_t num_calls = 0;         // allocate/deallocate calls
  std::int64_t call_ns = 0;           // ... and the time spent inside them, lock waits included
  std::int64_t num_foreign_frees = 0; // deallocate() of pointers this allocator does not own
  std::int64_t num_reclaims = 0;      // idle segments destroyed for an allocation (its pages or chunk reused)
  std::int64_t num_engine_reclaims = 0;  // ... for a prefetch of the residency engine (page_source::reclaim_idle)
  std::int64_t num_oversize_reuses = 0;  // large allocations served by a larger idle segment (Note [Oversize reuse])
  std::int64_t num_composites = 0;     // large segments made of idle segments' chunks, no host wait (Note [Composites])
  std::int64_t composite_donors = 0;   // ... the idle segments they took
  std::int64_t num_zombies_reaped = 0;  // ... whose VA was unmapped once the GPU was past it
  std::int64_t num_spare_composites = 0;  // large segments made of spare chunks, none released (Note [Spare composites])
  std::int64_t spare_composite_parts = 0;  // ... the chunks they map (spares, and a new one for the rest)
  std::int64_t num_splits = 0;  // large allocations served by a range of a larger segment (Note [Split segments])
  std::int64_t num_spare_splits = 0;  // ... of a spare chunk made a segment for it (Note [Split spares])
  std::int64_t num_home_segments = 0;  // segments made at a spare chunk's home VA, no driver call (Note [Home segments])
  std::int64_t num_slab_reuses = 0;  // idle slabs that took another size class instead of a new slab (Note [Slabs change class])
  std::int64_t segment_new_ns = 0;    // time making segments (memory gathered, mapped), reclaims and evictions included
  std::int64_t segment_destroy_ns = 0;  // time destroying segments (unmapped, memory pooled)
};

class caching_allocator {
 public:
  caching_allocator(driver& port, allocator_options options);
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  // Memory for `bytes` (>= 1) usable on `stream`. Throws out_of_memory (budget or device exhausted after
  // reclaiming the cache); the message names the budget, the largest holders and what to change.
  [[nodiscard]] void* allocate(std::size_t bytes, stream_handle stream);
  // Returns a block; false (and counted) when `ptr` is not one of ours. Never throws.
  bool deallocate(void* ptr) noexcept;
  // `ptr` is also used by work on `stream`: its reuse waits for that work too (Tensor.record_stream).
  void record_stream(void* ptr, stream_handle stream);
  // Returns every cached block and pooled page to the driver (waits for the streams that used them).
  void empty_cache();

  [[nodiscard]] allocator_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();

  // Whether `ptr` is in a live segment of this allocator (takes the mutex).
  [[nodiscard]] bool owns(const void* ptr) const noexcept;
  // Whether `ptr` lies in virtual address space this allocator reserved, live segment or not: lock-free, for
  // finding the allocator a free belongs to (owner_of; Note [Free without a second lock] in caching_allocator.cpp).
  [[nodiscard]] bool in_arena(const void* ptr) const noexcept;
  // Start and size of the block holding `ptr` (the allocation it belongs to); {nullptr, 0} if not ours.
  [[nodiscard]] std::pair<void*, std::size_t> block_of(const void* ptr) const noexcept;
  // The largest request that could be served now without reclaiming or exceeding the budget.
  [[nodiscard]] std::size_t largest_free_block() const;
  [[nodiscard]] std::size_t budget() const noexcept;
  void set_budget(std::size_t bytes);
  [[nodiscard]] driver& port() const noexcept;

  // ---- residency (swapping; allocator/residency.hpp). No-ops unless options.residency.enabled ----
  // Where the policy reads the future from (the learner); null: no forecast (LRU on the gate's last uses). Once
  // it returns, the previous source is no longer used; a source must outlive the allocator or be replaced.
  void set_forecast_source(forecast_source* source) noexcept;
  // The streams launches may use: moves wait for events recorded on them (the legacy stream is always
  // included, and every stream that allocates is added automatically).
  void set_streams(std::span<const stream_handle> streams);
  void note_stream(stream_handle stream);
  [[nodiscard]] residency_stats residency() const;
  // One round of the migration thread's work (tests with residency_options::thread off drive it by hand).
  void residency_tick();
  // Where the region of the large allocation holding `ptr` lives; none for small blocks and foreign pointers.
  [[nodiscard]] region_residency residency_of(const void* ptr) const;
  // Starts moving the region of the live large allocation holding `ptr` to the host (evict) or back (prefetch)
  // now, as the policy would; the move completes in a later residency_tick(). False when it cannot start (not
  // swappable, already there or moving, pinned, no pages within the budget, swapping inactive). For tests/tools.
  bool request_evict(const void* ptr);
  bool request_prefetch(const void* ptr);

  // Checks every internal invariant (no overlapping blocks, accounting, budget, owner table) and throws
  // layerswap::error describing the first violation. For tests; takes the lock.
  void verify() const;
  // Runs `fn` with the allocator's mutex held, as the migration thread's policy rounds do. For tests of what must
  // not need the mutex (in_arena).
  void with_lock_for_test(const std::function<void()>& fn) const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace layerswap
