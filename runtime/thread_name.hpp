// Names the calling thread for tools that show threads (top -H, /proc/<pid>/task/*/comm, perf, gdb, the
// swapping benchmark's per-thread CPU table). Linux keeps at most 15 characters; longer names are cut.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <cstring>

namespace layerswap {

inline void name_this_thread(const char* name) noexcept {
  char cut[16] = {};
  std::memcpy(cut, name, std::min(std::strlen(name), sizeof cut - 1));
  (void)pthread_setname_np(pthread_self(), cut);  // best effort: a name is a courtesy, never a failure
}

}  // namespace layerswap
