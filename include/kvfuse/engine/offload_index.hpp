// kvfuse/engine/offload_index.hpp — OffloadIndex, the engine side's one owner (R5).
// Its tickets are in engine/tickets.hpp, its options and stats in engine/index_options.hpp,
// and the full consistency walk (an end-of-run audit) in engine/index_consistency.hpp.
//
// OffloadIndex alone owns the indexed state hashes (an LRU-capped set), every outstanding
// load (KV-only, joint and state-only alike), the slots held for orphaned loads, and the
// counters. Every load is named by one LoadKey {request, generation}; the index issues the
// generation itself, one per granted load, so two loads of one request never share a key
// and a report for one can never settle the other (R3, R8).
//
// Threading: the whole engine side is single-threaded by design. OffloadIndex and
// LoadTicket are NOT thread-safe: every member of both is called from the engine's
// scheduler thread only. Ranks never touch the index; they receive the plain-data
// LoadRequest a ticket yields and report CompletionRecords back through a Group.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/resolution.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/detail/flat_map.hpp>
#include <kvfuse/engine/detail/lru_hash_set.hpp>
#include <kvfuse/engine/index_options.hpp>
#include <kvfuse/engine/tickets.hpp>
#include <kvfuse/error.hpp>


namespace kvfuse {

namespace detail {
/// Test hook, declared and never defined here: a test specialises it for a tag type of its
/// own to reach OffloadIndex internals (to corrupt a counter and watch the audit catch it).
/// Engines have no use for it.
template <class Tag>
struct OffloadIndexAccess;
}  // namespace detail

/// The engine side's one owner of offload state (R5). See the file comment.
///
/// NOT thread-safe: every member is called from the engine's scheduler thread only.
/// Neither copyable nor movable (tickets point at it); it must outlive every ticket it
/// issued. Every member is noexcept except construction and the visitor walks
/// (for_each_indexed; drain_resolutions with a visitor that may throw). The full
/// consistency walk is check_consistency (engine/index_consistency.hpp).
///
/// Lifecycle of a load:
///   request_load ──► ticket ──dispatch()──► in flight ──settle/complete/fail/abandon──► resolved
///                        └──abandon()/dropped──────────────────────────────────────────► resolved
///   in flight ──orphan()──► orphaned (index holds the slot) ──settle() or reclaim()──► resolved + slot released
/// Every resolution is queued exactly once for drain_resolutions(). An orphan ends only by
/// its rank-backed settlement or by reclaim (R8): complete/fail/abandon by key leave it be,
/// because its ranks may still be writing into its slot.
///
/// Lifecycle of a save: request_save ──► ticket ──dispatch()──► in flight ──released──►
/// ──stored──► resolved (a dropped ticket is abandoned). Saves draw their generations from
/// the same source as loads, so one generation orders every key the engine issued.
///
/// Costs: every member is O(1) (amortised where a table grows) except reclaim (O(reclaimed)),
/// fail_all/settle_all (O(keys)), drain_resolutions (O(drained)) and for_each_indexed
/// (O(indexed)). No path on a load, settle or stats() walks a structure (R17).
template <class Clock = std::chrono::steady_clock>
class OffloadIndex final : private detail::TicketSink {
  template <class Tag>
  friend struct detail::OffloadIndexAccess;
  static_assert(IndexClock<Clock>,
                "kvfuse::OffloadIndex<Clock>: Clock does not model kvfuse::IndexClock "
                "(needs time_point, duration and a static now(), like std::chrono::steady_clock)");

 public:
  using clock = Clock;
  using time_point = typename Clock::time_point;
  using duration = typename Clock::duration;

  /// Builds an empty index whose `release` returns orphans' slots to the engine's
  /// allocator: for an engine that drives the index itself. Throws Error(invalid_argument)
  /// naming the value when hash_capacity is 0 or above 2^31, slot_count is above 2^24, or
  /// `release` is empty. Any thread may construct it; from then on only the scheduler
  /// thread uses it. Destroying it releases no slot (the engine is going away) and
  /// requires every ticket it issued to be gone.
  OffloadIndex(OffloadIndexOptions options, SlotFree release) : OffloadIndex(options) {
    if (!release) throw Error(ErrorCode::invalid_argument, "OffloadIndex needs a slot-free callback, got an empty one");
    release_ = std::move(release);
  }

  /// Builds an empty index with no slot-free callback: the engine learns that an
  /// orphan's slot is free another way — a Coordinator's Freed event (a Coordinator
  /// requires this form), or the orphaned LoadResolution. Throws as the other constructor
  /// for bad options.
  explicit OffloadIndex(OffloadIndexOptions options)
      : options_(validated(options)),
        hashes_(options_.hash_capacity, options_.preallocate_hashes,
                options_.hash_eviction == HashEviction::spared_tokens ? spared_tokens_window : 1),
        generations_(options_.last_issued),
        slot_owner_(options_.slot_count, detail::npos32) {}

