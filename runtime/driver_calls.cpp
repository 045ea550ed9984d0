#include "runtime/driver_calls.hpp"

namespace layerswap::driver_calls {
namespace {
thread_local int t_role = 0;
}  // namespace

counters& global() noexcept {
  static counters c;  // never destroyed before the calls that count into it: static storage, trivial atomics
  return c;
}

int this_thread_role() noexcept { return t_role; }

void set_engine_thread() noexcept { t_role = 1; }

}  // namespace layerswap::driver_calls
