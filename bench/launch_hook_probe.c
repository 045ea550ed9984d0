// A probe, not part of layerswap: can kernel launches be seen without CUPTI, through the driver's symbol resolution?
//
// LD_PRELOAD this library into a process. It puts itself in front of dlsym, so that a library asking the driver for
// cuGetProcAddress (the CUDA runtime does, to find every driver entry point) or for a launch function by name gets a
// wrapper. The cuGetProcAddress wrapper hands out counting wrappers of cuLaunchKernel and cuLaunchKernelEx (per
// stream-mode flag: the driver returns the per-thread-stream variant under the same name). Each launch wrapper adds
// one to a counter and calls the driver.
//
// It also defines the CUDA runtime's launch functions (cudaLaunchKernel, cudaLaunchKernelExC, cooperative, CUDA 13's
// __cudaLaunchKernel that <<<...>>> compiles to, and their per-thread-stream forms), which in an LD_PRELOAD library
// come before libcudart's for every library that links the runtime dynamically (PyTorch does): counted separately,
// then passed on to libcudart. bench/launch_hook_probe.py compares the counts with what the CUPTI tracker saw in the
// same process: equal counts mean every launch came through one of the two routes.
//
// Only the symbols named here are wrapped; everything else goes to the real dlsym. A dlsym(RTLD_NEXT, ...) made
// through this wrapper resolves from this library's place in the search order, not the caller's: fine for the
// probe's workloads, not for a product.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

typedef int result_t;
typedef result_t (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                              void**, void**);
typedef result_t (*launch_ex_fn)(const void*, void*, void**, void**);
typedef result_t (*proc_v2_fn)(const char*, void**, int, uint64_t, int*);
typedef result_t (*proc_v1_fn)(const char*, void**, int, uint64_t);
typedef void* (*dlsym_fn)(void*, const char*);

enum { k_slots = 3 };  // cuGetProcAddress flags: 0 default, 1 legacy stream, 2 per-thread default stream

static _Atomic uint64_t g_launches[k_slots];
static _Atomic uint64_t g_launches_ex[k_slots];
// cudaLaunchKernel, ...ExC, cooperative, the _ptsz forms of those three; __cudaLaunchKernel and its _ptsz form (what
// CUDA 13's compiler emits for <<<...>>>).
static _Atomic uint64_t g_runtime[6];
static _Atomic uint64_t g_resolved;   // launch functions handed out
static _Atomic uint64_t g_conflicts;  // a slot asked again that resolved to another function (kept the first)
static _Atomic(launch_fn) g_launch[k_slots];
static _Atomic(launch_ex_fn) g_launch_ex[k_slots];
static _Atomic(proc_v2_fn) g_proc_v2;
static _Atomic(proc_v1_fn) g_proc_v1;

static dlsym_fn real_dlsym(void) {
  static _Atomic(dlsym_fn) fn;
  dlsym_fn f = atomic_load(&fn);
  if (!f) {
    f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f) f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    atomic_store(&fn, f);
  }
  return f;
}

#define LAUNCH_WRAPPER(slot)                                                                                      \
  static result_t launch_##slot(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,         \
                                unsigned bz, unsigned shm, void* stream, void** params, void** extra) {           \
    atomic_fetch_add_explicit(&g_launches[slot], 1, memory_order_relaxed);                                        \
    return atomic_load_explicit(&g_launch[slot], memory_order_relaxed)(f, gx, gy, gz, bx, by, bz, shm, stream,    \
                                                                       params, extra);                             \
  }                                                                                                               \
  static result_t launch_ex_##slot(const void* config, void* f, void** params, void** extra) {                   \
    atomic_fetch_add_explicit(&g_launches_ex[slot], 1, memory_order_relaxed);                                     \
    return atomic_load_explicit(&g_launch_ex[slot], memory_order_relaxed)(config, f, params, extra);              \
  }
LAUNCH_WRAPPER(0)
LAUNCH_WRAPPER(1)
LAUNCH_WRAPPER(2)
static const launch_fn k_launch_wrappers[k_slots] = {launch_0, launch_1, launch_2};
static const launch_ex_fn k_launch_ex_wrappers[k_slots] = {launch_ex_0, launch_ex_1, launch_ex_2};

// The wrapper for the real function `fn` of `name` in `slot`, or fn itself when the name is not a launch.
static void* wrap(const char* name, void* fn, unsigned slot) {
  if (!fn || slot >= k_slots) return fn;
  if (strcmp(name, "cuLaunchKernel") == 0 || strcmp(name, "cuLaunchKernel_ptsz") == 0) {
    launch_fn expected = NULL;
    if (!atomic_compare_exchange_strong(&g_launch[slot], &expected, (launch_fn)fn) && expected != (launch_fn)fn) {
      atomic_fetch_add(&g_conflicts, 1);
      return fn;
    }
    atomic_fetch_add(&g_resolved, 1);
    return (void*)k_launch_wrappers[slot];
  }
  if (strcmp(name, "cuLaunchKernelEx") == 0 || strcmp(name, "cuLaunchKernelEx_ptsz") == 0) {
    launch_ex_fn expected = NULL;
    if (!atomic_compare_exchange_strong(&g_launch_ex[slot], &expected, (launch_ex_fn)fn) &&
        expected != (launch_ex_fn)fn) {
      atomic_fetch_add(&g_conflicts, 1);
      return fn;
    }
    atomic_fetch_add(&g_resolved, 1);
    return (void*)k_launch_ex_wrappers[slot];
  }
  return fn;
}

