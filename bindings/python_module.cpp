// layerswap._C: the pybind11 module behind the Python package (bindings/python/layerswap). It exposes the
// configuration, installation into PyTorch, statistics, and a micro-benchmark hook. Settings errors become
// ValueError; other layerswap errors RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "allocator/registry.hpp"
#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/learner.hpp"
#include "bindings/torch_allocator.hpp"
#include "profiler/tracker.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/error.hpp"

namespace py = pybind11;
using namespace layerswap;

namespace {

std::vector<std::pair<std::string, std::string>> to_pairs(const std::map<std::string, std::string>& m) {
  return {m.begin(), m.end()};
}

py::dict stat_dict(const layerswap::stat& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

py::dict stats_dict(const allocator_stats& s) {
  py::dict d;
  d["device"] = s.device;
  d["budget"] = s.budget;
  d["granularity"] = s.granularity;
  d["device_bytes"] = stat_dict(s.device_bytes);
  d["allocated_bytes"] = stat_dict(s.all.allocated_bytes);
  d["requested_bytes"] = stat_dict(s.all.requested_bytes);
  d["reserved_bytes"] = stat_dict(s.all.reserved_bytes);
  d["active_bytes"] = stat_dict(s.all.active_bytes);
  d["allocations"] = stat_dict(s.all.allocations);
  d["segments"] = stat_dict(s.all.segments);
  d["small_segments"] = stat_dict(s.small.segments);  // slabs
  d["large_segments"] = stat_dict(s.large.segments);
  d["small_pool_reserved_bytes"] = stat_dict(s.small.reserved_bytes);
  d["large_pool_reserved_bytes"] = stat_dict(s.large.reserved_bytes);
  d["cached_bytes"] = s.cached_bytes;
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["num_host_waits"] = s.num_host_waits;
  d["host_wait_s"] = static_cast<double>(s.host_wait_us) * 1e-6;
  d["stall_s"] = static_cast<double>(s.stall_us) * 1e-6;
  d["num_lock_waits"] = s.num_lock_waits;
  d["lock_wait_s"] = static_cast<double>(s.lock_wait_us) * 1e-6;
  d["num_lock_spins"] = s.num_lock_spins;
  d["num_calls"] = s.num_calls;
  d["call_s"] = static_cast<double>(s.call_ns) * 1e-9;
  d["num_foreign_frees"] = s.num_foreign_frees;
  d["num_reclaims"] = s.num_reclaims;
  d["num_engine_reclaims"] = s.num_engine_reclaims;
  d["num_composites"] = s.num_composites;
  d["composite_donors"] = s.composite_donors;
  d["num_zombies_reaped"] = s.num_zombies_reaped;
  d["num_spare_composites"] = s.num_spare_composites;
  d["spare_composite_parts"] = s.spare_composite_parts;
  d["num_splits"] = s.num_splits;
  d["num_spare_splits"] = s.num_spare_splits;
  d["num_home_segments"] = s.num_home_segments;
  d["num_slab_reuses"] = s.num_slab_reuses;
  d["num_oversize_reuses"] = s.num_oversize_reuses;
  d["segment_new_s"] = static_cast<double>(s.segment_new_ns) * 1e-9;
  d["segment_destroy_s"] = static_cast<double>(s.segment_destroy_ns) * 1e-9;
  return d;
}

// One of residency_stats' arrays by the eighth of the learned step, as a list: counts as they are (count_list),
// microseconds as seconds (seconds_list).
template <std::size_t N>
py::list count_list(const std::array<std::int64_t, N>& values) {
  py::list out;
  for (const std::int64_t v : values) out.append(v);
  return out;
}
template <std::size_t N>
py::list seconds_list(const std::array<std::int64_t, N>& us) {
  py::list out;
  for (const std::int64_t v : us) out.append(static_cast<double>(v) * 1e-6);
  return out;
}

py::dict residency_dict(const residency_stats& r) {
  py::dict d;
  d["active"] = r.active;
  d["bytes_h2d"] = r.bytes_h2d;
  d["bytes_d2h"] = r.bytes_d2h;
  d["evictions"] = r.evictions;
  d["prefetches"] = r.prefetches;
  d["abandoned"] = r.abandoned;
  d["cancelled"] = r.cancelled;
  d["stall_evictions"] = r.stall_evictions;
  d["writeback_skipped"] = r.writeback_skipped;
  d["digests_carried"] = r.digests_carried;
  d["writeback_checked"] = r.writeback_checked;
  d["host_bytes"] = r.host_bytes;
  d["regions_swappable"] = r.regions_swappable;
  d["regions_resident"] = r.regions_resident;
  d["regions_on_host"] = r.regions_on_host;
  d["moves_in_flight"] = r.moves_in_flight;
  d["launches_counted"] = r.launches_counted;
  d["launches_missed"] = r.launches_missed;
  d["launch_waits"] = r.launch_waits;
  d["launch_wait_s"] = static_cast<double>(r.launch_wait_us) * 1e-6;
  d["launch_wait_timeouts"] = r.launch_wait_timeouts;
  d["launch_holds"] = r.launch_holds;
  d["launch_remap_waits"] = r.launch_remap_waits;
  d["launch_remap_wait_s"] = static_cast<double>(r.launch_remap_wait_us) * 1e-6;
  d["policy_rounds"] = r.policy_rounds;
  d["idle_sleeps"] = r.idle_sleeps;
  d["policy_s"] = static_cast<double>(r.policy_us) * 1e-6;
  d["maintain_s"] = static_cast<double>(r.maintain_us) * 1e-6;
  d["room_s"] = static_cast<double>(r.room_us) * 1e-6;
  d["remap_s"] = static_cast<double>(r.remap_us) * 1e-6;
  d["stage_s"] = static_cast<double>(r.stage_us) * 1e-6;
  d["remap_in_s"] = static_cast<double>(r.remap_in_us) * 1e-6;
  d["remap_out_s"] = static_cast<double>(r.remap_out_us) * 1e-6;
  d["chunks_created"] = r.chunks_created;
  d["chunks_released"] = r.chunks_released;
  d["spare_bytes"] = r.spare_bytes;
  d["chunks_for_segments"] = r.chunks_for_segments;
  d["chunks_released_for_size"] = r.chunks_released_for_size;
  d["chunks_released_for_pages"] = r.chunks_released_for_pages;
  d["cache_reserve_bytes"] = r.cache_reserve_bytes;
  d["reserve_bytes"] = r.reserve_bytes;
  d["reserve_followed"] = r.reserve_followed;
  d["reserve_auto_changes"] = r.reserve_auto_changes;
  d["cache_misses"] = r.cache_misses;
  d["prefetch_limit"] = r.prefetch_limit;
  d["prefetch_tunings"] = r.prefetch_tunings;
  d["prefetch_tune_steps"] = r.prefetch_tune_steps;
  d["prefetch_tune_abandoned"] = r.prefetch_tune_abandoned;
  d["late_prefetches"] = r.late_prefetches;
  d["late_bytes"] = r.late_bytes;
  d["late_lead_s"] = static_cast<double>(r.late_lead_us) * 1e-6;
  d["late_copy_wait_s"] = static_cast<double>(r.late_copy_wait_us) * 1e-6;
  d["late_remap_wait_s"] = static_cast<double>(r.late_remap_wait_us) * 1e-6;
  d["late_wait_s_by_phase"] = seconds_list(r.late_wait_us_by_phase);
  d["transient_peak_by_phase"] = count_list(r.transient_peak_by_phase);
  d["remap_s_by_phase"] = seconds_list(r.remap_us_by_phase);
  d["evicted_bytes_by_phase"] = count_list(r.evicted_bytes_by_phase);
  d["prefetched_bytes_by_phase"] = count_list(r.prefetched_bytes_by_phase);
  if (r.launches_counted) {
    d["hit_rate"] = 1.0 - static_cast<double>(r.launches_missed) / static_cast<double>(r.launches_counted);
  } else {
    d["hit_rate"] = py::none();
  }
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "layerswap native module: VMM caching allocator for PyTorch";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const config_error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const out_of_memory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });

