// The real driver port (runtime/cuda_driver.hpp), and the only file of layerswap that includes <cuda.h>.
//
// libcuda.so.1 is opened with dlopen on first use; its one versioned export cuGetProcAddress_v2 then resolves
// every other entry point into a table (Note [Driver entry points]), and cuInit(0) runs once. A process
// without the NVIDIA driver therefore loads layerswap fine: cuda_device_count() says 0 and make_cuda_driver()
// throws a cuda_error that says the driver is missing.
//
// A cuda_driver speaks for one device through its primary context, the one the CUDA runtime and PyTorch use:
// it retains it for its lifetime and makes it current around each call (Note [Current context]). Every
// failing call throws cuda_error naming the call, its arguments and the CUDA error; cuMemCreate running out
// of memory throws device_out_of_memory, which the allocator catches to reclaim its cache.
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "runtime/config.hpp"
#include "runtime/cuda_driver.hpp"
#include "runtime/digest_kernel.hpp"
#include "runtime/driver_calls.hpp"
#include "runtime/error.hpp"
#include "runtime/log.hpp"

static_assert(CUDA_VERSION >= 12000, "layerswap's driver port needs the CUDA 12.0 (or newer) headers");

// The digest kernel's fatbin (runtime/digest_kernel.cu), embedded by the build (cmake/embed.cmake); size 0 when
// the build had no nvcc.
extern const unsigned char layerswap_digest_image[];
extern const std::size_t layerswap_digest_image_size;

namespace layerswap {
namespace {

// Note [Driver entry points]
// cuGetProcAddress hands out the variant of a function that matches a CUDA version's ABI (cuMemGetInfo ->
// cuMemGetInfo_v2, ...) and, with CU_GET_PROC_ADDRESS_DEFAULT and no per-thread-default-stream macro, the
// legacy-default-stream variants (not the _ptds/_ptsz ones): the same ones the CUDA runtime and PyTorch use,
// so that nullptr means the same default stream for them and for us. We ask for the CUDA 12.0 ABI: every
// function in the table has had the signature our header declares (the decltype types below) since 12.0, and
// asking for a version newer than the installed driver fails, so 12.0 lets us run on every 12.x and 13.x
// driver. A function whose ABI changes later must be requested at the version of the change.
constexpr int k_entry_point_version = 12000;

using get_proc_address_fn = decltype(&::cuGetProcAddress);  // cuGetProcAddress_v2 (cuda.h renames it)

struct entry_points {
  decltype(&::cuGetErrorName) get_error_name = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDeviceGetCount) device_get_count = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetName) device_get_name = nullptr;
  decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&::cuDeviceTotalMem) device_total_mem = nullptr;
  decltype(&::cuMemGetInfo) mem_get_info = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) primary_ctx_release = nullptr;
  decltype(&::cuCtxGetCurrent) ctx_get_current = nullptr;
  decltype(&::cuCtxSetCurrent) ctx_set_current = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_allocation_granularity = nullptr;
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
  decltype(&::cuStreamCreate) stream_create = nullptr;
  decltype(&::cuStreamDestroy) stream_destroy = nullptr;
  decltype(&::cuStreamSynchronize) stream_synchronize = nullptr;
  decltype(&::cuStreamWaitEvent) stream_wait_event = nullptr;
  decltype(&::cuStreamWriteValue32) stream_write_value = nullptr;  // optional: holds need them
  decltype(&::cuStreamWaitValue32) stream_wait_value = nullptr;
  decltype(&::cuEventCreate) event_create = nullptr;
  decltype(&::cuEventDestroy) event_destroy = nullptr;
  decltype(&::cuEventRecord) event_record = nullptr;
  decltype(&::cuEventQuery) event_query = nullptr;
  decltype(&::cuEventSynchronize) event_synchronize = nullptr;
  decltype(&::cuMemcpyAsync) memcpy_async = nullptr;
  decltype(&::cuMemcpyDtoH) memcpy_dtoh = nullptr;
  decltype(&::cuMemcpyHtoD) memcpy_htod = nullptr;
  // optional: the digest kernel (Note [Digest kernel]) needs them
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleUnload) module_unload = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuLaunchKernel) launch_kernel = nullptr;
  decltype(&::cuMemHostAlloc) mem_host_alloc = nullptr;
  decltype(&::cuMemFreeHost) mem_free_host = nullptr;
  decltype(&::cuMemHostGetDevicePointer) mem_host_get_device_pointer = nullptr;
};

// libcuda as this process found it: loaded once, never unloaded (other libraries hold it too).
struct library {
  bool loaded = false;               // libcuda opened and every entry point resolved
  int load_error = CUDA_SUCCESS;     // the cuda_error code when !loaded
  CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
  std::string problem;               // why !loaded, or why cuInit failed
  entry_points fn;
};

