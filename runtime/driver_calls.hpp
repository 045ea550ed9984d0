// Counts and times of the CUDA driver port's calls (runtime/cuda_driver.cpp), split by caller: the residency
// engine's migration thread, and every other thread (the program's allocations and frees). A measurement aid:
// the driver serializes much of its work behind locks the program's launches take too, so what the migration
// thread spends in the driver can slow the launching threads (bench/vmm_interference_probe.py). And the order
// of the two callers' calls (Note [Program first]).
//
// Note [Program first]
//   The driver runs one thread's VMM calls (create, release, map, unmap, set access, reserve) at a time, and not
//   in the order they came: a thread that makes them back to back keeps the driver's lock, and another thread's
//   call waits until it pauses. On the H200 (bench/vmm_concurrency_probe.cpp, bench/results/vmm_concurrency_s30.json)
//   a thread remapping 22 MiB between two chunks took 36-47 us alone and 4-23 ms on average (p99 46-120 ms) while
//   another thread remapped regions between host pages and chunks without pause, as the migration thread does
//   through a step's evictions and prefetches (host remaps, 8-13 us per MiB). So a program thread that makes or
//   frees a segment (the allocator's calls under its mutex, with the step waiting) could wait milliseconds behind
//   the engine's remaps.
//
//   With program_first (LAYERSWAP_PROGRAM_FIRST=1, the default) a program thread announces each VMM call (a count
//   raised before it and lowered after), and the migration thread, before each of its VMM calls, waits while the
//   count is raised: a program's call waits for at most the one call the engine has in the driver (in the probe:
//   182-210 us on average, p99 0.36-0.42 ms). The program makes and frees a segment in a sequence of calls (create,
//   reserve, map, set access; unmap, release), and the engine, let in between two of them, would start a host remap
//   that the next one waits for: so the engine also waits until k_program_grace has passed since the program's last
//   VMM call ended.
//   * Only the program's VMM calls raise the count: they never wait for the GPU, so they end without the engine's
//     help, and the engine's wait ends. The program's other calls (event waits among them, which may wait for
//     launches that wait for a prefetch) raise nothing.
//   * The engine's other calls (event records and queries, copies: a few us each, some made under the allocator
//     mutex, which the program's next call needs anyway) do not wait.
//   * The engine waits k_turn_limit (20 ms) at most before a call, then goes on: the rule is an order, never a
//     condition of correctness, so no driver that made a program's VMM call wait for the GPU (and the GPU for the
//     engine, as a held launch does: Note [Holds] in allocator/residency.cpp) could deadlock them. The program's VMM
//     calls take 0.1-1 ms on the H200.
//   * The engine's waits are counted as calls of kind turn_wait.
//   On the H200 (interleaved against LAYERSWAP_PROGRAM_FIRST=0 in the same calls, session 30,
//   bench/results/program_first_s30.json): the UNet at 25% spent 48 ms a step in the program's VMM calls instead of
//   60-66 (allocator calls 55-58 ms instead of 69-75; steps 0.150 and 0.153 s against 0.166 and 0.158); full
//   fine-tuning at 25% 71 ms instead of 107, its step 0.468 s against 0.523 (0.452 against 0.507 and 0.490 against
//   0.523 in two calls with earlier forms of the rule), though its launches waited 34 ms more for prefetches (the
//   engine waited 31 ms a step). The LoRA case at 25% makes ~1 segment a step.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "runtime/fast_clock.hpp"

