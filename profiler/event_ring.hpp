// A bounded lock-free ring of fixed-size records: many producers (launching threads, inside the CUPTI
// callback), one consumer (the tracker's consumer thread, or a drain under its mutex).
//
// Each cell carries a sequence number (D. Vyukov's bounded queue): a producer claims position p with a CAS on
// the tail when cell p's sequence says it is free, writes the record, then publishes it by storing p + 1; the
// consumer reads cell `head` once its sequence is head + 1 and frees it by storing head + capacity. A full
// ring refuses the record (try_push returns false) instead of waiting: the caller counts the drop. Nothing
// allocates after construction.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace layerswap::profiler {

template <class T>
class event_ring {
 public:
  explicit event_ring(std::size_t capacity)
      : capacity_(std::bit_ceil(capacity < 2 ? std::size_t{2} : capacity)),
        mask_(capacity_ - 1),
        cells_(std::make_unique<cell[]>(capacity_)) {
    for (std::size_t i = 0; i < capacity_; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  // Any thread. False when the ring is full.
  template <class Fill>
  bool try_emplace(Fill&& fill) noexcept {
    std::size_t position = tail_.load(std::memory_order_relaxed);
    for (;;) {
      cell& c = cells_[position & mask_];
      const std::size_t sequence = c.sequence.load(std::memory_order_acquire);
      const auto diff = static_cast<std::intptr_t>(sequence) - static_cast<std::intptr_t>(position);
      if (diff == 0) {
        // seq_cst: one side of tracker_core's Note [Idle consumer] (on x86 the same locked instruction as relaxed).
        if (tail_.compare_exchange_weak(position, position + 1, std::memory_order_seq_cst, std::memory_order_relaxed)) {
          fill(c.value);
          c.sequence.store(position + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        position = tail_.load(std::memory_order_relaxed);
      }
    }
  }
  bool try_push(const T& value) noexcept {
    return try_emplace([&](T& slot) { slot = value; });
  }

  // The one consumer (or whoever holds its lock): whether no record was claimed since it last popped. A seq_cst
  // load of the tail, whose claims are compare-exchanges (tracker_core.hpp, Note [Idle consumer]).
  [[nodiscard]] bool nothing_claimed() const noexcept { return tail_.load(std::memory_order_seq_cst) == head_; }

  // The one consumer. False when empty (or the next record is still being written).
  bool try_pop(T& out) noexcept {
    cell& c = cells_[head_ & mask_];
    if (c.sequence.load(std::memory_order_acquire) != head_ + 1) return false;
    out = c.value;
    c.sequence.store(head_ + capacity_, std::memory_order_release);
    ++head_;
    return true;
  }

 private:
  // Cache-line aligned: a cell shares no line with its neighbours, so a producer writing cell p + 1 never
  // waits for a line that the consumer, reading cell p, holds.
  struct alignas(64) cell {
    std::atomic<std::size_t> sequence{0};
    T value{};
  };
  const std::size_t capacity_;
  const std::size_t mask_;
  std::unique_ptr<cell[]> cells_;
  alignas(64) std::atomic<std::size_t> tail_{0};
  alignas(64) std::size_t head_ = 0;  // consumer only
};

}  // namespace layerswap::profiler
