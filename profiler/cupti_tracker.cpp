// The CUPTI launch tracker: the only file of layerswap that includes CUPTI and CUDA runtime headers, and it
// uses them for types and constants only. CUPTI, the CUDA runtime and the driver are all reached at run time
// (Note [Run-time binding]), so layerswap builds and runs its CPU tests where none of them exists.
//
// The callback is a switchboard (STYLE.md: kineto): per call it reads the API's parameter struct, finds the
// function's parameter layout in the lock-free layout cache (queried once per function), scans the argument
// words through the region map, and hands the region set to tracker_core::record(). No allocation, no lock,
// no logging on that path; the thread-local scratch it uses is statically initialized.
//
// Which callbacks: runtime kernel launches (cudaLaunchKernel, ...ExC, cooperative), driver kernel launches
// (cuLaunchKernel, cuLaunchKernelEx, cooperative), graph launches of both APIs, and the memcpy / memset calls
// that can touch device memory. A driver callback nested in a runtime one is skipped (Note [Nested launch
// callbacks]). LAYERSWAP_TRACK_API=driver takes the driver's callbacks only (Note [Callback domains]).
//
// Note [Callback domains]
//   CUPTI raises an enter and an exit callback per API call, and a runtime launch (all of PyTorch's own
//   kernels) calls the driver underneath: with both domains enabled (the default) one torch launch costs four
//   dispatches into this file, two of which only skip (Note [Nested launch callbacks]). With the driver domain
//   only (LAYERSWAP_TRACK_API=driver) it costs two, and the runtime launch is decoded in the driver callback it
//   makes: its kernelParams, and the CUfunction, whose layout cuFuncGetParamInfo / cuKernelGetParamInfo give
//   (driver_query). That is only right if every runtime launch, copy and memset reaches one of the driver
//   callbacks enabled here with its arguments: tests/gpu/tracker_gpu_test.cpp checks it per API in both modes,
//   and bench/tracker.py measures both modes' decoded fraction on a training step and their cost.
//   LAYERSWAP_TRACK=subscribe-only subscribes on_callback_empty with the same callbacks enabled: the
//   benchmark's measure of CUPTI's own share of the cost. It records nothing and leaves the residency gate
//   unfed.
//
// Note [Launches beside the engine's calls]
//   While the residency engine moves, the program's kernel launches spend longer in the driver: on the H100 at
//   25% of the 1.1B LoRA step, ~5 ms a step more than with nothing to move (docs/history.md, session 33), and
//   the engine's digests, copies and fence records explain only ~2 ms of it. LAYERSWAP_TRACK=attribute is the
//   measurement aid that asks which of the engine's driver calls a slow launch met: the migration thread
//   publishes the kind of the driver call it is in (runtime/driver_calls.hpp, set_engine_call_marking), the
//   launch reads it when its entry callback returns and again at its exit callback, and its driver part (the
//   launch_driver_ns figure) is counted under the kind it met (the entry's, else the exit's; none when neither
//   saw a call), and in a histogram of lengths. A launch that overlapped only the middle of a short engine call
//   counts as none; engine calls are mostly longer than launches (tens of microseconds against a few), so that
//   is rare. LAYERSWAP_STATS=1 prints the totals at exit (attribution_report, tracker_core.hpp). Off otherwise: the mark costs the engine a store per call and the launch two loads of a line that
//   the engine writes.
//
// Note [Run-time binding]
//   CUPTI: the copy already loaded in the process if any (PyTorch's wheel loads libcupti.so.13), else
//   dlopen("libcupti.so.13"), "libcupti.so", then the toolkit's usual folders. cudaFuncGetParamInfo,
//   cudaPeekAtLastError and cudaGetLastError come from the libcudart already loaded (RTLD_DEFAULT, then
//   libcudart.so.13 with RTLD_NOLOAD); without them the runtime callbacks are not enabled at all and the
//   driver callbacks decode every launch. cuKernelGetParamInfo / cuFuncGetParamInfo come from libcuda.so.1
//   through cuGetProcAddress.
//
// Note [Param info in the runtime callback]
//   cudaFuncGetParamInfo fails past the last parameter and leaves that error for cudaGetLastError, which
//   PyTorch checks after every launch: the tracker clears it. So that it never clears an error of the
//   application's own, it does not query while cudaPeekAtLastError reports one (query_status::later: the
//   function is queried again on a later launch).
#if !defined(LAYERSWAP_NO_CUPTI)
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>

#include "allocator/region_map.hpp"
#include "allocator/registry.hpp"
#include "allocator/residency_gate.hpp"
#include "profiler/launch_recorder.hpp"
#include "profiler/learner.hpp"
#include "profiler/tracker.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/fast_clock.hpp"
#include "runtime/log.hpp"

