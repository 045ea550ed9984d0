// The driver port's call counters (runtime/driver_calls.hpp): each timed call counts once, under the caller's role;
// and the order of the program's and the engine's calls (Note [Program first]).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "runtime/driver_calls.hpp"

namespace layerswap {
namespace {

std::uint64_t calls(const char* name, bool engine) {
  std::uint64_t n = 0;
  driver_calls::for_each([&](const driver_calls::row& r) {
    if (std::string(r.name) == name && r.engine == engine) n = r.calls;
  });
  return n;
}

TEST(DriverCalls, EachTimedCallCountsOnceUnderItsCallersRole) {
  const std::uint64_t program_map = calls("map", false);
  const std::uint64_t engine_map = calls("map", true);
  const std::uint64_t engine_access = calls("set_access", true);
  { const driver_calls::timer t(driver_calls::kind::map); }
  std::thread engine([] {
    driver_calls::set_engine_thread();
    { const driver_calls::timer t(driver_calls::kind::map); }
    { const driver_calls::timer t(driver_calls::kind::set_access); }
    { const driver_calls::timer t(driver_calls::kind::set_access); }
  });
  engine.join();
  EXPECT_EQ(driver_calls::this_thread_role(), 0);  // the role belongs to the thread that set it
  EXPECT_EQ(calls("map", false), program_map + 1);
  EXPECT_EQ(calls("map", true), engine_map + 1);
  EXPECT_EQ(calls("set_access", true), engine_access + 2);
}

// A program thread's driver call of `kind`, open from construction (once the thread is in it) until release() or
// destruction.
class open_program_call {
 public:
  explicit open_program_call(driver_calls::kind kind)
      : thread_([this, kind] {
          const driver_calls::call c(kind);
          in_ = true;
          while (!release_) std::this_thread::yield();
        }) {
    while (!in_) std::this_thread::yield();
  }
  ~open_program_call() { release(); }
  open_program_call(const open_program_call&) = delete;
  open_program_call& operator=(const open_program_call&) = delete;
  void release() {
    release_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> in_{false};
  std::atomic<bool> release_{false};
  std::thread thread_;
};

// Waits until `flag` is set or `limit` has passed; returns the flag.
bool wait_for(const std::atomic<bool>& flag, std::chrono::steady_clock::duration limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!flag && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  return flag;
}

// While a program thread holds a driver call of `program_kind` open, an engine thread makes a VMM call. Returns
// whether the engine's call began while the program's was open.
bool engine_call_overlaps_program_call(driver_calls::kind program_kind) {
  open_program_call program(program_kind);
  std::atomic<bool> engine_in{false};
  std::thread engine([&] {
    driver_calls::set_engine_thread();
    const driver_calls::call c(driver_calls::kind::unmap);
    engine_in = true;
  });
  // A correct turn never lets the engine in while the program's call is open, up to k_turn_limit.
  const bool overlapped = wait_for(engine_in, driver_calls::k_turn_limit / 2);
  program.release();
  engine.join();
  EXPECT_TRUE(engine_in);  // the engine's call always happens
  return overlapped;
}

// Note [Launches beside the engine's calls]: with marking on, the engine's call publishes its kind for its
// duration; the program's calls publish nothing, and nothing is published with marking off.
TEST(DriverCalls, TheEnginesCallIsPublishedWhileMarkingIsOn) {
  driver_calls::set_engine_call_marking(true);
  std::atomic<int> seen_inside{-1};
  std::atomic<int> seen_after{-1};
  std::atomic<int> seen_unmarked{-1};
  std::thread engine([&] {
    driver_calls::set_engine_thread();
    {
      const driver_calls::call c(driver_calls::kind::set_access);
      seen_inside = driver_calls::engine_call_now();
    }
    seen_after = driver_calls::engine_call_now();
    driver_calls::set_engine_call_marking(false);
    {
      const driver_calls::call c(driver_calls::kind::map);
      seen_unmarked = driver_calls::engine_call_now();
    }
  });
  engine.join();
  EXPECT_EQ(seen_inside.load(), static_cast<int>(driver_calls::kind::set_access) + 1);
  EXPECT_EQ(seen_after.load(), 0);
  EXPECT_EQ(seen_unmarked.load(), 0);
  driver_calls::set_engine_call_marking(true);
  {
    const driver_calls::call c(driver_calls::kind::map);  // a program thread's
    EXPECT_EQ(driver_calls::engine_call_now(), 0);
  }
  driver_calls::set_engine_call_marking(false);
}

TEST(DriverCalls, TheEngineWaitsWhileAProgramThreadIsInAVmmCall) {
  driver_calls::set_program_first(true);
  const std::uint64_t waits = calls("turn_wait", true);
  EXPECT_FALSE(engine_call_overlaps_program_call(driver_calls::kind::map));
  EXPECT_FALSE(engine_call_overlaps_program_call(driver_calls::kind::create));
  EXPECT_EQ(calls("turn_wait", true), waits + 2);
  EXPECT_EQ(driver_calls::program_calls_in_progress(), 0);
}

TEST(DriverCalls, TheEngineLetsTheProgramsNextCallOfASequenceGoFirst) {
  // The engine's call right after a program's VMM call waits until k_program_grace has passed since it ended. The
  // engine thread is running before the program's call ends, so only the grace can keep it out.
  driver_calls::set_program_first(true);
  std::this_thread::sleep_for(2 * driver_calls::k_program_grace);  // past any earlier test's grace
  std::atomic<bool> engine_ready{false};
  std::atomic<bool> go{false};
  std::chrono::steady_clock::time_point program_end;
  std::chrono::steady_clock::time_point engine_start;
  std::thread engine([&] {
    driver_calls::set_engine_thread();
    engine_ready = true;
    while (!go) {
    }
    const driver_calls::call c(driver_calls::kind::set_access);
    engine_start = std::chrono::steady_clock::now();
  });
  while (!engine_ready) std::this_thread::yield();
  { const driver_calls::call c(driver_calls::kind::map); }
  program_end = std::chrono::steady_clock::now();
  go = true;
  engine.join();
  // program_end is read just after the grace's start is stored: a quarter of the grace absorbs that gap. Without the
  // grace the engine starts within a few microseconds.
  EXPECT_GE(engine_start - program_end, driver_calls::k_program_grace * 3 / 4);
}

TEST(DriverCalls, TheEngineWaitsNoLongerThanTheTurnLimit) {
  // A program's VMM call that never ends (a driver that made it wait for the GPU, and the GPU for the engine) must
  // not stop the engine for good.
  driver_calls::set_program_first(true);
  open_program_call program(driver_calls::kind::unmap);
  std::chrono::steady_clock::duration waited{};
  std::atomic<bool> engine_done{false};
  std::thread engine([&] {
    driver_calls::set_engine_thread();
    const auto start = std::chrono::steady_clock::now();
    { const driver_calls::call c(driver_calls::kind::map); }
    waited = std::chrono::steady_clock::now() - start;
    engine_done = true;
  });
  EXPECT_TRUE(wait_for(engine_done, driver_calls::k_turn_limit * 50))
      << "the engine still waits for a program call open for 50 times the limit";
  program.release();
  engine.join();
  EXPECT_GE(waited, driver_calls::k_turn_limit);
}

TEST(DriverCalls, AProgramCallThatMayWaitForTheGpuHoldsNoTurn) {
  // An event wait may wait for launches that wait for the engine (Note [Program first]): it must not hold it back.
  driver_calls::set_program_first(true);
  EXPECT_TRUE(engine_call_overlaps_program_call(driver_calls::kind::other));
  EXPECT_TRUE(engine_call_overlaps_program_call(driver_calls::kind::record));
  EXPECT_EQ(driver_calls::program_calls_in_progress(), 0);
}

TEST(DriverCalls, WithoutProgramFirstTheEngineDoesNotWait) {
  driver_calls::set_program_first(false);
  const std::uint64_t waits = calls("turn_wait", true);
  EXPECT_TRUE(engine_call_overlaps_program_call(driver_calls::kind::map));
  EXPECT_EQ(calls("turn_wait", true), waits);
  driver_calls::set_program_first(true);
}

TEST(DriverCalls, TheEnginesOtherCallsDoNotWait) {
  // An event record or query may be made under the allocator mutex, which the program's next call needs anyway.
  driver_calls::set_program_first(true);
  open_program_call program(driver_calls::kind::set_access);
  const std::uint64_t waits = calls("turn_wait", true);
  std::atomic<bool> engine_done{false};
  std::thread engine([&] {
    driver_calls::set_engine_thread();
    for (const auto k : {driver_calls::kind::record, driver_calls::kind::query, driver_calls::kind::copy,
                         driver_calls::kind::other}) {
      const driver_calls::call c(k);
    }
    engine_done = true;
  });
  EXPECT_TRUE(wait_for(engine_done, std::chrono::seconds(2))) << "the engine's calls waited for the program's VMM call";
  program.release();
  engine.join();
  EXPECT_EQ(calls("turn_wait", true), waits);
}

TEST(DriverCalls, OnlyTheProgramsVmmCallsRaiseTheCount) {
  driver_calls::set_program_first(true);
  for (std::size_t i = 0; i < driver_calls::k_kinds; ++i) {
    const auto k = static_cast<driver_calls::kind>(i);
    std::optional<driver_calls::call> c;
    c.emplace(k);
    EXPECT_EQ(driver_calls::program_calls_in_progress(), driver_calls::vmm_kind(k) ? 1 : 0) << driver_calls::k_names[i];
    c.reset();
    EXPECT_EQ(driver_calls::program_calls_in_progress(), 0);
  }
}

}  // namespace
}  // namespace layerswap
