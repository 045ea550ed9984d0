// The fast clock (runtime/fast_clock.hpp): its ticks, converted, agree with the steady clock.
#include "runtime/fast_clock.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

namespace layerswap {
namespace {

using std::chrono::steady_clock;

std::uint64_t steady_ns_since(steady_clock::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(steady_clock::now() - start).count());
}

TEST(FastClock, NamesItsSource) {
  const std::string source = fast_clock::source();
  EXPECT_TRUE(source == "tsc (invariant)" || source == "tsc (clocksource)" || source == "steady clock") << source;
}

TEST(FastClock, TicksNeverGoBackwardsOnOneThread) {
  std::uint64_t last = fast_clock::ticks();
  for (int i = 0; i < 100'000; ++i) {
    const std::uint64_t now = fast_clock::ticks();
    ASSERT_GE(now, last) << "at read " << i;
    last = now;
  }
}

// A sleep measured both ways: the fast clock's figure is within 2% (plus 0.2 ms for the two reads' distance) of
// the steady clock's, over a span long enough that the rate is well measured.
TEST(FastClock, ConvertedTicksMatchTheSteadyClock) {
  for (const int ms : {30, 120}) {
    const auto start = steady_clock::now();
    const std::uint64_t t0 = fast_clock::ticks();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    const std::uint64_t t1 = fast_clock::ticks();
    const std::uint64_t steady = steady_ns_since(start);
    const std::uint64_t fast = fast_clock::to_ns(t1 - t0);
    EXPECT_GE(steady, static_cast<std::uint64_t>(ms) * 1'000'000);
    EXPECT_NEAR(static_cast<double>(fast), static_cast<double>(steady), 0.02 * static_cast<double>(steady) + 200'000)
        << ms << " ms slept, source " << fast_clock::source();
  }
}

TEST(FastClock, SumsOfDifferencesConvertLikeOneSpan) {
  std::uint64_t sum = 0;
  const auto start = steady_clock::now();
  for (int i = 0; i < 5; ++i) {
    const std::uint64_t t0 = fast_clock::ticks();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    sum += fast_clock::ticks() - t0;
  }
  const std::uint64_t steady = steady_ns_since(start);
  const std::uint64_t fast = fast_clock::to_ns(sum);
  EXPECT_GE(fast, 50'000'000u);
  EXPECT_LE(fast, steady + 1'000'000);  // the five spans lie within the whole one
  EXPECT_EQ(fast_clock::to_ns(0), 0u);
}

TEST(FastClock, TicksAreCheapToRead) {
  // Not a timing target (CI machines are noisy): a bound far above a TSC read (a few ns) that still catches
  // a read gone slow (a system call, a lock). Only where the TSC is the source.
  if (std::strncmp(fast_clock::source(), "tsc", 3) != 0) GTEST_SKIP() << "ticks() reads the steady clock here";
  constexpr int n = 1'000'000;
  const std::uint64_t t0 = fast_clock::ticks();
  std::uint64_t sink = 0;
  for (int i = 0; i < n; ++i) sink += fast_clock::ticks();
  const std::uint64_t per_read = fast_clock::to_ns(fast_clock::ticks() - t0) / n;
  EXPECT_NE(sink, 0u);
  EXPECT_LT(per_read, 500u);
}

}  // namespace
}  // namespace layerswap
