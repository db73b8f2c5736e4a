// kvfuse/host/admission_book.hpp — the engine's side of the Coordinator's admissions: what
// each admission holds (its block table and its request slot), whether it waits on a load,
// runs, or ended and waits for its Freed, and the routing of a step's events onto them.
//
// Every engine loop writes these books: vLLM keeps them in its scheduler's request table and
// KV cache manager, kvfuse-replay and the llama.cpp adapters keep them here. The Coordinator
// owns the protocol (who unparks, when an admission may be freed); the book owns the
// resources, and checks each event the Coordinator hands out against what it holds:
//   - an Unpark resumes the request's live admission, which must be waiting on a load;
//   - a Freed hands back an admission that ended (finish or teardown), exactly once: its
//     blocks go to the block pool, its slot to the slot pool;
//   - a snapshot slot goes back to the snapshot pool.
// Anything else (an unpark nobody waits for, a second Freed, a Freed for an admission that
// still runs, a slot a pool refuses) is a protocol error: counted, and nothing is released,
// because releasing on a wrong event is how a block ends up in two requests.
//
// The engine keeps whatever else it knows of an admission in the entry's payload (the
// replay's simulated compute, say), so one table serves both.
//
// Threading: not thread-safe. Every member is called from the engine's scheduler thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/slot_pool.hpp>

namespace kvfuse {

/// Where an admission is in its life.
enum class AdmissionState : std::uint8_t {
  parked,   ///< waiting on its load (or P/D transfer): an Unpark resumes it
  running,  ///< computing
  ended,    ///< finished or torn down: its resources wait for the Coordinator's Freed
};

/// One admission on the book: what it holds, and the engine's own `payload`.
template <class Payload>
struct BookEntry {
  RequestId request;
  AdmissionId admission;
  AdmissionState state = AdmissionState::running;
  std::vector<BlockId> blocks;  ///< the block table, from block 0 (cached blocks included)
  std::optional<SlotId> slot;   ///< the request slot (stateful models)
  Payload payload{};
};

/// Counters and gauges of an AdmissionBook. Plain data.
struct AdmissionBookStats {
  std::uint64_t opened = 0;               ///< admissions put on the book
  std::uint64_t resumed = 0;              ///< Unparks routed to a waiting admission
  std::uint64_t freed = 0;                ///< Freed events that handed an ended admission's resources back
  std::uint64_t closed = 0;               ///< admissions closed without a Coordinator (close())
  std::uint64_t parked_now = 0;           ///< admissions waiting on a load now (gauge)
  std::uint64_t running_now = 0;          ///< admissions computing now (gauge)
  std::uint64_t ended_now = 0;            ///< admissions that ended and wait for their Freed now (gauge)
  std::uint64_t unexpected_unparks = 0;   ///< an Unpark for a request with no admission waiting on a load
  std::uint64_t unexpected_frees = 0;     ///< a Freed for an admission not on the book, not ended, or of another request
  std::uint64_t refused_slots = 0;        ///< a request or snapshot slot its pool refused (not taken, or given twice)
  std::uint64_t admitted_while_parked = 0;  ///< open() of a decision that answered already_parked

  /// The protocol errors: every one of them means the engine and the Coordinator disagree.
  [[nodiscard]] std::uint64_t protocol_errors() const noexcept {
    return unexpected_unparks + unexpected_frees + refused_slots + admitted_while_parked;
  }
};

/// The engine's admissions, keyed by AdmissionId (see the file comment). Scheduler thread
/// only. Movable, not copyable.
template <class Payload = std::monostate>
class AdmissionBook {
 public:
  using Entry = BookEntry<Payload>;

  /// Room for `expected` admissions before the table rehashes.
  explicit AdmissionBook(std::size_t expected = 64) {
    entries_.reserve(expected);
    live_.reserve(expected);
  }

  /// Puts the admission `decision` started on the book: parked when the Coordinator parked
  /// it, running when it computes now. A request whose previous admission still runs has
  /// that one ended first, as the Coordinator did (admit() on a running request replaces
  /// its admission). A decision that answered already_parked started nothing: counted as a
  /// protocol error, nothing is put on the book, and nullptr comes back (the caller still
  /// owns `blocks` and `slot`). Otherwise the entry, valid until it leaves the book.
  Entry* open(RequestId request, const AdmitDecision& decision, std::vector<BlockId> blocks,
              std::optional<SlotId> slot, Payload payload = {}) {
    if (!decision.parked && decision.reason == ComputeReason::already_parked) {
      ++stats_.admitted_while_parked;
      return nullptr;
    }
    return &put(request, decision.admission, decision.parked, std::move(blocks), slot, std::move(payload));
  }

  /// Puts an admission the engine runs without a Coordinator (offload off) on the book,
  /// under an id of the engine's own; it leaves with close(). Running.
  Entry& open_local(RequestId request, AdmissionId id, std::vector<BlockId> blocks, std::optional<SlotId> slot,
                    Payload payload = {}) {
    return put(request, id, false, std::move(blocks), slot, std::move(payload));
  }

  /// The request's live admission (parked or running), or nullptr. O(1).
  [[nodiscard]] Entry* live(RequestId request) noexcept {
    const auto it = live_.find(request);
    return it == live_.end() ? nullptr : find(it->second);
  }
  /// The admission `id`, or nullptr when it is not on the book. O(1).
  [[nodiscard]] Entry* find(AdmissionId id) noexcept {
    const auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : &it->second;
  }

