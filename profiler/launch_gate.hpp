// The launching thread's side of the residency gate (allocator/residency_gate.hpp): which regions each open
// launch entered, so that its API-exit callback exits exactly those, with the launch's number.
//
// Note [Gate bookkeeping]
//   At a launch's API-enter callback the tracker opens a frame, enters every region the launch touches
//   (deduplicated) and stamps the frame with the launch number; at the API-exit callback it closes the newest
//   frame, exiting the same regions. Frames stack (up to k_max_depth per thread) so that a launch made inside
//   another's callbacks still pairs up; a runtime launch's nested driver callback opens no frame at all
//   (Note [Nested launch callbacks]). The ids live in one fixed thread-local array (k_capacity for all open
//   frames together): nothing allocates. Every region that was entered is exited, exactly once:
//     * a region that does not fit in the array is not entered at all (counted in `unguarded`), never entered
//       without a record of it;
//     * a frame opened past k_max_depth enters nothing (counted) and its close() pops nothing real;
//     * a subscription that ends between a launch's enter and exit callbacks loses the exit callback: the next
//       callback on that thread sees the new subscription generation and calls close_all(), which exits every
//       frame left open (those launches were enqueued long ago).
//   A launch touching more regions than the decoder's region_set holds is re-decoded into the frame directly
//   (add(), deduplicated by a scan of the frame: slow, and only for such launches).
//
// Note [Held regions]
//   A Gate that can hold launches on the GPU (residency_gate.hpp, Note [Holding a launch on the GPU]) has
//   `enter_holding(id, hold&)` and `exit_held(id, launch_no)`. A region entered held is stored with k_held_bit
//   set (region ids stay below 2^28), so that close() exits it with exit_held(); the newest frame's holds are
//   kept (up to k_max_holds; past that a region is entered without holding) for the tracker to enqueue their
//   stream waits before the launch (holds()). Only kernel launches are held: a copy or memset frame calls
//   no_holds() first. The driver reads a copy's pointers (their allocations) inside the API call itself, and a held
//   region may be remapped meanwhile (the engine remaps a prefetch with held launches pending): a held
//   cuMemcpyDtoDAsync crashed inside the driver on the H200. A kernel's arguments are only copied.
//
// Gate is a type with static `bool enter(region_id)` (true: the region is backed by host pages) and
// `exit(region_id, launch_no)` (noexcept): the residency gate in production, a recorder in the unit tests. Constant-initializable, so a thread_local needs no guard.
#pragma once

#include <cstdint>

#include "allocator/region_map.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/arg_decoder.hpp"

namespace layerswap::profiler {

template <class Gate>
class launch_gate {
 public:
  static constexpr int k_capacity = 4096;  // region ids held by all the open frames of one thread
  static constexpr int k_max_depth = 8;    // launches open at once on one thread
  static constexpr int k_max_holds = 16;   // holds of one launch (Note [Held regions])
  static constexpr region_id k_held_bit = 0x40000000u;

  // A launch's API-enter callback begins.
  void open() noexcept {
    if (depth_ == k_max_depth) {
      ++excess_depth_;
      ++deep_;
      return;
    }
    frames_[depth_++] = frame{count_, 0};
    on_host_ = false;
    may_hold_ = true;
    nholds_ = 0;
  }
  // The newest frame enters its regions without holding (a copy or memset: Note [Held regions]).
  void no_holds() noexcept { may_hold_ = false; }

  // Enters a region of the newest frame unless the frame already holds it. False when it was not entered:
  // a duplicate, no frame open, or no room (then counted as unguarded).
  bool add(region_id id) noexcept {
    if (id == 0 || !writable()) return false;
    for (int i = frames_[depth_ - 1].begin; i < count_; ++i) {
      if ((ids_[i] & ~k_held_bit) == id || ids_[i] == id) return false;
    }
    return push(id);
  }
  // Enters every region of `set` (distinct by construction).
  void add_all(const region_set& set) noexcept {
    if (!writable()) return;
    for (int i = 0; i < set.count; ++i) {
      if (set.ids[i] != 0) push(set.ids[i]);
    }
  }
  // The launch number of the newest frame (tracker_core::record's result), passed to exit().
  void set_launch(std::uint64_t launch_no) noexcept {
    if (writable()) frames_[depth_ - 1].launch_no = launch_no;
  }

