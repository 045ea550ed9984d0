// The settings table and its parser. parse_config() first folds the NAME=VALUE pairs so the last value of each
// name wins (the environment, then enable()'s overrides), then checks each table row's final value once, in
// table order, throwing config_error on the first bad one. Names that start with LAYERSWAP but are not in the
// table are collected as ready-to-print messages with the closest known name. Sizes are parsed by hand (no
// strtod: it would accept "inf", "nan", hex and the locale's decimal point) with exact integer arithmetic, so
// "0.29KB" is 290 bytes and not 289. Nothing here is on a hot path.
#include "runtime/config.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "runtime/error.hpp"
#include "runtime/text.hpp"

extern char** environ;

namespace layerswap {

namespace {

// Rows of the table, in table order.
enum row : std::size_t {
  row_enable, row_budget, row_log, row_stats, row_va_reserve, row_track, row_track_api, row_trace,
  row_prefetch, row_pin, row_host_limit, row_hold, row_writeback, row_oversize, row_cache_reserve,
  row_composites, row_split, row_split_free, row_reclaim, row_reserve, row_program_first, row_count
};

constexpr setting_info k_settings[row_count] = {
    {"LAYERSWAP", "0", "0 or 1 (also true/false, on/off, yes/no)",
     "Turn layerswap on with no budget (LAYERSWAP_BUDGET also turns it on; an explicit LAYERSWAP=0 keeps it off "
     "even then)"},
    {"LAYERSWAP_BUDGET", "none",
     "a size such as 6GiB, 6144MiB, 1.5G, 1073741824 (bytes), or a percentage of device memory such as 75%; "
     "none for no cap",
     "Cap on the device memory layerswap holds (setting it turns layerswap on)"},
    {"LAYERSWAP_LOG", "warn", "warn, info or debug", "How much layerswap writes to stderr"},
    {"LAYERSWAP_STATS", "0", "0 or 1 (also true/false, on/off, yes/no)",
     "Print allocator statistics to stderr at exit"},
    {"LAYERSWAP_VA_RESERVE", "1TiB", "a size such as 1TiB or 256GiB (at least 2MiB)",
     "Virtual address space reserved per arena (grows by further arenas when used up)"},
    {"LAYERSWAP_TRACK", "auto", "auto, 0 or 1 (also true/false, on/off, yes/no), subscribe-only, or attribute",
     "The CUPTI launch tracker: auto runs it whenever layerswap is on; 0 never; 1 always; subscribe-only (a "
     "measurement aid) takes CUPTI and enables the same callbacks but records nothing, so that a benchmark sees "
     "CUPTI's own cost; without records swapping stays off, as without a tracker; attribute (a measurement aid) "
     "is 1, and also counts each launch's time in the driver by the driver call the migration thread was in "
     "(the tracker's launch_engine_* and launch_hist_* statistics)"},
    {"LAYERSWAP_TRACK_API", "driver", "driver or both",
     "Which CUPTI callbacks the tracker takes: driver = the driver's only (two per launch; a runtime launch is "
     "decoded in the driver callback it makes, which also reads kernels of libraries with their own static CUDA "
     "runtime, such as cuBLAS's sm80_xmma GEMMs); both = the runtime's and the driver's (four per runtime "
     "launch, decoded in the runtime's)"},
    {"LAYERSWAP_TRACE", "none", "a file path such as /tmp/launches.json, or none",
     "Write a Chrome/Perfetto trace of launches and the regions each touched to this file (bounded size)"},
    {"LAYERSWAP_PREFETCH", "auto", "auto, tune, or a number of regions such as 8 (at least 1)",
     "How far ahead swapping prefetches: auto as far as the budget allows, N at most the next N forecast regions, "
     "tune (experimental) the fastest of auto and shorter distances, timed a few steps each, per learned step"},
    {"LAYERSWAP_PIN", "none",
     "none; first:N and/or last:N joined by a comma, such as first:2,last:2 (groups of a step); or a size such "
     "as 2GiB (the step's first groups up to that size)",
     "Groups swapping never evicts: the first and last groups used in a step, or the first ones up to a size"},
    {"LAYERSWAP_HOST_LIMIT", "none", "a size such as 64GiB, or none",
     "Cap on the pinned host memory that backs swapped-out regions (none: as much as the host gives)"},
    {"LAYERSWAP_HOLD", "0", "0 or 1 (also true/false, on/off, yes/no)",
     "A launch that needs a region still being prefetched waits on the GPU (1, experimental) rather than on the "
     "host (0)"},
    {"LAYERSWAP_WRITEBACK", "skip-clean", "skip-clean or always",
     "skip-clean: an eviction copies a region back to the host only when a GPU digest of it differs from the one "
     "taken when it came in (frozen weights are never copied back); always: every eviction copies"},
    {"LAYERSWAP_OVERSIZE", "1", "a number from 1 to 16, such as 2 (1: off)",
     "Experimental: when the budget has no room for a new segment without reclaiming the cache, a large allocation "
     "takes an idle cached segment of its stream up to this many times its size instead (1: only one within 1/8 of "
     "its size, as always)"},
    {"LAYERSWAP_CACHE_RESERVE", "none", "none (or 0), auto, or a size such as 256MiB",
     "Device memory swapping leaves to the allocator's cache of freed segments besides the live activations: none, "
     "the policy may use all the budget leaves beside the activations (with LAYERSWAP_SPLIT the program's requests "
     "take ranges of segments it freed rather than remaking segments); auto grows it each time an allocation finds "
     "no cached segment of its size and has to destroy another's, up to half of what the budget leaves for swapped "
     "memory; a size fixes it (at most all of that)"},
    {"LAYERSWAP_COMPOSITES", "0", "0 or 1 (also true/false, on/off, yes/no)",
     "Experimental: when the budget has no room for a new large segment without waiting for the GPU, make it from "
     "the chunks of segments its stream freed, at once, as PyTorch reuses freed memory on a stream (0: reclaim them, "
     "waiting for the GPU to finish with them first)"},
    {"LAYERSWAP_SPLIT", "8/32",
     "0 or 1 (also true/false, on/off, yes/no), a whole number from 2 to 1024, or two such numbers F/P",
     "When the budget has no room for a new large segment, serve a large allocation from a range of a larger segment "
     "its stream freed, as PyTorch splits cached blocks: at most N times its size with N, 4 times with 1 (0: reclaim "
     "segments of other sizes and make a new one); F/P: at most F times while the reserve for activations follows the "
     "step, P times while it is the step's peak"},
    {"LAYERSWAP_SPLIT_FREE", "12.5%/25%",
     "a percentage of the budget such as 12.5%, a size such as 512MiB, or none; or two of them F/P",
     "With LAYERSWAP_SPLIT: the most device memory the free ranges of split segments may hold (room the swapping "
     "policy cannot use) after a split that takes a whole segment; past it the request makes a segment of its own "
     "(none: no bound); F/P: F while the reserve for activations follows the step, P while it is the step's peak"},
    {"LAYERSWAP_RECLAIM", "fit", "fit or oldest",
     "Which idle segment a request that finds no room destroys first: fit, the smallest one that covers what it lacks "
     "(else the largest), so that big segments stay for big requests; oldest, the least recently freed"},
    {"LAYERSWAP_RESERVE", "auto",
     "auto, peak, follow, or auto:N or follow:N with N a whole number from 0 to 32",
     "The device memory swapping leaves to memory that cannot move (activations): peak, the largest amount seen at "
     "any moment of a step; follow (experimental), the largest seen in each 64th of the learned step, met 64th by "
     "64th, so that weights fill what the activations leave between their peaks (a prefetch's room is held from N "
     "64ths before its use, 2 by default); auto, follow while at least nine tenths of the bytes the last step "
     "evicted were clean (their write-back skipped: frozen weights), else peak"},
    {"LAYERSWAP_PROGRAM_FIRST", "1", "0 or 1 (also true/false, on/off, yes/no)",
     "The program's driver calls that make and free device memory (VMM calls) go before the migration thread's: the "
     "migration thread waits before each of its VMM calls while one of the program's is in progress or ended less "
     "than 40 us ago, 20 ms at most (0: the driver's own order, in which the program's calls could wait milliseconds "
     "behind the migration thread's remaps)"},
};

constexpr std::string_view k_prefix = "LAYERSWAP";
constexpr std::uint64_t k_max_bytes = std::uint64_t{1} << 63;
constexpr std::uint64_t k_va_granularity = std::uint64_t{2} << 20;  // the VMM granularity, 2 MiB

// Used when parse_size() is called for a name that is not in the table.
constexpr std::string_view k_generic_size = "a size such as 6GiB, 6144MiB, 1.5G or 1073741824 (bytes)";
constexpr std::string_view k_generic_size_or_percent =
    "a size such as 6GiB, 6144MiB, 1.5G, 1073741824 (bytes), or a percentage of device memory such as 75%";

constexpr std::string_view k_spaces = " \t\n\r\f\v";

std::string_view trim(std::string_view s) noexcept {
  const auto first = s.find_first_not_of(k_spaces);
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(k_spaces);
  return s.substr(first, last - first + 1);
}

char to_upper(char c) noexcept { return (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c; }
bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (to_upper(a[i]) != to_upper(b[i])) return false;
  }
  return true;
}

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = to_upper(c);
  return out;
}

