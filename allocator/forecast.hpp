// What the residency policy knows about the future: the learner (profiler/learner) publishes it, the policy
// (allocator/) reads it. The allocator sees the forecast only through this interface, never the profiler.
//
// A forecast is a list of the regions the program will touch next, each once, in the order of their next
// use from the learner's current position in the step, with the distance to that use in launches, and the
// group each region belongs to (regions the learner saw used together: a layer's weights, its optimizer
// state). Regions the learner has not seen recur across steps are absent: the policy treats them as
// "no forecast" (LRU by last use).
#pragma once

#include <cstdint>
#include <vector>

#include "allocator/region_map.hpp"

namespace layerswap {

struct forecast_entry {
  region_id region = 0;
  std::uint32_t group = 0;        // 0 = no group
  std::uint64_t distance = 0;     // launches from the learner's position to the region's next use
};

struct forecast {
  bool learned = false;               // a step period has been found and the position is on it
  std::uint64_t generation = 0;       // bumped whenever the learned order changes (relearned)
  std::uint64_t position = 0;         // launch number the forecast was made at
  std::uint64_t step_launches = 0;    // launches per step (the period)
  std::uint64_t step_position = 0;    // the learner's position within its learned step (0..step_launches-1)
  std::vector<forecast_entry> upcoming;  // in order of next use; each region at most once
};

class forecast_source {
 public:
  virtual ~forecast_source() = default;
  // Fills `out` with the current forecast (at most `max_regions` entries). Thread-safe; cheap enough for
  // the migration thread to call every few hundred microseconds.
  virtual void current(forecast& out, std::size_t max_regions) = 0;
};

}  // namespace layerswap
