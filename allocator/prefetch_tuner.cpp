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

std::size_t prefetch_tuner::observe(std::uint64_t generation, std::uint64_t step_launches, std::uint64_t step_start,
                                    std::uint64_t now_ns, bool& finished) noexcept {
  finished = false;
  if (step_launches == 0) return limit_;
  const auto restart_timing = [&] {  // the step under way began at no boundary the rounds saw
    step_start_ = step_start;
    step_seen_ns_ = now_ns;
    untimed_ = true;
  };
  if (phase_ == phase::none || !same_length(step_launches, step_launches_)) {
    // Another step length: the closest remembered within reach, else a tuning from the start.
    if (tuning()) ++abandoned_;
    memo_in_force_ = k_remembered;
    for (std::size_t i = 0; i < memos_.size(); ++i) {
      const memo& m = memos_[i];
      if (m.step_launches == 0 || !same_length(m.step_launches, step_launches)) continue;
      if (memo_in_force_ == k_remembered ||
          length_gap(m.step_launches, step_launches) < length_gap(memos_[memo_in_force_].step_launches, step_launches)) {
        memo_in_force_ = i;
      }
    }
    if (memo_in_force_ != k_remembered) {
      memos_[memo_in_force_].used = ++memo_clock_;
      limit_ = memos_[memo_in_force_].chosen;
      set_phase(phase::done, 0);
    } else {
      begin(step_launches);
    }
    step_launches_ = step_launches;
    generation_ = generation;
    restart_timing();
    return limit_;
  }
  if (generation != generation_ || step_launches != step_launches_) {
    // Relearned at the same length, or within a 64th of it: a choice stands (its entry follows the length); a
    // trial goes on, the distance being timed timed again from a settled step, the ones timed kept.
    generation_ = generation;
    step_launches_ = step_launches;
    if (phase_ == phase::done && memo_in_force_ != k_remembered) memos_[memo_in_force_].step_launches = step_launches;
    if (phase_ == phase::timed) set_phase(phase::settle, k_settle_steps);
    restart_timing();
    return limit_;
  }
  if (step_start == step_start_) return limit_;
  if (step_start < step_start_) {
    // The learner re-synced backwards: a few launches, or across the step's wrap (a boundary counted twice).
    if (2 * (step_start_ - step_start) >= step_launches) {
      restart_timing();
    } else {
      step_start_ = step_start;
    }
    return limit_;
  }
  if (2 * (step_start - step_start_) < step_launches) {
    step_start_ = step_start;  // re-synced forwards a few launches: no step passed, timing goes on from the boundary
    return limit_;
  }
  // One step began, or several since the last round: each is timed as their mean. Once a step changes the distance,
  // the rest of them ran under the last one and count for nothing.
  const std::uint64_t steps = (step_start - step_start_ + step_launches / 2) / step_launches;
  const std::uint64_t step_ns = now_ns > step_seen_ns_ ? (now_ns - step_seen_ns_) / steps : 0;
  const bool valid = !untimed_ && step_ns != 0;
  step_start_ = step_start;
  step_seen_ns_ = now_ns;
  untimed_ = false;
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
  if (phase_ == phase::settle) {  // a step that was not timed counts here too: it settled nonetheless
    if (--steps_left_ == 0) {
      set_phase(phase::timed, k_timed_steps);
      timed_count_ = 0;
    }
    return;
  }
  if (phase_ != phase::timed || !valid) return;
  ++timed_steps_;
  timed_[timed_count_++] = step_ns;
  if (timed_count_ < k_timed_steps) return;
  std::sort(timed_.begin(), timed_.end());
  current_.trials[current_.count - 1].step_ns = timed_[k_timed_steps / 2];
  next_candidate(finished);
}

void prefetch_tuner::next_candidate(bool& finished) noexcept {
  const trial& last = current_.trials[current_.count - 1];
  std::uint64_t best = last.step_ns;
  for (std::size_t i = 0; i < current_.count; ++i) best = std::min(best, current_.trials[i].step_ns);
  const bool worse =
      current_.count >= 2 && static_cast<double>(last.step_ns) > static_cast<double>(best) * (1 + k_worse);
  // A distance whose wanted set held no fewer regions than the last one's wanted the same (whole groups).
  const bool no_shrink = current_.count >= 2 && last.wanted >= current_.trials[current_.count - 2].wanted;
  const std::size_t next =
      std::min(last.regions == k_auto ? std::numeric_limits<std::size_t>::max() : last.regions, last.wanted) / 2;
  if (worse || no_shrink || current_.count == k_max_candidates || next < k_min_regions) {
    finish(finished);
    return;
  }
  current_.trials[current_.count++] = trial{next, 0, 0};
  limit_ = next;
  set_phase(phase::settle, k_settle_steps);
}

void prefetch_tuner::finish(bool& finished) noexcept {
  const double auto_ns = static_cast<double>(current_.trials[0].step_ns);
  std::size_t chosen = k_auto;
  double chosen_ns = auto_ns;
  for (std::size_t i = 1; i < current_.count; ++i) {
    const double ns = static_cast<double>(current_.trials[i].step_ns);
    if (ns <= auto_ns * (1 - k_gain) && ns < chosen_ns) chosen = current_.trials[i].regions, chosen_ns = ns;
  }
  current_.chosen = chosen;
  limit_ = chosen;
  last_ = current_;
  // A tuning runs only for a step length with no entry: it takes an empty one, else the least recently used.
  auto slot = std::find_if(memos_.begin(), memos_.end(), [](const memo& m) { return m.step_launches == 0; });
  if (slot == memos_.end()) {
    slot = std::min_element(memos_.begin(), memos_.end(), [](const memo& a, const memo& b) { return a.used < b.used; });
  }
  *slot = memo{step_launches_, chosen, ++memo_clock_};
  memo_in_force_ = static_cast<std::size_t>(slot - memos_.begin());
  ++tunings_;
  set_phase(phase::done, 0);
  finished = true;
}

}  // namespace layerswap