  m.def("configure", [](const std::map<std::string, std::string>& overrides) {
    auto pairs = to_pairs(overrides);
    configure(pairs);
  }, py::arg("overrides"), "Apply settings (full LAYERSWAP_* names) over the environment.");

  m.def("check_settings", [](const std::map<std::string, std::string>& overrides) {
    auto vars = environment_settings();
    for (auto& kv : overrides) vars.emplace_back(kv.first, kv.second);
    return parse_config(vars).describe();
  }, py::arg("overrides"), "Parse the environment plus overrides without applying them; returns the description.");

  m.def("install", [] {
    py::gil_scoped_release release;
    torch_binding::install();
  }, "Make layerswap PyTorch's CUDA allocator.");
  m.def("is_installed", [] { return torch_binding::installed(); });
  m.def("native_allocator_initialized", [] { return torch_binding::native_initialized(); });
  m.def("gpu_available", [] { return gpu_available(); });

  m.def("config", [] {
    // Every row of the settings table, from the description the config command prints ("NAME=value  (note)").
    std::map<std::string, std::string> out;
    std::istringstream in(global_config().describe());
    for (std::string line; std::getline(in, line);) {
      const std::size_t eq = line.find('=');
      if (line.rfind("LAYERSWAP", 0) != 0 || eq == std::string::npos) continue;  // unknown settings' lines
      std::string value = line.substr(eq + 1);
      if (const std::size_t note = value.find("  ("); note != std::string::npos) value.resize(note);
      out[line.substr(0, eq)] = value;
    }
    return out;
  }, "The settings in force, by variable name.");
  m.def("describe_config", [] { return global_config().describe(); });
  m.def("unknown_settings", [] { return global_config().unknown; });
  m.def("settings_table", [] {
    std::vector<std::tuple<std::string, std::string, std::string, std::string>> rows;
    for (const setting_info& s : settings_table()) rows.emplace_back(s.name, s.default_value, s.accepted, s.help);
    return rows;
  });

