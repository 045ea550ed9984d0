// The simulated device (runtime/sim_driver.hpp).
//
// Model, all under one mutex:
//   * Virtual addresses: reservations handed out next-fit from a fake base (0x7000'0000'0000 upward), so a
//     freed range is not handed out again at once; addresses are never dereferenced.
//   * Physical allocations: host memory from mmap (MAP_NORESERVE: untouched pages cost nothing), zero-filled,
//     located on the device (counted against total_memory) or the host (against host_limit).
//   * Mappings: one record per map() call, with an access flag per granule. A VA resolves to
//     (allocation, byte) through the mapping that covers it.
//   * Streams: FIFOs of operations, executed in order (Note [Simulated streams]).
//
// Note [Errors and violations]
// Two kinds of wrong use. What the CUDA driver rejects (a misaligned size, a map onto a mapped range, an unmap
// of part of a mapping, an unknown handle) throws cuda_error with the CUDA code and leaves the state as it was.
// What the driver accepts but a GPU punishes later (an access to an unmapped granule or one without access
// rights; a map, unmap or unreserve of a range that work not yet executed touches; a release of pages such
// work still uses) is recorded as a violation, with the operation, the address and the stream, and the call
// goes ahead as the driver would let it: a faulting access skips its bytes, an unmap under a pending kernel
// unmaps (and the kernel faults when it runs). Tests assert that no violation was recorded.
//
// Note [Simulated streams]
// Each stream (the default stream is id 0, handle nullptr) is a FIFO of operations: kernels (launch), copies,
// event records, waits (stream_wait) and gates (launch_gate). The head runs when it can: a wait when the record
// it captured has executed, a gate when it is open, anything else at once. In eager mode every stream is run
// as far as it can go after each call, so only a gate keeps work pending. Otherwise work waits for the test
// (run_one, run_all) or for a host call that blocks on it: wait(event) runs the recording stream up to the
// record, synchronize(stream) runs the stream dry, and each runs, first, whatever the blocked head waits for
// on other streams. That is what a GPU would have had to finish before the host could continue, and no more:
// work that a real GPU could still be running stays pending, so the hazards stay visible.
//
// Note [Event records]
// Every record() gets a sequence number. An event remembers its last record; query() is true when that record
// has executed (or when the event was never recorded, as in CUDA). stream_wait() captures the event's last
// record at the time of the call, so a later re-record does not change what the stream waits for. Records of
// destroyed events still execute; waits on them still resolve.
//
// Note [Held work]
// A stream memory wait (stream_wait_value) whose value has not been written holds everything queued behind it
// on its stream: a GPU cannot start that work before some later write. map() and unmap() under such held work
// are not violations (the residency engine remaps a region under launches it holds until the remap is done:
// allocator/residency_gate.hpp, Note [Holding a launch on the GPU]); whatever the held work finds when it runs
// is checked then, as for any operation. Value waits can form cycles (a wait for a write queued behind it): a
// host call that would block on one reports the deadlock as below.
//
// Note [Deadlock]
// A wait can only capture a record that was enqueued before it, so chains of waits cannot form a cycle: with
// waits alone every stream can always drain. What can block forever is a closed gate (and whatever waits on a
// record behind it). A host call that would block on such work, or a run_all() that finds only blocked heads,
// records a violation and throws cuda_error(CUDA_ERROR_ILLEGAL_STATE): a real program would hang there.
#include "runtime/sim_driver.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "runtime/config.hpp"
#include "runtime/digest.hpp"
#include "runtime/error.hpp"

