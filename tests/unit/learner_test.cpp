// The learner (profiler/learner.hpp) on synthetic training steps, and the launch gate's bookkeeping
// (profiler/launch_gate.hpp). No GPU: access events are made up here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "profiler/launch_dedupe.hpp"
#include "profiler/launch_gate.hpp"
#include "profiler/learner.hpp"
#include "profiler/tracker_core.hpp"
#include "runtime/log.hpp"

using namespace layerswap;
using namespace layerswap::profiler;

namespace {

struct launch_spec {
  std::uint32_t kernel = 0;
  std::vector<region_id> regions;
};

// Feeds launches to a learner as the tracker's consumer would: k_event_regions regions an event, continuations flagged.
struct feeder {
  learner& l;
  std::uint64_t launch_no = 1;

  void launch(const launch_spec& s) {
    access_event e;
    e.launch_no = launch_no++;
    e.kernel = s.kernel;
    std::size_t done = 0;
    bool first = true;
    do {
      const std::size_t n = std::min<std::size_t>(s.regions.size() - done, k_event_regions);
      e.nregions = static_cast<std::uint8_t>(n);
      e.flags = first ? 0 : k_flag_continued;
      std::copy_n(s.regions.begin() + static_cast<std::ptrdiff_t>(done), n, e.regions);
      l.on_event(e);
      done += n;
      first = false;
    } while (done < s.regions.size());
  }
  void step(const std::vector<launch_spec>& launches) {
    for (const auto& s : launches) launch(s);
  }
};

constexpr region_id k_fresh_base = 1'000'000;  // activation ids: fresh every step, never recurring

// A training step of `layers` layers: forward (20 launches a layer: weights k = 0, 1, 2 at offsets 0, 4, 8, a
// workspace region shared by the activation-only launches, activations with fresh ids), a loss, backward in
// reverse (10 launches a layer, each weight once, activations of the forward consumed), and a per-parameter
// optimizer (one launch per weight with its two state regions).
struct model {
  int layers = 8;
  region_id base = 1;            // weights: base + 3 i + k
  std::uint32_t kernel_base = 1;
  region_id fresh = k_fresh_base;

