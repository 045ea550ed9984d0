// The access event: what the launch tracker makes of one kernel launch, copy, memset or graph launch.
// Plain data, fixed size, so that the CUPTI callback can write it into the ring without allocating.
#pragma once

#include <cstdint>

#include "allocator/region_map.hpp"

namespace layerswap::profiler {

enum class launch_kind : std::uint8_t { kernel, memcpy, memset, graph };

// Why a launch's arguments could not be read (stats; undecoded launches still make an event).
enum class undecoded_reason : std::uint8_t {
  none,       // decoded: a layout was read, or an `extra` buffer was scanned, or a word matched a region
  no_layout,  // the param info queries failed for this function and no `extra` buffer was given
  no_args,    // no kernelParams and no `extra` buffer
  graph,      // a graph launch: its nodes' arguments are not visible at launch time
  work_elsewhere,  // an NCCL kernel naming no region: its work is in NCCL's FIFO (Note [Work elsewhere])
  count_
};
inline constexpr int k_undecoded_reasons = static_cast<int>(undecoded_reason::count_);
[[nodiscard]] const char* reason_name(undecoded_reason r) noexcept;

// Region ids held inline by one event; a launch touching more regions continues in further events with the
// same launch number and `continued` set. 6 makes an event 56 bytes: with the ring's sequence number, a ring cell
// is exactly one cache line (event_ring.hpp), the one line a launch writes there. Most launches touch at most 6
// regions (a GEMM's two operands and output, an elementwise kernel's inputs and output); a foreach kernel's dozens
// take several events.
inline constexpr int k_event_regions = 6;

struct access_event {
  std::uint64_t launch_no = 0;  // process-wide launch number, from 1
  std::uint64_t stream = 0;     // CUstream / cudaStream_t value (0: legacy default stream)
  std::uint64_t time_ns = 0;    // steady clock at the launch call; 0 unless a trace is written (tracker_core)
  std::uint32_t kernel = 0;     // kernel id (layout_cache), 0 for copies, memsets and graphs
  launch_kind kind = launch_kind::kernel;
  undecoded_reason reason = undecoded_reason::none;
  std::uint8_t nregions = 0;
  std::uint8_t flags = 0;  // k_flag_*
  region_id regions[k_event_regions];
};

static_assert(sizeof(access_event) == 56, "a ring cell of an access event should be one cache line");

inline constexpr std::uint8_t k_flag_continued = 1;  // more regions of an earlier event with this launch_no
inline constexpr std::uint8_t k_flag_truncated = 2;  // the launch touched more regions than were recorded

}  // namespace layerswap::profiler
