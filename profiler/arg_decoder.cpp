// Argument decoding (arg_decoder.hpp). Everything here runs inside the CUPTI launch callback except
// kernel_family(): no allocation, no locks, no logging.
#include "profiler/arg_decoder.hpp"

#include <cstring>

namespace layerswap::profiler {

void region_set::add(region_id id) noexcept {
  // Neighbouring words usually point into the same region (a tensor and its strides, a pointer array of one
  // slab): the last id is checked first.
  if (count > 0 && ids[count - 1] == id) return;
  if (contains(id)) return;
  if (count == k_capacity) {
    truncated = true;
    return;
  }
  ids[count++] = id;
}

bool region_set::contains(region_id id) const noexcept {
  for (int i = 0; i < count; ++i) {
    if (ids[i] == id) return true;
  }
  return false;
}

void scan_words(const void* bytes, std::size_t size, region_lookup_fn lookup, region_set& out) noexcept {
  const auto* p = static_cast<const unsigned char*>(bytes);
  for (std::size_t offset = 0; offset + 8 <= size; offset += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + offset, 8);
    ++out.words;
    // Cheap rejection of what cannot be a device address: small integers, floats near 0, -1.
    if (word < (std::uint64_t{1} << 32) || word >= (std::uint64_t{1} << 57)) continue;
    if (const region_id id = lookup(word)) out.add(id);
  }
}

void decode_params(const param_layout& layout, const void* const* args, region_lookup_fn lookup,
                   region_set& out) noexcept {
  if (args == nullptr) return;
  for (std::uint32_t i = 0; i < layout.count; ++i) {
    const void* arg = args[i];
    if (arg == nullptr) continue;
    scan_words(arg, layout.params[i].size, lookup, out);
  }
}

extra_buffer parse_extra(const void* const* extra) noexcept {
  extra_buffer out;
  if (extra == nullptr) return out;
  const void* data = nullptr;
  const std::size_t* size = nullptr;
  for (int i = 0; i < 32; ++i) {
    const auto key = reinterpret_cast<std::uintptr_t>(extra[2 * i]);
    if (key == k_launch_param_end) break;
    const void* value = extra[2 * i + 1];
    if (key == k_launch_param_buffer_pointer) {
      data = value;
    } else if (key == k_launch_param_buffer_size) {
      size = static_cast<const std::size_t*>(value);
    }
  }
  if (data != nullptr && size != nullptr) {
    out.data = data;
    out.size = *size;
  }
  return out;
}

namespace {

bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

// The last source name of an Itanium-mangled function name ("_Z..." ), or "" if it cannot be read.
std::string_view mangled_family(std::string_view name) noexcept {
  std::size_t i = 2;  // after "_Z"
  const bool nested = i < name.size() && name[i] == 'N';
  if (nested) {
    ++i;
    while (i < name.size() && (name[i] == 'K' || name[i] == 'V' || name[i] == 'r')) ++i;  // cv-qualifiers
  }
  std::string_view last;
  while (i < name.size()) {
    if (name[i] == 'S' && i + 1 < name.size() && name[i + 1] == 't') {  // St: ::std::
      i += 2;
      continue;
    }
    if (name[i] == 'L') ++i;  // internal linkage
    if (i >= name.size() || !is_digit(name[i])) break;
    std::size_t length = 0;
    while (i < name.size() && is_digit(name[i])) {
      length = length * 10 + static_cast<std::size_t>(name[i] - '0');
      if (length > 4096) return {};
      ++i;
    }
    if (length == 0) break;
    last = name.substr(i, length);  // may be cut short in a truncated name
    i += length;
    if (!nested) break;
  }
  return last;
}

// "void at::native::(anonymous namespace)::foo<float>(int, float*)" -> "foo".
std::string_view demangled_family(std::string_view name) noexcept {
  constexpr std::string_view k_anonymous = "(anonymous namespace)";
  std::size_t end = 0;
  for (;; ++end) {
    end = name.find_first_of("<(", end);
    if (end == std::string_view::npos || name.substr(end, k_anonymous.size()) != k_anonymous) break;
  }
  if (end == std::string_view::npos) end = name.size();
  std::string_view head = name.substr(0, end);
  if (const auto space = head.rfind(' '); space != std::string_view::npos) head = head.substr(space + 1);
  if (const auto colon = head.rfind("::"); colon != std::string_view::npos) head = head.substr(colon + 2);
  return head;
}

}  // namespace

std::string_view kernel_family(std::string_view name) noexcept {
  if (name.size() > 2 && name[0] == '_' && name[1] == 'Z') {
    const std::string_view f = mangled_family(name);
    if (!f.empty()) return f;
    return name.substr(0, 32);
  }
  if (name.find_first_of("<(:") != std::string_view::npos) {
    const std::string_view f = demangled_family(name);
    if (!f.empty()) return f;
  }
  // Plain C names: the first two tokens.
  const std::size_t first = name.find('_', 1);
  if (first == std::string_view::npos) return name;
  const std::size_t second = name.find('_', first + 1);
  return second == std::string_view::npos ? name : name.substr(0, second);
}

}  // namespace layerswap::profiler
