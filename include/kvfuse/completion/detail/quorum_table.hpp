// kvfuse/completion/detail/quorum_table.hpp — the pending-key table behind TpQuorum:
// per key, which ranks reported and the failure-dominant merge so far; settled keys in a
// bounded tombstone FIFO; arrival order for the oldest-pending gauge.
//
// Scheduler thread only. Allocates only when the number of pending keys passes its
// high-water mark (the tables and rings then double); tombstone storage is fixed.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <kvfuse/detail/flat_map.hpp>
#include <kvfuse/detail/ring.hpp>

namespace kvfuse::detail {

/// Failure-dominant merge state of one load key. Value-initialised = nothing failed yet.
struct LoadAcc {
  bool failed = false;  ///< some rank's record was not ok
  bool missed = false;  ///< some rank reported StateOutcome::missed
  std::uint32_t restored = UINT32_MAX;  ///< the fewest chunks a rank restored; 0 once a rank died unreported (UINT32_MAX: none yet)

  /// Settlement::kv_restored: the minimum over the ranks, 0 if none reported.
  [[nodiscard]] std::uint32_t kv_restored() const noexcept { return restored == UINT32_MAX ? 0 : restored; }
};

/// Failure-dominant merge state of one save key. The entry's `reported` mask tracks the
/// `stored` phase; `released` tracks the `released` phase, which settles on its own. A dead
/// rank's substitute `stored` report is neutral: a save is stored when every live rank stored
/// it (and at least one did).
struct SaveAcc {
  std::uint64_t released = 0;     ///< bit r set: rank r's `released` report (or its dead-rank substitute) is in
  bool released_settled = false;  ///< the `released` phase already went to the sink
  bool not_stored = false;        ///< some live rank reported that it did not store
  bool any_stored = false;        ///< some rank reported that it stored
  bool not_released = false;      ///< some rank could not confirm its source free
};

/// Pending entries keyed by Key, each carrying an accumulator Acc (value-initialised =
/// the merge identity), plus Key tombstones in a FIFO of fixed capacity. Every member:
/// scheduler thread only.
template <class Key, class Acc>
class QuorumTable {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  struct Entry {
    std::uint64_t reported = 0;  ///< bit r set: rank r's report (or its dead-rank substitute) is in
    std::uint64_t seq = 0;       ///< creation number, to tell a live arrival from a stale one
    Acc acc{};
  };

  /// Remembers the last `tombstone_capacity` (>= 1) settled keys; room for
  /// `expected_pending` pending keys before the first growth. Allocates both up front.
  QuorumTable(std::size_t tombstone_capacity, std::size_t expected_pending)
      : pending_(expected_pending),
        arrivals_(expected_pending),
        tomb_set_(tombstone_capacity),
        tomb_fifo_(tombstone_capacity),
        tomb_capacity_(tombstone_capacity) {}

  /// Whether `key` settled recently (is among the remembered tombstones). O(1), noexcept.
  [[nodiscard]] bool tombstoned(const Key& key) const noexcept { return tomb_set_.contains(key); }
  /// The pending entry for `key`, or nullptr. Valid until the next create or settle.
  /// O(1), noexcept.
  [[nodiscard]] Entry* find(const Key& key) noexcept { return pending_.find(key); }

  /// Creates the entry for `key` (precondition: not pending), first seen at `now`. Allocates
  /// only past the high-water mark (may throw std::bad_alloc then).
  Entry* create(const Key& key, TimePoint now) {
    Entry* e = pending_.try_emplace(key).first;
    e->seq = ++next_seq_;
    arrivals_.push_back(Arrival{key, e->seq, now});
    return e;
  }

  /// Removes the pending entry for `key` and tombstones it. noexcept: tombstone storage
  /// never grows, and the arrival FIFO only shrinks here.
  void settle(const Key& key) noexcept {
    const Entry* e = pending_.find(key);
    const std::uint64_t seq = e != nullptr ? e->seq : 0;
    pending_.erase(key);
    tombstone(key);
    if (!arrivals_.empty() && arrivals_.front().seq == seq) {
      arrivals_.pop_front();
      // Keep the front live: pop arrivals whose key settled while it was not at the front.
      while (!arrivals_.empty() && !live(arrivals_.front())) arrivals_.pop_front();
    }
    // Stale arrivals pile up behind a long-pending front; squeeze them out so the FIFO
    // stays O(pending), amortised O(1) per settle.
    if (arrivals_.size() > 2 * pending_.size() + 64) arrivals_.retain([this](const Arrival& a) noexcept { return live(a); });
  }

  /// Tombstones a key that settled without ever being pending. noexcept (no growth).
  void tombstone(const Key& key) noexcept {
    if (tomb_set_.contains(key)) return;
    if (tomb_fifo_.size() == tomb_capacity_) {
      tomb_set_.erase(tomb_fifo_.front());
      tomb_fifo_.pop_front();
    }
    // Neither container grows: both were sized for `capacity` keys at construction and
    // hold at most that many, so these inserts cannot allocate.
    tomb_fifo_.push_back(key);
    tomb_set_.insert(key);
  }

  /// Keys of every pending entry for which `wanted(key, entry)` holds. May allocate.
  template <class Pred>
  void collect(Pred&& wanted, std::vector<Key>& out) {
    out.clear();
    pending_.for_each([&](const Key& key, const Entry& e) {
      if (wanted(key, e)) out.push_back(key);
    });
  }

  /// Keys pending now. O(1), noexcept.
  [[nodiscard]] std::size_t pending() const noexcept { return pending_.size(); }
  /// Tombstones held (at most the capacity). O(1), noexcept.
  [[nodiscard]] std::size_t tombstones() const noexcept { return tomb_fifo_.size(); }
  /// When the oldest still-pending key was first seen; nothing if none is pending. O(1).
  [[nodiscard]] std::optional<TimePoint> oldest_since() const noexcept {
    if (arrivals_.empty()) return std::nullopt;
    return arrivals_.front().at;
  }

 private:
  struct Arrival {
    Key key{};
    std::uint64_t seq = 0;
    TimePoint at{};
  };

  [[nodiscard]] bool live(const Arrival& a) const noexcept {
    const Entry* e = pending_.find(a.key);
    return e != nullptr && e->seq == a.seq;
  }

  FlatMap<Key, Entry> pending_;
  Ring<Arrival> arrivals_;
  FlatSet<Key> tomb_set_;
  Ring<Key> tomb_fifo_;
  std::size_t tomb_capacity_;
  std::uint64_t next_seq_ = 0;
};

}  // namespace kvfuse::detail
