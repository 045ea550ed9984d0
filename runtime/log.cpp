// Logging: one line "layerswap: <message>\n" (warnings: "layerswap: warning: <message>\n") formatted into a
// fixed stack buffer and written to stderr with one write(2), so lines from several threads do not
// interleave, nothing is allocated, and it works before the C++ runtime is up (LD_PRELOAD) or after
// iostreams are gone (exit). Messages longer than the buffer are cut and end in "...". errno is preserved.
#include "runtime/log.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace layerswap::detail {

// Constant-initialized: valid before any constructor runs.
constinit std::atomic<int> g_log_level{static_cast<int>(log_level::warn)};

void log_write(log_level level, const char* format, ...) noexcept {
  const int saved_errno = errno;
  char line[1024];
  const char* prefix = level == log_level::warn ? "layerswap: warning: " : "layerswap: ";
  const std::size_t prefix_length = std::strlen(prefix);
  std::memcpy(line, prefix, prefix_length);

  // Room for the message and its terminating NUL, keeping one byte for the newline.
  const std::size_t room = sizeof line - prefix_length - 1;
  va_list args;
  va_start(args, format);
  const int wanted = std::vsnprintf(line + prefix_length, room, format, args);
  va_end(args);

  std::size_t length = prefix_length;
  if (wanted > 0) {
    const auto message_length = static_cast<std::size_t>(wanted);
    if (message_length < room) {
      length += message_length;
    } else {
      length += room - 1;
      std::memcpy(line + length - 3, "...", 3);
    }
  }
  if (length > prefix_length && line[length - 1] == '\n') --length;  // the caller's newline: we add one
  line[length++] = '\n';

  const char* data = line;
  while (length > 0) {
    const ssize_t written = ::write(STDERR_FILENO, data, length);
    if (written < 0) {
      if (errno == EINTR) continue;
      break;
    }
    data += written;
    length -= static_cast<std::size_t>(written);
  }
  errno = saved_errno;
}

}  // namespace layerswap::detail
