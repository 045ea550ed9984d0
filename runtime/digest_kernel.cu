// The GPU side of runtime/digest.hpp: one launch digests a range of device-visible memory (layerswap_digest), or up
// to k_batch_ranges of them (layerswap_digest_many), and writes each 128-bit result to host-mapped memory. Compiled
// by nvcc into a fatbin that runtime/cuda_driver.cpp embeds and loads with cuModuleLoadData (layerswap links no
// CUDA runtime). The mixing functions are digest.hpp's, __host__ __device__ under nvcc, so the host reference and
// the GPU compute one function (the GPU tests CudaDriver.DigestMatchesTheHostAndSeesEveryChange and
// CudaDriver.BatchedDigestMatchesTheHostForEveryRange check the results agree). The launch interface (sizes, the
// batched kernel's parameter) is runtime/digest_kernel.hpp.
//
// Reduction: each block sums its grid-stride share of its range's 16-byte loads into two 64-bit lanes and writes
// them to a partials array; the last block of the range to arrive (a counter, after __threadfence) sums the range's
// partials and writes the result. Partials and counters live in module globals, one set per `slot`: the port gives
// each stream its own slot, and launches on one stream run one after another, so slots need no other
// synchronization. A batched launch gives each range a run of the grid's blocks (batch::first_block), their
// partials entries of the same indices, and a counter of its own; a word's terms use its index within its range,
// so each range's result is the one layerswap_digest (and digest_of) gives.
#include "runtime/digest.hpp"
#include "runtime/digest_kernel.hpp"

typedef unsigned long long u64;

namespace dk = layerswap::digest_kernel;

__device__ u64 layerswap_digest_partials[dk::k_slots][dk::k_max_blocks][2];
__device__ unsigned int layerswap_digest_arrived[dk::k_slots];                       // layerswap_digest's
__device__ unsigned int layerswap_digest_many_arrived[dk::k_slots][dk::k_batch_ranges];  // ... each range's

using layerswap::digest_detail::mix_a;
using layerswap::digest_detail::term_a;
using layerswap::digest_detail::term_b;

// Sums (a, b) over the block; the result is valid in thread 0.
__device__ __forceinline__ void block_sum(u64& a, u64& b) {
  __shared__ u64 lanes[dk::k_threads / 32][2];
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    lanes[warp][0] = a;
    lanes[warp][1] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < dk::k_threads / 32; ++w) {
      a += lanes[w][0];
      b += lanes[w][1];
    }
  }
  __syncthreads();
}

// Block `block` of the `blocks` that digest `pairs` 16-byte units at `data`: its share, and, in the last block of
// the range to arrive, the result in out[0], out[1] (two words of host-mapped memory). `partials`: the range's
// `blocks` entries; `arrived`: its counter, zero before and after.
__device__ __forceinline__ void digest_range(const ulonglong2* data, u64 pairs, unsigned int block, unsigned int blocks,
                                             u64 (*partials)[2], unsigned int* arrived, u64* out) {
  u64 a = 0;
  u64 b = 0;
  const u64 stride = static_cast<u64>(blocks) * blockDim.x;
  for (u64 i = static_cast<u64>(block) * blockDim.x + threadIdx.x; i < pairs; i += stride) {
    const ulonglong2 w = __ldcs(data + i);  // streamed once: keep it out of the caches' way
    a += term_a(w.x, 2 * i) + term_a(w.y, 2 * i + 1);
    b += term_b(w.x, 2 * i) + term_b(w.y, 2 * i + 1);
  }
  block_sum(a, b);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[block][0] = a;
    partials[block][1] = b;
    __threadfence();
    last = atomicAdd(arrived, 1u) == blocks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  a = 0;
  b = 0;
  for (unsigned int k = threadIdx.x; k < blocks; k += blockDim.x) {
    const volatile u64* p = partials[k];
    a += p[0];
    b += p[1];
  }
  block_sum(a, b);
  if (threadIdx.x == 0) {
    out[0] = a;
    out[1] = b ^ mix_a(2 * pairs);
    *arrived = 0;
    __threadfence_system();
  }
}

// `pairs` 16-byte units at `data`; `out`: two words of host-mapped memory.
extern "C" __global__ void __launch_bounds__(dk::k_threads)
layerswap_digest(const ulonglong2* data, u64 pairs, unsigned int slot, u64* out) {
  digest_range(data, pairs, blockIdx.x, gridDim.x, layerswap_digest_partials[slot], &layerswap_digest_arrived[slot],
               out);
}

// The ranges of `batch` (runtime/digest_kernel.hpp), each by its run of the grid's blocks.
extern "C" __global__ void __launch_bounds__(dk::k_threads)
layerswap_digest_many(const dk::batch batch) {
  unsigned int k = 0;
  while (k + 1 < batch.count && blockIdx.x >= batch.first_block[k + 1]) ++k;
  const unsigned int first = batch.first_block[k];
  digest_range(reinterpret_cast<const ulonglong2*>(batch.data[k]), batch.pairs[k], blockIdx.x - first,
               batch.first_block[k + 1] - first, layerswap_digest_partials[batch.slot] + first,
               &layerswap_digest_many_arrived[batch.slot][k], reinterpret_cast<u64*>(batch.out[k]));
}
