// The learner (learner.hpp): step period, per-step order of use, groups and forecast, from access events.
//
// Algorithm, per launch (O(1) amortized; memory bounded by learner_options::history):
//   1. Assemble the launch from its events (continuations extend it) and remember it in a ring of the last
//      `history` launches: kernel key and region ids, each with a pointer to the region's bookkeeping
//      (first and last launch index that used it).
//   2. Candidate periods: for every (kernel, region) pair, the distance to the pair's previous use. Weights
//      recur once per step with the same kernels, so the step period is among the most frequent distances;
//      a space-saving counter keeps the 32 most frequent, and the 8 best are evaluated as lags.
//   3. Evaluating lag p (Note [Recurring at a lag]): launch i is compared with launch i - p (within `slack`
//      positions, so an inserted or removed launch costs one comparison, not the rest of the step) on its
//      kernel and its recurring regions. Launches weigh by their recurring regions; launches with none carry
//      no evidence and are skipped. Every p launches a lag closes an epoch with its mismatch share; the
//      smallest lag whose share is ≤ max_mismatch and within 1% of the best is the period. A layer's length
//      (a sub-period of the kernel sequence) fails: its weight launches touch another layer's weights.
//   4. Learning: the last `period` launches become the step template. Its recurring regions are those used
//      at least one period after they first appeared; activations with fresh ids are not. Step position 0 is
//      chosen from the content, not from where the window happened to start (Note [Step origin]). Per
//      position: kernel and a hash of the recurring regions; per region: its uses; groups (Note [Groups]).
//   5. Following: each launch is matched to the template near the expected position (expected first, then
//      ±1, ±2, ... up to `resync`): a match moves the position there and is a hit; no match advances the
//      position by one and is a miss. A block of max(64, period / 8) launches with more than half missed
//      drops the template (learned = false, generation bumped, relearns counted) and learning starts over.
//   6. Forecast: from the position, the template's uses in circular order; each region's first one is its
//      next use (distance in launches, 1..period). The template is immutable and shared with readers.
//
// Note [Recurring at a lag]
//   When launch i is compared with launch j ≈ i - p, the regions of i that count are those that existed a
//   period earlier (first seen ≤ i - p), and the regions of j that count are those used again around now
//   (last seen ≥ i - slack). Both sides thus drop regions that live for less than a period (activations that
//   get fresh ids every step) and keep the ones that recur, so that the first repeat of a step (step 1 against
//   step 0) already matches: a period is found two steps in.
//
// Note [Step origin]
//   A step is a cycle; where it "starts" only matters for step_order() and for which region leads a group.
//   Position 0 is one of the uses of the smallest recurring region id (the earliest allocated: usually the
//   first layer's weights): the one after which the next 32 distinct recurring regions most often come in
//   ascending id order. Forward passes touch weights in allocation order, backward in reverse, so this picks
//   the forward use of the first layer. A heuristic: a wrong pick shifts positions, never distances.
//
// Note [Region bookkeeping]
//   regions_ maps a region id to its first and last use; the history ring keeps pointers to its entries
//   (std::unordered_map never moves its elements). Every history_/2 launches a sweep erases regions and
//   (kernel, region) pairs not used within the last `history` launches, which no history entry can point to
//   any more: with fresh region ids every step, memory stays bounded.
//
// Note [Groups]
//   A region's uses in the step split into bursts (uses closer than burst_gap launches). Regions are taken in
//   order of first use; a group leader takes the following regions, first used within group_window launches
//   of it, whose every use lies within group_window launches of one of the leader's uses and the other way
//   round (a layer's weights: used together in forward, in backward and in the optimizer; anchored on the
//   leader, so consecutive layers do not chain into one group). A region with a single burst (optimizer
//   state) joins the group of the multi-burst
//   regions it is first used with, when they all belong to one group (per-parameter optimizer launches);
//   otherwise single-burst regions are grouped by the same window rule. A group's id is its smallest region
//   id: stable across relearns of the same program.
#include "profiler/learner.hpp"

#include <algorithm>
#include <utility>

#include "runtime/log.hpp"