  /// Whether the index calls a slot-free callback for orphans. Any thread that owns it;
  /// noexcept; O(1).
  [[nodiscard]] bool has_slot_free() const noexcept { return static_cast<bool>(release_); }

  OffloadIndex(const OffloadIndex&) = delete;
  OffloadIndex& operator=(const OffloadIndex&) = delete;
  OffloadIndex(OffloadIndex&&) = delete;
  OffloadIndex& operator=(OffloadIndex&&) = delete;
  ~OffloadIndex() = default;

  /// The options the index was built with. Scheduler thread only; noexcept.
  [[nodiscard]] const OffloadIndexOptions& options() const noexcept { return options_; }

  // ---------------------------------------------------------------- indexed hashes

  /// Indexes `hash` as most recently used (or touches it); `spared_tokens` is the prefill
  /// its checkpoint spares (its boundary), which the spared_tokens eviction weighs. At the
  /// cap a hash is evicted (the least recently used, or the lightest of the 8 least
  /// recently used with HashEviction::spared_tokens) and counted in hashes_evicted. Call it
  /// only when every live rank stored the entry (settle_save does, with the save's
  /// boundary). Scheduler thread only; noexcept; O(1) amortised.
  void note_stored(PrefixHash hash, TokenCount spared_tokens = 0) noexcept {
    const auto r = hashes_.insert_or_touch(hash, weight_of(spared_tokens));
    if (r.evicted) {
      ++stats_.hashes_evicted;
      --stats_.indexed;
    }
    if (r.outcome == detail::LruHashSet::Outcome::inserted) ++stats_.indexed;
  }

  /// Removes `hash` from the index; returns whether it was indexed. Outstanding loads of it
  /// are untouched. Scheduler thread only; noexcept; O(1).
  bool forget(PrefixHash hash) noexcept {
    if (!hashes_.erase(hash)) return false;
    --stats_.indexed;
    return true;
  }

  /// Whether a state load of `hash` would be admitted as far as the index goes. Does NOT
  /// change the LRU order (admitting a load does). Scheduler thread only; noexcept; O(1).
  [[nodiscard]] bool could_serve(PrefixHash hash) const noexcept { return hashes_.contains(hash); }

  /// Calls f(hash) for every indexed hash, most recently used first (for persisting the
  /// index or for tests). O(indexed); counts walk steps. Scheduler thread only.
  template <class F>
  void for_each_indexed(F&& f) const {
    hashes_.for_each_mru(std::forward<F>(f));
  }

  // ---------------------------------------------------------------- loads

  /// Grants a load ticket for `request`: KV-only (state empty), state-only (kv empty, R10)
  /// or joint. On a grant, issues a fresh generation, counts the load in `issued` and
  /// `outstanding`, holds the slot against other loads, touches the state hash's LRU
  /// position, and returns a ticket that owns the KV spec (moved, not copied). On refusal
  /// (see LoadRefusal for the order of checks) only `refused` changes.
  /// Scheduler thread only; noexcept; O(1) amortised (allocates only when a table grows).
  [[nodiscard]] LoadGrant request_load(RequestId request, std::optional<KvSpec> kv,
                                       std::optional<StateSpec> state) noexcept {
    const LoadRefusal why = grant_check(request, kv.has_value(), state);
    if (why != LoadRefusal::none) return refuse(why);
    std::uint32_t e = free_entry_;
    try {
      keys_.reserve(keys_.size() + 1);
      requests_.reserve(requests_.size() + 1);
      // Every outstanding load resolves at most once before the next grant, so this
      // reserve is what lets every settle path queue its resolution without allocating.
      const std::size_t need = resolutions_.size() + stats_.outstanding + 1;
      if (resolutions_.capacity() < need) resolutions_.reserve(std::max(need, 2 * resolutions_.capacity()));
      const std::size_t forget_need = forgotten_.size() + stats_.outstanding + 1;
      if (forgotten_.capacity() < forget_need) forgotten_.reserve(std::max(forget_need, 2 * forgotten_.capacity()));
      if (e == detail::npos32) {
        if (entries_.size() == entries_.capacity()) entries_.reserve(std::max<std::size_t>(64, 2 * entries_.size()));
        entries_.emplace_back();
        e = static_cast<std::uint32_t>(entries_.size() - 1);
        entries_[e].free_next = detail::npos32;
        free_entry_ = e;  // now on the free list, popped below
      }
    } catch (...) {
      return refuse(LoadRefusal::out_of_memory);
    }
    free_entry_ = entries_[e].free_next;

    const LoadKey key{request, generations_.next()};
    Entry& en = entries_[e];
    en = Entry{};
    en.key = key;
    en.status = Status::ticketed;
    if (state) {
      en.has_state = true;
      en.leg = *state;
      slot_owner_[state->slot.value] = e;
      hashes_.touch(state->boundary_hash);
    }
    keys_.insert(key.generation, e);
    requests_.insert(request, e);
    ++stats_.issued;
    ++stats_.outstanding;
    return LoadGrant(LoadTicket(this, e, key, std::move(kv)));
  }

