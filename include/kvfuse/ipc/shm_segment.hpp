// kvfuse/ipc/shm_segment.hpp — the shared memory segment one engine and its rank processes
// map: a header (who made it, for which world and geometry), then per rank a control block
// (its state, incarnation and pid), its frame ring (engine -> rank) and one record ring per
// producing lane (rank -> engine).
//
// Security: the engine creates the segment owner-only (mode 0600) under a name with 64 random
// bits (/<prefix>-<16 hex digits>) and O_EXCL semantics, so it never opens a segment somebody
// else made; it removes the segment when it is destroyed. A crashed engine leaves its
// segment behind: the next engine with the same prefix finds it (its header names a dead
// engine process, or a process that started at another time, i.e. a reused pid) and
// removes it before it creates its own. A segment whose engine is alive is left alone.
//
// Layout: plain data and process-shared atomics at offsets every process computes the same
// way from the header's sizes (segment_layout), no pointer anywhere. Internal to ipc/;
// every call here runs at set-up, never on a load's path.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include <kvfuse/error.hpp>
#include <kvfuse/ipc/shm_ring.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

namespace kvfuse {

/// What every rank process must agree on with the engine to attach: the world and the
/// per-rank geometry (rank excluded: each rank attaches with its own).
struct ShmGeometry {
  std::uint64_t model = 0;
  std::uint32_t world_size = 0;
  std::uint32_t block_tokens = 0;
  std::uint32_t chunk_tokens = 0;
  std::uint32_t num_blocks = 0;
  std::uint32_t num_slots = 0;
  std::uint32_t pad = 0;
  std::uint64_t kv_bytes_per_token = 0;
  std::uint64_t slot_bytes = 0;