namespace layerswap::profiler {

struct learner::step_template {
  std::uint64_t period = 0;
  std::vector<std::uint32_t> kernel;  // per position
  std::vector<std::uint64_t> hash;    // per position: hash of the recurring regions used there
  std::vector<region_id> regions;     // dense index -> region
  std::vector<std::uint32_t> group;   // dense index -> group id
  std::vector<std::pair<std::uint32_t, std::uint32_t>> uses;  // (position, dense index), by position
  std::vector<region_id> order;       // regions by first use
  std::unordered_map<region_id, std::uint32_t> index;
  std::size_t groups = 0;
};

namespace {

constexpr std::size_t k_distance_slots = 32;
constexpr std::size_t k_lags = 8;
constexpr std::uint64_t k_refresh = 64;
constexpr std::uint32_t k_max_regions_per_launch = 1024;

std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint32_t kernel_key(const access_event& e) noexcept {
  return e.kernel | (static_cast<std::uint32_t>(e.kind) << 28);
}

}  // namespace

learner::learner(learner_options options) : options_(options) {
  options_.history = std::max<std::size_t>(options_.history, 64);
  options_.region_slots_per_launch = std::max<std::size_t>(options_.region_slots_per_launch, 1);
  options_.min_period = std::max<std::uint64_t>(options_.min_period, std::uint64_t{options_.slack} + 2);
  launches_.resize(options_.history);
  region_ring_.resize(options_.history * options_.region_slots_per_launch);
  info_ring_.resize(region_ring_.size());
  distances_.reserve(k_distance_slots);
}

learner::~learner() = default;

// ---- assembling launches ----

void learner::on_event(const access_event& e) {
  if (e.flags & k_flag_continued) {
    if (!open_ || launches_[next_index_ % launches_.size()].launch_no != e.launch_no) {
      ++counters_.late_continued;
      std::lock_guard lock(publish_mutex_);
      publish_locked();
      return;
    }
  } else {
    if (open_) close_launch();
    launch_rec& rec = launches_[next_index_ % launches_.size()];
    rec = launch_rec{e.launch_no, region_total_, kernel_key(e), 0};
    open_ = true;
  }
  launch_rec& rec = launches_[next_index_ % launches_.size()];
  for (int k = 0; k < e.nregions; ++k) {
    const region_id id = e.regions[k];
    if (id == 0 || rec.nregions >= k_max_regions_per_launch) continue;
    if (options_.keep != nullptr && !options_.keep(id)) continue;
    auto [it, inserted] = regions_.try_emplace(id, region_info{next_index_, next_index_});
    it->second.last_seen = next_index_;
    const std::size_t slot = region_total_ % region_ring_.size();
    region_ring_[slot] = id;
    info_ring_[slot] = &it->second;
    ++region_total_;
    ++rec.nregions;
  }
  // A launch continues only in events that are full (tracker_core::record): otherwise it is complete.
  if (e.nregions < k_event_regions) close_launch();
}

void learner::flush() {
  if (open_) close_launch();
}

void learner::close_launch() {
  open_ = false;
  const std::uint64_t index = next_index_++;
  process(index);
}

bool learner::in_history(std::uint64_t index) const noexcept {
  if (index >= next_index_ || next_index_ - index > launches_.size()) return false;
  return region_total_ - launches_[index % launches_.size()].region_begin <= region_ring_.size();
}

// ---- per launch ----

void learner::process(std::uint64_t index) {
  ++counters_.launches;
  const launch_rec& rec = launches_[index % launches_.size()];
  for (std::uint32_t k = 0; k < rec.nregions; ++k) {
    const region_id id = region_ring_[(rec.region_begin + k) % region_ring_.size()];
    const std::uint64_t key = (std::uint64_t{rec.kernel_key} << 32) | id;
    auto [it, inserted] = pair_last_.try_emplace(key, index);
    if (!inserted) {
      if (!template_) count_distance(index - it->second);
      it->second = index;
    }
  }
  if (template_) {
    follow(index);
  } else {
    evaluate_lags(index);
    if (!template_ && ++since_refresh_ >= k_refresh) refresh_lags();
  }
  if (index - last_sweep_ >= launches_.size() / 2) sweep(index);
  std::lock_guard lock(publish_mutex_);
  publish_locked();
  published_launch_no_ = rec.launch_no;
}

void learner::count_distance(std::uint64_t distance) {
  if (distance < options_.min_period || distance + options_.slack > launches_.size() / 2) return;
  std::size_t smallest = 0;
  for (std::size_t k = 0; k < distances_.size(); ++k) {
    if (distances_[k].distance == distance) {
      ++distances_[k].count;
      return;
    }
    if (distances_[k].count < distances_[smallest].count) smallest = k;
  }
  if (distances_.size() < k_distance_slots) {
    distances_.push_back({distance, 1});
  } else {  // space-saving: the new distance inherits the smallest count
    distances_[smallest] = {distance, distances_[smallest].count + 1};
  }
}

void learner::refresh_lags() {
  since_refresh_ = 0;
  std::vector<distance_counter> top = distances_;
  std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) {
    return a.count != b.count ? a.count > b.count : a.distance < b.distance;
  });
  if (top.size() > k_lags) top.resize(k_lags);
  std::vector<lag> next;
  next.reserve(top.size());
  for (const distance_counter& d : top) {
    if (d.count < 2) continue;
    const auto it = std::find_if(lags_.begin(), lags_.end(), [&](const lag& l) { return l.period == d.distance; });
    next.push_back(it != lags_.end() ? *it : lag{d.distance});
  }
  lags_ = std::move(next);
}

