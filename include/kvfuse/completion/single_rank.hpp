// kvfuse/completion/single_rank.hpp — the one-rank group: each record is its own settlement.
//
// With one rank there is nothing to wait for and nothing to merge, so SingleRank keeps no
// pending table and no tombstones: a record for a key the engine holds as outstanding
// settles the moment it is drained; anything else is late (R3; the index is the truth).
//
// The handoff. The rank's lanes run on their own threads and the engine settles on its
// own, so a record must cross threads; "no queue" (docs/reference.md#single-rank) means no quorum between the
// record and its settlement, not a direct cross-thread call. The crossing is the same
// bounded lock-free SPSC lane queue TpQuorum uses (a RankQueue for rank 0): wait-free for
// the lane while there is room, never blocking it on the engine, never allocating.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Shape of a SingleRank group.
struct SingleRankOptions {
  std::size_t lanes = 3;             ///< producing lanes; 0 = no in-process queue (records arrive via ingest)
  std::size_t lane_capacity = 4096;  ///< records per lane queue
  Backoff backoff{};                 ///< how a producer waits on a full lane queue
};

/// The one-rank group. Rank side: emitter(0, lane). Engine side: drain + merge from one
/// scheduler thread (not thread-safe; the lane queues are the only thread boundary).
/// Non-copyable, non-movable.
class SingleRank {
 public:
  using Emitter = LaneEmitter;

  /// Throws Error(invalid_argument) naming the value if lane_capacity is 0 with lanes.
  explicit SingleRank(SingleRankOptions config = {}) {
    if (config.lanes > 0)
      queue_ = std::make_unique<RankQueue>(0, RankQueueOptions{config.lanes, config.lane_capacity, config.backoff});
  }
  SingleRank(const SingleRank&) = delete;
  SingleRank& operator=(const SingleRank&) = delete;

  [[nodiscard]] std::uint32_t world_size() const noexcept { return 1; }

  /// Claims lane `lane` of rank 0. Throws Error naming the rank or lane if the rank is not
  /// 0, the lane is out of range or claimed, or the group has no in-process queue.
  [[nodiscard]] LaneEmitter emitter(std::uint32_t rank, std::size_t lane) { return queue(rank).emitter(lane); }

  /// The rank's queue. Throws Error naming the rank if it is not 0, or if built with lanes == 0.
  [[nodiscard]] RankQueue& queue(std::uint32_t rank = 0) {
    if (rank != 0)
      throw Error(ErrorCode::invalid_argument, "rank " + std::to_string(rank) + " out of range: SingleRank has rank 0 only");
    if (!queue_) throw Error(ErrorCode::invalid_argument, "this SingleRank was built with lanes = 0: it has no queue");
    return *queue_;
  }

  /// Visits every queued record: visitor(0, record). Scheduler thread only; noexcept.
  template <class Visitor>
  std::size_t drain(Visitor& visitor) noexcept {
    if (!queue_) return 0;
    auto bound = [&visitor](const auto& record) noexcept { visitor(std::uint32_t{0}, record); };
    return queue_->drain(bound);
  }