// The value as it appears in messages: in double quotes, with quotes, backslashes and control bytes escaped.
std::string quoted(std::string_view value) {
  std::string out = "\"";
  append_escaped(out, value, "\\x%02x");
  out += '"';
  return out;
}

const setting_info* find_row(std::string_view name) noexcept {
  for (const auto& info : k_settings) {
    if (name == info.name) return &info;
  }
  return nullptr;
}

// NAME="value" <problem>: use <accepted forms>
[[noreturn]] void reject(std::string_view name, std::string_view value, std::string_view problem,
                         std::string_view accepted) {
  std::string message(name);
  message += '=';
  message += quoted(value);
  message += ' ';
  message += problem;
  message += ": use ";
  message += accepted;
  throw config_error(message);
}

std::string_view size_accepted(std::string_view name, bool allow_percent) noexcept {
  if (const auto* info = find_row(name)) return info->accepted;
  return allow_percent ? k_generic_size_or_percent : k_generic_size;
}

struct unit {
  std::string_view suffix;  // upper case
  std::uint64_t multiplier;
};

constexpr std::uint64_t k_kib = std::uint64_t{1} << 10;
constexpr std::uint64_t k_mib = std::uint64_t{1} << 20;
constexpr std::uint64_t k_gib = std::uint64_t{1} << 30;
constexpr std::uint64_t k_tib = std::uint64_t{1} << 40;

