// The residency gate (allocator/residency_gate.hpp): per-region counters shared by the launch tracker and the
// residency engine.
//
// Note [Gate handshake]
//   enter() increments `issuing`, then waits while `remapping` is set. try_begin_remap() sets `remapping`, then
//   reads `issuing` and `sequence`. Both sides use sequentially consistent operations, so in the single total
//   order at least one of them sees the other's write: either the engine sees issuing != 0 (and gives up,
//   clearing `remapping`), or the launcher sees remapping == 1 (and waits for end_remap()). exit() bumps
//   `sequence` before it decrements `issuing`, so an engine that sees issuing == 0 after a launch also sees
//   that launch's sequence bump and fails the `expected` comparison.
//
// Table: region ids are small and dense (region_map::next_region_id()), so the state lives in chunks of
// k_chunk entries reached through a fixed array of chunk pointers (k_max_chunks of them). A chunk is created
// by prepare() and never freed (one cache line per region id: 256 KiB per 4096 ids), so the hot path is two loads.
#include "allocator/residency_gate.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "runtime/fast_clock.hpp"
#include "runtime/log.hpp"
#include "runtime/spin.hpp"
#include "runtime/stats.hpp"

namespace layerswap::residency_gate {
namespace {

constexpr std::size_t k_chunk_shift = 12;
constexpr std::size_t k_chunk = std::size_t{1} << k_chunk_shift;  // entries per chunk
constexpr std::size_t k_max_chunks = std::size_t{1} << 16;         // 2^28 regions

// One cache line per region: a launch entering and exiting a region touches that line only.
struct alignas(64) entry {
  std::atomic<std::uint32_t> issuing{0};
  std::atomic<std::uint32_t> remapping{0};
  std::atomic<std::uint64_t> sequence{0};
  std::atomic<std::uint64_t> last_use{0};
  std::atomic<std::uint8_t> on_host{0};   // the VA is backed by host pages
  std::atomic<std::uint8_t> incoming{0};  // a prefetch is in flight (Note [Waiting for a prefetch])
  std::atomic<std::uint8_t> large{0};    // a large segment's region (mark_large)
  std::atomic<std::uint8_t> freed{0};    // its allocation was freed at least once (note_freed)
  // Note [Holding a launch on the GPU]: the published hold (value 0: none), and the held launches' counters.
  std::atomic<std::uint32_t> hold_value{0};
  std::atomic<std::uint64_t> hold_flag{0};
  std::atomic<std::uint32_t> held_issuing{0};
  std::atomic<std::uint64_t> held_sequence{0};
  // Steady-clock ns when the first launch began waiting for the prefetch in flight (0: none; take_wait_start).
  std::atomic<std::uint64_t> wait_start{0};
};

static_assert(sizeof(entry) == 64);

struct chunk {
  entry entries[k_chunk];
};

std::atomic<chunk*> g_chunks[k_max_chunks];
std::mutex g_prepare_mutex;
entry g_unknown;                          // launches that may touch any region (Note [Unknown launches])
// The globals a launch reads or writes sit on lines of their own, apart from those the migration thread writes
// (g_remapping at every remap, g_waiting per wait): a launch then misses on none of them after a remap.
alignas(64) std::atomic<std::uint32_t> g_remapping{0};  // remaps in progress, all regions
alignas(64) std::atomic<bool> g_fed{false};
std::atomic<bool> g_counting{false};
std::atomic<std::uint64_t> g_internal[k_max_internal_streams];  // 0 = free slot
alignas(64) std::atomic<std::uint64_t> g_counted{0};
std::atomic<std::uint64_t> g_missed{0};
// On the counted launches' line: a launch reads it where it writes (Note [Idle engine]).
std::atomic<bool> g_asleep{false};
alignas(64) std::atomic<std::uint32_t> g_waiting{0};
std::atomic<std::uint64_t> g_waits{0};
std::atomic<std::uint64_t> g_wait_ns{0};
std::atomic<std::uint64_t> g_wait_timeouts{0};
std::atomic<std::uint64_t> g_remap_waits{0};    // launches that found their region (or, unknown, any) remapping
std::atomic<std::uint64_t> g_remap_wait_ns{0};  // ... and the time they spun for it
std::atomic<std::uint64_t> g_holds{0};
std::atomic<bool> g_holding{false};
std::mutex g_wake_mutex;  // guards the pair below (set rarely; read once per wait, off the fast path)
void (*g_wake)(void*) = nullptr;
void* g_wake_context = nullptr;

// Calls the waker set_waiter_wake() installed, if any: a launch began waiting, or an engine asleep is nudged.
void wake_engine() noexcept {
  std::lock_guard lock(g_wake_mutex);
  if (g_wake) g_wake(g_wake_context);
}

// Note [Waiting for a prefetch]: sleeps in short slices until the prefetch of `e` lands or the limit passes, or,
// with `until_hold`, until it publishes a hold (Note [Holding a launch on the GPU]).
void wait_incoming(entry& e, bool until_hold = false) noexcept {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  std::uint64_t none = 0;
  e.wait_start.compare_exchange_strong(none, fast_clock::steady_ns() | 1, std::memory_order_relaxed);  // never 0
  g_waiting.fetch_add(1);
  wake_engine();
  bool timed_out = false;
  for (unsigned spins = 0; e.incoming.load() != 0 && !(until_hold && e.hold_value.load() != 0); ++spins) {
    if (spins < 64) continue;
    if (clock::now() - start > std::chrono::microseconds(k_incoming_wait_us)) {
      timed_out = true;
      break;
    }
    if (spins < 256) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(5));
  }
  g_waiting.fetch_sub(1);
  g_waits.fetch_add(1, std::memory_order_relaxed);
  if (timed_out) g_wait_timeouts.fetch_add(1, std::memory_order_relaxed);
  g_wait_ns.fetch_add(static_cast<std::uint64_t>(elapsed_ns(start)), std::memory_order_relaxed);
}

entry* find(region_id id) noexcept {
  if (id == k_unknown_region) return &g_unknown;
  const std::size_t c = id >> k_chunk_shift;
  if (id == 0 || c >= k_max_chunks) return nullptr;
  chunk* ch = g_chunks[c].load(std::memory_order_acquire);
  return ch ? &ch->entries[id & (k_chunk - 1)] : nullptr;
}

}  // namespace

