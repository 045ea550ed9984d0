// Logging to stderr, prefixed "layerswap: ". The level comes from LAYERSWAP_LOG (warn|info|debug; default
// warn). Never called on a hot path (malloc/free, the launch callback): those count, and the counts are
// reported later.
#pragma once

#include <atomic>

namespace layerswap {

enum class log_level : int { warn = 0, info = 1, debug = 2 };

namespace detail {
extern std::atomic<int> g_log_level;
void log_write(log_level level, const char* format, ...) noexcept __attribute__((format(printf, 2, 3)));
}  // namespace detail

inline void set_log_level(log_level level) noexcept {
  detail::g_log_level.store(static_cast<int>(level), std::memory_order_relaxed);
}
[[nodiscard]] inline bool log_enabled(log_level level) noexcept {
  return static_cast<int>(level) <= detail::g_log_level.load(std::memory_order_relaxed);
}

}  // namespace layerswap

// printf-style; arguments are evaluated only when the level is enabled.
#define LAYERSWAP_LOG(level, ...)                                                  \
  do {                                                                             \
    if (::layerswap::log_enabled(::layerswap::log_level::level)) {                 \
      ::layerswap::detail::log_write(::layerswap::log_level::level, __VA_ARGS__);  \
    }                                                                              \
  } while (0)
