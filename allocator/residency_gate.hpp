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
// land before it counts as issuing (Note [Waiting for a prefetch]), unless the tracker can hold it on the GPU
// instead (enter_holding, Note [Holding a launch on the GPU]).
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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

// Note [Holding a launch on the GPU]
//   Waiting in enter() for a prefetch blocks the launching thread, and a training step is usually bound by that
//   thread (PyTorch issues ~5,000 launches per step for a 1B model; the GPU idles between them): every wait adds to
//   the step. Instead, once a prefetch's copy is enqueued the engine publishes a *hold* for the region: a 32-bit
//   flag in device memory and a ticket value. A launch touching the region enters with enter_holding(): it takes
//   the hold and does not wait; the tracker enqueues a stream wait "flag >= ticket" (cuStreamWaitValue32) on the
//   launch's stream before the launch. The engine writes the ticket into the flag (on a stream of its own) only
//   after the prefetch has ended: remapped to the device pages, or abandoned with the VA still on the host copy.
//   So a held launch runs after the remap whatever the timing, the launching thread goes on at once, and the GPU
//   waits only if the copy is really late. Off unless LAYERSWAP_HOLD=1: on the H100 Llama LoRA benchmark at 25%
//   it made steps slower (0.45 s against 0.37 s), the launching thread running ahead of the GPU by more than the
//   budget holds, while the policy plans from the launching thread's position.
//   Held launches do not invalidate their prefetch: they cannot run before the remap, so the copy they would race
//   with is already done. They count apart (held_issuing, held_sequence), and the prefetch's remap checks only
//   the others (try_begin_remap with `held_ok`). For every other purpose (the next eviction's snapshot and remap,
//   "untouched since its eviction") they are ordinary uses.
//   Deadlock: a held launch blocks its stream until the engine finishes the prefetch. Nothing the prefetch needs
//   waits on the program's streams after the hold (its fences were recorded before the hold was published), but a
//   host wait on a program stream with the allocator mutex held would block the migration thread that must remap:
//   the allocator first finishes the prefetches with published holds (residency_engine::release_holds_locked).
//   A hold is published only after the move's fences are recorded, so no fence can wait for a launch held on it.
struct hold {
  std::uint64_t flag = 0;   // device address of the 32-bit flag; 0: no hold
  std::uint32_t value = 0;  // run once *flag >= value
  region_id region = 0;
};
enum class entry_state : std::uint8_t { device, host, held };

// Makes sure the table holds `id` (allocates a chunk the first time). Not for the hot path. Thread-safe.
void prepare(region_id id);