namespace layerswap {
namespace {

// CUresult values the simulator reports (the same numbers as cuda.h, which this file must not include).
constexpr int k_invalid_value = 1;     // CUDA_ERROR_INVALID_VALUE
constexpr int k_out_of_memory = 2;     // CUDA_ERROR_OUT_OF_MEMORY
constexpr int k_invalid_handle = 400;  // CUDA_ERROR_INVALID_HANDLE
constexpr int k_illegal_state = 401;   // CUDA_ERROR_ILLEGAL_STATE
constexpr int k_not_supported = 801;   // CUDA_ERROR_NOT_SUPPORTED

constexpr device_ptr k_va_base = 0x7000'0000'0000;
constexpr device_ptr k_va_limit = k_va_base + (std::uint64_t{1} << 50);
constexpr std::uintptr_t k_stream_base = 0x5157'0000'0000;  // fake handle of stream id i: base + 16 i
constexpr std::uintptr_t k_event_base = 0x5e7e'0000'0000;
constexpr phys_handle k_first_handle = 0x1000;

const char* error_text(int code) {
  switch (code) {
    case k_invalid_value:
      return "CUDA_ERROR_INVALID_VALUE (invalid argument)";
    case k_out_of_memory:
      return "CUDA_ERROR_OUT_OF_MEMORY (out of memory)";
    case k_invalid_handle:
      return "CUDA_ERROR_INVALID_HANDLE (invalid resource handle)";
    case k_illegal_state:
      return "CUDA_ERROR_ILLEGAL_STATE (the operation cannot be performed in the present state)";
    default:
      return "CUDA error";
  }
}

// "sim: <call> failed: <CUDA error>: <why>".
[[noreturn]] void fail(int code, const std::string& call, const std::string& why) {
  throw cuda_error(code, "sim: " + call + " failed: " + error_text(code) + ": " + why);
}

std::string hex(std::uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

std::string hex_ptr(const void* p) { return hex(reinterpret_cast<std::uintptr_t>(p)); }

// "[0x7000..., +2.00 MiB)".
std::string range_text(device_ptr va, std::size_t bytes) { return "[" + hex(va) + ", +" + format_bytes(bytes) + ")"; }

std::string stream_text(std::uint64_t id) {
  return id == 0 ? std::string("stream 0 (default)") : "stream " + std::to_string(id);
}

bool overlaps(device_ptr a, std::size_t a_bytes, device_ptr b, std::size_t b_bytes) {
  return a_bytes != 0 && b_bytes != 0 && a < b + b_bytes && b < a + a_bytes;
}

device_ptr align_up(device_ptr value, std::size_t alignment) {
  return (value + alignment - 1) & ~static_cast<device_ptr>(alignment - 1);
}

enum class op_kind : std::uint8_t { kernel, copy, record, wait, gate, value_wait, value_write, digest };

struct op {
  op_kind kind = op_kind::kernel;
  std::uint64_t number = 0;              // global enqueue order, for messages
  std::vector<sim_driver::access> ranges;  // kernel: its accesses; copy: {dst (write), src (read)}
  std::uint64_t id = 0;                  // record, wait: a record sequence (0: nothing to wait for); gate: its id;
                                         // value_wait, value_write: the value (ranges[0]: the 32-bit word)
  std::uint64_t event = 0;               // record, wait: the event's id
  std::vector<std::uint64_t*> out{};     // digest: where each range's result goes (ranges: the ranges read)
};

struct stream_state {
  std::uint64_t id = 0;
  std::deque<op> ops;
  bool destroyed = false;  // destroy_stream() came while work was pending; gone once drained
};

struct phys_block {
  std::size_t bytes = 0;
  memory_location where = memory_location::device;
  bool released = false;     // release() called; the pages live until the last mapping goes
  std::size_t mappings = 0;  // map() records that use it
  std::byte* data = nullptr;
};

struct mapping {
  std::size_t bytes = 0;
  phys_handle handle = 0;
  std::size_t offset = 0;
  std::vector<bool> access;  // per granule
};

struct event_state {
  std::uint64_t last_record = 0;  // sequence of the last record(); 0: never recorded
};

enum class fault : std::uint8_t { none, unmapped, denied };

// Bytes of one access that could not be performed, by reason.
struct fault_tally {
  std::size_t unmapped = 0;
  std::size_t denied = 0;
  device_ptr first_unmapped = 0;
  device_ptr first_denied = 0;

  void add(fault why, device_ptr va, std::size_t bytes) {
    if (why == fault::unmapped) {
      if (unmapped == 0) first_unmapped = va;
      unmapped += bytes;
    } else if (why == fault::denied) {
      if (denied == 0) first_denied = va;
      denied += bytes;
    }
  }
  [[nodiscard]] bool any() const { return unmapped != 0 || denied != 0; }
  [[nodiscard]] std::string text() const {
    std::string out;
    if (unmapped != 0) out += format_bytes(unmapped) + " not mapped (first at " + hex(first_unmapped) + ")";
    if (denied != 0) {
      if (!out.empty()) out += ", ";
      out += format_bytes(denied) + " mapped without access rights, set_access missing (first at " +
             hex(first_denied) + ")";
    }
    return out;
  }
};

}  // namespace

struct sim_driver::impl {
  explicit impl(const sim_options& options)
      : granularity(options.granularity),
        total(options.total_memory),
        host_limit(options.host_limit),
        digest_enabled(options.digest),
        unmap_one_mapping(options.unmap_one_mapping),
        digest_drops_results(options.digest_drops_results),
        eager(options.eager),
        device(options.device) {
    if (granularity == 0 || !std::has_single_bit(granularity)) {
      throw cuda_error(k_invalid_value, "sim: sim_options.granularity must be a power of two, got " +
                                            std::to_string(granularity));
    }
    streams.emplace(0, stream_state{});
  }

  ~impl() {
    for (auto& [handle, block] : phys) free_storage(block);
  }

  // ---- options and counters ----
  const std::size_t granularity;
  std::size_t total;
  const std::size_t host_limit;
  const bool digest_enabled;
  const bool unmap_one_mapping;
  const bool digest_drops_results;
  const bool eager;
  const int device;

  std::size_t live_device = 0;
  std::size_t live_host = 0;
  std::size_t creates = 0;
  std::size_t releases = 0;
  std::size_t maps = 0;
  std::size_t unmaps = 0;
  std::size_t host_waits = 0;
  std::size_t digests = 0;          // ranges digested
  std::size_t digest_launches = 0;  // digest operations (one per digest_async or digest_many_async call)
  std::size_t synchronizes = 0;
  std::size_t reserved = 0;

  // ---- state ----
  mutable std::mutex mutex;
  std::map<device_ptr, std::size_t> reservations;  // start -> bytes
  device_ptr va_cursor = k_va_base;
  std::map<phys_handle, phys_block> phys;
  phys_handle next_handle = k_first_handle;
  std::map<device_ptr, mapping> mappings;  // start -> mapping; never overlapping
  std::map<std::uint64_t, stream_state> streams;
  std::uint64_t next_stream = 1;
  std::map<std::uint64_t, event_state> events;
  std::uint64_t next_event = 1;
  std::map<std::uint64_t, std::uint64_t> pending_records;  // record sequence -> stream id
  std::uint64_t next_record = 1;
  std::map<std::uint64_t, std::uint64_t> closed_gates;  // gate id -> stream id
  std::uint64_t next_gate = 1;
  std::uint64_t next_op = 1;
  std::vector<std::string> violations;

  // ---- helpers; all assume `mutex` is held ----

  static void free_storage(phys_block& block) {
    if (block.data != nullptr) ::munmap(block.data, block.bytes);
    block.data = nullptr;
  }

  void destroy_block(std::map<phys_handle, phys_block>::iterator it) {
    (it->second.where == memory_location::device ? live_device : live_host) -= it->second.bytes;
    free_storage(it->second);
    phys.erase(it);
  }

  void violation(std::string message) { violations.push_back("sim: " + std::move(message)); }

  [[nodiscard]] bool aligned(std::uint64_t value) const { return value % granularity == 0; }

  // The mapping that covers `va`, or mappings.end().
  std::map<device_ptr, mapping>::iterator mapping_at(device_ptr va) {
    auto it = mappings.upper_bound(va);
    if (it == mappings.begin()) return mappings.end();
    --it;
    return va < it->first + it->second.bytes ? it : mappings.end();
  }

  // Where the byte at `va` lives, or nullptr with the reason.
  std::byte* resolve(device_ptr va, bool need_access, fault& why) {
    auto it = mapping_at(va);
    if (it == mappings.end()) {
      why = fault::unmapped;
      return nullptr;
    }
    const std::size_t within = va - it->first;
    if (need_access && !it->second.access[within / granularity]) {
      why = fault::denied;
      return nullptr;
    }
    why = fault::none;
    return phys.at(it->second.handle).data + it->second.offset + within;
  }

