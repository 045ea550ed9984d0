// The real driver port: libcuda.so.1 loaded at run time (dlopen + cuGetProcAddress), so that nothing links
// against libcuda and the library loads on machines without a GPU.
#pragma once

#include <memory>

#include "runtime/driver.hpp"

namespace layerswap {

// Number of CUDA devices, or 0 when libcuda cannot be loaded or cuInit fails. Creates no context.
[[nodiscard]] int cuda_device_count() noexcept;

// A port for `device`. Uses (and retains) the device's primary context, the one the CUDA runtime and
// PyTorch use, and makes it current on the calling thread when no context is. Throws cuda_error with a
// message that says what is missing (driver library, device, symbol).
[[nodiscard]] std::unique_ptr<driver> make_cuda_driver(int device);

}  // namespace layerswap
