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

#include <algorithm>
#include <cstddef>
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

// Note [Pointer tables]
//   Some kernels reach their tensors through an array of addresses in device memory rather than through their
//   arguments: PyTorch's split_with_sizes_copy (FSDP2's all-gather copy-out, which writes a layer's unsharded
//   parameters) and _chunk_cat (its reduce-scatter copy-in, which reads the gradients) pack the tensors'
//   addresses on the host, copy the pack to the device with a small host-to-device copy, and pass the pack's
//   device address. Unseen, those tensors could be remapped under the kernel (a fault: DESIGN.md invariant 3) or
//   moved while it writes them (a lost write: invariant 4). So the source of a copy of at most k_max_pack_bytes
//   from host memory into a region is scanned like arguments, word by word, over its first k_pack_scan_bytes
//   (the packs put the addresses first: split_with_sizes_copy's holds the destinations' and sources' addresses,
//   then sizes, then a word per thread block, up to ~35 KB on an H100); when it holds addresses in regions, the
//   thread remembers them as a table: the destination range and those regions. A kernel that the same thread
//   launches within k_table_lifetime kernels, and one of whose argument words points into a remembered range,
//   touches the table's regions too: they enter the gate with its own and are recorded with it. A table with more
//   regions than it holds makes such a kernel an unknown launch (Note [Unknown launches] in residency_gate.hpp).
//   The pack and its kernel come from one operator call, so one thread's memory suffices; a pack copied by one
//   thread and used by another's kernel is not seen, nor are addresses a kernel computes on the device (NCCL's
//   work in its FIFO, Note [Work elsewhere]): the limits of the tracker's sight (docs/tracker.md).
inline constexpr int k_pointer_tables = 8;           // the tables a thread remembers (the oldest is replaced)
inline constexpr int k_table_regions = 32;           // regions a table holds
inline constexpr std::size_t k_max_pack_bytes = std::size_t{1} << 20;  // larger copies are data, not scanned
inline constexpr std::size_t k_pack_scan_bytes = 4096;  // the words scanned: 256 tensors' two addresses
inline constexpr std::uint64_t k_table_lifetime = 4;    // kernels of the thread a table applies to