std::string strprintf(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string strprintf(const char* format, ...) {
  char small[256];
  std::va_list args;
  va_start(args, format);
  std::va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(small, sizeof small, format, args);
  va_end(args);
  std::string out;
  if (n < 0) {
    out = format;
  } else if (static_cast<std::size_t>(n) < sizeof small) {
    out.assign(small, static_cast<std::size_t>(n));
  } else {
    out.resize(static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, again);
    out.resize(static_cast<std::size_t>(n));
  }
  va_end(again);
  return out;
}

unsigned long long hex(std::uint64_t value) { return static_cast<unsigned long long>(value); }

template <class Fn>
bool resolve(get_proc_address_fn get_proc, const char* name, Fn& slot, std::string& problem) {
  void* address = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  const CUresult r = get_proc(name, &address, k_entry_point_version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (r != CUDA_SUCCESS || address == nullptr || status != CU_GET_PROC_ADDRESS_SUCCESS) {
    problem = strprintf(
        "the NVIDIA driver (libcuda.so.1) offers no %s for CUDA %d.%d (cuGetProcAddress returned %d, symbol status "
        "%d); layerswap needs a driver for CUDA 12.0 or newer: update the NVIDIA driver",
        name, k_entry_point_version / 1000, k_entry_point_version % 1000 / 10, static_cast<int>(r),
        static_cast<int>(status));
    return false;
  }
  slot = reinterpret_cast<Fn>(address);
  return true;
}

library load_library() {
  library lib;
  lib.load_error = CUDA_ERROR_NOT_INITIALIZED;
  void* handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    lib.problem = strprintf(
        "no NVIDIA driver found: dlopen(\"libcuda.so.1\") failed (%s). layerswap needs the NVIDIA driver to use "
        "a GPU: install it, or make libcuda.so.1 visible to the dynamic loader (LD_LIBRARY_PATH, ldconfig)",
        why != nullptr ? why : "unknown error");
    return lib;
  }
  auto get_proc = reinterpret_cast<get_proc_address_fn>(::dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    lib.load_error = CUDA_ERROR_NOT_FOUND;
    lib.problem =
        "the NVIDIA driver (libcuda.so.1) is too old: it has no cuGetProcAddress_v2. layerswap needs a driver for "
        "CUDA 12.0 or newer: update the NVIDIA driver";
    return lib;
  }
  entry_points& fn = lib.fn;
  std::string& p = lib.problem;
  const bool ok =
      resolve(get_proc, "cuGetErrorName", fn.get_error_name, p) &&
      resolve(get_proc, "cuGetErrorString", fn.get_error_string, p) && resolve(get_proc, "cuInit", fn.init, p) &&
      resolve(get_proc, "cuDeviceGetCount", fn.device_get_count, p) &&
      resolve(get_proc, "cuDeviceGet", fn.device_get, p) &&
      resolve(get_proc, "cuDeviceGetName", fn.device_get_name, p) &&
      resolve(get_proc, "cuDeviceGetAttribute", fn.device_get_attribute, p) &&
      resolve(get_proc, "cuDeviceTotalMem", fn.device_total_mem, p) &&
      resolve(get_proc, "cuMemGetInfo", fn.mem_get_info, p) &&
      resolve(get_proc, "cuDevicePrimaryCtxRetain", fn.primary_ctx_retain, p) &&
      resolve(get_proc, "cuDevicePrimaryCtxRelease", fn.primary_ctx_release, p) &&
      resolve(get_proc, "cuCtxGetCurrent", fn.ctx_get_current, p) &&
      resolve(get_proc, "cuCtxSetCurrent", fn.ctx_set_current, p) &&
      resolve(get_proc, "cuMemGetAllocationGranularity", fn.mem_get_allocation_granularity, p) &&
      resolve(get_proc, "cuMemAddressReserve", fn.mem_address_reserve, p) &&
      resolve(get_proc, "cuMemAddressFree", fn.mem_address_free, p) &&
      resolve(get_proc, "cuMemCreate", fn.mem_create, p) && resolve(get_proc, "cuMemRelease", fn.mem_release, p) &&
      resolve(get_proc, "cuMemMap", fn.mem_map, p) && resolve(get_proc, "cuMemUnmap", fn.mem_unmap, p) &&
      resolve(get_proc, "cuMemSetAccess", fn.mem_set_access, p) &&
      resolve(get_proc, "cuStreamCreate", fn.stream_create, p) &&
      resolve(get_proc, "cuStreamDestroy", fn.stream_destroy, p) &&
      resolve(get_proc, "cuStreamSynchronize", fn.stream_synchronize, p) &&
      resolve(get_proc, "cuStreamWaitEvent", fn.stream_wait_event, p) &&
      resolve(get_proc, "cuEventCreate", fn.event_create, p) &&
      resolve(get_proc, "cuEventDestroy", fn.event_destroy, p) &&
      resolve(get_proc, "cuEventRecord", fn.event_record, p) && resolve(get_proc, "cuEventQuery", fn.event_query, p) &&
      resolve(get_proc, "cuEventSynchronize", fn.event_synchronize, p) &&
      resolve(get_proc, "cuMemcpyAsync", fn.memcpy_async, p) &&
      resolve(get_proc, "cuMemcpyDtoH", fn.memcpy_dtoh, p) && resolve(get_proc, "cuMemcpyHtoD", fn.memcpy_htod, p);
  if (!ok) {
    lib.load_error = CUDA_ERROR_NOT_FOUND;
    return lib;
  }
  if (!resolve(get_proc, "cuStreamWriteValue32", fn.stream_write_value, p) ||
      !resolve(get_proc, "cuStreamWaitValue32", fn.stream_wait_value, p)) {
    fn.stream_write_value = nullptr;
    fn.stream_wait_value = nullptr;
  }
  if (!resolve(get_proc, "cuModuleLoadData", fn.module_load_data, p) ||
      !resolve(get_proc, "cuModuleUnload", fn.module_unload, p) ||
      !resolve(get_proc, "cuModuleGetFunction", fn.module_get_function, p) ||
      !resolve(get_proc, "cuLaunchKernel", fn.launch_kernel, p) || !resolve(get_proc, "cuMemHostAlloc", fn.mem_host_alloc, p) ||
      !resolve(get_proc, "cuMemFreeHost", fn.mem_free_host, p) ||
      !resolve(get_proc, "cuMemHostGetDevicePointer", fn.mem_host_get_device_pointer, p)) {
    fn.module_load_data = nullptr;  // no digests: can_digest() says so
  }
  lib.loaded = true;
  lib.load_error = CUDA_SUCCESS;
  lib.init_result = fn.init(0);
  return lib;
}

// Thread-safe: the first caller loads, the others wait (a function-local static). Never destroyed, so that a
// port destroyed late at exit still finds its entry points (Note [Driver at exit]).
const library& cuda_library() {
  static const library* const instance = new library(load_library());
  return *instance;
}

// Only called once cuda_library().loaded.
const entry_points& api() { return cuda_library().fn; }

// "CUDA_ERROR_INVALID_VALUE (invalid argument)".
std::string describe(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  const entry_points& fn = api();
  if (fn.get_error_name == nullptr || fn.get_error_name(r, &name) != CUDA_SUCCESS) name = nullptr;
  if (fn.get_error_string == nullptr || fn.get_error_string(r, &text) != CUDA_SUCCESS) text = nullptr;
  if (name == nullptr) return strprintf("CUresult %d", static_cast<int>(r));
  return strprintf("%s (%s)", name, text != nullptr ? text : "no description");
}

// Throws cuda_error "<call> failed: <error>" when r is not CUDA_SUCCESS. `call` builds the text lazily, so the
// success path formats nothing.
template <class Call>
void check(CUresult r, Call&& call) {
  if (r != CUDA_SUCCESS) [[unlikely]] {
    throw cuda_error(static_cast<int>(r), call() + " failed: " + describe(r));
  }
}

// Note [Current context]
// Most driver calls act on the calling thread's current context: streams and events belong to it, nullptr is
// its legacy default stream, cuMemGetInfo reports its device. A port must therefore run each call in its
// device's primary context, without fighting the application over the thread's current context:
//   * none current (a fresh thread, or before PyTorch touched the GPU): make the primary context current and
//     leave it so, as the CUDA runtime itself does lazily; later calls on this thread find it current.
//   * the primary context current (the common case: PyTorch set this device): nothing to do. The check is one
//     cuCtxGetCurrent, a thread-local read in the driver.
//   * another context current (a multi-device program working on another device, or a user context): switch
//     to ours for the call and put theirs back afterwards, so the application sees its choice untouched.
class context_scope {
 public:
  explicit context_scope(CUcontext primary) {
    const entry_points& fn = api();
    CUcontext current = nullptr;
    check(fn.ctx_get_current(&current), [] { return std::string("cuCtxGetCurrent()"); });
    if (current == primary) [[likely]] return;
    check(fn.ctx_set_current(primary), [&] { return strprintf("cuCtxSetCurrent(primary context %p)", static_cast<void*>(primary)); });
    previous_ = current;
  }
  ~context_scope() {
    if (previous_ != nullptr) (void)api().ctx_set_current(previous_);
  }
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;

 private:
  CUcontext previous_ = nullptr;  // the context to restore, when it was another one
};

CUstream to_stream(stream_handle stream) { return static_cast<CUstream>(stream); }
CUevent to_event(event_handle event) { return static_cast<CUevent>(event); }

class cuda_driver final : public driver {
 public:
  explicit cuda_driver(int device) : device_(device) {
    const entry_points& fn = api();
    int count = 0;
    check(fn.device_get_count(&count), [] { return std::string("cuDeviceGetCount()"); });
    if (device < 0 || device >= count) {
      throw cuda_error(CUDA_ERROR_INVALID_DEVICE,
                       strprintf("CUDA device %d does not exist: this process sees %d device%s (check "
                                 "CUDA_VISIBLE_DEVICES)",
                                 device, count, count == 1 ? "" : "s"));
    }
    check(fn.device_get(&device_handle_, device), [&] { return strprintf("cuDeviceGet(%d)", device); });
    char name[256] = {};
    if (fn.device_get_name(name, sizeof name - 1, device_handle_) != CUDA_SUCCESS) name[0] = '\0';

    int vmm = 0;
    check(fn.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device_handle_),
          [&] { return strprintf("cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device %d)", device); });
    if (vmm == 0) {
      throw cuda_error(CUDA_ERROR_NOT_SUPPORTED,
                       strprintf("CUDA device %d (%s) does not support virtual memory management (cuMemCreate, "
                                 "cuMemMap), which layerswap is built on",
                                 device, name));
    }
    // The host NUMA node nearest the device, for host-located pages; 0 when unknown (attribute new in 12.2).
    int numa = -1;
    if (fn.device_get_attribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device_handle_) == CUDA_SUCCESS &&
        numa >= 0) {
      host_numa_id_ = numa;
    }

    check(fn.device_total_mem(&total_, device_handle_), [&] { return strprintf("cuDeviceTotalMem(device %d)", device); });

    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    check(fn.mem_get_allocation_granularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          [&] { return strprintf("cuMemGetAllocationGranularity(pinned, device %d, minimum)", device); });

    // Last, so that nothing above can throw with the retain taken.
    check(fn.primary_ctx_retain(&primary_, device_handle_),
          [&] { return strprintf("cuDevicePrimaryCtxRetain(device %d)", device); });
    LAYERSWAP_LOG(info, "device %d (%s): CUDA driver port ready, %s, VMM granularity %s", device, name,
                  format_bytes(total_).c_str(), format_bytes(granularity_).c_str());
  }

  // Note [Driver at exit]
  // A port may be destroyed from a static destructor, after libcuda has torn itself down; every call then
  // returns CUDA_ERROR_DEINITIALIZED. Release the primary context only while the driver is alive, and never
  // throw. The entry-point table itself is never destroyed, and libcuda is never unloaded.
  ~cuda_driver() override {
    const entry_points& fn = api();
    CUcontext current = nullptr;
    if (fn.ctx_get_current(&current) == CUDA_ERROR_DEINITIALIZED) return;
    if (digest_module_ != nullptr) {
      context_scope scope(primary_);
      (void)fn.module_unload(digest_module_);
    }
    (void)fn.primary_ctx_release(device_handle_);
  }

  cuda_driver(const cuda_driver&) = delete;
  cuda_driver& operator=(const cuda_driver&) = delete;

  [[nodiscard]] int device() const noexcept override { return device_; }
  [[nodiscard]] std::uint64_t context_id() const noexcept override { return reinterpret_cast<std::uint64_t>(primary_); }
  [[nodiscard]] std::size_t granularity() override { return granularity_; }
  [[nodiscard]] std::size_t total_memory() override { return total_; }

  [[nodiscard]] std::size_t free_memory() override {
    const driver_calls::call timing(driver_calls::kind::other);
    context_scope scope(primary_);
    std::size_t free = 0;
    std::size_t total = 0;
    check(api().mem_get_info(&free, &total), [&] { return strprintf("cuMemGetInfo(device %d)", device_); });
    return free;
  }

  [[nodiscard]] device_ptr reserve(std::size_t bytes, std::size_t alignment) override {
    const driver_calls::call timing(driver_calls::kind::reserve);
    context_scope scope(primary_);
    CUdeviceptr va = 0;
    check(api().mem_address_reserve(&va, bytes, alignment, 0, 0), [&] {
      return strprintf("cuMemAddressReserve(%s, alignment %s)", format_bytes(bytes).c_str(),
                       format_bytes(alignment).c_str());
    });
    return va;
  }

  void unreserve(device_ptr va, std::size_t bytes) override {
    const driver_calls::call timing(driver_calls::kind::reserve);
    context_scope scope(primary_);
    check(api().mem_address_free(va, bytes),
          [&] { return strprintf("cuMemAddressFree(va=0x%llx, %s)", hex(va), format_bytes(bytes).c_str()); });
  }

  [[nodiscard]] phys_handle create(std::size_t bytes, memory_location where) override {
    const driver_calls::call timing(driver_calls::kind::create);
    context_scope scope(primary_);
    const entry_points& fn = api();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = CUDA_SUCCESS;
    if (where == memory_location::device) {
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = device_;
      r = fn.mem_create(&handle, bytes, &prop, 0);
    } else {
      // Host-located pages: a host NUMA node when the driver and system support it, else plain host memory.
      // The first HOST_NUMA failure switches this port to HOST for good, so the failing call is paid once.
      prop.location.type = static_cast<CUmemLocationType>(host_location_.load(std::memory_order_relaxed));
      prop.location.id = prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? host_numa_id_ : 0;
      r = fn.mem_create(&handle, bytes, &prop, 0);
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
        const CUresult numa_result = r;
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
        prop.location.id = 0;
        r = fn.mem_create(&handle, bytes, &prop, 0);
        if (r == CUDA_SUCCESS) {
          host_location_.store(CU_MEM_LOCATION_TYPE_HOST, std::memory_order_relaxed);
          LAYERSWAP_LOG(info, "device %d: host NUMA node %d pages unavailable (%s); using CU_MEM_LOCATION_TYPE_HOST",
                        device_, host_numa_id_, describe(numa_result).c_str());
        }
      }
    }
    if (r != CUDA_SUCCESS) [[unlikely]] {
      std::string what = where == memory_location::device
                             ? strprintf("cuMemCreate(%s, device %d)", format_bytes(bytes).c_str(), device_)
                             : strprintf("cuMemCreate(%s, host %s%d)", format_bytes(bytes).c_str(),
                                         prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? "NUMA node " : "",
                                         prop.location.id);
      what += " failed: " + describe(r);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) throw device_out_of_memory(static_cast<int>(r), what);
      throw cuda_error(static_cast<int>(r), what);
    }
    return static_cast<phys_handle>(handle);
  }

  void release(phys_handle handle) override {
    const driver_calls::call timing(driver_calls::kind::release);
    context_scope scope(primary_);
    check(api().mem_release(static_cast<CUmemGenericAllocationHandle>(handle)),
          [&] { return strprintf("cuMemRelease(handle=0x%llx)", hex(handle)); });
  }

  void map(device_ptr va, std::size_t bytes, phys_handle handle, std::size_t offset) override {
    const driver_calls::call timing(driver_calls::kind::map);
    context_scope scope(primary_);
    check(api().mem_map(va, bytes, offset, static_cast<CUmemGenericAllocationHandle>(handle), 0), [&] {
      return strprintf("cuMemMap(va=0x%llx, %s, handle=0x%llx, offset=%s)", hex(va), format_bytes(bytes).c_str(),
                       hex(handle), format_bytes(offset).c_str());
    });
  }

  void unmap(device_ptr va, std::size_t bytes) override {
    const driver_calls::call timing(driver_calls::kind::unmap);
    context_scope scope(primary_);
    check(api().mem_unmap(va, bytes),
          [&] { return strprintf("cuMemUnmap(va=0x%llx, %s)", hex(va), format_bytes(bytes).c_str()); });
  }

  void set_access(device_ptr va, std::size_t bytes) override {
    const driver_calls::call timing(driver_calls::kind::set_access);
    context_scope scope(primary_);
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device_;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(api().mem_set_access(va, bytes, &desc, 1), [&] {
      return strprintf("cuMemSetAccess(va=0x%llx, %s, read/write for device %d)", hex(va), format_bytes(bytes).c_str(),
                       device_);
    });
  }

  [[nodiscard]] stream_handle create_stream() override {
    context_scope scope(primary_);
    CUstream stream = nullptr;
    check(api().stream_create(&stream, CU_STREAM_NON_BLOCKING),
          [&] { return strprintf("cuStreamCreate(non-blocking, device %d)", device_); });
    return stream;
  }

  void destroy_stream(stream_handle stream) override {
    context_scope scope(primary_);
    check(api().stream_destroy(to_stream(stream)), [&] { return strprintf("cuStreamDestroy(stream=%p)", stream); });
  }

  void synchronize(stream_handle stream) override {
    const driver_calls::call timing(driver_calls::kind::other);
    context_scope scope(primary_);
    check(api().stream_synchronize(to_stream(stream)), [&] { return strprintf("cuStreamSynchronize(stream=%p)", stream); });
  }

  [[nodiscard]] event_handle create_event() override {
    context_scope scope(primary_);
    CUevent event = nullptr;
    check(api().event_create(&event, CU_EVENT_DISABLE_TIMING),
          [&] { return strprintf("cuEventCreate(disable timing, device %d)", device_); });
    return event;
  }

  void destroy_event(event_handle event) override {
    context_scope scope(primary_);
    check(api().event_destroy(to_event(event)), [&] { return strprintf("cuEventDestroy(event=%p)", event); });
  }

  void record(event_handle event, stream_handle stream) override {
    const driver_calls::call timing(driver_calls::kind::record);
    context_scope scope(primary_);
    check(api().event_record(to_event(event), to_stream(stream)),
          [&] { return strprintf("cuEventRecord(event=%p, stream=%p)", event, stream); });
  }

  [[nodiscard]] bool query(event_handle event) override {
    const driver_calls::call timing(driver_calls::kind::query);
    context_scope scope(primary_);
    const CUresult r = api().event_query(to_event(event));
    if (r == CUDA_SUCCESS) return true;
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, [&] { return strprintf("cuEventQuery(event=%p)", event); });
    return false;
  }

  void wait(event_handle event) override {
    const driver_calls::call timing(driver_calls::kind::other);
    context_scope scope(primary_);
    check(api().event_synchronize(to_event(event)), [&] { return strprintf("cuEventSynchronize(event=%p)", event); });
  }

  void stream_wait(stream_handle stream, event_handle event) override {
    const driver_calls::call timing(driver_calls::kind::stream_wait);
    context_scope scope(primary_);
    check(api().stream_wait_event(to_stream(stream), to_event(event), 0),
          [&] { return strprintf("cuStreamWaitEvent(stream=%p, event=%p)", stream, event); });
  }

  void stream_write_value(stream_handle stream, device_ptr addr, std::uint32_t value) override {
    const driver_calls::call timing(driver_calls::kind::write_value);
    context_scope scope(primary_);
    const auto fn = api().stream_write_value;
    check(fn ? fn(to_stream(stream), addr, value, CU_STREAM_WRITE_VALUE_DEFAULT) : CUDA_ERROR_NOT_SUPPORTED,
          [&] { return strprintf("cuStreamWriteValue32(stream=%p, 0x%llx, %u)", stream, hex(addr), value); });
  }

  void stream_wait_value(stream_handle stream, device_ptr addr, std::uint32_t value) override {
    const driver_calls::call timing(driver_calls::kind::write_value);
    context_scope scope(primary_);
    const auto fn = api().stream_wait_value;
    check(fn ? fn(to_stream(stream), addr, value, CU_STREAM_WAIT_VALUE_GEQ) : CUDA_ERROR_NOT_SUPPORTED,
          [&] { return strprintf("cuStreamWaitValue32(stream=%p, 0x%llx, %u)", stream, hex(addr), value); });
  }

  void copy_async(device_ptr dst, device_ptr src, std::size_t bytes, stream_handle stream) override {
    const driver_calls::call timing(driver_calls::kind::copy);
    context_scope scope(primary_);
    check(api().memcpy_async(dst, src, bytes, to_stream(stream)), [&] {
      return strprintf("cuMemcpyAsync(dst=0x%llx, src=0x%llx, %s, stream=%p)", hex(dst), hex(src),
                       format_bytes(bytes).c_str(), stream);
    });
  }

  // Note [Digest kernel]
  // The kernels of runtime/digest_kernel.cu, from the fatbin the build embeds, loaded into the primary context at
  // the first can_digest() or digest call. Each stream gets one of the kernels' scratch slots (partial sums and
  // arrival counters; launches on one stream never overlap), so at most k_slots streams may digest. Results go to
  // page-locked host memory (cuMemHostAlloc, mapped; with unified addressing the host pointer is the device pointer
  // too, which alloc_host_words checks). digest_async launches layerswap_digest for one range; digest_many_async
  // launches layerswap_digest_many for up to k_batch_ranges ranges at once (its parameter, runtime/digest_kernel.hpp,
  // travels by value in the launch), sharing the blocks a launch gets among its ranges by their sizes. A launch costs
  // driver time whatever it digests: on the H100, 32 ranges of 64 KiB took the launching thread 129 us as 32 launches
  // and 5.4 us as one (CudaDriver.BatchedDigestMatchesTheHostForEveryRange).
  static constexpr unsigned k_digest_threads = digest_kernel::k_threads;
  static constexpr unsigned k_digest_max_blocks = digest_kernel::k_max_blocks;
  static constexpr unsigned k_digest_ranges = digest_kernel::k_batch_ranges;

  [[nodiscard]] bool can_digest() override {
    std::lock_guard lock(digest_mutex_);
    return load_digest_locked();
  }

  void digest_async(device_ptr va, std::size_t bytes, std::uint64_t* out, stream_handle stream) override {
    const driver_calls::call timing(driver_calls::kind::digest);
    const auto what = [&] {
      return strprintf("digest_async(va=0x%llx, %s, stream=%p)", hex(va), format_bytes(bytes).c_str(), stream);
    };
    if (!digestible({va, bytes, out})) {
      throw cuda_error(CUDA_ERROR_INVALID_VALUE, what() + ": the range must be 16-byte aligned and non-empty, with result words");
    }
    unsigned slot = digest_slot(stream, what);
    context_scope scope(primary_);
    unsigned long long pairs = bytes / 16;
    const unsigned blocks = static_cast<unsigned>(std::min<unsigned long long>(
        {k_digest_max_blocks, static_cast<unsigned long long>(digest_blocks_), (pairs + k_digest_threads - 1) / k_digest_threads}));
    CUdeviceptr data = va;
    CUdeviceptr result = reinterpret_cast<CUdeviceptr>(out);
    void* params[] = {&data, &pairs, &slot, &result};
    check(api().launch_kernel(digest_function_, blocks, 1, 1, k_digest_threads, 1, 1, 0, to_stream(stream), params, nullptr),
          [&] { return "cuLaunchKernel(layerswap_digest) for " + what(); });
  }

  void digest_many_async(std::span<const digest_range> ranges, stream_handle stream) override {
    const driver_calls::call timing(driver_calls::kind::digest);
    const auto what = [&] { return strprintf("digest_many_async(%zu ranges, stream=%p)", ranges.size(), stream); };
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const digest_range& r = ranges[i];
      if (!digestible(r)) {
        throw cuda_error(CUDA_ERROR_INVALID_VALUE,
                         what() + strprintf(": range %zu (va=0x%llx, %s, out=%p) must be 16-byte aligned and "
                                            "non-empty, with result words",
                                            i, hex(r.va), format_bytes(r.bytes).c_str(), static_cast<void*>(r.out)));
      }
    }
    if (ranges.empty()) return;
    const unsigned slot = digest_slot(stream, what);
    context_scope scope(primary_);
    for (std::size_t first = 0; first < ranges.size(); first += k_digest_ranges) {
      const std::span<const digest_range> part =
          ranges.subspan(first, std::min<std::size_t>(k_digest_ranges, ranges.size() - first));
      digest_kernel::batch batch = plan_batch(part, slot);
      void* params[] = {&batch};
      check(api().launch_kernel(digest_many_function_, batch.first_block[batch.count], 1, 1, k_digest_threads, 1, 1, 0,
                                to_stream(stream), params, nullptr),
            [&] {
              return strprintf("cuLaunchKernel(layerswap_digest_many) for ranges %zu-%zu of ", first,
                               first + part.size() - 1) + what();
            });
    }
  }

  [[nodiscard]] std::uint64_t* alloc_host_words(std::size_t n) override {
    const entry_points& fn = api();
    const auto what = [&] { return strprintf("cuMemHostAlloc(%zu words, mapped)", n); };
    if (fn.mem_host_alloc == nullptr) throw cuda_error(CUDA_ERROR_NOT_SUPPORTED, what() + ": the driver offers no cuMemHostAlloc");
    context_scope scope(primary_);
    void* p = nullptr;
    const std::size_t bytes = std::max<std::size_t>(n, 1) * sizeof(std::uint64_t);
    check(fn.mem_host_alloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP), what);
    CUdeviceptr device = 0;
    const CUresult r = fn.mem_host_get_device_pointer(&device, p, 0);
    if (r != CUDA_SUCCESS || device != reinterpret_cast<CUdeviceptr>(p)) {
      (void)fn.mem_free_host(p);
      throw cuda_error(r != CUDA_SUCCESS ? static_cast<int>(r) : CUDA_ERROR_NOT_SUPPORTED,
                       what() + ": the device address of the words differs from their host address (no unified addressing)");
    }
    std::fill_n(static_cast<std::uint64_t*>(p), bytes / sizeof(std::uint64_t), 0);
    return static_cast<std::uint64_t*>(p);
  }

  void free_host_words(std::uint64_t* words) override {
    if (words == nullptr) return;
    context_scope scope(primary_);
    check(api().mem_free_host(words), [&] { return strprintf("cuMemFreeHost(%p)", static_cast<void*>(words)); });
  }

  void copy_to_host(void* dst, device_ptr src, std::size_t bytes) override {
    if (bytes == 0) return;
    context_scope scope(primary_);
    // To pageable host memory cuMemcpyDtoH returns only once the copy is done.
    check(api().memcpy_dtoh(dst, src, bytes), [&] {
      return strprintf("cuMemcpyDtoH(dst=%p, src=0x%llx, %s)", dst, hex(src), format_bytes(bytes).c_str());
    });
  }

  void copy_from_host(device_ptr dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    context_scope scope(primary_);
    const entry_points& fn = api();
    check(fn.memcpy_htod(dst, src, bytes), [&] {
      return strprintf("cuMemcpyHtoD(dst=0x%llx, src=%p, %s)", hex(dst), src, format_bytes(bytes).c_str());
    });
    // From pageable memory the call may return once the bytes are staged; the copy is ordered on the legacy
    // default stream, so synchronizing that stream waits for them to land.
    check(fn.stream_synchronize(nullptr), [] { return std::string("cuStreamSynchronize(default stream)"); });
  }

 private:
  // What the digest kernels take: a non-empty, 16-byte aligned range of 16-byte units, with result words.
  [[nodiscard]] static bool digestible(const digest_range& r) noexcept {
    return r.bytes != 0 && r.bytes % 16 == 0 && r.va % 16 == 0 && r.out != nullptr;
  }

  // The scratch slot of `stream` (Note [Digest kernel]), the kernels loaded first; `what` names the call in errors.
  template <class What>
  unsigned digest_slot(stream_handle stream, const What& what) {
    std::lock_guard lock(digest_mutex_);
    if (!load_digest_locked()) throw cuda_error(CUDA_ERROR_NOT_SUPPORTED, what() + ": " + digest_problem_);
    auto it = std::find(digest_streams_.begin(), digest_streams_.end(), stream);
    if (it == digest_streams_.end()) {
      if (digest_streams_.size() == digest_kernel::k_slots) {
        throw cuda_error(CUDA_ERROR_NOT_SUPPORTED, what() + ": more streams digest than the kernel has slots for");
      }
      it = digest_streams_.insert(digest_streams_.end(), stream);
    }
    return static_cast<unsigned>(it - digest_streams_.begin());
  }

  // One launch of layerswap_digest_many for `ranges` (1 to k_digest_ranges, checked). The blocks digest_async would
  // give one range (digest_blocks_) are shared by size: each block gets about `per` pairs, and each range at least
  // one block and at most one per k_digest_threads pairs. The shares sum to at most `budget`, the ones added to at
  // most k_digest_ranges: the grid stays within the k_digest_max_blocks partials entries.
  [[nodiscard]] digest_kernel::batch plan_batch(std::span<const digest_range> ranges, unsigned slot) const {
    digest_kernel::batch batch{};
    batch.count = static_cast<std::uint32_t>(ranges.size());
    batch.slot = slot;
    const std::uint64_t budget =
        std::min<std::uint64_t>(static_cast<std::uint64_t>(digest_blocks_), k_digest_max_blocks - k_digest_ranges);
    std::uint64_t total = 0;
    for (const digest_range& r : ranges) total += r.bytes / 16;
    const std::uint64_t per = std::max<std::uint64_t>(1, (total + budget - 1) / budget);
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const std::uint64_t pairs = ranges[k].bytes / 16;
      const std::uint64_t useful = (pairs + k_digest_threads - 1) / k_digest_threads;
      const auto blocks = static_cast<std::uint32_t>(std::min(useful, std::max<std::uint64_t>(pairs / per, 1)));
      batch.data[k] = ranges[k].va;
      batch.pairs[k] = pairs;
      batch.out[k] = reinterpret_cast<std::uintptr_t>(ranges[k].out);
      batch.first_block[k + 1] = batch.first_block[k] + blocks;
    }
    return batch;
  }

  // Loads the digest kernels once (digest_mutex_ held); false, with digest_problem_ saying why, when it cannot.
  bool load_digest_locked() {
    if (digest_function_ != nullptr) return true;
    if (!digest_problem_.empty()) return false;
    const entry_points& fn = api();
    if (layerswap_digest_image_size == 0) {
      digest_problem_ = "layerswap was built without nvcc, so it has no digest kernel";
    } else if (fn.module_load_data == nullptr) {
      digest_problem_ = "the NVIDIA driver lacks the module or launch entry points the digest kernel needs";
    } else {
      context_scope scope(primary_);
      CUmodule module = nullptr;
      CUfunction function = nullptr;
      int sms = 0;
      CUresult r = fn.module_load_data(&module, layerswap_digest_image);
      CUfunction many = nullptr;
      if (r == CUDA_SUCCESS) r = fn.module_get_function(&function, module, "layerswap_digest");
      if (r == CUDA_SUCCESS) r = fn.module_get_function(&many, module, "layerswap_digest_many");
      if (r == CUDA_SUCCESS) r = fn.device_get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_handle_);
      if (r == CUDA_SUCCESS) {
        digest_module_ = module;
        digest_function_ = function;
        digest_many_function_ = many;
        digest_blocks_ = std::max(1, sms) * 4;
        return true;
      }
      if (module != nullptr) (void)fn.module_unload(module);
      digest_problem_ = "the digest kernel did not load on device " + std::to_string(device_) + ": " + describe(r);
    }
    LAYERSWAP_LOG(info, "%s; evictions always copy", digest_problem_.c_str());
    return false;
  }

  int device_;
  CUdevice device_handle_ = 0;
  CUcontext primary_ = nullptr;
  std::size_t granularity_ = 0;
  std::size_t total_ = 0;
  int host_numa_id_ = 0;
  std::atomic<int> host_location_{CU_MEM_LOCATION_TYPE_HOST_NUMA};
  std::mutex digest_mutex_;  // guards the digest kernel's state below
  CUmodule digest_module_ = nullptr;
  CUfunction digest_function_ = nullptr;       // layerswap_digest
  CUfunction digest_many_function_ = nullptr;  // layerswap_digest_many
  int digest_blocks_ = 0;
  std::string digest_problem_;                 // why there is no digest kernel ("" until known)
  std::vector<stream_handle> digest_streams_;  // stream -> scratch slot (its index)
};

}  // namespace

int cuda_device_count() noexcept {
  try {
    const library& lib = cuda_library();
    if (!lib.loaded || lib.init_result != CUDA_SUCCESS) return 0;
    int count = 0;
    if (lib.fn.device_get_count(&count) != CUDA_SUCCESS) return 0;
    return count;
  } catch (...) {
    return 0;
  }
}

std::unique_ptr<driver> make_cuda_driver(int device) {
  const library& lib = cuda_library();
  if (!lib.loaded) throw cuda_error(lib.load_error, lib.problem);
  if (lib.init_result != CUDA_SUCCESS) {
    throw cuda_error(lib.init_result,
                     "cuInit(0) failed: " + describe(lib.init_result) +
                         ". The NVIDIA driver is installed but no GPU is usable: check nvidia-smi, "
                         "CUDA_VISIBLE_DEVICES and that the driver is new enough for CUDA 12");
  }
  return std::make_unique<cuda_driver>(device);
}

}  // namespace layerswap
