// The prefetch distance tuner (prefetch_tuner.hpp; residency.cpp, Note [Tuned prefetch]).
#include "allocator/prefetch_tuner.hpp"

#include <algorithm>

namespace layerswap {

namespace {

// Two learned step lengths of one workload: a relearned step may count a few launches more or less (within a 64th,
// or two launches).
bool same_length(std::uint64_t a, std::uint64_t b) noexcept {
  const std::uint64_t d = a > b ? a - b : b - a;
  return d <= std::max<std::uint64_t>(2, std::max(a, b) / 64);
}

}  // namespace

std::size_t prefetch_tuner::observe(std::uint64_t generation, std::uint64_t step_launches, std::uint64_t step_start,
                                    std::uint64_t now_ns, bool& finished) noexcept {
  finished = false;
  if (step_launches == 0) return limit_;
  if (phase_ == phase::none || !same_length(step_launches, step_launches_)) {
    // Another step length: its remembered choice, else a tuning from the start.
    const auto it = std::find_if(memos_.begin(), memos_.end(), [&](const memo& m) {
      return m.step_launches != 0 && same_length(m.step_launches, step_launches);
    });
    if (it != memos_.end()) {
      it->used = ++memo_clock_;
      limit_ = it->chosen;
      set_phase(phase::done, 0);
      step_launches_ = step_launches;
    } else {
      begin(step_launches);
    }
    generation_ = generation;
    step_start_ = step_start;
    step_seen_ns_ = now_ns;
    return limit_;
  }
  if (generation != generation_ || step_launches != step_launches_) {
    // Relearned at the same length, or within a 64th of it: a choice stands; a tuning starts over (its
    // steps may have timed another order).
    generation_ = generation;
    step_launches_ = step_launches;
    if (tuning()) begin(step_launches);
    step_start_ = step_start;
    step_seen_ns_ = now_ns;
    return limit_;
  }
  if (step_start == step_start_) return limit_;
  if (step_start < step_start_ || 2 * (step_start - step_start_) < step_launches) {
    step_start_ = step_start;  // the learner moved its start (no step passed): keep timing from the last boundary
    return limit_;
  }
  // One step began, or several since the last round: each is timed as their mean.
  const std::uint64_t steps = (step_start - step_start_ + step_launches / 2) / step_launches;
  const std::uint64_t step_ns = now_ns > step_seen_ns_ ? (now_ns - step_seen_ns_) / steps : 0;
  step_start_ = step_start;
  step_seen_ns_ = now_ns;
  for (std::uint64_t k = 0; k < steps && tuning(); ++k) on_step(step_ns, finished);
  return limit_;
}

void prefetch_tuner::note_wanted(std::size_t regions) noexcept {
  if (phase_ == phase::timed) wanted_most_ = std::max(wanted_most_, regions);
}

void prefetch_tuner::begin(std::uint64_t step_launches) noexcept {
  step_launches_ = step_launches;
  limit_ = k_auto;
  current_ = outcome{};
  current_.step_launches = step_launches;
  set_phase(phase::warm, k_warm_steps);
}

void prefetch_tuner::on_step(std::uint64_t step_ns, bool& finished) noexcept {
  switch (phase_) {
    case phase::warm:
    case phase::settle:
      if (--steps_left_ != 0) return;
      if (phase_ == phase::warm) current_.trials[current_.count++] = trial{k_auto, 0};  // auto first
      set_phase(phase::timed, k_timed_steps);
      timed_count_ = 0;
      wanted_most_ = 0;
      return;
    case phase::timed: {
      ++trial_steps_;
      timed_[timed_count_++] = step_ns;
      if (timed_count_ < k_timed_steps) return;
      std::sort(timed_.begin(), timed_.end());
      trial& t = current_.trials[current_.count - 1];
      t.step_ns = timed_[k_timed_steps / 2];
      if (t.regions == k_auto) current_.auto_regions = wanted_most_;
      next_candidate(finished);
      return;
    }
    case phase::none:
    case phase::done:
      return;
  }
}

void prefetch_tuner::next_candidate(bool& finished) noexcept {
  const trial& last = current_.trials[current_.count - 1];
  std::uint64_t best = last.step_ns;
  for (std::size_t i = 0; i < current_.count; ++i) best = std::min(best, current_.trials[i].step_ns);
  const bool worse =
      current_.count >= 2 && static_cast<double>(last.step_ns) > static_cast<double>(best) * (1 + k_worse);
  const std::size_t next = (last.regions == k_auto ? current_.auto_regions : last.regions) / 2;
  if (worse || current_.count == k_max_candidates || next < k_min_regions) {
    finish(finished);
    return;
  }
  current_.trials[current_.count++] = trial{next, 0};
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
  ++tunings_;
  set_phase(phase::done, 0);
  finished = true;
}

}  // namespace layerswap
