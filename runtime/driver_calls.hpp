// Counts and times of the CUDA driver port's calls (runtime/cuda_driver.cpp), split by caller: the residency
// engine's migration thread, and every other thread (the program's allocations and frees). A measurement aid:
// the driver serializes much of its work behind locks the program's launches take too, so what the migration
// thread spends in the driver can slow the launching threads (bench/vmm_interference_probe.py).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "runtime/fast_clock.hpp"

namespace layerswap::driver_calls {

enum class kind : std::uint8_t {
  create, release, map, unmap, set_access, reserve, record, query, stream_wait, copy, digest, write_value, other,
  count_
};
inline constexpr std::size_t k_kinds = static_cast<std::size_t>(kind::count_);
inline constexpr std::array<const char*, k_kinds> k_names = {
    "create", "release", "map", "unmap", "set_access", "reserve", "record", "query", "stream_wait", "copy", "digest",
    "write_value", "other"};

struct counters {
  std::atomic<std::uint64_t> calls[2][k_kinds] = {};
  std::atomic<std::uint64_t> ticks[2][k_kinds] = {};
};
counters& global() noexcept;
// 1 on the thread that called set_engine_thread(), else 0.
int this_thread_role() noexcept;
// The calling thread's driver calls count as the engine's from now on (the migration thread, once).
void set_engine_thread() noexcept;

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
