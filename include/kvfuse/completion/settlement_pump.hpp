// kvfuse/completion/settlement_pump.hpp — the one engine-side object an engine calls per
// step: drain every rank's lane queues, merge through the group, settle into the index,
// and hand the scheduler one stream of answers.
//
//   auto step = pump.step();                                 // scheduler thread, once per step
//   for (const LoadResolution& r : step.resolutions)         // every load that ended, however
//     r.kind == Resolution::completed ? scheduler.resume(r.key) : scheduler.recompute(r.key);
//   for (const SaveSettlement& s : step.saves)
//     if (s.phase == SavePhase::released && s.ok) free_source(s.key);   // early block release
//
// One answer per question: `resolutions` is the index's resolution queue, drained — loads
// its ranks settled, loads the engine failed or abandoned by key, tickets dropped
// undispatched, orphans reclaimed. A scheduler that unparks from it cannot strand a request.
//
// The gate (R3). The index is the source of truth: a load record whose key has no pending
// entry is admitted only if index.is_in_flight(key) (in flight), a save record only if
// index.is_save_in_flight(key); otherwise it is late, dropped before it can create a
// partial entry that would wait forever. Tombstones are only the fast path in front of
// that check. Keys the index resolved without its ranks leave the group at the start of
// the next step (forget), so their later records are late too.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <kvfuse/completion/group.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/resolution.hpp>

namespace kvfuse {

/// What the pump needs from the engine's index (kvfuse::OffloadIndex models it):
///   is_in_flight(LoadKey) const noexcept -> bool     admit a load record (in flight)
///   is_save_in_flight(SaveKey) const noexcept -> bool admit a save record
///   settle(const Settlement&) -> bool                  a load its ranks settled
///   settle_save(const SaveSettlement&) -> bool         one phase of a save
///   drain_resolutions(vector&) noexcept                append the scheduler's stream; all or nothing
///   drain_forgotten(visitor)                           keys resolved without their ranks
///   for_each_load_in_flight(visitor) const             every load key in flight (when a rank dies)
///   for_each_save_in_flight(visitor) const             every save key in flight (when a rank dies)
///   last_issued() -> Generation                        for mark_rank_alive
/// Everything but last_issued is called from the pump's noexcept paths: it must not throw.
template <class I>
concept SettlementIndex = requires(I& index, const I& cindex, const LoadKey& key, const SaveKey& save_key,
                                   const Settlement& load, const SaveSettlement& save,
                                   std::vector<LoadResolution>& resolutions,
                                   void (*on_forgotten)(const LoadKey&) noexcept,
                                   void (*on_load)(const LoadKey&) noexcept, void (*on_save)(const SaveKey&) noexcept) {
  { cindex.is_in_flight(key) } noexcept -> std::convertible_to<bool>;
  { cindex.is_save_in_flight(save_key) } noexcept -> std::convertible_to<bool>;
  { index.settle(load) } -> std::convertible_to<bool>;
  { index.settle_save(save) } -> std::convertible_to<bool>;
  { index.drain_resolutions(resolutions) } noexcept;
  index.drain_forgotten(on_forgotten);
  cindex.for_each_load_in_flight(on_load);
  cindex.for_each_save_in_flight(on_save);
  { cindex.last_issued() } -> std::convertible_to<Generation>;
};

/// The pump's counters, next to the group's. `late_reports` comes first: every record or
/// settlement dropped as late anywhere on the path, as one number; the parts follow.
struct PumpStats {
  std::uint64_t late_reports = 0;      ///< group late + dead-rank reports + late settlements (R3)
  GroupStats group;                    ///< the merger's and the lane queues' counters (parts of the total)
  std::uint64_t late_settlements = 0;  ///< merged settlements the index no longer held (part of the total)
  std::uint64_t steps = 0;             ///< step() calls
  std::uint64_t forgotten = 0;         ///< keys dropped from the group because the index resolved them
  std::uint64_t dropped_saves = 0;     ///< save settlements the output could not hold (out of memory); their sources stay pinned
};

/// Drains a CompletionGroup, merges, and settles into a SettlementIndex. Holds references:
/// the group and the index must outlive it. Scheduler thread only (not thread-safe); the
/// lane queues inside the group are the only thread boundary. Non-copyable, non-movable.
template <CompletionGroup G, SettlementIndex I>
class SettlementPump {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  /// What one step produced. The spans stay valid until the next call to step, ingest,
  /// mark_rank_dead or mark_rank_alive.
  struct Step {
    std::span<const LoadResolution> resolutions;  ///< every load that ended since the last step: unpark from these
    std::span<const SaveSettlement> saves;        ///< save phases: free sources on released, and see stored
    std::size_t records = 0;                      ///< records drained from the lane queues by this step
  };

