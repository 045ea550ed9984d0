// A spin-wait hint for busy loops that wait for another core: lets the sibling hyperthread run and saves the
// pipeline flush at the loop's exit. A no-op where the architecture has none.
#pragma once

namespace layerswap {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace layerswap
