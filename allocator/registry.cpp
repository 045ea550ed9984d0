// Process-wide state: the configuration and one allocator per device (see registry.hpp).
#include "allocator/registry.hpp"

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>

#include "runtime/cuda_driver.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/error.hpp"
#include "runtime/log.hpp"

namespace layerswap {

namespace {

constexpr int k_max_devices = 64;

struct registry_state {
  std::mutex mutex;
  std::optional<config> cfg;
  std::vector<std::pair<std::string, std::string>> overrides;
  std::array<std::atomic<caching_allocator*>, k_max_devices> allocators{};
  std::array<driver*, k_max_devices> ports{};
  std::atomic<int> created{0};
  std::atomic<forecast_source*> forecast{nullptr};  // the residency policies' forecast (set_forecast_source)
  std::atomic<std::string (*)()> extra_stats{nullptr};  // set_stats_section
  bool exit_hook = false;
};

// Never destroyed: allocators must outlive every static destructor that might still free memory.
registry_state& state() {
  static auto* s = new registry_state();
  return *s;
}

config parse_locked(registry_state& s) {
  auto vars = environment_settings();
  vars.insert(vars.end(), s.overrides.begin(), s.overrides.end());
  return parse_config(vars);
}

void apply_locked(registry_state& s, config c) {
  set_log_level(c.log);
  driver_calls::set_program_first(c.program_first);
  for (const std::string& u : c.unknown) LAYERSWAP_LOG(warn, "%s", u.c_str());
  s.cfg = std::move(c);
}

void print_stats_at_exit() {
  const std::string report = stats_report();
  std::fprintf(stderr, "%s", report.c_str());
}

}  // namespace

const config& global_config() {
  registry_state& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.cfg) apply_locked(s, parse_locked(s));
  return *s.cfg;
}

void configure(std::span<const std::pair<std::string, std::string>> overrides) {
  registry_state& s = state();
  std::lock_guard lock(s.mutex);
  auto saved = s.overrides;
  s.overrides.assign(overrides.begin(), overrides.end());
  config c;
  try {
    c = parse_locked(s);
  } catch (...) {
    s.overrides = std::move(saved);
    throw;
  }
  if (s.created.load() > 0 && s.cfg) {
    const bool same = c.budget.how == s.cfg->budget.how && c.budget.value == s.cfg->budget.value &&
                      c.va_reserve == s.cfg->va_reserve;
    if (!same) {
      s.overrides = std::move(saved);
      throw error("layerswap: settings cannot change after layerswap has handed out memory (budget " +
                  s.cfg->budget.to_string() + " is in force); set them before the first CUDA allocation");
    }
  }
  apply_locked(s, std::move(c));
}

caching_allocator& allocator_for(int device) {
  registry_state& s = state();
  if (device < 0 || device >= k_max_devices) {
    throw error("layerswap: device index " + std::to_string(device) + " is out of range");
  }
  if (caching_allocator* a = s.allocators[device].load(std::memory_order_acquire)) return *a;
  const config& cfg = global_config();
  std::lock_guard lock(s.mutex);
  if (caching_allocator* a = s.allocators[device].load(std::memory_order_acquire)) return *a;
  std::unique_ptr<driver> port = make_cuda_driver(device);
  allocator_options opts;
  const std::size_t total = port->total_memory();
  opts.budget = cfg.budget.resolve(total);
  opts.va_reserve = cfg.va_reserve;
  opts.oversize = cfg.oversize;
  opts.composites = cfg.composites;
  opts.split = cfg.split;
  opts.split_peak = cfg.split_peak;  // Note [Splits by reserve]
  constexpr std::size_t no_bound = std::numeric_limits<std::size_t>::max();  // Note [Split bound]
  opts.split_free = cfg.split_free.is_set() ? cfg.split_free.resolve(opts.budget) : no_bound;
  opts.split_free_peak = cfg.split_free_peak.is_set() ? cfg.split_free_peak.resolve(opts.budget) : no_bound;
  opts.reclaim_fit = cfg.reclaim_fit;
  // Swapping (allocator/residency.hpp): the engine runs when layerswap is on; its thread only under a budget, and
  // it moves regions only while the launch tracker feeds the residency gate.
  opts.residency.enabled = cfg.enabled;
  opts.residency.prefetch = cfg.prefetch;
  opts.residency.prefetch_tune = cfg.prefetch_tune;
  opts.residency.pin = pin_setting{cfg.pin_first, cfg.pin_last, cfg.pin_bytes};
  opts.residency.host_limit = cfg.host_limit;
  opts.residency.skip_clean = !cfg.writeback_always;
  opts.residency.cache_reserve_auto = cfg.cache_reserve_auto;
  opts.residency.cache_reserve = cfg.cache_reserve;
  opts.residency.reserve = cfg.reserve;
  opts.residency.reserve_ahead = cfg.reserve_ahead;
  auto* alloc = new caching_allocator(*port, opts);
  if (forecast_source* f = s.forecast.load(std::memory_order_acquire)) alloc->set_forecast_source(f);
  LAYERSWAP_LOG(info, "device %d: allocator ready (budget %s of %s)", device,
                opts.budget ? format_bytes(opts.budget).c_str() : "none", format_bytes(total).c_str());
  s.ports[device] = port.release();  // lives as long as the allocator: forever
  s.allocators[device].store(alloc, std::memory_order_release);
  s.created.fetch_add(1);
  if (cfg.stats && !s.exit_hook) {
    s.exit_hook = true;
    std::atexit(print_stats_at_exit);
  }
  return *alloc;
}