  [[nodiscard]] region_id w(int i, int k) const { return base + static_cast<region_id>(3 * i + k); }
  [[nodiscard]] region_id m(int i, int k) const { return base + 10'000 + static_cast<region_id>(2 * (3 * i + k)); }
  [[nodiscard]] region_id v(int i, int k) const { return m(i, k) + 1; }
  [[nodiscard]] region_id ws() const { return base + 50'000; }
  [[nodiscard]] std::uint32_t kernel(int k) const { return kernel_base + static_cast<std::uint32_t>(k); }

  std::vector<launch_spec> step() {
    std::vector<launch_spec> out;
    std::vector<region_id> saved(static_cast<std::size_t>(layers));
    region_id act = fresh++;
    for (int i = 0; i < layers; ++i) {
      for (int o = 0; o < 20; ++o) {
        if (o == 0 || o == 4 || o == 8) {
          const region_id next = fresh++;
          out.push_back({kernel(o / 4), {w(i, o / 4), act, next}});
          act = next;
        } else if (o % 3 == 0) {
          out.push_back({kernel(5), {ws(), act}});
        } else {
          out.push_back({kernel(6), {act}});
        }
      }
      saved[static_cast<std::size_t>(i)] = act;
    }
    out.push_back({kernel(7), {act}});  // loss
    region_id grad = fresh++;
    for (int i = layers - 1; i >= 0; --i) {
      for (int o = 0; o < 10; ++o) {
        if (o == 0 || o == 3 || o == 6) {
          const region_id next = fresh++;
          out.push_back({kernel(8 + o / 3), {w(i, 2 - o / 3), saved[static_cast<std::size_t>(i)], grad, next}});
          grad = next;
        } else {
          out.push_back({kernel(11), {grad}});
        }
      }
    }
    for (int i = 0; i < layers; ++i) {
      for (int k = 0; k < 3; ++k) out.push_back({kernel(12), {w(i, k), m(i, k), v(i, k)}});
    }
    return out;
  }
  [[nodiscard]] std::size_t step_launches() const { return static_cast<std::size_t>(layers) * 33 + 1; }
  [[nodiscard]] bool recurring(region_id id) const { return id >= base && id < k_fresh_base; }
};

// Next-use distance of every recurring region from step position x (the last consumed launch), by brute force.
std::map<region_id, std::uint64_t> expected_distances(const model& m, const std::vector<launch_spec>& step,
                                                      std::size_t x) {
  std::map<region_id, std::uint64_t> out;
  const std::size_t p = step.size();
  for (std::size_t d = 1; d <= p; ++d) {
    for (const region_id id : step[(x + d) % p].regions) {
      if (m.recurring(id)) out.emplace(id, d);
    }
  }
  return out;
}

}  // namespace

TEST(Learner, LearnsAForwardBackwardOptimizerStepInTwoToThreeSteps) {
  learner l;
  feeder f{l};
  model m;
  f.step(m.step());
  EXPECT_FALSE(l.stats().learned);
  f.step(m.step());
  f.step(m.step());
  const learner_stats s = l.stats();
  ASSERT_TRUE(s.learned) << "not learned after 3 steps";
  EXPECT_EQ(s.period, m.step_launches());
  EXPECT_EQ(s.relearns, 0u);
  EXPECT_EQ(s.learns, 1u);
  // Weights, optimizer state and the workspace recur; no activation does.
  EXPECT_EQ(s.recurring_regions, static_cast<std::uint64_t>(m.layers) * 9 + 1);
  // One group per layer (its weights and their optimizer state) and one for the workspace.
  EXPECT_EQ(s.groups, static_cast<std::uint64_t>(m.layers) + 1);
  for (int i = 0; i < m.layers; ++i) {
    const std::uint32_t g = l.group_of(m.w(i, 0));
    EXPECT_EQ(g, m.w(i, 0)) << "the group id is its smallest region id";
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(l.group_of(m.w(i, k)), g) << "layer " << i << " weight " << k;
      EXPECT_EQ(l.group_of(m.m(i, k)), g) << "layer " << i << " state " << k;
      EXPECT_EQ(l.group_of(m.v(i, k)), g) << "layer " << i << " state " << k;
    }
    if (i > 0) {
      EXPECT_NE(g, l.group_of(m.w(i - 1, 0)));
    }
  }
  EXPECT_NE(l.group_of(m.ws()), 0u);
  EXPECT_EQ(l.group_of(k_fresh_base + 5), 0u);

