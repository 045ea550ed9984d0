// The prefetch distance tuner (allocator/prefetch_tuner.hpp; residency.cpp, Note [Tuned prefetch]), as pure logic:
// steps played with a cost per distance, a policy round at each step's start.
#include "allocator/prefetch_tuner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace layerswap {
namespace {

constexpr std::uint64_t ms = 1'000'000;
constexpr std::size_t k_auto = prefetch_tuner::k_auto;

struct player {
  prefetch_tuner tuner;
  std::uint64_t now = 5 * ms;
  std::uint64_t start = 1000;      // the launch number the current step began at
  std::uint64_t generation = 1;
  std::uint64_t launches = 1000;   // the step's length
  std::size_t wanted = 40;         // the regions auto's wanted set holds
  int finished = 0;
  std::size_t rounds_per_step = 1;  // policy rounds that see each step (1: one at its start)

  // The distance in force at the round that saw the step begin, and the step played at `cost` of it.
  std::size_t step(const std::function<std::uint64_t(std::size_t)>& cost) {
    bool done = false;
    const std::size_t limit = tuner.observe(generation, launches, start, now, done);
    finished += done;
    tuner.note_wanted(limit == k_auto ? wanted : std::min(limit, wanted));
    now += cost(limit);
    start += launches;
    return limit;
  }
  void steps(int n, const std::function<std::uint64_t(std::size_t)>& cost) {
    for (int i = 0; i < n; ++i) step(cost);
  }
};

// Generation's shape (session 58, 25% of a 1.1B Llama's weights): shorter distances are faster, down to a point.
std::uint64_t generation_cost(std::size_t limit) {
  if (limit == k_auto) return 56 * ms;
  if (limit >= 20) return 45 * ms;
  if (limit >= 10) return 38 * ms;
  if (limit >= 5) return 39 * ms;
  return 60 * ms;
}

// Training's: every shorter distance is slower (16 regions 1.107x, 4 regions 1.9x).
std::uint64_t training_cost(std::size_t limit) {
  if (limit == k_auto) return 120 * ms;
  return limit >= 16 ? 133 * ms : 228 * ms;
}

TEST(PrefetchTuner, GenerationLikeStepsKeepTheFastestShorterDistance) {
  player p;
  p.steps(prefetch_tuner::k_warm_steps, generation_cost);
  EXPECT_TRUE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.limit(), k_auto) << "auto is timed first";
  p.steps(60, generation_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.limit(), 10u);
  const prefetch_tuner::outcome& o = p.tuner.last();
  EXPECT_EQ(o.chosen, 10u);
  EXPECT_EQ(o.step_launches, 1000u);
  EXPECT_EQ(o.auto_regions, 40u);
  ASSERT_EQ(o.count, 5u) << "auto, then halvings of auto's 40 regions: 20, 10, 5, 2";
  const std::size_t tried[] = {k_auto, 20, 10, 5, 2};
  const std::uint64_t timed[] = {56 * ms, 45 * ms, 38 * ms, 39 * ms, 60 * ms};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(o.trials[i].regions, tried[i]) << i;
    EXPECT_EQ(o.trials[i].step_ns, timed[i]) << i;
  }
  EXPECT_EQ(p.tuner.tunings(), 1u);
  EXPECT_EQ(p.tuner.trial_steps(), 5 * prefetch_tuner::k_timed_steps);
  EXPECT_EQ(p.step(generation_cost), 10u) << "the choice stands";
}

TEST(PrefetchTuner, TrainingLikeStepsKeepAutoAndStopAtTheFirstSlowerDistance) {
  player p;
  p.steps(40, training_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.limit(), k_auto);
  const prefetch_tuner::outcome& o = p.tuner.last();
  EXPECT_EQ(o.chosen, k_auto);
  ASSERT_EQ(o.count, 2u) << "20 regions ran 1.108x auto's step: the trial stops there";
  EXPECT_EQ(o.trials[1].regions, 20u);
  EXPECT_EQ(p.tuner.trial_steps(), 2 * prefetch_tuner::k_timed_steps);
}

TEST(PrefetchTuner, AGainSmallerThanTheMarginKeepsAuto) {
  player p;
  p.steps(60, [](std::size_t limit) { return limit == k_auto ? 100 * ms : 97 * ms; });
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().count, 5u);
  EXPECT_EQ(p.tuner.limit(), k_auto) << "3% is within the noise the margin allows for";
}

TEST(PrefetchTuner, OneSlowStepInATrialDoesNotDecideIt) {
  player p;
  int auto_steps = 0;
  p.steps(60, [&](std::size_t limit) {
    if (limit == k_auto && p.tuner.tuning() && ++auto_steps == prefetch_tuner::k_warm_steps + 2) return 500 * ms;
    return generation_cost(limit);
  });
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().trials[0].step_ns, 56 * ms) << "the median of auto's timed steps";
  EXPECT_EQ(p.tuner.limit(), 10u);
}