// ---- the tracker's side (hot path) ----
// A launch that touches `id` is about to be enqueued: waits while a prefetch of `id` is in flight (Note [Waiting
// for a prefetch]), counts the launch as issuing, waits while `id` is being remapped. Returns whether `id` is
// backed by host pages then (the hit rate).
bool enter(region_id id) noexcept;
// The launch that entered `id` is enqueued: bumps the region's use sequence, stamps its last use.
void exit(region_id id, std::uint64_t launch_no) noexcept;
// enter() for a tracker that can hold launches on the GPU (Note [Holding a launch on the GPU]): when the region's
// prefetch has published a hold and holding is on (set_holding), fills `out` and returns held without waiting;
// the tracker must then enqueue the stream wait before the launch and exit with exit_held(). Otherwise as enter().
entry_state enter_holding(region_id id, hold& out) noexcept;
void exit_held(region_id id, std::uint64_t launch_no) noexcept;
// The tracker could not enqueue a hold's stream wait: waits on the host until the prefetch has ended (the hold is
// retracted after the remap), as long as it takes: the launch is already entered as held.
void wait_hold_on_host(const hold& h) noexcept;
// Whether the tracker can enqueue the stream waits of holds (it found cuStreamWaitValue32). Off by default.
void set_holding(bool on) noexcept;
[[nodiscard]] bool holding() noexcept;

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
// ... of which were held on a prefetch (Note [Holding a launch on the GPU]).
[[nodiscard]] std::uint64_t held_sequence(region_id id) noexcept;
// Starts a remap of `id` if no launch touching it is issuing and its sequence still equals `expected`;
// otherwise changes nothing and returns false. A success must be followed by end_remap(id). With `held_ok` (a
// prefetch's remap), held launches are left out of both: `expected` is then sequence - held_sequence at the
// snapshot.
[[nodiscard]] bool try_begin_remap(region_id id, std::uint64_t expected, bool held_ok = false) noexcept;
void end_remap(region_id id) noexcept;
// A prefetch of `id` is in flight (true from its start until it lands or is abandoned).
void set_incoming(region_id id, bool incoming) noexcept;
// When the first launch began waiting for the prefetch of `id` (fast_clock::steady_ns()),
// and forgets it; 0 when none waited since the prefetch started. The engine's late-prefetch statistics.
[[nodiscard]] std::uint64_t take_wait_start(region_id id) noexcept;
// Whether a launch began waiting for the prefetch of `id` in flight (take_wait_start() would be non-zero), without
// forgetting it.
[[nodiscard]] bool waited_for(region_id id) noexcept;
// The prefetch of `id` has enqueued its copy: launches may hold on `h` from now on (Note [Holding a launch on the
// GPU]). retract_hold() ends that and returns the value published (0: none), which the engine must then write
// into the flag once the prefetch has ended.
void publish_hold(region_id id, hold h) noexcept;
std::uint32_t retract_hold(region_id id) noexcept;
// Launching threads waiting in enter() for a prefetch right now.
[[nodiscard]] std::uint32_t waiting() noexcept;
// Called (from the launching thread) when a launch starts waiting for a prefetch; null: nobody to wake.
void set_waiter_wake(void (*wake)(void*), void* context) noexcept;
// Clears the waker if `context` is the one set (an engine stopping).
void clear_waiter_wake(void* context) noexcept;
// Note [Idle engine] (residency.cpp): the engine says it sleeps long (true) or polls again (false). While it
// sleeps, the next counted launch (count_launch) or nudge() calls the waker set above, once. set_engine_asleep is
// sequentially consistent, like count_launch's count: an engine that marks itself asleep and then finds the count
// unchanged will be woken by any launch counted after that.
void set_engine_asleep(bool asleep) noexcept;
// From a program thread (a free): wakes an engine asleep; one relaxed load when none is.
void nudge() noexcept;
struct wait_counts {
  std::uint64_t waits = 0;  // launches that waited for a prefetch
  std::uint64_t ns = 0;     // total time they waited
  std::uint64_t timeouts = 0;  // ... of which gave up after k_incoming_wait_us
  std::uint64_t holds = 0;     // launches held on the GPU instead (Note [Holding a launch on the GPU])
  std::uint64_t remap_waits = 0;  // launches that waited in enter() for a remap of their region (any region:
                                  // unknown launches) to end
  std::uint64_t remap_ns = 0;     // ... and the time they waited
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
// The engine's copy streams: the tracker leaves copies and kernels (the digests of residency.cpp's Note
// [Write-back]) on them out of the gate and the access stream (a move's own copy must not count as a use of the
// region it moves, or every move would be abandoned). At most
// k_max_internal_streams at once; thread-safe; internal_stream() is k_max_internal_streams relaxed loads.
inline constexpr int k_max_internal_streams = 16;
void add_internal_stream(std::uint64_t stream) noexcept;
void remove_internal_stream(std::uint64_t stream) noexcept;  // the engine is gone (its stream destroyed)
[[nodiscard]] bool internal_stream(std::uint64_t stream) noexcept;

// ---- the program's streams (Note [Launch streams]) ----
// Note [Launch streams]
//   A move's copy waits for what was enqueued before its snapshot on every stream launches may use (residency.cpp,
//   Note [Shadow copies]). The allocator knows the streams it allocates on and the legacy stream; a stream the
//   program launches on without allocating on it is known only from its launches: NCCL's under
//   DistributedDataParallel (its all-reduces read and write gradient buckets allocated on the compute stream), or a
//   side stream working on tensors from another. Unfenced, a kernel still running there could write a region while
//   its eviction copies it, or run across its remap (DESIGN.md invariants 3 and 4).
//   So the tracker notes the stream of every launch (once per thread and stream: a compare per launch) with the
//   launch's context, at the launch's API-enter callback, before its API exit ends its issue in the gate; the
//   engine reads the table at each fence, after its snapshot of the region's sequence. A launch whose exit the
//   snapshot counted has its stream in the table; one it did not count is still issuing or comes later, and the
//   remap refuses it anyway (Note [Gate handshake]). A stream is forgotten when the program destroys it (the
//   tracker's callback on cuStreamDestroy runs before the driver destroys it) and when the tracker stops; a fence
//   being recorded on it finishes first. CUDA's special handles (the legacy and per-thread default streams) are
//   not noted: the engine fences the legacy stream, which waits for every blocking stream.
inline constexpr std::size_t k_max_streams = 1024;
// The tracker: a launch on `stream` (nonzero) in `context`. A full table is logged once; its streams go unfenced.
void note_stream(std::uint64_t stream, std::uint64_t context) noexcept;
// The tracker: `stream` is about to be destroyed (returns once no fence is being recorded on it).
void forget_stream(std::uint64_t stream) noexcept;
// ... every stream (the tracker stops: no launch is seen until it starts again).
void forget_streams() noexcept;
// Changes whenever a stream is forgotten: a tracker thread that remembers having noted a stream notes it again.
[[nodiscard]] std::uint64_t streams_epoch() noexcept;
// The engine: calls visit(arg, stream) for every noted stream of `context`; a stream being forgotten meanwhile
// is destroyed only after its visit returns. An exception from visit propagates.
void visit_streams(std::uint64_t context, void (*visit)(void*, std::uint64_t), void* arg);
template <class F>
void for_each_stream(std::uint64_t context, F&& f) {
  visit_streams(context, [](void* a, std::uint64_t s) { (*static_cast<std::remove_reference_t<F>*>(a))(s); },
                static_cast<void*>(&f));
}
// ... those not among `known` (stream handles: the fences the caller records on its own streams), as handles.
template <class Handles, class F>
void for_each_stream_besides(std::uint64_t context, const Handles& known, F&& f) {
  for_each_stream(context, [&](std::uint64_t id) {
    const auto s = reinterpret_cast<typename Handles::value_type>(id);
    if (std::find(known.begin(), known.end(), s) == known.end()) f(s);
  });
}

// ---- the hit rate (LAYERSWAP_STATS): launches whose regions were all on the device when they were issued ----
// The engine marks the regions whose VA is backed by host pages, and turns counting on while it can move regions.
void set_on_host(region_id id, bool on_host) noexcept;
[[nodiscard]] bool on_host(region_id id) noexcept;
void set_counting(bool counting) noexcept;
[[nodiscard]] bool counting() noexcept;
// The tracker, once per launch that touched at least one region, while counting(): `missed` when one of its
// regions was on the host. Wakes an engine asleep (Note [Idle engine]).
void count_launch(bool missed) noexcept;
struct launch_counts {
  std::uint64_t launches = 0;  // launches with regions, counted while counting() was on
  std::uint64_t missed = 0;    // ... of which touched a region backed by host pages
};
[[nodiscard]] launch_counts counts() noexcept;

}  // namespace layerswap::residency_gate