static_assert(CU_LAUNCH_PARAM_END_AS_INT == layerswap::profiler::k_launch_param_end);
static_assert(CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT == layerswap::profiler::k_launch_param_buffer_pointer);
static_assert(CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT == layerswap::profiler::k_launch_param_buffer_size);

namespace layerswap::profiler {

namespace {

// ---- run-time bound entry points ----

struct cupti_api {
  decltype(&::cuptiSubscribe) subscribe = nullptr;
  decltype(&::cuptiUnsubscribe) unsubscribe = nullptr;
  decltype(&::cuptiEnableCallback) enable_callback = nullptr;
  decltype(&::cuptiGetResultString) result_string = nullptr;
};

struct cuda_api {
  decltype(&::cudaFuncGetParamInfo) func_get_param_info = nullptr;
  decltype(&::cudaPeekAtLastError) peek_at_last_error = nullptr;
  decltype(&::cudaGetLastError) get_last_error = nullptr;
  decltype(&::cuKernelGetParamInfo) kernel_get_param_info = nullptr;
  decltype(&::cuFuncGetParamInfo) func_get_param_info_driver = nullptr;
  decltype(&::cuFuncLoad) func_load = nullptr;
  decltype(&::cuStreamWaitValue32) stream_wait_value = nullptr;  // holds (Note [Holding a launch on the GPU])
  decltype(&::cuPointerGetAttribute) pointer_get_attribute = nullptr;  // host sources of copies (pointer tables)
};

struct state {
  std::mutex mutex;  // control operations only
  bool loaded = false;
  bool load_tried = false;
  std::string problem;
  cupti_api cupti;
  cuda_api cuda;
  CUpti_SubscriberHandle subscriber = nullptr;
  tracker_core* core = nullptr;  // never destroyed: callbacks may be in flight at any time
  learner* learn = nullptr;      // fed by the core's consumer; never destroyed (the allocator may hold it)
  std::atomic<bool> active{false};
  std::atomic<bool> paused{false};
  std::atomic<bool> busy{false};
  bool busy_reported = false;
  bool hold_warned = false;  // LAYERSWAP_HOLD=1 said once per process
  bool exit_hook = false;
  bool mode_set = false;  // by tracker_set_mode(), else from the configuration at the next subscribe
  tracker_mode mode;
  tracker_mode subscribed_mode;  // of the current subscription
};

state& the_state() {
  static auto* s = new state();
  return *s;
}

// The core the callback writes to; published once, never changes.
std::atomic<tracker_core*> g_core{nullptr};
std::atomic<learner*> g_learner{nullptr};
cuda_api g_cuda;  // written before the first subscribe, read-only afterwards
std::atomic<std::uint32_t> g_generation{0};
std::atomic<bool> g_attribute{false};  // LAYERSWAP_TRACK=attribute (Note [Launches beside the engine's calls])

void* open_library(const char* const* names, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    if (void* h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD)) return h;
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (void* h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL)) return h;
  }
  return nullptr;
}

template <class Fn>
void resolve(void* library, const char* name, Fn& slot) {
  slot = reinterpret_cast<Fn>(dlsym(library, name));
}

