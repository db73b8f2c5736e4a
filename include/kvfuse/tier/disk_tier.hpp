// kvfuse/tier/disk_tier.hpp — DiskTier: one file per entry, validated on open and on read (R18).
//
// The bytes on disk (entry header, file names) are specified in tier/disk_format.hpp; the
// POSIX plumbing (descriptors, whole reads and writes, publish by rename) is in
// tier/detail/posix_file.hpp. This header is the tier: the catalogue, the restart scan,
// quarantine, and the counters.
//
// A file whose header key disagrees with its name is never served: a slice cut for another
// rank, model or world size cannot be read back under this key.
//
// Restart: the constructor scans the directory and rebuilds the catalogue from the headers.
// Files that fail validation (bad magic or version, header checksum, truncated or trailing
// bytes, payload checksum, key/name mismatch, a name that is not an entry name) are moved to
// `quarantine/` and counted, never served. Leftover `.tmp-*` files (a put interrupted by a
// crash) are deleted: they were never published.
//
// Capacity: with DiskTierOptions::capacity_bytes a put that would go over it evicts the least
// recently used entries (their files are deleted). Recency is kept where a restart finds it:
// a hit sets the file's modification time, and the opening scan orders the catalogue by those
// times, so a restart keeps both the budget and the order.
//
// Locking: one mutex guards the catalogue; it is never held across file I/O. Counters are
// atomics. Reads and writes use POSIX calls on a directory descriptor opened once, so a get
// builds its file name on the stack and never allocates.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/detail/posix_file.hpp>
#include <kvfuse/tier/disk_format.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// How a DiskTier trades speed for durability.
struct DiskTierOptions {
  /// fsync each file before its rename and the directory after it, so a put that returned
  /// true survives a power loss. Off by default: the rename alone already makes a put
  /// atomic against a process crash (the page cache survives it), and a file torn by a
  /// power loss fails its checksum and is quarantined on the next open, never served — a
  /// cache may lose entries, it must not serve wrong ones. Turn it on when the entries are
  /// expensive to recompute.
  bool durable = false;
  /// The opening scan checks every payload checksum (reads every byte). With false it
  /// checks headers and lengths only and leaves payload corruption to be caught (and
  /// quarantined) by the get that reads it: faster restarts over very large directories.
  bool verify_payloads_on_open = true;
  /// The most payload bytes the tier keeps. A put that would go over it evicts the least
  /// recently used entries (by their last put or hit) until it fits; a put larger than the
  /// whole capacity fails (counted) and writes nothing. An opening scan that finds more than
  /// this (the capacity was lowered) evicts the oldest down to it. Unset: no limit, nothing
  /// is evicted. 0 is refused at construction: Error(invalid_argument) naming it.
  std::optional<std::uint64_t> capacity_bytes{};
};

/// Counters of a DiskTier. `entries` and `bytes` describe the catalogue now; the rest
/// count events since this object was constructed (the opening scan included).
struct DiskTierStats {
  std::size_t entries = 0;
  std::uint64_t bytes = 0;          ///< payload bytes of the entries in the catalogue; <= capacity
  std::uint64_t capacity = 0;       ///< DiskTierOptions::capacity_bytes (0: no limit)
  std::uint64_t evictions = 0;      ///< entries deleted to keep within the capacity (not erases)
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t get_failures = 0;   ///< gets that returned failed (too big for staging, I/O, corrupt)
  std::uint64_t quarantined = 0;    ///< files moved to quarantine/ (at open or at read time)
  std::uint64_t puts = 0;           ///< successful puts
  std::uint64_t put_failures = 0;   ///< I/O failed (a full disk), larger than the capacity, no file name
  std::uint64_t io_errors = 0;      ///< failed system calls (open, read, write, rename, ...)
};