  /// `expected_settlements` sizes the output buffers, so steps below that size never
  /// allocate. May throw std::bad_alloc.
  SettlementPump(G& group, I& index, std::size_t expected_settlements = 4096) : group_(group), index_(index) {
    resolutions_.reserve(expected_settlements);
    saves_.reserve(expected_settlements);
  }
  SettlementPump(const SettlementPump&) = delete;
  SettlementPump& operator=(const SettlementPump&) = delete;

  /// One scheduler step: forgets keys the index resolved without their ranks, stamps `now`
  /// as the first-seen time of new pending keys, drains every lane queue once (a snapshot,
  /// so it returns while lanes keep pushing), merges each record, settles completed keys
  /// into the index, and returns the index's resolutions and every save settlement since
  /// the last step. Scheduler thread; noexcept; never blocks a lane; allocates only past
  /// the high-water marks (and returns what fit if that fails).
  Step step(TimePoint now = std::chrono::steady_clock::now()) noexcept {
    begin_output();
    ++steps_;
    forget_resolved();
    // While every rank is dead, a key dispatched since the last sweep is owed by nobody.
    if (world_dead_ && std::as_const(index_).last_issued() != swept_through_) settle_unowed();
    group_.set_time(now);
    Drain drain{this};
    const std::size_t n = group_.drain(drain);
    collect_resolutions();
    handed_out_ = true;
    return Step{std::span<const LoadResolution>(resolutions_), std::span<const SaveSettlement>(saves_), n};
  }

  /// Merges records that reached the engine by another transport (RPC, shared memory),
  /// e.g. decoded with from_bytes. `rank` is the rank they came from; a record naming
  /// another rank is invalid and dropped. Results come out of the next step(). noexcept.
  void ingest(std::uint32_t rank, std::span<const CompletionRecord> records) noexcept { ingest_batch(rank, records); }
  void ingest(std::uint32_t rank, std::span<const SaveRecord> records) noexcept { ingest_batch(rank, records); }

  /// Declares `rank` dead (see TpQuorum::mark_rank_dead); keys it unblocks settle into the
  /// index now and come out of the next step(). That includes every load and save in
  /// flight that no live rank owes a report any more, reported by anyone or not: when the
  /// last rank counted for a key dies, the key settles (failed; a save released and not
  /// stored) instead of waiting forever. The one way to handle a dead rank: the index's
  /// fail/fail_all are not. Cost: O(pending keys in the group + loads and saves in flight),
  /// paid only here (and at a step while every rank is dead), never on a record's path.
  /// Throws Error naming a rank out of range; may allocate. Scheduler thread.
  void mark_rank_dead(std::uint32_t rank) {
    begin_output();
    forget_resolved();
    Sink sink{this};
    group_.mark_rank_dead(rank, sink);
    world_dead_ = group_.stats().live_ranks == 0;
    settle_unowed();
  }

  /// `rank` is back: it counts for every load and save the index issues from now on; its
  /// records for keys issued before are dropped (see TpQuorum::mark_rank_alive). If every
  /// rank was dead, the keys dispatched since the last sweep are owed by nobody — the rank
  /// that returns does not count for them — so they settle now (out of the next step), before
  /// the world is alive again and the step's sweep would pass them by. Throws Error naming a
  /// rank out of range; may allocate. Scheduler thread.
  void mark_rank_alive(std::uint32_t rank) {
    if (world_dead_ && std::as_const(index_).last_issued() != swept_through_) {
      begin_output();
      forget_resolved();
      settle_unowed();
    }
    group_.mark_rank_alive(rank, Generation{std::as_const(index_).last_issued().value + 1});
    world_dead_ = group_.stats().live_ranks == 0;
  }

