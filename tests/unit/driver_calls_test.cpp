// The driver port's call counters (runtime/driver_calls.hpp): each timed call counts once, under the caller's role.
#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace
}  // namespace layerswap