namespace layerswap::driver_calls {

// turn_wait is no call: the engine's waits for the program's VMM calls (Note [Program first]).
enum class kind : std::uint8_t {
  create, release, map, unmap, set_access, reserve, record, query, stream_wait, copy, digest, write_value, other,
  turn_wait, count_
};
inline constexpr std::size_t k_kinds = static_cast<std::size_t>(kind::count_);
inline constexpr std::array<const char*, k_kinds> k_names = {
    "create", "release", "map", "unmap", "set_access", "reserve", "record", "query", "stream_wait", "copy", "digest",
    "write_value", "other", "turn_wait"};

// The VMM calls: the ones the driver serializes between threads (Note [Program first]).
[[nodiscard]] constexpr bool vmm_kind(kind k) noexcept {
  return k == kind::create || k == kind::release || k == kind::map || k == kind::unmap || k == kind::set_access ||
         k == kind::reserve;
}

struct counters {
  std::atomic<std::uint64_t> calls[2][k_kinds] = {};
  std::atomic<std::uint64_t> ticks[2][k_kinds] = {};
};
counters& global() noexcept;
// 1 on the thread that called set_engine_thread(), else 0.
int this_thread_role() noexcept;
// The calling thread's driver calls count as the engine's from now on (the migration thread, once).
void set_engine_thread() noexcept;

// Note [Program first]: how long after a program's VMM call the engine still waits for the next one, and the
// longest the engine waits before one of its calls, whatever the program does.
inline constexpr std::chrono::microseconds k_program_grace{40};
inline constexpr std::chrono::microseconds k_turn_limit{20'000};
// Note [Program first]: on (the default) or off, process-wide. Safe to change at any time.
void set_program_first(bool on) noexcept;
// The program's VMM calls in progress (raised by `call`).
[[nodiscard]] int program_calls_in_progress() noexcept;

// Note [Launches beside the engine's calls] (profiler/cupti_tracker.cpp): while marking is on, the migration
// thread's `call`s publish their kind, so that a kernel launch on another thread can tell which driver call of the
// engine it met. engine_call_now(): that kind plus one, 0 while the engine is in no driver call (or marking is
// off). Off by default: the mark is a store per engine call to a line the launching threads read.
void set_engine_call_marking(bool on) noexcept;
[[nodiscard]] std::uint8_t engine_call_now() noexcept;

// Times one driver call from construction to destruction.
class timer {
 public:
  explicit timer(kind k) noexcept : k_(k), start_(fast_clock::ticks()) {}
  ~timer() {
    counters& c = global();
    const int role = this_thread_role();
    const auto i = static_cast<std::size_t>(k_);
    c.calls[role][i].fetch_add(1, std::memory_order_relaxed);
    c.ticks[role][i].fetch_add(fast_clock::ticks() - start_, std::memory_order_relaxed);
  }
  timer(const timer&) = delete;
  timer& operator=(const timer&) = delete;

 private:
  kind k_;
  std::uint64_t start_;
};

// One driver call: its turn (Note [Program first]), then its timer. On the engine's thread the constructor waits
// while a program thread is in a VMM call; on a program thread a VMM call raises the count until destruction.
class call {
 public:
  explicit call(kind k) noexcept : raised_(take_turn(k)), marked_(mark(k)), timing_(k) {}
  ~call();
  call(const call&) = delete;
  call& operator=(const call&) = delete;

 private:
  static bool take_turn(kind k) noexcept;
  static bool mark(kind k) noexcept;  // Note [Launches beside the engine's calls]
  bool raised_;
  bool marked_;
  timer timing_;  // started after the turn: an engine call's time leaves out its wait (kind turn_wait)
};

struct row {
  const char* name;
  bool engine;
  std::uint64_t calls;
  std::uint64_t ns;
};
// Every (kind, caller) with at least one call.
template <class F>
void for_each(F&& f) {
  counters& c = global();
  for (int role = 0; role < 2; ++role) {
    for (std::size_t i = 0; i < k_kinds; ++i) {
      const std::uint64_t n = c.calls[role][i].load(std::memory_order_relaxed);
      if (n != 0) f(row{k_names[i], role == 1, n, fast_clock::to_ns(c.ticks[role][i].load(std::memory_order_relaxed))});
    }
  }
}

}  // namespace layerswap::driver_calls