std::uint64_t learner::recent_hash(std::uint64_t index, std::uint64_t period, std::uint32_t* count) const {
  const launch_rec& rec = launches_[index % launches_.size()];
  std::uint64_t h = 0;
  std::uint32_t n = 0;
  for (std::uint32_t k = 0; k < rec.nregions; ++k) {
    const std::size_t slot = (rec.region_begin + k) % region_ring_.size();
    if (info_ring_[slot]->first_seen + period <= index) {
      h += mix(region_ring_[slot]);
      ++n;
    }
  }
  if (count) *count = n;
  return h;
}

std::uint64_t learner::earlier_hash(std::uint64_t index, std::uint64_t now) const {
  const launch_rec& rec = launches_[index % launches_.size()];
  std::uint64_t h = 0;
  for (std::uint32_t k = 0; k < rec.nregions; ++k) {
    const std::size_t slot = (rec.region_begin + k) % region_ring_.size();
    if (info_ring_[slot]->last_seen + options_.slack >= now) h += mix(region_ring_[slot]);
  }
  return h;
}

void learner::evaluate_lags(std::uint64_t index) {
  bool closed = false;
  const std::uint32_t key = launches_[index % launches_.size()].kernel_key;
  for (lag& l : lags_) {
    const std::uint64_t p = l.period;
    if (index >= p + options_.slack) {
      std::uint32_t weight = 0;
      const std::uint64_t h = recent_hash(index, p, &weight);
      if (weight > 0) {
        bool matched = false;
        for (std::uint32_t s = 0; s <= 2 * options_.slack && !matched; ++s) {
          // Offsets 0, -1, +1, -2, +2, ...
          const std::int64_t offset = (s % 2 == 1) ? -static_cast<std::int64_t>((s + 1) / 2)
                                                   : static_cast<std::int64_t>(s / 2);
          const std::uint64_t j = index - p + static_cast<std::uint64_t>(offset);
          if (j >= index || !in_history(j)) continue;
          matched = launches_[j % launches_.size()].kernel_key == key && earlier_hash(j, index) == h;
        }
        l.compared += weight;
        if (!matched) l.mismatched += weight;
      }
    }
    // An epoch closes after a whole period with enough evidence: a lag whose epoch held one or two lucky
    // comparisons (a weight used twice by one kernel a few launches apart) must not pass for a step.
    if (++l.seen >= p && l.compared >= options_.min_compared) {
      l.last_rate = static_cast<double>(l.mismatched) / static_cast<double>(l.compared);
      ++l.epochs;
      l.seen = l.compared = l.mismatched = 0;
      closed = true;
    }
  }
  if (!closed) return;
  double best = 2.0;
  for (const lag& l : lags_) {
    if (l.epochs > 0 && l.last_rate <= options_.max_mismatch) best = std::min(best, l.last_rate);
  }
  if (best > 1.0) return;
  std::uint64_t period = 0;
  for (const lag& l : lags_) {
    if (l.epochs > 0 && l.last_rate <= best + 0.01 && (period == 0 || l.period < period)) period = l.period;
  }
  learn(index, period);
}

// ---- learning the step ----

