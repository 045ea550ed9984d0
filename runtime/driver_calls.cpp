#include "runtime/driver_calls.hpp"

#include <thread>

#include "runtime/spin.hpp"

namespace layerswap::driver_calls {
namespace {
thread_local int t_role = 0;
std::atomic<bool> g_program_first{true};
std::atomic<int> g_program_calls{0};  // Note [Program first]: the program's VMM calls in progress
std::atomic<std::uint64_t> g_program_end_ns{0};  // ... and when the last one ended (steady_ns)
std::atomic<bool> g_marking{false};        // Note [Launches beside the engine's calls]
std::atomic<std::uint8_t> g_engine_call{0};  // ... the engine's call now, kind + 1 (0: none)
constexpr int k_spins = 256;                     // pauses before the engine's wait yields its core

// Whether the engine should let the program's VMM calls go first now: one is in progress, or one ended less than
// k_program_grace ago (the program's next call of a sequence is usually that close).
bool program_turn() noexcept {
  if (g_program_calls.load() != 0) return true;
  const std::uint64_t end = g_program_end_ns.load(std::memory_order_relaxed);
  return end != 0 && fast_clock::steady_ns() < end + static_cast<std::uint64_t>(k_program_grace.count()) * 1000;
}
}  // namespace

counters& global() noexcept {
  static counters c;  // never destroyed before the calls that count into it: static storage, trivial atomics
  return c;
}

int this_thread_role() noexcept { return t_role; }

void set_engine_thread() noexcept { t_role = 1; }

void set_program_first(bool on) noexcept { g_program_first.store(on, std::memory_order_relaxed); }
int program_calls_in_progress() noexcept { return g_program_calls.load(std::memory_order_relaxed); }

void set_engine_call_marking(bool on) noexcept { g_marking.store(on, std::memory_order_relaxed); }
std::uint8_t engine_call_now() noexcept { return g_engine_call.load(std::memory_order_relaxed); }

bool call::mark(kind k) noexcept {
  if (t_role != 1 || !g_marking.load(std::memory_order_relaxed)) return false;
  g_engine_call.store(static_cast<std::uint8_t>(static_cast<int>(k) + 1), std::memory_order_relaxed);
  return true;
}

// Note [Program first]. The count is seq_cst on both sides: the engine, having read 0, may still meet a program
// call in the driver (that call then waits for the engine's one call), but it starts no call after reading a
// raised count.
bool call::take_turn(kind k) noexcept {
  if (!vmm_kind(k) || !g_program_first.load(std::memory_order_relaxed)) return false;
  if (t_role == 0) {
    g_program_calls.fetch_add(1);
    return true;
  }
  if (!program_turn()) return false;
  const timer waited(kind::turn_wait);
  const std::uint64_t until = fast_clock::steady_ns() + static_cast<std::uint64_t>(k_turn_limit.count()) * 1000;
  for (int spins = 0; program_turn(); ++spins) {
    if (spins < k_spins) {
      cpu_relax();
    } else if (fast_clock::steady_ns() < until) {
      std::this_thread::yield();
    } else {
      break;  // an order, never a condition of correctness: the engine goes on (Note [Program first])
    }
  }
  return false;
}

// Lowered as soon as the driver call has returned: the timer, a member, counts the call after this body.
call::~call() {
  if (marked_) g_engine_call.store(0, std::memory_order_relaxed);
  if (!raised_) return;
  g_program_end_ns.store(fast_clock::steady_ns(), std::memory_order_relaxed);
  g_program_calls.fetch_sub(1);
}

}  // namespace layerswap::driver_calls
