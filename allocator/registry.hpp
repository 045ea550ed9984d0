// The process-wide state the bindings share: the configuration (parsed once) and one caching_allocator per
// device, each over a cuda_driver, created on first use. Allocators live until the process exits and are
// never destroyed: at exit the CUDA driver may already be gone, and the OS takes the memory back anyway.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/forecast.hpp"
#include "runtime/config.hpp"

namespace layerswap {

// The configuration in force: parsed from the environment on first call (throws config_error), unless
// configure() set it first. Unknown LAYERSWAP_* names are reported once, as a warning.
[[nodiscard]] const config& global_config();
// Replaces the configuration (environment plus `overrides`, which win). Throws config_error, or
// layerswap::error when an allocator already exists (settings are fixed once memory is handed out).
void configure(std::span<const std::pair<std::string, std::string>> overrides);

// The allocator of `device`, created on first use. Throws cuda_error when no GPU/driver is usable.
[[nodiscard]] caching_allocator& allocator_for(int device);
// The allocator whose reserved virtual address space holds `ptr` (a live block or not: its deallocate() checks),
// or nullptr. Never throws; lock-free, O(devices).
[[nodiscard]] caching_allocator* owner_of(const void* ptr) noexcept;
// Allocators created so far (device order; entries may be null).
[[nodiscard]] std::vector<caching_allocator*> allocators() noexcept;
// Whether a usable CUDA driver and at least one device are present (loads libcuda; creates no context).
[[nodiscard]] bool gpu_available() noexcept;
// The forecast every device allocator's residency policy reads (the launch tracker's learner), for the allocators
// created so far and those created later; nullptr withdraws it. Returns once no policy round reads the old one.
void set_forecast_source(forecast_source* source) noexcept;
// A section appended to stats_report() (the learner's line, from the bindings); nullptr removes it.
void set_stats_section(std::string (*section)()) noexcept;
// A human-readable statistics report over all devices (LAYERSWAP_STATS=1 prints it at exit).
[[nodiscard]] std::string stats_report();

}  // namespace layerswap
