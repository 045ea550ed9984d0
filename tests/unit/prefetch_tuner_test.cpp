// The prefetch distance tuner (allocator/prefetch_tuner.hpp; residency.cpp, Note [Tuned prefetch]), as pure logic:
// steps played with a cost per distance, a policy round at each step's start.
#include "allocator/prefetch_tuner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

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
  std::uint64_t steps_per_round = 1;  // steps between two policy rounds (1: a round at each step's start)
  std::size_t group = 1;              // the policy wants whole groups of this many regions

  std::size_t wanted_under(std::size_t limit) const {
    if (limit == k_auto) return wanted;
    return std::min(wanted, (limit + group - 1) / group * group);  // whole groups: the limit is checked before one
  }
  // A round: the distance in force there, and steps_per_round steps played at `cost` of it.
  std::size_t step(const std::function<std::uint64_t(std::size_t)>& cost) {
    bool done = false;
    const std::size_t limit = tuner.observe(generation, launches, start, now, done);
    finished += done;
    tuner.note_wanted(wanted_under(limit));
    now += steps_per_round * cost(limit);
    start += steps_per_round * launches;
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
  ASSERT_EQ(o.count, 5u) << "auto, then halvings of auto's 40 regions: 20, 10, 5, 2";
  const std::size_t tried[] = {k_auto, 20, 10, 5, 2};
  const std::uint64_t timed[] = {56 * ms, 45 * ms, 38 * ms, 39 * ms, 60 * ms};
  const std::size_t wanted[] = {40, 20, 10, 5, 2};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(o.trials[i].regions, tried[i]) << i;
    EXPECT_EQ(o.trials[i].step_ns, timed[i]) << i;
    EXPECT_EQ(o.trials[i].wanted, wanted[i]) << i;
  }
  EXPECT_EQ(p.tuner.tunings(), 1u);
  EXPECT_EQ(p.tuner.timed_steps(), 5 * prefetch_tuner::k_timed_steps);
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
  EXPECT_EQ(p.tuner.timed_steps(), 2 * prefetch_tuner::k_timed_steps);
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
  const std::uint64_t timed = p.tuner.timed_steps();
  p.launches = 1000;  // back: its choice at once, no trial
  EXPECT_EQ(p.step(generation_cost), 10u);
  p.steps(20, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.timed_steps(), timed);
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

TEST(PrefetchTuner, ARelearnedOrderRetimesTheDistanceUnderWayAndKeepsTheRest) {
  player p;
  // Relearned every 8 steps (a prompt before each few tokens): the tuning still ends, with generation's choice.
  for (int k = 0; k < 12 && p.finished == 0; ++k) {
    p.steps(8, generation_cost);
    ++p.generation;
  }
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.limit(), 10u);
  EXPECT_EQ(p.tuner.last().count, 5u);
  EXPECT_EQ(p.tuner.last().trials[2].step_ns, 38 * ms) << "no step that spanned a relearn was timed";
  EXPECT_EQ(p.tuner.abandoned(), 0u);
  ++p.generation;  // a choice stands
  EXPECT_EQ(p.step(generation_cost), 10u);
  p.steps(10, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  EXPECT_EQ(p.tuner.tunings(), 1u);
}

// Relearned every k steps, the relearn seen at a step's start or in the middle of one: every trial ends (with what
// it timed when the relearns leave nothing to time), and what is kept is auto or a distance faster than auto.
TEST(PrefetchTuner, FrequentRelearnsEndTheTrialWithAFasterDistanceOrAuto) {
  for (const bool mid : {false, true}) {
    for (int k = 1; k <= 10; ++k) {
      for (const auto& [cost, name] : {std::pair{&generation_cost, "generation"}, {&training_cost, "training"}}) {
        player p;
        int steps = 0;
        for (; steps < 400 && p.finished == 0; ++steps) {
          if (steps % k == k - 1) {
            if (mid) {  // a round in the middle of the step under way sees the relearned order
              bool done = false;
              p.tuner.observe(p.generation + 1, p.launches, p.start - p.launches, p.now - 10 * ms, done);
              p.finished += done;
            }
            ++p.generation;
          }
          p.step(cost);
        }
        const std::string what = std::string(name) + ", relearned every " + std::to_string(k) + " steps" +
                                 (mid ? " mid-step" : " at a start");
        ASSERT_EQ(p.finished, 1) << what;
        EXPECT_LE(steps, 200) << what;
        const std::size_t kept = p.tuner.limit();
        if (kept != k_auto) {
          EXPECT_LE((*cost)(kept), (*cost)(k_auto) * 95 / 100) << what << ": kept " << kept;
        }
        if (cost == &training_cost) {
          EXPECT_EQ(kept, k_auto) << what;
        }
      }
    }
  }
}

