// The layout cache (layout_cache.hpp).
//
// Entry states: filling (claimed, being written), ready, failed (queries failed: no layout), retry (the query
// said `later`: the next launch refills it), uncached (the parameter pool is full: every launch queries).
#include "profiler/layout_cache.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

namespace layerswap::profiler {

namespace {
constexpr std::uint8_t k_filling = 0;
constexpr std::uint8_t k_ready = 1;
constexpr std::uint8_t k_failed = 2;
constexpr std::uint8_t k_retry = 3;
constexpr std::uint8_t k_uncached = 4;

// Note [Named late]
//   CUPTI may give a launch no name (symbolName null). Whether a function is NCCL's (takes_work_elsewhere) is read
//   from its name once, so a function whose first launch came nameless would be taken for none of NCCL's forever,
//   and its launches whose work is in NCCL's FIFO recorded as touching no region (launch_recorder.hpp, Note [Work
//   elsewhere]). So an entry is named apart from its layout: by the first launch that has a name, whichever that is
//   (one thread wins the claim, k_unnamed -> k_naming; it stores the name and the flag, then k_named with release).
//   Until then every launch decides the flag from its own name, as an uncached launch does.
constexpr std::uint8_t k_unnamed = 0;
constexpr std::uint8_t k_naming = 1;
constexpr std::uint8_t k_named = 2;

// Queries every parameter into `out` (k_max_params slots).
query_status query_all(std::uint64_t function, param_query_fn query, void* context, param_slot* out,
                       std::uint32_t& count, bool& truncated) noexcept {
  count = 0;
  truncated = false;
  for (std::uint32_t i = 0;; ++i) {
    if (i == static_cast<std::uint32_t>(k_max_params)) {
      param_slot probe;
      truncated = query(context, function, i, probe) == query_status::ok;
      return query_status::ok;
    }
    const query_status s = query(context, function, i, out[i]);
    if (s == query_status::end) return query_status::ok;
    if (s == query_status::later) return s;
    if (s == query_status::error) return i > 0 ? query_status::ok : s;  // keep the parameters read before
    ++count;
  }
}

std::size_t hash(std::uint64_t key) noexcept {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  return static_cast<std::size_t>(key);
}

}  // namespace

struct layout_cache::entry {
  std::atomic<std::uint64_t> key{0};
  std::atomic<std::uint8_t> state{k_filling};
  std::atomic<std::uint8_t> naming{k_unnamed};  // Note [Named late]
  bool truncated = false;
  bool work_elsewhere = false;  // written before `naming` becomes k_named, read after it is seen so
  std::uint32_t first = 0;  // into params_
  std::uint32_t count = 0;
  std::atomic<std::uint32_t> name_offset{0};
  std::atomic<std::uint32_t> name_length{0};
};

layout_cache::layout_cache(std::size_t entries, std::size_t param_pool, std::size_t name_pool)
    : param_capacity_(param_pool), name_capacity_(name_pool) {
  const std::size_t n = std::bit_ceil(std::max<std::size_t>(entries, 16));
  entries_ = new entry[n];
  mask_ = n - 1;
  params_ = std::make_unique<param_slot[]>(param_pool);
  names_ = std::make_unique<char[]>(name_pool);
}

layout_cache::~layout_cache() { delete[] entries_; }

bool takes_work_elsewhere(const char* name) noexcept {
  if (name == nullptr) return false;
  const std::string_view n(name);
  // NCCL 2.19 and later name them ncclDevKernel_<op>_..., earlier ones ncclKernel_<op>_...
  return n.find("ncclDevKernel") != std::string_view::npos || n.find("ncclKernel") != std::string_view::npos;
}

layout_lookup layout_cache::find_or_add(std::uint64_t function, const char* name, param_query_fn query,
                                        void* context, param_slot* scratch) noexcept {
  layout_lookup out;
  const auto from_scratch = [&](std::uint32_t kernel, query_status s, std::uint32_t count) {
    out.kernel = kernel;
    out.work_elsewhere = takes_work_elsewhere(name);
    out.has_layout = s == query_status::ok;
    out.layout = param_layout{scratch, count};
    return out;
  };
  // Names entry `e` from this launch's name if nobody has (Note [Named late]); the flag for this launch either way.
  const auto name_entry = [&](entry& e) {
    if (e.naming.load(std::memory_order_acquire) == k_named) return e.work_elsewhere;
    if (name == nullptr) return false;
    const bool flag = takes_work_elsewhere(name);
    std::uint8_t unnamed = k_unnamed;
    if (!e.naming.compare_exchange_strong(unnamed, k_naming, std::memory_order_acq_rel)) return flag;
    const std::size_t length = std::min(std::strlen(name), k_max_name);
    const std::size_t at = names_used_.fetch_add(length, std::memory_order_relaxed);
    if (length > 0 && at + length <= name_capacity_) {
      std::memcpy(names_.get() + at, name, length);
      e.name_offset.store(static_cast<std::uint32_t>(at), std::memory_order_relaxed);
      e.name_length.store(static_cast<std::uint32_t>(length), std::memory_order_release);
    }
    e.work_elsewhere = flag;
    e.naming.store(k_named, std::memory_order_release);
    return flag;
  };
  const auto uncached = [&](std::uint32_t kernel) {
    uncached_.fetch_add(1, std::memory_order_relaxed);
    std::uint32_t count = 0;
    const query_status s = query_all(function, query, context, scratch, count, out.truncated);
    return from_scratch(kernel, s, count);
  };
  // Fills a claimed entry (state filling) and publishes it.
  const auto fill = [&](entry& e, std::uint32_t kernel) {
    std::uint32_t count = 0;
    const query_status s = query_all(function, query, context, scratch, count, out.truncated);
    if (s == query_status::later) {
      e.state.store(k_retry, std::memory_order_release);
      return from_scratch(kernel, s, count);
    }
    const std::size_t first = params_used_.fetch_add(count, std::memory_order_relaxed);
    if (first + count > param_capacity_) {
      e.state.store(k_uncached, std::memory_order_release);
      uncached_.fetch_add(1, std::memory_order_relaxed);
      return from_scratch(kernel, s, count);
    }
    std::copy_n(scratch, count, params_.get() + first);
    e.first = static_cast<std::uint32_t>(first);
    e.count = count;
    e.truncated = out.truncated;
    out.work_elsewhere = name_entry(e);
    e.state.store(s == query_status::ok ? k_ready : k_failed, std::memory_order_release);
    out.kernel = kernel;
    out.has_layout = s == query_status::ok;
    out.layout = param_layout{params_.get() + first, count};
    return out;
  };

  for (std::size_t probe = 0, i = hash(function) & mask_; probe <= mask_; ++probe, i = (i + 1) & mask_) {
    entry& e = entries_[i];
    const auto kernel = static_cast<std::uint32_t>(i + 1);
    std::uint64_t key = e.key.load(std::memory_order_acquire);
    if (key == 0) {
      if (!e.key.compare_exchange_strong(key, function, std::memory_order_acq_rel)) {
        if (key != function) continue;  // another function took the slot
        return uncached(kernel);        // the same function, being filled by another thread
      }
      used_.fetch_add(1, std::memory_order_relaxed);
      (void)name_entry(e);  // the name first, for name() while the layout is queried
      return fill(e, kernel);
    }
    if (key != function) continue;
    std::uint8_t state = e.state.load(std::memory_order_acquire);
    if (state == k_retry) {
      if (e.state.compare_exchange_strong(state, k_filling, std::memory_order_acq_rel)) return fill(e, kernel);
      return uncached(kernel);
    }
    if (state == k_filling || state == k_uncached) return uncached(kernel);
    out.kernel = kernel;
    out.has_layout = state == k_ready;
    out.truncated = e.truncated;
    out.work_elsewhere = name_entry(e);
    out.layout = param_layout{params_.get() + e.first, e.count};
    return out;
  }
  return uncached(0);  // table full
}

std::string_view layout_cache::name(std::uint32_t kernel) const noexcept {
  if (kernel == 0 || kernel > mask_ + 1) return {};
  const entry& e = entries_[kernel - 1];
  const std::uint32_t length = e.name_length.load(std::memory_order_acquire);
  if (length == 0) return {};
  return {names_.get() + e.name_offset.load(std::memory_order_relaxed), length};
}

}  // namespace layerswap::profiler
