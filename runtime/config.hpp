// The one table of layerswap settings. Every setting is an environment variable LAYERSWAP_<NAME>; the
// Python `layerswap.enable(budget=..., **settings)` passes the same names in lower case without the
// prefix. Values are parsed once; a bad value is a config_error naming the variable, the value and the
// accepted forms; an unknown LAYERSWAP_* name is reported with the closest known one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/log.hpp"

namespace layerswap {

// LAYERSWAP_RESERVE's modes (allocator/residency.cpp, Notes [Following reserve] and [Automatic reserve]).
enum class reserve_mode : std::uint8_t { peak, follow, automatic };

// One row of the table.
struct setting_info {
  const char* name;           // full variable name, e.g. "LAYERSWAP_BUDGET"
  const char* default_value;  // as a user would write it
  const char* accepted;       // the accepted forms, quoted in errors
  const char* help;           // one line for the README and `layerswap config`
};

[[nodiscard]] std::span<const setting_info> settings_table() noexcept;

// A size that may be relative to the device: "6GiB", "6144MiB", "1.5G", "1073741824", "75%".
// Binary suffixes K/KiB/M/MiB/G/GiB/T/TiB (1024-based), decimal KB/MB/GB/TB (1000-based), a bare number is
// bytes. Case-insensitive; spaces around the number are ignored.
struct size_setting {
  enum class kind : std::uint8_t { unset, bytes, percent };
  kind how = kind::unset;
  double value = 0;  // bytes, or percent in (0, 100]

  [[nodiscard]] bool is_set() const noexcept { return how != kind::unset; }
  bool operator==(const size_setting&) const = default;
  // Bytes for a device with `device_total` bytes; 0 when unset.
  [[nodiscard]] std::size_t resolve(std::size_t device_total) const noexcept;
  [[nodiscard]] std::string to_string() const;
};

struct config {
  bool enabled = false;          // LAYERSWAP=1, or LAYERSWAP_BUDGET set
  size_setting budget;           // LAYERSWAP_BUDGET: cap on device memory layerswap holds (unset: no cap)
  log_level log = log_level::warn;  // LAYERSWAP_LOG
  bool stats = false;            // LAYERSWAP_STATS: print statistics at exit
  std::size_t va_reserve = std::size_t{1} << 40;  // LAYERSWAP_VA_RESERVE: virtual address space per arena
  // LAYERSWAP_TRACK: the CUPTI launch tracker. automatic = on whenever layerswap is enabled. subscribe_only: a
  // measurement aid, CUPTI taken with the tracker's callbacks enabled but a callback that records nothing.
  // attribute: a measurement aid, on as `on`, and each launch's time in the driver is also counted by the driver
  // call the migration thread was in (profiler/cupti_tracker.cpp, Note [Launches beside the engine's calls]).
  enum class track_mode : std::uint8_t { automatic, off, on, subscribe_only, attribute };
  track_mode track = track_mode::automatic;
  // LAYERSWAP_TRACK_API: which CUPTI callback domains the tracker enables (profiler/cupti_tracker.cpp, Note
  // [Callback domains]).
  enum class track_api_mode : std::uint8_t { both, driver };
  track_api_mode track_api = track_api_mode::driver;
  std::string trace;             // LAYERSWAP_TRACE: path of a Chrome/Perfetto launch trace ("" for none)
  std::size_t prefetch = 0;      // LAYERSWAP_PREFETCH: regions prefetched ahead; 0 = auto (as the budget allows)
  bool prefetch_tune = false;    // LAYERSWAP_PREFETCH=tune: the distance chosen from the step times seen
  // LAYERSWAP_PIN: groups never evicted: the first/last N groups of a step, or the first ones up to pin_bytes.
  std::uint32_t pin_first = 0;
  std::uint32_t pin_last = 0;
  std::size_t pin_bytes = 0;
  std::size_t host_limit = 0;    // LAYERSWAP_HOST_LIMIT: host bytes backing swapped-out regions; 0 = no cap
  bool hold = false;             // LAYERSWAP_HOLD: hold launches on the GPU for prefetches (residency_gate.hpp)
  // LAYERSWAP_PROGRAM_FIRST: the program's VMM calls before the migration thread's (runtime/driver_calls.hpp, Note
  // [Program first]).
  bool program_first = true;
  bool writeback_always = false;  // LAYERSWAP_WRITEBACK=always: no skip of clean write-backs (residency.cpp)
  // LAYERSWAP_OVERSIZE: under the budget's pressure, a large allocation takes an idle segment up to this many times
  // its size before reclaiming the cache (caching_allocator.cpp, Note [Oversize reuse]); 1 = off.
  double oversize = 1.0;
  // LAYERSWAP_CACHE_RESERVE: device bytes the policy leaves to the allocator's cache (residency.cpp, Note [Cache
  // reserve]): none (the default: cache_reserve 0), auto (grown by the cache's misses), or a fixed size.
  bool cache_reserve_auto = false;
  std::size_t cache_reserve = 0;
  // LAYERSWAP_COMPOSITES: a large segment made at once from the chunks of segments its stream freed, rather than
  // after a wait for the GPU (caching_allocator.cpp, Note [Composites]). Experimental, off by default.
  bool composites = false;
  // LAYERSWAP_SPLIT: a large allocation served by a range of a larger segment its stream freed, rather than a new
  // segment (caching_allocator.cpp, Note [Split segments]): 0 = off, else the most times the request's size that
  // segment may be (on = 4): `split` while the reserve for activations follows the step, `split_peak` while it is
  // the step's peak (Note [Splits by reserve]; one number sets both).
  std::uint32_t split = 8;
  std::uint32_t split_peak = 32;
  // LAYERSWAP_SPLIT_FREE: the most the free ranges of split segments may hold after a split that takes a whole
  // segment (caching_allocator.cpp, Note [Split bound]): a percentage of the budget or a size; unset = no bound.
  // `split_free` while the reserve follows the step, `split_free_peak` while it is the step's peak.
  size_setting split_free{size_setting::kind::percent, 12.5};
  size_setting split_free_peak{size_setting::kind::percent, 25};
  // LAYERSWAP_RECLAIM: which idle segment a request without room destroys first (caching_allocator.cpp, Note
  // [Reclaim by fit]): the smallest that covers it (fit, the default) or the least recently freed (oldest).
  bool reclaim_fit = true;
  // LAYERSWAP_RESERVE: the policy's reserve for memory that cannot move (residency.cpp, Notes [Following reserve],
  // [Reserve profile] and [Automatic reserve]): the step's peak, the peak learned for each 64th of the step, met 64th
  // by 64th with a prefetch's room held from `reserve_ahead` 64ths before its use (follow), or that while the
  // evictions are clean and the step's peak otherwise (auto, the default).
  reserve_mode reserve = reserve_mode::automatic;
  std::uint32_t reserve_ahead = k_reserve_ahead;
  static constexpr std::uint32_t k_reserve_ahead = 2;  // the profile's lead of LAYERSWAP_RESERVE=auto and follow
  // Whether the launch tracker should run (LAYERSWAP_TRACK against `enabled`).
  [[nodiscard]] bool tracking() const noexcept {
    return track == track_mode::on || track == track_mode::subscribe_only || track == track_mode::attribute ||
           (track == track_mode::automatic && enabled);
  }

