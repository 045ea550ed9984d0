// The GPU side of runtime/digest.hpp: one launch digests a range of device-visible memory and writes the 128-bit
// result to host-mapped memory. Compiled by nvcc into a fatbin that runtime/cuda_driver.cpp embeds and loads with
// cuModuleLoadData (layerswap links no CUDA runtime), so this file includes no header of the project's C++
// side: the mixing functions below must stay those of digest.hpp (the GPU test
// CudaDriver.DigestMatchesTheHostAndSeesEveryChange checks that they do). They could be shared through a
// __host__ __device__ header; that change waits for a GPU run to check it, since a digest that matched for
// different content would make evictions drop writes.
//
// Reduction: each block sums its grid-stride share of 16-byte loads into two 64-bit lanes and writes them to a
// partials array; the last block to arrive (a counter, after __threadfence) sums the partials and writes the
// result. Partials and counter live in module globals, one set per `slot`: the port gives each stream its own
// slot, and launches on one stream run one after another, so slots need no other synchronization.
typedef unsigned long long u64;

#define LAYERSWAP_DIGEST_THREADS 256
#define LAYERSWAP_DIGEST_MAX_BLOCKS 1024
#define LAYERSWAP_DIGEST_SLOTS 16

__device__ u64 layerswap_digest_partials[LAYERSWAP_DIGEST_SLOTS][LAYERSWAP_DIGEST_MAX_BLOCKS][2];
__device__ unsigned int layerswap_digest_arrived[LAYERSWAP_DIGEST_SLOTS];

__device__ __forceinline__ u64 mix_a(u64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}
__device__ __forceinline__ u64 mix_b(u64 x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
__device__ __forceinline__ u64 term_a(u64 w, u64 i) { return mix_a(w ^ (i * 0x9e3779b97f4a7c15ULL)); }
__device__ __forceinline__ u64 term_b(u64 w, u64 i) { return mix_b((w + 0x632be59bd9b4e019ULL) ^ (i * 0xd6e8feb86659fd93ULL)); }

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
