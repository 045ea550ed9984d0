// The residency engine: moves swappable regions (large live segments of the caching allocator) between device
// pages and host-located pages, and the policy that decides which to move, from the learner's forecast. See
// residency.cpp for the algorithm and its notes. The allocator owns the engine and calls it with its own mutex
// held (the *_locked methods); the engine's migration thread takes that same mutex, so there is one lock. The
// migration thread makes a remap's driver calls without it (Note [Remaps outside the lock]): a *_locked method
// that acts on a region being remapped waits for the remap, releasing the mutex meanwhile.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "allocator/forecast.hpp"
#include "allocator/region_map.hpp"
#include "runtime/config.hpp"
#include "runtime/driver.hpp"

namespace layerswap {

// LAYERSWAP_PIN: regions kept on the device, never evicted. Groups count in the order of their first use in a
// step (the learner's forecast): `first` groups from the start of the step, `last` from its end; or `bytes`
// worth of groups from the start of the step. All zero: nothing pinned.
struct pin_setting {
  std::uint32_t first = 0;
  std::uint32_t last = 0;
  std::size_t bytes = 0;
  [[nodiscard]] bool any() const noexcept { return first || last || bytes; }
};

struct residency_options {
  // Run the engine at all (the migration thread starts only when a budget is set too).
  bool enabled = false;
  // Move regions even when no tracker feeds the residency gate (tests that play the tracker themselves).
  // Without a fed gate the engine has no way to know a region is idle, so it moves nothing (Note [No tracker]).
  bool without_tracker = false;
  // Start the migration thread; tests may leave it off and call caching_allocator::residency_tick().
  bool thread = true;
  // LAYERSWAP_PREFETCH: regions of the forecast prefetched ahead (from the front); 0 = auto (budget-bound).
  std::size_t prefetch = 0;
  // LAYERSWAP_PREFETCH=tune: the distance chosen per learned step length from the step times seen (residency.cpp,
  // Note [Tuned prefetch]); `prefetch` is then 0.
  bool prefetch_tune = false;
  pin_setting pin;                                  // LAYERSWAP_PIN
  std::size_t host_limit = 0;                       // LAYERSWAP_HOST_LIMIT: host bytes for backing; 0 = no cap
  // LAYERSWAP_WRITEBACK=skip-clean: skip an eviction's copy when the region's digest proves the host copy current
  // (residency.cpp, Note [Write-back]); needs driver::can_digest().
  bool skip_clean = true;
  // Digest the checks of the evictions a policy round starts with one kernel launch, not one each (residency.cpp,
  // Note [Batched checks]). Not a setting: the unit tests turn it off to compare.
  bool batch_digests = true;
  // LAYERSWAP_CACHE_RESERVE (residency.cpp, Note [Cache reserve]): device bytes the policy leaves to the
  // allocator's cache. Automatic: grown by note_cache_miss_locked(), at most half the policy's room; else fixed.
  bool cache_reserve_auto = false;
  std::size_t cache_reserve = 0;
  // LAYERSWAP_RESERVE: the reserve for memory that cannot move is the step's peak (peak); the peak learned for each
  // 64th of the step, met 64th by 64th, a region's room held from `reserve_ahead` 64ths before its use (follow,
  // residency.cpp, Notes [Following reserve] and [Reserve profile]); or that while the evictions of the last learned
  // step were clean, else the step's peak (automatic, Note [Automatic reserve]).
  reserve_mode reserve = reserve_mode::peak;
  std::uint32_t reserve_ahead = 2;
  // 64ths after a wanted region's next use that its room stays held (residency.cpp, Note [Reserve profile]).
  std::uint32_t reserve_margin = 2;
  std::chrono::microseconds period{200};            // migration thread period
  // How long an idle migration thread sleeps (residency.cpp, Note [Idle engine]); at most `period`: never idle.
  std::chrono::microseconds idle_period{20000};
  // Tests: called inside every remap (between try_begin_remap and end_remap); the allocator mutex is held when
  // the remap is made by settling or a synchronous eviction, not when the migration thread's tick() makes it.
  std::function<void(region_id)> remap_hook;
  // Tests: the clock the prefetch tuner times steps with, in ns (default: std::chrono::steady_clock).
  std::function<std::uint64_t()> tune_clock;
  // Tests: called when the gate refuses a remap (the move is then abandoned), after a prefetch's holds are released;
  // without the mutex when the migration thread's tick() made the attempt.
  std::function<void(region_id)> refused_hook;
};

struct residency_stats {
  std::int64_t bytes_h2d = 0;          // bytes copied host -> device by completed prefetches
  std::int64_t bytes_d2h = 0;          // bytes copied device -> host by completed evictions
  std::int64_t evictions = 0;          // completed evictions (background and synchronous)
  std::int64_t prefetches = 0;         // completed prefetches
  std::int64_t abandoned = 0;          // moves abandoned because a launch touched the region meanwhile
  std::int64_t cancelled = 0;          // moves cancelled because the region was freed
  std::int64_t stall_evictions = 0;    // synchronous evictions on the allocation path (host waits)
  std::int64_t writeback_skipped = 0;  // evictions that skipped the copy: the region was clean (Note [Write-back])
  std::int64_t digests_carried = 0;    // prefetches that kept the region's digest (Note [Digest carried over])
  std::int64_t writeback_checked = 0;  // evictions that digested the region to find out (clean or not)
  std::int64_t host_bytes = 0;         // host-located bytes in existence (backing + pooled)
  std::int64_t regions_swappable = 0;  // live large regions known to the engine
  std::int64_t regions_resident = 0;   // ... of which backed by device pages (resident or moving out)
  std::int64_t regions_on_host = 0;    // ... of which backed by host pages (on host or moving in)
  std::int64_t moves_in_flight = 0;
  std::uint64_t launches_counted = 0;  // launches with regions issued while the engine ran (process-wide)
  std::uint64_t launches_missed = 0;   // ... of which touched a region backed by host pages
  std::uint64_t launch_waits = 0;      // launches that waited for a prefetch to land (process-wide)
  std::uint64_t launch_wait_us = 0;    // ... the time they waited in all (the stall time of launches)
  std::uint64_t launch_wait_timeouts = 0;  // ... of which gave up and ran on the host copy
  std::uint64_t launch_holds = 0;      // launches held on the GPU for a prefetch instead (process-wide)
  std::uint64_t launch_remap_waits = 0;     // launches that waited for a remap of a region they touch to end
  std::uint64_t launch_remap_wait_us = 0;   // ... and the time they waited (process-wide)
  std::int64_t policy_rounds = 0;      // policy rounds run (Note [Policy rounds])
  std::int64_t policy_us = 0;          // ... and the time they held the allocator mutex
  std::int64_t maintain_us = 0;        // ... of which the allocator's housekeeping (fences, pending frees, retiring)
  std::int64_t room_us = 0;            // ... of which finding prefetches a chunk (spares released, cache reclaimed)
  std::int64_t idle_sleeps = 0;        // long sleeps of an idle migration thread (Note [Idle engine])
  std::int64_t remap_us = 0;           // time in the driver calls of remaps and prefetch starts (map, unmap, access)
  std::int64_t stage_us = 0;           // ... of which prefetch starts (staging VA mapped, copy enqueued)
  std::int64_t remap_in_us = 0;        // ... of which remaps to the device
  std::int64_t remap_out_us = 0;       // ... of which remaps to the host
  std::int64_t chunks_created = 0;     // device chunks created (Note [Chunks] in residency.cpp)
  std::int64_t chunks_released = 0;    // ... and released (to make room for other sizes, or to the allocator)
  std::int64_t chunks_for_segments = 0;      // ... of the created: for new large segments (take_chunk_locked)
  std::int64_t chunks_released_for_size = 0; // ... of the released: spares that made room for a chunk of another size
  std::int64_t chunks_released_for_pages = 0;  // ... spares released for the allocator (release_spare_locked)
  std::int64_t spare_bytes = 0;        // device bytes in spare chunks now
  std::int64_t cache_reserve_bytes = 0;  // the cache reserve the last policy round left (Note [Cache reserve])
  std::int64_t reserve_bytes = 0;        // the reserve for memory that cannot move the last policy round left
  std::int64_t reserve_followed = 0;     // policy rounds whose reserve followed the step (Note [Following reserve])
  std::int64_t reserve_auto_changes = 0;  // LAYERSWAP_RESERVE=auto turning following on or off (Note [Automatic reserve])
  std::int64_t cache_misses = 0;       // allocations that destroyed a cached segment for want of their size
  // LAYERSWAP_PREFETCH=tune (Note [Tuned prefetch] in residency.cpp): the distance in force (regions; 0: auto, or no
  // learned step), the tunings finished, the steps tunings timed (finished or not), and the tunings abandoned for
  // another step length.
  std::int64_t prefetch_limit = 0;
  std::int64_t prefetch_tunings = 0;
  std::int64_t prefetch_tune_steps = 0;
  std::int64_t prefetch_tune_abandoned = 0;
  // Note [Late prefetches] in residency.cpp: prefetches a launch waited for, their bytes, how long after its
  // begin the first launch began waiting (summed), and that wait split: until the copy was seen complete, and
  // from then until the remap ended; the waits summed by the eighth of the learned step they happened in.
  std::int64_t late_prefetches = 0;
  std::int64_t late_bytes = 0;
  std::int64_t late_lead_us = 0;
  std::int64_t late_copy_wait_us = 0;
  std::int64_t late_remap_wait_us = 0;
  std::array<std::int64_t, 8> late_wait_us_by_phase{};
  std::array<std::int64_t, 8> transient_peak_by_phase{};  // bytes: the transient peak seen in each eighth
  // remap_us by the eighth of the learned step the policy's last forecast was made in: where in the step the
  // migration thread's driver calls fall (without a learned step, all in the first).
  std::array<std::int64_t, 8> remap_us_by_phase{};
  // Bytes moved by the eighth of the learned step their move ended in (the policy's last forecast, as above): where
  // the evictions (host mappings, the dear remaps) and the prefetches fall.
  std::array<std::int64_t, 8> evicted_bytes_by_phase{};
  std::array<std::int64_t, 8> prefetched_bytes_by_phase{};
  bool active = false;                 // whether the engine moves regions (a fed gate or without_tracker)
};

enum class region_residency : std::uint8_t { none, device, host, moving_in, moving_out };

namespace detail {

// One physical allocation of device memory backing a whole large segment (residency.cpp, Note [Chunks]), and the
// VA of its own where it is also mapped once a prefetch has copied into it (0: none yet).
struct device_chunk {
  phys_handle handle = 0;
  device_ptr home = 0;
  explicit operator bool() const noexcept { return handle != 0; }
};

// What the engine needs from the allocator. Called with the allocator mutex held.
class page_source {
 public:
  virtual ~page_source() = default;
  // `n` device pages within the budget (pooled ones first), all or none; never reclaims or evicts.
  virtual bool take_pages(std::size_t n, std::vector<phys_handle>& out) = 0;
  // Unmapped pages with no pending work, back to the allocator's pool (still counted as held).
  virtual void give_pages(std::vector<phys_handle>& pages) = 0;
  // Room in the budget for `n` pages' worth of device memory the engine creates itself (a chunk: residency.cpp,
  // Note [Chunks]), counted as held from now on. Releases pooled pages as needed; never reclaims or evicts. False
  // (nothing changed) when the budget has no such room; always true without a budget (create() then says whether
  // the device has room).
  virtual bool take_room(std::size_t n) = 0;
  // The engine released `n` pages' worth of its own device memory (or never created what take_room made room for).
  virtual void give_room(std::size_t n) = 0;
  [[nodiscard]] virtual std::size_t budget() const = 0;
  [[nodiscard]] virtual std::size_t held_bytes() const = 0;    // device bytes held (mapped + pooled + in moves)
  [[nodiscard]] virtual std::size_t pooled_bytes() const = 0;  // unmapped pooled pages
  // Device bytes in the allocator's cache: idle segments (freed, still mapped), which reclaim_idle() can free.
  [[nodiscard]] virtual std::size_t idle_bytes() const = 0;
  // Returns idle segments to the page pool (a chunk-backed one's chunk to the engine's spares), least recently
  // freed first, until `n` pages can be had (pooled pages, spare chunks, the budget's headroom), without a host
  // wait: only segments whose streams' work is known complete; for the others an event is recorded so that a later
  // call can take them.
  virtual void reclaim_idle(std::size_t n) = 0;
  // Destroys one idle segment whose chunk is exactly `bytes` (a region's own, or a home segment's) and whose stream's
  // work is known complete, so that its chunk becomes a spare of that size (residency.cpp, Note [Following
  // reserve]). False: none.
  virtual bool reclaim_idle_sized(std::size_t /*bytes*/) { return false; }
  // Housekeeping the allocator does from the migration thread (retiring freed host-backed segments).
  virtual void maintain() = 0;
  // A VA range of `bytes` for a chunk's home (caching_allocator.cpp, Note [Home segments]), from the allocator's
  // arena of homes; 0 when it has none (the engine reserves one itself). Called with or without the mutex.
  virtual device_ptr take_home_va(std::size_t bytes) { (void)bytes; return 0; }
  // Gives back a range take_home_va() gave (unmapped); false when `va` is not from there.
  virtual bool give_home_va(device_ptr va, std::size_t bytes) { (void)va; (void)bytes; return false; }
};

struct swap_region;

class residency_engine {
 public:
  residency_engine(driver& port, std::mutex& mutex, page_source& source, residency_options options);
  ~residency_engine();  // stop() first, and remove every region
  residency_engine(const residency_engine&) = delete;
  residency_engine& operator=(const residency_engine&) = delete;