bool load_locked(state& s) {
  if (s.load_tried) return s.loaded;
  s.load_tried = true;
  static constexpr const char* k_cupti[] = {
      "libcupti.so.13", "libcupti.so", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13",
      "/usr/local/cuda/lib64/libcupti.so.13", "/usr/local/cuda/targets/x86_64-linux/lib/libcupti.so.13"};
  void* cupti = open_library(k_cupti, std::size(k_cupti));
  if (cupti == nullptr) {
    s.problem = "CUPTI (libcupti.so.13) was not found; add its folder to LD_LIBRARY_PATH";
    return false;
  }
  resolve(cupti, "cuptiSubscribe", s.cupti.subscribe);
  resolve(cupti, "cuptiUnsubscribe", s.cupti.unsubscribe);
  resolve(cupti, "cuptiEnableCallback", s.cupti.enable_callback);
  resolve(cupti, "cuptiGetResultString", s.cupti.result_string);
  if (!s.cupti.subscribe || !s.cupti.unsubscribe || !s.cupti.enable_callback) {
    s.problem = "the CUPTI library found lacks cuptiSubscribe/cuptiEnableCallback";
    return false;
  }

  // The CUDA runtime the application uses (Note [Run-time binding]).
  cuda_api c;
  resolve(RTLD_DEFAULT, "cudaFuncGetParamInfo", c.func_get_param_info);
  resolve(RTLD_DEFAULT, "cudaPeekAtLastError", c.peek_at_last_error);
  resolve(RTLD_DEFAULT, "cudaGetLastError", c.get_last_error);
  if (!c.func_get_param_info || !c.peek_at_last_error || !c.get_last_error) {
    if (void* rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD)) {
      resolve(rt, "cudaFuncGetParamInfo", c.func_get_param_info);
      resolve(rt, "cudaPeekAtLastError", c.peek_at_last_error);
      resolve(rt, "cudaGetLastError", c.get_last_error);
    }
  }
  if (!c.func_get_param_info || !c.peek_at_last_error || !c.get_last_error) c = cuda_api{};

  // The driver's param info, through cuGetProcAddress as runtime/cuda_driver.cpp does.
  if (void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) {
    using get_proc_fn = decltype(&::cuGetProcAddress);
    auto get_proc = reinterpret_cast<get_proc_fn>(dlsym(cuda, "cuGetProcAddress_v2"));
    if (get_proc) {
      const auto get = [&](const char* name, auto& slot) {
        for (const int version : {13000, 12040}) {
          void* address = nullptr;
          CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
          if (get_proc(name, &address, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS && address &&
              status == CU_GET_PROC_ADDRESS_SUCCESS) {
            slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(address);
            return;
          }
        }
      };
      get("cuKernelGetParamInfo", c.kernel_get_param_info);
      get("cuFuncGetParamInfo", c.func_get_param_info_driver);
      get("cuFuncLoad", c.func_load);
      get("cuStreamWaitValue32", c.stream_wait_value);
      get("cuPointerGetAttribute", c.pointer_get_attribute);
    }
  }
  g_cuda = c;
  s.loaded = true;
  return true;
}

// ---- param info queries (layout_cache::find_or_add) ----

query_status runtime_query(void*, std::uint64_t function, std::uint32_t index, param_slot& out) noexcept {
  const cuda_api& c = g_cuda;
  if (index == 0 && c.peek_at_last_error() != cudaSuccess) return query_status::later;  // Note [Param info ...]
  std::size_t offset = 0;
  std::size_t size = 0;
  const cudaError_t r = c.func_get_param_info(reinterpret_cast<const void*>(function), index, &offset, &size);
  if (r == cudaSuccess) {
    out = param_slot{static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(size)};
    return query_status::ok;
  }
  c.get_last_error();
  return r == cudaErrorInvalidValue ? query_status::end : query_status::error;
}

std::atomic<int> g_param_info_error_func{0};
std::atomic<int> g_param_info_error_kernel{0};
std::atomic<std::uint64_t> g_param_info_failures{0};

query_status driver_query(void* context, std::uint64_t function, std::uint32_t index, param_slot& out) noexcept {
  const cuda_api& c = g_cuda;
  // The context (record_kernel's, zeroed per launch) says which call answers for this function, decided at
  // parameter 0: 0 cuFuncGetParamInfo, 1 cuKernelGetParamInfo.
  auto& use_kernel = *static_cast<std::uint64_t*>(context);
  std::size_t offset = 0;
  std::size_t size = 0;
  CUresult r = CUDA_ERROR_NOT_SUPPORTED;
  int r_func = -1;
  if (index == 0) {
    // A CUfunction (Triton's cuModuleGetFunction) answers cuFuncGetParamInfo; a CUkernel (library kernels,
    // runtime launches) fails it with 400 and answers cuKernelGetParamInfo (DESIGN.md).
    use_kernel = 0;
    if (c.func_get_param_info_driver) {
      r = c.func_get_param_info_driver(reinterpret_cast<CUfunction>(function), 0, &offset, &size);
      // A function of a lazily loaded module may not answer before it is loaded: load it (the launch is about
      // to) and ask again.
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_INVALID_VALUE && c.func_load &&
          c.func_load(reinterpret_cast<CUfunction>(function)) == CUDA_SUCCESS) {
        r = c.func_get_param_info_driver(reinterpret_cast<CUfunction>(function), 0, &offset, &size);
      }
      r_func = static_cast<int>(r);
    }
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_INVALID_VALUE && c.kernel_get_param_info) {
      use_kernel = 1;
      r = c.kernel_get_param_info(reinterpret_cast<CUkernel>(function), 0, &offset, &size);
    }
  } else if (use_kernel) {
    if (c.kernel_get_param_info) r = c.kernel_get_param_info(reinterpret_cast<CUkernel>(function), index, &offset, &size);
  } else if (c.func_get_param_info_driver) {
    r = c.func_get_param_info_driver(reinterpret_cast<CUfunction>(function), index, &offset, &size);
  }
  if (r == CUDA_SUCCESS) {
    out = param_slot{static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(size)};
    return query_status::ok;
  }
  if (r != CUDA_ERROR_INVALID_VALUE) {  // diagnostics: which error the param info queries give (tracker_param_info_errors)
    g_param_info_error_func.store(r_func, std::memory_order_relaxed);
    g_param_info_error_kernel.store(static_cast<int>(r), std::memory_order_relaxed);
    g_param_info_failures.fetch_add(1, std::memory_order_relaxed);
  }
  return r == CUDA_ERROR_INVALID_VALUE ? query_status::end : query_status::error;
}