  // Bytes from `va` to the end of its granule, at most `left`.
  [[nodiscard]] std::size_t piece(device_ptr va, std::size_t left) const {
    return std::min<std::size_t>(left, granularity - va % granularity);
  }

  // Performs one checked access of [va, va + bytes): writes `value`, or copies into/out of `host` when given.
  fault_tally touch(device_ptr va, std::size_t bytes, bool write, std::uint8_t value, std::byte* host_out,
                    const std::byte* host_in) {
    fault_tally tally;
    std::size_t done = 0;
    while (done < bytes) {
      const device_ptr at = va + done;
      const std::size_t n = piece(at, bytes - done);
      fault why = fault::none;
      std::byte* p = resolve(at, true, why);
      if (p == nullptr) {
        tally.add(why, at, n);
      } else if (host_in != nullptr) {
        std::memcpy(p, host_in + done, n);
      } else if (host_out != nullptr) {
        std::memcpy(host_out + done, p, n);
      } else if (write) {
        std::memset(p, value, n);
      }
      done += n;
    }
    return tally;
  }

  static bool touches(const op& o, device_ptr va, std::size_t bytes) {
    return std::any_of(o.ranges.begin(), o.ranges.end(),
                       [&](const sim_driver::access& r) { return overlaps(r.va, r.bytes, va, bytes); });
  }

  static std::string op_text(const op& o, std::uint64_t stream) {
    std::string what;
    switch (o.kind) {
      case op_kind::kernel:
        what = "kernel #" + std::to_string(o.number);
        break;
      case op_kind::copy:
        what = "copy #" + std::to_string(o.number);
        break;
      case op_kind::record:
        what = "record of event " + std::to_string(o.event) + " #" + std::to_string(o.number);
        break;
      case op_kind::wait:
        what = "wait for event " + std::to_string(o.event) + " #" + std::to_string(o.number);
        break;
      case op_kind::gate:
        what = "gate " + std::to_string(o.id) + " #" + std::to_string(o.number);
        break;
      case op_kind::value_wait:
        what = "wait for value " + std::to_string(o.id) + " at " + hex(o.ranges[0].va) + " #" + std::to_string(o.number);
        break;
      case op_kind::value_write:
        what = "write of value " + std::to_string(o.id) + " at " + hex(o.ranges[0].va) + " #" + std::to_string(o.number);
        break;
      case op_kind::digest:
        what = "digest #" + std::to_string(o.number);
        break;
    }
    return what + " on " + stream_text(stream);
  }

  static std::string ranges_text(const op& o, device_ptr va, std::size_t bytes) {
    std::string out;
    for (const sim_driver::access& r : o.ranges) {
      if (!overlaps(r.va, r.bytes, va, bytes)) continue;
      if (!out.empty()) out += ", ";
      out += (r.write ? "writes " : "reads ") + range_text(r.va, r.bytes);
    }
    return out;
  }

  // Describes the pending operations (on any stream but `except`) touching [va, va + bytes); "" when none.
  // Operations queued behind a value wait whose value has not been written are left out when `held_ok`: they
  // cannot start before some later write, and what they find then is checked when they run (Note [Held work]).
  std::string pending_touch_text(device_ptr va, std::size_t bytes, std::optional<std::uint64_t> except = {},
                                 bool held_ok = false) const {
    std::string first;
    std::size_t more = 0;
    for (const auto& [id, s] : streams) {
      if (except && *except == id) continue;
      for (const op& o : s.ops) {
        if (held_ok && o.kind == op_kind::value_wait && !value_reached(o.ranges[0].va, static_cast<std::uint32_t>(o.id))) {
          break;
        }
        if (!touches(o, va, bytes)) continue;
        if (first.empty()) {
          first = op_text(o, id) + " (pending, " + ranges_text(o, va, bytes) + ")";
        } else {
          ++more;
        }
      }
    }
    if (!first.empty() && more != 0) first += " and " + std::to_string(more) + " more pending operation(s)";
    return first;
  }

  // ---- streams ----

  static std::uint64_t stream_id_of(stream_handle handle) {
    if (handle == nullptr) return 0;
    const auto value = reinterpret_cast<std::uintptr_t>(handle);
    if (value <= k_stream_base || (value - k_stream_base) % 16 != 0) return ~std::uint64_t{0};
    return (value - k_stream_base) / 16;
  }
  static stream_handle stream_handle_of(std::uint64_t id) {
    return id == 0 ? nullptr : reinterpret_cast<stream_handle>(k_stream_base + id * 16);
  }

  stream_state& stream(stream_handle handle, const std::string& call, bool allow_destroyed = false) {
    auto it = streams.find(stream_id_of(handle));
    if (it == streams.end() || (it->second.destroyed && !allow_destroyed)) {
      fail(k_invalid_handle, call, "unknown or destroyed stream " + hex_ptr(handle));
    }
    return it->second;
  }

  event_state& event(event_handle handle, const std::string& call, std::uint64_t* id_out = nullptr) {
    const auto value = reinterpret_cast<std::uintptr_t>(handle);
    std::uint64_t id = 0;
    if (value > k_event_base && (value - k_event_base) % 16 == 0) id = (value - k_event_base) / 16;
    auto it = events.find(id);
    if (it == events.end()) fail(k_invalid_handle, call, "unknown or destroyed event " + hex_ptr(handle));
    if (id_out != nullptr) *id_out = id;
    return it->second;
  }

  void enqueue(stream_state& s, op o) {
    o.number = next_op++;
    s.ops.push_back(std::move(o));
    pump();
  }

  [[nodiscard]] bool can_run(const op& o) const {
    switch (o.kind) {
      case op_kind::wait:
        return o.id == 0 || !pending_records.contains(o.id);
      case op_kind::gate:
        return !closed_gates.contains(o.id);
      case op_kind::value_wait:
        return value_reached(o.ranges[0].va, static_cast<std::uint32_t>(o.id));
      default:
        return true;
    }
  }