  m.def("stats", [] {
    py::list out;
    for (caching_allocator* a : allocators()) {
      py::dict d = stats_dict(a->stats());
      d["residency"] = residency_dict(a->residency());
      // The driver port's calls, process-wide, by caller: "engine" (the migration thread) or "program".
      py::dict calls;
      py::dict call_s;
      driver_calls::for_each([&](const driver_calls::row& r) {
        const std::string key = std::string(r.engine ? "engine." : "program.") + r.name;
        calls[py::str(key)] = r.calls;
        call_s[py::str(key)] = static_cast<double>(r.ns) * 1e-9;
      });
      d["driver_calls"] = calls;
      d["driver_call_s"] = call_s;
      out.append(d);
    }
    return out;
  }, "Statistics of every device allocator created so far.");
  m.def("stats_report", [] { return stats_report(); });
  m.def("empty_cache", [] {
    py::gil_scoped_release release;
    for (caching_allocator* a : allocators()) a->empty_cache();
  });

  // ---- the launch tracker (profiler/tracker.hpp, docs/tracker.md) ----
  // These take locks and may wait on the tracker's consumer thread: the GIL is released around each call.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("tracker_start", &profiler::tracker_start, no_gil,
        "Take CUPTI and track launches; False when CUPTI is missing or held by another subscriber.");
  m.def("tracker_stop", &profiler::tracker_stop, no_gil);
  m.def("tracker_pause", &profiler::tracker_pause, no_gil,
        "Release CUPTI (for torch.profiler); True when tracking was on.");
  m.def("tracker_resume", &profiler::tracker_resume, no_gil,
        "Retake CUPTI after tracker_pause(); True when tracking is on afterwards.");
  m.def("tracker_set_mode", [](const std::string& api, bool subscribe_only) {
    if (api != "both" && api != "driver") throw py::value_error("api must be \"both\" or \"driver\", not \"" + api + "\"");
    profiler::tracker_set_mode({api == "driver" ? profiler::tracker_api::driver : profiler::tracker_api::both,
                                subscribe_only});
  }, py::arg("api"), py::arg("subscribe_only") = false,
        "The callbacks the next subscription takes (start/resume): LAYERSWAP_TRACK_API and "
        "LAYERSWAP_TRACK=subscribe-only, switchable between pause() and resume() (for benchmarks).");
  m.def("tracker_mode", [] {
    const profiler::tracker_mode mode = profiler::tracker_get_mode();
    py::dict d;
    d["api"] = mode.api == profiler::tracker_api::driver ? "driver" : "both";
    d["subscribe_only"] = mode.subscribe_only;
    return d;
  }, "The mode of the current subscription (or of the next one when none is active).");
  m.def("tracker_stats", [] {
    py::dict d;
    d["active"] = profiler::tracker_active();
    d["paused"] = profiler::tracker_paused();
    d["subscriber_busy"] = profiler::tracker_subscriber_busy();
    d["problem"] = profiler::tracker_problem();
    d["param_info_errors"] = profiler::tracker_param_info_errors();
    profiler::tracker_core* core = profiler::tracker_instance();
    if (core == nullptr) return d;
    profiler::tracker_stats s;
    {
      py::gil_scoped_release release;
      s = core->stats();
    }
    d["launches"] = s.launches;
    d["kernels"] = s.kernels;
    d["copies"] = s.copies;
    d["memsets"] = s.memsets;
    d["graphs"] = s.graphs;
    d["decoded"] = s.decoded;
    d["undecoded"] = s.launches - s.decoded;
    py::dict reasons;
    for (int r = 1; r < profiler::k_undecoded_reasons; ++r) {
      reasons[profiler::reason_name(static_cast<profiler::undecoded_reason>(r))] = s.undecoded[r];
    }
    d["undecoded_by_reason"] = reasons;
    d["with_regions"] = s.with_regions;
    d["truncated"] = s.truncated;
    d["dropped"] = s.dropped;
    d["nested_skipped"] = s.nested_skipped;
    d["pointer_tables"] = s.pointer_tables;
    d["table_launches"] = s.table_launches;
    d["launch_api_s"] = static_cast<double>(s.launch_api_ns) * 1e-9;
    d["launch_api_calls"] = s.launch_api_calls;
    d["launch_driver_s"] = static_cast<double>(s.launch_driver_ns) * 1e-9;
    // LAYERSWAP_TRACK=attribute (profiler/cupti_tracker.cpp, Note [Launches beside the engine's calls]): flat
    // keys, so that benchmarks take differences of them as of every other number here. launch_engine_<kind>_*:
    // the launches that met the engine in a driver call of that kind (none: in no call); launch_hist_<b>_*: those
    // whose driver part was below launch_hist_<b>_upper_s (the last bucket has no upper bound).
    if (std::any_of(s.launch_engine_calls.begin(), s.launch_engine_calls.end(), [](auto n) { return n != 0; })) {
      for (std::size_t i = 0; i < profiler::k_engine_states; ++i) {
        const std::string kind = profiler::engine_state_name(i);
        d[py::str("launch_engine_" + kind + "_calls")] = s.launch_engine_calls[i];
        d[py::str("launch_engine_" + kind + "_s")] = static_cast<double>(s.launch_engine_ns[i]) * 1e-9;
      }
      for (std::size_t b = 0; b < profiler::k_launch_hist; ++b) {
        const std::string at = "launch_hist_" + std::to_string(b);
        d[py::str(at + "_calls")] = s.launch_hist_calls[b];
        d[py::str(at + "_s")] = static_cast<double>(s.launch_hist_ns[b]) * 1e-9;
        d[py::str(at + "_upper_s")] = static_cast<double>(s.launch_hist_upper_ns[b]) * 1e-9;
      }
    }
    d["recent_dropped"] = s.recent_dropped;
    d["consumer_sleeps"] = s.consumer_sleeps;
    d["trace_written"] = s.trace_written;
    d["trace_skipped"] = s.trace_skipped;
    d["functions"] = s.functions;
    py::dict families;
    for (const auto& [family, count] : s.no_region_families) families[py::str(family)] = count;
    d["no_region_families"] = families;
    return d;
  }, "Launch tracker counters.");
  m.def("tracker_drain", [](std::size_t max) {
    py::list out;
    profiler::tracker_core* core = profiler::tracker_instance();
    if (core == nullptr) return out;
    std::vector<profiler::drained_event> events;
    {
      py::gil_scoped_release release;
      events = core->drain(max);
    }
    for (const auto& e : events) {
      py::list regions;
      for (const region_id r : e.regions) regions.append(r);
      out.append(py::make_tuple(e.launch_no, e.stream, core->kernel_name(e.kind, e.kernel), regions));
    }
    return out;
  }, py::arg("max") = std::size_t{1} << 20,
        "Up to `max` of the oldest tracked launches, as (launch_no, stream, kernel, [region ids]); they are removed.");
  m.def("region_of", [](std::uintptr_t ptr) { return region_map::lookup(static_cast<std::uint64_t>(ptr)); },
        py::arg("ptr"), "The layerswap region holding a device address, or 0.");

  m.def("region_info", [](std::uintptr_t ptr) {
    const region_id id = region_map::lookup(static_cast<std::uint64_t>(ptr));
    py::dict d;
    d["region"] = id;
    d["persistent"] = residency_gate::persistent(id);
    d["on_host"] = residency_gate::on_host(id);
    d["sequence"] = residency_gate::sequence(id);
    d["last_use"] = residency_gate::last_use(id);
    return d;
  }, py::arg("ptr"), "Diagnostics: the region of a device address and its residency gate state.");
  m.def("learner_stats", [] {
    py::dict d;
    const profiler::learner* l = profiler::tracker_learner();
    if (l == nullptr) return d;
    const profiler::learner_stats s = l->stats();
    d["learned"] = s.learned;
    d["generation"] = s.generation;
    d["launches"] = s.launches;
    d["steps"] = s.steps;
    d["period"] = s.period;
    d["recurring_regions"] = s.recurring_regions;
    d["groups"] = s.groups;
    d["learns"] = s.learns;
    d["relearns"] = s.relearns;
    d["predicted"] = s.predicted;
    d["hits"] = s.hits;
    d["tracked_regions"] = s.tracked_regions;
    return d;
  }, "The learner's view of the step (period, recurring regions, groups, relearns).");
  m.def("bench_alloc_free", [](std::size_t nbytes, int iters) {
    return torch_binding::bench_alloc_free(nbytes, iters);
  }, py::arg("nbytes"), py::arg("iters"),
        "Median microseconds of one alloc+free pair through PyTorch's current CUDA allocator.");
}
