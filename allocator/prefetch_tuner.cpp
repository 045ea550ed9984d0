// The prefetch distance tuner (prefetch_tuner.hpp; residency.cpp, Note [Tuned prefetch]).
#include "allocator/prefetch_tuner.hpp"

#include <algorithm>
#include <limits>

namespace layerswap {

namespace {

// Two learned step lengths of one workload: a relearned step may count a few launches more or less (within a 64th,
// or two launches).
std::uint64_t length_gap(std::uint64_t a, std::uint64_t b) noexcept { return a > b ? a - b : b - a; }
bool same_length(std::uint64_t a, std::uint64_t b) noexcept {
  return length_gap(a, b) <= std::max<std::uint64_t>(2, std::max(a, b) / 64);
}

}  // namespace

void prefetch_tuner::restart_timing(std::uint64_t step_start, std::uint64_t now_ns) noexcept {
  step_start_ = step_start;
  step_seen_ns_ = now_ns;
  untimed_ = true;
}

std::size_t prefetch_tuner::observe(std::uint64_t generation, std::uint64_t step_launches, std::uint64_t step_start,
                                    std::uint64_t now_ns, bool& finished) noexcept {
  finished = false;
  if (step_launches == 0) return limit_;
  if (phase_ == phase::none || !same_length(step_launches, key_launches_)) {
    // Another step length: the closest remembered within reach, else a tuning from the start.
    if (tuning()) ++abandoned_;
    memo* found = nullptr;
    for (memo& m : memos_) {
      if (m.step_launches == 0 || !same_length(m.step_launches, step_launches)) continue;
      if (!found || length_gap(m.step_launches, step_launches) < length_gap(found->step_launches, step_launches)) {
        found = &m;
      }
    }
    if (found) {
      found->used = ++memo_clock_;
      key_launches_ = found->step_launches;
      limit_ = found->chosen;
      set_phase(phase::done, 0);
    } else {
      key_launches_ = step_launches;
      begin(step_launches);
    }
    step_launches_ = step_launches;
    generation_ = generation;
    restart_timing(step_start, now_ns);
    return limit_;
  }
  // Relearned at the same length (or within a 64th of the one tuned): a choice stands and a trial goes on with what
  // it timed, but the learner's step may now begin elsewhere, so no step seen by this round, nor the one under way,
  // is timed; they still count as steps that passed (a distance settles in them).
  const bool relearned = generation != generation_ || step_launches != step_launches_;
  generation_ = generation;
  step_launches_ = step_launches;
  if (step_start < step_start_) {
    // The learner re-synced back: a few launches, or across the step's wrap (a boundary counted twice).
    if (relearned || 2 * (step_start_ - step_start) >= step_launches) {
      restart_timing(step_start, now_ns);
    } else {
      step_start_ = step_start;
    }
    return limit_;
  }
  const std::uint64_t moved = step_start - step_start_;
  if (2 * moved < step_launches) {  // no step passed: re-synced forwards a few launches, or nothing
    if (relearned) {
      restart_timing(step_start, now_ns);
    } else {
      step_start_ = step_start;  // timing goes on from the boundary
    }
    return limit_;
  }
  // One step began, or several since the last round: each is timed as their mean, when the start moved by whole
  // steps (within a 16th: else the learner re-synced too) and no relearn came between. Once a step changes the
  // distance, the rest of them ran under the last one and count for nothing; a batch that holds a step settling
  // a distance is not timed (its mean would hold that step).
  const std::uint64_t steps = (moved + step_launches / 2) / step_launches;
  const std::uint64_t step_ns = now_ns > step_seen_ns_ ? (now_ns - step_seen_ns_) / steps : 0;
  const bool whole = length_gap(moved, steps * step_launches) <= step_launches / 16;
  const bool valid = !untimed_ && !relearned && whole && step_ns != 0 && (steps == 1 || phase_ == phase::timed);
  step_start_ = step_start;
  step_seen_ns_ = now_ns;
  untimed_ = relearned || !whole;  // the step under way began when the learner says, which no round saw
  const std::size_t before = limit_;
  for (std::uint64_t k = 0; k < steps && tuning() && limit_ == before; ++k) on_step(step_ns, valid, finished);
  return limit_;
}

void prefetch_tuner::note_wanted(std::size_t regions) noexcept {
  if (!tuning()) return;
  trial& t = current_.trials[current_.count - 1];
  t.wanted = std::max(t.wanted, regions);
}

void prefetch_tuner::begin(std::uint64_t step_launches) noexcept {
  limit_ = k_auto;
  current_ = outcome{};
  current_.step_launches = step_launches;
  current_.trials[current_.count++] = trial{};  // auto first, after its warm steps
  set_phase(phase::settle, k_warm_steps);
}

void prefetch_tuner::on_step(std::uint64_t step_ns, bool valid, bool& finished) noexcept {
  if (phase_ == phase::settle) {  // a step that could not be timed settles a distance all the same
    if (--steps_left_ == 0) {
      set_phase(phase::timed, k_timed_steps);
      timed_count_ = 0;
      untimed_run_ = 0;
    }
    return;
  }
  if (phase_ != phase::timed) return;
  if (!valid) {
    // Relearned every step or two, or re-syncing: the trial ends with what it timed (Note [Tuned prefetch]).
    if (++untimed_run_ > k_untimed_most) finish(finished);
    return;
  }
  untimed_run_ = 0;
  ++timed_steps_;
  timed_[timed_count_++] = step_ns;
  if (timed_count_ < k_timed_steps) return;
  std::sort(timed_.begin(), timed_.end());
  current_.trials[current_.count - 1].step_ns = timed_[k_timed_steps / 2];
  next_candidate(finished);
}

void prefetch_tuner::next_candidate(bool& finished) noexcept {
  trial& last = current_.trials[current_.count - 1];
  // A distance whose wanted set held no fewer regions than the last one's wanted the same (whole groups): its time
  // is the same set's, and no shorter distance wants fewer.
  if (current_.count >= 2 && last.wanted >= current_.trials[current_.count - 2].wanted) {
    last.same_set = true;
    finish(finished);
    return;
  }
  std::uint64_t best = last.step_ns;
  for (std::size_t i = 0; i < current_.count; ++i) best = std::min(best, current_.trials[i].step_ns);
  const bool worse =
      current_.count >= 2 && static_cast<double>(last.step_ns) > static_cast<double>(best) * (1 + k_worse);
  const std::size_t next =
      std::min(last.regions == k_auto ? std::numeric_limits<std::size_t>::max() : last.regions, last.wanted) / 2;
  if (worse || current_.count == k_max_candidates || next < k_min_regions) {
    finish(finished);
    return;
  }
  current_.trials[current_.count++] = trial{next, 0, 0, false};
  limit_ = next;
  set_phase(phase::settle, k_settle_steps);
}

void prefetch_tuner::finish(bool& finished) noexcept {
  // Auto unless a shorter distance, timed and wanting a set of its own, was at least k_gain faster than auto.
  std::size_t chosen = k_auto;
  if (current_.trials[0].step_ns != 0) {
    const double auto_ns = static_cast<double>(current_.trials[0].step_ns);
    double chosen_ns = auto_ns;
    for (std::size_t i = 1; i < current_.count; ++i) {
      const trial& t = current_.trials[i];
      const double ns = static_cast<double>(t.step_ns);
      if (t.step_ns == 0 || t.same_set) continue;
      if (ns <= auto_ns * (1 - k_gain) && ns < chosen_ns) chosen = t.regions, chosen_ns = ns;
    }
  }
  current_.chosen = chosen;
  limit_ = chosen;
  last_ = current_;
  // A tuning runs only for a step length with no entry: it takes an empty one, else the least recently used.
  auto slot = std::find_if(memos_.begin(), memos_.end(), [](const memo& m) { return m.step_launches == 0; });
  if (slot == memos_.end()) {
    slot = std::min_element(memos_.begin(), memos_.end(), [](const memo& a, const memo& b) { return a.used < b.used; });
  }
  *slot = memo{key_launches_, chosen, ++memo_clock_};
  ++tunings_;
  set_phase(phase::done, 0);
  finished = true;
}

}  // namespace layerswap