  // The 32-bit word at `va` (a stream memory operation's): its value, or nothing when it cannot be read.
  // Where that word lives: nullptr unless all 4 bytes are mapped with access.
  std::byte* word_at(device_ptr va) {
    fault why = fault::none;
    std::byte* p = resolve(va, true, why);
    return p != nullptr && piece(va, 4) >= 4 ? p : nullptr;
  }
  [[nodiscard]] std::optional<std::uint32_t> word(device_ptr va) const {
    const std::byte* p = const_cast<impl*>(this)->word_at(va);
    if (p == nullptr) return std::nullopt;
    std::uint32_t v = 0;
    std::memcpy(&v, p, 4);
    return v;
  }
  [[nodiscard]] bool value_reached(device_ptr va, std::uint32_t value) const {
    const std::optional<std::uint32_t> v = word(va);
    return v && *v >= value;
  }

  void execute(const op& o, std::uint64_t stream) {
    switch (o.kind) {
      case op_kind::kernel:
        for (const sim_driver::access& r : o.ranges) {
          const fault_tally t = touch(r.va, r.bytes, r.write, r.value, nullptr, nullptr);
          if (t.any()) {
            violation(op_text(o, stream) + ": " + (r.write ? "write of " : "read of ") + range_text(r.va, r.bytes) +
                      " faulted: " + t.text());
          }
        }
        break;
      case op_kind::copy:
        execute_copy(o, stream);
        break;
      case op_kind::record:
        pending_records.erase(o.id);
        break;
      case op_kind::value_write: {
        std::byte* p = word_at(o.ranges[0].va);
        if (p == nullptr) {
          violation(op_text(o, stream) + " faulted: the word is not mapped with access");
        } else {
          const auto v = static_cast<std::uint32_t>(o.id);
          std::memcpy(p, &v, 4);
        }
        break;
      }
      case op_kind::digest:
        execute_digest(o, stream);
        break;
      case op_kind::wait:
      case op_kind::gate:
      case op_kind::value_wait:
        break;
    }
  }

  // The digest of runtime/digest.hpp of each range, over the bytes it holds when the operation runs.
  void execute_digest(const op& o, std::uint64_t stream) {
    ++digest_launches;
    for (std::size_t k = 0; k < o.ranges.size(); ++k) {
      const sim_driver::access& r = o.ranges[k];
      digest128 sums;
      fault_tally faults;
      for (std::size_t done = 0; done < r.bytes;) {
        const std::size_t n = piece(r.va + done, r.bytes - done);  // granules are multiples of 8 bytes
        fault why = fault::none;
        if (const std::byte* p = resolve(r.va + done, true, why)) {
          digest_add(sums, p, n / 8, done / 8);
        } else {
          faults.add(why, r.va + done, n);
        }
        done += n;
      }
      ++digests;
      if (faults.any()) {
        violation(op_text(o, stream) + ": read of " + range_text(r.va, r.bytes) + " faulted: " + faults.text());
        continue;  // the result is left as it was, as a faulting kernel would leave it
      }
      if (digest_drops_results) continue;
      const digest128 d = digest_finish(sums, r.bytes / 8);
      o.out[k][0] = d.a;
      o.out[k][1] = d.b;
    }
  }

  // Checks and enqueues one digest operation for `ranges` (digest_async: one range; `call` names the call).
  void enqueue_digest(const std::string& call, std::span<const digest_range> ranges, stream_handle stream, bool many) {
    stream_state& s = this->stream(stream, call);
    if (!digest_enabled) fail(k_not_supported, call, "this simulated device has no digest kernel (sim_options.digest)");
    op o{op_kind::digest, 0, {}, 0, 0};
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const digest_range& r = ranges[k];
      const std::string which = many ? "range " + std::to_string(k) + " " + range_text(r.va, r.bytes) + ": " : "";
      if (r.bytes % 16 != 0 || r.va % 16 != 0 || r.bytes == 0) {
        fail(k_invalid_value, call, which + "the range must be 16-byte aligned and non-empty");
      }
      if (r.out == nullptr) fail(k_invalid_value, call, which + "no result words");
      o.ranges.push_back(sim_driver::access{r.va, r.bytes, false, 0});
      o.out.push_back(r.out);
    }
    if (!o.ranges.empty()) enqueue(s, std::move(o));
  }

  void execute_copy(const op& o, std::uint64_t stream) {
    const device_ptr dst = o.ranges[0].va;
    const device_ptr src = o.ranges[1].va;
    const std::size_t bytes = o.ranges[0].bytes;
    fault_tally dst_faults;
    fault_tally src_faults;
    std::size_t done = 0;
    while (done < bytes) {
      const std::size_t n = std::min(piece(dst + done, bytes - done), piece(src + done, bytes - done));
      fault why_src = fault::none;
      fault why_dst = fault::none;
      const std::byte* from = resolve(src + done, true, why_src);
      std::byte* to = resolve(dst + done, true, why_dst);
      if (from == nullptr) src_faults.add(why_src, src + done, n);
      if (to == nullptr) dst_faults.add(why_dst, dst + done, n);
      if (from != nullptr && to != nullptr) std::memmove(to, from, n);
      done += n;
    }
    if (src_faults.any() || dst_faults.any()) {
      std::string message = op_text(o, stream) + " of " + format_bytes(bytes) + " from " + hex(src) + " to " +
                            hex(dst) + " faulted:";
      if (src_faults.any()) message += " source " + src_faults.text() + ";";
      if (dst_faults.any()) message += " destination " + dst_faults.text() + ";";
      message.pop_back();
      violation(std::move(message));
    }
  }

  // Executes the head of `s` when it can run.
  bool run_one(stream_state& s) {
    if (s.ops.empty() || !can_run(s.ops.front())) return false;
    const op o = std::move(s.ops.front());
    s.ops.pop_front();
    execute(o, s.id);
    return true;
  }

  // Drops destroyed streams that have drained. Invalidates stream references: call at the end of a public call.
  void reap() {
    std::erase_if(streams, [](const auto& entry) { return entry.second.destroyed && entry.second.ops.empty(); });
  }

