// The layout cache: kernel function handle -> kernel id, name and parameter layout, filled on a function's
// first launch and read lock-free on every later one.
//
// A fixed open-addressing table of atomic keys (linear probing) over fixed pools for parameters and names,
// all allocated once when the cache is made: find_or_add() allocates nothing, takes no lock and never blocks.
// The first thread to see a function claims an entry (CAS on the key), queries the layout through the given
// function and publishes the entry (release). The entry's name (at most k_max_name bytes) and whether the
// function is NCCL's come from the first launch that has a name, which need not be the claiming one (CUPTI may
// give a launch none; layout_cache.cpp, Note [Named late]). A thread that meets an entry still being filled, or
// a full table or pool, queries into its own scratch space instead, so a launch is decoded either way; only the
// cost differs.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "profiler/arg_decoder.hpp"

namespace layerswap::profiler {

enum class query_status : std::uint8_t { ok, end, error, later };
// Parameter `index` of `function`: ok with `out` set; end past the last parameter; error when the function's
// parameters cannot be queried at all; later when they cannot be queried now (e.g. the CUDA runtime holds an
// error the application has not read yet): nothing is cached and a later launch asks again. Must not throw.
using param_query_fn = query_status (*)(void* context, std::uint64_t function, std::uint32_t index,
                                        param_slot& out) noexcept;

struct layout_lookup {
  std::uint32_t kernel = 0;  // kernel id (1-based entry index), 0 when the table is full
  bool has_layout = false;   // false: the queries failed (no_layout)
  bool truncated = false;    // more than k_max_params parameters
  // The function may take its buffers' addresses from memory outside its arguments when they name no region:
  // NCCL's kernels (launch_recorder.hpp, Note [Work elsewhere]). Decided by the function's first
  // named launch (layout_cache.cpp, Note [Named late]).
  bool work_elsewhere = false;
  param_layout layout;
};

// Whether a kernel named `name` (mangled or not; may be null) is one of NCCL's (Note [Work elsewhere]).
[[nodiscard]] bool takes_work_elsewhere(const char* name) noexcept;

class layout_cache {
 public:
  static constexpr std::size_t k_max_name = 255;

  explicit layout_cache(std::size_t entries = 16384, std::size_t param_pool = std::size_t{1} << 18,
                        std::size_t name_pool = std::size_t{4} << 20);
  ~layout_cache();
  layout_cache(const layout_cache&) = delete;
  layout_cache& operator=(const layout_cache&) = delete;

  // The layout of `function` (a non-zero handle), from the cache or queried now. `scratch` (k_max_params
  // slots) is used when the result cannot be cached; the returned layout may point into it.
  [[nodiscard]] layout_lookup find_or_add(std::uint64_t function, const char* name, param_query_fn query,
                                          void* context, param_slot* scratch) noexcept;

  // The name stored for a kernel id ("" while unknown). The view stays valid for the cache's lifetime.
  [[nodiscard]] std::string_view name(std::uint32_t kernel) const noexcept;

  [[nodiscard]] std::size_t functions() const noexcept { return used_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t uncached_queries() const noexcept { return uncached_.load(std::memory_order_relaxed); }

 private:
  struct entry;
  entry* entries_ = nullptr;
  std::size_t mask_ = 0;
  std::unique_ptr<param_slot[]> params_;
  std::size_t param_capacity_ = 0;
  std::atomic<std::size_t> params_used_{0};
  std::unique_ptr<char[]> names_;
  std::size_t name_capacity_ = 0;
  std::atomic<std::size_t> names_used_{0};
  std::atomic<std::size_t> used_{0};
  std::atomic<std::uint64_t> uncached_{0};
};

}  // namespace layerswap::profiler