  /// Settles a load its ranks reported on (the completion path calls it with every
  /// merged settlement): ok ? completed : failed, retracting the state hash when
  /// state_missed (a genuine miss on some rank); the resolution carries kv_restored. The one way an orphan ends besides
  /// reclaim: its slot goes back through the callback. Returns false (and only counts a
  /// late report) if `key` is not in flight: unknown, never dispatched, already resolved,
  /// or reclaimed (R3). Scheduler thread only; noexcept; O(1).
  bool settle(const Settlement& s) noexcept {
    const std::uint32_t e = find_entry(s.key);
    if (e == detail::npos32 || entries_[e].status != Status::in_flight) {
      ++stats_.late_reports;
      return false;
    }
    resolve(e, s.ok ? Resolution::completed : Resolution::failed, !s.ok && s.state_missed, s.kv_restored);
    return true;
  }

  /// settle() for each; returns how many applied. Scheduler thread only; noexcept; O(n).
  std::size_t settle_all(std::span<const Settlement> settlements) noexcept {
    std::size_t applied = 0;
    for (const Settlement& s : settlements) applied += settle(s) ? 1 : 0;
    return applied;
  }

  /// The engine resolves a live in-flight load as ok without its ranks' settlement.
  /// As fail(); rarely what an engine wants (settle() is the normal path).
  bool complete(LoadKey key) noexcept { return resolve_by_engine(key, Resolution::completed, false); }

  /// The engine fails a live in-flight load without waiting for its ranks (a tier outage
  /// it learned of another way). `missing` retracts the state hash. The key also goes on
  /// the forget list, so the completion group drops its partial entry and later records
  /// for it are late (R3). Returns false, changing nothing, for an orphan (it ends only by
  /// settle() or reclaim, R8: its ranks may still write its slot) and, counting a late
  /// report, for a key not in flight. A dead rank is not a reason to call it:
  /// mark_rank_dead settles what waits on the rank. Scheduler thread only; noexcept; O(1).
  bool fail(LoadKey key, bool missing) noexcept { return resolve_by_engine(key, Resolution::failed, missing); }

  /// The engine abandons a live in-flight load: nothing was tried, so the hash is never
  /// retracted (R7). Orphans and keys not in flight as fail(); a load whose ticket was not
  /// dispatched is abandoned through its ticket, not by key. Scheduler thread only;
  /// noexcept; O(1).
  bool abandon(LoadKey key) noexcept { return resolve_by_engine(key, Resolution::abandoned, false); }

  /// fail() for every key in `keys`; returns how many applied (orphans are skipped, keys
  /// not in flight count as late). Scheduler thread only; noexcept; O(keys.size()).
  std::size_t fail_all(std::span<const LoadKey> keys, bool missing) noexcept {
    std::size_t applied = 0;
    for (const LoadKey& k : keys) applied += fail(k, missing) ? 1 : 0;
    return applied;
  }

  /// The request of an in-flight load was torn down (R8): the index takes custody of its
  /// slot, stamps the orphan time with Clock::now(), and stops counting the load against
  /// the request, so a re-admission is not blocked. The slot goes back through the
  /// slot-free callback exactly once, when the load settles or is reclaimed. Returns false
  /// if `key` is not in flight (unknown, not yet dispatched, resolved) or already
  /// orphaned: then nothing is writing into the slot and the caller keeps it (a ticket
  /// still alive must be dropped with the request). Scheduler thread only; noexcept; O(1)
  /// (O(k) only if the clock went back by k orphans).
  bool orphan(LoadKey key) noexcept {
    const std::uint32_t e = find_entry(key);
    if (e == detail::npos32 || entries_[e].status != Status::in_flight || entries_[e].orphaned) return false;
    Entry& en = entries_[e];
    en.orphaned = true;
    en.orphaned_at = Clock::now();
    requests_.erase(key.request);
    link_sorted<&Entry::orphan_links, &Entry::orphaned_at>(orphans_, e);
    ++stats_.orphaned;
    return true;
  }