/// A tier of one file per entry in one directory, durable across restarts (R18).
///
/// A put writes header and payload to a temporary name in the same directory and renames
/// it over the entry's name, so a reader sees the old file or the new one, never a mix. A
/// get reads into the caller's staging buffer and returns a view of it; it re-checks the
/// header (key included) and the payload checksum on every read, and quarantines a file
/// that fails. One DiskTier object should own a directory at a time (it deletes leftover
/// temporary files when it opens); ranks share one object, or use one directory each.
///
/// Thread-safe: every member may be called from any thread at once; the catalogue lock is
/// never held across file I/O. Not copyable or movable.
class DiskTier {
 public:
  /// Opens (creating if missing) `directory`, makes `quarantine/` in it, and rebuilds the
  /// catalogue by scanning it. Throws Error(io_failure) naming the path when the directory
  /// cannot be created, opened or written, and Error(invalid_argument) for a capacity of 0.
  explicit DiskTier(std::filesystem::path directory, DiskTierOptions options = {})
      : directory_(std::move(directory)), options_(options) {
    namespace fs = std::filesystem;
    if (options_.capacity_bytes && *options_.capacity_bytes == 0)
      throw Error(ErrorCode::invalid_argument,
                  "DiskTier capacity_bytes must be > 0, got 0 (directory '" + directory_.string() + "')");
    std::error_code ec;
    fs::create_directories(directory_, ec);
    if (ec) fail_open("cannot be created", ec);
    if (!fs::is_directory(directory_, ec)) fail_open("is not a directory", ec);
    dir_ = detail::posix::UniqueFd(::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!dir_.valid()) fail_open("cannot be opened", errno_code());
    if (::faccessat(dir_.get(), ".", W_OK, 0) != 0) fail_open("is not writable", errno_code());
    const std::string quarantine(detail::disk::quarantine_dir);
    if (::mkdirat(dir_.get(), quarantine.c_str(), 0755) != 0 && errno != EEXIST)
      fail_open("cannot hold a quarantine/ subdirectory", errno_code());
    quarantine_ = detail::posix::UniqueFd(::openat(dir_.get(), quarantine.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!quarantine_.valid()) fail_open("has a quarantine entry that is not a usable directory", errno_code());
    // Distinguishes this object's temporary and quarantine names from any other's.
    nonce_ = mix64(static_cast<std::uint64_t>(::getpid()) ^
                           static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                           reinterpret_cast<std::uintptr_t>(this));
    scan();
  }

  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// Reads the entry for `key` into `staging` and returns a view of the bytes read.
  /// `miss` if the catalogue does not have it (or its file vanished); `failed` if it is
  /// larger than `staging`, an I/O call fails, or the file fails validation (then it is
  /// quarantined and later gets miss). Any thread; noexcept; never allocates; blocks on
  /// file I/O with no lock held (the catalogue lock is taken only for the O(1) lookup).
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    if (!contains(key)) return counted_miss();
    char name[64];
    detail::disk::format_name(key, name);
    detail::posix::UniqueFd fd(::openat(dir_.get(), name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd.valid()) {
      if (errno == ENOENT) {  // erased (or replaced and erased) since the lookup
        forget(key);
        return counted_miss();
      }
      return counted_failure(true);
    }
    detail::disk::Header header;
    switch (read_header(fd.get(), key, header)) {
      case Check::ok: break;
      case Check::io_error: return counted_failure(true);
      case Check::corrupt: quarantine_open_file(fd.get(), name, key); return counted_failure(false);
    }
    if (header.payload_bytes > staging.size()) return counted_failure(false);
    const auto n = static_cast<std::size_t>(header.payload_bytes);
    const long long got = detail::posix::read_at(fd.get(), staging.data(), n, detail::disk::header_bytes);
    if (got < 0) return counted_failure(true);
    const auto payload = std::span<const std::byte>(staging.data(), n);
    if (static_cast<std::size_t>(got) != n ||
        detail::disk::entry_checksum(header.version, payload) != header.payload_checksum) {
      quarantine_open_file(fd.get(), name, key);
      return counted_failure(false);
    }
    if (options_.capacity_bytes) {
      // The restart's recency order; a failure only makes this entry look older.
      const auto times = stamp();
      if (::futimens(fd.get(), times.data()) != 0) io_errors_.fetch_add(1, std::memory_order_relaxed);
      touch(key);
    }
    hits_.fetch_add(1, std::memory_order_relaxed);
    return TierView(payload);
  }

  /// Writes `bytes` as the entry for `key`, atomically replacing any previous one, and
  /// evicts least recently used entries to stay within the capacity. False (counted) on an
  /// I/O error (a full disk: the temporary file is removed, the previous entry stays), an
  /// entry larger than the capacity, or a key kind that has no file name. Any thread;
  /// noexcept. Concurrent puts of one key leave one of them, whole. Blocks on file I/O with
  /// no lock held; allocates only when the key is new to the catalogue (its nodes).
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    char name[64];
    if (!detail::disk::format_name(key, name)) return counted_put_failure(false);
    if (options_.capacity_bytes && bytes.size() > *options_.capacity_bytes) return counted_put_failure(false);
    const detail::disk::HeaderBytes header = detail::disk::encode_entry_header(key, bytes);

    char temp[96];
    detail::disk::format_temp_name(name, unique(), temp);
    const std::span<const std::byte> parts[] = {header, bytes};
    if (!detail::posix::publish_file(dir_.get(), temp, name, parts, options_.durable)) return counted_put_failure(true);
    if (options_.durable && ::fsync(dir_.get()) != 0) io_errors_.fetch_add(1, std::memory_order_relaxed);
    if (options_.capacity_bytes) {  // the file's own time is coarse (a clock tick): stamp it finely
      const auto times = stamp();
      // ENOENT: an erase or an eviction took the file since the rename; nothing to order.
      if (::utimensat(dir_.get(), name, times.data(), AT_SYMLINK_NOFOLLOW) != 0 && errno != ENOENT)
        io_errors_.fetch_add(1, std::memory_order_relaxed);
    }
    {
      std::lock_guard lock(mutex_);
      try {
        remember(key, bytes.size());
      } catch (...) {  // bad_alloc: the file is whole on disk and the next open adopts it
        put_failures_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    }
    puts_.fetch_add(1, std::memory_order_relaxed);
    evict_to_capacity();
    return true;
  }

  /// Whether the catalogue has `key`. Any thread; noexcept; O(1); no I/O.
  bool contains(const TierKey& key) const noexcept {
    std::lock_guard lock(mutex_);
    return catalogue_.contains(key);
  }

  /// Removes `key` from the catalogue and deletes its file. True if it was in the
  /// catalogue. Any thread; noexcept.
  bool erase(const TierKey& key) noexcept {
    if (!forget(key)) return false;
    delete_file(key);
    return true;
  }

  /// The keys of `kind` in the catalogue, in no particular order: how an engine re-seeds
  /// its index from the state entries that survived a restart (R18). Any thread;
  /// allocates (not for a hot path); throws only std::bad_alloc.
  std::vector<TierKey> keys(EntryKind kind) const {
    std::vector<TierKey> out;
    std::lock_guard lock(mutex_);
    out.reserve(catalogue_.size());
    for (const auto& [key, entry] : catalogue_)
      if (key.kind == kind) out.push_back(key);
    return out;
  }

  /// A snapshot of the counters. Any thread; noexcept; O(1).
  DiskTierStats stats() const noexcept {
    DiskTierStats s;
    {
      std::lock_guard lock(mutex_);
      s.entries = catalogue_.size();
      s.bytes = bytes_;
    }
    s.capacity = options_.capacity_bytes.value_or(0);
    s.evictions = evictions_.load(std::memory_order_relaxed);
    s.hits = hits_.load(std::memory_order_relaxed);
    s.misses = misses_.load(std::memory_order_relaxed);
    s.get_failures = get_failures_.load(std::memory_order_relaxed);
    s.quarantined = quarantined_.load(std::memory_order_relaxed);
    s.puts = puts_.load(std::memory_order_relaxed);
    s.put_failures = put_failures_.load(std::memory_order_relaxed);
    s.io_errors = io_errors_.load(std::memory_order_relaxed);
    return s;
  }

  /// The directory given at construction. Any thread; noexcept.
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return directory_; }