void prepare(region_id id) {
  const std::size_t c = id >> k_chunk_shift;
  if (id == 0 || c >= k_max_chunks) return;
  if (g_chunks[c].load(std::memory_order_acquire)) return;
  std::lock_guard lock(g_prepare_mutex);
  if (g_chunks[c].load(std::memory_order_relaxed)) return;
  g_chunks[c].store(new chunk(), std::memory_order_release);  // never freed (see the file comment)
}

bool enter(region_id id) noexcept {
  entry* e = find(id);
  if (!e) return false;
  if (e->incoming.load(std::memory_order_relaxed) != 0) wait_incoming(*e);
  e->issuing.fetch_add(1);  // seq_cst: Note [Gate handshake]
  // An unknown launch waits for every remap in progress; a known one for its region's.
  std::atomic<std::uint32_t>& flag = e == &g_unknown ? g_remapping : e->remapping;
  if (flag.load() != 0) {  // rare: timed, off the fast path
    const std::uint64_t start = fast_clock::steady_ns();
    for (unsigned spins = 0; flag.load() != 0; ++spins) {
      if (spins >= 64) std::this_thread::yield();
    }
    g_remap_waits.fetch_add(1, std::memory_order_relaxed);
    g_remap_wait_ns.fetch_add(fast_clock::steady_ns() - start, std::memory_order_relaxed);
  }
  return e->on_host.load(std::memory_order_relaxed) != 0;
}

void exit(region_id id, std::uint64_t launch_no) noexcept {
  entry* e = find(id);
  if (!e) return;
  e->sequence.fetch_add(1);
  e->last_use.store(launch_no, std::memory_order_release);  // a hint for the policy's ties (no fence needed)
  e->issuing.fetch_sub(1);
}

