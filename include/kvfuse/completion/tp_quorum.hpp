// kvfuse/completion/tp_quorum.hpp — the tensor-parallel group: each rank's lane queues on
// the rank side, the failure-dominant quorum on the engine side (R3, R4, R20).
//
// A key settles when every rank in the world has a report in: its own record, or the
// substitute failure that mark_rank_dead(r) stands in for a dead rank. The merge:
//   load:  ok           iff every rank's record is record_ok (all legs succeeded)
//          state_missed iff some rank reported StateOutcome::missed
//                       (KV failure, transfer failure, refusal, `none`: never retract)
//   store: stored          iff every rank stored
//          source_released iff every rank released its source
// A second report from a rank never counts twice; it is merged failure-dominantly, so a
// failure is never overwritten by a later success. Settled keys are tombstoned in a
// bounded FIFO; later reports for them are late and dropped. Pending keys never expire:
// liveness comes from R1 (every rank reports every dispatch) and mark_rank_dead.
#pragma once

#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <kvfuse/completion/detail/quorum_table.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/completion/records.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Shape of a TpQuorum. Checked at construction: a bad value throws kvfuse::Error
/// (invalid_argument) naming it.
struct TpQuorumConfig {
  std::uint32_t world_size = 1;        ///< ranks, 1..64
  std::size_t lanes_per_rank = 3;      ///< producing lanes per rank; 0 = no in-process queues (records
                                       ///< arrive through SettlementPump::ingest from a transport)
  std::size_t lane_capacity = 4096;    ///< records per lane queue (> 0 when lanes_per_rank > 0)
  std::size_t tombstones = 4096;       ///< settled keys remembered per record type, >= 1
  std::size_t expected_pending = 4096; ///< pending keys the tables hold before their first growth
  Backoff backoff{};                   ///< how a producer waits on a full lane queue
};

/// The TP group. Rank side: emitter(rank, lane) hands out LaneEmitters over per-rank
/// RankQueues. Engine side: drain + merge + mark_rank_dead, all from one engine thread
/// (not thread-safe; the queues are the only thread boundary). Non-copyable, non-movable.
class TpQuorum {
 public:
  using Emitter = LaneEmitter;
  using TimePoint = std::chrono::steady_clock::time_point;