  // Order of first use from the step's origin (the first layer's first weight): weights layer by layer, then
  // the optimizer state.
  const std::vector<region_id> order = l.step_order();
  ASSERT_EQ(order.size(), s.recurring_regions);
  EXPECT_EQ(order.front(), m.w(0, 0));
  std::vector<region_id> weights;
  for (const region_id id : order) {
    if (id < m.base + 10'000) weights.push_back(id);
  }
  for (std::size_t k = 0; k < weights.size(); ++k) EXPECT_EQ(weights[k], m.base + k);
  EXPECT_EQ(order[static_cast<std::size_t>(m.layers) * 3 + 1], m.m(0, 0));

  // Following more steps: every launch is a hit, steps are counted.
  for (int k = 0; k < 5; ++k) f.step(m.step());
  const learner_stats t = l.stats();
  EXPECT_TRUE(t.learned);
  EXPECT_EQ(t.relearns, 0u);
  EXPECT_EQ(t.hits, t.predicted);
  EXPECT_GE(t.steps, 5u);
  EXPECT_GT(t.hit_rate(), 0.55);  // 5 of 8 steps were followed
}

TEST(Learner, ForecastOrderAndDistancesAtSeveralPositions) {
  learner l;
  feeder f{l};
  model m;
  m.layers = 6;
  for (int k = 0; k < 3; ++k) f.step(m.step());
  ASSERT_TRUE(l.stats().learned);
  const std::vector<launch_spec> step = m.step();
  const std::size_t p = step.size();
  forecast fc;
  std::size_t fed = 0;
  for (const std::size_t x : {std::size_t{0}, std::size_t{7}, std::size_t{60}, std::size_t{119}, std::size_t{120},
                              std::size_t{150}, p - 20, p - 1}) {
    while (fed <= x) f.launch(step[fed++]);
    l.current(fc, 1'000);
    ASSERT_TRUE(fc.learned);
    EXPECT_EQ(fc.step_launches, p);
    EXPECT_EQ(fc.position, f.launch_no - 1);
    const auto expected = expected_distances(m, step, x);
    ASSERT_EQ(fc.upcoming.size(), expected.size()) << "position " << x;
    std::set<region_id> once;
    for (std::size_t k = 0; k < fc.upcoming.size(); ++k) {
      const forecast_entry& e = fc.upcoming[k];
      EXPECT_TRUE(once.insert(e.region).second) << "region " << e.region << " twice";
      ASSERT_TRUE(expected.count(e.region)) << "region " << e.region;
      EXPECT_EQ(e.distance, expected.at(e.region)) << "region " << e.region << " at position " << x;
      EXPECT_EQ(e.group, l.group_of(e.region));
      if (k > 0) {
        EXPECT_GE(e.distance, fc.upcoming[k - 1].distance);
      }
    }
    // A bounded request returns the nearest ones.
    forecast few;
    l.current(few, 5);
    ASSERT_EQ(few.upcoming.size(), 5u);
    for (std::size_t k = 0; k < 5; ++k) EXPECT_EQ(few.upcoming[k].region, fc.upcoming[k].region);
  }
  const std::uint64_t generation = fc.generation;
  while (fed < p) f.launch(step[fed++]);
  l.current(fc, 10);
  EXPECT_EQ(fc.generation, generation);
}

TEST(Learner, ToleratesAFewLaunchesThatDifferPerStep) {
  learner l;
  feeder f{l};
  model m;
  std::mt19937 rng(7);
  region_id logging_fresh = 5'000'000;
  int learned_after = -1;
  for (int k = 0; k < 30; ++k) {
    std::vector<launch_spec> step = m.step();
    // Every other step a logging kernel at a random place (inserted), on a fresh region; every third step one
    // activation-only launch replaced by another kernel; every fifth step one activation-only launch removed.
    if (k % 2 == 1) {
      const auto at = static_cast<std::ptrdiff_t>(rng() % step.size());
      step.insert(step.begin() + at, launch_spec{900, {logging_fresh++}});
    }
    if (k % 3 == 2) {
      for (auto& s : step) {
        if (s.kernel == m.kernel(6) && rng() % 50 == 0) {
          s.kernel = 901;
          break;
        }
      }
    }
    if (k % 5 == 4) {
      const auto it = std::find_if(step.begin() + static_cast<std::ptrdiff_t>(rng() % 100), step.end(),
                                   [&](const launch_spec& s) { return s.kernel == m.kernel(6); });
      if (it != step.end()) step.erase(it);
    }
    f.step(step);
    if (learned_after < 0 && l.stats().learned) learned_after = k + 1;
  }
  const learner_stats s = l.stats();
  EXPECT_TRUE(s.learned);
  ASSERT_GT(learned_after, 0);
  EXPECT_LE(learned_after, 4);
  EXPECT_EQ(s.relearns, 0u);
  EXPECT_EQ(s.period, m.step_launches());
  EXPECT_GT(static_cast<double>(s.hits) / static_cast<double>(s.predicted), 0.99);
  EXPECT_EQ(s.groups, static_cast<std::uint64_t>(m.layers) + 1);
}

TEST(Learner, AChangedPatternRelearnsWithoutFloodingTheLog) {
  set_log_level(log_level::info);
  testing::internal::CaptureStderr();
  learner l;
  feeder f{l};
  model a;
  model b;
  b.layers = 5;
  b.base = 200'000;
  b.kernel_base = 100;
  b.fresh = 3'000'000;  // region ids are never reused
  for (int k = 0; k < 10; ++k) f.step(a.step());
  const learner_stats before = l.stats();
  for (int k = 0; k < 10; ++k) f.step(b.step());
  const learner_stats after = l.stats();
  // Patterns flapping every few steps: more relearns, still at most one log line in this short test.
  for (int k = 0; k < 40; ++k) f.step(k / 4 % 2 == 0 ? a.step() : b.step());
  const learner_stats flapping = l.stats();
  const std::string log = testing::internal::GetCapturedStderr();
  set_log_level(log_level::warn);

  EXPECT_TRUE(before.learned);
  EXPECT_EQ(before.period, a.step_launches());
  EXPECT_TRUE(after.learned);
  EXPECT_EQ(after.period, b.step_launches());
  EXPECT_EQ(after.relearns, 1u);
  EXPECT_GT(after.generation, before.generation);
  EXPECT_EQ(after.groups, static_cast<std::uint64_t>(b.layers) + 1);
  EXPECT_GE(flapping.relearns, 5u);
  std::size_t lines = 0;
  for (std::size_t at = log.find("learner:"); at != std::string::npos; at = log.find("learner:", at + 1)) ++lines;
  EXPECT_EQ(lines, 1u) << log;
}

TEST(Learner, MemoryStaysBoundedOverAMillionLaunches) {
  learner_options options;
  options.history = 4096;
  learner l(options);
  feeder f{l};
  // A learnable stream whose activations get fresh ids, then unlearnable noise: every region new.
  model m;
  m.layers = 4;
  std::size_t peak_regions = 0;
  std::size_t peak_pairs = 0;
  std::uint64_t launches = 0;
  while (launches < 500'000) {
    f.step(m.step());
    launches += m.step_launches();
    peak_regions = std::max(peak_regions, l.stats().tracked_regions);
    peak_pairs = std::max(peak_pairs, l.stats().tracked_pairs);
  }
  EXPECT_TRUE(l.stats().learned);
  std::mt19937 rng(3);
  region_id id = 10'000'000;
  for (int k = 0; k < 500'000; ++k) {
    f.launch({static_cast<std::uint32_t>(rng() % 50), {id++, id++, static_cast<region_id>(rng() % 100'000 + 1)}});
    if (k % 1000 == 0) {
      peak_regions = std::max(peak_regions, l.stats().tracked_regions);
      peak_pairs = std::max(peak_pairs, l.stats().tracked_pairs);
    }
  }
  const learner_stats s = l.stats();
  EXPECT_FALSE(s.learned);
  EXPECT_EQ(s.launches, launches + 500'000);
  // Bookkeeping covers at most the last 1.5 histories of launches (3 regions each).
  EXPECT_LE(peak_regions, 3 * options.history * 3 / 2 + 16);
  EXPECT_LE(peak_pairs, 3 * options.history * 3 / 2 + 16);
}

TEST(Learner, ContinuedEventsExtendOneLaunch) {
  learner l;
  feeder f{l};
  launch_spec big{3, {}};
  for (region_id id = 1; id <= 60; ++id) big.regions.push_back(id);
  f.launch(big);
  f.launch({4, {1}});
  access_event late;
  late.launch_no = 1;
  late.flags = k_flag_continued;
  late.nregions = 1;
  late.regions[0] = 99;
  l.on_event(late);  // its launch is closed already
  l.flush();
  const learner_stats s = l.stats();
  EXPECT_EQ(s.launches, 2u);
  EXPECT_EQ(s.late_continued, 1u);
}

TEST(Learner, FedByTheTrackerCore) {
  tracker_options options;
  options.recent_capacity = 16;
  tracker_core core(options);
  learner l;
  core.set_learner(&l);
  EXPECT_EQ(core.get_learner(), &l);
  model m;
  m.layers = 3;
  for (int k = 0; k < 4; ++k) {
    for (const launch_spec& s : m.step()) {
      region_set set;
      for (const region_id id : s.regions) set.add(id);
      const std::uint64_t no = core.record(launch_kind::kernel, 0, s.kernel, undecoded_reason::none, set);
      EXPECT_GT(no, 0u);
    }
    core.consume();
  }
  EXPECT_TRUE(l.stats().learned);
  EXPECT_EQ(l.stats().period, m.step_launches());
  EXPECT_EQ(l.stats().launches, 4 * m.step_launches());
  // The recent buffer still works beside it.
  EXPECT_EQ(core.drain(100).size(), 16u);
  forecast fc;
  static_cast<forecast_source&>(l).current(fc, 3);
  EXPECT_TRUE(fc.learned);
  EXPECT_EQ(fc.upcoming.size(), 3u);
  core.set_learner(nullptr);
}

// ---- the launch gate's bookkeeping ----

namespace {

struct fake_gate {
  static inline std::map<region_id, int> issuing;
  static inline std::vector<std::pair<region_id, std::uint64_t>> exits;
  static inline int enters = 0;
  static bool enter(region_id id) noexcept {
    ++issuing[id];
    ++enters;
    return false;
  }
  static void exit(region_id id, std::uint64_t launch_no) noexcept {
    --issuing[id];
    exits.emplace_back(id, launch_no);
  }
  static void reset() {
    issuing.clear();
    exits.clear();
    enters = 0;
  }
  static bool balanced() {
    return std::all_of(issuing.begin(), issuing.end(), [](const auto& e) { return e.second == 0; });
  }
};

region_set set_of(std::initializer_list<region_id> ids) {
  region_set s;
  for (const region_id id : ids) s.add(id);
  return s;
}

}  // namespace

TEST(LaunchGate, EntersAtEnterAndExitsTheSameRegionsWithTheLaunchNumber) {
  fake_gate::reset();
  static launch_gate<fake_gate> gate;  // as large as the thread-local one
  gate.open();
  gate.add_all(set_of({4, 5, 6}));
  gate.set_launch(17);
  EXPECT_EQ(fake_gate::issuing[5], 1);
  EXPECT_EQ(gate.entered(), 3);
  EXPECT_TRUE(fake_gate::exits.empty());
  gate.close();
  EXPECT_TRUE(fake_gate::balanced());
  ASSERT_EQ(fake_gate::exits.size(), 3u);
  for (const auto& [id, no] : fake_gate::exits) EXPECT_EQ(no, 17u);
  EXPECT_EQ(gate.entered(), 0);
  EXPECT_EQ(gate.depth(), 0);
  // A close without an open frame (an exit callback whose enter came before the subscription) does nothing.
  gate.close();
  EXPECT_EQ(fake_gate::exits.size(), 3u);
  // add() deduplicates within a frame (the re-decoding path); id 0 is no region.
  gate.open();
  EXPECT_TRUE(gate.add(9));
  EXPECT_FALSE(gate.add(9));
  EXPECT_FALSE(gate.add(0));
  gate.add_all(set_of({}));  // copies, memsets, graphs: an empty frame
  gate.set_launch(18);
  gate.close();
  EXPECT_EQ(fake_gate::enters, 4);
  EXPECT_TRUE(fake_gate::balanced());
}

namespace {

// A gate that holds every region it can (Note [Held regions]): a kernel frame holds, a copy frame (no_holds())
// enters its regions without holding, and close() exits each the way it was entered.
struct holding_gate {
  static inline int held_enters = 0;
  static inline int plain_enters = 0;
  static inline int held_exits = 0;
  static inline int plain_exits = 0;
  static bool enter(region_id) noexcept {
    ++plain_enters;
    return false;
  }
  static void exit(region_id, std::uint64_t) noexcept { ++plain_exits; }
  static residency_gate::entry_state enter_holding(region_id id, residency_gate::hold& h) noexcept {
    ++held_enters;
    h = residency_gate::hold{0x1000, 1, id};
    return residency_gate::entry_state::held;
  }
  static void exit_held(region_id, std::uint64_t) noexcept { ++held_exits; }
};

}  // namespace

TEST(LaunchGate, OnlyKernelFramesHoldTheirRegions) {
  static launch_gate<holding_gate> gate;
  gate.open();  // a kernel launch
  gate.add_all(set_of({4, 5}));
  EXPECT_EQ(gate.hold_count(), 2);
  gate.close();
  gate.open();  // a copy
  gate.no_holds();
  gate.add_all(set_of({4, 5}));
  EXPECT_EQ(gate.hold_count(), 0);
  gate.close();
  gate.open();  // the next kernel holds again
  gate.add_all(set_of({6}));
  EXPECT_EQ(gate.hold_count(), 1);
  gate.close();
  EXPECT_EQ(holding_gate::held_enters, 3);
  EXPECT_EQ(holding_gate::held_exits, 3);
  EXPECT_EQ(holding_gate::plain_enters, 2);
  EXPECT_EQ(holding_gate::plain_exits, 2);
}

TEST(LaunchGate, NestedFramesAndOverflowsStayBalanced) {
  fake_gate::reset();
  static launch_gate<fake_gate> gate;
  // A launch issued inside another's callbacks: frames stack and pair up.
  gate.open();
  gate.add_all(set_of({1, 2}));
  gate.set_launch(1);
  gate.open();
  gate.add_all(set_of({2, 3}));
  gate.set_launch(2);
  gate.close();
  EXPECT_EQ(fake_gate::issuing[2], 1);
  EXPECT_EQ(fake_gate::issuing[1], 1);
  ASSERT_EQ(fake_gate::exits.size(), 2u);
  EXPECT_EQ(fake_gate::exits[0], (std::pair<region_id, std::uint64_t>{2, 2}));
  EXPECT_EQ(fake_gate::exits[1], (std::pair<region_id, std::uint64_t>{3, 2}));
  gate.close();
  EXPECT_TRUE(fake_gate::balanced());
  EXPECT_EQ(fake_gate::exits.back().second, 1u);

  // Deeper than k_max_depth: the extra frames enter nothing and their closes pop nothing real.
  for (int d = 0; d < launch_gate<fake_gate>::k_max_depth + 3; ++d) {
    gate.open();
    gate.add_all(set_of({static_cast<region_id>(100 + d)}));
    gate.set_launch(static_cast<std::uint64_t>(d));
  }
  EXPECT_EQ(gate.too_deep(), 3u);
  EXPECT_EQ(fake_gate::issuing[100 + launch_gate<fake_gate>::k_max_depth], 0);
  for (int d = 0; d < launch_gate<fake_gate>::k_max_depth + 3; ++d) gate.close();
  EXPECT_EQ(gate.depth(), 0);
  EXPECT_TRUE(fake_gate::balanced());

  // More regions than the array holds: the rest is not entered (counted), never entered without an exit.
  gate.open();
  for (region_id id = 1; id <= launch_gate<fake_gate>::k_capacity + 10; ++id) gate.add(id);
  gate.set_launch(99);
  EXPECT_EQ(gate.unguarded(), 10u);
  EXPECT_EQ(gate.entered(), launch_gate<fake_gate>::k_capacity);
  gate.close();
  EXPECT_TRUE(fake_gate::balanced());

  // A subscription that ended between enter and exit: close_all() exits every open frame.
  gate.open();
  gate.add_all(set_of({7}));
  gate.open();
  gate.add_all(set_of({8}));
  gate.close_all();
  EXPECT_EQ(gate.depth(), 0);
  EXPECT_TRUE(fake_gate::balanced());
}

TEST(LaunchGate, CallbackSequenceOfRuntimeAndDriverLaunches) {
  // The switchboard of cupti_tracker.cpp: a runtime launch opens a frame at its enter, its nested driver
  // callbacks do nothing, its exit closes the frame; a driver launch at depth 0 opens and closes its own.
  fake_gate::reset();
  static launch_gate<fake_gate> gate;
  launch_nesting nesting;
  const auto runtime_enter = [&](std::initializer_list<region_id> ids, std::uint64_t no) {
    nesting.runtime_enter();
    gate.open();
    gate.add_all(set_of(ids));
    gate.set_launch(no);
  };
  const auto runtime_exit = [&] {
    gate.close();
    nesting.runtime_exit();
  };
  const auto driver = [&](bool enter, std::initializer_list<region_id> ids, std::uint64_t no) {
    if (nesting.driver_is_nested()) return;
    if (!enter) {
      gate.close();
      return;
    }
    gate.open();
    gate.add_all(set_of(ids));
    gate.set_launch(no);
  };
  runtime_enter({1, 2}, 1);
  driver(true, {1, 2}, 0);   // nested: skipped
  EXPECT_EQ(fake_gate::issuing[1], 1);
  driver(false, {}, 0);      // nested exit: skipped
  EXPECT_EQ(fake_gate::issuing[1], 1);
  runtime_exit();
  EXPECT_EQ(fake_gate::issuing[1], 0);
  driver(true, {3}, 2);      // cuBLASLt straight through the driver
  EXPECT_EQ(fake_gate::issuing[3], 1);
  driver(false, {}, 0);
  EXPECT_TRUE(fake_gate::balanced());
  EXPECT_EQ(fake_gate::exits.size(), 3u);
  EXPECT_EQ(fake_gate::exits.back(), (std::pair<region_id, std::uint64_t>{3, 2}));
}

namespace layerswap::profiler {
namespace {

// A real access stream: 6 steps of a 1.1B Llama LoRA run recorded on the H100 (tests/data/llama_lora_launches.txt),
// whose steps are 4,050 launches apart for most parameter uses (4,402 for some: steps differ a little). On the
// H100 the learner learned 18-launch "steps" here 88 times: a lag whose last epoch held one lucky comparison was
// accepted. It must find the step.
// tests/data/llama_lora_launches.txt: one launch a line, its kernel key and then its regions ('#': a comment).
std::vector<launch_spec> read_llama_lora_launches() {
  const std::string path = std::string(LAYERSWAP_TEST_DATA_DIR) + "/llama_lora_launches.txt";
  std::vector<launch_spec> launches;
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return launches;
  char line[4096];
  while (std::fgets(line, sizeof line, f)) {
    if (line[0] == '#') continue;
    launch_spec s;
    char* p = line;
    char* end = nullptr;
    s.kernel = static_cast<std::uint32_t>(std::strtoul(p, &end, 10));
    for (p = end;; p = end) {
      const unsigned long r = std::strtoul(p, &end, 10);
      if (end == p) break;
      s.regions.push_back(static_cast<region_id>(r));
    }
    launches.push_back(std::move(s));
  }
  std::fclose(f);
  return launches;
}

TEST(LearnerReplay, FindsTheStepOfARealLlamaLoraRun) {
  const std::vector<launch_spec> launches = read_llama_lora_launches();
  ASSERT_GT(launches.size(), 20000u) << "tests/data/llama_lora_launches.txt";
  learner l;
  feeder feed{l};
  std::uint64_t max_period = 0;
  for (const launch_spec& s : launches) {
    feed.launch(s);
    max_period = std::max<std::uint64_t>(max_period, l.stats().period);
  }
  const learner_stats st = l.stats();
  std::printf("replay: learned %llu times, relearned %llu, last period %llu, largest period %llu, %llu recurring "
              "regions, %llu groups\n",
              static_cast<unsigned long long>(st.learns), static_cast<unsigned long long>(st.relearns),
              static_cast<unsigned long long>(st.period), static_cast<unsigned long long>(max_period),
              static_cast<unsigned long long>(st.recurring_regions), static_cast<unsigned long long>(st.groups));
  EXPECT_GE(max_period, 4000u) << "the learner never learned a step-sized period";
  EXPECT_LE(st.learns, 4u) << "the learner kept learning and dropping periods";
}

// The step's start that a forecast implies (its launch number less its position in the step) is what
// LAYERSWAP_PREFETCH=tune times steps by (allocator/prefetch_tuner.hpp): on the real stream, read as the migration
// thread's rounds would (every 100 launches), it must move by one period at each step and otherwise only by the
// learner's re-syncs, a few launches. The stream is played three times over; a generation's change (relearned at the
// seams, where the run's first step differs) starts the count again.
TEST(LearnerReplay, TheForecastsStepStartMovesByOnePeriodAStep) {
  const std::vector<launch_spec> launches = read_llama_lora_launches();
  ASSERT_GT(launches.size(), 20000u) << "tests/data/llama_lora_launches.txt";
  learner l;
  feeder feed{l};
  forecast f;
  std::uint64_t generation = 0;
  std::uint64_t start = 0;
  int steps = 0;
  int resyncs = 0;
  for (int pass = 0; pass < 3; ++pass) {
    for (std::size_t i = 0; i < launches.size(); ++i) {
      feed.launch(launches[i]);
      if (i % 100 != 0) continue;
      l.current(f, 0);
      if (!f.learned) continue;
      ASSERT_GE(f.position, f.step_position);
      const std::uint64_t now = f.position - f.step_position;
      if (f.generation != generation) {
        generation = f.generation;
        start = now;
        continue;
      }
      const auto moved = static_cast<std::int64_t>(now - start);
      const auto period = static_cast<std::int64_t>(f.step_launches);
      if (2 * moved >= period) {
        EXPECT_LE(std::abs(moved - period), period / 16) << "launch " << i << " of pass " << pass;
        ++steps;
      } else if (moved != 0) {
        EXPECT_LT(std::abs(moved), period / 16) << "launch " << i << " of pass " << pass;
        ++resyncs;
      }
      start = now;
    }
  }
  EXPECT_GE(steps, 8) << "steps seen within a generation over three passes (" << resyncs << " re-syncs)";
}

}  // namespace
}  // namespace layerswap::profiler
