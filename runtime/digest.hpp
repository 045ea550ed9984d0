// Content digests: a 128-bit fingerprint of a range of memory, computed on the GPU (runtime/digest_kernel.cu) or
// on the host (this header: the simulated device and the tests), the same function on both sides.
//
// The residency engine skips an eviction's copy when the region's digest equals the one taken when the region
// last came to the device (allocator/residency.cpp, Note [Write-back]). A skip is only sound when equal digests
// mean equal content, so the function is built for that, not for speed alone:
//   * the range is read as 64-bit words w_i; each word is mixed with its index by two different bijective
//     finalizers (murmur3's fmix64 and splitmix64's), and the two lanes are summed modulo 2^64;
//   * a change confined to one word always changes both lanes (each finalizer is a bijection of w_i for a given
//     i), and a change spread over several words goes unnoticed only if both lane sums cancel at once: about
//     2^-128 for unrelated content;
//   * the sums do not depend on the order the words are added in, so the GPU reduces them in any order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace layerswap {

struct digest128 {
  std::uint64_t a = 0;
  std::uint64_t b = 0;
  friend bool operator==(const digest128&, const digest128&) = default;
};

// runtime/digest_kernel.cu includes this header through nvcc: the mixing functions below are the GPU's too.
#if defined(__CUDACC__)
#define LAYERSWAP_DIGEST_HD __host__ __device__
#else
#define LAYERSWAP_DIGEST_HD
#endif

namespace digest_detail {
inline constexpr std::uint64_t k_index_a = 0x9e3779b97f4a7c15ULL;  // golden ratio, odd
inline constexpr std::uint64_t k_index_b = 0xd6e8feb86659fd93ULL;
inline constexpr std::uint64_t k_seed_b = 0x632be59bd9b4e019ULL;

LAYERSWAP_DIGEST_HD constexpr std::uint64_t mix_a(std::uint64_t x) noexcept {  // murmur3 fmix64
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}
LAYERSWAP_DIGEST_HD constexpr std::uint64_t mix_b(std::uint64_t x) noexcept {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
// Word `i` of the range, value `w`: its terms of the two lane sums.
LAYERSWAP_DIGEST_HD constexpr std::uint64_t term_a(std::uint64_t w, std::uint64_t i) noexcept {
  return mix_a(w ^ (i * k_index_a));
}
LAYERSWAP_DIGEST_HD constexpr std::uint64_t term_b(std::uint64_t w, std::uint64_t i) noexcept {
  return mix_b((w + k_seed_b) ^ (i * k_index_b));
}
}  // namespace digest_detail

// Accumulates the lane sums of words [first, first + n) of a range (so a range can be digested in pieces).
inline void digest_add(digest128& d, const void* data, std::size_t n, std::uint64_t first) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t k = 0; k < n; ++k) {
    std::uint64_t w = 0;
    std::memcpy(&w, bytes + k * 8, 8);
    d.a += digest_detail::term_a(w, first + k);
    d.b += digest_detail::term_b(w, first + k);
  }
}

// The digest of a whole range of `words` 64-bit words from its lane sums: the length enters too.
constexpr digest128 digest_finish(digest128 sums, std::uint64_t words) noexcept {
  return {sums.a, sums.b ^ digest_detail::mix_a(words)};
}

// Host reference: the digest of `bytes` (a multiple of 16) at `data`.
inline digest128 digest_of(const void* data, std::size_t bytes) noexcept {
  digest128 d;
  digest_add(d, data, bytes / 8, 0);
  return digest_finish(d, bytes / 8);
}

}  // namespace layerswap
