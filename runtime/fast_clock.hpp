// Cheap timestamps for the time counters read on hot paths: a kernel launch's API time (the tracker, twice per
// launch) and an allocator call's time (twice per call). A 1.1B LoRA step makes ~5,600 launches and ~7,100 allocator
// calls, so those counters read the clock ~25,000 times per step. On the H200 machine (a VM) the steady clock's
// vDSO read showed as 2-2.5% of the launching threads' samples (bench/perf_threads.sh); the TSC is read in a few
// nanoseconds.
//
// Note [Fast clock]
//   ticks() reads the TSC where it is usable: x86-64, and either the CPU says it is invariant (CPUID 0x80000007,
//   EDX bit 8: constant rate, runs in every C-state) or the kernel uses it as its clocksource (which it does only
//   when it trusts it; VMs often hide the CPUID bit but keep the TSC as the clocksource). Elsewhere ticks() is the
//   steady clock in nanoseconds. The choice is made once, at the first call, and never changes, so any two ticks()
//   of the process compare. Ticks are converted to nanoseconds only when statistics are read (to_ns): the rate is
//   measured against the steady clock over the process's life so far (at least 10 ms: to_ns waits out the rest the
//   first time), so no calibration runs on a hot path. Only time counters use it; nothing that orders events or
//   decides anything does.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace layerswap::fast_clock {

namespace detail {
enum mode : int { unknown = 0, tsc = 1, steady = 2 };
extern std::atomic<int> g_mode;
int detect() noexcept;  // sets g_mode (once; concurrent callers agree) and returns it
}  // namespace detail

// The steady clock, in nanoseconds since its epoch: what ticks() reads where the TSC is not usable, and the one
// reading of std::chrono::steady_clock as a number that the rest of layerswap uses.
[[nodiscard]] std::uint64_t steady_ns() noexcept;

// A timestamp in ticks (Note [Fast clock]). Any thread, no lock, no system call.
inline std::uint64_t ticks() noexcept {
  int mode = detail::g_mode.load(std::memory_order_relaxed);
  if (mode == detail::unknown) mode = detail::detect();
#if defined(__x86_64__)
  if (mode == detail::tsc) return __rdtsc();
#endif
  return steady_ns();
}

// Nanoseconds in `ticks` ticks (a difference of two ticks(), or a sum of such differences).
[[nodiscard]] std::uint64_t to_ns(std::uint64_t ticks) noexcept;

// Whether ticks() reads the TSC (else the steady clock), and why, for the log: "tsc (invariant)",
// "tsc (clocksource)", "steady clock".
[[nodiscard]] const char* source() noexcept;

}  // namespace layerswap::fast_clock
