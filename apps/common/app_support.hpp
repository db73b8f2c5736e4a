// kvfuse's applications (kvfuse-replay, kvfuse-llama): the small pieces every report,
// output file and run directory needs, written once.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace kvfuse_apps {

/// `v` with a comma between each group of three digits ("1,234,567"), as the reports print
/// counts. Any thread.
inline std::string thousands(std::uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

/// `v` printed with `decimals` digits after the point. Any thread.
inline std::string fixed(double v, int decimals) {
  char b[48];
  std::snprintf(b, sizeof b, "%.*f", decimals, v);
  return b;
}

/// Writes `text` to `path` whole or not at all: a temporary name, then a rename, so a reader
/// never sees half a report. Throws std::runtime_error or std::filesystem::filesystem_error
/// naming the path when it cannot.
inline void write_whole(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) throw std::runtime_error("cannot write \"" + path + "\"");
  }
  std::filesystem::rename(tmp, path);
}

/// A run's temporary directory `parent/NAME-PID`, made empty at construction and removed
/// however the run ends (an exception included). Throws std::filesystem::filesystem_error
/// when it cannot be made.
struct TempRoot {
  std::filesystem::path path;
  TempRoot(const std::filesystem::path& parent, const std::string& name)
      : path(parent / (name + "-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempRoot(const TempRoot&) = delete;
  TempRoot& operator=(const TempRoot&) = delete;
  ~TempRoot() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace kvfuse_apps
