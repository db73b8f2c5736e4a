// kvfuse-replay: ranks as processes (--ranks-as processes). The replay re-executes its own
// binary once per rank (`kvfuse-replay --rank-process 3`, hidden); each rank process owns
// its device memory, its connector and its tier, and checks its own bytes.
//
// Two ways between the engine and a rank process:
//  - the segment (kvfuse/ipc): loads and saves go as frames through ShmEngine, the
//    Coordinator's transport; records come back through the rank's record rings into the
//    engine's ShmQuorum and SettlementPump. Deaths are ShmEngine's: a pidfd per rank.
//  - the control channel: a socketpair per rank process, one request and one reply at a
//    time, for everything else (the forward's writes, folds and byte checks, the tier's
//    lookups and faults, counters, drain). Requests are fixed-size headers followed by a
//    length-prefixed payload of trivially copyable structs (both ends are this binary).
//
// A rank process ends when the engine says quit, when the control channel closes, or when
// ShmRank sees the engine gone (its pidfd): no rank process outlives its engine.
#pragma once

#include "ranks.hpp"

#include <kvfuse/ipc/shm_engine.hpp>

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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

/// What a rank process is built from: the segment, its rank and geometry, its model and
/// its tier. Sent as the payload of ControlOp::ready.
struct ChildSetup {
  std::string segment;
  std::string model;  ///< the model table's name: the child builds that entry's connector
  std::uint32_t rank = 0;
  RankSetup ranks;    ///< its runtime and group are not used
  TierOptions tier;   ///< this rank's

  std::vector<std::byte> encode() const;
  /// Throws InputError on a payload that does not decode.
  static ChildSetup decode(std::span<const std::byte> bytes);
};

/// Ranks as processes: one child process per rank, its frames through `shm`, everything else
/// over its control channel. Scheduler thread only.
class RankProcesses final : public Ranks {
 public:
  /// Starts every rank process and waits until each attached to `shm`. Throws kvfuse::Error
  /// when one cannot start or attach (the message is the child's).
  RankProcesses(const RankSetup& setup, std::string_view model, kvfuse::ShmEngine& shm);
  /// Tells every rank process to quit and reaps it (SIGKILL after 5 s).
  ~RankProcesses() override;
  RankProcesses(const RankProcesses&) = delete;
  RankProcesses& operator=(const RankProcesses&) = delete;

  bool up(std::uint32_t r) const override;
  /// Every rank process runs and the engine has seen it attached.
  bool all_up() const;

  Delivery deliver(const kvfuse::LoadRequest& request, const std::vector<bool>& alive) override;
  Delivery deliver(const kvfuse::KvSave& save, const std::vector<bool>& alive) override;
  Delivery deliver(const kvfuse::StateSave& save, const std::vector<bool>& alive) override;
  void write_kv(std::span<const BlockSpan> spans) override;
  void write_state(kvfuse::SlotId slot, std::uint64_t digest) override;
  std::uint64_t read_state(kvfuse::SlotId slot) override;
  void fold_kv(std::span<const BlockSpan> spans, std::span<std::uint64_t> out) override;
  Checked check(std::span<const BlockSpan> spans, std::optional<kvfuse::SlotId> slot, std::uint64_t digest) override;
  std::byte* pd_landing(std::uint32_t r) override;
  void pd_landed(std::span<const kvfuse::BlockId> blocks) override;
  TierControl& tier(std::uint32_t r) override;
  kvfuse::ConnectorStats connector_stats(std::uint32_t r) override;
  std::vector<RankCounts> rank_counts() override;
  void drain() override;

  /// ShmEngine::watch (deaths marked dead in `pump`, returns marked alive), then returns the
  /// ranks whose process the engine saw die in this call.
  template <class Pump>
  std::vector<std::uint32_t> watch(Pump& pump) {
    std::vector<bool> before(world_);
    for (std::uint32_t r = 0; r < world_; ++r) before[r] = shm_.attached(r);
    (void)shm_.watch(pump);
    std::vector<std::uint32_t> died;
    for (std::uint32_t r = 0; r < world_; ++r) {
      if (before[r] && !shm_.attached(r)) {
        seen_dead(r);
        died.push_back(r);
      }
      if (children_[r].state == State::restarting && shm_.attached(r)) children_[r].state = State::running;
    }
    return died;
  }

  /// Tells every rank process to quit and reaps it. Throws kvfuse::Error naming each that
  /// did not exit with status 0 (a sanitizer's report, a crash). Call once, at the end.
  void quit_all();

  /// SIGKILLs rank r's process and reaps it; false when it is not running.
  bool kill(std::uint32_t r);
  /// Whether rank r was killed by kill() (not a death nobody caused).
  bool killed(std::uint32_t r) const { return children_[r].killed; }
  /// How rank r's process ended when nobody killed it ("" otherwise).
  const std::string& how_it_ended(std::uint32_t r) const { return children_[r].ended; }
  /// Whether the engine saw rank r's process die and it has not been restarted.
  bool lost(std::uint32_t r) const { return children_[r].state == State::lost; }
  /// Starts a new process for a lost rank (a new incarnation, fresh device memory, its tier
  /// built again: a memory tier comes back empty, a disk tier reopens its files). It counts
  /// once watch() sees it attached. False when rank r is not lost. Throws as the constructor.
  bool restart(std::uint32_t r);

 private:
  friend class RemoteTier;
  enum class State { running, killed, lost, restarting };
  struct Child {
    pid_t pid = 0;
    ControlChannel channel;
    State state = State::running;
    bool killed = false;
    std::uint64_t delay_us = 0;  // the tier's delay, set again in a restarted process
    std::string ended;           // how a process nobody killed ended
  };

  void spawn(std::uint32_t r);
  void seen_dead(std::uint32_t r);
  /// Tells every rank process to quit and reaps it (SIGKILL after 5 s); returns how those
  /// that did not exit with status 0 ended ("" when all did).
  std::string stop_all() noexcept;
  /// One request and its reply; false (the channel closed) when the rank process is gone.
  bool call(std::uint32_t r, const ControlHeader& h, std::span<const std::byte> payload, ControlHeader* reply = nullptr,
            std::vector<std::byte>* reply_payload = nullptr);
  /// The same request to every rank process with an open channel, all sent before any reply
  /// is read; `each(r, reply, payload)` per reply.
  template <class Each>
  void call_all(const ControlHeader& h, std::span<const std::byte> payload, Each&& each);

  RankSetup setup_;
  std::string model_;
  kvfuse::ShmEngine& shm_;
  std::vector<Child> children_;
  std::vector<std::unique_ptr<TierControl>> tiers_;
  std::vector<std::vector<std::byte>> landing_;  // P/D transfers land here, then go to the ranks
  std::vector<std::byte> reply_;
};

/// The hidden mode of kvfuse-replay: serves as one rank process on the control channel `fd`
/// until the engine says quit or is gone. Returns the exit status (0, or 3 when it could not
/// start: the reason went back to the engine).
int rank_process_main(int fd);

}  // namespace replay