void learner::learn(std::uint64_t index, std::uint64_t period) {
  const std::uint64_t first = index + 1 - period;
  if (!in_history(first)) return;
  auto t = std::make_shared<step_template>();
  t->period = period;

  // Recurring regions: used in the window at least a period after they first appeared.
  std::unordered_map<region_id, std::uint32_t>& dense = t->index;
  for (std::uint64_t j = first; j <= index; ++j) {
    const launch_rec& rec = launches_[j % launches_.size()];
    for (std::uint32_t k = 0; k < rec.nregions; ++k) {
      const std::size_t slot = (rec.region_begin + k) % region_ring_.size();
      if (info_ring_[slot]->first_seen + period <= j && dense.emplace(region_ring_[slot], 0).second) {
        t->regions.push_back(region_ring_[slot]);
      }
    }
  }
  std::sort(t->regions.begin(), t->regions.end());
  for (std::uint32_t d = 0; d < t->regions.size(); ++d) dense[t->regions[d]] = d;

  // Positions relative to the window's start first, then to the origin (Note [Step origin]).
  t->kernel.assign(period, 0);
  t->hash.assign(period, 0);
  for (std::uint64_t j = first; j <= index; ++j) {
    const launch_rec& rec = launches_[j % launches_.size()];
    const auto x = static_cast<std::uint32_t>(j - first);
    t->kernel[x] = rec.kernel_key;
    for (std::uint32_t k = 0; k < rec.nregions; ++k) {
      const region_id id = region_ring_[(rec.region_begin + k) % region_ring_.size()];
      if (const auto it = dense.find(id); it != dense.end()) {
        t->hash[x] += mix(id);
        t->uses.emplace_back(x, it->second);
      }
    }
  }
  std::sort(t->uses.begin(), t->uses.end());
  std::uint32_t shift = 0;
  if (!t->uses.empty()) {
    std::size_t best_score = 0;
    bool any = false;
    std::vector<std::uint32_t> walked;
    for (std::size_t u = 0; u < t->uses.size(); ++u) {
      if (t->uses[u].second != 0) continue;  // dense 0 is the smallest id
      walked.clear();
      std::size_t score = 0;
      for (std::size_t k = 0; k < t->uses.size() && walked.size() < 32; ++k) {
        const std::uint32_t d = t->uses[(u + k) % t->uses.size()].second;
        if (std::find(walked.begin(), walked.end(), d) != walked.end()) continue;
        if (!walked.empty() && d > walked.back()) ++score;
        walked.push_back(d);
      }
      if (!any || score > best_score) {
        any = true;
        best_score = score;
        shift = t->uses[u].first;
      }
    }
  }
  const std::uint64_t origin = first + shift;
  if (shift != 0) {
    std::rotate(t->kernel.begin(), t->kernel.begin() + shift, t->kernel.end());
    std::rotate(t->hash.begin(), t->hash.begin() + shift, t->hash.end());
    for (auto& use : t->uses) use.first = static_cast<std::uint32_t>((use.first + period - shift) % period);
    std::sort(t->uses.begin(), t->uses.end());
  }

  // Groups (Note [Groups]).
  const std::size_t n = t->regions.size();
  std::vector<std::vector<std::uint32_t>> bursts(n);
  std::vector<std::uint32_t> last_use(n, 0);
  for (const auto& [x, d] : t->uses) {
    if (bursts[d].empty() || x > last_use[d] + options_.burst_gap) bursts[d].push_back(x);
    last_use[d] = x;
  }
  // The step is circular: a last burst that runs into the first one is the same burst.
  std::vector<std::size_t> burst_count(n);
  for (std::uint32_t d = 0; d < n; ++d) {
    burst_count[d] = bursts[d].size();
    if (burst_count[d] > 1 && bursts[d].front() + period - last_use[d] <= options_.burst_gap) --burst_count[d];
  }
  std::vector<std::uint32_t> by_first(n);
  for (std::uint32_t d = 0; d < n; ++d) by_first[d] = d;
  std::sort(by_first.begin(), by_first.end(), [&](std::uint32_t a, std::uint32_t b) {
    return bursts[a].front() != bursts[b].front() ? bursts[a].front() < bursts[b].front() : a < b;
  });
  std::vector<std::vector<std::uint32_t>> positions(n);  // each region's uses, by position
  for (const auto& [x, d] : t->uses) positions[d].push_back(x);
  // Every use of `a` lies within group_window launches of a use of `b` (circularly).
  const auto near = [&](std::uint32_t a, std::uint32_t b) {
    const std::vector<std::uint32_t>& pb = positions[b];
    const std::uint64_t w = options_.group_window;
    for (const std::uint32_t x : positions[a]) {
      const auto it = std::lower_bound(pb.begin(), pb.end(), x);
      const bool after = it != pb.end() ? *it - x <= w : pb.front() + period - x <= w;
      const bool before = it != pb.begin() ? x - *(it - 1) <= w : x + period - pb.back() <= w;
      if (!after && !before) return false;
    }
    return true;
  };
  std::vector<std::uint32_t> group(n, 0);  // 1-based group number, 0: none yet
  std::uint32_t groups = 0;
  const auto form_groups = [&](bool multi) {
    for (std::size_t a = 0; a < n; ++a) {
      const std::uint32_t leader = by_first[a];
      if (group[leader] != 0 || (burst_count[leader] > 1) != multi) continue;
      group[leader] = ++groups;
      for (std::size_t b = a + 1; b < n; ++b) {
        const std::uint32_t r = by_first[b];
        if (bursts[r].front() > bursts[leader].front() + options_.group_window) break;
        if (group[r] != 0 || (burst_count[r] > 1) != multi) continue;
        if (near(r, leader) && near(leader, r)) group[r] = group[leader];
      }
    }
  };
  form_groups(true);
  for (std::uint32_t d = 0; d < n; ++d) {  // single-burst regions join the group they are first used with
    if (burst_count[d] != 1) continue;
    const std::uint32_t x = bursts[d].front();
    auto it = std::lower_bound(t->uses.begin(), t->uses.end(), std::make_pair(x, std::uint32_t{0}));
    std::uint32_t found = 0;
    bool unique = true;
    for (; it != t->uses.end() && it->first == x; ++it) {
      const std::uint32_t g = burst_count[it->second] > 1 ? group[it->second] : 0;
      if (g == 0) continue;
      if (found != 0 && g != found) unique = false;
      found = g;
    }
    if (found != 0 && unique) group[d] = found;
  }
  form_groups(false);
  std::vector<region_id> group_id(groups + 1, 0);  // the smallest region id of each group
  for (std::uint32_t d = 0; d < n; ++d) {
    region_id& g = group_id[group[d]];
    if (g == 0 || t->regions[d] < g) g = t->regions[d];
  }
  t->group.resize(n);
  for (std::uint32_t d = 0; d < n; ++d) t->group[d] = group_id[group[d]];
  t->groups = groups;
  t->order.reserve(n);
  for (const std::uint32_t d : by_first) t->order.push_back(t->regions[d]);

  template_ = std::move(t);
  origin_index_ = origin;
  position_ = (index + period - origin) % period;
  block_launches_ = block_misses_ = 0;
  lags_.clear();
  distances_.clear();
  ++counters_.learns;
  ++counters_.generation;
  counters_.learned = true;
  counters_.period = period;
  counters_.recurring_regions = n;
  counters_.groups = groups;
  maybe_log("learned the step");
}