  /// The engine called Coordinator::finish or teardown for `request`: its live admission
  /// ended, and waits for its Freed. Returns it, or nullptr when the request has none
  /// (a second teardown: nothing changes). O(1).
  Entry* end(RequestId request) noexcept {
    const auto it = live_.find(request);
    if (it == live_.end()) return nullptr;
    Entry* e = find(it->second);
    live_.erase(it);
    if (e == nullptr) return nullptr;
    leave_state(*e);
    e->state = AdmissionState::ended;
    ++stats_.ended_now;
    return e;
  }

  /// Routes one Coordinator step onto the book: each Unpark resumes the request's waiting
  /// admission (it runs from now on) and calls `on_resume(entry, unpark)`, in the step's
  /// order; each Freed hands the ended admission's blocks to `blocks` and its slot to
  /// `slots`, and the admission leaves the book; each snapshot slot goes to `snapshots`.
  /// Everything the book cannot match is a protocol error, counted, and releases nothing.
  /// `on_resume` may call into the book (end a request, open another). Returns the events
  /// that were routed. `Step` is a Coordinator's StepResult (anything with `unparked`,
  /// `freed` and `snapshots` spans).
  template <class Step, BlockAllocator B, SlotAllocator S, SlotAllocator N, class OnResume>
  std::size_t apply(const Step& step, B& blocks, S& slots, N& snapshots, OnResume&& on_resume) {
    std::size_t routed = 0;
    for (const Unpark& u : step.unparked) {
      Entry* e = live(u.request);
      if (e == nullptr || e->state != AdmissionState::parked) {
        ++stats_.unexpected_unparks;
        continue;
      }
      leave_state(*e);
      e->state = AdmissionState::running;
      ++stats_.running_now;
      ++stats_.resumed;
      ++routed;
      on_resume(*e, u);
    }
    for (const Freed& f : step.freed) routed += free(f, blocks, slots) ? 1 : 0;
    for (const SlotId s : step.snapshots) {
      if (snapshots.give(s)) ++routed;
      else ++stats_.refused_slots;
    }
    return routed;
  }

  /// Hands back an admission opened with open_local() (no Coordinator frees it): its blocks
  /// to `blocks`, its slot to `slots`; it leaves the book. False, and nothing changes, when
  /// `id` is not on the book.
  template <BlockAllocator B, SlotAllocator S>
  bool close(AdmissionId id, B& blocks, S& slots) {
    const auto it = entries_.find(id);
    if (it == entries_.end()) return false;
    Entry& e = it->second;
    if (e.state != AdmissionState::ended) {
      if (const auto l = live_.find(e.request); l != live_.end() && l->second == id) live_.erase(l);
    }
    leave_state(e);
    give_back(e, blocks, slots);
    erase(it);
    ++stats_.closed;
    return true;
  }

  /// Calls f(entry) for every admission on the book, in no particular order; `f` must not
  /// add or remove admissions.
  template <class F>
  void for_each(F&& f) {
    for (auto& [id, e] : entries_) f(e);
  }

  /// Admissions of `request` on the book (its live one and ended ones). O(1).
  [[nodiscard]] std::uint32_t admissions_of(RequestId request) const noexcept {
    const auto it = per_request_.find(request);
    return it == per_request_.end() ? 0 : it->second;
  }
  /// Admissions on the book. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Counters and gauges. O(1).
  [[nodiscard]] AdmissionBookStats stats() const noexcept { return stats_; }

 private:
  Entry& put(RequestId request, AdmissionId id, bool parked, std::vector<BlockId> blocks, std::optional<SlotId> slot,
             Payload payload) {
    (void)end(request);  // a running admission replaced by this one
    auto [it, fresh] = entries_.try_emplace(id, Entry{request, id, parked ? AdmissionState::parked : AdmissionState::running,
                                                      std::move(blocks), slot, std::move(payload)});
    (void)fresh;  // ids are unique: the Coordinator never issues one twice
    live_[request] = id;
    ++per_request_[request];
    ++(parked ? stats_.parked_now : stats_.running_now);
    ++stats_.opened;
    return it->second;
  }

  template <BlockAllocator B, SlotAllocator S>
  bool free(const Freed& f, B& blocks, S& slots) {
    const auto it = entries_.find(f.admission);
    if (it == entries_.end() || it->second.request != f.request || it->second.state != AdmissionState::ended) {
      ++stats_.unexpected_frees;
      return false;
    }
    leave_state(it->second);
    give_back(it->second, blocks, slots);
    erase(it);
    ++stats_.freed;
    return true;
  }

  template <BlockAllocator B, SlotAllocator S>
  void give_back(Entry& e, B& blocks, S& slots) {
    for (const BlockId b : e.blocks) blocks.release(b);
    if (e.slot && !slots.give(*e.slot)) ++stats_.refused_slots;
  }

  void erase(typename std::unordered_map<AdmissionId, Entry>::iterator it) {
    const auto r = per_request_.find(it->second.request);
    if (r != per_request_.end() && --r->second == 0) per_request_.erase(r);
    entries_.erase(it);
  }

  void leave_state(const Entry& e) noexcept {
    switch (e.state) {
      case AdmissionState::parked: --stats_.parked_now; break;
      case AdmissionState::running: --stats_.running_now; break;
      case AdmissionState::ended: --stats_.ended_now; break;
    }
  }

  std::unordered_map<AdmissionId, Entry> entries_;
  std::unordered_map<RequestId, AdmissionId> live_;  // each request's admission that has not ended
  std::unordered_map<RequestId, std::uint32_t> per_request_;
  AdmissionBookStats stats_{};
};

}  // namespace kvfuse
