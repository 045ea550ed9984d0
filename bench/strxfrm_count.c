// A probe for bench/cublas_regex_probe.py, loaded with LD_PRELOAD: counts the calls of glibc's __strxfrm_l, which
// libstdc++'s std::collate<char>::do_transform makes for every character of a std::regex bracket expression when the
// regex is compiled (about 516 calls for PyTorch's ":([0-9]+):([0-9]+)"). After layerswap_probe_strxfrm_arm(n), it
// prints the stack of up to n calls, 50,000 calls apart, to stderr (backtrace() reads the unwind tables, so libraries
// built without frame pointers unwind too). The real function is found with dlsym(RTLD_NEXT).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <locale.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

typedef size_t (*strxfrm_l_fn)(char*, const char*, size_t, locale_t);

static _Atomic(strxfrm_l_fn) real_strxfrm_l;
static atomic_long calls;
static atomic_long armed_at = -1;
static atomic_int stacks_left;

long layerswap_probe_strxfrm_calls(void) { return atomic_load(&calls); }

void layerswap_probe_strxfrm_arm(int stacks) {
  atomic_store(&stacks_left, stacks);
  atomic_store(&armed_at, atomic_load(&calls));
}

size_t __strxfrm_l(char* dst, const char* src, size_t n, locale_t locale) {
  strxfrm_l_fn real = atomic_load_explicit(&real_strxfrm_l, memory_order_relaxed);
  if (real == NULL) {
    real = (strxfrm_l_fn)dlsym(RTLD_NEXT, "__strxfrm_l");
    atomic_store(&real_strxfrm_l, real);
  }
  const long call = atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
  const long armed = atomic_load_explicit(&armed_at, memory_order_relaxed);
  if (armed >= 0 && (call - armed) % 50000 == 0 && atomic_fetch_sub(&stacks_left, 1) > 0) {
    void* frames[48];
    const int depth = backtrace(frames, 48);
    fprintf(stderr, "[strxfrm_count] stack of call %ld (thread %d):\n", call, gettid());
    backtrace_symbols_fd(frames, depth, 2);
  }
  return real(dst, src, n, locale);
}