// Note [Held counters]
//   A held launch counts in both issuing and held_issuing, and bumps both sequence and held_sequence. Its
//   held_* counter rises first and falls last, and the engine reads the plain counter first: it may then see
//   more held than plain (clamped: no ordinary launch) or one ordinary launch too many (a refused remap, an
//   abandoned move: safe), never miss an ordinary one.
entry_state enter_holding(region_id id, hold& out) noexcept {
  entry* e = find(id);
  if (!e) return entry_state::device;
  if (e == &g_unknown || !g_holding.load(std::memory_order_relaxed) || e->incoming.load(std::memory_order_relaxed) == 0) {
    return enter(id) ? entry_state::host : entry_state::device;
  }
  if (e->hold_value.load() == 0) wait_incoming(*e, true);  // the copy is about to start: wait for its hold
  e->held_issuing.fetch_add(1);
  e->issuing.fetch_add(1);  // seq_cst: Note [Gate handshake]
  const std::uint32_t value = e->hold_value.load();
  if (value != 0) {
    // The prefetch has not ended (the engine retracts the hold before it writes the flag), so the only remap of
    // this region that can be in progress is the prefetch's own: the held launch runs after it anyway.
    out.flag = e->hold_flag.load();
    out.value = value;
    out.region = id;
    g_holds.fetch_add(1, std::memory_order_relaxed);
    return entry_state::held;
  }
  // The prefetch ended meanwhile: an ordinary launch (Note [Gate handshake]).
  e->issuing.fetch_sub(1);
  e->held_issuing.fetch_sub(1);
  return enter(id) ? entry_state::host : entry_state::device;
}

void exit_held(region_id id, std::uint64_t launch_no) noexcept {
  entry* e = find(id);
  if (!e) return;
  e->held_sequence.fetch_add(1);
  e->sequence.fetch_add(1);
  e->last_use.store(launch_no, std::memory_order_release);
  e->issuing.fetch_sub(1);
  e->held_issuing.fetch_sub(1);
}