  // LAYERSWAP_* names that are not in the table, each with a hint ("did you mean LAYERSWAP_BUDGET?").
  std::vector<std::string> unknown;

  // Which rows of settings_table() were given a non-empty value: bit i is row i. describe() marks the others
  // "(default)".
  std::uint32_t given = 0;
  [[nodiscard]] bool was_given(std::string_view name) const noexcept;

  // One line per setting, for `layerswap config`: "LAYERSWAP_BUDGET=6GiB", or "LAYERSWAP_LOG=warn  (default)"
  // for one not given; then the unknown lines.
  [[nodiscard]] std::string describe() const;
};

// Parses NAME=VALUE pairs (full LAYERSWAP_* names; later pairs override earlier ones). Throws config_error
// on the first bad value. Names that do not start with LAYERSWAP are ignored. An empty (or all-space) value
// counts as unset, so an override of "" restores the default. Only the last value of a name is checked.
[[nodiscard]] config parse_config(std::span<const std::pair<std::string, std::string>> vars);

// Every LAYERSWAP* variable of the process environment, in environment order.
[[nodiscard]] std::vector<std::pair<std::string, std::string>> environment_settings();

// Parses one size value; throws config_error naming `name`.
[[nodiscard]] size_setting parse_size(std::string_view name, std::string_view value, bool allow_percent);

// The closest known name to `name` (edit distance), or "" when nothing is reasonably close. Case-insensitive;
// a name without the LAYERSWAP_ prefix ("bugdet", as enable() spells settings) is compared as if it had it.
[[nodiscard]] std::string closest_setting(std::string_view name);

// LAYERSWAP_TRACK's value as written: "auto", "0", "1", "subscribe-only" or "attribute".
[[nodiscard]] const char* track_name(config::track_mode mode) noexcept;

// Human-readable bytes: "6.00 GiB", "512 B".
[[nodiscard]] std::string format_bytes(std::uint64_t bytes);

}  // namespace layerswap
