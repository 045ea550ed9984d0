// The fast clock (runtime/fast_clock.hpp, Note [Fast clock]).
#include "runtime/fast_clock.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace layerswap::fast_clock {

namespace detail {

std::atomic<int> g_mode{unknown};

}  // namespace detail

std::uint64_t steady_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

namespace {

// The TSC and the steady clock read together when the mode was chosen: the origin of the rate's measurement.
std::atomic<std::uint64_t> g_origin_ticks{0};
std::atomic<std::uint64_t> g_origin_ns{0};
const char* g_source = "steady clock";
std::mutex g_rate_mutex;
double g_ns_per_tick = 0;          // the last measured rate (guarded by g_rate_mutex)
std::uint64_t g_rate_span_ns = 0;  // ... and the span it was measured over

#if defined(__x86_64__)
bool cpu_says_invariant() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) == 0 || a < 0x80000007u) return false;
  if (__get_cpuid(0x80000007u, &a, &b, &c, &d) == 0) return false;
  return (d & (1u << 8)) != 0;
}

// The kernel's current clocksource is "tsc": read with plain system calls (no allocation: detect() may run inside
// a CUPTI callback, at the first launch).
bool kernel_uses_tsc() noexcept {
  const int fd = ::open("/sys/devices/system/clocksource/clocksource0/current_clocksource", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[32] = {};
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  return n >= 3 && std::strncmp(text, "tsc", 3) == 0 && (n == 3 || text[3] == '\n');
}
#endif

}  // namespace

namespace detail {

int detect() noexcept {
  static std::once_flag once;  // callers racing at the first ticks() detect once and agree
  std::call_once(once, [] {
    int mode = steady;
#if defined(__x86_64__)
    if (cpu_says_invariant()) {
      mode = tsc, g_source = "tsc (invariant)";
    } else if (kernel_uses_tsc()) {
      mode = tsc, g_source = "tsc (clocksource)";
    }
    g_origin_ticks.store(mode == tsc ? __rdtsc() : 0, std::memory_order_relaxed);
#endif
    g_origin_ns.store(steady_ns(), std::memory_order_relaxed);
    g_mode.store(mode);
  });
  return g_mode.load();
}

}  // namespace detail

std::uint64_t to_ns(std::uint64_t ticks) noexcept {
  int mode = detail::g_mode.load();
  if (mode == detail::unknown) mode = detail::detect();
  if (mode != detail::tsc) return ticks;
#if defined(__x86_64__)
  std::lock_guard lock(g_rate_mutex);
  constexpr std::uint64_t k_min_span_ns = 10'000'000;
  std::uint64_t now_ticks = 0;
  std::uint64_t now_ns = 0;
  do {  // the first read within 10 ms of the origin waits for the rest
    now_ns = steady_ns();
    now_ticks = __rdtsc();
  } while (now_ns - g_origin_ns.load(std::memory_order_relaxed) < k_min_span_ns);
  const std::uint64_t span_ns = now_ns - g_origin_ns.load(std::memory_order_relaxed);
  const std::uint64_t span_ticks = now_ticks - g_origin_ticks.load(std::memory_order_relaxed);
  if (span_ticks > 0 && span_ns > g_rate_span_ns) {  // a longer span measures the rate better
    g_ns_per_tick = static_cast<double>(span_ns) / static_cast<double>(span_ticks);
    g_rate_span_ns = span_ns;
  }
  return static_cast<std::uint64_t>(static_cast<double>(ticks) * g_ns_per_tick);
#else
  return ticks;
#endif
}

const char* source() noexcept {
  if (detail::g_mode.load() == detail::unknown) detail::detect();
  return g_source;
}

}  // namespace layerswap::fast_clock
