// The GPU side of runtime/digest.hpp: one launch digests a range of device-visible memory and writes the 128-bit
// result to host-mapped memory. Compiled by nvcc into a fatbin that runtime/cuda_driver.cpp embeds and loads with
// cuModuleLoadData (layerswap links no CUDA runtime). The mixing functions are digest.hpp's, __host__ __device__
// under nvcc, so the host reference and the GPU compute one function (the GPU test
// CudaDriver.DigestMatchesTheHostAndSeesEveryChange checks the two results agree).
//
// Reduction: each block sums its grid-stride share of 16-byte loads into two 64-bit lanes and writes them to a
// partials array; the last block to arrive (a counter, after __threadfence) sums the partials and writes the
// result. Partials and counter live in module globals, one set per `slot`: the port gives each stream its own
// slot, and launches on one stream run one after another, so slots need no other synchronization.
#include "runtime/digest.hpp"

typedef unsigned long long u64;

#define LAYERSWAP_DIGEST_THREADS 256
#define LAYERSWAP_DIGEST_MAX_BLOCKS 1024
#define LAYERSWAP_DIGEST_SLOTS 16

__device__ u64 layerswap_digest_partials[LAYERSWAP_DIGEST_SLOTS][LAYERSWAP_DIGEST_MAX_BLOCKS][2];
__device__ unsigned int layerswap_digest_arrived[LAYERSWAP_DIGEST_SLOTS];

using layerswap::digest_detail::mix_a;
using layerswap::digest_detail::term_a;
using layerswap::digest_detail::term_b;

// Sums (a, b) over the block; the result is valid in thread 0.
__device__ __forceinline__ void block_sum(u64& a, u64& b) {
  __shared__ u64 lanes[LAYERSWAP_DIGEST_THREADS / 32][2];
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
    for (int w = 1; w < LAYERSWAP_DIGEST_THREADS / 32; ++w) {
      a += lanes[w][0];
      b += lanes[w][1];
    }
  }
  __syncthreads();
}

// `pairs` 16-byte units at `data`; `out`: two words of host-mapped memory.
extern "C" __global__ void __launch_bounds__(LAYERSWAP_DIGEST_THREADS)
layerswap_digest(const ulonglong2* data, u64 pairs, unsigned int slot, u64* out) {
  u64 a = 0;
  u64 b = 0;
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += stride) {
    const ulonglong2 w = __ldcs(data + i);  // streamed once: keep it out of the caches' way
    a += term_a(w.x, 2 * i) + term_a(w.y, 2 * i + 1);
    b += term_b(w.x, 2 * i) + term_b(w.y, 2 * i + 1);
  }
  block_sum(a, b);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    layerswap_digest_partials[slot][blockIdx.x][0] = a;
    layerswap_digest_partials[slot][blockIdx.x][1] = b;
    __threadfence();
    last = atomicAdd(&layerswap_digest_arrived[slot], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  a = 0;
  b = 0;
  for (unsigned int k = threadIdx.x; k < gridDim.x; k += blockDim.x) {
    const volatile u64* p = layerswap_digest_partials[slot][k];
    a += p[0];
    b += p[1];
  }
  block_sum(a, b);
  if (threadIdx.x == 0) {
    out[0] = a;
    out[1] = b ^ mix_a(2 * pairs);
    layerswap_digest_arrived[slot] = 0;
    __threadfence_system();
  }
}
