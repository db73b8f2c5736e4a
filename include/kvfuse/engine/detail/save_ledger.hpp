// kvfuse/engine/detail/save_ledger.hpp — the Coordinator's books on the saves it sent: what
// each save reads (an admission's blocks or slot, or a snapshot slot), which state hashes
// are being saved (so one checkpoint is not saved twice at once), and the snapshot slots it
// holds until every rank released them.
//
// A save reports two phases per rank, merged by the pump (section "save path" of
// docs/reference.md): `released` (no rank reads the source any more), then `stored`. The
// ledger turns each phase into what it means for the source — free it now, or keep it
// pinned because a rank could not confirm that nothing reads it — and the Coordinator
// applies that to the admission ledger. Snapshot slots never belong to an admission: they
// come back through the ledger's ready list whatever became of the request.
//
// Audit term: every snapshot slot held is read by a save whose `released` has not settled,
// waits in the ready list, or stayed pinned.
//
// Internal: the Coordinator's; scheduler thread only. Allocates when its tables grow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/resolution.hpp>
#include <kvfuse/engine/coordinator_types.hpp>

namespace kvfuse::detail {

/// Hands `item` to the engine's transport: true when it is on its way to every rank. A
/// transport that throws is taken as one that dropped it (the item reached no rank), so
/// the books never hold a dispatched item nobody tracks: the caller resolves it as
/// dropped. Scheduler thread.
template <class Transport, class Item>
bool transport_took(Transport& transport, const Item& item) noexcept {
  try {
    return static_cast<bool>(transport.send(item));
  } catch (...) {
    return false;
  }
}

/// See the file comment. Every member: scheduler thread only.
class SaveLedger {
 public:
  /// What a save reads: the blocks or slot of an admission, or a snapshot slot.
  struct Source {
    std::optional<AdmissionId> admission;  ///< empty for a snapshot
    SlotId slot;                           ///< a state save's source slot (the snapshot, or the request's)
  };

  /// What one settled phase means for its save's source.
  struct Settled {
    bool known = false;            ///< the save is one this ledger sent (false: nothing to do)
    Source source;
    bool source_free_now = false;  ///< the phase frees the source (released, or stored without a released)
    bool confirmed = true;         ///< false: a rank could not confirm that nothing reads the source
    bool store_failed = false;     ///< the stored phase failed: the tier may lack what was saved
  };

  /// Room for `expected` saves in flight before the tables rehash.
  explicit SaveLedger(std::size_t expected) {
    saves_.reserve(expected);
    state_saves_.reserve(expected);
  }

  /// Whether a state save of `hash` is in flight. O(1).
  [[nodiscard]] bool saving_state(PrefixHash hash) const noexcept { return state_saves_.contains(hash); }

  /// Takes a ticket for `save` from `index`, dispatches it through `transport` and books it
  /// as reading `source` (`state`: the hash a state save stores). `refused`: no ticket,
  /// nothing sent. `dropped`: the transport dropped it (or threw) before any rank saw it, so it is
  /// settled here (released, stored failed) and booked nowhere. Otherwise `saved`.
  template <class Index, class Transport, class Save>
  CheckpointResult submit(Index& index, Transport& transport, Source source, std::optional<PrefixHash> state, Save save) {
    auto grant = index.request_save(std::move(save));
    if (!grant) return CheckpointResult::refused;
    const Save dispatched = grant.ticket().dispatch();
    if (!transport_took(transport, dispatched)) {
      (void)index.settle_save(SaveSettlement{dispatched.key, SavePhase::released, true});
      (void)index.settle_save(SaveSettlement{dispatched.key, SavePhase::stored, false});
      return CheckpointResult::dropped;
    }
    sent(dispatched.key, source, state);
    return CheckpointResult::saved;
  }

  /// A save went to every rank: `key` reads `source`; `state` is the hash a state save stores.
  void sent(SaveKey key, Source source, std::optional<PrefixHash> state) {
    saves_.emplace(key, Owner{source, state, false});
    if (state) ++state_saves_[*state];
    if (state && !source.admission) {
      ++snapshots_held_;
      ++snapshots_unreleased_;
    }
  }

  /// Books one settled phase and says what it means for the source. A snapshot whose
  /// source is free now joins the ready list (or stays pinned, unconfirmed).
  Settled settle(const SaveSettlement& s) {
    Settled out;
    const auto it = saves_.find(s.key);
    if (it == saves_.end()) return out;
    Owner& owner = it->second;
    out.known = true;
    out.source = owner.source;
    out.source_free_now = s.phase == SavePhase::released || !owner.released;
    out.confirmed = s.phase != SavePhase::released || s.ok;
    out.store_failed = s.phase == SavePhase::stored && !s.ok;
    if (s.phase == SavePhase::released) {
      owner.released = true;
    } else {
      if (owner.state) end_state_save(*owner.state);
      saves_.erase(it);
    }
    if (!out.confirmed) ++sources_pinned_;
    if (out.source_free_now && !out.source.admission) {
      --snapshots_unreleased_;
      if (out.confirmed) ready_.push_back(out.source.slot);
      else ++snapshots_pinned_;
    }
    return out;
  }

  /// Moves the snapshot slots every rank released since the last call into `out`; returns
  /// how many.
  std::size_t take_ready(std::vector<SlotId>& out) {
    out.insert(out.end(), ready_.begin(), ready_.end());
    const std::size_t n = ready_.size();
    snapshots_held_ -= n;
    ready_.clear();
    return n;
  }

  /// Snapshot slots taken by a save and not handed back yet (pinned ones included). O(1).
  [[nodiscard]] std::uint64_t snapshots_held() const noexcept { return snapshots_held_; }
  /// Sources some rank could not confirm free, pinned for good. O(1).
  [[nodiscard]] std::uint64_t sources_pinned() const noexcept { return sources_pinned_; }
  /// The audit term: every snapshot held is accounted for. O(1).
  [[nodiscard]] bool consistent() const noexcept {
    return snapshots_held_ == snapshots_unreleased_ + ready_.size() + snapshots_pinned_;
  }

 private:
  struct Owner {
    Source source;
    std::optional<PrefixHash> state;  // a state save: the hash it stores (deduplication)
    bool released = false;            // its `released` phase settled
  };

  void end_state_save(PrefixHash hash) {
    const auto it = state_saves_.find(hash);
    if (it != state_saves_.end() && --it->second == 0) state_saves_.erase(it);
  }

  std::unordered_map<SaveKey, Owner> saves_;
  std::unordered_map<PrefixHash, std::uint32_t> state_saves_;  // state saves in flight, by hash
  std::vector<SlotId> ready_;                   // snapshots released since the last take_ready
  std::uint64_t snapshots_held_ = 0;            // taken by a save, not yet handed back
  std::uint64_t snapshots_unreleased_ = 0;      // snapshot saves whose released phase has not settled
  std::uint64_t snapshots_pinned_ = 0;          // snapshots a rank could not confirm free: never handed back
  std::uint64_t sources_pinned_ = 0;
};

}  // namespace kvfuse::detail