  /// The file name an entry for `key` has ("" for a kind without one; see disk_format.hpp).
  /// For operators and tests. Any thread; allocates.
  [[nodiscard]] static std::string file_name(const TierKey& key) {
    char name[64];
    return detail::disk::format_name(key, name) ? std::string(name) : std::string();
  }

  /// Where the entry for `key` lives (whether or not it exists). Any thread; allocates.
  [[nodiscard]] std::filesystem::path path_of(const TierKey& key) const { return directory_ / file_name(key); }

 private:
  enum class Check { ok, corrupt, io_error };

  static std::error_code errno_code() noexcept { return {errno, std::generic_category()}; }

  [[noreturn]] void fail_open(const char* what, const std::error_code& ec) const {
    throw Error(ErrorCode::io_failure, "DiskTier directory '" + directory_.string() + "' " + what +
                                           (ec ? ": " + ec.message() : std::string()));
  }

  std::uint64_t unique() noexcept { return nonce_ + counter_.fetch_add(1, std::memory_order_relaxed); }

  TierView counted_miss() noexcept {
    misses_.fetch_add(1, std::memory_order_relaxed);
    return TierView(GetStatus::miss);
  }
  TierView counted_failure(bool io) noexcept {
    if (io) io_errors_.fetch_add(1, std::memory_order_relaxed);
    get_failures_.fetch_add(1, std::memory_order_relaxed);
    return TierView(GetStatus::failed);
  }
  bool counted_put_failure(bool io) noexcept {
    if (io) io_errors_.fetch_add(1, std::memory_order_relaxed);
    put_failures_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  // Drops `key` from the catalogue; true if it was there.
  bool forget(const TierKey& key) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = catalogue_.find(key);
    if (it == catalogue_.end()) return false;
    bytes_ -= it->second.bytes;
    recency_.erase(it->second.recency);
    catalogue_.erase(it);
    return true;
  }