TEST(PrefetchTuner, RelearnsThatBeginAfterAutoWasTimedLeaveNoSlowerDistance) {
  for (int k = 1; k <= 4; ++k) {
    player p;
    p.steps(7, training_cost);  // auto timed, the 20-region distance settling
    for (int i = 0; i < 300 && p.finished == 0; ++i) {
      if (i % k == 0) ++p.generation;
      p.step(training_cost);
    }
    ASSERT_EQ(p.finished, 1) << k;
    EXPECT_EQ(p.tuner.limit(), k_auto) << "relearned every " << k << " steps";
  }
}

TEST(PrefetchTuner, AForwardResyncOfPartOfAStepIsNotTimed) {
  player p;
  p.steps(prefetch_tuner::k_warm_steps + 1, generation_cost);  // auto timed from here
  bool done = false;
  for (int k = 0; k < 2; ++k) {  // twice, so that the median would show either part
    p.tuner.observe(p.generation, p.launches, p.start, p.now, done);  // a round sees the next step begin
    p.now += 30 * ms;
    p.start += p.launches / 2 + 40;  // the learner re-synced forwards half a step and more
    p.tuner.observe(p.generation, p.launches, p.start, p.now, done);
    p.now += 26 * ms;  // the rest of the step the learner now counts from: it began before the round saw it
    p.start += p.launches;
  }
  p.steps(60, generation_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().trials[0].step_ns, 56 * ms) << "the part-steps were not timed";
}

TEST(PrefetchTuner, ALengthThatDriftsPastA64thOfTheOneTunedIsTunedAgain) {
  player p;
  p.steps(60, generation_cost);
  ASSERT_EQ(p.tuner.limit(), 10u);
  bool retuned = false;
  for (int i = 0; i < 40 && !retuned; ++i) {  // relearned a launch longer each time
    ++p.launches;
    ++p.generation;
    p.steps(2, generation_cost);
    retuned = p.tuner.tuning();
    if (!retuned) {
      EXPECT_LE(p.launches, 1000u + 1000u / 64) << "a length beyond a 64th kept the choice";
    }
  }
  EXPECT_TRUE(retuned);
  EXPECT_GT(p.launches, 1000u + 1000u / 64);
}

TEST(PrefetchTuner, ADistanceThatWantsTheSameSetIsNotChosenOnItsTime) {
  player p;
  p.group = 9;
  p.wanted = 36;
  p.steps(60, [](std::size_t limit) -> std::uint64_t {
    if (limit == k_auto) return 50 * ms;
    if (limit >= 18) return 40 * ms;
    return (limit >= 9 ? 35 : 34) * ms;  // 4 regions want the same 9 as 9 did: its 34 ms is noise
  });
  ASSERT_EQ(p.finished, 1);
  EXPECT_TRUE(p.tuner.last().trials[3].same_set);
  EXPECT_EQ(p.tuner.limit(), 9u);
}

// Steps shorter than the rounds' period: several between two rounds. Each is timed as their mean, and once one of
// them ends a distance's trial the rest (run under it) count for nothing: the outcome is a round a step's.
TEST(PrefetchTuner, SeveralStepsBetweenTwoRoundsTimeTheDistanceTheyRanUnder) {
  for (std::uint64_t k = 2; k <= 7; ++k) {
    player p;
    p.steps_per_round = k;
    p.steps(80, generation_cost);
    ASSERT_EQ(p.finished, 1) << k << " steps a round";
    const prefetch_tuner::outcome& o = p.tuner.last();
    EXPECT_EQ(o.chosen, 10u) << k;
    ASSERT_EQ(o.count, 5u) << k;
    const std::uint64_t timed[] = {56 * ms, 45 * ms, 38 * ms, 39 * ms, 60 * ms};
    const std::size_t wanted[] = {40, 20, 10, 5, 2};
    for (std::size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(o.trials[i].step_ns, timed[i]) << k << " steps a round, trial " << i;
      EXPECT_EQ(o.trials[i].wanted, wanted[i]) << k << " steps a round, trial " << i;
    }
  }
}

