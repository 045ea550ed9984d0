// The residency gate: where the launch tracker (profiler/) and the residency engine (allocator/) meet, per
// region, so that a region's backing pages never change under a launch that touches it (DESIGN.md,
// invariants 3 and 4).
//
// The tracker calls enter() for every region a launch touches before the launch is handed to the driver
// (the CUPTI API-enter callback, on the launching thread) and exit() for the same regions once it has been
// enqueued (API exit). The engine, before it remaps a region, calls try_begin_remap() with the use sequence
// it snapshotted when it started the copy: it succeeds only when no launch touching the region is being
// issued and none was issued since the snapshot; launches that arrive during the remap wait in enter()
// until end_remap(). Launches enqueued before the snapshot are the engine's to wait for (an event recorded
// on their streams after the snapshot).
//
// A launch that touches a region whose prefetch is in flight (set_incoming) waits in enter() for the prefetch to
// land before it counts as issuing (Note [Waiting for a prefetch]).
//
//   launching thread                         engine
//   enter(r): issuing += 1                   snapshot s = sequence(r); record events; copy; wait
//             while remapping: wait          try_begin_remap(r, s): remapping = 1;
//   (launch enqueued)                             fails if issuing != 0 or sequence(r) != s
//   exit(r):  sequence += 1, last_use = n    remap; end_remap(r): remapping = 0
//             issuing -= 1
//
// The per-region state lives in a table indexed by region id: fixed-size chunks reached through one
// pointer array, created by prepare() off the hot path (when the allocator creates a region). enter() and
// exit() on an id whose chunk does not exist do nothing. Every function is noexcept and lock-free except
// enter()'s waits: it spins (then yields) while that region is being remapped (tens of µs), and sleeps in short
// slices while its prefetch is in flight (Note [Waiting for a prefetch]).
#pragma once

#include <cstdint>

#include "allocator/region_map.hpp"

namespace layerswap::residency_gate {

// Note [Unknown launches]
//   A launch whose arguments the tracker could not read (no parameter layout, a graph launch) may touch any
//   region. The tracker enters it as k_unknown_region: it waits while any region is being remapped, and every
//   region's sequence() includes the unknown launches' count, so a move that such a launch overlapped is
//   abandoned and no remap starts while one is being issued. Safe, and slow where such launches are frequent:
//   the cure is to decode them.
inline constexpr region_id k_unknown_region = 0xFFFFFFFFu;

// Note [Waiting for a prefetch]
//   A region on the host stays mapped, so a launch may always run on it; but a kernel reading its operands over
//   PCIe (a GEMM re-reads its weight tiles many times) is far slower than the copy that brings the region in, and
//   a launch issued during the prefetch makes the engine abandon it (the copy may be stale). So when the engine
//   has a prefetch of the region in flight, enter() first waits for it to land (or be abandoned), at most
//   k_incoming_wait, and only then counts the launch as issuing. The wait never blocks a remap: the launch is not
//   issuing yet. The engine is woken (set_waiter_wake) so that it completes the move at once instead of at its
//   next period. A wait that reaches the limit (the prefetch stuck behind work that never completes) lets the
//   launch run on the host copy: slow, never wrong.
inline constexpr std::uint64_t k_incoming_wait_us = 200'000;

// Makes sure the table holds `id` (allocates a chunk the first time). Not for the hot path. Thread-safe.
void prepare(region_id id);

// ---- the tracker's side (hot path) ----
// A launch that touches `id` is about to be enqueued: waits while a prefetch of `id` is in flight (Note [Waiting
// for a prefetch]), counts the launch as issuing, waits while `id` is being remapped. Returns whether `id` is
// backed by host pages then (the hit rate).
bool enter(region_id id) noexcept;
// The launch that entered `id` is enqueued: bumps the region's use sequence, stamps its last use.
void exit(region_id id, std::uint64_t launch_no) noexcept;

// Whether a tracker feeds the gate (set by the tracker when it starts and stops). Without one the engine
// must not move regions that launches might touch: it has no way to know they are idle.
void set_fed(bool fed) noexcept;
[[nodiscard]] bool fed() noexcept;

// ---- the engine's side ----
// Launches enqueued so far that touched `id` or may have (unknown launches, Note [Unknown launches]); 0 for an
// id never prepared.
[[nodiscard]] std::uint64_t sequence(region_id id) noexcept;
// Launch number of the last enqueued launch that touched `id` (0 if none).
[[nodiscard]] std::uint64_t last_use(region_id id) noexcept;
// Launches touching `id` between enter() and exit() right now.
[[nodiscard]] std::uint32_t issuing(region_id id) noexcept;
// Starts a remap of `id` if no launch touching it is issuing and its sequence still equals `expected`;
// otherwise changes nothing and returns false. A success must be followed by end_remap(id).
[[nodiscard]] bool try_begin_remap(region_id id, std::uint64_t expected) noexcept;
void end_remap(region_id id) noexcept;
// A prefetch of `id` is in flight (true from its start until it lands or is abandoned).
void set_incoming(region_id id, bool incoming) noexcept;
// Launching threads waiting in enter() for a prefetch right now.
[[nodiscard]] std::uint32_t waiting() noexcept;
// Called (from the launching thread) when a launch starts waiting for a prefetch; null: nobody to wake.
void set_waiter_wake(void (*wake)(void*), void* context) noexcept;
// Clears the waker if `context` is the one set (an engine stopping).
void clear_waiter_wake(void* context) noexcept;
struct wait_counts {
  std::uint64_t waits = 0;  // launches that waited for a prefetch
  std::uint64_t ns = 0;     // total time they waited
  std::uint64_t timeouts = 0;  // ... of which gave up after k_incoming_wait_us
};
[[nodiscard]] wait_counts waits() noexcept;

// ---- persistent regions (the learner keys the step on them) ----
// A large segment (its own region) is persistent until its allocation is first freed: parameters and optimizer
// state stay persistent, activations and gradients (freed every step, their segments reused from the cache
// under the same region id) do not. Slabs never are.
void mark_large(region_id id) noexcept;
void note_freed(region_id id) noexcept;
[[nodiscard]] bool persistent(region_id id) noexcept;

// ---- the engine's own copies ----
// The engine's copy streams: the tracker leaves copies on them out of the gate and the access stream (a move's
// own copy must not count as a use of the region it moves, or every move would be abandoned). At most
// k_max_internal_streams at once; thread-safe; internal_stream() is k_max_internal_streams relaxed loads.
inline constexpr int k_max_internal_streams = 16;
void add_internal_stream(std::uint64_t stream) noexcept;
void remove_internal_stream(std::uint64_t stream) noexcept;  // the engine is gone (its stream destroyed)
[[nodiscard]] bool internal_stream(std::uint64_t stream) noexcept;

// ---- the hit rate (LAYERSWAP_STATS): launches whose regions were all on the device when they were issued ----
// The engine marks the regions whose VA is backed by host pages, and turns counting on while it can move regions.
void set_on_host(region_id id, bool on_host) noexcept;
[[nodiscard]] bool on_host(region_id id) noexcept;
void set_counting(bool counting) noexcept;
[[nodiscard]] bool counting() noexcept;
// The tracker, once per launch that touched at least one region, while counting(): `missed` when one of its
// regions was on the host.
void count_launch(bool missed) noexcept;
struct launch_counts {
  std::uint64_t launches = 0;  // launches with regions, counted while counting() was on
  std::uint64_t missed = 0;    // ... of which touched a region backed by host pages
};
[[nodiscard]] launch_counts counts() noexcept;

}  // namespace layerswap::residency_gate
