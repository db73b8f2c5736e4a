// kvfuse/tier/detail/posix_file.hpp — the POSIX file plumbing under DiskTier: whole reads and writes that retry short transfers and EINTR, and the
// write-to-a-temporary-then-rename that makes a put atomic.
//
// Everything works on descriptors (a directory descriptor plus a name, the *at calls), so
// a caller builds names on the stack and nothing here allocates. Internal: not part of the
// public API. Any thread; every function is noexcept and reports failure by its result
// with errno set by the failing call.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <kvfuse/detail/unique_fd.hpp>

namespace kvfuse::detail::posix {

/// The owning descriptor every function here works with.
using kvfuse::detail::UniqueFd;

/// Reads up to `n` bytes at `offset`, retrying short reads; the count read (short only at
/// end of file), or -1 on an I/O error. Any thread; noexcept.
inline long long read_at(int fd, std::byte* out, std::size_t n, std::uint64_t offset) noexcept {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return static_cast<long long>(done);
}

/// Writes all `n` bytes, retrying short writes. False on an I/O error. Any thread; noexcept.
inline bool write_all(int fd, const std::byte* in, std::size_t n) noexcept {
  while (n != 0) {
    const ssize_t put = ::write(fd, in, n);
    if (put < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    in += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

/// Publishes a file atomically: creates `temp` in directory `dir` (failing if it exists),
/// writes `parts` in order, fsyncs it when `sync`, closes it, and renames it over `name` in
/// the same directory, so a reader of `name` sees the old file or the new one, whole. On a
/// failure after `temp` was created it is unlinked again. Syncing the directory (to make
/// the rename itself durable) is the caller's choice. Any thread; noexcept; no allocation.
inline bool publish_file(int dir, const char* temp, const char* name, std::span<const std::span<const std::byte>> parts,
                         bool sync) noexcept {
  UniqueFd fd(::openat(dir, temp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!fd.valid()) return false;
  bool ok = true;
  for (const auto& part : parts) ok = ok && write_all(fd.get(), part.data(), part.size());
  if (ok && sync) ok = ::fsync(fd.get()) == 0;
  ok = fd.reset() && ok;
  if (ok) ok = ::renameat(dir, temp, dir, name) == 0;
  if (!ok) ::unlinkat(dir, temp, 0);
  return ok;
}

}  // namespace kvfuse::detail::posix