  /// The fields of `g` the segment pins.
  static ShmGeometry of(const RankGeometry& g) noexcept {
    return ShmGeometry{g.model, g.world_size, g.block_tokens, g.chunk_tokens, g.num_blocks, g.num_slots, 0,
                       g.kv_bytes_per_token, g.slot_bytes};
  }
  /// "world_size 4, model 42, block_tokens 16, ...", for the refusal that names both sides.
  [[nodiscard]] std::string describe() const {
    std::ostringstream o;
    o << "world_size " << world_size << ", model " << model << ", block_tokens " << block_tokens << ", chunk_tokens "
      << chunk_tokens << ", kv_bytes_per_token " << kv_bytes_per_token << ", num_blocks " << num_blocks
      << ", num_slots " << num_slots << ", slot_bytes " << slot_bytes;
    return o.str();
  }
  friend bool operator==(const ShmGeometry&, const ShmGeometry&) = default;
};

namespace detail {

inline constexpr std::uint64_t shm_magic = 0x5049455355465654ULL;  // "TVFUSEIP" little-endian: kvfuse ipc
inline constexpr std::uint32_t shm_version = 1;

/// A rank's place in the segment, as the engine sees it: free (nobody attached, or the
/// engine retired the last incarnation), alive (attached; `pid` and `incarnation` name it).
enum class RankState : std::uint32_t { free = 0, alive = 1 };

/// The per-rank control block.
struct alignas(64) RankControl {
  std::atomic<std::uint32_t> state{0};         ///< RankState
  std::atomic<std::uint64_t> incarnation{0};  ///< bumped by every attach
  std::atomic<std::int32_t> pid{0};            ///< the attached process
};

/// The segment header. Written once by the engine before anyone else can open the segment;
/// read-only afterwards, except the membership event count.
struct SegmentHeader {
  std::uint64_t magic = shm_magic;
  std::uint32_t version = shm_version;
  std::uint32_t lanes = 0;
  std::uint64_t frame_ring_bytes = 0;
  std::uint64_t record_ring_records = 0;
  ShmGeometry geometry{};
  std::int32_t engine_pid = 0;
  std::uint32_t pad = 0;
  std::uint64_t engine_start = 0;  ///< the engine process's start time (ticks since boot): tells a reused pid
  std::atomic<std::uint32_t> closed{0};     ///< the engine shut down cleanly: the ranks stop serving
  alignas(64) SharedEventCount membership;  ///< notified when a rank attaches
};

/// Where everything lives, computed from the header's sizes alone.
struct SegmentLayout {
  std::size_t rank_stride = 0;     ///< bytes per rank
  std::size_t control = 0;         ///< offset of RankControl in a rank's area
  std::size_t frame_control = 0;   ///< the frame ring's RingControl
  std::size_t frame_data = 0;      ///< its data
  std::size_t record_control = 0;  ///< lane 0's RingControl; lane l at + l * record_stride
  std::size_t record_stride = 0;
  std::size_t first_rank = 0;      ///< offset of rank 0's area
  std::size_t total = 0;           ///< segment bytes
};

constexpr std::size_t align_up(std::size_t n, std::size_t a) noexcept { return (n + a - 1) / a * a; }

inline SegmentLayout segment_layout(std::uint32_t world, std::uint32_t lanes, std::size_t frame_bytes,
                                    std::size_t records) noexcept {
  SegmentLayout l;
  l.first_rank = align_up(sizeof(SegmentHeader), 64);
  l.control = 0;
  l.frame_control = align_up(sizeof(RankControl), 64);
  l.frame_data = l.frame_control + align_up(sizeof(RingControl), 64);
  l.record_control = align_up(l.frame_data + frame_bytes, 64);
  l.record_stride = align_up(sizeof(RingControl) + records * sizeof(RecordBytes), 64);
  l.rank_stride = align_up(l.record_control + lanes * l.record_stride, 64);
  l.total = l.first_rank + world * l.rank_stride;
  return l;
}

/// The start time of process `pid` (field 22 of /proc/<pid>/stat), or 0 if there is no such
/// process. With the pid it names a process uniquely: a pid reused by another process has
/// another start time.
inline std::uint64_t process_start(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return 0;
  const std::size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i)
    if (i == 22) return std::stoull(field);
  return 0;
}

/// A pidfd on process `pid` (Linux 5.3), or -1. Through syscall(): glibc 2.36's
/// <sys/pidfd.h> declares pidfd_open without C linkage, so C++ cannot link against it.
inline int open_pidfd(int pid) noexcept { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

/// Sends `sig` to the process behind `pidfd` (Linux 5.1): never to a later process that
/// reused its pid.
inline int signal_pidfd(int pidfd, int sig) noexcept {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

/// A mapped segment: the shared memory object and its mapping, with typed access.
class MappedSegment {
 public:
  MappedSegment() = default;
  MappedSegment(boost::interprocess::shared_memory_object object, boost::interprocess::mode_t mode)
      : object_(std::move(object)), region_(object_, mode) {}

  [[nodiscard]] std::byte* base() const noexcept { return static_cast<std::byte*>(region_.get_address()); }
  [[nodiscard]] std::size_t size() const noexcept { return region_.get_size(); }
  [[nodiscard]] SegmentHeader& header() const noexcept { return *reinterpret_cast<SegmentHeader*>(base()); }

  [[nodiscard]] SegmentLayout layout() const noexcept {
    const SegmentHeader& h = header();
    return segment_layout(h.geometry.world_size, h.lanes, h.frame_ring_bytes, h.record_ring_records);
  }
  [[nodiscard]] std::byte* rank_area(std::uint32_t rank) const noexcept {
    const SegmentLayout l = layout();
    return base() + l.first_rank + rank * l.rank_stride;
  }
  [[nodiscard]] RankControl& rank_control(std::uint32_t rank) const noexcept {
    return *reinterpret_cast<RankControl*>(rank_area(rank) + layout().control);
  }
  [[nodiscard]] FrameRing frame_ring(std::uint32_t rank) const noexcept {
    const SegmentLayout l = layout();
    std::byte* area = rank_area(rank);
    return FrameRing(reinterpret_cast<RingControl*>(area + l.frame_control), area + l.frame_data,
                     header().frame_ring_bytes);
  }
  [[nodiscard]] RecordRing record_ring(std::uint32_t rank, std::uint32_t lane) const noexcept {
    const SegmentLayout l = layout();
    std::byte* at = rank_area(rank) + l.record_control + lane * l.record_stride;
    return RecordRing(reinterpret_cast<RingControl*>(at), reinterpret_cast<RecordBytes*>(at + sizeof(RingControl)),
                      header().record_ring_records);
  }

 private:
  boost::interprocess::shared_memory_object object_;
  boost::interprocess::mapped_region region_;
};

/// A name nobody else will pick: the prefix and 64 random bits.
inline std::string fresh_segment_name(const std::string& prefix) {
  std::random_device rd;
  const std::uint64_t bits = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(bits));
  return prefix + "-" + hex;
}

/// Removes every segment named `prefix-...` in /dev/shm whose engine is gone (a crashed
/// engine's), after checking it is a kvfuse segment; returns how many. A segment of a live
/// engine, or one that is not ours, is left alone.
inline std::size_t remove_stale_segments(const std::string& prefix) {
  namespace bip = boost::interprocess;
  std::size_t removed = 0;
  const std::string dir = "/dev/shm";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix + "-", 0) != 0) continue;
    try {
      bip::shared_memory_object object(bip::open_only, name.c_str(), bip::read_only);
      bip::offset_t size = 0;
      if (!object.get_size(size) || static_cast<std::size_t>(size) < sizeof(SegmentHeader)) continue;
      bip::mapped_region region(object, bip::read_only, 0, sizeof(SegmentHeader));
      const auto* h = static_cast<const SegmentHeader*>(region.get_address());
      if (h->magic != shm_magic) continue;
      const std::uint64_t start = process_start(h->engine_pid);
      if (start != 0 && start == h->engine_start) continue;  // its engine is alive
    } catch (const bip::interprocess_exception&) {
      continue;
    }
    if (bip::shared_memory_object::remove(name.c_str())) ++removed;
  }
  return removed;
}

}  // namespace detail
}  // namespace kvfuse
