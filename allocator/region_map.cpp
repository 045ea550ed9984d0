// The process-wide region map (region_map.hpp): a fixed table of arena slots, each an atomic base, size,
// granule shift and id array. A lookup first rejects addresses outside [lowest base, highest end) of all
// arenas ever registered (most scalar kernel arguments), then scans the used slots.
//
// Publication order: register_arena() fills the ids and shift, then the base, then the size with release;
// a reader loads the size with acquire before trusting the rest. unregister_arena() zeroes the size first.
#include "allocator/region_map.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace layerswap::region_map {

namespace {

struct slot {
  std::atomic<std::uint64_t> base{0};
  std::atomic<std::uint64_t> bytes{0};  // 0: free
  std::atomic<unsigned> shift{0};
  std::atomic<std::atomic<region_id>*> ids{nullptr};
  bool taken = false;  // under table::mutex
};

struct table {
  std::mutex mutex;  // register/unregister only
  slot slots[k_max_arenas];
  std::atomic<int> used{0};  // slots [0, used) may be live
  std::atomic<std::uint64_t> low{~std::uint64_t{0}};
  std::atomic<std::uint64_t> high{0};
  std::atomic<region_id> next_id{1};
  std::atomic<std::uint64_t> refused{0};
};

// Never destroyed: lookups may run from CUPTI callbacks during exit.
table& the_table() {
  static auto* t = new table();
  return *t;
}

}  // namespace

region_id next_region_id() noexcept {
  region_id id = the_table().next_id.fetch_add(1, std::memory_order_relaxed);
  if (id == 0) id = the_table().next_id.fetch_add(1, std::memory_order_relaxed);  // after 2^32 ids: skip 0
  return id;
}

int register_arena(std::uint64_t base, std::size_t bytes, unsigned granule_shift) {
  table& t = the_table();
  const std::size_t granules = bytes >> granule_shift;
  if (granules == 0) return -1;
  std::lock_guard lock(t.mutex);
  int index = -1;
  for (int i = 0; i < k_max_arenas; ++i) {
    if (!t.slots[i].taken) {
      index = i;
      break;
    }
  }
  if (index < 0) {
    t.refused.fetch_add(1, std::memory_order_relaxed);
    return -1;
  }
  slot& s = t.slots[index];
  s.taken = true;
  s.ids.store(new std::atomic<region_id>[granules](), std::memory_order_relaxed);
  s.shift.store(granule_shift, std::memory_order_relaxed);
  s.base.store(base, std::memory_order_relaxed);
  s.bytes.store(granules << granule_shift, std::memory_order_release);
  if (index >= t.used.load(std::memory_order_relaxed)) t.used.store(index + 1, std::memory_order_release);
  if (base < t.low.load(std::memory_order_relaxed)) t.low.store(base, std::memory_order_release);
  if (base + bytes > t.high.load(std::memory_order_relaxed)) t.high.store(base + bytes, std::memory_order_release);
  return index;
}

void unregister_arena(int index) noexcept {
  if (index < 0 || index >= k_max_arenas) return;
  table& t = the_table();
  std::lock_guard lock(t.mutex);
  slot& s = t.slots[index];
  if (!s.taken) return;
  s.bytes.store(0, std::memory_order_release);
  delete[] s.ids.exchange(nullptr, std::memory_order_acq_rel);  // Note [Region map lifetime]
  s.base.store(0, std::memory_order_relaxed);
  s.taken = false;
}

void publish(int index, std::size_t first, std::size_t count, region_id id) noexcept {
  if (index < 0 || index >= k_max_arenas) return;
  slot& s = the_table().slots[index];
  std::atomic<region_id>* ids = s.ids.load(std::memory_order_acquire);
  if (ids == nullptr) return;
  const std::size_t granules = s.bytes.load(std::memory_order_relaxed) >> s.shift.load(std::memory_order_relaxed);
  const std::size_t end = std::min(first + count, granules);
  for (std::size_t i = first; i < end; ++i) ids[i].store(id, std::memory_order_release);
}

region_id lookup(std::uint64_t address) noexcept {
  table& t = the_table();
  if (address < t.low.load(std::memory_order_relaxed) || address >= t.high.load(std::memory_order_relaxed)) return 0;
  const int used = t.used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    slot& s = t.slots[i];
    const std::uint64_t bytes = s.bytes.load(std::memory_order_acquire);
    const std::uint64_t offset = address - s.base.load(std::memory_order_relaxed);
    if (offset >= bytes) continue;
    std::atomic<region_id>* ids = s.ids.load(std::memory_order_acquire);
    if (ids == nullptr) return 0;
    return ids[offset >> s.shift.load(std::memory_order_relaxed)].load(std::memory_order_acquire);
  }
  return 0;
}

std::uint64_t arenas_refused() noexcept { return the_table().refused.load(std::memory_order_relaxed); }

}  // namespace layerswap::region_map