// ---- following the step ----

void learner::follow(std::uint64_t index) {
  const step_template& t = *template_;
  const launch_rec& rec = launches_[index % launches_.size()];
  std::uint64_t h = 0;
  for (std::uint32_t k = 0; k < rec.nregions; ++k) {
    const region_id id = region_ring_[(rec.region_begin + k) % region_ring_.size()];
    if (t.index.count(id) != 0) h += mix(id);
  }
  const std::uint64_t period = t.period;
  const std::uint64_t expected = (position_ + 1) % period;
  std::uint64_t next = expected;
  bool hit = false;
  const std::uint64_t reach = std::min<std::uint64_t>(options_.resync, period / 2);
  for (std::uint64_t s = 0; s <= 2 * reach && !hit; ++s) {
    const std::uint64_t step = (s + 1) / 2;
    const std::uint64_t x = (s % 2 == 1) ? (expected + period - step) % period : (expected + step) % period;
    if (t.kernel[x] == rec.kernel_key && t.hash[x] == h) {
      next = x;
      hit = true;
    }
  }
  if (next < position_ && position_ - next > period / 2) ++counters_.steps;  // wrapped around
  position_ = next;
  ++counters_.predicted;
  if (hit) ++counters_.hits;
  ++block_launches_;
  if (!hit) ++block_misses_;
  if (block_launches_ >= std::max<std::uint64_t>(64, period / 8)) {
    const bool broken = block_misses_ * 2 > block_launches_;
    block_launches_ = block_misses_ = 0;
    if (broken) drop("the launch order changed; relearning");
  }
}