  /// Settles one load record at once if `admit(key)`: Settlement{key, record_ok,
  /// record_missed_state}. Scheduler thread only; noexcept.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const CompletionRecord& r, Admit& admit, Sink& sink) noexcept {
    const MergeResult gate = check(source_rank, r.rank, r.key, admit);
    if (gate != MergeResult::settled) return gate;
    ++counters_.settled;
    sink(Settlement{r.key, record_ok(r), record_missed_state(r), r.kv_restored});
    return MergeResult::settled;
  }

  /// Settles one phase of a save at once if `admit(key)`: the rank's `released` record is
  /// the released settlement, its `stored` record the stored one. Scheduler thread only; noexcept.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const SaveRecord& r, Admit& admit, Sink& sink) noexcept {
    const MergeResult gate = check(source_rank, r.rank, r.key, admit);
    if (gate != MergeResult::settled) return gate;
    ++counters_.save_settled;
    sink(SaveSettlement{r.key, r.phase, r.ok});
    return MergeResult::settled;
  }

  /// Merges a batch that arrived from `source_rank`; returns how many settled. noexcept.
  template <class Record, AdmitPolicy Admit, SettlementSink Sink>
  std::size_t ingest(std::uint32_t source_rank, std::span<const Record> records, Admit& admit, Sink& sink) noexcept {
    std::size_t settled = 0;
    for (const Record& r : records) settled += merge(source_rank, r, admit, sink) == MergeResult::settled ? 1 : 0;
    return settled;
  }

  /// The only rank died: its later records are dropped and counted. Nothing is pending in
  /// this group, so nothing settles here; the keys in flight settle through
  /// settle_if_unowed (SettlementPump calls it for each). Throws Error naming the rank if
  /// it is not 0. Scheduler thread.
  template <SettlementSink Sink>
  void mark_rank_dead(std::uint32_t rank, Sink& /*sink*/) {
    check_rank(rank, "dead");
    dead_ = true;
  }

  /// Settles `key`, a load in flight, failed if the rank will never report it: it is dead,
  /// or came back after the key was issued. Returns whether it settled. Call it only for
  /// keys the index holds in flight (there are no tombstones here to stop a second call).
  /// Scheduler thread; noexcept; O(1).
  template <SettlementSink Sink>
  bool settle_if_unowed(const LoadKey& key, Sink& sink) noexcept {
    if (owes(key.generation)) return false;
    ++counters_.settled;
    sink(Settlement{key, false, false});
    return true;
  }

  /// The same for a save: `released` ok (a dead rank reads nothing), `stored` not ok.
  /// Scheduler thread; noexcept; O(1).
  template <SettlementSink Sink>
  bool settle_if_unowed(const SaveKey& key, Sink& sink) noexcept {
    if (owes(key.generation)) return false;
    counters_.save_settled += 2;
    sink(SaveSettlement{key, SavePhase::released, true});
    sink(SaveSettlement{key, SavePhase::stored, false});
    return true;
  }

  /// The rank is back: its records count again for keys of generation `first_counted` or
  /// later; older ones are dropped as dead-rank reports. No-op if it is alive. Throws Error
  /// naming the rank if it is not 0. Scheduler thread.
  void mark_rank_alive(std::uint32_t rank, Generation first_counted) {
    check_rank(rank, "alive");
    if (!dead_) return;
    dead_ = false;
    counted_from_ = first_counted;
  }

  /// Nothing is ever pending here: the index's answer (admit) already makes later records
  /// for `key` late. noexcept.
  void forget(const LoadKey& /*key*/) noexcept {}

  /// No pending keys, so no clock is needed. noexcept.
  void set_time(std::chrono::steady_clock::time_point /*now*/) noexcept {}

  /// Counters; pending is always 0. Scheduler thread; O(lanes).
  [[nodiscard]] GroupStats stats() const noexcept {
    GroupStats s = counters_;
    s.world_size = 1;
    s.live_ranks = dead_ ? 0 : 1;
    if (queue_) s.queues = queue_->stats();
    return s;
  }

  /// Shutdown: closes the queue (see RankQueue::close). Thread-safe.
  void close() noexcept {
    if (queue_) queue_->close();
  }

 private:
  static void check_rank(std::uint32_t rank, const char* what) {
    if (rank != 0)
      throw Error(ErrorCode::invalid_argument,
                  "cannot mark rank " + std::to_string(rank) + " " + what + ": SingleRank has rank 0 only");
  }

  // Whether the rank reports keys of generation `g`: it is alive and was already alive
  // when they were issued.
  [[nodiscard]] bool owes(Generation g) const noexcept { return !dead_ && !(g < counted_from_); }

  // Returns `settled` when the record may settle, else the reason it is dropped (counted).
  template <class Key, class Admit>
  MergeResult check(std::uint32_t source_rank, std::uint32_t rank, const Key& key, Admit& admit) noexcept {
    ++counters_.records;
    if (rank != 0 || source_rank != 0) {
      ++counters_.invalid_reports;
      return MergeResult::invalid;
    }
    if (!owes(key.generation)) {
      ++counters_.dead_rank_reports;
      return MergeResult::dead_rank;
    }
    if (!static_cast<bool>(admit(key))) {
      ++counters_.late_reports;
      return MergeResult::late;
    }
    return MergeResult::settled;
  }

  std::unique_ptr<RankQueue> queue_;
  Generation counted_from_{};  // records of older generations are from before a restart
  bool dead_ = false;
  GroupStats counters_{};
};

static_assert(CompletionGroup<SingleRank>);

}  // namespace kvfuse