  /// Reclaims orphans whose age since orphan time is at least `timeout`: each is settled
  /// as abandoned and reclaimed, and its slot released through the callback. A report for
  /// it afterwards is late and releases nothing. `timeout <= 0` disables reclaim. Live
  /// (non-orphaned) loads are never reclaimed. Returns how many were reclaimed.
  /// Scheduler thread only; noexcept; O(reclaimed + 1).
  std::size_t reclaim(time_point now, duration timeout) noexcept {
    if (!(duration::zero() < timeout)) return 0;
    std::size_t n = 0;
    while (orphans_.head != detail::npos32) {
      const std::uint32_t e = orphans_.head;
      if (now - entries_[e].orphaned_at < timeout) break;  // sorted by orphan time: the rest are younger
      forgotten_.push_back(entries_[e].key);
      resolve(e, Resolution::reclaimed, false);
      ++n;
    }
    return n;
  }

  /// Appends every queued resolution to `out`, oldest first, and clears the queue; returns
  /// how many. Allocates only if `out` lacks capacity; if that allocation fails, returns 0
  /// and keeps the queue. Scheduler thread only; noexcept; O(drained).
  std::size_t drain_resolutions(std::vector<LoadResolution>& out) noexcept {
    const std::size_t n = resolutions_.size();
    try {
      out.insert(out.end(), resolutions_.begin(), resolutions_.end());
    } catch (...) {
      return 0;
    }
    resolutions_.clear();
    return n;
  }

  /// Calls visit(const LoadResolution&) for every queued resolution, oldest first, and
  /// clears the queue; returns how many. Never allocates. `visit` must not call back into
  /// the index. Scheduler thread only; noexcept if `visit` is.
  template <class F>
    requires std::invocable<F&, const LoadResolution&>
  std::size_t drain_resolutions(F&& visit) noexcept(std::is_nothrow_invocable_v<F&, const LoadResolution&>) {
    const std::size_t n = resolutions_.size();
    for (const LoadResolution& r : resolutions_) visit(r);
    resolutions_.clear();
    return n;
  }

  /// Resolutions queued and not yet drained. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::size_t pending_resolutions() const noexcept { return resolutions_.size(); }

  /// Calls forget(const LoadKey&) for every in-flight load the index resolved without its
  /// ranks (reclaim, or complete/fail/abandon by key) since the last call, and clears the
  /// list: the completion path drops their partial group entries (SettlementPump does this
  /// at the start of every step). Never allocates. Scheduler thread only; noexcept if
  /// `forget` is.
  template <class F>
    requires std::invocable<F&, const LoadKey&>
  std::size_t drain_forgotten(F&& forget) noexcept(std::is_nothrow_invocable_v<F&, const LoadKey&>) {
    const std::size_t n = forgotten_.size();
    for (const LoadKey& k : forgotten_) forget(k);
    forgotten_.clear();
    return n;
  }

  /// Calls visit(const OverdueLoad&) for every load in flight (dispatched, not resolved;
  /// orphans included) for at least `threshold` at `now`, oldest dispatch first, and
  /// returns how many; IndexStats::overdue keeps that count until the next call. Nothing is
  /// released or resolved: a load that never hears back (a transport that lost its request)
  /// stays in flight, because only its ranks or the engine can know it is gone; this makes
  /// it visible. Scheduler thread only; noexcept if `visit` is; O(reported + 1).
  template <class F>
    requires std::invocable<F&, const OverdueLoad&>
  std::size_t report_overdue(time_point now, duration threshold, F&& visit) noexcept(
      std::is_nothrow_invocable_v<F&, const OverdueLoad&>) {
    std::size_t n = 0;
    for (std::uint32_t e = flight_.head; e != detail::npos32; e = entries_[e].flight_links.next) {
      const duration age = now - entries_[e].dispatched_at;
      if (age < threshold) break;  // dispatch-ordered: the rest are younger
      visit(OverdueLoad{entries_[e].key, std::chrono::duration_cast<std::chrono::nanoseconds>(age), entries_[e].orphaned});
      ++n;
    }
    stats_.overdue = n;
    return n;
  }

  /// Calls visit(const LoadKey&) for every load in flight (dispatched, not resolved;
  /// orphans included), oldest dispatch first. `visit` must not call back into the index.
  /// SettlementPump uses it when a rank dies (keys no live rank owes settle then). Scheduler
  /// thread only; noexcept if `visit` is; O(in flight), counted in walk_steps.
  template <class F>
    requires std::invocable<F&, const LoadKey&>
  void for_each_load_in_flight(F&& visit) const noexcept(std::is_nothrow_invocable_v<F&, const LoadKey&>) {
    for (std::uint32_t e = flight_.head; e != detail::npos32; e = entries_[e].flight_links.next) {
      ++own_walks_;
      visit(entries_[e].key);
    }
  }

