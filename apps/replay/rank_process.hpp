// kvfuse-replay: ranks as processes (--ranks-as processes). The replay re-executes its own
// binary once per rank (`kvfuse-replay --rank-process 3`, hidden); each rank process owns
// its device memory, its connector and its tier, and checks its own bytes.
//
// Two ways between the engine and a rank process:
//  - the segment (kvfuse/ipc): loads and saves go as frames through ShmEngine, the
//    Coordinator's transport; records come back through the rank's record rings into the
//    engine's ShmQuorum and SettlementPump. Deaths are ShmEngine's: a pidfd per rank.
//  - the control channel (control_channel.hpp): a socketpair per rank process for
//    everything else.
//
// A rank process ends when the engine says quit, when the control channel closes, or when
// ShmRank sees the engine gone (its pidfd): no rank process outlives its engine.
//
// The files, one job each:
//   rank_process.hpp/.cpp       the engine's side: RankProcesses (start, call, watch, restart)
//   control_channel.hpp/.cpp    the channel: requests, replies, whole writes and reads
//   byte_encoding.hpp           the bytes of what crosses it
//   child_setup.hpp/.cpp        what a rank process is built from, as bytes
//   rank_server.hpp/.cpp        the rank process's side: RankServer, serve_rank<Conn, Inner>
//   rank_process_main.hpp/.cpp  the rank process's entry: its setup, its model, serve_rank
#pragma once

#include "control_channel.hpp"
#include "ranks.hpp"

#include <kvfuse/ipc/shm_engine.hpp>

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace replay {

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

}  // namespace replay
