// The C ABI of liblayerswap.so. Signatures of layerswap_malloc/layerswap_free match what
// torch.cuda.memory.CUDAPluggableAllocator expects:
//
//   alloc = torch.cuda.memory.CUDAPluggableAllocator("liblayerswap.so", "layerswap_malloc", "layerswap_free")
//   torch.cuda.memory.change_current_allocator(alloc)
//
// Boundary rules: nothing throws across these functions; failures return nullptr or a non-zero code and
// leave a message for layerswap_last_error() on the calling thread.
#include <sys/types.h>

#include <cstring>
#include <exception>
#include <string>

#include "allocator/registry.hpp"
#include "runtime/log.hpp"

#define LAYERSWAP_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string t_last_error;

void remember(const char* what) noexcept {
  try {
    t_last_error = what;
  } catch (...) {
  }
}
}  // namespace

LAYERSWAP_EXPORT void* layerswap_malloc(ssize_t size, int device, void* stream) noexcept {
  if (size <= 0) return nullptr;
  try {
    return layerswap::allocator_for(device).allocate(static_cast<std::size_t>(size), stream);
  } catch (const std::exception& e) {
    remember(e.what());
    LAYERSWAP_LOG(warn, "%s", e.what());
    return nullptr;
  } catch (...) {
    remember("layerswap: unknown error in layerswap_malloc");
    return nullptr;
  }
}

LAYERSWAP_EXPORT void layerswap_free(void* ptr, ssize_t /*size*/, int /*device*/, void* /*stream*/) noexcept {
  if (!ptr) return;
  if (layerswap::caching_allocator* a = layerswap::owner_of(ptr)) {
    if (!a->deallocate(ptr)) remember("layerswap: layerswap_free of a pointer that is not a live layerswap block");
  } else {
    remember("layerswap: layerswap_free of a pointer layerswap did not allocate");
  }
}

LAYERSWAP_EXPORT int layerswap_record_stream(void* ptr, void* stream) noexcept {
  try {
    layerswap::caching_allocator* a = layerswap::owner_of(ptr);
    if (!a) return 1;
    a->record_stream(ptr, stream);
    return 0;
  } catch (const std::exception& e) {
    remember(e.what());
    return 2;
  }
}

LAYERSWAP_EXPORT int layerswap_empty_cache(void) noexcept {
  try {
    for (layerswap::caching_allocator* a : layerswap::allocators()) a->empty_cache();
    return 0;
  } catch (const std::exception& e) {
    remember(e.what());
    return 2;
  }
}

// Copies the statistics report (as LAYERSWAP_STATS=1 prints it) into buf; returns its full length.
LAYERSWAP_EXPORT size_t layerswap_stats_report(char* buf, size_t len) noexcept {
  try {
    const std::string r = layerswap::stats_report();
    if (buf && len) {
      const size_t n = r.size() < len - 1 ? r.size() : len - 1;
      std::memcpy(buf, r.data(), n);
      buf[n] = '\0';
    }
    return r.size();
  } catch (...) {
    return 0;
  }
}

LAYERSWAP_EXPORT const char* layerswap_last_error(void) noexcept { return t_last_error.c_str(); }
