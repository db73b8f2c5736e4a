// kvfuse/engine/detail/parking_ledger.hpp — the Coordinator's books on parked requests: which
// request waits on what (a load of the index, or a P/D sub's transfer), what it claims if
// that completes, and which torn-down admissions a transfer may still write.
//
// A parked request has exactly one owner that will settle it. A load the transport dropped
// is parked all the same (the index failed it at once; its resolution unparks it next
// step), but it is not in flight, which is what the audit term counts: the requests parked
// on a load that reached the ranks match the index's live loads in flight one to one, give
// or take the resolutions still queued for the next step. A P/D sub ends one request's
// transfers in the order they started, so the oldest held admission is the one an ended
// transfer wrote.
//
// Internal: the Coordinator's; scheduler thread only. Allocates when its tables grow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/coordinator_types.hpp>

namespace kvfuse::detail {

/// See the file comment. Every member: scheduler thread only.
class ParkingLedger {
 public:
  /// What a request is parked on, and what a salvage of its load needs to know.
  struct Parked {
    LoadKey key;            ///< the load (empty for a transfer)
    TokenCount claims = 0;  ///< tokens it resumes with if the load or transfer completes
    AdmissionId admission;
    bool dropped = false;   ///< the transport dropped the load; the index already failed it
    bool transfer = false;  ///< parked on a P/D sub's transfer, not on a load
    TokenCount hbm = 0;      ///< the HBM floor at admission
    TokenCount kv_from = 0;  ///< where the KV leg's first chunk starts (its chunks restore from here)
    TokenCount kv_end = 0;   ///< where the KV leg ends (kv_from == kv_end: no KV leg)
    std::optional<SlotId> slot;       ///< the state slot (stateful models)
    bool hbm_state_held = false;      ///< the engine holds the state at hbm
    bool second = false;              ///< this is the admission's second load: no third
    std::vector<Checkpoint> fallbacks;  ///< servable checkpoints below the planned boundary, ascending
    std::uint64_t bytes = 0;          ///< what its longer leg reads on one rank (the load-cost meter's sample)
    std::int64_t dispatched_ns = 0;   ///< when it was sent, on the Coordinator's clock
  };

  /// Room for `expected` parked requests before the table rehashes.
  explicit ParkingLedger(std::size_t expected) { parked_.reserve(expected); }

  /// `request` waits on the load `p.key` (`p.dropped`: it never reached the ranks).
  void park_on_load(RequestId request, Parked p) {
    p.transfer = false;
    if (!p.dropped) ++in_flight_;
    parked_.insert_or_assign(request, std::move(p));
  }
  /// `request` waits on a P/D transfer.
  void park_on_transfer(RequestId request, TokenCount claims, AdmissionId admission) {
    Parked p;
    p.claims = claims;
    p.admission = admission;
    p.transfer = true;
    parked_.insert_or_assign(request, std::move(p));
    ++on_transfers_;
  }

  /// What `request` is parked on, or nullptr. O(1).
  [[nodiscard]] const Parked* find(RequestId request) const noexcept {
    const auto it = parked_.find(request);
    return it == parked_.end() ? nullptr : &it->second;
  }

  /// The request leaves the parking (it unparks, or is torn down); returns what it was
  /// parked on, nothing if it was not parked.
  std::optional<Parked> leave(RequestId request) {
    const auto it = parked_.find(request);
    if (it == parked_.end()) return std::nullopt;
    Parked p = std::move(it->second);
    parked_.erase(it);
    if (p.transfer) --on_transfers_;
    else if (!p.dropped) --in_flight_;
    return p;
  }

  /// The request parked on load `key`, if any.
  [[nodiscard]] bool parked_on(RequestId request, const LoadKey& key) const noexcept {
    const Parked* p = find(request);
    return p != nullptr && !p->transfer && p->key == key;
  }
  /// Whether `request` is parked on a transfer.
  [[nodiscard]] bool on_transfer(RequestId request) const noexcept {
    const Parked* p = find(request);
    return p != nullptr && p->transfer;
  }

  /// Admission `admission` of `request` was torn down while its transfer may still write
  /// its blocks.
  void hold_for_transfer(RequestId request, AdmissionId admission) {
    holding_[request].push_back(admission);
    ++held_;
  }
  /// A transfer of `request` ended: the oldest admission held for it, written by nobody
  /// now; nothing when none is held (the transfer's request is parked).
  std::optional<AdmissionId> transfer_ended(RequestId request) {
    const auto it = holding_.find(request);
    if (it == holding_.end()) return std::nullopt;
    const AdmissionId admission = it->second.front();
    it->second.erase(it->second.begin());
    if (it->second.empty()) holding_.erase(it);
    --held_;
    return admission;
  }

  /// Parked requests now. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return parked_.size(); }
  /// Torn-down admissions a transfer may still write now. O(1).
  [[nodiscard]] std::uint64_t held_for_transfers() const noexcept { return held_; }
  /// The audit term, given the index's live loads in flight and the resolutions it has
  /// queued for the next step. O(1).
  [[nodiscard]] bool consistent(std::uint64_t live_in_flight, std::uint64_t queued) const noexcept {
    return in_flight_ >= live_in_flight && in_flight_ <= live_in_flight + queued &&
           in_flight_ + on_transfers_ <= parked_.size();
  }

 private:
  std::unordered_map<RequestId, Parked> parked_;
  std::unordered_map<RequestId, std::vector<AdmissionId>> holding_;  // oldest first per request
  std::uint64_t in_flight_ = 0;     // parked on a load that reached the ranks
  std::uint64_t on_transfers_ = 0;  // parked on a transfer
  std::uint64_t held_ = 0;
};

}  // namespace kvfuse::detail