constexpr unit k_units[] = {
    {"", 1},          {"B", 1},
    {"K", k_kib},     {"KIB", k_kib},     {"KB", 1'000},
    {"M", k_mib},     {"MIB", k_mib},     {"MB", 1'000'000},
    {"G", k_gib},     {"GIB", k_gib},     {"GB", 1'000'000'000},
    {"T", k_tib},     {"TIB", k_tib},     {"TB", 1'000'000'000'000},
};

// `text`, all of it, as a number of type T; nothing when it is not one or has anything after it.
template <class T>
std::optional<T> as_number(std::string_view text) noexcept {
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return v;
}

std::optional<std::uint64_t> unit_multiplier(std::string_view suffix) noexcept {
  for (const auto& u : k_units) {
    if (iequals(suffix, u.suffix)) return u.multiplier;
  }
  return std::nullopt;
}

// A non-negative decimal "123", "1.5", ".5" or "2.": the whole part (saturating; `whole_overflow` when it
// does not fit), and the fraction as fraction_numerator / fraction_denominator with at most 18 digits kept
// (the dropped digits only ever round down, which is what sizes do anyway).
struct decimal {
  std::uint64_t whole = 0;
  bool whole_overflow = false;
  std::uint64_t fraction_numerator = 0;
  std::uint64_t fraction_denominator = 1;
};

// Parses a decimal at the start of `s`; returns the number of characters used, 0 when there is no digit.
std::size_t parse_decimal(std::string_view s, decimal& out) noexcept {
  std::size_t i = 0;
  std::size_t digits = 0;
  for (; i < s.size() && is_digit(s[i]); ++i, ++digits) {
    const auto d = static_cast<std::uint64_t>(s[i] - '0');
    if (out.whole > (std::numeric_limits<std::uint64_t>::max() - d) / 10) {
      out.whole_overflow = true;
    } else if (!out.whole_overflow) {
      out.whole = out.whole * 10 + d;
    }
  }
  if (i < s.size() && s[i] == '.') {
    ++i;
    std::size_t kept = 0;
    for (; i < s.size() && is_digit(s[i]); ++i, ++digits) {
      if (kept < 18) {
        out.fraction_numerator = out.fraction_numerator * 10 + static_cast<std::uint64_t>(s[i] - '0');
        out.fraction_denominator *= 10;
        ++kept;
      }
    }
  }
  return digits == 0 ? 0 : i;
}

constexpr const char* k_yes_words[] = {"1", "true", "on", "yes"};
constexpr const char* k_no_words[] = {"0", "false", "off", "no"};

// Whether `value` (trimmed) is one of `words`, ignoring case.
template <std::size_t N>
bool one_of(std::string_view value, const char* const (&words)[N]) {
  return std::any_of(std::begin(words), std::end(words), [&](const char* w) { return iequals(value, w); });
}

// A setting with a value per mode of the reserve for activations (Note [Splits by reserve] in
// caching_allocator.cpp): "V" sets both, "F/P" the one while the reserve follows the step and the one while it is
// the step's peak. `part(text, pair)` parses one value (`pair`: it is half of "F/P") and rejects a bad one.
template <class T, class Part>
std::pair<T, T> by_reserve(std::string_view value, Part&& part) {
  const std::size_t slash = value.find('/');
  if (slash == std::string_view::npos) {
    const T both = part(value, false);
    return {both, both};
  }
  return {part(value.substr(0, slash), true), part(value.substr(slash + 1), true)};
}

bool parse_bool(std::string_view name, std::string_view value) {
  const auto v = trim(value);
  if (one_of(v, k_yes_words)) return true;
  if (one_of(v, k_no_words)) return false;
  reject(name, value, "is not 0 or 1", find_row(name)->accepted);
}

log_level parse_log_level(std::string_view name, std::string_view value) {
  const auto v = trim(value);
  if (iequals(v, "warn")) return log_level::warn;
  if (iequals(v, "info")) return log_level::info;
  if (iequals(v, "debug")) return log_level::debug;
  reject(name, value, "is not a log level", find_row(name)->accepted);
}

const char* log_level_name(log_level level) noexcept {
  switch (level) {
    case log_level::info: return "info";
    case log_level::debug: return "debug";
    case log_level::warn: break;
  }
  return "warn";
}

// "6GiB" when a binary unit divides exactly, else "1GB" for a decimal one, else "1234567B".
std::string format_size(std::uint64_t bytes) {
  static constexpr unit k_exact[] = {
      {"TiB", k_tib}, {"GiB", k_gib}, {"MiB", k_mib}, {"KiB", k_kib},
      {"TB", 1'000'000'000'000}, {"GB", 1'000'000'000}, {"MB", 1'000'000}, {"KB", 1'000},
  };
  for (const auto& u : k_exact) {
    if (bytes != 0 && bytes % u.multiplier == 0) return std::to_string(bytes / u.multiplier) + std::string(u.suffix);
  }
  return std::to_string(bytes) + "B";
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions, so "BUGDET" is one edit from
// "BUDGET"), on upper-cased strings.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> before(b.size() + 1), previous(b.size() + 1), current(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        current[j] = std::min(current[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, current);
  }
  return previous[b.size()];
}

}  // namespace