  /// Throws Error(invalid_argument) naming the value for world_size outside 1..64,
  /// tombstones == 0, or lane_capacity == 0 with lanes.
  explicit TpQuorum(TpQuorumConfig config)
      : world_(check(config).world_size),
        all_mask_(world_ == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << world_) - 1),
        loads_(config.tombstones, config.expected_pending),
        stores_(config.tombstones, config.expected_pending) {
    if (config.lanes_per_rank > 0) {
      queues_.reserve(world_);
      for (std::uint32_t r = 0; r < world_; ++r)
        queues_.push_back(std::make_unique<RankQueue>(
            r, RankQueueConfig{config.lanes_per_rank, config.lane_capacity, config.backoff}));
    }
  }
  TpQuorum(const TpQuorum&) = delete;
  TpQuorum& operator=(const TpQuorum&) = delete;

  [[nodiscard]] std::uint32_t world_size() const noexcept { return world_; }

  /// Claims lane `lane` of rank `rank` (see RankQueue::emitter). Throws Error naming the
  /// rank or lane if out of range, already claimed, or the group has no in-process queues.
  /// Thread-safe.
  [[nodiscard]] LaneEmitter emitter(std::uint32_t rank, std::size_t lane) { return queue(rank).emitter(lane); }

  /// Rank `rank`'s queues. Throws Error naming the rank if out of range or if the group was
  /// built with lanes_per_rank == 0.
  [[nodiscard]] RankQueue& queue(std::uint32_t rank) {
    if (queues_.empty())
      throw Error(ErrorCode::invalid_argument, "this TpQuorum was built with lanes_per_rank = 0: it has no rank queues");
    if (rank >= world_)
      throw Error(ErrorCode::invalid_argument,
                  "rank " + std::to_string(rank) + " out of range: world size is " + std::to_string(world_));
    return *queues_[rank];
  }

  /// Visits every queued record, rank by rank: visitor(rank, record). Engine thread only;
  /// never blocks a producer; noexcept. Returns the number of records visited.
  template <class Visitor>
  std::size_t drain(Visitor& visitor) noexcept {
    std::size_t n = 0;
    for (auto& q : queues_) {
      auto bound = [&visitor, r = q->rank()](const auto& record) noexcept { visitor(r, record); };
      n += q->drain(bound);
    }
    return n;
  }

  /// Merges one load record that arrived from `source_rank`. Engine thread only; noexcept.
  /// `admit(key)` is asked only when the record would create a new pending entry; a key it
  /// refuses is late. A settled key goes to `sink` exactly once.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const CompletionRecord& r, Admit& admit, Sink& sink) noexcept {
    return merge_into(loads_, source_rank, r.rank, r.key, admit, sink, [&r](detail::LoadAcc& acc) noexcept {
      acc.failed |= !record_ok(r);
      acc.missed |= record_missed_state(r);
    });
  }

  /// Merges one store record that arrived from `source_rank`. As above.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const StoreRecord& r, Admit& admit, Sink& sink) noexcept {
    return merge_into(stores_, source_rank, r.rank, r.key, admit, sink, [&r](detail::StoreAcc& acc) noexcept {
      acc.not_stored |= !r.stored;
      acc.not_released |= !r.source_released;
    });
  }

  /// Merges a batch of records that arrived from `source_rank` (a transport's delivery).
  /// Returns how many settled a key. Engine thread only; noexcept.
  template <class Record, AdmitPolicy Admit, SettlementSink Sink>
  std::size_t ingest(std::uint32_t source_rank, std::span<const Record> records, Admit& admit, Sink& sink) noexcept {
    std::size_t settled = 0;
    for (const Record& r : records) settled += merge(source_rank, r, admit, sink) == MergeResult::settled ? 1 : 0;
    return settled;
  }

  /// Declares rank `rank` dead: it will never report again. From now on every key that has
  /// not heard from it gets a substitute report — load: failed (not missed, so it retracts
  /// nothing); store: not stored, source released (a dead rank reads nothing). A key whose
  /// only missing report was this rank's settles now, into `sink`; a key still waiting on
  /// a live rank settles (failed) when that rank reports, never earlier, because that rank
  /// may still be writing the destination. Later records from the rank are dropped and
  /// counted. Idempotent. Throws Error naming the rank if out of range; may allocate
  /// (std::bad_alloc). Engine thread only. O(pending).
  template <SettlementSink Sink>
  void mark_rank_dead(std::uint32_t rank, Sink& sink) {
    if (rank >= world_)
      throw Error(ErrorCode::invalid_argument,
                  "cannot mark rank " + std::to_string(rank) + " dead: world size is " + std::to_string(world_));
    const std::uint64_t bit = std::uint64_t{1} << rank;
    if ((dead_mask_ & bit) != 0) return;
    dead_mask_ |= bit;
    substitute_dead(loads_, bit, load_scratch_, sink);
    substitute_dead(stores_, bit, store_scratch_, sink);
  }

  /// Whether `rank` was marked dead. Engine thread.
  [[nodiscard]] bool is_dead(std::uint32_t rank) const noexcept {
    return rank < world_ && (dead_mask_ & (std::uint64_t{1} << rank)) != 0;
  }

  /// The time stamped on keys first seen from now on (for the oldest-pending gauge).
  /// SettlementPump calls it once per step. Engine thread; noexcept.
  void set_time(TimePoint now) noexcept { now_ = now; }

  /// Counters and gauges, O(1) in keys (O(world) for the queue counters). Engine thread.
  [[nodiscard]] GroupStats stats() const noexcept {
    GroupStats s = counters_;
    s.pending = loads_.pending();
    s.pending_stores = stores_.pending();
    s.tombstones = loads_.tombstones() + stores_.tombstones();
    s.world_size = world_;
    s.live_ranks = world_ - static_cast<std::uint32_t>(std::popcount(dead_mask_));
    s.oldest_pending_since = loads_.oldest_since();
    s.oldest_pending_store_since = stores_.oldest_since();
    for (const auto& q : queues_) {
      const RankQueueStats qs = q->stats();
      s.queues.drained += qs.drained;
      s.queues.full_waits += qs.full_waits;
      s.queues.sleeps += qs.sleeps;
      s.queues.wait_ns += qs.wait_ns;
      s.queues.dropped_after_close += qs.dropped_after_close;
    }
    return s;
  }

  /// Shutdown: closes every rank queue (see RankQueue::close). Thread-safe.
  void close() noexcept {
    for (auto& q : queues_) q->close();
  }

 private:
  static const TpQuorumConfig& check(const TpQuorumConfig& c) {
    if (c.world_size == 0 || c.world_size > 64)
      throw Error(ErrorCode::invalid_argument,
                  "TpQuorum world_size must be in 1..64, got " + std::to_string(c.world_size));
    if (c.tombstones == 0) throw Error(ErrorCode::invalid_argument, "TpQuorum tombstones must be >= 1, got 0");
    if (c.lanes_per_rank > 0 && c.lane_capacity == 0)
      throw Error(ErrorCode::invalid_argument, "TpQuorum lane_capacity must be > 0 records, got 0");
    return c;
  }

  static Settlement settlement(const LoadKey& key, const detail::LoadAcc& acc) noexcept {
    return Settlement{key, !acc.failed, acc.missed};
  }
  static StoreSettlement settlement(const StoreKey& key, const detail::StoreAcc& acc) noexcept {
    return StoreSettlement{key, !acc.not_stored, !acc.not_released};
  }
  static void substitute(detail::LoadAcc& acc) noexcept { acc.failed = true; }
  static void substitute(detail::StoreAcc& acc) noexcept { acc.not_stored = true; }

  template <class Key, class Acc, class Admit, class Sink, class Apply>
  MergeResult merge_into(detail::QuorumTable<Key, Acc>& table, std::uint32_t source_rank, std::uint32_t rank,
                         const Key& key, Admit& admit, Sink& sink, Apply&& apply) noexcept {
    ++counters_.records;
    if (rank >= world_ || rank != source_rank) {
      ++counters_.invalid_reports;
      return MergeResult::invalid;
    }
    const std::uint64_t bit = std::uint64_t{1} << rank;
    if ((dead_mask_ & bit) != 0) {
      ++counters_.dead_rank_reports;
      return MergeResult::dead_rank;
    }
    auto* e = table.find(key);
    if (e == nullptr) {
      // Not pending (a pending key is never tombstoned: it is tombstoned when it settles).
      // Tombstones are the fast path; `admit` (the index) is the truth (R3).
      if (table.tombstoned(key) || !static_cast<bool>(admit(key))) {
        ++counters_.late_reports;
        return MergeResult::late;
      }
      if ((dead_mask_ | bit) == all_mask_) {
        // This report is the only one the key waits for (one live rank): settle without
        // ever creating a pending entry.
        Acc acc{};
        if (dead_mask_ != 0) substitute(acc);
        apply(acc);
        finish_unentered(table, key, acc, sink);
        return MergeResult::settled;
      }
      e = table.create(key, now_);
      if (dead_mask_ != 0) {
        e->reported = dead_mask_;
        substitute(e->acc);
      }
    }
    apply(e->acc);
    if ((e->reported & bit) != 0) {
      ++counters_.duplicate_reports;
      return MergeResult::duplicate;
    }
    e->reported |= bit;
    if (e->reported != all_mask_) return MergeResult::counted;
    finish(table, key, *e, sink);
    return MergeResult::settled;
  }

  template <class Key, class Acc, class Sink>
  void finish(detail::QuorumTable<Key, Acc>& table, const Key& key, const typename detail::QuorumTable<Key, Acc>::Entry& e,
              Sink& sink) noexcept {
    const auto s = settlement(key, e.acc);
    table.settle(key);
    if constexpr (std::is_same_v<Key, LoadKey>) {
      ++counters_.settled;
    } else {
      ++counters_.store_settled;
    }
    sink(s);
  }

  template <class Key, class Acc, class Sink>
  void finish_unentered(detail::QuorumTable<Key, Acc>& table, const Key& key, const Acc& acc, Sink& sink) noexcept {
    table.tombstone(key);
    if constexpr (std::is_same_v<Key, LoadKey>) {
      ++counters_.settled;
    } else {
      ++counters_.store_settled;
    }
    sink(settlement(key, acc));
  }

  template <class Key, class Acc, class Sink>
  void substitute_dead(detail::QuorumTable<Key, Acc>& table, std::uint64_t bit, std::vector<Key>& scratch, Sink& sink) {
    table.keys_missing(bit, scratch);
    for (const Key& key : scratch) {
      auto* e = table.find(key);
      e->reported |= bit;
      substitute(e->acc);
      if (e->reported == all_mask_) finish(table, key, *e, sink);
    }
  }

  std::uint32_t world_;
  std::uint64_t all_mask_;
  std::uint64_t dead_mask_ = 0;
  TimePoint now_{};
  detail::QuorumTable<LoadKey, detail::LoadAcc> loads_;
  detail::QuorumTable<StoreKey, detail::StoreAcc> stores_;
  std::vector<std::unique_ptr<RankQueue>> queues_;
  std::vector<LoadKey> load_scratch_;
  std::vector<StoreKey> store_scratch_;
  GroupStats counters_{};
};

static_assert(CompletionGroup<TpQuorum>);

}  // namespace kvfuse