  // Eager mode: runs every stream as far as it goes (Note [Simulated streams]).
  void pump() {
    if (!eager) return;
    for (bool progress = true; progress;) {
      progress = false;
      for (auto& [id, s] : streams) {
        while (run_one(s)) progress = true;
      }
    }
  }

  [[noreturn]] void deadlock(const std::string& call, const std::string& why) {
    violation(call + " would block forever: " + why);
    fail(k_illegal_state, call, "deadlock: " + why);
  }

  std::string blocked_text(const stream_state& s) const {
    const op& head = s.ops.front();
    if (head.kind == op_kind::gate) return stream_text(s.id) + " is stopped at closed gate " + std::to_string(head.id);
    if (head.kind == op_kind::value_wait) {
      return stream_text(s.id) + " waits for the value " + std::to_string(head.id) + " at " + hex(head.ranges[0].va) +
             ", which no pending operation writes";
    }
    std::string out = stream_text(s.id) + " waits for event " + std::to_string(head.event);
    auto it = pending_records.find(head.id);
    if (it != pending_records.end()) out += " (its record is pending on " + stream_text(it->second) + ")";
    return out;
  }

  // Runs what must run for record `sequence` to execute: its stream up to it, and first whatever that stream's
  // blocked head waits for (Note [Simulated streams]).
  void complete_record(std::uint64_t sequence, const std::string& call, int depth = 0) {
    while (pending_records.contains(sequence)) {
      stream_state& s = streams.at(pending_records.at(sequence));
      if (run_one(s)) continue;
      unblock(s, call, depth);
    }
  }

  // Runs what the blocked head of `s` waits for: an event's record (cannot recurse forever: Note [Deadlock]), or
  // a pending write of the value a value wait wants (value waits can form cycles, as on a GPU: depth-limited).
  void unblock(stream_state& s, const std::string& call, int depth) {
    const op& head = s.ops.front();
    if (head.kind == op_kind::wait) {
      complete_record(head.id, call, depth);
      return;
    }
    if (head.kind != op_kind::value_wait || depth > 64) deadlock(call, blocked_text(s));
    const device_ptr va = head.ranges[0].va;
    const auto value = static_cast<std::uint32_t>(head.id);
    while (!value_reached(va, value)) {
      stream_state* writer = nullptr;
      for (auto& [id, other] : streams) {
        for (const op& o : other.ops) {
          if (o.kind == op_kind::value_write && o.ranges[0].va == va && o.id >= value) writer = &other;
        }
        if (writer) break;
      }
      if (writer == nullptr || writer == &s) deadlock(call, blocked_text(s));
      if (run_one(*writer)) continue;
      unblock(*writer, call, depth + 1);
    }
  }

  void drain(stream_state& s, const std::string& call) {
    while (!s.ops.empty()) {
      if (run_one(s)) continue;
      unblock(s, call, 0);
    }
  }

  // ---- virtual address space ----

  // Lowest start in [from, limit) for `bytes` at `alignment` that overlaps no reservation.
  std::optional<device_ptr> find_gap(device_ptr from, device_ptr limit, std::size_t bytes, std::size_t alignment) const {
    device_ptr candidate = align_up(from, alignment);
    for (;;) {
      if (candidate < from || candidate >= limit || limit - candidate < bytes) return std::nullopt;
      auto next = reservations.upper_bound(candidate);
      if (next != reservations.begin()) {
        auto previous = std::prev(next);
        if (previous->first + previous->second > candidate) {
          candidate = align_up(previous->first + previous->second, alignment);
          continue;
        }
      }
      if (next != reservations.end() && next->first < candidate + bytes) {
        candidate = align_up(next->first + next->second, alignment);
        continue;
      }
      return candidate;
    }
  }

