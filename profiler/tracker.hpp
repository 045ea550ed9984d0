// The launch tracker's public face (implemented in cupti_tracker.cpp, the only file that includes CUPTI and
// CUDA headers). See docs/tracker.md.
//
// CUPTI has one subscriber per process. tracker_start() takes it; when another tool holds it (nsys,
// a torch.profiler started first) it says so once and returns false, and the program runs on untracked.
// tracker_pause() releases the subscription so that torch.profiler can take it; tracker_resume() takes it
// back. Every function here is safe to call from any thread, never throws, and is a no-op where it has
// nothing to do.
#pragma once

#include <string>

#include "profiler/tracker_core.hpp"

namespace layerswap::profiler {

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
// The core (counters, recent events); nullptr before the first tracker_start().
[[nodiscard]] tracker_core* tracker_instance() noexcept;

}  // namespace layerswap::profiler