// ---- the callback ----

std::uint64_t stream_value(const void* stream) noexcept { return reinterpret_cast<std::uint64_t>(stream); }

template <class P>
const P& params_of(const CUpti_CallbackData* info) noexcept {
  return *static_cast<const P*>(info->functionParams);
}

std::uint64_t u64(const void* p) noexcept { return reinterpret_cast<std::uint64_t>(p); }

// A copy whose direction the call does not say (cuMemcpyAsync, cudaMemcpyDefault): a small one from page-locked
// host memory into a region is recorded by record_host_copy (Note [Pointer tables] in launch_recorder.hpp), and
// any other as a plain copy. Only memory the driver reports as host memory is read: a device address would fault.
void record_unified_copy(tracker_core& core, thread_scratch& t, std::uint64_t stream, std::uint64_t dst,
                         std::uint64_t src, std::size_t bytes) noexcept {
  const auto attribute = g_cuda.pointer_get_attribute;
  if (attribute != nullptr && bytes <= k_max_pack_bytes && region_map::lookup(src) == 0 &&
      region_map::lookup(dst) != 0) {
    unsigned int type = 0;
    if (attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, static_cast<CUdeviceptr>(src)) == CUDA_SUCCESS &&
        type == CU_MEMORYTYPE_HOST) {
      record_host_copy(core, t, stream, dst, reinterpret_cast<const void*>(src), bytes);
      return;
    }
  }
  record_copy(core, t, launch_kind::memcpy, stream, dst, src);
}

// A runtime copy by its kind: from the host (record_host_copy), either way (record_unified_copy), or device memory.
void record_runtime_copy(tracker_core& core, thread_scratch& t, std::uint64_t stream, const void* dst, const void* src,
                         std::size_t bytes, cudaMemcpyKind kind) noexcept {
  if (kind == cudaMemcpyHostToDevice) {
    record_host_copy(core, t, stream, u64(dst), src, bytes);
  } else if (kind == cudaMemcpyDefault) {
    record_unified_copy(core, t, stream, u64(dst), u64(src), bytes);
  } else {
    record_copy(core, t, launch_kind::memcpy, stream, u64(dst), u64(src));
  }
}

