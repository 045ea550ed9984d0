// The launch interface of the digest kernels (runtime/digest_kernel.cu), shared by the kernels and the real port
// (runtime/cuda_driver.cpp), which launches them with cuLaunchKernel: their sizes, and the parameter of the batched
// kernel, laid out once here so that the two sides cannot disagree. No CUDA header: nvcc compiles it for the
// kernels, the host compiler for the port.
#pragma once

#include <cstdint>

namespace layerswap::digest_kernel {

inline constexpr unsigned k_threads = 256;      // threads per block
inline constexpr unsigned k_max_blocks = 1024;  // blocks per launch, at most (each has a partials entry)
inline constexpr unsigned k_slots = 16;         // scratch slots: streams that may digest (Note [Digest kernel])
inline constexpr unsigned k_batch_ranges = 32;  // ranges one launch of layerswap_digest_many digests, at most

// The parameter of layerswap_digest_many, passed by value: cuLaunchKernel copies it when the launch is enqueued,
// so the host's copy may go as soon as the call returns. Range k (k < count) is `pairs[k]` 16-byte units at device
// address data[k], its result goes to the two words at device address out[k], and it is digested by blocks
// [first_block[k], first_block[k + 1]) of the grid (first_block[0] == 0, first_block[count] == the grid's size,
// at most k_max_blocks; every range has at least one block). Addresses are 64-bit integers on both sides.
struct batch {
  std::uint64_t data[k_batch_ranges];
  std::uint64_t pairs[k_batch_ranges];
  std::uint64_t out[k_batch_ranges];
  std::uint32_t first_block[k_batch_ranges + 1];
  std::uint32_t count;
  std::uint32_t slot;
};
// A kernel's parameters may take 4 KiB on every GPU the kernel is built for.
static_assert(sizeof(batch) <= 4096, "the batched digest's parameter must fit a kernel's parameter space");

}  // namespace layerswap::digest_kernel
