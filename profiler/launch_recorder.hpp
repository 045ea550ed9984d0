// What the CUPTI launch callback does with a launch once it has read the API's parameters, without any CUDA or
// CUPTI type: decode the arguments into regions, enter them into the residency gate, and record the access
// event. cupti_tracker.cpp calls these from its callback; tests/perf/tracker_hotpath_bench.cpp calls the same
// code with synthetic launches to measure the callback's own cost without a GPU.
//
// Everything here runs on the launching thread inside the callback: no allocation, no lock, no logging. The
// per-thread scratch is one constant-initialized thread_local, fetched once per callback (one TLS lookup) and
// passed down by reference.
//
// Note [One TLS lookup per callback]
//   layerswap is a shared library that Python loads with dlopen, so a thread_local is reached through
//   __tls_get_addr (the general-dynamic model; the static TLS block that the one-instruction models need is too
//   small for this ~20 KiB scratch). Knowing that `t` is &t_scratch, GCC 12 called __tls_get_addr again wherever
//   keeping the address in a register was dearer: 177 call sites in on_callback, more than one on a launch's path.
//   this_thread_scratch() hides the address behind an empty asm, so the compiler keeps the pointer it got: one call
//   site (objdump -dr of cupti_tracker.cpp.o counts them), and 3 KB less code. On an H100 the cost per launch and
//   the LoRA step did not change beyond the noise (docs/history.md, session 35).
#pragma once

#include <cstdint>

#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/arg_decoder.hpp"
#include "profiler/launch_dedupe.hpp"
#include "profiler/launch_gate.hpp"
#include "profiler/layout_cache.hpp"
#include "profiler/tracker_core.hpp"
#include "runtime/fast_clock.hpp"