void on_runtime(tracker_core& core, thread_scratch& t, CUpti_CallbackId cbid, const CUpti_CallbackData* info) noexcept {
  switch (cbid) {
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000: {
      const auto& p = params_of<cudaLaunchKernel_v7000_params>(info);
      record_kernel(core, t, runtime_query, u64(p.func), info->symbolName, stream_value(p.stream), p.args, nullptr);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000: {
      const auto& p = params_of<cudaLaunchCooperativeKernel_v9000_params>(info);
      record_kernel(core, t, runtime_query, u64(p.func), info->symbolName, stream_value(p.stream), p.args, nullptr);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060:
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060: {
      const auto& p = params_of<cudaLaunchKernelExC_v11060_params>(info);
      record_kernel(core, t, runtime_query, u64(p.func), info->symbolName, p.config ? stream_value(p.config->stream) : 0,
                    p.args, nullptr);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000: {
      const auto& p = params_of<cudaGraphLaunch_v10000_params>(info);
      record_graph(core, t, stream_value(p.stream));
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000: {
      const auto& p = params_of<cudaMemcpyAsync_v3020_params>(info);
      record_runtime_copy(core, t, stream_value(p.stream), p.dst, p.src, p.count, p.kind);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020: {
      const auto& p = params_of<cudaMemcpy_v3020_params>(info);
      record_runtime_copy(core, t, 0, p.dst, p.src, p.count, p.kind);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000: {
      const auto& p = params_of<cudaMemsetAsync_v3020_params>(info);
      record_copy(core, t, launch_kind::memset, stream_value(p.stream), u64(p.devPtr), 0);
      break;
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020: {
      const auto& p = params_of<cudaMemset_v3020_params>(info);
      record_copy(core, t, launch_kind::memset, 0, u64(p.devPtr), 0);
      break;
    }
    default: break;
  }
}

void on_driver(tracker_core& core, thread_scratch& t, CUpti_CallbackId cbid, const CUpti_CallbackData* info) noexcept {
  switch (cbid) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz: {
      const auto& p = params_of<cuLaunchKernel_params>(info);
      record_kernel(core, t, driver_query, u64(p.f), info->symbolName, stream_value(p.hStream), p.kernelParams, p.extra);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz: {
      const auto& p = params_of<cuLaunchCooperativeKernel_params>(info);
      record_kernel(core, t, driver_query, u64(p.f), info->symbolName, stream_value(p.hStream), p.kernelParams, nullptr);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz: {
      const auto& p = params_of<cuLaunchKernelEx_params>(info);
      record_kernel(core, t, driver_query, u64(p.f), info->symbolName, p.config ? stream_value(p.config->hStream) : 0,
                    p.kernelParams, p.extra);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz: {
      const auto& p = params_of<cuGraphLaunch_params>(info);
      record_graph(core, t, stream_value(p.hStream));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz: {
      const auto& p = params_of<cuMemcpyAsync_params>(info);
      record_unified_copy(core, t, stream_value(p.hStream), p.dst, p.src, p.ByteCount);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpy:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds: {
      const auto& p = params_of<cuMemcpy_params>(info);
      record_unified_copy(core, t, 0, p.dst, p.src, p.ByteCount);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz: {
      const auto& p = params_of<cuMemcpyDtoDAsync_v2_params>(info);
      record_copy(core, t, launch_kind::memcpy, stream_value(p.hStream), p.dstDevice, p.srcDevice);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz: {
      const auto& p = params_of<cuMemcpyHtoDAsync_v2_params>(info);
      record_host_copy(core, t, stream_value(p.hStream), p.dstDevice, p.srcHost, p.ByteCount);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz: {
      const auto& p = params_of<cuMemcpyDtoHAsync_v2_params>(info);
      record_copy(core, t, launch_kind::memcpy, stream_value(p.hStream), p.srcDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds: {
      const auto& p = params_of<cuMemcpyDtoD_v2_params>(info);
      record_copy(core, t, launch_kind::memcpy, 0, p.dstDevice, p.srcDevice);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds: {
      const auto& p = params_of<cuMemcpyHtoD_v2_params>(info);
      record_host_copy(core, t, 0, p.dstDevice, p.srcHost, p.ByteCount);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds: {
      const auto& p = params_of<cuMemcpyDtoH_v2_params>(info);
      record_copy(core, t, launch_kind::memcpy, 0, p.srcDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeerAsync: {
      const auto& p = params_of<cuMemcpyPeerAsync_params>(info);
      record_copy(core, t, launch_kind::memcpy, stream_value(p.hStream), p.dstDevice, p.srcDevice);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async: {
      const auto& p = params_of<cuMemsetD8Async_params>(info);
      record_copy(core, t, launch_kind::memset, stream_value(p.hStream), p.dstDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async: {
      const auto& p = params_of<cuMemsetD16Async_params>(info);
      record_copy(core, t, launch_kind::memset, stream_value(p.hStream), p.dstDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async: {
      const auto& p = params_of<cuMemsetD32Async_params>(info);
      record_copy(core, t, launch_kind::memset, stream_value(p.hStream), p.dstDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2_ptds: {
      const auto& p = params_of<cuMemsetD8_v2_params>(info);
      record_copy(core, t, launch_kind::memset, 0, p.dstDevice, 0);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2_ptds: {
      const auto& p = params_of<cuMemsetD32_v2_params>(info);
      record_copy(core, t, launch_kind::memset, 0, p.dstDevice, 0);
      break;
    }
    default: break;
  }
}

// The holds the launch took (residency_gate.hpp, Note [Holding a launch on the GPU]): a stream wait each, on the
// launch's stream, enqueued here in its API-enter callback, so before the launch itself. The wait is a driver
// call the tracker does not subscribe to (no nested callback). If it fails, the launch must not run before the
// prefetch ends: wait on the host until the engine retracts the hold (it does so after the remap). A _ptsz launch
// on stream 0 gets its wait on the legacy stream, which the per-thread default stream synchronizes with.
void enqueue_holds(const thread_scratch& t) noexcept {
  const auto wait_value = g_cuda.stream_wait_value;
  for (int i = 0; i < t.gate.hold_count(); ++i) {
    const residency_gate::hold& h = t.gate.held(i);
    const CUresult r = wait_value ? wait_value(reinterpret_cast<CUstream>(t.stream), static_cast<CUdeviceptr>(h.flag),
                                               h.value, CU_STREAM_WAIT_VALUE_GEQ)
                                  : CUDA_ERROR_NOT_SUPPORTED;
    if (r != CUDA_SUCCESS) residency_gate::wait_hold_on_host(h);
  }
}

// A kernel launch call has returned: the time since record_kernel stamped it (tracker_stats::launch_api_ns), which
// covers the decoding, any wait in the residency gate, and the driver; and the part since the entry callback
// returned (launch_driver_ns): the driver's own work, CUPTI's dispatch of the exit callback, and any wait for a
// lock inside the driver (the migration thread's VMM calls take the driver's locks too).
void end_api_timing(tracker_core& core, thread_scratch& t) noexcept {
  if (t.api_start == 0) return;
  const std::uint64_t now = fast_clock::ticks();
  const std::uint64_t entered = t.api_entered != 0 ? t.api_entered : now;
  core.add_launch_api_time(now - t.api_start, now - entered);
  if (g_attribute.load(std::memory_order_relaxed)) {  // Note [Launches beside the engine's calls]
    const std::uint8_t met = t.engine_at_entry != 0 ? t.engine_at_entry : driver_calls::engine_call_now();
    core.add_launch_attribution(met, now - entered);
    t.engine_at_entry = 0;
  }
  t.api_start = 0;
  t.api_entered = 0;
}

// The entry callback of a kernel launch is done: what follows until the exit callback is the driver's.
void mark_entered(thread_scratch& t) noexcept {
  if (t.api_start == 0) return;
  t.api_entered = fast_clock::ticks();
  if (g_attribute.load(std::memory_order_relaxed)) t.engine_at_entry = driver_calls::engine_call_now();
}

// LAYERSWAP_TRACK=subscribe-only: CUPTI's own cost per launch, with the same callbacks enabled.
void CUPTIAPI on_callback_empty(void*, CUpti_CallbackDomain, CUpti_CallbackId, const void*) noexcept {}

void CUPTIAPI on_callback(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) noexcept {
  tracker_core* core = g_core.load(std::memory_order_acquire);
  if (core == nullptr) return;
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  thread_scratch& t = this_thread_scratch();
  const std::uint32_t generation = g_generation.load(std::memory_order_relaxed);
  if (t.generation != generation) {  // a new subscription: forget nesting left over from the last one
    t.generation = generation;
    t.nesting = launch_nesting{};
    t.gate.close_all();  // launches whose exit callback the old subscription never delivered
  }
  // Each counted launch opens a gate frame at API enter and closes it at API exit (Note [Gate bookkeeping]);
  // a driver callback nested in a runtime launch does neither, at enter or at exit.
  if (domain == CUPTI_CB_DOMAIN_RUNTIME_API) {
    if (info->callbackSite == CUPTI_API_EXIT) {
      t.gate.close();
      t.nesting.runtime_exit();
      end_api_timing(*core, t);
      return;
    }
    t.nesting.runtime_enter();
    t.gate.open();
    t.context = u64(info->context);
    on_runtime(*core, t, cbid, info);
    if (t.gate.hold_count() != 0) enqueue_holds(t);
    mark_entered(t);
  } else if (domain == CUPTI_CB_DOMAIN_DRIVER_API) {
    if (cbid == CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy || cbid == CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2) {
      // Note [Launch streams]: forgotten before the driver destroys it (no launch of this thread is in flight).
      if (info->callbackSite == CUPTI_API_ENTER) {
        residency_gate::forget_stream(u64(cbid == CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy
                                              ? params_of<cuStreamDestroy_params>(info).hStream
                                              : params_of<cuStreamDestroy_v2_params>(info).hStream));
      }
      return;
    }
    if (t.nesting.driver_is_nested()) {
      if (info->callbackSite == CUPTI_API_ENTER) core->count_nested();
      return;
    }
    if (info->callbackSite == CUPTI_API_EXIT) {
      t.gate.close();
      end_api_timing(*core, t);
      return;
    }
    t.gate.open();
    t.context = u64(info->context);
    on_driver(*core, t, cbid, info);
    if (t.gate.hold_count() != 0) enqueue_holds(t);
    mark_entered(t);
  }
}

constexpr CUpti_CallbackId k_runtime_cbids[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020,
};

constexpr CUpti_CallbackId k_driver_cbids[] = {
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpy,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyPeerAsync,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD8_v2_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD32_v2_ptds,
    CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy,  // Note [Launch streams]
    CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2,
};

std::string result_text(const state& s, CUptiResult r) {
  const char* text = nullptr;
  if (s.cupti.result_string) s.cupti.result_string(r, &text);
  return text ? std::string(text) : "CUPTI error " + std::to_string(static_cast<int>(r));
}

void at_exit() {
  tracker_core* core = g_core.load(std::memory_order_acquire);
  if (core == nullptr) return;
  core->stop_consumer();
  try {
    core->consume();
  } catch (...) {
  }
  core->close_trace();
}

// The mode of the next subscription: tracker_set_mode()'s, else the configuration's.
tracker_mode mode_locked(state& s) {
  if (!s.mode_set) {
    try {
      const config& c = global_config();
      s.mode.api = c.track_api == config::track_api_mode::driver ? tracker_api::driver : tracker_api::both;
      s.mode.subscribe_only = c.track == config::track_mode::subscribe_only;
      s.mode.attribute = c.track == config::track_mode::attribute;
    } catch (...) {  // a bad setting was reported where the configuration was first read
    }
    s.mode_set = true;
  }
  return s.mode;
}

bool subscribe_locked(state& s) {
  if (s.active.load()) return true;
  if (!load_locked(s)) return false;
  if (s.core == nullptr) {
    tracker_options options;
    try {
      options.trace_path = global_config().trace;
    } catch (...) {
    }
    s.core = new tracker_core(options);
    learner_options learn_options;
    learn_options.keep = &residency_gate::persistent;  // parameters and optimizer state, not activations
    s.learn = new learner(learn_options);
    s.core->set_learner(s.learn);
    g_learner.store(s.learn, std::memory_order_release);
    g_core.store(s.core, std::memory_order_release);
  }
  const tracker_mode mode = mode_locked(s);
  const auto callback = mode.subscribe_only ? &on_callback_empty : &on_callback;
  const CUptiResult r = s.cupti.subscribe(&s.subscriber, reinterpret_cast<CUpti_CallbackFunc>(callback), nullptr);
  if (r != CUPTI_SUCCESS) {
    s.subscriber = nullptr;
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
      s.busy.store(true);
      s.problem = "another CUPTI subscriber (nsys, ncu or a torch.profiler started earlier) holds CUPTI";
      if (!s.busy_reported) {
        s.busy_reported = true;
        LAYERSWAP_LOG(warn, "%s; layerswap runs on without launch tracking (see docs/tracker.md)", s.problem.c_str());
      }
    } else {
      s.problem = "cuptiSubscribe failed: " + result_text(s, r);
      LAYERSWAP_LOG(warn, "%s; layerswap runs on without launch tracking", s.problem.c_str());
    }
    return false;
  }
  s.busy.store(false);
  g_generation.fetch_add(1, std::memory_order_relaxed);
  bool all = true;
  // Note [Callback domains]: without the runtime's param info the driver callbacks decode everything.
  const bool runtime_callbacks = mode.api == tracker_api::both && g_cuda.func_get_param_info != nullptr;
  if (runtime_callbacks) {
    for (const CUpti_CallbackId cbid : k_runtime_cbids) {
      all &= s.cupti.enable_callback(1, s.subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, cbid) == CUPTI_SUCCESS;
    }
  }
  for (const CUpti_CallbackId cbid : k_driver_cbids) {
    all &= s.cupti.enable_callback(1, s.subscriber, CUPTI_CB_DOMAIN_DRIVER_API, cbid) == CUPTI_SUCCESS;
  }
  if (!all) LAYERSWAP_LOG(info, "some CUPTI launch callbacks could not be enabled");
  s.problem.clear();
  s.subscribed_mode = mode;
  // Note [Launches beside the engine's calls]
  const bool attribute = mode.attribute && !mode.subscribe_only;
  driver_calls::set_engine_call_marking(attribute);
  g_attribute.store(attribute, std::memory_order_relaxed);
  if (!mode.subscribe_only) {
    s.core->start_consumer();
    residency_gate::set_fed(true);  // from here on every launch enters and exits the regions it touches
    // Note [Holding a launch on the GPU] (allocator/residency_gate.hpp): LAYERSWAP_HOLD=1 turns it on.
    // With lazy module loading (CUDA_MODULE_LOADING=LAZY, PyTorch's default) a kernel's first launch loads its
    // module inside the launch call, and the load waited for the GPU while a held launch blocked it until the
    // migration thread's remap, which waited for the load: the LoRA run at 25% hung so on the H200 (the stack: the
    // launching thread spinning in cuKernelGetParamInfo inside its launch callback, the migration thread asleep).
    // Holds are therefore on only with eager loading.
    const char* loading = std::getenv("CUDA_MODULE_LOADING");
    const bool eager = loading != nullptr && std::string_view(loading) == "EAGER";
    residency_gate::set_holding(g_cuda.stream_wait_value != nullptr && global_config().hold && eager);
    if (global_config().hold && !s.hold_warned) {
      s.hold_warned = true;
      if (eager) {
        LAYERSWAP_LOG(warn, "LAYERSWAP_HOLD=1 is experimental (README, LAYERSWAP_HOLD); leave it at 0 unless you are "
                            "measuring it");
      } else {
        LAYERSWAP_LOG(warn, "LAYERSWAP_HOLD=1 ignored: holding launches needs CUDA_MODULE_LOADING=EAGER (it is %s); "
                            "with lazy loading a kernel's first launch can deadlock against a held launch "
                            "(README, LAYERSWAP_HOLD)", loading ? loading : "unset, LAZY");
      }
    }
  }
  s.active.store(true);
  if (!s.exit_hook) {
    s.exit_hook = true;
    std::atexit(at_exit);
  }
  LAYERSWAP_LOG(info, "launch tracker on (runtime callbacks %s, driver callbacks on%s%s; time counters read the %s)",
                runtime_callbacks ? "on" : "off", mode.subscribe_only ? "; subscribe-only: nothing is recorded" : "",
                attribute ? "; launches attributed to the engine's driver calls" : "", fast_clock::source());
  return true;
}

void unsubscribe_locked(state& s) {
  if (!s.active.load()) return;
  residency_gate::set_fed(false);  // the engine must not trust the gate's idleness from now on
  residency_gate::set_holding(false);
  g_attribute.store(false, std::memory_order_relaxed);
  driver_calls::set_engine_call_marking(false);
  s.cupti.unsubscribe(s.subscriber);
  s.subscriber = nullptr;
  s.active.store(false);
  residency_gate::forget_streams();  // destroys go unseen from now on (Note [Launch streams])
  s.core->stop_consumer();
  s.core->consume();
}

}  // namespace

bool tracker_start() noexcept {
  try {
    state& s = the_state();
    std::lock_guard lock(s.mutex);
    s.paused.store(false);
    return subscribe_locked(s);
  } catch (const std::exception& e) {
    LAYERSWAP_LOG(warn, "the launch tracker could not start: %s", e.what());
    return false;
  } catch (...) {
    return false;
  }
}

void tracker_stop() noexcept {
  try {
    state& s = the_state();
    std::lock_guard lock(s.mutex);
    s.paused.store(false);
    unsubscribe_locked(s);
  } catch (...) {
  }
}

bool tracker_pause() noexcept {
  try {
    state& s = the_state();
    std::lock_guard lock(s.mutex);
    if (!s.active.load()) return false;
    unsubscribe_locked(s);
    s.paused.store(true);
    return true;
  } catch (...) {
    return false;
  }
}

bool tracker_resume() noexcept {
  try {
    state& s = the_state();
    std::lock_guard lock(s.mutex);
    if (!s.paused.load()) return s.active.load();
    s.paused.store(false);
    return subscribe_locked(s);
  } catch (...) {
    return false;
  }
}

bool tracker_active() noexcept { return the_state().active.load(); }
bool tracker_paused() noexcept { return the_state().paused.load(); }
bool tracker_subscriber_busy() noexcept { return the_state().busy.load(); }

std::string tracker_param_info_errors() {
  return std::to_string(g_param_info_failures.load()) + " failed driver param-info queries; last: cuFuncGetParamInfo " +
         std::to_string(g_param_info_error_func.load()) + ", cuKernelGetParamInfo " +
         std::to_string(g_param_info_error_kernel.load());
}

std::string tracker_problem() {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  return s.problem;
}

tracker_core* tracker_instance() noexcept { return g_core.load(std::memory_order_acquire); }
learner* tracker_learner() noexcept { return g_learner.load(std::memory_order_acquire); }

void tracker_set_mode(tracker_mode mode) noexcept {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  s.mode = mode;
  s.mode_set = true;
}

tracker_mode tracker_get_mode() noexcept {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  try {
    return s.active.load() ? s.subscribed_mode : mode_locked(s);
  } catch (...) {
    return s.mode;
  }
}

}  // namespace layerswap::profiler

#else  // LAYERSWAP_NO_CUPTI: built without cupti.h; the tracker never starts.

#include "profiler/tracker.hpp"

namespace layerswap::profiler {
bool tracker_start() noexcept { return false; }
void tracker_stop() noexcept {}
bool tracker_pause() noexcept { return false; }
bool tracker_resume() noexcept { return false; }
bool tracker_active() noexcept { return false; }
bool tracker_paused() noexcept { return false; }
bool tracker_subscriber_busy() noexcept { return false; }
std::string tracker_problem() { return "layerswap was built without the CUPTI headers"; }
std::string tracker_param_info_errors() { return {}; }
tracker_core* tracker_instance() noexcept { return nullptr; }
learner* tracker_learner() noexcept { return nullptr; }
void tracker_set_mode(tracker_mode) noexcept {}
tracker_mode tracker_get_mode() noexcept { return {}; }
}  // namespace layerswap::profiler

#endif
