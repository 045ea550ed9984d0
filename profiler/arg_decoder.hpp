// Kernel argument decoding, with no CUDA header: turns a launch's arguments into the set of regions they
// point into.
//
// Two shapes of arguments reach a launch:
//   * kernelParams: an array of pointers, one per parameter, each to that parameter's bytes. The function's
//     param_layout (offset and size of each parameter, from cudaFuncGetParamInfo / cuKernelGetParamInfo /
//     cuFuncGetParamInfo) says how many there are and how big each is.
//   * extra: CU_LAUNCH_PARAM_BUFFER_POINTER, buffer, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END:
//     one buffer with every parameter packed at its offset (cuBLASLt's Hopper GEMMs pass 1,720 bytes).
// Either way every naturally aligned 8-byte word is a candidate address: pointers, structs by value holding
// pointers (TensorIterator's OffsetCalculator, foreach TensorListMetadata with arrays of addresses), TMA
// descriptors' global addresses. Each word goes through the region lookup (region_map::lookup in production;
// any function in tests); the hits are collected, without duplicates, in a fixed-capacity region_set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "allocator/region_map.hpp"

namespace layerswap::profiler {

// Parameters read per function; a kernel with more has the rest unread (counted as truncated).
inline constexpr int k_max_params = 256;

struct param_slot {
  std::uint32_t offset = 0;
  std::uint32_t size = 0;
};

// A function's parameters as a view over storage the caller owns (the layout cache's pool).
struct param_layout {
  const param_slot* params = nullptr;
  std::uint32_t count = 0;
};

using region_lookup_fn = region_id (*)(std::uint64_t address) noexcept;

// The distinct regions of one launch. Capacity bounded; overflow sets `truncated`.
struct region_set {
  static constexpr int k_capacity = 512;
  int count = 0;  // before the ids: a launch with few regions touches one cache line
  bool truncated = false;
  std::uint32_t words = 0;  // words looked up
  region_id ids[k_capacity]{};

  void clear() noexcept {
    count = 0;
    truncated = false;
    words = 0;
  }
  void add(region_id id) noexcept;
  [[nodiscard]] bool contains(region_id id) const noexcept;
};

// Scans [bytes, bytes + size) in 8-byte words at offsets 0, 8, ... (a trailing part shorter than a word is
// skipped: no address fits in it).
void scan_words(const void* bytes, std::size_t size, region_lookup_fn lookup, region_set& out) noexcept;

// Every parameter of `layout`, read through `args[i]`. Null argument pointers are skipped.
void decode_params(const param_layout& layout, const void* const* args, region_lookup_fn lookup,
                   region_set& out) noexcept;

// The buffer of a cuLaunchKernel `extra` array, or {nullptr, 0} when it has none. Reads at most 32 pairs.
struct extra_buffer {
  const void* data = nullptr;
  std::size_t size = 0;
};
[[nodiscard]] extra_buffer parse_extra(const void* const* extra) noexcept;

// Values of CU_LAUNCH_PARAM_* (cuda.h; the CUPTI file checks they match).
inline constexpr std::uintptr_t k_launch_param_end = 0;
inline constexpr std::uintptr_t k_launch_param_buffer_pointer = 1;
inline constexpr std::uintptr_t k_launch_param_buffer_size = 2;

// The family of a kernel name, for reports: the function's own name without namespaces, template arguments
// or parameters for C++ names, mangled ("_ZN2at6native29vectorized_elementwise_kernelILi4E..." ->
// "vectorized_elementwise_kernel") or not ("void at::native::foo<...>(...)" -> "foo"); for other names
// (Triton, cuBLASLt) the first two '_'-separated tokens ("triton_poi_fused_add_0" -> "triton_poi",
// "nvjet_sm90_tst_..." -> "nvjet_sm90"). Works on truncated names.
[[nodiscard]] std::string_view kernel_family(std::string_view name) noexcept;

}  // namespace layerswap::profiler