  // A launch's API-exit callback: exits the regions of the newest frame. No-op without an open frame.
  void close() noexcept {
    if (excess_depth_ > 0) {
      --excess_depth_;
      return;
    }
    if (depth_ == 0) return;
    const frame f = frames_[--depth_];
    for (int i = f.begin; i < count_; ++i) exit_one(ids_[i], f.launch_no);
    count_ = f.begin;
    nholds_ = 0;
  }
  // Exits every open frame, newest first (the subscription changed under them).
  void close_all() noexcept {
    excess_depth_ = 0;
    while (depth_ > 0) close();
  }

  // Whether a region entered since the newest open() was backed by host pages when it was entered.
  [[nodiscard]] bool touched_host() const noexcept { return on_host_; }
  [[nodiscard]] int depth() const noexcept { return depth_ + excess_depth_; }
  [[nodiscard]] int entered() const noexcept { return count_; }  // regions entered and not yet exited
  [[nodiscard]] std::uint64_t unguarded() const noexcept { return unguarded_; }
  [[nodiscard]] std::uint64_t too_deep() const noexcept { return deep_; }
  // The holds taken by the newest frame (Note [Held regions]): the tracker enqueues their waits.
  [[nodiscard]] int hold_count() const noexcept { return nholds_; }
  [[nodiscard]] const residency_gate::hold& held(int i) const noexcept { return holds_[i]; }

 private:
  struct frame {
    int begin = 0;
    std::uint64_t launch_no = 0;
  };
  // The newest frame is a real one (not past k_max_depth).
  [[nodiscard]] bool writable() const noexcept { return depth_ > 0 && excess_depth_ == 0; }
  bool push(region_id id) noexcept {
    if (count_ == k_capacity) {
      ++unguarded_;
      return false;
    }
    if constexpr (requires(residency_gate::hold& h) { Gate::enter_holding(id, h); }) {
      if (may_hold_ && id != residency_gate::k_unknown_region && nholds_ < k_max_holds) {
        residency_gate::hold& h = holds_[nholds_];
        switch (Gate::enter_holding(id, h)) {
          case residency_gate::entry_state::held:
            ++nholds_;
            ids_[count_++] = id | k_held_bit;
            return true;
          case residency_gate::entry_state::host: on_host_ = true; break;
          case residency_gate::entry_state::device: break;
        }
        ids_[count_++] = id;
        return true;
      }
    }
    on_host_ = Gate::enter(id) || on_host_;
    ids_[count_++] = id;
    return true;
  }
  static void exit_one(region_id stored, std::uint64_t launch_no) noexcept {
    if constexpr (requires { Gate::exit_held(stored, launch_no); }) {
      if (stored != residency_gate::k_unknown_region && (stored & k_held_bit) != 0) {
        Gate::exit_held(stored & ~k_held_bit, launch_no);
        return;
      }
    }
    Gate::exit(stored, launch_no);
  }

  // The counters first, the ids last: a launch with few regions touches the first lines only.
  int count_ = 0;
  int depth_ = 0;
  int excess_depth_ = 0;
  bool on_host_ = false;
  bool may_hold_ = true;
  int nholds_ = 0;
  frame frames_[k_max_depth];
  residency_gate::hold holds_[k_max_holds];
  std::uint64_t unguarded_ = 0;
  std::uint64_t deep_ = 0;
  region_id ids_[k_capacity]{};
};

}  // namespace layerswap::profiler