  // Adds or replaces `key` as the most recently used entry. Caller holds mutex_ (or is the
  // constructor). Throws only bad_alloc, before changing anything.
  void remember(const TierKey& key, std::uint64_t bytes) {
    const auto it = catalogue_.find(key);
    if (it != catalogue_.end()) {
      bytes_ -= std::exchange(it->second.bytes, bytes);
      recency_.splice(recency_.begin(), recency_, it->second.recency);
    } else {
      recency_.push_front(key);
      try {
        catalogue_.emplace(key, Entry{bytes, recency_.begin()});
      } catch (...) {
        recency_.pop_front();
        throw;
      }
    }
    bytes_ += bytes;
  }

  // File times for "used now": the access time left alone, the modification time the wall
  // clock in nanoseconds, made strictly increasing within this object so that two uses in one
  // clock tick keep their order across a restart.
  std::array<timespec, 2> stamp() noexcept {
    timespec now {};
    ::clock_gettime(CLOCK_REALTIME, &now);
    const std::int64_t wall = nanoseconds(now);
    std::int64_t last = last_stamp_.load(std::memory_order_relaxed);
    std::int64_t next = 0;
    do {
      next = std::max(wall, last + 1);
    } while (!last_stamp_.compare_exchange_weak(last, next, std::memory_order_relaxed));
    std::array<timespec, 2> times{};
    times[0].tv_nsec = UTIME_OMIT;
    times[1].tv_sec = static_cast<time_t>(next / 1'000'000'000);
    times[1].tv_nsec = static_cast<long>(next % 1'000'000'000);
    return times;
  }

  static std::int64_t nanoseconds(const timespec& t) noexcept {
    return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
  }

  // Marks `key` most recently used, if it is still in the catalogue.
  void touch(const TierKey& key) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = catalogue_.find(key);
    if (it != catalogue_.end()) recency_.splice(recency_.begin(), recency_, it->second.recency);
  }

  // Deletes least recently used entries until the catalogue fits the capacity. Victims are
  // taken out of the catalogue under the lock a batch at a time and their files deleted
  // after it is released, so no allocation and no I/O under the lock. A put of a victim's
  // key racing with its deletion can lose its new file: the catalogue then names a file
  // that is gone, and the next get of it misses and forgets it (never wrong bytes).
  void evict_to_capacity() noexcept {
    if (!options_.capacity_bytes) return;
    const std::uint64_t capacity = *options_.capacity_bytes;
    for (;;) {
      TierKey victims[16];
      std::size_t n = 0;
      {
        std::lock_guard lock(mutex_);
        while (bytes_ > capacity && n < std::size(victims) && !recency_.empty()) {
          const TierKey victim = recency_.back();
          const auto it = catalogue_.find(victim);
          bytes_ -= it->second.bytes;
          catalogue_.erase(it);
          recency_.pop_back();
          victims[n++] = victim;
        }
      }
      for (std::size_t i = 0; i < n; ++i) delete_file(victims[i]);
      evictions_.fetch_add(n, std::memory_order_relaxed);
      if (n < std::size(victims)) return;
    }
  }

  void delete_file(const TierKey& key) noexcept {
    char name[64];
    detail::disk::format_name(key, name);
    if (::unlinkat(dir_.get(), name, 0) != 0 && errno != ENOENT) io_errors_.fetch_add(1, std::memory_order_relaxed);
  }

  // Reads and validates the header of an open file against the key it must hold and the
  // file's size (a truncated file or one with trailing bytes is corrupt).
  static Check read_header(int fd, const TierKey& expected, detail::disk::Header& out) noexcept {
    detail::disk::HeaderBytes raw;
    const long long got = detail::posix::read_at(fd, raw.data(), raw.size(), 0);
    if (got < 0) return Check::io_error;
    if (static_cast<std::size_t>(got) != raw.size()) return Check::corrupt;
    struct stat st {};
    if (::fstat(fd, &st) != 0) return Check::io_error;
    return detail::disk::check_header(raw, expected, static_cast<std::uint64_t>(st.st_size), out) ==
                   detail::disk::EntryError::none
               ? Check::ok
               : Check::corrupt;
  }

  // Moves `name` into quarantine/ under a name no other quarantined file has; counts it.
  void quarantine(const char* name) noexcept {
    char target[256];
    detail::disk::format_quarantine_name(name, unique(), target);
    if (::renameat(dir_.get(), name, quarantine_.get(), target) == 0) {
      quarantined_.fetch_add(1, std::memory_order_relaxed);
    } else {
      io_errors_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // A get found the file it opened corrupt. Quarantine it only if the name still refers to
  // that same file: a put may have renamed a good file over it since we opened it. Either
  // way the catalogue forgets the key unless a newer file took the name.
  void quarantine_open_file(int fd, const char* name, const TierKey& key) noexcept {
    struct stat opened {}, current {};
    if (::fstat(fd, &opened) != 0 || ::fstatat(dir_.get(), name, &current, AT_SYMLINK_NOFOLLOW) != 0) {
      io_errors_.fetch_add(1, std::memory_order_relaxed);
      forget(key);
      return;
    }
    if (opened.st_dev != current.st_dev || opened.st_ino != current.st_ino) return;  // already replaced
    quarantine(name);
    forget(key);
  }

  // Rebuilds the catalogue from the directory. Construction only (no other thread yet).
  void scan() {
    namespace fs = std::filesystem;
    std::error_code ec;
    std::vector<std::string> names;
    for (fs::directory_iterator it(directory_, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code type_ec;
      if (it->symlink_status(type_ec).type() == fs::file_type::regular) names.push_back(it->path().filename().string());
    }
    if (ec) fail_open("cannot be listed", ec);

    struct Found {
      TierKey key;
      std::uint64_t bytes;
      std::int64_t used;  // last put or hit, ns (the file's modification time)
    };
    std::vector<Found> found;
    std::unique_ptr<std::byte[]> buffer;  // for streaming payload checksums
    constexpr std::size_t buffer_bytes = std::size_t{1} << 20;
    for (const std::string& name : names) {
      if (std::string_view(name).starts_with(detail::disk::temp_prefix)) {  // an unpublished put
        ::unlinkat(dir_.get(), name.c_str(), 0);
        continue;
      }
      const auto key = detail::disk::parse_name(name);
      if (!key) {
        quarantine(name.c_str());
        continue;
      }
      detail::posix::UniqueFd fd(::openat(dir_.get(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
      if (!fd.valid()) {
        io_errors_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      detail::disk::Header header;
      Check check = read_header(fd.get(), *key, header);
      if (check == Check::ok && options_.verify_payloads_on_open) {
        if (!buffer) buffer = std::make_unique<std::byte[]>(buffer_bytes);
        check = verify_payload(fd.get(), header, buffer.get(), buffer_bytes);
      }
      if (check == Check::io_error) {  // not proof of corruption: leave the file, do not serve it
        io_errors_.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      if (check == Check::corrupt) {
        quarantine(name.c_str());
        continue;
      }
      struct stat st {};
      if (::fstat(fd.get(), &st) != 0) io_errors_.fetch_add(1, std::memory_order_relaxed);
      found.push_back({*key, header.payload_bytes, nanoseconds(st.st_mtim)});
    }
    // Oldest first, so the newest ends at the front of the recency list.
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.used < b.used; });
    for (const Found& f : found) remember(f.key, f.bytes);
    evict_to_capacity();
  }

  static Check verify_payload(int fd, const detail::disk::Header& header, std::byte* buffer, std::size_t size) noexcept {
    detail::disk::EntryChecksum hash(header.version);
    std::uint64_t offset = detail::disk::header_bytes;
    std::uint64_t left = header.payload_bytes;
    while (left != 0) {
      const std::size_t want = left < size ? static_cast<std::size_t>(left) : size;
      const long long got = detail::posix::read_at(fd, buffer, want, offset);
      if (got < 0) return Check::io_error;
      if (static_cast<std::size_t>(got) != want) return Check::corrupt;
      hash.update(std::span<const std::byte>(buffer, want));
      offset += want;
      left -= want;
    }
    return hash.digest() == header.payload_checksum ? Check::ok : Check::corrupt;
  }

  std::filesystem::path directory_;
  DiskTierOptions options_;
  detail::posix::UniqueFd dir_;
  detail::posix::UniqueFd quarantine_;
  std::uint64_t nonce_ = 0;
  std::atomic<std::uint64_t> counter_{0};

  struct Entry {
    std::uint64_t bytes;                      // payload bytes
    std::list<TierKey>::iterator recency;     // its node in recency_
  };
  mutable std::mutex mutex_;
  std::unordered_map<TierKey, Entry> catalogue_;  // guarded by mutex_
  std::list<TierKey> recency_;                    // most recently used first; guarded by mutex_
  std::uint64_t bytes_ = 0;                       // guarded by mutex_

  std::atomic<std::uint64_t> hits_{0}, misses_{0}, get_failures_{0}, quarantined_{0}, puts_{0}, put_failures_{0},
      io_errors_{0}, evictions_{0};
  std::atomic<std::int64_t> last_stamp_{0};  // the last file time stamp() gave, in ns
};

static_assert(Tier<DiskTier>);

}  // namespace kvfuse