std::span<const setting_info> settings_table() noexcept { return k_settings; }

const char* track_name(config::track_mode mode) noexcept {
  switch (mode) {
    case config::track_mode::off: return "0";
    case config::track_mode::on: return "1";
    case config::track_mode::subscribe_only: return "subscribe-only";
    case config::track_mode::attribute: return "attribute";
    case config::track_mode::automatic: break;
  }
  return "auto";
}

namespace {

// LAYERSWAP_RESERVE's value as written: "peak", "follow", "follow:N", "auto" or "auto:N".
std::string reserve_text(const config& c) {
  if (c.reserve == reserve_mode::peak) return "peak";
  const bool automatic = c.reserve == reserve_mode::automatic;
  std::string text = automatic ? "auto" : "follow";
  if (c.reserve_ahead != config::k_reserve_ahead) text += ':' + std::to_string(c.reserve_ahead);
  return text;
}

// LAYERSWAP_CACHE_RESERVE's value as written: "auto", "none" or a size such as "256MiB".
std::string cache_reserve_text(const config& c) {
  if (c.cache_reserve_auto) return "auto";
  return c.cache_reserve ? format_size(c.cache_reserve) : std::string("none");
}

}  // namespace

// ---- sizes ----

size_setting parse_size(std::string_view name, std::string_view value, bool allow_percent) {
  const auto accepted = size_accepted(name, allow_percent);
  const auto text = trim(value);
  if (text.empty()) reject(name, value, "is empty", accepted);
  if (text.front() == '-') reject(name, value, "is negative", accepted);

  decimal number;
  const std::size_t used = parse_decimal(text, number);
  if (used == 0) reject(name, value, "is not a size", accepted);
  const auto suffix = trim(text.substr(used));

  if (suffix == "%") {
    if (!allow_percent) reject(name, value, "is a percentage, which is not accepted here", accepted);
    if (number.whole_overflow || number.whole > 100 ||
        (number.whole == 100 && number.fraction_numerator != 0)) {
      reject(name, value, "is more than 100%", accepted);
    }
    if (number.whole == 0 && number.fraction_numerator == 0) {
      reject(name, value, "is zero", accepted);
    }
    const double percent = static_cast<double>(number.whole) + static_cast<double>(number.fraction_numerator) /
                                                                    static_cast<double>(number.fraction_denominator);
    return size_setting{size_setting::kind::percent, percent};
  }

  const auto multiplier = unit_multiplier(suffix);
  if (!multiplier) reject(name, value, "is not a size", accepted);

  const auto too_large = [&] { reject(name, value, "is too large (more than 8 EiB)", accepted); };
  if (number.whole_overflow || number.whole > k_max_bytes / *multiplier) too_large();
  __extension__ using u128 = unsigned __int128;
  const u128 fraction_bytes = static_cast<u128>(number.fraction_numerator) * *multiplier / number.fraction_denominator;
  const u128 bytes = static_cast<u128>(number.whole) * *multiplier + fraction_bytes;
  if (bytes > k_max_bytes) too_large();
  if (bytes == 0) {
    const bool budget = name == k_settings[row_budget].name;
    const bool fraction = number.fraction_numerator != 0;
    reject(name, value,
           budget ? (fraction ? "is less than one byte (use none for no cap)" : "is zero (use none for no cap)")
                  : (fraction ? "is less than one byte" : "is zero"),
           accepted);
  }
  return size_setting{size_setting::kind::bytes, static_cast<double>(static_cast<std::uint64_t>(bytes))};
}

