// kvfuse/engine/detail/admission_ledger.hpp — the Coordinator's books on admissions: which
// admission of each request is live, what still touches the resources of each one that
// ended, and the Freed events now due.
//
// An admission's blocks and slot may be freed once it ended (finish, teardown, or a
// re-admission that replaced it) and nothing touches them any more: no orphaned load or
// P/D transfer may still write them, and no save still reads them. The ledger keeps those
// three facts per admission and emits one Freed the moment they all hold — exactly once,
// because the admission leaves the books with it. Per request it keeps the live admission
// and the save watermark, and it forgets the request with its last admission. It also
// knows which orphaned load holds which torn-down admission, and the loads torn down after
// they had resolved (their resolution, still queued, must unpark nobody).
//
// Internal: the Coordinator's; scheduler thread only. Allocates when its tables grow.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/coordinator_types.hpp>

namespace kvfuse::detail {

/// See the file comment. Every member: scheduler thread only.
class AdmissionLedger {
 public:
  /// Room for `expected` requests and admissions before the tables rehash.
  explicit AdmissionLedger(std::size_t expected) {
    admissions_.reserve(expected);
    requests_.reserve(expected);
    loads_.reserve(expected);
  }

  /// A new admission of `request`, its live one from now on. Precondition: the request has
  /// no live admission (end_live first).
  AdmissionId start(RequestId request) {
    const AdmissionId id = issue(request);
    requests_.at(request).live = id;
    return id;
  }

  /// The request's live admission, if any. O(1).
  [[nodiscard]] std::optional<AdmissionId> live(RequestId request) const noexcept {
    const auto it = requests_.find(request);
    return it == requests_.end() ? std::nullopt : it->second.live;
  }

  /// Ends the request's live admission and returns it; nothing if it has none. The
  /// admission is freed once nothing touches it (call free_if_idle after setting holds).
  std::optional<AdmissionId> end_live(RequestId request) {
    const auto it = requests_.find(request);
    if (it == requests_.end() || !it->second.live) return std::nullopt;
    const AdmissionId id = *std::exchange(it->second.live, std::nullopt);
    admissions_.at(id).ended = true;
    return id;
  }

  /// The KV below this many tokens is known to be in the tier (on the chunk grid); 0 for a
  /// request the ledger does not hold.
  [[nodiscard]] TokenCount watermark(RequestId request) const noexcept {
    const auto it = requests_.find(request);
    return it == requests_.end() ? 0 : it->second.watermark;
  }
  /// Raises the watermark to `tokens` (no-op for a request the ledger does not hold).
  void raise_watermark(RequestId request, TokenCount tokens) noexcept {
    if (const auto it = requests_.find(request); it != requests_.end() && it->second.watermark < tokens)
      it->second.watermark = tokens;
  }
  /// Forgets what the tier was thought to hold: the next save saves from 0.
  void reset_watermark(RequestId request) noexcept {
    if (const auto it = requests_.find(request); it != requests_.end()) it->second.watermark = 0;
  }

  /// An orphaned load or a torn-down P/D transfer may still write the admission's blocks
  /// and slot (`held`), or no longer does.
  void hold_writer(AdmissionId id, bool held) { admissions_.at(id).writer_held = held; }

  /// The orphaned load `key` may still write the torn-down admission `id`.
  void hold_for_load(const LoadKey& key, AdmissionId id) {
    loads_.emplace(key, id);
    hold_writer(id, true);
  }
  /// The load `key` ended (settled or reclaimed). If it held a torn-down admission, that
  /// one is written by nobody now and is freed if nothing else touches it; true then.
  bool load_ended(const LoadKey& key) {
    const auto it = loads_.find(key);
    if (it == loads_.end()) return false;
    const AdmissionId id = it->second;
    loads_.erase(it);
    hold_writer(id, false);
    (void)free_if_idle(id);
    return true;
  }
  /// Orphaned loads holding an admission now. O(1).
  [[nodiscard]] std::size_t loads_holding() const noexcept { return loads_.size(); }