// Note [Work elsewhere]
//   NCCL's kernels take their work (each collective's buffers' addresses) in their arguments while it fits in
//   their 4 KiB of parameters, and from NCCL's work FIFO, a ring in pinned host memory, when it does not: a group
//   of many collectives (a coalesced all-reduce of many tensors). Then their arguments hold only the FIFO's
//   offsets, and the tracker would record a kernel that touches no region while it reads and writes the program's
//   buffers: a move could copy a buffer it is writing, or a remap run under it (DESIGN.md invariants 3 and 4). The
//   FIFO's layout is NCCL's own and changes between versions, so the tracker does not read it; instead a kernel
//   whose name is NCCL's (takes_work_elsewhere, layout_cache.hpp) and whose arguments name no region is an unknown
//   launch (Note [Unknown launches] in residency_gate.hpp). The buffers of an NCCL kernel come from the program's
//   allocator, so one whose work is in its arguments names their regions and is recorded as any kernel; one that
//   names none is rare (the FSDP2 and DDP runs of sessions 56-57 had none): safe, and slow only where frequent.
struct pointer_table {
  std::uint64_t begin = 0;  // the device range the pack was copied to (bytes == 0: unused)
  std::uint64_t bytes = 0;
  std::uint64_t born = 0;     // the thread's kernel count when it was copied
  std::uint64_t made = 0;     // the thread's count of tables made, then (the oldest is replaced first)
  region_id home = 0;         // the region of the range (a kernel not touching it is not scanned again)
  std::uint32_t count = 0;
  bool overflow = false;      // more regions than ids[] holds
  region_id ids[k_table_regions]{};
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
  bool table_used = false;           // the kernel being recorded points into a pointer table ...
  bool table_unknown = false;        // ... one that overflowed
  std::uint32_t tables_live = 0;     // pointer tables in use (Note [Pointer tables]); 0: a compare per launch
  std::uint64_t kernels = 0;         // kernel launches recorded on this thread (the tables' clock)
  std::uint64_t tables_made = 0;     // pointer tables made by this thread
  launch_nesting nesting;
  region_set regions;
  launch_gate<residency_gate_calls> gate;
  param_slot params[k_max_params];  // only while a function's layout is queried
  pointer_table tables[k_pointer_tables];
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

// Note [Pointer tables]: an argument word inside a live table's range adds the table's regions to the launch's
// set (t_scratch.regions). Returns 0 so that the set given to the decoder is left alone.
inline region_id lookup_tables(std::uint64_t address) noexcept {
  thread_scratch& t = t_scratch;
  for (const pointer_table& e : t.tables) {
    if (e.bytes == 0 || address - e.begin >= e.bytes) continue;
    for (std::uint32_t i = 0; i < e.count; ++i) t.regions.add(e.ids[i]);
    t.table_used = true;
    t.table_unknown |= e.overflow;
  }
  return 0;
}

// The tables the launch being recorded may use: live (younger than k_table_lifetime kernels of this thread) and
// in a region its arguments point into. Expired tables are dropped here.
inline bool tables_apply(thread_scratch& t, const region_set& regions) noexcept {
  bool any = false;
  for (pointer_table& e : t.tables) {
    if (e.bytes == 0) continue;
    if (t.kernels - e.born > k_table_lifetime) {
      e.bytes = 0;
      --t.tables_live;
      continue;
    }
    any = any || regions.contains(e.home);
  }
  return any;
}

// A kernel's argument words through `lookup` into `out`: its parameters by their layout, else its `extra` buffer.
// Returns why they could not be read, or none.
inline undecoded_reason decode_arguments(const layout_lookup& found, void* const* args, void* const* extra,
                                         region_lookup_fn lookup, region_set& out) noexcept {
  if (args != nullptr) {
    if (!found.has_layout) return undecoded_reason::no_layout;
    decode_params(found.layout, args, lookup, out);
  } else if (const extra_buffer buffer = parse_extra(extra); buffer.data != nullptr) {
    scan_words(buffer.data, buffer.size, lookup, out);
  } else {
    return undecoded_reason::no_args;
  }
  return undecoded_reason::none;
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
  std::uint64_t query_context = 0;  // scratch for the query function (driver_query keeps a flag in it)
  const layout_lookup found = core.layouts().find_or_add(function, name, query, &query_context, t.params);
  undecoded_reason reason = detail::decode_arguments(found, args, extra, region_map::lookup, regions);
  ++t.kernels;
  t.table_used = t.table_unknown = false;
  if (t.tables_live != 0 && detail::tables_apply(t, regions)) {  // Note [Pointer tables]: the words again
    region_set words;  // only its word count changes: lookup_tables adds to `regions` and returns 0
    (void)detail::decode_arguments(found, args, extra, detail::lookup_tables, words);
    if (t.table_unknown) t.gate.add(residency_gate::k_unknown_region);
    if (t.table_used) core.count_table_launch();
  }
  if (regions.count > 0) {
    reason = undecoded_reason::none;
  } else if (found.work_elsewhere && reason == undecoded_reason::none) {
    reason = undecoded_reason::work_elsewhere;  // Note [Work elsewhere]
  }
  t.gate.add_all(regions);
  // Arguments not read: the launch may touch any region (residency_gate.hpp, Note [Unknown launches]).
  if (reason != undecoded_reason::none) t.gate.add(residency_gate::k_unknown_region);
  detail::count_residency(regions, t);
  if (regions.truncated) {  // more regions than the set holds: enter the rest too
    region_set rest;  // only its word count changes: lookup_into_gate returns 0
    (void)detail::decode_arguments(found, args, extra, detail::lookup_into_gate, rest);
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

// A copy from host memory at `host` (readable now: the caller knows it is host memory) into `dst`, of `bytes`.
// Recorded as record_copy records it; a small one into a region has its source scanned for region addresses and,
// when it holds some, becomes one of the thread's pointer tables (Note [Pointer tables]).
inline void record_host_copy(tracker_core& core, thread_scratch& t, std::uint64_t stream, std::uint64_t dst,
                             const void* host, std::size_t bytes) noexcept {
  record_copy(core, t, launch_kind::memcpy, stream, dst, 0);
  if (stream != 0 && residency_gate::internal_stream(stream)) return;
  if (host == nullptr || bytes < sizeof(std::uint64_t) || bytes > k_max_pack_bytes || t.regions.count == 0) return;
  const region_id home = t.regions.ids[0];
  region_set& found = t.regions;  // the copy is recorded: the set is free again
  found.clear();
  scan_words(host, std::min(bytes, k_pack_scan_bytes), region_map::lookup, found);
  // A table for the same range is gone (the pack was overwritten); the new one takes its place, else an unused
  // one, else the oldest.
  pointer_table* slot = nullptr;
  for (pointer_table& e : t.tables) {
    if (e.bytes != 0 && e.begin == dst) {
      slot = &e;
      e.bytes = 0;
      --t.tables_live;
      break;
    }
  }
  if (found.count == 0) return;  // data, not addresses
  for (pointer_table& e : t.tables) {
    if (slot == nullptr || (slot->bytes != 0 && (e.bytes == 0 || e.made < slot->made))) slot = &e;
  }
  if (slot->bytes != 0) --t.tables_live;
  slot->begin = dst;
  slot->bytes = bytes;
  slot->born = t.kernels;
  slot->made = ++t.tables_made;
  slot->home = home;
  slot->overflow = found.truncated || found.count > k_table_regions;
  slot->count = static_cast<std::uint32_t>(std::min<int>(found.count, k_table_regions));
  std::copy_n(found.ids, slot->count, slot->ids);
  ++t.tables_live;
  core.count_pointer_table();
}

// A graph launch: counted, its nodes' arguments are not visible.
inline void record_graph(tracker_core& core, thread_scratch& t, std::uint64_t stream) noexcept {
  detail::note_stream(t, stream);
  t.regions.clear();
  t.gate.add(residency_gate::k_unknown_region);  // its kernels' arguments are not visible
  core.record(launch_kind::graph, stream, 0, undecoded_reason::graph, t.regions);
}

}  // namespace layerswap::profiler
