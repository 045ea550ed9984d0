// LD_PRELOAD interposer: `LD_PRELOAD=liblayerswap_preload.so program` routes the program's cudaMalloc and
// cudaFree (those of libcudart.so, which PyTorch and most CUDA programs link dynamically) through
// layerswap's allocator. Preloading the library is the opt-in; LAYERSWAP_* settings apply as usual.
//
// Semantics kept from the real functions: cudaMalloc'd memory is usable on any stream, and cudaFree
// implicitly synchronizes the device. The interposed cudaFree synchronizes too (through the real
// cudaDeviceSynchronize), so a block it returns has no pending work and may be handed to the next
// cudaMalloc whatever stream that caller uses. Pointers layerswap does not own go to the real cudaFree.
// If layerswap cannot serve a request (no driver, bad settings) it says so once and falls back to the
// real cudaMalloc, so the program keeps running.
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <exception>

#include "allocator/registry.hpp"
#include "runtime/error.hpp"
#include "runtime/log.hpp"

#define LAYERSWAP_INTERPOSE extern "C" __attribute__((visibility("default")))

namespace {

using cuda_status = int;  // cudaError_t
constexpr cuda_status k_success = 0;
constexpr cuda_status k_invalid_value = 1;
constexpr cuda_status k_out_of_memory = 2;  // cudaErrorMemoryAllocation

template <typename F>
F next_symbol(const char* name) noexcept {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

using malloc_fn = cuda_status (*)(void**, std::size_t);
using free_fn = cuda_status (*)(void*);
using sync_fn = cuda_status (*)();
using get_device_fn = cuda_status (*)(int*);

std::atomic<bool> g_fallback{false};

}  // namespace

LAYERSWAP_INTERPOSE cuda_status cudaMalloc(void** ptr, std::size_t size) {
  static const auto real = next_symbol<malloc_fn>("cudaMalloc");
  static const auto get_device = next_symbol<get_device_fn>("cudaGetDevice");
  if (!ptr) return k_invalid_value;
  if (g_fallback.load(std::memory_order_relaxed) || !get_device) return real ? real(ptr, size) : k_out_of_memory;
  if (size == 0) {
    *ptr = nullptr;
    return k_success;
  }
  int device = 0;
  if (const cuda_status st = get_device(&device); st != k_success) return st;
  try {
    *ptr = layerswap::allocator_for(device).allocate(size, nullptr);
    return k_success;
  } catch (const layerswap::out_of_memory& e) {
    LAYERSWAP_LOG(warn, "%s", e.what());
    *ptr = nullptr;
    return k_out_of_memory;
  } catch (const std::exception& e) {
    LAYERSWAP_LOG(warn, "%s; falling back to the CUDA runtime's own cudaMalloc for this process", e.what());
    g_fallback.store(true);
    return real ? real(ptr, size) : k_out_of_memory;
  }
}

LAYERSWAP_INTERPOSE cuda_status cudaFree(void* ptr) {
  static const auto real = next_symbol<free_fn>("cudaFree");
  static const auto sync = next_symbol<sync_fn>("cudaDeviceSynchronize");
  if (ptr) {
    if (layerswap::caching_allocator* a = layerswap::owner_of(ptr)) {
      const cuda_status st = sync ? sync() : k_success;  // as the real cudaFree does
      if (!a->deallocate(ptr)) return k_invalid_value;  // in layerswap's VA, but not a live block (a double free)
      return st;
    }
  }
  return real ? real(ptr) : k_success;
}
