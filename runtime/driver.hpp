// The CUDA driver port: the only way the allocator and the residency engine touch a GPU.
//
// Two implementations sit behind this interface:
//   * cuda_driver (cuda_driver.cpp) loads libcuda.so.1 at run time (dlopen + cuGetProcAddress); nothing
//     links against libcuda, so the library loads on machines without a GPU.
//   * sim_driver (sim_driver.hpp) plays a device in host memory: VA reservations, physical pages on the
//     device or the host, map/unmap/access, streams, events, copies. It checks the invariants a real GPU
//     would punish (access to an unmapped range, a remap under a pending launch) and is what every CPU
//     test stands on.
//
// Types are opaque integers/pointers so that no CUDA header leaks out of this layer. A stream_handle is a
// CUstream (== cudaStream_t); nullptr is the legacy default stream.
//
// Errors: every method throws layerswap::cuda_error on failure, except create() which throws
// layerswap::device_out_of_memory when the device has no room left (the allocator catches that one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace layerswap {

using device_ptr = std::uint64_t;
using phys_handle = std::uint64_t;
using stream_handle = void*;
using event_handle = void*;

enum class memory_location : std::uint8_t { device, host };

// One range of driver::digest_many_async: what digest_async takes, for one range.
struct digest_range {
  device_ptr va = 0;
  std::size_t bytes = 0;
  std::uint64_t* out = nullptr;
};

class driver {
 public:
  virtual ~driver() = default;

  // The device this port speaks for (CUDA ordinal).
  [[nodiscard]] virtual int device() const noexcept = 0;
  // The context its streams and events belong to, as the launch tracker sees launches' contexts (CUcontext).
  [[nodiscard]] virtual std::uint64_t context_id() const noexcept = 0;
  // VMM mapping granularity for device memory (2 MiB on the H100).
  [[nodiscard]] virtual std::size_t granularity() = 0;
  // Total and currently free device memory, bytes.
  [[nodiscard]] virtual std::size_t total_memory() = 0;
  [[nodiscard]] virtual std::size_t free_memory() = 0;

  // Virtual address space. `bytes` and `alignment` are multiples of granularity().
  [[nodiscard]] virtual device_ptr reserve(std::size_t bytes, std::size_t alignment) = 0;
  virtual void unreserve(device_ptr va, std::size_t bytes) = 0;

  // Physical memory. create() throws device_out_of_memory when there is no room.
  [[nodiscard]] virtual phys_handle create(std::size_t bytes, memory_location where) = 0;
  virtual void release(phys_handle handle) = 0;
  virtual void map(device_ptr va, std::size_t bytes, phys_handle handle, std::size_t offset) = 0;
  virtual void unmap(device_ptr va, std::size_t bytes) = 0;
  // Grants this device read/write access to a fully mapped range.
  virtual void set_access(device_ptr va, std::size_t bytes) = 0;

  // Streams and events. Events are created with timing disabled; streams do not synchronize with the default
  // stream (CU_STREAM_NON_BLOCKING, as PyTorch's side streams).
  [[nodiscard]] virtual stream_handle create_stream() = 0;
  virtual void destroy_stream(stream_handle stream) = 0;
  virtual void synchronize(stream_handle stream) = 0;
  [[nodiscard]] virtual event_handle create_event() = 0;
  virtual void destroy_event(event_handle event) = 0;
  virtual void record(event_handle event, stream_handle stream) = 0;
  // True once all work captured by the last record() has completed. Never blocks.
  [[nodiscard]] virtual bool query(event_handle event) = 0;
  // Blocks the calling thread until the event has completed.
  virtual void wait(event_handle event) = 0;
  // Makes future work on `stream` wait for `event` (no host blocking).
  virtual void stream_wait(stream_handle stream, event_handle event) = 0;

  // Stream memory operations on a 32-bit word of mapped memory (4-byte aligned): when `stream` reaches it,
  // write_value stores `value`; wait_value makes later work on `stream` wait until the word is >= `value`
  // (unsigned). No host blocking. The residency engine's holds (allocator/residency_gate.hpp).
  virtual void stream_write_value(stream_handle stream, device_ptr addr, std::uint32_t value) = 0;
  virtual void stream_wait_value(stream_handle stream, device_ptr addr, std::uint32_t value) = 0;

  // Content digests (runtime/digest.hpp; the residency engine's write-back skip). can_digest(): whether
  // digest_async works here (the real port: its kernel image is built in and loads on this device).
  // digest_async: when `stream` reaches it, stores the digest of the mapped range [va, va + bytes) (bytes a
  // multiple of 16) in out[0], out[1], memory from alloc_host_words; the host reads it once an event recorded on
  // `stream` afterwards has completed. alloc_host_words: page-locked host memory for `n` 64-bit words, zeroed,
  // that the device may write; free_host_words releases it (no work may still write it).
  // digest_many_async: digest_async for each of `ranges` (the same preconditions; each its own result words), in
  // as few launches as the port can (the real one: up to 32 ranges a kernel launch), so that digesting many regions
  // does not cost a launch each: when `stream` reaches it, stores each range's digest in its words. Every range is
  // checked before anything is enqueued: a bad one throws with nothing enqueued. A launch that fails after others
  // were enqueued throws too, and the ranges of those may still be digested (their words written) when `stream`
  // reaches them. An empty `ranges` enqueues nothing.
  [[nodiscard]] virtual bool can_digest() = 0;
  virtual void digest_async(device_ptr va, std::size_t bytes, std::uint64_t* out, stream_handle stream) = 0;
  virtual void digest_many_async(std::span<const digest_range> ranges, stream_handle stream) = 0;
  [[nodiscard]] virtual std::uint64_t* alloc_host_words(std::size_t n) = 0;
  virtual void free_host_words(std::uint64_t* words) = 0;

  // Stream-ordered copy between any two mapped addresses (device or host-located pages).
  virtual void copy_async(device_ptr dst, device_ptr src, std::size_t bytes, stream_handle stream) = 0;

  // Synchronous copies between ordinary host memory and a mapped range, for tests and diagnostics (never on
  // a hot path). Like cuMemcpyDtoH/HtoD they run after the work already enqueued on the default stream
  // (nullptr) but not after work on streams from create_stream(): synchronize those first. Both return once
  // the bytes have arrived.
  virtual void copy_to_host(void* dst, device_ptr src, std::size_t bytes) = 0;
  virtual void copy_from_host(device_ptr dst, const void* src, std::size_t bytes) = 0;
};

}  // namespace layerswap