void wait_hold_on_host(const hold& h) noexcept {
  entry* e = find(h.region);
  if (!e || e == &g_unknown) return;
  for (unsigned spins = 0; e->hold_value.load() == h.value; ++spins) {
    if (spins < 256) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void set_holding(bool on) noexcept { g_holding.store(on); }
bool holding() noexcept { return g_holding.load(); }

void publish_hold(region_id id, hold h) noexcept {
  entry* e = find(id);
  if (!e || e == &g_unknown || h.flag == 0 || h.value == 0) return;
  e->hold_flag.store(h.flag);
  e->hold_value.store(h.value);
}

std::uint32_t retract_hold(region_id id) noexcept {
  entry* e = find(id);
  if (!e || e == &g_unknown) return 0;
  return e->hold_value.exchange(0);
}

std::uint64_t held_sequence(region_id id) noexcept {
  const entry* e = find(id);
  return e && e != &g_unknown ? e->held_sequence.load() : 0;
}

void set_fed(bool fed) noexcept { g_fed.store(fed); }
bool fed() noexcept { return g_fed.load(); }

std::uint64_t sequence(region_id id) noexcept {
  const entry* e = find(id);
  if (!e || e == &g_unknown) return 0;
  return e->sequence.load() + g_unknown.sequence.load();  // Note [Unknown launches]
}

std::uint64_t last_use(region_id id) noexcept {
  const entry* e = find(id);
  return e ? e->last_use.load() : 0;
}

std::uint32_t issuing(region_id id) noexcept {
  const entry* e = find(id);
  return e ? e->issuing.load() : 0;
}

bool try_begin_remap(region_id id, std::uint64_t expected, bool held_ok) noexcept {
  entry* e = find(id);
  if (!e || e == &g_unknown) return false;  // never prepared: no way to exclude launches
  e->remapping.store(1);
  g_remapping.fetch_add(1);
  // Note [Held counters]: the plain counters first.
  std::uint64_t issuing = e->issuing.load();
  std::uint64_t seq = e->sequence.load() + g_unknown.sequence.load();
  if (held_ok) {
    const std::uint64_t held = e->held_issuing.load();
    issuing = issuing > held ? issuing - held : 0;
    seq -= std::min(seq, e->held_sequence.load());
  }
  if (issuing != 0 || g_unknown.issuing.load() != 0 || seq != expected) {
    g_remapping.fetch_sub(1);
    e->remapping.store(0);
    return false;
  }
  return true;
}

void end_remap(region_id id) noexcept {
  entry* e = find(id);
  if (!e || e == &g_unknown) return;
  g_remapping.fetch_sub(1);
  e->remapping.store(0);
}

void set_incoming(region_id id, bool incoming) noexcept {
  entry* e = find(id);
  if (!e || e == &g_unknown) return;
  if (incoming) e->wait_start.store(0, std::memory_order_relaxed);
  e->incoming.store(incoming ? 1 : 0);
}

std::uint64_t take_wait_start(region_id id) noexcept {
  entry* e = find(id);
  return e && e != &g_unknown ? e->wait_start.exchange(0, std::memory_order_relaxed) : 0;
}

bool waited_for(region_id id) noexcept {
  entry* e = find(id);
  return e && e != &g_unknown && e->wait_start.load(std::memory_order_relaxed) != 0;
}

std::uint32_t waiting() noexcept { return g_waiting.load(std::memory_order_relaxed); }

void set_waiter_wake(void (*wake)(void*), void* context) noexcept {
  std::lock_guard lock(g_wake_mutex);
  g_wake = wake;
  g_wake_context = context;
}

void set_engine_asleep(bool asleep) noexcept { g_asleep.store(asleep); }

void nudge() noexcept {
  if (!g_asleep.load(std::memory_order_relaxed) || !g_asleep.exchange(false)) return;
  wake_engine();
}

void clear_waiter_wake(void* context) noexcept {
  std::lock_guard lock(g_wake_mutex);
  if (g_wake_context != context) return;
  g_wake = nullptr;
  g_wake_context = nullptr;
}

wait_counts waits() noexcept {
  return {g_waits.load(std::memory_order_relaxed), g_wait_ns.load(std::memory_order_relaxed),
          g_wait_timeouts.load(std::memory_order_relaxed), g_holds.load(std::memory_order_relaxed),
          g_remap_waits.load(std::memory_order_relaxed), g_remap_wait_ns.load(std::memory_order_relaxed)};
}

void mark_large(region_id id) noexcept {
  if (entry* e = find(id); e && e != &g_unknown) e->large.store(1, std::memory_order_relaxed);
}

void note_freed(region_id id) noexcept {
  if (entry* e = find(id); e && e != &g_unknown) e->freed.store(1, std::memory_order_relaxed);
}

bool persistent(region_id id) noexcept {
  const entry* e = find(id);
  return e && e != &g_unknown && e->large.load(std::memory_order_relaxed) != 0 &&
         e->freed.load(std::memory_order_relaxed) == 0;
}

void add_internal_stream(std::uint64_t stream) noexcept {
  if (stream == 0) return;  // the legacy stream is the program's
  for (auto& slot : g_internal) {
    std::uint64_t empty = 0;
    if (slot.compare_exchange_strong(empty, stream)) return;
  }
  // More engines than slots: their copies count as uses (their moves are abandoned, never unsafe).
}

void remove_internal_stream(std::uint64_t stream) noexcept {
  if (stream == 0) return;
  for (auto& slot : g_internal) {
    std::uint64_t expected = stream;
    if (slot.compare_exchange_strong(expected, 0)) return;
  }
}

bool internal_stream(std::uint64_t stream) noexcept {
  if (stream == 0) return false;  // empty slots hold 0; the legacy stream is always the program's
  for (const auto& slot : g_internal) {
    if (slot.load(std::memory_order_relaxed) == stream) return true;
  }
  return false;
}

void set_on_host(region_id id, bool host) noexcept {
  if (entry* e = find(id)) e->on_host.store(host ? 1 : 0, std::memory_order_relaxed);
}

bool on_host(region_id id) noexcept {
  const entry* e = find(id);
  return e && e->on_host.load(std::memory_order_relaxed) != 0;
}

void set_counting(bool counting) noexcept { g_counting.store(counting, std::memory_order_relaxed); }
bool counting() noexcept { return g_counting.load(std::memory_order_relaxed); }

void count_launch(bool missed) noexcept {
  g_counted.fetch_add(1);  // seq_cst, against set_engine_asleep's store (Note [Idle engine])
  if (missed) g_missed.fetch_add(1, std::memory_order_relaxed);
  if (g_asleep.load()) nudge();
}

launch_counts counts() noexcept {
  return {g_counted.load(), g_missed.load(std::memory_order_relaxed)};  // seq_cst: Note [Idle engine]
}

// ---- the program's streams (Note [Launch streams]) ----
namespace {

constexpr std::uint64_t k_claiming = ~std::uint64_t{0};  // a slot being filled: its context not yet written

struct alignas(64) stream_slot {
  std::atomic<std::uint64_t> stream{0};  // 0: free
  std::atomic<std::uint64_t> context{0};
  std::atomic<std::uint32_t> visitors{0};  // engines recording a fence on it now (visit_streams)
};

stream_slot g_streams[k_max_streams];
std::atomic<std::size_t> g_streams_end{0};  // every slot ever filled is below it
std::atomic<std::uint64_t> g_streams_epoch{0};
std::atomic<bool> g_streams_full{false};

// Frees `slot` if it holds `stream`, once no visit is on it (sequentially consistent: a visit that counted itself
// before the free is waited for, one after it reads the freed slot). True when it held `stream`.
bool free_slot(stream_slot& slot, std::uint64_t stream) noexcept {
  std::uint64_t expected = stream;
  if (!slot.stream.compare_exchange_strong(expected, 0)) return false;
  while (slot.visitors.load() != 0) cpu_relax();
  return true;
}

}  // namespace

void note_stream(std::uint64_t stream, std::uint64_t context) noexcept {
  if (stream == 0 || stream == k_claiming) return;
  const std::size_t end = g_streams_end.load();
  for (std::size_t i = 0; i < end; ++i) {
    if (g_streams[i].stream.load() == stream && g_streams[i].context.load() == context) return;
  }
  for (std::size_t i = 0; i < k_max_streams; ++i) {
    stream_slot& slot = g_streams[i];
    std::uint64_t expected = 0;
    if (slot.stream.load(std::memory_order_relaxed) != 0 || !slot.stream.compare_exchange_strong(expected, k_claiming)) {
      continue;
    }
    slot.context.store(context);
    slot.stream.store(stream);
    std::size_t at = g_streams_end.load();
    while (at < i + 1 && !g_streams_end.compare_exchange_weak(at, i + 1)) {
    }
    return;
  }
  if (!g_streams_full.exchange(true)) {
    LAYERSWAP_LOG(warn, "more than %zu CUDA streams with launches at once: moves are not fenced on the streams beyond "
                        "them (residency_gate.hpp, Note [Launch streams])", k_max_streams);
  }
}

void forget_stream(std::uint64_t stream) noexcept {
  if (stream == 0 || stream == k_claiming) return;
  bool freed = false;
  const std::size_t end = g_streams_end.load();
  for (std::size_t i = 0; i < end; ++i) freed |= free_slot(g_streams[i], stream);
  if (freed) g_streams_epoch.fetch_add(1);
}

void forget_streams() noexcept {
  const std::size_t end = g_streams_end.load();
  for (std::size_t i = 0; i < end; ++i) {
    const std::uint64_t s = g_streams[i].stream.load();
    if (s != 0 && s != k_claiming) free_slot(g_streams[i], s);
  }
  g_streams_epoch.fetch_add(1);
}

std::uint64_t streams_epoch() noexcept { return g_streams_epoch.load(std::memory_order_relaxed); }

void visit_streams(std::uint64_t context, void (*visit)(void*, std::uint64_t), void* arg) {
  const std::size_t end = g_streams_end.load();
  for (std::size_t i = 0; i < end; ++i) {
    stream_slot& slot = g_streams[i];
    if (slot.stream.load(std::memory_order_relaxed) == 0) continue;
    slot.visitors.fetch_add(1);
    struct leave {
      stream_slot& slot;
      ~leave() { slot.visitors.fetch_sub(1); }
    } guard{slot};
    const std::uint64_t s = slot.stream.load();
    if (s == 0 || s == k_claiming || slot.context.load() != context) continue;
    if (slot.stream.load() != s) continue;  // refilled meanwhile: the context read may be the new stream's
    visit(arg, s);
  }
}

}  // namespace layerswap::residency_gate