void learner::drop(const char* why) {
  template_.reset();
  lags_.clear();
  distances_.clear();
  since_refresh_ = 0;
  ++counters_.relearns;
  ++counters_.generation;
  counters_.learned = false;
  counters_.period = 0;
  counters_.recurring_regions = 0;
  counters_.groups = 0;
  maybe_log(why);
}

void learner::sweep(std::uint64_t index) {
  last_sweep_ = index;
  const std::uint64_t horizon = launches_.size();
  if (index < horizon) return;
  const std::uint64_t oldest = index - horizon;
  std::erase_if(regions_, [&](const auto& entry) { return entry.second.last_seen < oldest; });
  std::erase_if(pair_last_, [&](const auto& entry) { return entry.second < oldest; });
}

void learner::maybe_log(const char* what) {
  const auto now = std::chrono::steady_clock::now();
  if (logged_ && now - last_log_ < std::chrono::duration<double>(options_.log_interval_s)) {
    ++unlogged_;
    return;
  }
  LAYERSWAP_LOG(info,
                "learner: %s (period %llu launches, %llu recurring regions in %llu groups; %llu learned, %llu "
                "relearned, %llu events not logged since the last line)",
                what, static_cast<unsigned long long>(counters_.period),
                static_cast<unsigned long long>(counters_.recurring_regions),
                static_cast<unsigned long long>(counters_.groups), static_cast<unsigned long long>(counters_.learns),
                static_cast<unsigned long long>(counters_.relearns), static_cast<unsigned long long>(unlogged_));
  logged_ = true;
  last_log_ = now;
  unlogged_ = 0;
}

// ---- publishing ----

void learner::publish_locked() {
  published_ = counters_;
  published_.tracked_regions = regions_.size();
  published_.tracked_pairs = pair_last_.size();
  if (published_template_ != template_) published_template_ = template_;
  published_position_ = position_;
}

void learner::current(forecast& out, std::size_t max_regions) {
  std::shared_ptr<const step_template> t;
  std::uint64_t position = 0;
  {
    std::lock_guard lock(publish_mutex_);
    t = published_template_;
    position = published_position_;
    out.generation = published_.generation;
    out.position = published_launch_no_;
  }
  out.upcoming.clear();
  out.learned = t != nullptr;
  out.step_launches = t ? t->period : 0;
  out.step_position = t ? position : 0;
  if (!t || max_regions == 0 || t->uses.empty()) return;

  // Regions already emitted, by generation stamp (no clearing per call).
  thread_local std::vector<std::uint32_t> seen;
  thread_local std::uint32_t stamp = 0;
  if (seen.size() < t->regions.size()) seen.resize(t->regions.size(), 0);
  if (++stamp == 0) {
    std::fill(seen.begin(), seen.end(), 0);
    stamp = 1;
  }
  const std::size_t want = std::min(max_regions, t->regions.size());
  out.upcoming.reserve(want);
  const auto begin = std::upper_bound(t->uses.begin(), t->uses.end(),
                                      std::make_pair(static_cast<std::uint32_t>(position), ~std::uint32_t{0}));
  const std::size_t start = static_cast<std::size_t>(begin - t->uses.begin());
  const std::size_t total = t->uses.size();
  for (std::size_t k = 0; k < total && out.upcoming.size() < want; ++k) {
    const auto& [x, d] = t->uses[(start + k) % total];
    if (seen[d] == stamp) continue;
    seen[d] = stamp;
    const std::uint64_t distance = x > position ? x - position : x + t->period - position;
    out.upcoming.push_back(forecast_entry{t->regions[d], t->group[d], distance});
  }
}

learner_stats learner::stats() const {
  std::lock_guard lock(publish_mutex_);
  return published_;
}

std::vector<region_id> learner::step_order() const {
  std::lock_guard lock(publish_mutex_);
  return published_template_ ? published_template_->order : std::vector<region_id>{};
}

std::uint32_t learner::group_of(region_id id) const {
  std::lock_guard lock(publish_mutex_);
  if (!published_template_) return 0;
  const auto it = published_template_->index.find(id);
  return it == published_template_->index.end() ? 0 : published_template_->group[it->second];
}

}  // namespace layerswap::profiler