void set_stats_section(std::string (*section)()) noexcept {
  state().extra_stats.store(section, std::memory_order_release);
}

void set_forecast_source(forecast_source* source) noexcept {
  registry_state& s = state();
  std::lock_guard lock(s.mutex);
  s.forecast.store(source, std::memory_order_release);
  for (auto& slot : s.allocators) {
    if (caching_allocator* a = slot.load(std::memory_order_acquire)) a->set_forecast_source(source);
  }
}

caching_allocator* owner_of(const void* ptr) noexcept {
  registry_state& s = state();
  if (s.created.load(std::memory_order_acquire) == 0) return nullptr;
  for (auto& slot : s.allocators) {
    caching_allocator* a = slot.load(std::memory_order_acquire);
    if (a && a->in_arena(ptr)) return a;  // lock-free (Note [Free without a second lock])
  }
  return nullptr;
}

std::vector<caching_allocator*> allocators() noexcept {
  std::vector<caching_allocator*> out;
  registry_state& s = state();
  for (auto& slot : s.allocators) {
    if (caching_allocator* a = slot.load(std::memory_order_acquire)) out.push_back(a);
  }
  return out;
}

bool gpu_available() noexcept { return cuda_device_count() > 0; }

std::string stats_report() {
  std::string out;
  for (caching_allocator* a : allocators()) {
    const allocator_stats st = a->stats();
    const pool_stats& t = st.all;
    char line[2048];
    std::snprintf(line, sizeof line,
                  "layerswap: device %d: budget %s; device memory held %s (peak %s); allocated %s (peak %s) in %lld "
                  "allocations; %lld segments; cached %s; physical allocations made %lld, released %lld; reclaim "
                  "retries %lld, host waits %lld, OOMs %lld; %.3f s in %lld allocate/free calls; idle segments reclaimed %lld "
                  "for allocations, %lld for prefetches, %lld reused oversize; %lld composites of %lld idle segments; %lld split\n",
                  st.device, st.budget ? format_bytes(st.budget).c_str() : "none",
                  format_bytes(static_cast<std::uint64_t>(st.device_bytes.current)).c_str(),
                  format_bytes(static_cast<std::uint64_t>(st.device_bytes.peak)).c_str(),
                  format_bytes(static_cast<std::uint64_t>(t.allocated_bytes.current)).c_str(),
                  format_bytes(static_cast<std::uint64_t>(t.allocated_bytes.peak)).c_str(),
                  static_cast<long long>(t.allocations.current), static_cast<long long>(t.segments.current),
                  format_bytes(static_cast<std::uint64_t>(st.cached_bytes)).c_str(),
                  static_cast<long long>(st.num_device_alloc), static_cast<long long>(st.num_device_free),
                  static_cast<long long>(st.num_alloc_retries), static_cast<long long>(st.num_host_waits),
                  static_cast<long long>(st.num_ooms), static_cast<double>(st.call_ns) * 1e-9,
                  static_cast<long long>(st.num_calls), static_cast<long long>(st.num_reclaims),
                  static_cast<long long>(st.num_engine_reclaims), static_cast<long long>(st.num_oversize_reuses),
                  static_cast<long long>(st.num_composites), static_cast<long long>(st.composite_donors),
                  static_cast<long long>(st.num_splits));
    out += line;
    const residency_stats r = a->residency();
    if (r.evictions || r.prefetches || r.abandoned || r.host_bytes) {
      std::snprintf(line, sizeof line,
                    "layerswap: device %d: swapping: %s to host in %lld evictions (%lld stalled an allocation, %lld clean: no "
                    "copy), %s "
                    "back in %lld prefetches, %lld moves abandoned, %lld cancelled; host backing %s; regions %lld "
                    "swappable, %lld on the device, %lld on the host; hit rate %.4f (%llu of %llu launches found a "
                    "region on the host); %llu launches held on the GPU for a prefetch, %llu waited %.3f s on the host (%llu "
                    "gave up); chunks made %lld, released %lld, %s spare; cache reserve %s after %lld misses; the "
                    "reserve for activations followed the step in %lld policy rounds (turned on or off %lld times)\n",
                    st.device, format_bytes(static_cast<std::uint64_t>(r.bytes_d2h)).c_str(),
                    static_cast<long long>(r.evictions), static_cast<long long>(r.stall_evictions),
                    static_cast<long long>(r.writeback_skipped),
                    format_bytes(static_cast<std::uint64_t>(r.bytes_h2d)).c_str(), static_cast<long long>(r.prefetches),
                    static_cast<long long>(r.abandoned), static_cast<long long>(r.cancelled),
                    format_bytes(static_cast<std::uint64_t>(r.host_bytes)).c_str(),
                    static_cast<long long>(r.regions_swappable), static_cast<long long>(r.regions_resident),
                    static_cast<long long>(r.regions_on_host),
                    r.launches_counted ? 1.0 - static_cast<double>(r.launches_missed) /
                                                 static_cast<double>(r.launches_counted)
                                       : 1.0,
                    static_cast<unsigned long long>(r.launches_missed),
                    static_cast<unsigned long long>(r.launches_counted),
                    static_cast<unsigned long long>(r.launch_holds),
                    static_cast<unsigned long long>(r.launch_waits), static_cast<double>(r.launch_wait_us) * 1e-6,
                    static_cast<unsigned long long>(r.launch_wait_timeouts),
                    static_cast<long long>(r.chunks_created), static_cast<long long>(r.chunks_released),
                    format_bytes(static_cast<std::uint64_t>(r.spare_bytes)).c_str(),
                    format_bytes(static_cast<std::uint64_t>(r.cache_reserve_bytes)).c_str(),
                    static_cast<long long>(r.cache_misses), static_cast<long long>(r.reserve_followed),
                    static_cast<long long>(r.reserve_auto_changes));
      out += line;
    }
    if (r.prefetch_tunings || r.prefetch_tune_steps || r.prefetch_tune_abandoned) {  // LAYERSWAP_PREFETCH=tune
      char limit[32];
      if (r.prefetch_limit) {
        std::snprintf(limit, sizeof limit, "%lld regions", static_cast<long long>(r.prefetch_limit));
      } else {
        std::snprintf(limit, sizeof limit, "auto");
      }
      std::snprintf(line, sizeof line,
                    "layerswap: device %d: LAYERSWAP_PREFETCH=tune: %lld tunings finished, %lld abandoned for another "
                    "step length, %lld steps timed; the distance in force %s\n",
                    st.device, static_cast<long long>(r.prefetch_tunings),
                    static_cast<long long>(r.prefetch_tune_abandoned), static_cast<long long>(r.prefetch_tune_steps),
                    limit);
      out += line;
    }
  }
  if (out.empty()) out = "layerswap: no device memory was allocated through layerswap\n";
  if (std::string (*section)() = state().extra_stats.load(std::memory_order_acquire)) out += section();
  return out;
}

}  // namespace layerswap
