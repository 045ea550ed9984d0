// PyTorch integration, seen from the pybind11 module (no torch header here).
#pragma once

#include <cstddef>

namespace layerswap::torch_binding {

// Makes layerswap PyTorch's CUDA allocator (c10::cuda::CUDACachingAllocator and c10::GetAllocator(kCUDA)).
// Idempotent. Throws layerswap::error when PyTorch's own allocator already holds live memory ("too late")
// or when no GPU is usable.
void install();
[[nodiscard]] bool installed() noexcept;
// Whether PyTorch's native caching allocator has been initialized / holds live allocations.
[[nodiscard]] bool native_initialized();
// Median microseconds of one alloc+free pair through PyTorch's *current* CUDA allocator (native or
// layerswap), on the current stream, after a warm-up.
[[nodiscard]] double bench_alloc_free(std::size_t bytes, int iters);

}  // namespace layerswap::torch_binding