static result_t proc_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  const result_t r = atomic_load(&g_proc_v2)(symbol, pfn, version, flags, status);
  if (r == 0 && pfn && symbol) *pfn = wrap(symbol, *pfn, flags == 0 ? 0 : (unsigned)flags);
  return r;
}

static result_t proc_v1(const char* symbol, void** pfn, int version, uint64_t flags) {
  const result_t r = atomic_load(&g_proc_v1)(symbol, pfn, version, flags);
  if (r == 0 && pfn && symbol) *pfn = wrap(symbol, *pfn, flags == 0 ? 0 : (unsigned)flags);
  return r;
}

void* dlsym(void* handle, const char* name) {
  void* fn = real_dlsym()(handle, name);
  if (!fn || strncmp(name, "cu", 2) != 0) return fn;
  if (strcmp(name, "cuGetProcAddress_v2") == 0) {
    atomic_store(&g_proc_v2, (proc_v2_fn)fn);
    return (void*)proc_v2;
  }
  if (strcmp(name, "cuGetProcAddress") == 0) {
    atomic_store(&g_proc_v1, (proc_v1_fn)fn);
    return (void*)proc_v1;
  }
  const size_t n = strlen(name);
  return wrap(name, fn, n > 5 && strcmp(name + n - 5, "_ptsz") == 0 ? 2 : 0);
}

// ---- the runtime's launch functions, interposed ----
typedef struct {
  unsigned x, y, z;
} dim3_t;
typedef int (*rt_launch_fn)(const void*, dim3_t, dim3_t, void**, size_t, void*);
typedef int (*rt_launch_ex_fn)(const void*, const void*, void**);
enum { k_symbol_not_found = 500 };  // cudaErrorSymbolNotFound: no runtime loaded to pass the launch on to

// The definition of `name` in the first loaded object other than this library, for a runtime loaded where
// RTLD_NEXT does not look (dlopen'ed without RTLD_GLOBAL, as a dependency of a module).
struct find_other {
  const char* name;
  void* found;
};
static int find_in_object(struct dl_phdr_info* info, size_t size, void* data) {
  (void)size;
  struct find_other* want = data;
  Dl_info self;
  if (!info->dlpi_name || !info->dlpi_name[0] || !dladdr((void*)find_in_object, &self)) return 0;
  if (self.dli_fname && strcmp(self.dli_fname, info->dlpi_name) == 0) return 0;
  void* handle = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return 0;
  want->found = real_dlsym()(handle, want->name);
  dlclose(handle);
  return want->found != NULL;
}

static void* next_symbol(_Atomic(void*)* cache, const char* name) {
  void* f = atomic_load_explicit(cache, memory_order_relaxed);
  if (!f) {
    f = real_dlsym()(RTLD_NEXT, name);
    if (!f) {
      struct find_other want = {name, NULL};
      dl_iterate_phdr(find_in_object, &want);
      f = want.found;
    }
    atomic_store(cache, f);
  }
  return f;
}

#define RUNTIME_LAUNCH(name, counter)                                                                              \
  int name(const void* func, dim3_t grid, dim3_t block, void** args, size_t shared, void* stream) {               \
    static _Atomic(void*) next;                                                                                   \
    atomic_fetch_add_explicit(&g_runtime[counter], 1, memory_order_relaxed);                                     \
    const rt_launch_fn f = (rt_launch_fn)next_symbol(&next, #name);                                               \
    return f ? f(func, grid, block, args, shared, stream) : k_symbol_not_found;                                   \
  }
#define RUNTIME_LAUNCH_EX(name, counter)                                                                           \
  int name(const void* config, const void* func, void** args) {                                                  \
    static _Atomic(void*) next;                                                                                   \
    atomic_fetch_add_explicit(&g_runtime[counter], 1, memory_order_relaxed);                                     \
    const rt_launch_ex_fn f = (rt_launch_ex_fn)next_symbol(&next, #name);                                         \
    return f ? f(config, func, args) : k_symbol_not_found;                                                        \
  }
RUNTIME_LAUNCH(cudaLaunchKernel, 0)
RUNTIME_LAUNCH(cudaLaunchCooperativeKernel, 2)
RUNTIME_LAUNCH(cudaLaunchKernel_ptsz, 3)
RUNTIME_LAUNCH(cudaLaunchCooperativeKernel_ptsz, 3)
RUNTIME_LAUNCH_EX(cudaLaunchKernelExC, 1)
RUNTIME_LAUNCH_EX(cudaLaunchKernelExC_ptsz, 3)
RUNTIME_LAUNCH(__cudaLaunchKernel, 4)
RUNTIME_LAUNCH(__cudaLaunchKernel_ptsz, 5)

// What the probe saw: 0-2 cuLaunchKernel per slot, 3-5 cuLaunchKernelEx per slot, 6 launch functions handed out,
// 7 conflicts, 8-13 the runtime's launches (cudaLaunchKernel, cudaLaunchKernelExC, cooperative, their per-thread
// forms, __cudaLaunchKernel, __cudaLaunchKernel_ptsz).
uint64_t launch_hook_probe_count(int which) {
  if (which >= 0 && which < k_slots) return atomic_load(&g_launches[which]);
  if (which >= k_slots && which < 2 * k_slots) return atomic_load(&g_launches_ex[which - k_slots]);
  if (which == 6) return atomic_load(&g_resolved);
  if (which == 7) return atomic_load(&g_conflicts);
  if (which >= 8 && which < 14) return atomic_load(&g_runtime[which - 8]);
  return 0;
}