namespace layerswap::profiler {

// The residency gate, as launch_gate calls it (Note [Gate bookkeeping]).
struct residency_gate_calls {
  static bool enter(region_id id) noexcept { return residency_gate::enter(id); }
  static void exit(region_id id, std::uint64_t launch_no) noexcept { residency_gate::exit(id, launch_no); }
  static residency_gate::entry_state enter_holding(region_id id, residency_gate::hold& h) noexcept {
    return residency_gate::enter_holding(id, h);
  }
  static void exit_held(region_id id, std::uint64_t launch_no) noexcept { residency_gate::exit_held(id, launch_no); }
};

// Ordered so that a launch with few regions touches the first few cache lines of each member: the counters
// of the region_set and the gate come before their id arrays (about 2.3 KiB in all for such a launch).
struct thread_scratch {
  std::uint32_t generation = 0;  // the subscription this thread's nesting and gate frames belong to
  std::uint64_t stream = 0;      // the stream of the launch being recorded (where its holds' waits go)
  std::uint64_t context = 0;     // ... and its context (the callback's)
  std::uint64_t noted_stream = 0;  // the stream this thread last noted in the gate (Note [Launch streams]) ...
  std::uint64_t noted_epoch = 0;   // ... at this epoch of the gate's forgotten streams
  std::uint64_t api_start = 0;   // fast_clock::ticks() when the kernel launch in flight was recorded (0: none)
  std::uint64_t api_entered = 0; // ... and when its entry callback returned (the gate entered, holds enqueued)
  std::uint8_t engine_at_entry = 0;  // LAYERSWAP_TRACK=attribute: the engine's driver call then (driver_calls)
  launch_nesting nesting;
  region_set regions;
  launch_gate<residency_gate_calls> gate;
  param_slot params[k_max_params];  // only while a function's layout is queried
};

namespace detail {
inline constinit thread_local thread_scratch t_scratch;

// A region lookup that enters every hit straight into the open gate frame (re-decoding a launch whose regions
// overflowed the region_set: Note [Gate bookkeeping]). Returns 0 so that the region_set is left alone.
inline region_id lookup_into_gate(std::uint64_t address) noexcept {
  if (const region_id id = region_map::lookup(address)) t_scratch.gate.add(id);
  return 0;
}

inline void add_pointer(region_set& set, std::uint64_t address) noexcept {
  if (const region_id id = region_map::lookup(address)) set.add(id);
}

// Note [Launch streams] (residency_gate.hpp): the launch's stream, for the residency engine's fences; once per
// thread, stream and epoch of forgotten streams, so a compare per launch. CUDA's special handles (0, 1
// CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD) are not noted: the engine fences the legacy stream.
inline void note_stream(thread_scratch& t, std::uint64_t stream) noexcept {
  if (stream <= 2) return;
  const std::uint64_t epoch = residency_gate::streams_epoch();
  if (stream == t.noted_stream && epoch == t.noted_epoch) return;
  residency_gate::note_stream(stream, t.context);
  t.noted_stream = stream;
  t.noted_epoch = epoch;
}

// The hit rate, while a residency engine counts it: was one of the launch's regions backed by host pages when
// the gate entered it (after any wait for its prefetch)?
inline void count_residency(const region_set& regions, const thread_scratch& t) noexcept {
  if (regions.count == 0 || !residency_gate::counting()) return;
  residency_gate::count_launch(t.gate.touched_host());
}
}  // namespace detail

// The calling thread's scratch (one TLS lookup: call once per callback). Note [One TLS lookup per callback].
inline thread_scratch& this_thread_scratch() noexcept {
  thread_scratch* scratch = &detail::t_scratch;
#if defined(__GNUC__)
  asm("" : "+r"(scratch));  // the compiler no longer knows where it points: it keeps it instead of asking again
#endif
  return *scratch;
}

// A kernel launch with either kernelParams (+ the layout `query` answers) or an `extra` buffer. The gate frame
// must be open (t.gate.open()).
inline void record_kernel(tracker_core& core, thread_scratch& t, param_query_fn query, std::uint64_t function,
                          const char* name, std::uint64_t stream, void* const* args, void* const* extra) noexcept {
  t.api_start = fast_clock::ticks();  // the launch call's time runs from here to its exit callback (tracker_stats::launch_api_ns)
  if (stream != 0 && residency_gate::internal_stream(stream)) return;  // the residency engine's digest kernel
  region_set& regions = t.regions;
  regions.clear();
  t.stream = stream;
  detail::note_stream(t, stream);
  undecoded_reason reason = undecoded_reason::none;
  std::uint64_t query_context = 0;  // scratch for the query function (driver_query keeps a flag in it)
  const layout_lookup found = core.layouts().find_or_add(function, name, query, &query_context, t.params);
  if (args != nullptr) {
    if (found.has_layout) {
      decode_params(found.layout, args, region_map::lookup, regions);
    } else {
      reason = undecoded_reason::no_layout;
    }
  } else if (const extra_buffer buffer = parse_extra(extra); buffer.data != nullptr) {
    scan_words(buffer.data, buffer.size, region_map::lookup, regions);
  } else {
    reason = undecoded_reason::no_args;
  }
  if (regions.count > 0) reason = undecoded_reason::none;
  t.gate.add_all(regions);
  // Arguments not read: the launch may touch any region (residency_gate.hpp, Note [Unknown launches]).
  if (reason != undecoded_reason::none) t.gate.add(residency_gate::k_unknown_region);
  detail::count_residency(regions, t);
  if (regions.truncated) {  // more regions than the set holds: enter the rest too
    region_set rest;  // only its word count changes: lookup_into_gate returns 0
    if (args != nullptr) {
      if (found.has_layout) decode_params(found.layout, args, detail::lookup_into_gate, rest);
    } else if (const extra_buffer buffer = parse_extra(extra); buffer.data != nullptr) {
      scan_words(buffer.data, buffer.size, detail::lookup_into_gate, rest);
    }
  }
  t.gate.set_launch(core.record(launch_kind::kernel, stream, found.kernel, reason, regions));
}

// A copy or memset touching `dst` and `src` (0: none). The gate frame must be open.
inline void record_copy(tracker_core& core, thread_scratch& t, launch_kind kind, std::uint64_t stream,
                        std::uint64_t dst, std::uint64_t src) noexcept {
  if (stream != 0 && residency_gate::internal_stream(stream)) return;  // the residency engine's own move
  region_set& regions = t.regions;
  regions.clear();
  t.stream = stream;
  detail::note_stream(t, stream);
  t.gate.no_holds();  // the driver reads a copy's pointers in the call (launch_gate.hpp, Note [Held regions])
  detail::add_pointer(regions, dst);
  if (src != 0) detail::add_pointer(regions, src);
  t.gate.add_all(regions);
  detail::count_residency(regions, t);
  t.gate.set_launch(core.record(kind, stream, 0, undecoded_reason::none, regions));
}

// A graph launch: counted, its nodes' arguments are not visible.
inline void record_graph(tracker_core& core, thread_scratch& t, std::uint64_t stream) noexcept {
  detail::note_stream(t, stream);
  t.regions.clear();
  t.gate.add(residency_gate::k_unknown_region);  // its kernels' arguments are not visible
  core.record(launch_kind::graph, stream, 0, undecoded_reason::graph, t.regions);
}

}  // namespace layerswap::profiler
