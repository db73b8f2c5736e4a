// kvfuse: the merge half of a CompletionGroup, handed to a group it wraps.
//
// A group that changes how records travel (where they are drained from, what an emitter
// does on the way) keeps its inner group's merge (R4), rank liveness and bookkeeping as they
// are. GroupWrapper holds the inner group and forwards exactly those; the wrapping class adds
// `Emitter`, `emitter()` and `drain()`, the parts it changes, and so models CompletionGroup.
#pragma once

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/completion/group.hpp>

#include <chrono>
#include <cstdint>
#include <utility>

namespace kvfuse {

/// Base of a group that wraps `Inner`: forwards merge, mark_rank_dead, mark_rank_alive,
/// settle_if_unowed, forget, set_time, stats and world_size to it, with Inner's thread and
/// progress guarantees (scheduler thread; noexcept where Inner's are). Not a group by itself.
template <CompletionGroup Inner>
class GroupWrapper {
 public:
  template <class... Args>
  explicit GroupWrapper(Args&&... args) : inner_(std::forward<Args>(args)...) {}

  /// The inner group's world size. Any thread.
  [[nodiscard]] std::uint32_t world_size() const noexcept { return inner_.world_size(); }

  /// The inner group's merge of one record (failure-dominant, R4). Scheduler thread.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t rank, const CompletionRecord& r, Admit& admit, Sink& sink) noexcept {
    return inner_.merge(rank, r, admit, sink);
  }
  /// As above, for a save record. Scheduler thread.
  template <AdmitPolicy Admit, SettlementSink Sink>
  MergeResult merge(std::uint32_t rank, const SaveRecord& r, Admit& admit, Sink& sink) noexcept {
    return inner_.merge(rank, r, admit, sink);
  }
  /// The inner group's mark_rank_dead (keys the rank owed settle without it). Scheduler thread.
  template <SettlementSink Sink>
  void mark_rank_dead(std::uint32_t rank, Sink& sink) {
    inner_.mark_rank_dead(rank, sink);
  }
  /// The inner group's settle_if_unowed. Scheduler thread.
  template <class Key, SettlementSink Sink>
  bool settle_if_unowed(const Key& key, Sink& sink) noexcept {
    return inner_.settle_if_unowed(key, sink);
  }
  /// The inner group's mark_rank_alive (counted for keys from `first_counted`). Scheduler thread.
  void mark_rank_alive(std::uint32_t rank, Generation first_counted) { inner_.mark_rank_alive(rank, first_counted); }
  /// The inner group's forget. Scheduler thread.
  void forget(const LoadKey& key) noexcept { inner_.forget(key); }
  /// The inner group's clock. Scheduler thread.
  void set_time(std::chrono::steady_clock::time_point now) noexcept { inner_.set_time(now); }
  /// The inner group's counters. Scheduler thread.
  [[nodiscard]] GroupStats stats() const noexcept { return inner_.stats(); }

 protected:
  Inner inner_;
};

}  // namespace kvfuse
