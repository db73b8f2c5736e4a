// kvfuse/detail/unique_fd.hpp — an owning file descriptor: DiskTier's files and directories,
// the pidfds that ranks as processes hold on each other.
//
// Owning it from the moment it is opened is what keeps a constructor that throws half way
// (a refused attach, a directory that fails validation) from leaking the descriptor: no
// destructor of the object under construction runs, but its members' do.
//
// Internal: not part of the public API. One owner at a time; any thread.
#pragma once

#include <unistd.h>

#include <utility>

namespace kvfuse::detail {

/// Owns a file descriptor and closes it on destruction. Move-only. One owner at a time;
/// any thread.
class UniqueFd {
 public:
  /// Owns nothing.
  UniqueFd() noexcept = default;
  /// Owns `fd` (may be negative: then it owns nothing and valid() is false).
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  /// The descriptor, or -1.
  [[nodiscard]] int get() const noexcept { return fd_; }
  /// Whether it owns a descriptor.
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  /// Closes now; false if close reported an error (a delayed write error on some filesystems).
  bool reset() noexcept {
    if (fd_ < 0) return true;
    return ::close(std::exchange(fd_, -1)) == 0;
  }

 private:
  int fd_ = -1;
};

}  // namespace kvfuse::detail
