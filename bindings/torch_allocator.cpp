// The LibTorch allocator adapter: layerswap's caching allocators behind PyTorch's CUDAAllocator interface,
// so that tensors, torch.cuda.memory_allocated/reserved/max_*, reset_peak_memory_stats, memory_stats,
// empty_cache, Tensor.record_stream and torch.OutOfMemoryError all work as with PyTorch's own allocator.
//
// Installing it stores the adapter where torch.cuda.memory.change_current_allocator would
// (c10::cuda::CUDACachingAllocator::allocator) and registers it for c10::GetAllocator(kCUDA), which newer
// device-generic code paths use. Features PyTorch's native allocator has and layerswap does not yet
// (CUDA-graph private pools, IPC handles, memory history) fail with a message that says so.
//
// Boundary: layerswap exceptions are turned into c10 errors here (out_of_memory -> c10::OutOfMemoryError,
// which Python sees as torch.OutOfMemoryError); nothing else crosses into PyTorch.
#include "bindings/torch_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <cstdio>
#include <vector>

#include "allocator/registry.hpp"
#include "profiler/learner.hpp"
#include "profiler/tracker.hpp"
#include "runtime/error.hpp"
#include "runtime/log.hpp"

namespace layerswap::torch_binding {

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;

void copy_stat(const stat& from, c10::CachingAllocator::Stat& to) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

void copy_pool(const pool_stats& p, DeviceStats& d, std::size_t index) {
  copy_stat(p.allocations, d.allocation[index]);
  copy_stat(p.segments, d.segment[index]);
  copy_stat(p.active, d.active[index]);
  copy_stat(p.allocated_bytes, d.allocated_bytes[index]);
  copy_stat(p.reserved_bytes, d.reserved_bytes[index]);
  copy_stat(p.active_bytes, d.active_bytes[index]);
  copy_stat(p.requested_bytes, d.requested_bytes[index]);
}

void raw_delete_fn(void* ptr);

class torch_allocator final : public cca::CUDAAllocator {
 public:
  // ---- c10::Allocator ----
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    void* p = n ? allocate_on(n, device, c10::cuda::getCurrentCUDAStream(device).stream()) : nullptr;
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- c10::DeviceAllocator ----
  bool initialized() override { return initialized_; }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    guarded([&] {
      for (caching_allocator* a : allocators()) a->empty_cache();
    });
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &raw_delete_fn) return;
    guarded([&] {
      if (caching_allocator* a = owner_of(ptr.get())) a->record_stream(ptr.get(), stream.stream());
    });
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceStats d;
    caching_allocator* a = existing(device);
    if (!a) return d;
    const allocator_stats s = a->stats();
    copy_pool(s.all, d, static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE));
    copy_pool(s.small, d, static_cast<std::size_t>(c10::CachingAllocator::StatType::SMALL_POOL));
    copy_pool(s.large, d, static_cast<std::size_t>(c10::CachingAllocator::StatType::LARGE_POOL));
    d.num_alloc_retries = s.num_alloc_retries;
    d.num_ooms = s.num_ooms;
    d.num_device_alloc = s.num_device_alloc;
    d.num_device_free = s.num_device_free;
    d.num_sync_all_streams = 0;
    d.max_split_size = 0;
    return d;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (caching_allocator* a = existing(device)) a->reset_accumulated_stats();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    if (caching_allocator* a = existing(device)) a->reset_peak_stats();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::pair<size_t, size_t> out{0, 0};
    guarded([&] {
      driver& port = allocator_for(device).port();
      out = {port.free_memory(), port.total_memory()};
    });
    return out;
  }

  // ---- c10::cuda::CUDACachingAllocator::CUDAAllocator ----
  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return nbytes ? allocate_on(nbytes, c10::cuda::current_device(), stream) : nullptr;
  }
  void raw_delete(void* ptr) override { raw_delete_fn(ptr); }
  void init(int device_count) override {
    device_count_ = device_count;
    initialized_ = true;
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    caching_allocator& a = guarded_ref(device);
    const std::size_t b = a.budget();
    return b ? static_cast<double>(b) / static_cast<double>(a.port().total_memory()) : 1.0;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction > 0 && fraction <= 1, "layerswap: memory fraction must be in (0, 1], got ", fraction);
    caching_allocator& a = guarded_ref(device);
    a.set_budget(static_cast<std::size_t>(fraction * static_cast<double>(a.port().total_memory())));
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    guarded([&] { *largest = allocator_for(device).largest_free_block(); });
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    caching_allocator* a = owner_of(ptr);
    TORCH_CHECK(a, "layerswap: getBaseAllocation of a pointer layerswap did not allocate");
    auto [base, bytes] = a->block_of(ptr);
    if (size) *size = bytes;
    return base;
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t, bool) override { return {}; }
  void beginAllocateToPool(c10::DeviceIndex, c10::MempoolId_t, std::function<bool(cudaStream_t)>) override {
    unsupported("CUDA graph memory pools (torch.cuda.graph, torch.compile mode=\"reduce-overhead\")");
  }
  void endAllocateToPool(c10::DeviceIndex, c10::MempoolId_t) override {
    unsupported("CUDA graph memory pools (torch.cuda.graph, torch.compile mode=\"reduce-overhead\")");
  }
  void releasePool(c10::DeviceIndex, c10::MempoolId_t) override {}
  cca::ShareableHandle shareIpcHandle(void*) override { unsupported("sharing CUDA tensors between processes (IPC)"); }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    unsupported("sharing CUDA tensors between processes (IPC)");
  }
  bool isHistoryEnabled() override { return false; }
  void recordHistory(bool enabled, c10::CachingDeviceAllocator::CreateContextFn, size_t,
                     c10::CachingDeviceAllocator::RecordContext, bool, const std::vector<std::string>&) override {
    if (enabled) unsupported("memory history (torch.cuda.memory._record_memory_history)");
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(c10::CachingDeviceAllocator::AllocatorTraceTracker) override {}
  void enablePeerAccess(c10::DeviceIndex, c10::DeviceIndex) override {
    // TODO(multi-GPU): grant peer devices access to every region (cuMemSetAccess) for P2P copies.
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, c10::MempoolId_t) override {
    unsupported("allocator checkpoints (CUDA graph trees)");
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override {
    unsupported("allocator checkpoints (CUDA graph trees)");
  }
  std::string name() override { return "layerswap"; }

 private:
  void* allocate_on(std::size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    try {
      return allocator_for(device).allocate(n, stream);
    } catch (const out_of_memory& e) {
      notify_oom(device, n);
      TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, e.what());
    }
  }
  void notify_oom(c10::DeviceIndex device, std::size_t n) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(mutex_);
      observers = oom_observers_;
    }
    if (observers.empty()) return;
    std::size_t held = 0, total = 0, free = 0;
    try {
      caching_allocator& a = allocator_for(device);
      held = static_cast<std::size_t>(a.stats().device_bytes.current);
      total = a.port().total_memory();
      free = a.port().free_memory();
    } catch (...) {
    }
    for (auto& o : observers) o(device, held, total, free);
  }
  static caching_allocator* existing(c10::DeviceIndex device) {
    for (caching_allocator* a : allocators()) {
      if (a->port().device() == device) return a;
    }
    return nullptr;
  }
  static caching_allocator& guarded_ref(c10::DeviceIndex device) {
    caching_allocator* out = nullptr;
    guarded([&] { out = &allocator_for(device); });
    return *out;
  }
  template <typename F>
  static void guarded(F&& f) {
    try {
      f();
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      TORCH_CHECK(false, e.what());
    }
  }
  [[noreturn]] static void unsupported(const char* what) {
    TORCH_CHECK(false, "layerswap does not support ", what,
                " yet; run without layerswap (unset LAYERSWAP_BUDGET and LAYERSWAP) for this program");
  }

  std::mutex mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  int device_count_ = 0;
  bool initialized_ = false;
  bool enabled_ = true;
};

