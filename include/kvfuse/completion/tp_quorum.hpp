// kvfuse/completion/tp_quorum.hpp — the tensor-parallel group: each rank's lane queues on
// the rank side, the failure-dominant quorum on the engine side (R3, R4, R20).
//
// A key is owed a report by every rank counted for it (alive when it was issued) that is
// still alive. It settles when every rank in the world has a report in: its own record, or
// the substitute that stands in for a rank that is dead (mark_rank_dead) or was dead when
// the key was issued (mark_rank_alive counts a returned rank only for later generations).
// A key no live rank owes any more settles at once, even if nobody reported it
// (settle_if_unowed, which SettlementPump calls for every key in flight when a rank dies).
// The merge:
//   load:  ok           iff every rank's record is record_ok (all legs succeeded); a dead
//                       rank's substitute is a failure
//          state_missed iff some rank reported StateOutcome::missed
//                       (KV failure, transfer failure, refusal, `none`: never retract)
//   save:  two phases, each settling on its own:
//          released ok  iff every rank confirmed nothing reads the source (early block release);
//                       a dead rank reads nothing
//          stored ok    iff every live rank stored, and at least one did (a rank that comes
//                       back without the entry misses, and a genuine miss retracts, R5)
// A second report from a rank never counts twice; it is merged failure-dominantly, so a
// failure is never overwritten by a later success. Settled keys are tombstoned in a
// bounded FIFO; later reports for them are late and dropped. Pending keys never expire:
// liveness comes from R1 (every rank reports every dispatch), mark_rank_dead, and forget()
// for a key the index resolved without its ranks.
#pragma once

#include <bit>
#include <algorithm>
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
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Shape of a TpQuorum. Checked at construction: a bad value throws kvfuse::Error
/// (invalid_argument) naming it.
struct TpQuorumOptions {
  std::uint32_t world_size = 1;        ///< ranks, 1..64
  std::size_t lanes_per_rank = 3;      ///< producing lanes per rank; 0 = no in-process queues (records
                                       ///< arrive through SettlementPump::ingest from a transport)
  std::size_t lane_capacity = 4096;    ///< records per lane queue (> 0 when lanes_per_rank > 0)
  std::size_t tombstones = 4096;       ///< settled keys remembered per record type, >= 1
  std::size_t expected_pending = 4096; ///< pending keys the tables hold before their first growth
  Backoff backoff{};                   ///< how a producer waits on a full lane queue
};

/// The TP group. Rank side: emitter(rank, lane) hands out LaneEmitters over per-rank
/// RankQueues. Engine side: drain + merge + mark_rank_dead, all from one scheduler thread
/// (not thread-safe; the queues are the only thread boundary). Non-copyable, non-movable.
class TpQuorum {
 public:
  using Emitter = LaneEmitter;
  using TimePoint = std::chrono::steady_clock::time_point;