std::size_t size_setting::resolve(std::size_t device_total) const noexcept {
  switch (how) {
    case kind::unset: return 0;
    case kind::bytes: return static_cast<std::size_t>(value);
    case kind::percent: {
      const long double bytes =
          std::floor(static_cast<long double>(device_total) * static_cast<long double>(value) / 100.0L);
      if (bytes <= 0) return 0;
      if (bytes >= static_cast<long double>(device_total)) return device_total;
      return static_cast<std::size_t>(bytes);
    }
  }
  return 0;
}

std::string size_setting::to_string() const {
  switch (how) {
    case kind::unset: return "none";
    case kind::bytes: return format_size(static_cast<std::uint64_t>(value));
    case kind::percent: {
      char text[64];
      std::snprintf(text, sizeof text, "%.15g%%", value);
      return text;
    }
  }
  return "none";
}

std::string format_bytes(std::uint64_t bytes) {
  char text[64];
  if (bytes < 1024) {
    std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
    return text;
  }
  static constexpr const char* k_names[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double scaled = static_cast<double>(bytes) / 1024.0;
  std::size_t index = 0;
  // Move up a unit also when rounding to two decimals would print "1024.00".
  while (index + 1 < std::size(k_names) && scaled >= 1023.995) {
    scaled /= 1024.0;
    ++index;
  }
  std::snprintf(text, sizeof text, "%.2f %s", scaled, k_names[index]);
  return text;
}

// ---- names ----

std::string closest_setting(std::string_view name) {
  std::string query = upper(trim(name));
  if (query.compare(0, k_prefix.size(), k_prefix) != 0) query.insert(0, "LAYERSWAP_");
  // The part after the prefix is what the user typed; the shared prefix must not make any short name look
  // close ("LAYERSWAP_FOO" is two edits from "LAYERSWAP_LOG" but is no typo of it).
  std::size_t own = query.size() - k_prefix.size();
  if (own > 0 && query[k_prefix.size()] == '_') --own;
  const std::size_t limit = std::min(std::max<std::size_t>(2, query.size() / 4), std::max<std::size_t>(1, own / 2));

  std::string_view best;
  std::size_t best_distance = limit + 1;
  for (const auto& info : k_settings) {
    const std::size_t distance = edit_distance(query, info.name);
    if (distance < best_distance) {
      best_distance = distance;
      best = info.name;
    }
  }
  return std::string(best);
}

// ---- the configuration ----

bool config::was_given(std::string_view name) const noexcept {
  for (std::size_t i = 0; i < row_count; ++i) {
    if (name == k_settings[i].name) return (given >> i) & 1U;
  }
  return false;
}

std::string config::describe() const {
  std::string out;
  const auto line = [&](std::size_t index, const std::string& value, std::string_view note) {
    out += k_settings[index].name;
    out += '=';
    out += value;
    if (((given >> index) & 1U) == 0) out += note;
    out += '\n';
  };
  line(row_enable, enabled ? "1" : "0",
       enabled ? "  (default; on because LAYERSWAP_BUDGET is set)" : "  (default)");
  line(row_budget, budget.to_string(), "  (default)");
  line(row_log, log_level_name(log), "  (default)");
  line(row_stats, stats ? "1" : "0", "  (default)");
  line(row_va_reserve, format_size(va_reserve), "  (default)");
  line(row_track, track_name(track), "  (default)");
  line(row_track_api, track_api == track_api_mode::driver ? "driver" : "both", "  (default)");
  line(row_trace, trace.empty() ? "none" : trace, "  (default)");
  line(row_prefetch, prefetch_tune ? std::string("tune") : prefetch ? std::to_string(prefetch) : std::string("auto"),
       "  (default)");
  {
    std::string pin;
    if (pin_first) pin = "first:" + std::to_string(pin_first);
    if (pin_last) pin += (pin.empty() ? "" : ",") + std::string("last:") + std::to_string(pin_last);
    if (pin_bytes) pin = format_size(pin_bytes);
    line(row_pin, pin.empty() ? "none" : pin, "  (default)");
  }
  line(row_host_limit, host_limit ? format_size(host_limit) : std::string("none"), "  (default)");
  line(row_hold, hold ? "1" : "0", "  (default)");
  line(row_writeback, writeback_always ? "always" : "skip-clean", "  (default)");
  {
    char text[32];
    const auto end = std::to_chars(text, text + sizeof text, oversize).ptr;
    line(row_oversize, std::string(text, end), "  (default)");
  }
  line(row_cache_reserve, cache_reserve_text(*this), "  (default)");
  line(row_composites, composites ? "1" : "0", "  (default)");
  {
    const std::string follow = std::to_string(split);
    line(row_split, split == split_peak ? follow : follow + "/" + std::to_string(split_peak), "  (default)");
    const std::string free = split_free.to_string();
    line(row_split_free, split_free_peak == split_free ? free : free + "/" + split_free_peak.to_string(),
         "  (default)");
  }
  line(row_reclaim, reclaim_fit ? "fit" : "oldest", "  (default)");
  line(row_reserve, reserve_text(*this), "  (default)");
  line(row_program_first, program_first ? "1" : "0", "  (default)");
  for (const auto& message : unknown) {
    out += message;
    out += '\n';
  }
  return out;
}

config parse_config(std::span<const std::pair<std::string, std::string>> vars) {
  // Fold: the last value of each name wins. Unknown names keep their first position and their last value.
  std::optional<std::string_view> values[row_count];
  std::vector<std::pair<std::string_view, std::string_view>> unknown;
  for (const auto& var : vars) {
    const std::string_view name = var.first;
    const std::string_view value = var.second;
    if (name.substr(0, k_prefix.size()) != k_prefix) continue;
    bool known = false;
    for (std::size_t i = 0; i < row_count; ++i) {
      if (name == k_settings[i].name) {
        values[i] = value;
        known = true;
        break;
      }
    }
    if (known) continue;
    const auto same = std::find_if(unknown.begin(), unknown.end(), [&](const auto& u) { return u.first == name; });
    if (same != unknown.end()) {
      same->second = value;
    } else {
      unknown.emplace_back(name, value);
    }
  }

  config result;
  // Set and non-empty: the value to check; otherwise the default stays.
  const auto given = [&](std::size_t index) -> std::optional<std::string_view> {
    if (!values[index] || trim(*values[index]).empty()) return std::nullopt;
    result.given |= std::uint32_t{1} << index;
    return values[index];
  };

  const auto enable = given(row_enable);
  const bool enable_flag = enable ? parse_bool(k_settings[row_enable].name, *enable) : false;

  if (const auto budget = given(row_budget)) {
    if (!iequals(trim(*budget), "none")) result.budget = parse_size(k_settings[row_budget].name, *budget, true);
  }
  // An explicit LAYERSWAP=0 wins over a budget; without LAYERSWAP, a budget turns layerswap on.
  result.enabled = enable ? enable_flag : result.budget.is_set();

  if (const auto level = given(row_log)) result.log = parse_log_level(k_settings[row_log].name, *level);
  if (const auto stats = given(row_stats)) result.stats = parse_bool(k_settings[row_stats].name, *stats);
  if (const auto hold = given(row_hold)) result.hold = parse_bool(k_settings[row_hold].name, *hold);
  if (const auto first = given(row_program_first)) {
    result.program_first = parse_bool(k_settings[row_program_first].name, *first);
  }
  if (const auto composites = given(row_composites)) {
    result.composites = parse_bool(k_settings[row_composites].name, *composites);
  }
  if (const auto reclaim = given(row_reclaim)) {
    const std::string_view v = trim(*reclaim);
    if (iequals(v, "fit")) {
      result.reclaim_fit = true;
    } else if (iequals(v, "oldest")) {
      result.reclaim_fit = false;
    } else {
      reject(k_settings[row_reclaim].name, *reclaim, "is neither fit nor oldest", k_settings[row_reclaim].accepted);
    }
  }
  if (const auto reserve = given(row_reserve)) {
    const std::string_view v = trim(*reserve);
    const std::string_view accepted = k_settings[row_reserve].accepted;
    const std::string_view name = k_settings[row_reserve].name;
    const auto set = [&](reserve_mode mode, std::uint32_t ahead) {
      result.reserve = mode;
      result.reserve_ahead = ahead;
    };
    // "follow:N" or "auto:N": the lead N after the word's colon.
    const auto window = [&](std::string_view word) -> std::optional<std::uint32_t> {
      if (v.size() <= word.size() || !iequals(v.substr(0, word.size()), word) || v[word.size()] != ':') {
        return std::nullopt;
      }
      const std::optional<std::uint32_t> n = as_number<std::uint32_t>(trim(v.substr(word.size() + 1)));
      if (!n || *n > 32) {
        reject(name, *reserve, "has no whole number from 0 to 32 after " + std::string(word) + ":", accepted);
      }
      return n;
    };
    if (iequals(v, "peak")) {
      set(reserve_mode::peak, config::k_reserve_ahead);
    } else if (iequals(v, "follow")) {
      set(reserve_mode::follow, config::k_reserve_ahead);
    } else if (iequals(v, "auto")) {
      set(reserve_mode::automatic, config::k_reserve_ahead);
    } else if (const std::optional<std::uint32_t> n = window("follow")) {
      set(reserve_mode::follow, *n);
    } else if (const std::optional<std::uint32_t> n = window("auto")) {
      set(reserve_mode::automatic, *n);
    } else {
      reject(name, *reserve, "is none of auto, peak and follow", accepted);
    }
  }
  if (const auto split = given(row_split)) {
    const auto* name = k_settings[row_split].name;
    const auto ratio = [&](std::string_view part, bool pair) -> std::uint32_t {
      const std::string_view text = trim(part);
      if (const std::optional<std::uint32_t> n = as_number<std::uint32_t>(text); n && *n >= 2 && *n <= 1024) return *n;
      if (one_of(text, k_yes_words)) return 4;
      if (!pair && one_of(text, k_no_words)) return 0;
      reject(name, *split,
             pair ? "has a part that is not 1 or a whole number from 2 to 1024 (0 turns splits off in both: give 0 "
                    "alone)"
                  : "is not 0, 1 or a whole number from 2 to 1024",
             k_settings[row_split].accepted);
    };
    std::tie(result.split, result.split_peak) = by_reserve<std::uint32_t>(*split, ratio);
  }
  if (const auto free = given(row_split_free)) {
    const auto bound = [&](std::string_view part, bool) {
      return iequals(trim(part), "none") ? size_setting{} : parse_size(k_settings[row_split_free].name, part, true);
    };
    std::tie(result.split_free, result.split_free_peak) = by_reserve<size_setting>(*free, bound);
  }

  if (const auto reserve = given(row_va_reserve)) {
    const auto* name = k_settings[row_va_reserve].name;
    const auto size = parse_size(name, *reserve, false);
    const auto bytes = static_cast<std::uint64_t>(size.value);
    if (bytes < k_va_granularity) reject(name, *reserve, "is less than 2MiB", k_settings[row_va_reserve].accepted);
    // Reservations are made in whole VMM granules; 2^63 is a multiple of 2 MiB, so this cannot overflow.
    result.va_reserve = static_cast<std::size_t>((bytes + k_va_granularity - 1) / k_va_granularity * k_va_granularity);
  }

  if (const auto track = given(row_track)) {
    if (iequals(trim(*track), "auto")) {
      result.track = config::track_mode::automatic;
    } else if (iequals(trim(*track), "subscribe-only")) {
      result.track = config::track_mode::subscribe_only;
    } else if (iequals(trim(*track), "attribute")) {
      result.track = config::track_mode::attribute;
    } else {
      result.track = parse_bool(k_settings[row_track].name, *track) ? config::track_mode::on : config::track_mode::off;
    }
  }
  if (const auto api = given(row_track_api)) {
    const std::string_view text = trim(*api);
    if (iequals(text, "both")) {
      result.track_api = config::track_api_mode::both;
    } else if (iequals(text, "driver")) {
      result.track_api = config::track_api_mode::driver;
    } else {
      reject(k_settings[row_track_api].name, *api, "is not both or driver", k_settings[row_track_api].accepted);
    }
  }
  if (const auto trace = given(row_trace)) {
    if (!iequals(trim(*trace), "none")) result.trace = std::string(trim(*trace));
  }

  if (const auto prefetch = given(row_prefetch)) {
    const auto* name = k_settings[row_prefetch].name;
    const std::string_view text = trim(*prefetch);
    if (iequals(text, "tune")) {
      result.prefetch_tune = true;
    } else if (!iequals(text, "auto")) {
      std::size_t n = 0;
      bool ok = !text.empty() && text.size() <= 9;
      for (char c : text) ok = ok && is_digit(c), n = n * 10 + static_cast<std::size_t>(c - '0');
      if (!ok || n == 0) {
        reject(name, *prefetch, "is not auto, tune or a positive number", k_settings[row_prefetch].accepted);
      }
      result.prefetch = n;
    }
  }
  if (const auto pin = given(row_pin)) {
    const auto* name = k_settings[row_pin].name;
    const auto* accepted = k_settings[row_pin].accepted;
    const std::string_view text = trim(*pin);
    if (!iequals(text, "none")) {
      if (!text.empty() && is_digit(text.front()) && text.find(':') == std::string_view::npos) {
        result.pin_bytes = static_cast<std::size_t>(parse_size(name, *pin, false).value);
      } else {
        std::string_view rest = text;
        while (!rest.empty()) {
          const auto comma = rest.find(',');
          const std::string_view part = trim(rest.substr(0, comma));
          rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
          const auto colon = part.find(':');
          const std::string_view key = colon == std::string_view::npos ? part : trim(part.substr(0, colon));
          const std::string_view num = colon == std::string_view::npos ? std::string_view{} : trim(part.substr(colon + 1));
          const std::optional<std::uint32_t> parsed = as_number<std::uint32_t>(num);
          if (!parsed) reject(name, *pin, "is not of the form first:N,last:N", accepted);
          const std::uint32_t n = *parsed;
          if (iequals(key, "first")) {
            result.pin_first = n;
          } else if (iequals(key, "last")) {
            result.pin_last = n;
          } else {
            reject(name, *pin, "names neither first nor last", accepted);
          }
        }
      }
    }
  }
  if (const auto oversize = given(row_oversize)) {
    const std::optional<double> v = as_number<double>(trim(*oversize));
    if (!v || !(*v >= 1.0 && *v <= 16.0)) {
      reject(k_settings[row_oversize].name, *oversize, "is not a number from 1 to 16", k_settings[row_oversize].accepted);
    }
    result.oversize = *v;
  }
  if (const auto writeback = given(row_writeback)) {
    const std::string_view v = trim(*writeback);
    if (iequals(v, "always")) {
      result.writeback_always = true;
    } else if (!iequals(v, "skip-clean")) {
      reject(k_settings[row_writeback].name, *writeback, "is not a write-back mode", k_settings[row_writeback].accepted);
    }
  }
  if (const auto reserve = given(row_cache_reserve)) {
    const std::string_view v = trim(*reserve);
    result.cache_reserve_auto = iequals(v, "auto");
    if (!result.cache_reserve_auto) {
      if (!iequals(v, "none") && v != "0") {
        result.cache_reserve =
            static_cast<std::size_t>(parse_size(k_settings[row_cache_reserve].name, *reserve, false).value);
      }
    }
  }
  if (const auto limit = given(row_host_limit)) {
    if (!iequals(trim(*limit), "none")) {
      result.host_limit = static_cast<std::size_t>(parse_size(k_settings[row_host_limit].name, *limit, false).value);
    }
  }

  for (const auto& [name, value] : unknown) {
    std::string message = "unknown setting ";
    message += name;
    message += '=';
    message += value;
    if (const auto hint = closest_setting(name); !hint.empty()) {
      message += " (did you mean ";
      message += hint;
      message += "?)";
    }
    result.unknown.push_back(std::move(message));
  }
  return result;
}

std::vector<std::pair<std::string, std::string>> environment_settings() {
  std::vector<std::pair<std::string, std::string>> out;
  if (environ == nullptr) return out;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    if (text.substr(0, k_prefix.size()) != k_prefix) continue;
    const auto equals = text.find('=');
    if (equals == std::string_view::npos) {
      out.emplace_back(std::string(text), std::string());
    } else {
      out.emplace_back(std::string(text.substr(0, equals)), std::string(text.substr(equals + 1)));
    }
  }
  return out;
}

}  // namespace layerswap
