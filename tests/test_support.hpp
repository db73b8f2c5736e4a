// Helpers several test files share: a gate a thread (or an emulated stream) blocks on until
// the test opens it, a bounded poll, a clock the test sets by hand, and a temporary
// directory. Every wait is
// bounded (10 s by default) so a broken implementation fails its test instead of hanging.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <system_error>
#include <stdlib.h>
#include <cstdint>
#include <mutex>
#include <thread>

namespace kvfuse::testing {

/// Waits (polling every millisecond) until `pred` holds or `bound` passes; returns pred().
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds bound = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// A one-shot gate. `pass()` marks `entered` and sleeps until the test calls `open()`
/// (or 10 s pass: then it returns false). `host_func` is the same as a HostRuntime host
/// function, so an emulated stream can be held at a known point.
class Gate {
 public:
  std::atomic<bool> entered{false};

  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    cv_.notify_all();
  }
  [[nodiscard]] bool is_open() {
    std::lock_guard lock(mutex_);
    return open_;
  }
  bool pass() {
    entered.store(true);
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return open_; });
  }
  static void host_func(void* gate) noexcept { (void)static_cast<Gate*>(gate)->pass(); }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;
};

/// A clock the test sets by hand (the index's clock is a policy, R8). `Tag` keeps the
/// `current` of two test files apart.
template <class Tag>
struct ManualClock {
  using rep = std::int64_t;
  using period = std::nano;
  using duration = std::chrono::nanoseconds;
  using time_point = std::chrono::time_point<ManualClock>;
  static inline time_point current{};
  static time_point now() noexcept { return current; }
};

/// A fresh directory (mkdtemp, named after `prefix`), removed with everything in it at the
/// end of the scope. Tests that write real files (DiskTier) get one each.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const char* prefix = "kvfuse") {
    std::string templ = (std::filesystem::temp_directory_path() / (std::string(prefix) + "-XXXXXX")).string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::filesystem::filesystem_error("mkdtemp", std::error_code(errno, std::generic_category()));
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

/// Writes `bytes` to `path`, replacing what was there; true when every byte was written.
inline bool write_bytes(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return out.good();
}

/// The regular files directly in `dir` (not in its subfolders).
inline std::size_t regular_files_in(const std::filesystem::path& dir) {
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.is_regular_file()) ++n;
  return n;
}

}  // namespace kvfuse::testing