  /// Calls visit(const SaveKey&) for every save in flight (dispatched, its `stored` phase
  /// not settled), in no particular order. `visit` must not call back into the index.
  /// Scheduler thread only; noexcept if `visit` is; O(saves outstanding), counted in
  /// walk_steps.
  template <class F>
    requires std::invocable<F&, const SaveKey&>
  void for_each_save_in_flight(F&& visit) const noexcept(std::is_nothrow_invocable_v<F&, const SaveKey&>) {
    saves_.for_each([&](const SaveKey& key, std::uint32_t v) {
      if ((v & save_dispatched_bit) != 0) visit(key);
    });
  }

  /// The last generation this index issued (to a load or a save). Persist it and pass it
  /// back as OffloadIndexOptions::last_issued after a restart, so no key is ever reissued.
  /// Scheduler thread only; noexcept; O(1).
  [[nodiscard]] Generation last_issued() const noexcept { return generations_.last_issued(); }

  // ---------------------------------------------------------------- queries

  /// Whether `key` is in flight: dispatched and not yet resolved. The completion path
  /// accepts records only for keys this says yes to (R3). A key whose ticket was not
  /// dispatched yet is outstanding but not in flight: no rank has it.
  /// Scheduler thread only; noexcept; O(1).
  [[nodiscard]] bool is_in_flight(LoadKey key) const noexcept {
    const std::uint32_t e = find_entry(key);
    return e != detail::npos32 && entries_[e].status == Status::in_flight;
  }

  /// Whether `key` is an in-flight load whose request was torn down. Scheduler thread
  /// only; noexcept; O(1).
  [[nodiscard]] bool is_orphaned(LoadKey key) const noexcept {
    const std::uint32_t e = find_entry(key);
    return e != detail::npos32 && entries_[e].orphaned;
  }

  /// The state hash of an outstanding load (ticketed or in flight); empty for a KV-only,
  /// unknown or resolved key. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::optional<PrefixHash> hash_of(LoadKey key) const noexcept {
    const std::uint32_t e = find_entry(key);
    if (e == detail::npos32 || !entries_[e].has_state) return std::nullopt;
    return entries_[e].leg.boundary_hash;
  }