torch_allocator& adapter() {
  static auto* a = new torch_allocator();  // static lifetime, never destroyed (tensors may outlive main)
  return *a;
}

void raw_delete_fn(void* ptr) {
  if (!ptr) return;
  if (caching_allocator* a = owner_of(ptr)) {
    if (!a->deallocate(ptr)) LAYERSWAP_LOG(warn, "free of %p, which is not a live layerswap block; ignored", ptr);
    return;
  }
  LAYERSWAP_LOG(warn, "free of %p, which layerswap did not allocate; ignored", ptr);
}

std::mutex g_install_mutex;

}  // namespace

bool installed() noexcept { return cca::allocator.load() == &adapter(); }

bool native_initialized() {
  cca::CUDAAllocator* current = cca::allocator.load();
  return current && current != &adapter() && current->initialized();
}

// LAYERSWAP_STATS: what the learner made of the launches.
static std::string learner_report() {
  const profiler::learner* l = profiler::tracker_learner();
  if (l == nullptr) return {};
  const profiler::learner_stats s = l->stats();
  char line[512];
  std::snprintf(line, sizeof line,
                "layerswap: learner: %s; period %llu launches, %llu steps followed, %llu recurring regions in %llu "
                "groups, learned %llu times, relearned %llu times, %.4f of launches predicted\n",
                s.learned ? "step learned" : "no step learned", static_cast<unsigned long long>(s.period),
                static_cast<unsigned long long>(s.steps), static_cast<unsigned long long>(s.recurring_regions),
                static_cast<unsigned long long>(s.groups), static_cast<unsigned long long>(s.learns),
                static_cast<unsigned long long>(s.relearns), s.hit_rate());
  std::string out = line;
  // LAYERSWAP_TRACK=attribute: where the launches met the migration thread (empty otherwise).
  if (profiler::tracker_core* core = profiler::tracker_instance()) out += profiler::attribution_report(core->stats());
  return out;
}

