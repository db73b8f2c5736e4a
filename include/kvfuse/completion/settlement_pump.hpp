// kvfuse/completion/settlement_pump.hpp — the one engine-side object an engine calls per
// step: drain every rank's lane queues, merge through the group, settle into the index.
//
//   auto step = pump.step();                         // engine thread, once per scheduler step
//   for (const Settlement& s : step.loads)  scheduler.unpark(s.key, s.ok);
//   for (const StoreSettlement& s : step.stores)
//     if (s.source_released) free_source(s.key);     // early block release (DESIGN section 5)
//
// The gate (R3). The index is the source of truth for loads: a record whose key has no
// pending entry yet is admitted only if index.is_outstanding(key); otherwise it is late,
// dropped before it can create a partial quorum entry that would wait forever. Tombstones
// are only the fast path in front of that check. For saves the engine calls
// expect_store(key) when it submits one; store records for keys it was not told about (or
// that already settled) are late. If the index can answer is_store_outstanding(StoreKey),
// that answer is the truth; otherwise the pump keeps the set of expected saves itself.
// expect_store also forwards to index.note_store_attempted(key) when the index has it
// (kvfuse::OffloadIndex does), so the engine announces a save in one place.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <kvfuse/completion/detail/flat_table.hpp>
#include <kvfuse/completion/detail/quorum_table.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/records.hpp>
#include <kvfuse/engine/store_request.hpp>

namespace kvfuse {

/// What the pump needs from the engine's index (kvfuse::OffloadIndex models it):
///   is_outstanding(LoadKey) const noexcept -> bool   the truth for admitting a load record
///   settle(const Settlement&) -> bool                 ok: complete; else fail(key, state_missed);
///                                                     false if the key was not outstanding
///   settle_store(const StoreSettlement&)              stored: note_stored(hash)
/// settle and settle_store are called from the pump's noexcept paths: they must not throw.
template <class I>
concept SettlementIndex = requires(I& index, const I& cindex, const LoadKey& key, const Settlement& load,
                                   const StoreSettlement& store) {
  { cindex.is_outstanding(key) } noexcept -> std::convertible_to<bool>;
  { index.settle(load) } -> std::convertible_to<bool>;
  index.settle_store(store);
};

/// An index that tracks submitted saves itself and can say which are still outstanding.
/// Optional: with it, the pump keeps no expected-save set of its own.
template <class I>
concept StoreTrackingIndex = requires(const I& cindex, const StoreKey& key) {
  { cindex.is_store_outstanding(key) } noexcept -> std::convertible_to<bool>;
};

/// An index that wants to hear about submitted saves (OffloadIndex::note_store_attempted).
template <class I>
concept StoreNotingIndex = requires(I& index, const StoreKey& key) { index.note_store_attempted(key); };

/// An index that also wants to know what each save holds (OffloadIndex: only state saves
/// index their hash).
template <class I>
concept SaveKindNotingIndex =
    requires(I& index, const StoreKey& key, SaveKind kind) { index.note_store_attempted(key, kind); };

/// The pump's own counters, next to the group's.
struct PumpStats {
  GroupStats group;                     ///< the merger's and the lane queues' counters
  std::uint64_t steps = 0;              ///< step() calls
  std::uint64_t late_settlements = 0;   ///< quorums completed for keys the index no longer held (reclaimed meanwhile)
  std::uint64_t expected_stores = 0;    ///< saves announced by expect_store and not yet settled
  /// All records dropped as late: the group's (tombstoned / not admitted) plus late settlements.
  [[nodiscard]] std::uint64_t late_reports() const noexcept { return group.late_reports + late_settlements; }
};

/// Drains a CompletionGroup, merges, and settles into a SettlementIndex. Holds references:
/// the group and the index must outlive it. Engine thread only (not thread-safe); the lane
/// queues inside the group are the only thread boundary. Non-copyable, non-movable.
template <CompletionGroup G, SettlementIndex I>
class SettlementPump {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  /// What settled since the previous step(): load settlements the index accepted (unpark
  /// these) and every store settlement (free sources where source_released). The spans stay
  /// valid until the next call to step, ingest or mark_rank_dead.
  struct Step {
    std::span<const Settlement> loads;
    std::span<const StoreSettlement> stores;
    std::size_t records = 0;  ///< records drained from the lane queues by this step
  };

  /// `expected_settlements` sizes the output buffers and the expected-save set, so steps
  /// below that size never allocate. May throw std::bad_alloc.
  SettlementPump(G& group, I& index, std::size_t expected_settlements = 4096)
      : group_(group), index_(index), expected_(expected_settlements) {
    loads_.reserve(expected_settlements);
    stores_.reserve(expected_settlements);
  }
  SettlementPump(const SettlementPump&) = delete;
  SettlementPump& operator=(const SettlementPump&) = delete;