  /// A load torn down after it had resolved: its resolution, still queued, unparks nobody.
  void note_torn_down(const LoadKey& key) { torn_down_.push_back(key); }
  /// Whether `key` was such a load (forgotten now: its resolution came).
  bool forget_torn_down(const LoadKey& key) {
    const auto it = std::find(torn_down_.begin(), torn_down_.end(), key);
    if (it == torn_down_.end()) return false;
    *it = torn_down_.back();
    torn_down_.pop_back();
    return true;
  }

  /// One more save reads the admission's blocks or slot.
  void hold_source(AdmissionId id) { ++admissions_.at(id).sources_held; }
  /// A save no longer reads them; `confirmed` false (a rank could not confirm it) pins the
  /// admission for good: it is never freed, rather than freed under a copy that may run.
  void release_source(AdmissionId id, bool confirmed) {
    Admission& a = admissions_.at(id);
    --a.sources_held;
    a.pinned |= !confirmed;
  }
  /// Saves that still read the admission's resources.
  [[nodiscard]] std::uint32_t sources_held(AdmissionId id) const { return admissions_.at(id).sources_held; }
  /// Whether `id` is still on the books (not freed, not pinned and dropped).
  [[nodiscard]] bool holds(AdmissionId id) const noexcept { return admissions_.contains(id); }
  /// The request an admission belongs to.
  [[nodiscard]] RequestId request_of(AdmissionId id) const { return admissions_.at(id).request; }

  /// Frees the admission if it ended and nothing touches its resources: a Freed is due
  /// (take_freed hands it out) unless it is pinned; either way it leaves the books, and the
  /// request with its last admission. Returns whether it left.
  bool free_if_idle(AdmissionId id) {
    const auto it = admissions_.find(id);
    if (it == admissions_.end()) return false;
    const Admission& a = it->second;
    if (!a.ended || a.writer_held || a.sources_held > 0) return false;
    const RequestId request = a.request;
    if (!a.pinned) freed_.push_back(Freed{request, id});
    admissions_.erase(it);
    const auto rs = requests_.find(request);
    if (rs != requests_.end() && --rs->second.admissions == 0 && !rs->second.live) requests_.erase(rs);
    return true;
  }

  /// Appends the Freed events due since the last call to `out` and clears them.
  void take_freed(std::vector<Freed>& out) {
    out.insert(out.end(), freed_.begin(), freed_.end());
    freed_.clear();
  }

  /// Admissions on the books (live ones included). O(1).
  [[nodiscard]] std::size_t admissions() const noexcept { return admissions_.size(); }
  /// Requests on the books. O(1).
  [[nodiscard]] std::size_t requests() const noexcept { return requests_.size(); }

 private:
  struct Admission {
    RequestId request;
    std::uint32_t sources_held = 0;  // saves whose source some rank may still read
    bool ended = false;              // finished or torn down: no longer the request's live admission
    bool writer_held = false;        // an orphaned load or a torn-down transfer may still write
    bool pinned = false;             // a save's source could not be confirmed free: never freed
  };
  struct RequestState {
    TokenCount watermark = 0;
    std::optional<AdmissionId> live;
    std::uint32_t admissions = 0;  // on the books, the live one included
  };

  AdmissionId issue(RequestId request) {
    const AdmissionId id{++last_};
    ++requests_[request].admissions;
    admissions_.emplace(id, Admission{request, 0, false, false, false});
    return id;
  }

  std::unordered_map<AdmissionId, Admission> admissions_;
  std::unordered_map<RequestId, RequestState> requests_;
  std::unordered_map<LoadKey, AdmissionId> loads_;  // orphaned load -> the torn-down admission it may write
  std::vector<LoadKey> torn_down_;                  // torn down after resolving; their resolution is still queued
  std::vector<Freed> freed_;  // due since the last take_freed
  std::uint64_t last_ = 0;
};

}  // namespace kvfuse::detail
