// kvfuse/host/slot_pool.hpp — a pool of device state slots: the request slots a stateful
// model's admissions hold until the Coordinator frees them, or the snapshot slots that hold
// a mid-prefill checkpoint until every rank has read it (a step's `snapshots`).
//
// The ids are the same on every rank (the ranks' slot memory is laid out alike), and two
// pools can share one slot memory by owning disjoint ranges: request slots first, snapshot
// slots after them. A slot handed back that this pool did not hand out, or handed back
// twice, is refused and counted: it means the engine lost track of a slot, and accepting it
// would put one slot in two requests' hands.
//
// Threading: not thread-safe. Every member is called from the engine's scheduler thread.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Something the engine's freed slots go back to: `pool.give(slot)` -> false when the pool
/// refuses it. Scheduler thread.
template <class P>
concept SlotAllocator = requires(P& pool, SlotId slot) {
  { pool.give(slot) } -> std::same_as<bool>;
};

/// Free slots `first` .. `first + count - 1`. Scheduler thread only. Movable, not copyable.
class SlotPool {
 public:
  /// `count` slots from `first`; `count` 0 is a pool that never has a slot (a dense
  /// model). Throws Error(invalid_argument) naming the values when the range overflows a
  /// slot id.
  explicit SlotPool(std::uint32_t count, std::uint32_t first = 0) : first_(first), taken_(count, false) {
    if (std::uint64_t{first} + count > std::uint64_t{UINT32_MAX})
      throw Error(ErrorCode::invalid_argument, "SlotPool range " + std::to_string(first) + " + " + std::to_string(count) +
                                                   " overflows a slot id");
    free_.reserve(count);
    for (std::uint32_t s = count; s-- > 0;) free_.push_back(SlotId{first + s});
  }

  /// Whether no slot is free now. O(1).
  [[nodiscard]] bool empty() const noexcept { return free_.empty(); }
  /// A free slot (the lowest-numbered of those never taken first), or nothing when none is
  /// free. O(1).
  std::optional<SlotId> take() noexcept {
    if (free_.empty()) return std::nullopt;
    const SlotId s = free_.back();
    free_.pop_back();
    taken_[s.value - first_] = true;
    return s;
  }
  /// Gives back a slot this pool handed out. False, and nothing changes, for a slot outside
  /// the pool or one not taken (given back twice): counted in refused(). O(1).
  bool give(SlotId s) noexcept {
    if (s.value < first_ || s.value - first_ >= taken_.size() || !taken_[s.value - first_]) {
      ++refused_;
      return false;
    }
    taken_[s.value - first_] = false;
    free_.push_back(s);  // reserved for every slot: never reallocates
    return true;
  }
  /// Slots taken and not given back. O(1).
  [[nodiscard]] std::size_t taken() const noexcept { return taken_.size() - free_.size(); }
  /// Slots in the pool. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return taken_.size(); }
  /// give() calls refused so far. O(1).
  [[nodiscard]] std::uint64_t refused() const noexcept { return refused_; }

 private:
  std::uint32_t first_;
  std::vector<bool> taken_;
  std::vector<SlotId> free_;
  std::uint64_t refused_ = 0;
};

}  // namespace kvfuse