  // Checks [va, va + bytes) for map/unmap/set_access: granule aligned, non-empty, no overflow.
  void check_range(device_ptr va, std::size_t bytes, const std::string& call) const {
    if (bytes == 0 || !aligned(va) || !aligned(bytes) || va + bytes < va) {
      fail(k_invalid_value, call,
           "address and size must be non-zero multiples of the granularity (" + format_bytes(granularity) + ")");
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------

sim_driver::sim_driver(sim_options options) : impl_(std::make_unique<impl>(options)) {}
sim_driver::~sim_driver() = default;

int sim_driver::device() const noexcept { return impl_->device; }
std::uint64_t sim_driver::context_id() const noexcept { return reinterpret_cast<std::uint64_t>(impl_.get()); }
std::size_t sim_driver::granularity() { return impl_->granularity; }

std::size_t sim_driver::total_memory() {
  std::lock_guard lock(impl_->mutex);
  return impl_->total;
}

std::size_t sim_driver::free_memory() {
  std::lock_guard lock(impl_->mutex);
  return impl_->total > impl_->live_device ? impl_->total - impl_->live_device : 0;
}

device_ptr sim_driver::reserve(std::size_t bytes, std::size_t alignment) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "reserve(" + format_bytes(bytes) + ", alignment " + format_bytes(alignment) + ")";
  if (bytes == 0 || !m.aligned(bytes)) {
    fail(k_invalid_value, call, "size must be a non-zero multiple of the granularity (" + format_bytes(m.granularity) + ")");
  }
  if (alignment == 0) alignment = m.granularity;
  if (!std::has_single_bit(alignment) || !m.aligned(alignment)) {
    fail(k_invalid_value, call, "alignment must be 0 or a power-of-two multiple of the granularity");
  }
  std::optional<device_ptr> va = m.find_gap(m.va_cursor, k_va_limit, bytes, alignment);
  if (!va) va = m.find_gap(k_va_base, k_va_limit, bytes, alignment);
  if (!va) fail(k_out_of_memory, call, "the simulated virtual address space is exhausted");
  m.reservations.emplace(*va, bytes);
  m.va_cursor = *va + bytes;
  m.reserved += bytes;
  return *va;
}

void sim_driver::unreserve(device_ptr va, std::size_t bytes) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "unreserve(va=" + hex(va) + ", " + format_bytes(bytes) + ")";
  auto it = m.reservations.find(va);
  if (it == m.reservations.end() || it->second != bytes) {
    fail(k_invalid_value, call, "not a reservation: the range must be exactly one range returned by reserve()");
  }
  auto mapped = m.mappings.lower_bound(va);
  if (mapped != m.mappings.end() && mapped->first < va + bytes) {
    const std::string why = "still mapped at " + range_text(mapped->first, mapped->second.bytes) + ": unmap first";
    m.violation(call + ": " + why);
    fail(k_invalid_value, call, why);
  }
  if (std::string hit = m.pending_touch_text(va, bytes); !hit.empty()) {
    m.violation(call + " while " + hit + ": the range may be handed out again under work that uses it");
  }
  m.reservations.erase(it);
  m.reserved -= bytes;
}

phys_handle sim_driver::create(std::size_t bytes, memory_location where) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const bool on_device = where == memory_location::device;
  const std::string call = "create(" + format_bytes(bytes) + ", " +
                           (on_device ? "device " + std::to_string(m.device) : std::string("host")) + ")";
  if (bytes == 0 || !m.aligned(bytes)) {
    fail(k_invalid_value, call, "size must be a non-zero multiple of the granularity (" + format_bytes(m.granularity) + ")");
  }
  if (on_device && bytes > (m.total > m.live_device ? m.total - m.live_device : 0)) {
    throw device_out_of_memory(k_out_of_memory, "sim: " + call + " failed: " + error_text(k_out_of_memory) + ": " +
                                                    format_bytes(m.live_device) + " of " + format_bytes(m.total) +
                                                    " in use");
  }
  if (!on_device && m.host_limit != 0 && bytes > (m.host_limit > m.live_host ? m.host_limit - m.live_host : 0)) {
    throw device_out_of_memory(k_out_of_memory, "sim: " + call + " failed: " + error_text(k_out_of_memory) + ": " +
                                                    format_bytes(m.live_host) + " of the host limit " +
                                                    format_bytes(m.host_limit) + " in use");
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (data == MAP_FAILED) {
    throw device_out_of_memory(k_out_of_memory, "sim: " + call + " failed: " + error_text(k_out_of_memory) +
                                                    ": mmap of the backing host memory failed");
  }
  const phys_handle handle = m.next_handle++;
  m.phys.emplace(handle, phys_block{bytes, where, false, 0, static_cast<std::byte*>(data)});
  (on_device ? m.live_device : m.live_host) += bytes;
  ++m.creates;
  return handle;
}

void sim_driver::release(phys_handle handle) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "release(handle=" + hex(handle) + ")";
  auto it = m.phys.find(handle);
  if (it == m.phys.end() || it->second.released) fail(k_invalid_value, call, "unknown or already released handle");
  ++m.releases;
  if (it->second.mappings == 0) {
    m.destroy_block(it);
    return;
  }
  // Allowed, as in CUDA: the pages live until their last mapping goes. But pending work on them means the
  // caller has lost track of pages still in use (Note [Errors and violations]).
  it->second.released = true;
  for (const auto& [va, mp] : m.mappings) {
    if (mp.handle != handle) continue;
    if (std::string hit = m.pending_touch_text(va, mp.bytes); !hit.empty()) {
      m.violation(call + " of pages mapped at " + range_text(va, mp.bytes) + " while " + hit);
      break;
    }
  }
}

void sim_driver::map(device_ptr va, std::size_t bytes, phys_handle handle, std::size_t offset) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "map(va=" + hex(va) + ", " + format_bytes(bytes) + ", handle=" + hex(handle) +
                           ", offset=" + format_bytes(offset) + ")";
  m.check_range(va, bytes, call);
  // The real driver refuses any non-zero offset (CUDA_ERROR_NOT_SUPPORTED, measured on the H100).
  if (offset != 0) fail(801, call, "the offset must be zero (CUDA_ERROR_NOT_SUPPORTED on the real driver)");
  auto block = m.phys.find(handle);
  if (block == m.phys.end() || block->second.released) fail(k_invalid_value, call, "unknown or released handle");
  if (offset > block->second.bytes || bytes > block->second.bytes - offset) {
    fail(k_invalid_value, call, "offset + size exceed the allocation (" + format_bytes(block->second.bytes) + ")");
  }
  auto reservation = m.reservations.upper_bound(va);
  if (reservation == m.reservations.begin() ||
      std::prev(reservation)->first + std::prev(reservation)->second < va + bytes) {
    fail(k_invalid_value, call, "the range is not inside one reservation");
  }
  auto existing = m.mapping_at(va);
  if (existing == m.mappings.end()) existing = m.mappings.lower_bound(va);
  if (existing != m.mappings.end() && existing->first < va + bytes) {
    fail(k_invalid_value, call, "already mapped at " + range_text(existing->first, existing->second.bytes));
  }
  if (std::string hit = m.pending_touch_text(va, bytes, {}, /*held_ok=*/true); !hit.empty()) {
    m.violation(call + " while " + hit + ": pending work would see whichever mapping a real GPU happened to find");
  }
  m.mappings.emplace(va, mapping{bytes, handle, offset, std::vector<bool>(bytes / m.granularity, false)});
  ++block->second.mappings;
  ++m.maps;
}

void sim_driver::unmap(device_ptr va, std::size_t bytes) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "unmap(va=" + hex(va) + ", " + format_bytes(bytes) + ")";
  m.check_range(va, bytes, call);
  // CUDA unmaps whole mappings only: the range must be a run of complete map() records.
  for (device_ptr at = va; at < va + bytes;) {
    auto it = m.mappings.find(at);
    if (it == m.mappings.end()) {
      auto covering = m.mapping_at(at);
      if (covering == m.mappings.end()) fail(k_invalid_value, call, hex(at) + " is not mapped");
      fail(k_invalid_value, call,
           "the range cuts the mapping " + range_text(covering->first, covering->second.bytes) +
               " made by one map() call; unmap removes whole mappings only");
    }
    if (it->second.bytes > va + bytes - at) {
      fail(k_invalid_value, call,
           "the range cuts the mapping " + range_text(it->first, it->second.bytes) +
               " made by one map() call; unmap removes whole mappings only");
    }
    at += it->second.bytes;
    if (m.unmap_one_mapping && at < va + bytes) {
      fail(k_invalid_value, call, "this simulated device unmaps one mapping per call (sim_options.unmap_one_mapping)");
    }
  }
  if (std::string hit = m.pending_touch_text(va, bytes, {}, /*held_ok=*/true); !hit.empty()) {
    m.violation(call + " while " + hit + ": it would fault or read garbage on a GPU (DESIGN.md invariant 3)");
  }
  auto it = m.mappings.find(va);
  while (it != m.mappings.end() && it->first < va + bytes) {
    auto block = m.phys.find(it->second.handle);
    if (--block->second.mappings == 0 && block->second.released) m.destroy_block(block);
    it = m.mappings.erase(it);
  }
  ++m.unmaps;
}