  /// One engine step: stamps `now` as the first-seen time of new pending keys, drains every
  /// lane queue once (a snapshot, so it returns while lanes keep pushing), merges each
  /// record, settles completed keys into the index, and returns everything settled since
  /// the last step (including ingest and mark_rank_dead results). Engine thread; noexcept;
  /// never blocks a lane; allocates only past the high-water marks.
  Step step(TimePoint now = std::chrono::steady_clock::now()) noexcept {
    begin_output();
    ++steps_;
    group_.set_time(now);
    Drain drain{this};
    const std::size_t n = group_.drain(drain);
    handed_out_ = true;
    return Step{std::span<const Settlement>(loads_), std::span<const StoreSettlement>(stores_), n};
  }

  /// Merges records that reached the engine by another transport (RPC, shared memory),
  /// e.g. decoded with from_bytes. `rank` is the rank they came from; a record naming
  /// another rank is invalid and dropped. Results come out of the next step(). noexcept.
  void ingest(std::uint32_t rank, std::span<const CompletionRecord> records) noexcept { ingest_batch(rank, records); }
  void ingest(std::uint32_t rank, std::span<const StoreRecord> records) noexcept { ingest_batch(rank, records); }

  /// Announces a save the engine dispatched, so its store records are admitted. Call it
  /// before the ranks can report (i.e. before dispatching the save). Forwards to
  /// index.note_store_attempted(key, kind) (or (key)) if the index has it; `kind` lets the
  /// index keep KV saves out of its state-hash set. Engine thread; may allocate
  /// (std::bad_alloc) when more saves are in flight than ever before.
  void expect_store(StoreKey key, SaveKind kind = SaveKind::state) {
    if constexpr (SaveKindNotingIndex<I>) (void)index_.note_store_attempted(key, kind);
    else if constexpr (StoreNotingIndex<I>) (void)index_.note_store_attempted(key);
    if constexpr (!StoreTrackingIndex<I>) (void)expected_.try_emplace(key);
  }

  /// Declares `rank` dead (see TpQuorum::mark_rank_dead); keys it unblocks settle into the
  /// index now and come out of the next step(). Throws Error naming a rank out of range;
  /// may allocate. Engine thread.
  void mark_rank_dead(std::uint32_t rank) {
    begin_output();
    Sink sink{this};
    group_.mark_rank_dead(rank, sink);
  }

  /// Counters. Engine thread; O(1) in keys.
  [[nodiscard]] PumpStats stats() const noexcept {
    PumpStats s;
    s.group = group_.stats();
    s.steps = steps_;
    s.late_settlements = late_settlements_;
    s.expected_stores = expected_.size();
    return s;
  }

  [[nodiscard]] G& group() noexcept { return group_; }
  [[nodiscard]] I& index() noexcept { return index_; }

 private:
  struct Admit {
    SettlementPump* self;
    bool operator()(LoadKey key) const noexcept {
      return static_cast<bool>(std::as_const(self->index_).is_outstanding(key));
    }
    bool operator()(StoreKey key) const noexcept {
      if constexpr (StoreTrackingIndex<I>) {
        return static_cast<bool>(std::as_const(self->index_).is_store_outstanding(key));
      } else {
        return self->expected_.contains(key);
      }
    }
  };

  struct Sink {
    SettlementPump* self;
    void operator()(const Settlement& s) noexcept {
      if (static_cast<bool>(self->index_.settle(s))) {
        self->loads_.push_back(s);
      } else {
        ++self->late_settlements_;
      }
    }
    // Every store settlement goes back to the engine, even one the index no longer
    // tracks: the source units it releases must be freed either way.
    void operator()(const StoreSettlement& s) noexcept {
      if constexpr (!StoreTrackingIndex<I>) self->expected_.erase(s.key);
      (void)self->index_.settle_store(s);
      self->stores_.push_back(s);
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
    Drain drain{this};
    for (const Record& r : records) drain(rank, r);
  }

  // Output buffers are cleared lazily, on the first new result after a step handed them out.
  void begin_output() noexcept {
    if (!handed_out_) return;
    loads_.clear();
    stores_.clear();
    handed_out_ = false;
  }

  G& group_;
  I& index_;
  detail::FlatMap<StoreKey, detail::Unit> expected_;
  std::vector<Settlement> loads_;
  std::vector<StoreSettlement> stores_;
  bool handed_out_ = false;
  std::uint64_t steps_ = 0;
  std::uint64_t late_settlements_ = 0;
};

}  // namespace kvfuse
