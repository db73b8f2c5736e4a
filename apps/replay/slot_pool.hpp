// kvfuse-replay: the engine's device state slot pools. A stateful model's request holds a
// request slot from admission until the Coordinator frees its admission; a snapshot slot
// holds a state checkpoint copied out mid-prefill until every rank has read it (the
// Coordinator hands it back in a step's `snapshots`). Both pools live in the same device
// slot memory of every rank: request slots first, snapshot slots after them.
#pragma once

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace replay {

/// Free slots `first` .. `first + n - 1`, the same ids on every rank. Scheduler thread only.
class SlotPool {
 public:
  /// `n` slots from `first` (n = 0: take() never gives one, as for a dense model).
  explicit SlotPool(std::uint32_t n, std::uint32_t first = 0) : first_(first), taken_(n, false) {
    for (std::uint32_t s = n; s-- > 0;) free_.push_back(kvfuse::SlotId{first + s});
  }
  bool empty() const noexcept { return free_.empty(); }
  /// A free slot; precondition: !empty().
  kvfuse::SlotId take() {
    const kvfuse::SlotId s = free_.back();
    free_.pop_back();
    taken_[s.value - first_] = true;
    return s;
  }
  /// Gives back a slot this pool gave out; false (and nothing changes) for any other slot,
  /// or one given back already: the caller lost track of its slots.
  bool give(kvfuse::SlotId s) {
    if (s.value < first_ || s.value - first_ >= taken_.size() || !taken_[s.value - first_]) return false;
    taken_[s.value - first_] = false;
    free_.push_back(s);
    return true;
  }
  /// Slots taken and not given back.
  std::size_t taken() const noexcept { return taken_.size() - free_.size(); }

 private:
  std::uint32_t first_;
  std::vector<bool> taken_;
  std::vector<kvfuse::SlotId> free_;
};

}  // namespace replay