void sim_driver::set_access(device_ptr va, std::size_t bytes) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "set_access(va=" + hex(va) + ", " + format_bytes(bytes) + ")";
  m.check_range(va, bytes, call);
  for (device_ptr at = va; at < va + bytes; at += m.granularity) {
    if (m.mapping_at(at) == m.mappings.end()) {
      fail(k_invalid_value, call, hex(at) + " is not mapped; set_access needs the whole range mapped");
    }
  }
  for (device_ptr at = va; at < va + bytes; at += m.granularity) {
    auto it = m.mapping_at(at);
    it->second.access[(at - it->first) / m.granularity] = true;
  }
}

stream_handle sim_driver::create_stream() {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::uint64_t id = m.next_stream++;
  m.streams.emplace(id, stream_state{id, {}, false});
  return impl::stream_handle_of(id);
}

void sim_driver::destroy_stream(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "destroy_stream(" + hex_ptr(stream) + ")";
  if (stream == nullptr) fail(k_invalid_handle, call, "the default stream cannot be destroyed");
  // As in CUDA, pending work still runs; the stream goes once it has drained.
  m.stream(stream, call).destroyed = true;
  m.pump();
  m.reap();
}

void sim_driver::synchronize(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "synchronize(" + hex_ptr(stream) + ")";
  stream_state& s = m.stream(stream, call);
  ++m.synchronizes;
  m.drain(s, call);
  m.pump();
  m.reap();
}

event_handle sim_driver::create_event() {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::uint64_t id = m.next_event++;
  m.events.emplace(id, event_state{});
  return reinterpret_cast<event_handle>(k_event_base + id * 16);
}

void sim_driver::destroy_event(event_handle event) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  std::uint64_t id = 0;
  (void)m.event(event, "destroy_event(" + hex_ptr(event) + ")", &id);
  m.events.erase(id);
}

void sim_driver::record(event_handle event, stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "record(event=" + hex_ptr(event) + ", stream=" + hex_ptr(stream) + ")";
  std::uint64_t id = 0;
  event_state& e = m.event(event, call, &id);
  stream_state& s = m.stream(stream, call);
  const std::uint64_t sequence = m.next_record++;
  e.last_record = sequence;
  m.pending_records.emplace(sequence, s.id);
  m.enqueue(s, op{op_kind::record, 0, {}, sequence, id});
}

bool sim_driver::query(event_handle event) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const event_state& e = m.event(event, "query(" + hex_ptr(event) + ")");
  return e.last_record == 0 || !m.pending_records.contains(e.last_record);
}

void sim_driver::wait(event_handle event) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "wait(" + hex_ptr(event) + ")";
  const std::uint64_t sequence = m.event(event, call).last_record;
  ++m.host_waits;
  m.complete_record(sequence, call);
  m.pump();
  m.reap();
}

void sim_driver::stream_wait(stream_handle stream, event_handle event) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "stream_wait(stream=" + hex_ptr(stream) + ", event=" + hex_ptr(event) + ")";
  std::uint64_t id = 0;
  const std::uint64_t sequence = m.event(event, call, &id).last_record;
  m.enqueue(m.stream(stream, call), op{op_kind::wait, 0, {}, sequence, id});
}

// Note [Held work]: a value wait or write, on a 4-byte-aligned word.
void sim_driver::enqueue_value_op(bool write, stream_handle stream, device_ptr addr, std::uint32_t value) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = std::string(write ? "stream_write_value" : "stream_wait_value") + "(stream=" +
                           hex_ptr(stream) + ", " + hex(addr) + ")";
  if (addr % 4 != 0) fail(k_invalid_value, call, "the address must be 4-byte aligned");
  m.enqueue(m.stream(stream, call), op{write ? op_kind::value_write : op_kind::value_wait, 0, {access{addr, 4, write, 0}},
                                       value, 0});
}

void sim_driver::stream_write_value(stream_handle stream, device_ptr addr, std::uint32_t value) {
  enqueue_value_op(true, stream, addr, value);
}

void sim_driver::stream_wait_value(stream_handle stream, device_ptr addr, std::uint32_t value) {
  enqueue_value_op(false, stream, addr, value);
}

bool sim_driver::can_digest() { return impl_->digest_enabled; }

void sim_driver::digest_async(device_ptr va, std::size_t bytes, std::uint64_t* out, stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const digest_range range{va, bytes, out};
  m.enqueue_digest("digest_async(" + range_text(va, bytes) + ", out=" + hex_ptr(out) + ")", {&range, 1}, stream, false);
}

void sim_driver::digest_many_async(std::span<const digest_range> ranges, stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  m.enqueue_digest("digest_many_async(" + std::to_string(ranges.size()) + " ranges, stream=" + hex_ptr(stream) + ")",
                   ranges, stream, true);
}

std::uint64_t* sim_driver::alloc_host_words(std::size_t n) { return new std::uint64_t[n == 0 ? 1 : n](); }

void sim_driver::free_host_words(std::uint64_t* words) { delete[] words; }

void sim_driver::copy_async(device_ptr dst, device_ptr src, std::size_t bytes, stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "copy_async(dst=" + hex(dst) + ", src=" + hex(src) + ", " + format_bytes(bytes) + ")";
  stream_state& s = m.stream(stream, call);
  if (bytes == 0) return;
  m.enqueue(s, op{op_kind::copy, 0, {access{dst, bytes, true, 0}, access{src, bytes, false, 0}}, 0, 0});
}