TEST(PrefetchTuner, ADistanceThatWantsNoFewerRegionsEndsTheTrial) {
  player p;
  p.group = 9;  // four layers of nine regions
  p.wanted = 36;
  p.steps(60, [](std::size_t limit) -> std::uint64_t {
    if (limit == k_auto) return 50 * ms;
    return (limit >= 18 ? 40 : 35) * ms;
  });
  ASSERT_EQ(p.finished, 1);
  const prefetch_tuner::outcome& o = p.tuner.last();
  ASSERT_EQ(o.count, 4u) << "auto (36 wanted), 18, 9, then 4 wants a group of 9 again: no shorter";
  EXPECT_EQ(o.trials[3].regions, 4u);
  EXPECT_EQ(o.trials[3].wanted, 9u);
  EXPECT_EQ(o.chosen, 9u);
}

TEST(PrefetchTuner, AResyncBackAcrossTheWrapTimesNoPhantomStep) {
  player p;
  p.steps(prefetch_tuner::k_warm_steps + 1, generation_cost);  // auto timed from here
  ASSERT_TRUE(p.tuner.tuning());
  bool done = false;
  p.tuner.observe(p.generation, p.launches, p.start, p.now, done);  // a round sees the next step begin
  p.now += 5 * ms;
  p.tuner.observe(p.generation, p.launches, p.start - p.launches + 3, p.now, done);  // the learner re-synced back
  p.now += 51 * ms;
  p.start += p.launches;
  p.steps(60, generation_cost);
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().trials[0].step_ns, 56 * ms) << "the step counted twice was not timed";
  EXPECT_EQ(p.tuner.limit(), 10u);
}

TEST(PrefetchTuner, StepsThatTookNoTimeAreNotTimed) {
  player p;
  int twenty = 0;
  p.steps(80, [&](std::size_t limit) -> std::uint64_t {
    if (limit == 20 && ++twenty % 2 == 0) return 0;  // a clock that did not move
    return generation_cost(limit);
  });
  ASSERT_EQ(p.finished, 1);
  EXPECT_EQ(p.tuner.last().trials[1].step_ns, 45 * ms);
  EXPECT_EQ(p.tuner.limit(), 10u);
}

TEST(PrefetchTuner, AStartThatMovesLessThanHalfAStepIsNoStep) {
  prefetch_tuner t;
  bool done = false;
  t.observe(1, 1000, 0, ms, done);
  for (int k = 1; k <= 100; ++k) t.observe(1, 1000, 3 * k, ms + k * ms, done);  // the learner re-synced, a little
  EXPECT_EQ(t.timed_steps(), 0u);
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
  EXPECT_EQ(t.timed_steps(), 0u);
}

TEST(PrefetchTuner, TheLeastRecentlyUsedStepLengthIsForgotten) {
  player p;
  for (std::uint64_t k = 0; k < prefetch_tuner::k_remembered; ++k) {  // as many lengths as it keeps
    p.launches = 1000 + 100 * k;
    p.steps(60, generation_cost);
  }
  p.launches = 1000;  // the oldest used again: now the second oldest, 1100, is the least recently used
  p.steps(5, generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  p.launches = 1000 + 100 * prefetch_tuner::k_remembered;  // one more length
  p.steps(60, generation_cost);
  ASSERT_EQ(p.tuner.tunings(), prefetch_tuner::k_remembered + 1);
  p.launches = 1000;  // remembered
  p.step(generation_cost);
  EXPECT_FALSE(p.tuner.tuning());
  p.launches = 1100;  // forgotten, tuned again
  p.step(generation_cost);
  EXPECT_TRUE(p.tuner.tuning());
}

TEST(PrefetchTuner, ATuningLeftForAnotherStepLengthIsCountedAbandoned) {
  player p;
  p.steps(6, generation_cost);
  ASSERT_TRUE(p.tuner.tuning());
  p.launches = 700;
  p.step(training_cost);
  EXPECT_EQ(p.tuner.abandoned(), 1u);
  EXPECT_TRUE(p.tuner.tuning()) << "the new length's own tuning";
}

}  // namespace
}  // namespace layerswap