TEST(PrefetchTuner, EachStepLengthKeepsItsChoice) {
  player p;
  p.steps(60, generation_cost);
  ASSERT_EQ(p.tuner.limit(), 10u);
  p.launches = 700;  // another step (a prompt's pass, another model): tuned on its own, from auto
  EXPECT_EQ(p.step(training_cost), k_auto);
  EXPECT_TRUE(p.tuner.tuning());
  p.steps(60, training_cost);
  EXPECT_EQ(p.finished, 2);
  EXPECT_EQ(p.tuner.limit(), k_auto);
  const std::uint64_t timed = p.tuner.trial_steps();
  p.launches = 1000;  // back: its choice at once, no trial
  EXPECT_EQ(p.step(generation_cost), 10u);
  p.steps(20, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.trial_steps(), timed);
  EXPECT_EQ(p.tuner.tunings(), 2u);
}

TEST(PrefetchTuner, ALengthALaunchOrTwoApartIsTheSameStep) {
  player p;
  p.steps(60, generation_cost);
  ASSERT_EQ(p.tuner.limit(), 10u);
  p.launches = 1001;  // relearned a launch longer
  ++p.generation;
  p.steps(10, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.limit(), 10u);
  p.launches = 700;  // another step, then back to one close to the first: its choice, no trial
  p.steps(60, training_cost);
  ASSERT_EQ(p.tuner.tunings(), 2u);
  p.launches = 998;
  EXPECT_EQ(p.step(generation_cost), 10u);
  EXPECT_FALSE(p.tuner.tuning());
  p.launches = 1100;  // a tenth longer: another step
  p.step(generation_cost);
  EXPECT_TRUE(p.tuner.tuning());
}

TEST(PrefetchTuner, ARelearnedOrderRestartsATuningButKeepsAChoice) {
  player p;
  p.steps(prefetch_tuner::k_warm_steps + 2, generation_cost);  // auto being timed
  ASSERT_TRUE(p.tuner.tuning());
  ++p.generation;
  p.steps(prefetch_tuner::k_warm_steps, generation_cost);
  EXPECT_TRUE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.limit(), k_auto);
  p.steps(60, generation_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().count, 5u) << "the tuning began again, from auto";
  ++p.generation;
  EXPECT_EQ(p.step(generation_cost), 10u);
  p.steps(10, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.tunings(), 1u);
}

TEST(PrefetchTuner, StepsBetweenTwoRoundsAreTimedAsTheirMean) {
  prefetch_tuner t;
  bool done = false;
  std::uint64_t now = ms;
  std::uint64_t start = 0;
  int finished = 0;
  // A round every second step; each step costs 30 ms with a distance, 60 ms with auto.
  for (int i = 0; i < 60; ++i) {
    const std::size_t limit = t.observe(1, 500, start, now, done);
    finished += done;
    t.note_wanted(limit == k_auto ? 16 : limit);
    now += 2 * (limit == k_auto ? 60 : 30) * ms;
    start += 2 * 500;
  }
  ASSERT_EQ(finished, 1);
  EXPECT_EQ(t.last().trials[0].step_ns, 60 * ms);
  EXPECT_EQ(t.last().trials[1].step_ns, 30 * ms);
  EXPECT_EQ(t.limit(), 8u) << "auto's 16 regions halved; the later halvings were no faster";
}

TEST(PrefetchTuner, AStartThatMovesLessThanHalfAStepIsNoStep) {
  prefetch_tuner t;
  bool done = false;
  t.observe(1, 1000, 0, ms, done);
  for (int k = 1; k <= 100; ++k) t.observe(1, 1000, 3 * k, ms + k * ms, done);  // the learner re-synced, a little
  EXPECT_EQ(t.trial_steps(), 0u);
  EXPECT_EQ(t.limit(), k_auto);
}

TEST(PrefetchTuner, AutoWithTooFewRegionsToHalveIsKept) {
  player p;
  p.wanted = 3;
  p.steps(20, generation_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().count, 1u);
  EXPECT_EQ(p.tuner.limit(), k_auto);
}

TEST(PrefetchTuner, NoStepLengthNoTuning) {
  prefetch_tuner t;
  bool done = false;
  for (int k = 0; k < 50; ++k) EXPECT_EQ(t.observe(1, 0, 0, k * ms, done), k_auto);
  EXPECT_FALSE(t.tuning());
  EXPECT_EQ(t.trial_steps(), 0u);
}

TEST(PrefetchTuner, TheLeastRecentlyUsedStepLengthIsForgotten) {
  player p;
  for (std::uint64_t k = 0; k <= prefetch_tuner::k_remembered; ++k) {  // one more length than it keeps
    p.launches = 1000 + 100 * k;
    p.steps(60, generation_cost);
  }
  ASSERT_EQ(p.tuner.tunings(), prefetch_tuner::k_remembered + 1);
  p.launches = 1000 + 100 * prefetch_tuner::k_remembered;  // the newest: remembered
  p.step(generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  p.launches = 1000;  // the oldest: forgotten, tuned again
  p.step(generation_cost);
  EXPECT_TRUE(p.tuner.tuning());
}

}  // namespace
}  // namespace layerswap