  void start();           // the migration thread (no-op when options.thread is false or already running)
  void stop() noexcept;   // joins it; takes the mutex inside, so call it without the mutex held

  // One round of the migration thread: completes finished moves, then runs the policy. Takes the mutex.
  void tick();
  void wake() noexcept;

  void set_forecast_source(forecast_source* source) noexcept;
  // The engine's D2H and H2D copy streams (registered as internal in the residency gate).
  [[nodiscard]] std::pair<stream_handle, stream_handle> copy_streams() const noexcept;

  // ---- with the allocator mutex held ----
  void set_streams_locked(std::span<const stream_handle> streams);
  void note_stream_locked(stream_handle stream);
  // A large segment was created: `chunk`, from take_chunk_locked(), is mapped at `va` and backs the region while it
  // is on the device; the engine swaps it for host pages and back (Note [Chunks]).
  swap_region* add_locked(region_id id, device_ptr va, std::size_t bytes, device_chunk chunk);
  // A chunk of `bytes` for a new large segment (Note [Chunks]): a spare one of that size, else a new one within the
  // budget (page_source::take_room; spare chunks of other sizes are released to make room). Empty when there is no
  // room now (the caller reclaims or evicts, then asks again) or the device is full.
  device_chunk take_chunk_locked(std::size_t bytes);
  // A chunk from take_chunk_locked() that no segment took (mapping it failed), or from take_homed_spare_locked()
  // whose segment is gone: back to the spares.
  void give_chunk_locked(std::size_t bytes, const device_chunk& chunk);
  // The smallest spare chunk of `lo` to `hi` bytes whose home VA lies in [base, base + span), with its bytes; the
  // allocator makes it a segment at that home (caching_allocator.cpp, Note [Home segments]). Empty: none.
  std::pair<std::size_t, device_chunk> take_homed_spare_locked(std::size_t lo, std::size_t hi, device_ptr base,
                                                               std::size_t span);
  // Spare chunks for a composite of `lo` to `hi` bytes (caching_allocator.cpp, Note [Spare composites]): at most
  // `parts` of them, largest first, that make at least `lo` bytes, or at least `lo - room` bytes (the caller makes
  // the rest from `room` bytes of the budget's headroom). Taken off the pool, with their bytes; empty (none taken)
  // when they cannot make it.
  std::vector<std::pair<std::size_t, device_chunk>> take_spares_locked(std::size_t lo, std::size_t hi,
                                                                       std::size_t parts, std::size_t room);
  void set_live_locked(swap_region* r, bool live);
  // Whether the region is backed by host pages now (on host, or moving in).
  [[nodiscard]] bool host_backed_locked(const swap_region* r) const noexcept;
  [[nodiscard]] bool moving_locked(const swap_region* r) const noexcept;
  // Waits for the region's move (host wait) and completes it.
  void settle_locked(swap_region* r);
  // The segment is being destroyed (no pending work touches it): settles, unmaps a host mapping or a chunk of its VA
  // (returns true then; otherwise the caller unmaps the device pages) and forgets the region.
  bool remove_locked(swap_region* r);
  // The segment's chunk goes to a composite (caching_allocator.cpp, Note [Composites]): forgets a device-backed
  // region that is not moving and returns its chunk, still mapped at the region's VA. The caller unmaps that VA once
  // the GPU is past the region's last launches; the chunk is no longer the engine's (chunk_pages_locked).
  device_chunk detach_locked(swap_region* r);
  // Allocation under pressure (Note [Allocation under pressure]): evicts one region synchronously. False when
  // nothing is left to evict.
  bool evict_sync_locked();
  // An allocation found no cached segment of its size and no room for a new one of `bytes` without destroying
  // cached segments or evicting: grows the automatic cache reserve (Note [Cache reserve]).
  void note_cache_miss_locked(std::size_t bytes);
  // Starts an eviction (or a prefetch) of `r` now; false when it cannot start.
  bool request_locked(swap_region* r, bool to_device);
  // Finishes the prefetches that launches may be held on (host waits for their copies): call before any host wait
  // on the program's streams made with the allocator mutex held (residency.cpp, Note [Holds]).
  void release_holds_locked();
  // Device pages an evict_sync_locked() loop could free.
  [[nodiscard]] std::size_t evictable_pages_locked() const noexcept;
  // Device memory the engine holds itself, in pages (Note [Chunks]): chunks backing regions or pooled ("spare"),
  // not those of prefetches in flight (inflight_pages_locked); and the spare ones alone, which
  // release_spare_locked() gives back to the budget.
  [[nodiscard]] std::size_t chunk_pages_locked() const noexcept;
  [[nodiscard]] std::size_t spare_pages_locked() const noexcept;
  [[nodiscard]] bool has_spare_locked(std::size_t bytes) const noexcept;  // a spare chunk of exactly `bytes`
  // Whether the reserve follows the step (LAYERSWAP_RESERVE=follow, or auto while the evictions are clean:
  // residency.cpp, Notes [Following reserve] and [Automatic reserve]).
  [[nodiscard]] bool follows_step_locked() const noexcept;
  // The bytes of the smallest spare chunk of `lo` to `hi` bytes; 0: none (caching_allocator.cpp, Note [Split spares]).
  [[nodiscard]] std::size_t spare_within_locked(std::size_t lo, std::size_t hi) const noexcept;
  // Releases spare chunks worth at least `pages` pages, or all of them (no host wait: nothing pending touches
  // them). Returns the pages given back.
  std::size_t release_spare_locked(std::size_t pages = SIZE_MAX);
  // Taken by prefetches in flight: their chunks, and spares taken for their room (residency.cpp, Note [Releasing
  // spares outside the lock]).
  [[nodiscard]] std::size_t inflight_pages_locked() const noexcept;
  // The engine's own: the hold flags, and spares whose release failed (residency.cpp).
  [[nodiscard]] std::size_t own_pages_locked() const noexcept;
  [[nodiscard]] region_residency state_locked(const swap_region* r) const noexcept;
  [[nodiscard]] residency_stats stats_locked() const;
  // A line on the engine's memory for debug logs: the step's 64th and reserve, spare chunks by size, moves in flight.
  [[nodiscard]] std::string describe_locked() const;
  // Checks the engine's invariants; returns "" or the first violation.
  [[nodiscard]] std::string verify_locked() const;
  // Settles every move (destructor of the allocator).
  void settle_all_locked();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace detail
}  // namespace layerswap