  /// Throws Error(invalid_argument) naming the value for world_size outside 1..64,
  /// tombstones == 0, or lane_capacity == 0 with lanes.
  explicit TpQuorum(TpQuorumOptions config)
      : world_(check(config).world_size),
        all_mask_(world_ == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << world_) - 1),
        loads_(config.tombstones, config.expected_pending),
        saves_(config.tombstones, config.expected_pending),
        revived_from_(world_) {
    if (config.lanes_per_rank > 0) {
      queues_.reserve(world_);
      for (std::uint32_t r = 0; r < world_; ++r)
        queues_.push_back(std::make_unique<RankQueue>(
            r, RankQueueOptions{config.lanes_per_rank, config.lane_capacity, config.backoff}));
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

  /// Visits every queued record, rank by rank: visitor(rank, record). Scheduler thread only;
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

  /// Merges one load record that arrived from `source_rank`. Scheduler thread only; noexcept.
  /// `admit(key)` is asked only when the record would create a new pending entry; a key it
  /// refuses is late. A settled key goes to `sink` exactly once.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const CompletionRecord& r, Admit& admit, Sink& sink) noexcept {
    const MergeResult gate = gate_record(source_rank, r.rank, r.key.generation);
    if (gate != MergeResult::counted) return gate;
    const std::uint64_t bit = std::uint64_t{1} << r.rank;
    auto* e = loads_.find(r.key);
    if (e == nullptr) {
      // Not pending (a pending key is never tombstoned: it is tombstoned when it settles).
      // Tombstones are the fast path; `admit` (the index) is the truth (R3).
      if (loads_.tombstoned(r.key) || !static_cast<bool>(admit(r.key))) {
        ++counters_.late_reports;
        return MergeResult::late;
      }
      const std::uint64_t absent = absent_for(r.key.generation);
      if ((absent | bit) == all_mask_) {
        // This report is the only one the key waits for (one live rank): settle without
        // ever creating a pending entry.
        loads_.tombstone(r.key);
        ++counters_.settled;
        sink(Settlement{r.key, record_ok(r) && absent == 0, record_missed_state(r), absent == 0 ? r.kv_restored : 0});
        return MergeResult::settled;
      }
      e = loads_.create(r.key, now_);
      e->reported = absent;
      e->acc.failed = absent != 0;
      if (absent != 0) e->acc.restored = 0;  // a rank that never got the load filled none of its blocks
    }
    e->acc.failed |= !record_ok(r);
    e->acc.missed |= record_missed_state(r);
    e->acc.restored = std::min(e->acc.restored, r.kv_restored);  // salvage: what every rank holds
    if ((e->reported & bit) != 0) {
      ++counters_.duplicate_reports;
      return MergeResult::duplicate;
    }
    e->reported |= bit;
    if (e->reported != all_mask_) return MergeResult::counted;
    const Settlement s{r.key, !e->acc.failed, e->acc.missed, e->acc.kv_restored()};
    loads_.settle(r.key);
    ++counters_.settled;
    sink(s);
    return MergeResult::settled;
  }

  /// Merges one save record that arrived from `source_rank`. Its phase settles on its own:
  /// `released` when every rank released, `stored` when every rank stored; the key leaves
  /// the table once both phases settled. Scheduler thread only; noexcept.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t source_rank, const SaveRecord& r, Admit& admit, Sink& sink) noexcept {
    const MergeResult gate = gate_record(source_rank, r.rank, r.key.generation);
    if (gate != MergeResult::counted) return gate;
    const std::uint64_t bit = std::uint64_t{1} << r.rank;
    auto* e = saves_.find(r.key);
    if (e == nullptr) {
      if (saves_.tombstoned(r.key) || !static_cast<bool>(admit(r.key))) {
        ++counters_.late_reports;
        return MergeResult::late;
      }
      e = saves_.create(r.key, now_);
      e->reported = e->acc.released = absent_for(r.key.generation);
    }
    const bool released = r.phase == SavePhase::released;
    std::uint64_t& mask = released ? e->acc.released : e->reported;
    if (released) {
      e->acc.not_released |= !r.ok;
    } else {
      e->acc.not_stored |= !r.ok;
      e->acc.any_stored |= r.ok;
    }
    if ((mask & bit) != 0) {
      ++counters_.duplicate_reports;
      return MergeResult::duplicate;
    }
    mask |= bit;
    return advance_save(r.key, *e, sink) ? MergeResult::settled : MergeResult::counted;
  }

  /// Merges a batch of records that arrived from `source_rank` (a transport's delivery).
  /// Returns how many settled a key. Scheduler thread only; noexcept.
  template <class Record, AdmitPolicy Admit, SettlementSink Sink>
  std::size_t ingest(std::uint32_t source_rank, std::span<const Record> records, Admit& admit, Sink& sink) noexcept {
    std::size_t settled = 0;
    for (const Record& r : records) settled += merge(source_rank, r, admit, sink) == MergeResult::settled ? 1 : 0;
    return settled;
  }

  /// Declares rank `rank` dead: it will not report again until mark_rank_alive. From now
  /// on every key that has not heard from it gets a substitute report — load: failed (not
  /// missed, so it retracts nothing); save: released (a dead rank reads nothing), and
  /// neutral for `stored` (the save is stored if every live rank stored it). A pending key
  /// whose only missing report was this rank's settles now, into `sink`; a key still
  /// waiting on a live rank settles when that rank reports, never earlier, because that
  /// rank may still be writing the destination. Keys nobody reported yet are not pending
  /// here: settle_if_unowed settles those no live rank owes. Later records from the rank
  /// are dropped and counted. Idempotent. Throws Error naming the rank if out of range;
  /// may allocate (std::bad_alloc). Scheduler thread only. O(pending).
  template <SettlementSink Sink>
  void mark_rank_dead(std::uint32_t rank, Sink& sink) {
    check_rank(rank, "dead");
    const std::uint64_t bit = std::uint64_t{1} << rank;
    if ((dead_mask_ & bit) != 0) return;
    dead_mask_ |= bit;
    load_scratch_.clear();
    loads_.collect([bit](const LoadKey&, const auto& e) noexcept { return (e.reported & bit) == 0; }, load_scratch_);
    for (const LoadKey& key : load_scratch_) {
      auto* e = loads_.find(key);
      e->reported |= bit;
      e->acc.failed = true;
      e->acc.restored = 0;  // it died before saying what it restored: nothing can be counted on
      if (e->reported == all_mask_) {
        const Settlement s{key, false, e->acc.missed, e->acc.kv_restored()};
        loads_.settle(key);
        ++counters_.settled;
        sink(s);
      }
    }
    saves_.collect([bit](const SaveKey&, const auto& e) noexcept { return ((e.reported & e.acc.released) & bit) == 0; },
                   save_scratch_);
    for (const SaveKey& key : save_scratch_) {
      auto* e = saves_.find(key);
      e->reported |= bit;
      e->acc.released |= bit;
      (void)advance_save(key, *e, sink);
    }
  }

  /// Settles `key` — an in-flight load no rank reported yet — if no live rank owes it a
  /// report any more: every rank counted for it died (at once, or one by one with each
  /// brought back, a rolling restart). It settles failed (never missed). Returns whether
  /// it settled; false, changing nothing, for a key some live rank still owes, a key with
  /// reports (mark_rank_dead already substituted for it) or a settled key. Call it only for
  /// keys the index holds in flight (SettlementPump does, after every mark_rank_dead).
  /// Scheduler thread only; noexcept; O(1).
  template <SettlementSink Sink>
  bool settle_if_unowed(const LoadKey& key, Sink& sink) noexcept {
    if (loads_.find(key) != nullptr || loads_.tombstoned(key) || absent_for(key.generation) != all_mask_) return false;
    loads_.tombstone(key);
    ++counters_.settled;
    sink(Settlement{key, false, false});
    return true;
  }

  /// The same for a save no rank reported yet: both phases settle now, `released` ok (a
  /// dead rank reads nothing) and `stored` not ok (no rank stored it). Scheduler thread
  /// only; noexcept; O(1).
  template <SettlementSink Sink>
  bool settle_if_unowed(const SaveKey& key, Sink& sink) noexcept {
    if (saves_.find(key) != nullptr || saves_.tombstoned(key) || absent_for(key.generation) != all_mask_) return false;
    saves_.tombstone(key);
    counters_.save_settled += 2;
    sink(SaveSettlement{key, SavePhase::released, true});
    sink(SaveSettlement{key, SavePhase::stored, false});
    return true;
  }

  /// Rank `rank` is back (restarted): it counts again for every load and save whose
  /// generation is `first_counted` or later, i.e. issued after it returned. Keys issued
  /// before stay substituted for it, and its records for them are dropped as dead-rank
  /// reports: a restarted rank lost what it was doing, and a record it sent before it died
  /// must not count. No-op for a live rank. Throws Error naming the rank if out of range.
  /// Scheduler thread only; O(1).
  void mark_rank_alive(std::uint32_t rank, Generation first_counted) {
    check_rank(rank, "alive");
    const std::uint64_t bit = std::uint64_t{1} << rank;
    if ((dead_mask_ & bit) == 0) return;
    dead_mask_ &= ~bit;
    revived_from_[rank] = first_counted;
    revived_mask_ |= bit;
  }

  /// The index resolved `key` without its ranks (reclaimed, failed or abandoned by key):
  /// its pending entry goes, and later records for it are late (R3). O(1); noexcept.
  /// Scheduler thread only.
  void forget(const LoadKey& key) noexcept {
    if (loads_.find(key) != nullptr) ++counters_.forgotten;
    loads_.settle(key);
  }

  /// Whether `rank` was marked dead. Scheduler thread.
  [[nodiscard]] bool is_dead(std::uint32_t rank) const noexcept {
    return rank < world_ && (dead_mask_ & (std::uint64_t{1} << rank)) != 0;
  }

  /// The time stamped on keys first seen from now on (for the oldest-pending gauge).
  /// SettlementPump calls it once per step. Scheduler thread; noexcept.
  void set_time(TimePoint now) noexcept { now_ = now; }

  /// Counters and gauges, O(1) in keys (O(world) for the queue counters). Scheduler thread.
  [[nodiscard]] GroupStats stats() const noexcept {
    GroupStats s = counters_;
    s.pending = loads_.pending();
    s.pending_saves = saves_.pending();
    s.tombstones = loads_.tombstones() + saves_.tombstones();
    s.world_size = world_;
    s.live_ranks = world_ - static_cast<std::uint32_t>(std::popcount(dead_mask_));
    s.oldest_pending_since = loads_.oldest_since();
    s.oldest_pending_save_since = saves_.oldest_since();
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
  static const TpQuorumOptions& check(const TpQuorumOptions& c) {
    if (c.world_size == 0 || c.world_size > 64)
      throw Error(ErrorCode::invalid_argument,
                  "TpQuorum world_size must be in 1..64, got " + std::to_string(c.world_size));
    if (c.tombstones == 0) throw Error(ErrorCode::invalid_argument, "TpQuorum tombstones must be >= 1, got 0");
    if (c.lanes_per_rank > 0 && c.lane_capacity == 0)
      throw Error(ErrorCode::invalid_argument, "TpQuorum lane_capacity must be > 0 records, got 0");
    return c;
  }

  void check_rank(std::uint32_t rank, const char* what) const {
    if (rank >= world_)
      throw Error(ErrorCode::invalid_argument, "cannot mark rank " + std::to_string(rank) + " " + what +
                                                   ": world size is " + std::to_string(world_));
  }

  // Ranks that do not report for a key of generation g: the dead, and the returned whose
  // return came after g was issued. O(1) unless some rank has come back.
  [[nodiscard]] std::uint64_t absent_for(Generation g) const noexcept {
    std::uint64_t absent = dead_mask_;
    for (std::uint64_t m = revived_mask_; m != 0; m &= m - 1) {
      const int r = std::countr_zero(m);
      if (g < revived_from_[static_cast<std::size_t>(r)]) absent |= std::uint64_t{1} << r;
    }
    return absent;
  }

  // The checks every record passes before it reaches a table: `counted` lets it through.
  MergeResult gate_record(std::uint32_t source_rank, std::uint32_t rank, Generation g) noexcept {
    ++counters_.records;
    if (rank >= world_ || rank != source_rank) {
      ++counters_.invalid_reports;
      return MergeResult::invalid;
    }
    if ((absent_for(g) & (std::uint64_t{1} << rank)) != 0) {
      ++counters_.dead_rank_reports;
      return MergeResult::dead_rank;
    }
    return MergeResult::counted;
  }

  // Emits each phase of a save that became complete; the key leaves once both did.
  // Returns whether anything settled.
  template <class Sink>
  bool advance_save(const SaveKey& key, detail::QuorumTable<SaveKey, detail::SaveAcc>::Entry& e, Sink& sink) noexcept {
    bool settled = false;
    if (!e.acc.released_settled && e.acc.released == all_mask_) {
      e.acc.released_settled = true;
      ++counters_.save_settled;
      sink(SaveSettlement{key, SavePhase::released, !e.acc.not_released});
      settled = true;
    }
    if (e.reported == all_mask_ && e.acc.released_settled) {
      const SaveSettlement stored{key, SavePhase::stored, e.acc.any_stored && !e.acc.not_stored};
      saves_.settle(key);
      ++counters_.save_settled;
      sink(stored);
      settled = true;
    }
    return settled;
  }

  std::uint32_t world_;
  std::uint64_t all_mask_;
  std::uint64_t dead_mask_ = 0;
  std::uint64_t revived_mask_ = 0;  // ranks that came back: they count from revived_from_[r] on
  TimePoint now_{};
  detail::QuorumTable<LoadKey, detail::LoadAcc> loads_;
  detail::QuorumTable<SaveKey, detail::SaveAcc> saves_;
  std::vector<Generation> revived_from_;
  std::vector<std::unique_ptr<RankQueue>> queues_;
  std::vector<LoadKey> load_scratch_;
  std::vector<SaveKey> save_scratch_;
  GroupStats counters_{};
};

static_assert(CompletionGroup<TpQuorum>);

}  // namespace kvfuse
