// kvfuse/completion/group.hpp — the two halves of a completion group, as concepts.
//
// A group turns per-rank records into one settlement per key (docs/reference.md#groups):
//   * rank side: an Emitter (RecordEmitter) that a lane writes its records into;
//   * engine side: a merger that takes drained records and produces Settlements.
// The worker-side Connector sees only `typename G::Emitter`; the engine side sees the
// merger through SettlementPump. Shipped models: SingleRank, TpQuorum.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>

#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/bridge/records.hpp>

namespace kvfuse {

/// What a merger did with one record. Every record ends in exactly one of these.
enum class MergeResult : std::uint8_t {
  counted = 0,    ///< first report of this rank for a pending key; the key still waits for others
  settled = 1,    ///< this report completed the key: its settlement went to the sink
  duplicate = 2,  ///< a second report of the same rank for a pending key: merged failure-dominantly, not counted
  late = 3,       ///< the key is settled, unknown or reclaimed: dropped, counted in late_reports (R3)
  invalid = 4,    ///< rank out of range, or not the rank it arrived from: dropped, counted
  dead_rank = 5,  ///< from a rank marked dead: dropped (its substitute failure stands), counted
};

/// Counters and gauges of a group. O(1) to read (no structure is walked, R17).
struct GroupStats {
  std::uint64_t records = 0;            ///< records offered to the merger (loads and stores)
  std::uint64_t settled = 0;            ///< load settlements produced
  std::uint64_t save_settled = 0;       ///< save settlements produced (one per phase)
  std::uint64_t late_reports = 0;       ///< records for settled / unknown / reclaimed keys, dropped (R3)
  std::uint64_t duplicate_reports = 0;  ///< second reports of a rank for a still-pending key
  std::uint64_t invalid_reports = 0;    ///< records with a rank out of range or from the wrong source
  std::uint64_t dead_rank_reports = 0;  ///< records from ranks dead for their key, dropped
  std::uint64_t forgotten = 0;          ///< pending load keys dropped because the index resolved them (forget)
  std::uint64_t pending = 0;            ///< load keys heard from some rank but not yet all (never expire)
  std::uint64_t pending_saves = 0;      ///< save keys heard from some rank but not yet settled in both phases
  std::uint64_t tombstones = 0;         ///< settled keys (loads + stores) held in the bounded FIFOs now
  std::uint32_t world_size = 0;
  std::uint32_t live_ranks = 0;
  /// When the oldest pending load / save key was first reported (the group's clock, see
  /// set_time); empty when nothing is pending.
  std::optional<std::chrono::steady_clock::time_point> oldest_pending_since;
  std::optional<std::chrono::steady_clock::time_point> oldest_pending_save_since;
  RankQueueStats queues;  ///< lane-queue counters summed over every rank (full waits: R20)