  /// Counters. Scheduler thread; O(1) in keys.
  [[nodiscard]] PumpStats stats() const noexcept {
    PumpStats s;
    s.group = group_.stats();
    s.late_settlements = late_settlements_;
    s.late_reports = s.group.late_reports + s.group.dead_rank_reports + late_settlements_;
    s.steps = steps_;
    s.forgotten = forgotten_;
    s.dropped_saves = dropped_outputs_;
    return s;
  }

  [[nodiscard]] G& group() noexcept { return group_; }
  [[nodiscard]] I& index() noexcept { return index_; }

 private:
  struct Admit {
    SettlementPump* self;
    bool operator()(LoadKey key) const noexcept {
      return static_cast<bool>(std::as_const(self->index_).is_in_flight(key));
    }
    bool operator()(SaveKey key) const noexcept {
      return static_cast<bool>(std::as_const(self->index_).is_save_in_flight(key));
    }
  };

  struct Sink {
    SettlementPump* self;
    void operator()(const Settlement& s) noexcept {
      if (!static_cast<bool>(self->index_.settle(s))) ++self->late_settlements_;
    }
    // Every save settlement goes back to the engine, even one the index no longer
    // tracks: the source units it releases must be freed either way.
    void operator()(const SaveSettlement& s) noexcept {
      if (!static_cast<bool>(self->index_.settle_save(s))) ++self->late_settlements_;
      try {
        self->saves_.push_back(s);
      } catch (...) {
        ++self->dropped_outputs_;
      }
    }
  };

  struct Drain {
    SettlementPump* self;
    template <class Record>
    void operator()(std::uint32_t rank, const Record& r) noexcept {
      Admit admit{self};
      Sink sink{self};
      (void)self->group_.merge(rank, r, admit, sink);
    }
  };

  template <class Record>
  void ingest_batch(std::uint32_t rank, std::span<const Record> records) noexcept {
    begin_output();
    forget_resolved();
    Drain drain{this};
    for (const Record& r : records) drain(rank, r);
  }

  // Offers every key in flight to the group's settle_if_unowed. The keys are copied out
  // first: settling one takes it out of the index's in-flight set. If the copy cannot
  // grow, what fit is offered and the next sweep offers the rest.
  void settle_unowed() noexcept {
    unowed_loads_.clear();
    unowed_saves_.clear();
    bool complete = true;
    const auto keep = [&complete](auto& into, const auto& key) noexcept {
      try {
        into.push_back(key);
      } catch (...) {
        complete = false;
      }
    };
    std::as_const(index_).for_each_load_in_flight([&](const LoadKey& key) noexcept { keep(unowed_loads_, key); });
    std::as_const(index_).for_each_save_in_flight([&](const SaveKey& key) noexcept { keep(unowed_saves_, key); });
    Sink sink{this};
    for (const LoadKey& key : unowed_loads_) (void)group_.settle_if_unowed(key, sink);
    for (const SaveKey& key : unowed_saves_) (void)group_.settle_if_unowed(key, sink);
    swept_through_ = complete ? std::as_const(index_).last_issued() : Generation{};
  }

  void forget_resolved() noexcept {
    forgotten_ += index_.drain_forgotten([this](const LoadKey& key) noexcept { group_.forget(key); });
  }

  // Moves the index's queued resolutions into the step's output. If the output cannot
  // grow, they stay queued in the index for the next step: nothing is lost.
  void collect_resolutions() noexcept { (void)index_.drain_resolutions(resolutions_); }

  // Output buffers are cleared lazily, on the first new result after a step handed them out.
  void begin_output() noexcept {
    if (!handed_out_) return;
    resolutions_.clear();
    saves_.clear();
    handed_out_ = false;
  }

  G& group_;
  I& index_;
  std::vector<LoadResolution> resolutions_;
  std::vector<SaveSettlement> saves_;
  std::vector<LoadKey> unowed_loads_;  // settle_unowed's copies of the keys in flight
  std::vector<SaveKey> unowed_saves_;
  Generation swept_through_{};         // the last generation settle_unowed offered
  bool world_dead_ = false;            // every rank is dead: new keys are owed by nobody
  bool handed_out_ = false;
  std::uint64_t steps_ = 0;
  std::uint64_t late_settlements_ = 0;
  std::uint64_t forgotten_ = 0;
  std::uint64_t dropped_outputs_ = 0;
};

}  // namespace kvfuse