void sim_driver::copy_to_host(void* dst, device_ptr src, std::size_t bytes) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "copy_to_host(dst=" + hex_ptr(dst) + ", src=" + hex(src) + ", " + format_bytes(bytes) + ")";
  m.drain(m.streams.at(0), call);
  for (std::size_t done = 0; done < bytes;) {  // check first: a failing driver copy copies nothing
    const std::size_t n = m.piece(src + done, bytes - done);
    fault why = fault::none;
    if (m.resolve(src + done, true, why) == nullptr) {
      fail(k_invalid_value, call,
           hex(src + done) + (why == fault::unmapped ? " is not mapped" : " is mapped without access rights"));
    }
    done += n;
  }
  (void)m.touch(src, bytes, false, 0, static_cast<std::byte*>(dst), nullptr);
  m.pump();
  m.reap();
}

void sim_driver::copy_from_host(device_ptr dst, const void* src, std::size_t bytes) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const std::string call = "copy_from_host(dst=" + hex(dst) + ", src=" + hex_ptr(src) + ", " + format_bytes(bytes) + ")";
  m.drain(m.streams.at(0), call);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = m.piece(dst + done, bytes - done);
    fault why = fault::none;
    if (m.resolve(dst + done, true, why) == nullptr) {
      fail(k_invalid_value, call,
           hex(dst + done) + (why == fault::unmapped ? " is not mapped" : " is mapped without access rights"));
    }
    done += n;
  }
  (void)m.touch(dst, bytes, true, 0, nullptr, static_cast<const std::byte*>(src));
  m.pump();
  m.reap();
}

// ---- test side ----

void sim_driver::launch(stream_handle stream, std::span<const access> accesses) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  stream_state& s = m.stream(stream, "launch(stream=" + hex_ptr(stream) + ")");
  m.enqueue(s, op{op_kind::kernel, 0, std::vector<access>(accesses.begin(), accesses.end()), 0, 0});
}

void sim_driver::launch(stream_handle stream, std::initializer_list<access> accesses) {
  launch(stream, std::span<const access>(accesses.begin(), accesses.size()));
}

std::uint64_t sim_driver::launch_gate(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  stream_state& s = m.stream(stream, "launch_gate(stream=" + hex_ptr(stream) + ")");
  const std::uint64_t gate = m.next_gate++;
  m.closed_gates.emplace(gate, s.id);
  m.enqueue(s, op{op_kind::gate, 0, {}, gate, 0});
  return gate;
}

void sim_driver::open_gate(std::uint64_t gate) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (m.closed_gates.erase(gate) == 0) {
    fail(k_invalid_value, "open_gate(" + std::to_string(gate) + ")", "unknown or already open gate");
  }
  m.pump();
  m.reap();
}

bool sim_driver::run_one(stream_handle stream) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const bool ran = m.run_one(m.stream(stream, "run_one(" + hex_ptr(stream) + ")", true));
  m.pump();
  m.reap();
  return ran;
}

void sim_driver::run_all() {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  for (;;) {
    bool progress = false;
    bool left = false;
    for (auto& [id, s] : m.streams) {
      if (m.run_one(s)) progress = true;
      if (!s.ops.empty()) left = true;
    }
    if (!left) break;
    if (!progress) {
      std::string why;
      for (const auto& [id, s] : m.streams) {
        if (s.ops.empty()) continue;
        if (!why.empty()) why += "; ";
        why += m.blocked_text(s);
      }
      m.deadlock("run_all()", why);
    }
  }
  m.reap();
}

std::size_t sim_driver::pending(stream_handle stream) const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  auto it = m.streams.find(impl::stream_id_of(stream));
  if (it != m.streams.end()) return it->second.ops.size();
  if (impl::stream_id_of(stream) < m.next_stream) return 0;  // destroyed and drained
  fail(k_invalid_handle, "pending(" + hex_ptr(stream) + ")", "unknown stream");
}

bool sim_driver::pending_touches(device_ptr va, std::size_t bytes, stream_handle except_stream) const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  return !m.pending_touch_text(va, bytes, impl::stream_id_of(except_stream)).empty();
}

bool sim_driver::pending_touches(device_ptr va, std::size_t bytes) const {
  const impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  return !m.pending_touch_text(va, bytes).empty();
}

void sim_driver::host_write(device_ptr va, std::span<const std::byte> data) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const fault_tally t = m.touch(va, data.size(), true, 0, nullptr, data.data());
  if (t.any()) m.violation("host_write of " + range_text(va, data.size()) + " faulted: " + t.text());
}

void sim_driver::host_read(device_ptr va, std::span<std::byte> out) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const fault_tally t = m.touch(va, out.size(), false, 0, out.data(), nullptr);
  if (t.any()) m.violation("host_read of " + range_text(va, out.size()) + " faulted: " + t.text());
}

std::uint8_t sim_driver::byte_at(device_ptr va) {
  impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  fault why = fault::none;
  const std::byte* p = m.resolve(va, false, why);
  if (p == nullptr) fail(k_invalid_value, "byte_at(" + hex(va) + ")", "not mapped");
  return static_cast<std::uint8_t>(*p);
}

std::size_t sim_driver::live_device_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->live_device;
}
std::size_t sim_driver::live_host_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->live_host;
}
std::size_t sim_driver::num_creates() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->creates;
}
std::size_t sim_driver::num_releases() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->releases;
}
std::size_t sim_driver::num_maps() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->maps;
}
std::size_t sim_driver::num_unmaps() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->unmaps;
}
std::size_t sim_driver::num_digests() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->digests;
}
std::size_t sim_driver::num_digest_launches() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->digest_launches;
}

std::size_t sim_driver::num_host_waits() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->host_waits;
}
std::size_t sim_driver::num_synchronizes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->synchronizes;
}
std::size_t sim_driver::num_reserved_bytes() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->reserved;
}

void sim_driver::set_total_memory(std::size_t bytes) {
  std::lock_guard lock(impl_->mutex);
  impl_->total = bytes;
}

std::vector<std::string> sim_driver::violations() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->violations;
}

void sim_driver::clear_violations() {
  std::lock_guard lock(impl_->mutex);
  impl_->violations.clear();
}

}  // namespace layerswap
