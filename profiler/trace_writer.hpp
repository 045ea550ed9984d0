// LAYERSWAP_TRACE: a Chrome / Perfetto JSON trace of the launches the tracker saw, one complete event ("X")
// per launch on a track per stream, with the launch number and the regions it touched in its args. Written
// incrementally by the tracker's consumer thread (never by the launching thread), bounded to max_events
// (later launches are counted, not written), and closed at tracker stop or process exit. A trace cut short
// by a crash lacks the closing "]}"; Perfetto and chrome://tracing still load it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>

#include "profiler/access_event.hpp"

namespace layerswap::profiler {

class trace_writer {
 public:
  trace_writer() = default;
  ~trace_writer() { close(); }
  trace_writer(const trace_writer&) = delete;
  trace_writer& operator=(const trace_writer&) = delete;

  // Opens `path` for writing; false (and nothing written later) when it cannot be created.
  bool open(const std::string& path, std::uint64_t max_events);
  // Takes an already open stream (tests); the writer closes it.
  void open(std::FILE* file, std::uint64_t max_events);
  [[nodiscard]] bool is_open() const noexcept { return file_ != nullptr; }

  // One event; `name` is the kernel's name (or "memcpy", ...), `origin_ns` the tracker's start time.
  void write(const access_event& event, std::string_view name, std::uint64_t origin_ns);
  // Writes the closing part and closes the file. Idempotent.
  void close();

  [[nodiscard]] std::uint64_t written() const noexcept { return written_; }
  [[nodiscard]] std::uint64_t skipped() const noexcept { return skipped_; }

 private:
  std::FILE* file_ = nullptr;
  std::uint64_t max_events_ = 0;
  std::uint64_t written_ = 0;
  std::uint64_t skipped_ = 0;
};

// `text` as the inside of a JSON string.
void append_json_escaped(std::string& out, std::string_view text);

}  // namespace layerswap::profiler
