// Escaping text for messages and JSON: one loop, two spellings of a control byte.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace layerswap {

// Appends `text` to `out` with '"' and '\\' backslash-escaped and control bytes (< 0x20, 0x7f) written through
// `control_format` (a printf format taking the byte: "\\x%02x" in messages, "\\u%04x" in JSON).
inline void append_escaped(std::string& out, std::string_view text, const char* control_format) {
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, control_format, u);
      out += hex;
    } else {
      out += c;
    }
  }
}

}  // namespace layerswap
