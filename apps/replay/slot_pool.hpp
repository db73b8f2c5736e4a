// kvfuse-replay: the engine's device state slot pool (a stateful model's request holds one
// from admission until the Coordinator frees its admission).
#pragma once

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace replay {

/// Free state slots, the same ids on every rank. Scheduler thread only.
class SlotPool {
 public:
  /// `n` slots, 0 .. n-1 (0 for a dense model: take() never gives one).
  explicit SlotPool(std::uint32_t n) : size_(n) {
    for (std::uint32_t s = n; s-- > 0;) free_.push_back(kvfuse::SlotId{s});
  }
  bool empty() const noexcept { return free_.empty(); }
  /// A free slot; precondition: !empty().
  kvfuse::SlotId take() {
    const kvfuse::SlotId s = free_.back();
    free_.pop_back();
    return s;
  }
  void give(kvfuse::SlotId s) { free_.push_back(s); }
  /// Slots taken and not given back.
  std::size_t taken() const noexcept { return size_ - free_.size(); }

 private:
  std::uint32_t size_;
  std::vector<kvfuse::SlotId> free_;
};

}  // namespace replay
