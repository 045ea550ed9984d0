// A simulated device in host memory: the driver port every CPU test stands on (see sim_driver.cpp for the
// model and its notes).
//
// It behaves like the CUDA driver where the driver is strict (alignment, map only onto a reservation, unmap
// whole mappings, access per granule, out of memory) and, where the real GPU would silently corrupt data or
// fault later, it records a *violation* instead: an executed access to an unmapped or unauthorised granule,
// a map/unmap/unreserve under an operation still pending on some stream (DESIGN.md invariant 3), a release
// of pages that pending work still uses. Tests assert that violations() is empty.
//
// Streams are FIFOs of operations (simulated kernels, copies, event records, waits, gates). In eager mode an
// operation runs as soon as it is enqueued and its waits are satisfied; otherwise it stays pending until the
// test runs it (run_one, run_all) or the code under test blocks on it (wait, synchronize), which runs just
// what a GPU would have to finish first. The default stream (nullptr) does not synchronize with the others
// (they are non-blocking streams, as PyTorch's). Thread-safe (one mutex) and deterministic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/driver.hpp"

namespace layerswap {

struct sim_options {
  std::size_t total_memory = std::size_t{256} << 20;  // device bytes that may exist at once
  std::size_t granularity = std::size_t{2} << 20;     // a power of two
  bool eager = true;                                   // run operations as soon as they can run
  bool digest = true;                                  // can_digest(): a device with the digest kernel
  bool unmap_one_mapping = false;                      // unmap() refuses a range of several mappings
  bool digest_drops_results = false;                   // digests run but write nothing (a failed launch)
  int device = 0;
  std::size_t host_limit = 0;                          // host-located bytes that may exist at once; 0: unlimited
};

class sim_driver final : public driver {
 public:
  // One range a simulated kernel touches: reads check mapping and access; writes store `value` in every byte.
  struct access {
    device_ptr va = 0;
    std::size_t bytes = 0;
    bool write = false;
    std::uint8_t value = 0;
  };

  explicit sim_driver(sim_options options = {});
  ~sim_driver() override;
  sim_driver(const sim_driver&) = delete;
  sim_driver& operator=(const sim_driver&) = delete;

  // ---- driver ----
  [[nodiscard]] int device() const noexcept override;
  [[nodiscard]] std::uint64_t context_id() const noexcept override;  // distinct per simulated device
  [[nodiscard]] std::size_t granularity() override;
  [[nodiscard]] std::size_t total_memory() override;
  [[nodiscard]] std::size_t free_memory() override;
  [[nodiscard]] device_ptr reserve(std::size_t bytes, std::size_t alignment) override;
  void unreserve(device_ptr va, std::size_t bytes) override;
  [[nodiscard]] phys_handle create(std::size_t bytes, memory_location where) override;
  void release(phys_handle handle) override;
  void map(device_ptr va, std::size_t bytes, phys_handle handle, std::size_t offset) override;
  void unmap(device_ptr va, std::size_t bytes) override;
  void set_access(device_ptr va, std::size_t bytes) override;
  [[nodiscard]] stream_handle create_stream() override;
  void destroy_stream(stream_handle stream) override;
  void synchronize(stream_handle stream) override;
  [[nodiscard]] event_handle create_event() override;
  void destroy_event(event_handle event) override;
  void record(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool query(event_handle event) override;
  void wait(event_handle event) override;
  void stream_wait(stream_handle stream, event_handle event) override;
  void stream_write_value(stream_handle stream, device_ptr addr, std::uint32_t value) override;
  void stream_wait_value(stream_handle stream, device_ptr addr, std::uint32_t value) override;
  [[nodiscard]] bool can_digest() override;
  void digest_async(device_ptr va, std::size_t bytes, std::uint64_t* out, stream_handle stream) override;
  void digest_many_async(std::span<const digest_range> ranges, stream_handle stream) override;
  [[nodiscard]] std::uint64_t* alloc_host_words(std::size_t n) override;
  void free_host_words(std::uint64_t* words) override;
  void copy_async(device_ptr dst, device_ptr src, std::size_t bytes, stream_handle stream) override;
  void copy_to_host(void* dst, device_ptr src, std::size_t bytes) override;
  void copy_from_host(device_ptr dst, const void* src, std::size_t bytes) override;

  // ---- test side ----
  // Enqueues a simulated kernel touching `accesses`.
  void launch(stream_handle stream, std::span<const access> accesses);
  void launch(stream_handle stream, std::initializer_list<access> accesses);
  // Enqueues a gate: the stream stops there until open_gate(id), like a kernel spinning on a host flag. Lets a
  // test keep work "running on the GPU" in eager mode. Returns the gate's id.
  std::uint64_t launch_gate(stream_handle stream);
  void open_gate(std::uint64_t gate);

  // Executes the oldest operation of `stream`; false when it has none or it is blocked (wait, closed gate).
  bool run_one(stream_handle stream);
  // Runs every stream until all are empty, one operation per stream in turn (creation order). Throws
  // cuda_error (and records a violation) when operations remain that can never run.
  void run_all();
  // Operations enqueued on `stream` and not yet executed.
  [[nodiscard]] std::size_t pending(stream_handle stream) const;
  // Whether an operation not yet executed, on any stream but `except_stream`, touches [va, va + bytes).
  [[nodiscard]] bool pending_touches(device_ptr va, std::size_t bytes, stream_handle except_stream) const;
  [[nodiscard]] bool pending_touches(device_ptr va, std::size_t bytes) const;

  // Immediate host access through the device mapping, checked like a kernel access (violations, not throws).
  void host_write(device_ptr va, std::span<const std::byte> data);
  void host_read(device_ptr va, std::span<std::byte> out);
  // The byte currently stored at `va` (mapped; access rights not needed). Throws cuda_error when unmapped.
  [[nodiscard]] std::uint8_t byte_at(device_ptr va);

  [[nodiscard]] std::size_t live_device_bytes() const;  // device pages in existence (released-but-mapped too)
  [[nodiscard]] std::size_t live_host_bytes() const;
  [[nodiscard]] std::size_t num_creates() const;
  [[nodiscard]] std::size_t num_releases() const;
  [[nodiscard]] std::size_t num_maps() const;    // successful map() calls
  [[nodiscard]] std::size_t num_unmaps() const;  // successful unmap() calls
  [[nodiscard]] std::size_t num_digests() const;          // ranges digested (executed), however enqueued
  [[nodiscard]] std::size_t num_digest_launches() const;  // digest operations executed: one per digest_async or
                                                          // non-empty digest_many_async call (a kernel launch)
  [[nodiscard]] std::size_t num_host_waits() const;    // wait() calls
  [[nodiscard]] std::size_t num_synchronizes() const;  // synchronize() calls
  [[nodiscard]] std::size_t num_reserved_bytes() const;
  void set_total_memory(std::size_t bytes);

  [[nodiscard]] std::vector<std::string> violations() const;
  void clear_violations();

 private:
  void enqueue_value_op(bool write, stream_handle stream, device_ptr addr, std::uint32_t value);
  struct impl;
  std::unique_ptr<impl> impl_;
};

using sim_access = sim_driver::access;

}  // namespace layerswap