  /// The destination slot of an outstanding load; empty for a KV-only, unknown or resolved
  /// key. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::optional<SlotId> slot_of(LoadKey key) const noexcept {
    const std::uint32_t e = find_entry(key);
    if (e == detail::npos32 || !entries_[e].has_state) return std::nullopt;
    return entries_[e].leg.slot;
  }

  /// The live (non-orphaned) outstanding load of `request`, if any: what the scheduler
  /// orphans when it tears the request down. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::optional<LoadKey> live_load(RequestId request) const noexcept {
    const std::uint32_t e = requests_.find(request);
    if (e == detail::npos32) return std::nullopt;
    return entries_[e].key;
  }

  // ---------------------------------------------------------------- saves

  /// Grants a save ticket: issues its key (the caller's `save.key.hash`, a fresh generation) and
  /// returns a ticket whose dispatch() yields the save for every rank. The index remembers
  /// what it holds: only a StateSave every rank stored indexes its hash (the indexed set
  /// answers "can a state leg be served"; a KV chunk hash is not a checkpoint). Refused,
  /// changing nothing but saves_refused, only when the save table cannot grow: the caller
  /// learns it and keeps its source. Scheduler thread only; noexcept; O(1) amortised.
  template <class Save>
    requires std::same_as<Save, KvSave> || std::same_as<Save, StateSave>
  [[nodiscard]] SaveGrant<Save> request_save(Save save) noexcept {
    try {
      saves_.reserve(saves_.size() + 1);
    } catch (...) {
      ++stats_.saves_refused;
      return SaveGrant<Save>(SaveRefusal::out_of_memory);
    }
    save.key.generation = generations_.next();
    TokenCount spared = 0;
    if constexpr (std::same_as<Save, StateSave>) spared = save.boundary_tokens;
    saves_.insert(save.key, save_value(std::same_as<Save, StateSave> ? SaveKind::state : SaveKind::kv, false, spared));
    ++stats_.saves_issued;
    return SaveGrant<Save>(SaveTicket<Save>(this, std::move(save)));
  }

  /// Whether `key` is a dispatched save that has not settled its `stored` phase: the
  /// completion path accepts save records only for these (R3). Scheduler thread only;
  /// noexcept; O(1).
  [[nodiscard]] bool is_save_in_flight(SaveKey key) const noexcept {
    const std::uint32_t v = saves_.find(key);
    return v != detail::npos32 && (v & save_dispatched_bit) != 0;
  }

  /// Applies one phase of a merged save settlement. `released` counts saves_released when
  /// ok (the engine frees the source units; nothing changes in the index otherwise).
  /// `stored` resolves the save: a state save every rank stored indexes its hash via
  /// note_stored and counts saves_stored; otherwise saves_failed. A key not in flight is
  /// late: counted, nothing indexed. Returns whether it applied. Scheduler thread only;
  /// noexcept; O(1) amortised.
  bool settle_save(const SaveSettlement& s) noexcept {
    const std::uint32_t v = saves_.find(s.key);
    if (v == detail::npos32 || (v & save_dispatched_bit) == 0) {
      ++stats_.late_reports;
      return false;
    }
    if (s.phase == SavePhase::released) {
      if (s.ok) ++stats_.saves_released;
      return true;
    }
    (void)saves_.erase(s.key);
    if (s.ok) {
      ++stats_.saves_stored;
      if ((v & save_state_bit) != 0) note_stored(s.key.hash, v >> save_weight_shift);
    } else {
      ++stats_.saves_failed;
    }
    return true;
  }

  // ---------------------------------------------------------------- observability

  /// Every counter, plus the audit (see IndexStats) run on this read. A failed audit adds
  /// one to invariant_violations (included in the result) and never throws. Visits no
  /// entry: O(1) at any size (R17). Scheduler thread only; noexcept.
  [[nodiscard]] IndexStats stats() const noexcept {
    IndexStats s = stats_;
    s.saves_outstanding = saves_.size();
    const bool ok = s.issued == s.completed + s.failed + s.abandoned + s.outstanding &&
                    s.reclaimed <= s.abandoned && s.outstanding == keys_.size() && s.in_flight <= s.outstanding &&
                    s.in_flight == flight_.count && s.orphaned == orphans_.count && s.orphaned <= s.in_flight &&
                    s.indexed == hashes_.size() && hashes_.size() == hashes_.lru_length() &&
                    s.indexed <= options_.hash_capacity &&
                    s.saves_issued == s.saves_stored + s.saves_failed + s.saves_abandoned + s.saves_outstanding;
    if (!ok) ++invariant_violations_;
    s.invariant_violations = invariant_violations_;
    return s;
  }

  /// Test-visible count of per-entry visits made by any walk (the consistency walk,
  /// for_each_indexed, table rehashes) since construction. stats() adds nothing to it;
  /// R17's test proves that by counting. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::uint64_t walk_steps() const noexcept {
    return own_walks_ + hashes_.walks() + keys_.walks() + requests_.walks() + saves_.walks();
  }

 private:
  enum class Status : std::uint8_t { free, ticketed, in_flight };

  // Two intrusive lists thread the entries in time order: orphans by orphan time (reclaim
  // stops at the first young one) and loads in flight by dispatch time (report_overdue
  // stops likewise). One algorithm serves both, parameterised by the entry's links and time.
  struct Links {
    std::uint32_t prev = detail::npos32;
    std::uint32_t next = detail::npos32;
  };
  struct TimeList {
    std::uint32_t head = detail::npos32;  // oldest
    std::uint32_t tail = detail::npos32;  // newest
    std::uint64_t count = 0;              // kept by the list code, audited against the counters
  };

  struct Entry {
    LoadKey key{};
    StateSpec leg{};
    time_point orphaned_at{};
    time_point dispatched_at{};
    Links orphan_links{};   // the orphan list, in orphan-time order
    Links flight_links{};   // the in-flight list, in dispatch order
    std::uint32_t free_next = detail::npos32;  // the free list
    Status status = Status::free;
    bool has_state = false;
    bool orphaned = false;
  };

  static OffloadIndexOptions validated(OffloadIndexOptions o) {
    if (o.hash_capacity == 0 || o.hash_capacity > (std::size_t{1} << 31))
      throw Error(ErrorCode::invalid_argument,
                  "OffloadIndexOptions::hash_capacity must be in [1, 2^31], got " + std::to_string(o.hash_capacity));
    if (o.hash_eviction != HashEviction::lru && o.hash_eviction != HashEviction::spared_tokens)
      throw Error(ErrorCode::invalid_argument, "OffloadIndexOptions::hash_eviction=" +
                                                   std::to_string(static_cast<unsigned>(o.hash_eviction)) +
                                                   " is not a HashEviction (lru, spared_tokens)");
    if (o.slot_count > (std::uint32_t{1} << 24))
      throw Error(ErrorCode::invalid_argument,
                  "OffloadIndexOptions::slot_count must be at most 2^24, got " + std::to_string(o.slot_count));
    return o;
  }

  [[nodiscard]] LoadRefusal grant_check(RequestId request, bool has_kv,
                                            const std::optional<StateSpec>& state) const noexcept {
    if (!has_kv && !state) return LoadRefusal::empty_load;
    if (!options_.role_loads) return LoadRefusal::role_cannot_load;
    if (state) {
      if (!options_.state_tier) return LoadRefusal::no_state_tier;
      if (state->slot.value >= options_.slot_count) return LoadRefusal::invalid_slot;
      if (state->block_tokens == 0 || state->chunk_tokens == 0 || state->boundary_tokens % state->block_tokens != 0)
        return LoadRefusal::invalid_state_leg;
    }
    if (requests_.find(request) != detail::npos32) return LoadRefusal::load_in_flight;
    if (state) {
      if (slot_owner_[state->slot.value] != detail::npos32) return LoadRefusal::slot_in_use;
      if (!hashes_.contains(state->boundary_hash)) return LoadRefusal::hash_not_servable;
    }
    return LoadRefusal::none;
  }

  LoadGrant refuse(LoadRefusal why) noexcept {
    ++stats_.refused;
    return LoadGrant(why);
  }

  [[nodiscard]] std::uint32_t find_entry(LoadKey key) const noexcept {
    const std::uint32_t e = keys_.find(key.generation);
    if (e == detail::npos32 || entries_[e].key != key) return detail::npos32;
    return e;
  }

  // complete/fail/abandon by key: the engine ends a live load without its ranks.
  bool resolve_by_engine(LoadKey key, Resolution kind, bool missing) noexcept {
    const std::uint32_t e = find_entry(key);
    if (e == detail::npos32 || entries_[e].status != Status::in_flight) {
      ++stats_.late_reports;
      return false;
    }
    if (entries_[e].orphaned) return false;  // R8: ends only by settle() or reclaim
    forgotten_.push_back(key);  // capacity reserved at the grant
    resolve(e, kind, missing);
    return true;
  }

  // A save's table value: its kind and dispatched bits, and above them the tokens a state
  // save's checkpoint spares (its boundary, saturated below 2^30 - 1 so that the value is
  // never npos32), for the weighted eviction when it is indexed.
  static constexpr std::uint32_t save_state_bit = 1, save_dispatched_bit = 2, save_weight_shift = 2;
  static constexpr std::uint32_t save_value(SaveKind kind, bool dispatched, TokenCount spared = 0) noexcept {
    const std::uint32_t weight = static_cast<std::uint32_t>(std::min<TokenCount>(spared, (std::uint32_t{1} << 30) - 2));
    return (weight << save_weight_shift) | (kind == SaveKind::state ? save_state_bit : 0) |
           (dispatched ? save_dispatched_bit : 0);
  }
  // The eviction weight of a checkpoint sparing `tokens`: saturated to 32 bits.
  static constexpr std::uint32_t weight_of(TokenCount tokens) noexcept {
    return static_cast<std::uint32_t>(std::min<TokenCount>(tokens, UINT32_MAX));
  }
  // The spared_tokens eviction looks at this many least recently used hashes.
  static constexpr std::uint32_t spared_tokens_window = 8;

  // The one place a load ends: counters, tables, the hash (on a genuine miss), the
  // resolution queue, and, last, the orphan's slot.
  void resolve(std::uint32_t e, Resolution kind, bool missing, std::uint32_t kv_restored = 0) noexcept {
    Entry& en = entries_[e];
    const bool missed = missing && en.has_state;
    const bool release = en.orphaned && en.has_state;
    const SlotId slot = en.leg.slot;
    switch (kind) {
      case Resolution::completed: ++stats_.completed; break;
      case Resolution::failed: ++stats_.failed; break;
      case Resolution::abandoned: ++stats_.abandoned; break;
      case Resolution::reclaimed: ++stats_.abandoned; ++stats_.reclaimed; break;
    }
    --stats_.outstanding;
    if (en.status == Status::in_flight) {
      --stats_.in_flight;
      unlink<&Entry::flight_links>(flight_, e);
    }
    if (en.orphaned) {
      unlink<&Entry::orphan_links>(orphans_, e);
      --stats_.orphaned;
    } else {
      requests_.erase(en.key.request);
    }
    keys_.erase(en.key.generation);
    if (en.has_state) slot_owner_[slot.value] = detail::npos32;
    if (missed && forget(en.leg.boundary_hash)) ++stats_.hashes_retracted;
    resolutions_.push_back(LoadResolution{en.key, kind, missed, en.orphaned, en.status == Status::in_flight, kv_restored});
    en.status = Status::free;
    en.orphaned = false;
    en.free_next = free_entry_;
    free_entry_ = e;
    if (release) free_slot(slot);
  }

  void free_slot(SlotId slot) noexcept {
    ++stats_.slots_freed;
    if (!release_) return;  // the owner hears of it through the orphaned resolution
    try {
      release_(slot);
    } catch (...) {
      ++stats_.slot_free_errors;
    }
  }

  // Links `e` into `list` in time order. With a monotonic clock a new entry goes at the
  // tail in O(1); a clock that went back walks back k entries (counted as walk steps).
  template <Links Entry::*L, time_point Entry::*T>
  void link_sorted(TimeList& list, std::uint32_t e) noexcept {
    std::uint32_t after = list.tail;
    while (after != detail::npos32 && entries_[e].*T < entries_[after].*T) {
      ++own_walks_;
      after = (entries_[after].*L).prev;
    }
    const std::uint32_t before = after == detail::npos32 ? list.head : (entries_[after].*L).next;
    entries_[e].*L = Links{after, before};
    if (after == detail::npos32) list.head = e; else (entries_[after].*L).next = e;
    if (before == detail::npos32) list.tail = e; else (entries_[before].*L).prev = e;
    ++list.count;
  }

  template <Links Entry::*L>
  void unlink(TimeList& list, std::uint32_t e) noexcept {
    Links& l = entries_[e].*L;
    if (l.prev == detail::npos32) list.head = l.next; else (entries_[l.prev].*L).next = l.next;
    if (l.next == detail::npos32) list.tail = l.prev; else (entries_[l.next].*L).prev = l.prev;
    l = Links{};
    --list.count;
  }

  // detail::TicketSink
  std::optional<StateSpec> ticket_dispatch(std::uint32_t e, LoadKey key) noexcept override {
    if (e >= entries_.size() || entries_[e].key != key || entries_[e].status != Status::ticketed) return std::nullopt;
    Entry& en = entries_[e];
    en.status = Status::in_flight;
    en.dispatched_at = Clock::now();
    link_sorted<&Entry::flight_links, &Entry::dispatched_at>(flight_, e);
    ++stats_.in_flight;
    if (!en.has_state) return std::nullopt;
    return en.leg;
  }

  void ticket_abandon(std::uint32_t e, LoadKey key) noexcept override {
    if (e >= entries_.size() || entries_[e].key != key || entries_[e].status != Status::ticketed) return;
    resolve(e, Resolution::abandoned, false);
  }

  bool save_ticket_dispatch(SaveKey key) noexcept override {
    const std::uint32_t v = saves_.find(key);
    if (v == detail::npos32 || (v & save_dispatched_bit) != 0) return false;
    // Same size before and after: the re-insert cannot allocate.
    (void)saves_.erase(key);
    saves_.insert(key, v | save_dispatched_bit);
    return true;
  }

  void save_ticket_abandon(SaveKey key) noexcept override {
    const std::uint32_t v = saves_.find(key);
    if (v == detail::npos32 || (v & save_dispatched_bit) != 0) return;
    (void)saves_.erase(key);
    ++stats_.saves_abandoned;
  }

  OffloadIndexOptions options_;
  SlotFree release_;
  detail::LruHashSet hashes_;
  GenerationSource generations_;

  std::vector<Entry> entries_;                      // pooled load entries, addressed by index
  std::uint32_t free_entry_ = detail::npos32;       // free list through Entry::free_next
  detail::FlatIndexMap<Generation> keys_;           // generation -> outstanding entry (R3: the key of truth)
  detail::FlatIndexMap<RequestId> requests_;        // request -> its live (non-orphaned) entry
  std::vector<std::uint32_t> slot_owner_;           // slot -> outstanding entry holding it
  detail::FlatIndexMap<SaveKey> saves_;            // outstanding saves -> kind and dispatched bits
  std::vector<LoadResolution> resolutions_;         // the settlement queue the scheduler drains
  std::vector<LoadKey> forgotten_;                  // in-flight keys resolved without their ranks
  TimeList flight_;                                 // loads in flight, by dispatch time
  TimeList orphans_;                                // orphans, by orphan time

  IndexStats stats_{};  // every counter and counted gauge; stats() adds saves_outstanding and the audit
  mutable std::uint64_t invariant_violations_ = 0;
  mutable std::uint64_t own_walks_ = 0;
};

}  // namespace kvfuse