  /// Age of the oldest pending key (load or save) at `now`; zero when nothing is pending.
  [[nodiscard]] std::chrono::steady_clock::duration oldest_pending_age(
      std::chrono::steady_clock::time_point now) const noexcept {
    std::optional<std::chrono::steady_clock::time_point> oldest = oldest_pending_since;
    if (oldest_pending_save_since && (!oldest || *oldest_pending_save_since < *oldest))
      oldest = oldest_pending_save_since;
    return oldest && now > *oldest ? now - *oldest : std::chrono::steady_clock::duration::zero();
  }
};

namespace detail {
// Archetypes: the weakest types a group must accept, used only to state the concepts.
struct AdmitArchetype {
  bool operator()(LoadKey) const noexcept;
  bool operator()(SaveKey) const noexcept;
};
struct SinkArchetype {
  void operator()(const Settlement&) noexcept;
  void operator()(const SaveSettlement&) noexcept;
};
struct DrainArchetype {
  void operator()(std::uint32_t rank, const CompletionRecord&) noexcept;
  void operator()(std::uint32_t rank, const SaveRecord&) noexcept;
};
}  // namespace detail

/// A rank-side record sink: `e.emit(const CompletionRecord&) noexcept` and
/// `e.emit(const SaveRecord&) noexcept`. Contract beyond the signatures: called from exactly
/// one producing thread (the lane that owns the emitter); never loses a record; never blocks
/// on the consumer except the counted back-off of a full queue.
template <class E>
concept RecordEmitter = requires(E& e, const CompletionRecord& load, const SaveRecord& save) {
  { e.emit(load) } noexcept;
  { e.emit(save) } noexcept;
};

/// An engine-side admission predicate: admit(LoadKey) / admit(SaveKey) -> bool, noexcept.
/// It is asked only before a key's first record would create a pending entry (R3).
template <class A>
concept AdmitPolicy = requires(A& admit, LoadKey load, SaveKey save) {
  { admit(load) } noexcept -> std::convertible_to<bool>;
  { admit(save) } noexcept -> std::convertible_to<bool>;
};

/// An engine-side receiver of settlements: sink(const Settlement&) and
/// sink(const SaveSettlement&), noexcept. Called once per settled key.
template <class S>
concept SettlementSink = requires(S& sink, const Settlement& load, const SaveSettlement& save) {
  { sink(load) } noexcept;
  { sink(save) } noexcept;
};

/// A completion group: G::Emitter models RecordEmitter, plus the engine-side merger.
///   world_size()                       ranks in the group
///   emitter(rank, lane)                claims a lane's producer handle (throws kvfuse::Error)
///   drain(visitor)                     visitor(rank, record) for every queued record; scheduler thread
///   merge(source_rank, record, admit, sink)   one record into the merge; scheduler thread, noexcept
///   mark_rank_dead(rank, sink)         stop waiting on `rank`; scheduler thread
///   settle_if_unowed(key, sink)        settle an in-flight load or save key no live rank owes a report
///                                      (nobody reported it, and every rank counted for it died); noexcept
///   mark_rank_alive(rank, generation)  count `rank` again for keys from `generation` on; scheduler thread
///   forget(load_key)                   drop a key the index resolved without its ranks; scheduler thread, noexcept
///   set_time(now)                      the time stamped on keys first seen from now on
///   stats()                            GroupStats, O(1)
template <class G>
concept CompletionGroup =
    requires { typename G::Emitter; } && RecordEmitter<typename G::Emitter> &&
    requires(G& g, const G& cg, std::uint32_t rank, std::size_t lane, const LoadKey& load_key, const SaveKey& save_key,
             const CompletionRecord& load, const SaveRecord& save, detail::AdmitArchetype& admit,
             detail::SinkArchetype& sink, detail::DrainArchetype& visitor, std::chrono::steady_clock::time_point now) {
      { cg.world_size() } noexcept -> std::same_as<std::uint32_t>;
      { g.emitter(rank, lane) } -> std::same_as<typename G::Emitter>;
      { g.drain(visitor) } noexcept -> std::same_as<std::size_t>;
      { g.merge(rank, load, admit, sink) } noexcept -> std::same_as<MergeResult>;
      { g.merge(rank, save, admit, sink) } noexcept -> std::same_as<MergeResult>;
      g.mark_rank_dead(rank, sink);
      { g.settle_if_unowed(load_key, sink) } noexcept -> std::same_as<bool>;
      { g.settle_if_unowed(save_key, sink) } noexcept -> std::same_as<bool>;
      g.mark_rank_alive(rank, Generation{});
      { g.forget(load_key) } noexcept;
      { g.set_time(now) } noexcept;
      { cg.stats() } noexcept -> std::same_as<GroupStats>;
    };

/// Admits every key: for using a merger without an index (tests, tools). With it, R3's
/// guarantee rests on tombstones alone, which are bounded; engines use SettlementPump.
struct AdmitAll {
  constexpr bool operator()(LoadKey) const noexcept { return true; }
  constexpr bool operator()(SaveKey) const noexcept { return true; }
};

}  // namespace kvfuse
