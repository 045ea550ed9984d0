// The trace file (trace_writer.hpp).
#include "profiler/trace_writer.hpp"

#include <cinttypes>

#include "runtime/text.hpp"

namespace layerswap::profiler {

void append_json_escaped(std::string& out, std::string_view text) { append_escaped(out, text, "\\u%04x"); }

bool trace_writer::open(const std::string& path, std::uint64_t max_events) {
  close();
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  open(f, max_events);
  return true;
}

void trace_writer::open(std::FILE* file, std::uint64_t max_events) {
  close();
  file_ = file;
  max_events_ = max_events;
  written_ = 0;
  skipped_ = 0;
  std::fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", file_);
}

void trace_writer::write(const access_event& event, std::string_view name, std::uint64_t origin_ns) {
  if (file_ == nullptr) return;
  if (written_ >= max_events_) {
    ++skipped_;
    return;
  }
  std::string line;
  line.reserve(160 + name.size() + event.nregions * 11u);
  if (written_ > 0) line += ",\n";
  line += "{\"name\":\"";
  append_json_escaped(line, name);
  static constexpr const char* k_categories[] = {"kernel", "memcpy", "memset", "graph"};
  char head[256];
  const std::uint64_t ns = event.time_ns >= origin_ns ? event.time_ns - origin_ns : 0;
  std::snprintf(head, sizeof head,
                "\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%" PRIu64 ".%03u,\"dur\":1,\"pid\":1,\"tid\":\"stream 0x%" PRIx64
                "\",\"args\":{\"launch\":%" PRIu64 ",%s\"regions\":[",
                k_categories[static_cast<int>(event.kind) & 3], ns / 1000, static_cast<unsigned>(ns % 1000),
                event.stream, event.launch_no, (event.flags & k_flag_continued) ? "\"continued\":true," : "");
  line += head;
  for (int i = 0; i < event.nregions; ++i) {
    if (i) line += ',';
    line += std::to_string(event.regions[i]);
  }
  line += "]}}";
  std::fwrite(line.data(), 1, line.size(), file_);
  ++written_;
}

void trace_writer::close() {
  if (file_ == nullptr) return;
  std::fprintf(file_, "\n],\"otherData\":{\"events_written\":%" PRIu64 ",\"events_not_written\":%" PRIu64 "}}\n",
               written_, skipped_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace layerswap::profiler