void install() {
  std::lock_guard lock(g_install_mutex);
  if (installed()) return;
  cca::CUDAAllocator* current = cca::allocator.load();
  if (current && current->initialized()) {
    // PyTorch initialized CUDA already. Swapping is still safe if its allocator holds no live memory: its
    // tensors (none) would be freed through their own deleter anyway.
    std::int64_t live = 0;
    const int n = c10::cuda::device_count();
    for (int d = 0; d < n; ++d) {
      live += current->getDeviceStats(static_cast<c10::DeviceIndex>(d)).allocated_bytes[0].current;
    }
    if (live > 0) {
      throw error("layerswap: too late to enable: PyTorch's own CUDA allocator (" + current->name() +
                  ") already holds " + format_bytes(static_cast<std::uint64_t>(live)) +
                  " of live CUDA memory. Set LAYERSWAP_BUDGET (or LAYERSWAP=1) in the environment before starting "
                  "Python, run the script with `python -m layerswap run`, or call layerswap.enable() before the "
                  "first CUDA tensor is created");
    }
  }
  if (!gpu_available()) {
    throw error("layerswap: no CUDA GPU is visible (no NVIDIA driver, or no device); layerswap needs one");
  }
  (void)global_config();  // parse the settings now, so that a bad value fails here, not at the first tensor
  torch_allocator& a = adapter();
  a.init(c10::cuda::device_count());
  cca::allocator.store(&a);
  c10::SetAllocator(c10::DeviceType::CUDA, &a, /*priority=*/255);
  LAYERSWAP_LOG(info, "installed as PyTorch's CUDA allocator");
  // The launch tracker (LAYERSWAP_TRACK): installed means layerswap is on, so only an explicit 0 keeps it off.
  // It never fails the install: without CUPTI, or with CUPTI taken by another tool, the program runs untracked.
  if (global_config().track != config::track_mode::off && profiler::tracker_start()) {
    // Swapping learns the step from the tracker: its learner is the forecast every residency policy reads.
    set_forecast_source(profiler::tracker_learner());
    set_stats_section(&learner_report);
  }
}

double bench_alloc_free(std::size_t bytes, int iters) {
  cca::CUDAAllocator* a = cca::get();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < 20; ++i) a->raw_delete(a->raw_alloc_with_stream(bytes, stream));
  std::vector<double> us(static_cast<std::size_t>(std::max(iters, 1)));
  for (double& t : us) {
    const auto t0 = std::chrono::steady_clock::now();
    void* p = a->raw_alloc_with_stream(bytes, stream);
    a->raw_delete(p);
    t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
  return us[us.size() / 2];
}

}  // namespace layerswap::torch_binding
