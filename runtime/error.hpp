// Exceptions used inside the core. They never cross a boundary (C ABI, LD_PRELOAD hooks, CUPTI callbacks,
// destructors): those catch and turn them into error codes or nullptr. Every message says what to do next.
#pragma once

#include <stdexcept>
#include <string>

namespace layerswap {

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A LAYERSWAP_* variable (or an enable() setting) has a value we cannot accept. The message names the
// variable, the value and the accepted forms.
class config_error : public error {
 public:
  using error::error;
};

// A CUDA driver call failed. `code` is the CUresult.
class cuda_error : public error {
 public:
  cuda_error(int code, const std::string& what) : error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

// CUDA_ERROR_DEINITIALIZED: the driver is shutting down (at process exit); no call can succeed any more.
inline constexpr int k_cuda_deinitialized = 4;

// The driver could not create physical memory (CUDA_ERROR_OUT_OF_MEMORY). Internal: the allocator frees
// its cache and retries before it gives up with out_of_memory.
class device_out_of_memory : public cuda_error {
 public:
  using cuda_error::cuda_error;
};

// An allocation that cannot be satisfied within the budget or the device. Surfaces to PyTorch as
// torch.OutOfMemoryError.
class out_of_memory : public error {
 public:
  using error::error;
};

}  // namespace layerswap
