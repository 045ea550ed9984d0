// The launch tracker's public face (implemented in cupti_tracker.cpp, the only file that includes CUPTI and
// CUDA headers). See docs/tracker.md.
//
// CUPTI has one subscriber per process. tracker_start() takes it; when another tool holds it (nsys,
// a torch.profiler started first) it says so once and returns false, and the program runs on untracked.
// tracker_pause() releases the subscription so that torch.profiler can take it; tracker_resume() takes it
// back. Every function here is safe to call from any thread, never throws, and is a no-op where it has
// nothing to do.
#pragma once

#include <cstdint>
#include <string>

#include "profiler/tracker_core.hpp"

namespace layerswap::profiler {

// Which callbacks a subscription takes (cupti_tracker.cpp, Note [Callback domains]).
enum class tracker_api : std::uint8_t {
  both,    // runtime and driver: four callbacks per runtime launch, decoded in the runtime one
  driver,  // driver only: two per launch; a runtime launch is decoded in the driver callback it makes
};
struct tracker_mode {
  tracker_api api = tracker_api::both;
  bool subscribe_only = false;  // the callbacks are enabled but record nothing (a measurement aid)
  bool attribute = false;  // LAYERSWAP_TRACK=attribute (cupti_tracker.cpp, Note [Launches beside the engine's calls])
};
// The mode the next subscription (tracker_start, tracker_resume) uses. Until set, LAYERSWAP_TRACK_API and
// LAYERSWAP_TRACK=subscribe-only decide; tests and benchmarks switch modes between pause and resume.
void tracker_set_mode(tracker_mode mode) noexcept;
[[nodiscard]] tracker_mode tracker_get_mode() noexcept;

// Loads CUPTI (first call), subscribes and starts the consumer. True when tracking is on afterwards.
bool tracker_start() noexcept;
// Unsubscribes and stops the consumer; counters and recent events stay readable.
void tracker_stop() noexcept;
// Releases CUPTI for another subscriber (torch.profiler); true when tracking was on.
bool tracker_pause() noexcept;
// Retakes CUPTI after tracker_pause(); true when tracking is on afterwards.
bool tracker_resume() noexcept;

[[nodiscard]] bool tracker_active() noexcept;
[[nodiscard]] bool tracker_paused() noexcept;
// Whether the last subscribe attempt found CUPTI taken by another subscriber.
[[nodiscard]] bool tracker_subscriber_busy() noexcept;
// Why tracking is off ("" when on or never started).
[[nodiscard]] std::string tracker_problem();
// Diagnostics: how many driver param-info queries failed, and the CUresult codes of the last failure.
[[nodiscard]] std::string tracker_param_info_errors();
// The core (counters, recent events); nullptr before the first tracker_start().
[[nodiscard]] tracker_core* tracker_instance() noexcept;
// The learner the tracker feeds (a layerswap::forecast_source for the residency policy); nullptr before the
// first tracker_start(). It lives as long as the process.
[[nodiscard]] learner* tracker_learner() noexcept;

}  // namespace layerswap::profiler
