// kvfuse-replay: the control channel between the engine and one rank process (ranks as
// processes, rank_process.hpp): a socketpair per rank process, one request and one reply at
// a time, for everything that is not a frame (the forward's writes, folds and byte checks,
// the tier's lookups and faults, counters, drain). A request is a fixed-size header followed
// by a length-prefixed payload of trivially copyable structs (byte_encoding.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace replay {

/// The control channel's requests; each has exactly one reply.
enum class ControlOp : std::uint32_t {
  ready,                   ///< engine -> rank: the setup (payload); reply: a = 1, or the error text
  write_kv,                ///< BlockSpan[count]
  write_state,             ///< a: slot, b: digest
  read_state,              ///< a: slot; reply a: digest
  fold_kv,                 ///< BlockSpan[count]; reply a: the fold
  check,                   ///< BlockSpan[count], a: slot + 1 (0: none), b: digest; reply a: verified, b: corrupted
  put_blocks,              ///< BlockId[count] then count blocks' bytes
  tier_leading,            ///< TierKey[count]; reply a: leading keys held
  tier_erase,              ///< TierKey; reply a: erased
  tier_set_delay,          ///< a: microseconds
  tier_reopen_disk,        ///< reply a, b: entries before, after
  tier_erase_from_memory,  ///< TierKey; reply a: erased
  tier_disk_path,          ///< TierKey; reply: the path's text
  tier_snapshot,           ///< reply: TierSnapshotWire
  connector_stats,         ///< reply: ConnectorStats
  counts,                  ///< reply: RankCounts
  drain,                   ///< every frame sent so far served, every lane idle
  quit,                    ///< the rank process ends after replying
};

/// A request's or a reply's fixed part; `bytes` of payload follow it.
struct ControlHeader {
  ControlOp op = ControlOp::ready;
  std::uint32_t count = 0;
  std::uint64_t a = 0, b = 0;
  std::uint64_t bytes = 0;
};
static_assert(std::is_trivially_copyable_v<ControlHeader>);

/// One end of a control channel (a connected stream socket). Owns the descriptor. put, get
/// and close by one thread at a time; shut_down from any thread (it ends a blocked get).
class ControlChannel {
 public:
  ControlChannel() = default;
  explicit ControlChannel(int fd) noexcept : fd_(fd) {}
  ControlChannel(ControlChannel&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  ControlChannel& operator=(ControlChannel&& o) noexcept;
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;
  ~ControlChannel() { close(); }

  /// Writes a header and its payload whole; false when the other end is gone.
  bool put(ControlHeader h, std::span<const std::byte> payload = {}) noexcept;
  /// Reads a header and its payload whole (at most 1 GiB); false when the other end is
  /// gone, the payload is too large, or a receive timeout passed.
  bool get(ControlHeader& h, std::vector<std::byte>& payload) noexcept;
  /// Ends both directions (a blocked get on the other thread returns false); keeps the descriptor.
  void shut_down() noexcept;
  void close() noexcept;
  bool open() const noexcept { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace replay
