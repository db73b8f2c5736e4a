// kvfuse/engine/offload_index.hpp — OffloadIndex, the engine side's one owner (R5), and
// LoadTicket, the move-only handle a load admission returns (R6).
//
// OffloadIndex alone owns the indexed state hashes (an LRU-capped set), every outstanding
// load (KV-only, joint and state-only alike), the slots held for orphaned loads, and the
// counters. Every load is named by one LoadKey {request, generation}; the index issues the
// generation itself, one per admission, so two admissions of one request never share a key
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

#include <kvfuse/completion/records.hpp>
#include <kvfuse/engine/capability.hpp>
#include <kvfuse/engine/detail/flat_index_map.hpp>
#include <kvfuse/engine/detail/lru_hash_set.hpp>
#include <kvfuse/engine/ids.hpp>
#include <kvfuse/engine/load_request.hpp>
#include <kvfuse/engine/store_request.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// The clock policy of OffloadIndex: a type with `time_point`, `duration` and a static
/// `now()`, like the std::chrono clocks. Tests use a manual clock whose now() they set.
template <class C>
concept IndexClock = requires {
  typename C::time_point;
  typename C::duration;
  { C::now() } -> std::convertible_to<typename C::time_point>;
} && requires(typename C::time_point a, typename C::time_point b, typename C::duration d) {
  { a - b } -> std::convertible_to<typename C::duration>;
  { d < d } -> std::convertible_to<bool>;
  { C::duration::zero() } -> std::convertible_to<typename C::duration>;
};

/// Why request_load refused. A refusal changes no counter but `refused`, no slot and no
/// LRU order. Checked in this order; the first that applies is reported.
enum class LoadRefusal : std::uint8_t {
  none = 0,           ///< not refused (an admission)
  empty_load,         ///< neither a KV spec nor a state leg: nothing to load
  role_cannot_load,   ///< the configured role never loads (OffloadIndexOptions::can_load is false)
  no_state_tier,      ///< a state leg, but there is no state tier (OffloadIndexOptions::state_tier)
  invalid_slot,       ///< the state leg's slot is outside [0, slot_count)
  invalid_state_leg,  ///< zero block_tokens or chunk_tokens, or a boundary off the checkpoint grid
  load_in_flight,     ///< this request already has a live (non-orphaned) load outstanding
  slot_in_use,        ///< another outstanding load (live or orphaned) holds the slot
  hash_not_servable,  ///< the state hash is not indexed (never stored, retracted or evicted)
  out_of_memory,      ///< the index could not grow its tables; nothing changed
};

/// Short, stable name of a LoadRefusal ("hash_not_servable", ...). Thread-safe, noexcept.
constexpr std::string_view to_string(LoadRefusal r) noexcept {
  switch (r) {
    case LoadRefusal::none: return "none";
    case LoadRefusal::empty_load: return "empty_load";
    case LoadRefusal::role_cannot_load: return "role_cannot_load";
    case LoadRefusal::no_state_tier: return "no_state_tier";
    case LoadRefusal::invalid_slot: return "invalid_slot";
    case LoadRefusal::invalid_state_leg: return "invalid_state_leg";
    case LoadRefusal::load_in_flight: return "load_in_flight";
    case LoadRefusal::slot_in_use: return "slot_in_use";
    case LoadRefusal::hash_not_servable: return "hash_not_servable";
    case LoadRefusal::out_of_memory: return "out_of_memory";
  }
  return "unknown_refusal";
}

/// The state half of a load as the engine asks for it: which checkpoint, into which slot,
/// and the grids the engine used. dispatch() turns it into the StateSpec ranks receive.
struct StateLeg {
  PrefixHash hash;                   ///< tier key of the checkpoint; must be indexed
  SlotId slot;                       ///< destination slot; owned by the live request
  TokenCount boundary_tokens = 0;    ///< B, on the checkpoint grid
  std::uint32_t block_tokens = 16;   ///< the engine's checkpoint grid (> 0)
  std::uint32_t chunk_tokens = 256;  ///< the engine's chunk grid (> 0)

  /// The StateSpec ranks receive for this leg. Thread-safe, noexcept.
  [[nodiscard]] constexpr StateSpec spec() const noexcept {
    return StateSpec{boundary_tokens, hash, slot, block_tokens, chunk_tokens};
  }
  friend constexpr bool operator==(const StateLeg&, const StateLeg&) = default;
};

/// Why request_save refused. A refusal changes no counter but `saves_refused`.
enum class SaveRefusal : std::uint8_t {
  none = 0,        ///< not refused (an admission)
  out_of_memory,   ///< the index could not grow its save table; nothing changed
};

/// Short, stable name of a SaveRefusal. Thread-safe, noexcept.
constexpr std::string_view to_string(SaveRefusal r) noexcept {
  switch (r) {
    case SaveRefusal::none: return "none";
    case SaveRefusal::out_of_memory: return "out_of_memory";
  }
  return "unknown_refusal";
}

/// How a load ended.
enum class Resolution : std::uint8_t {
  completed,  ///< settled ok
  failed,     ///< settled not ok (state_missed says whether the hash was retracted)
  abandoned,  ///< abandoned: by the ticket (explicitly or dropped) or by key; never retracts
  reclaimed,  ///< an orphan reclaimed after its timeout; counted as abandoned too
};

/// Short, stable name of a Resolution. Thread-safe, noexcept.
constexpr std::string_view to_string(Resolution r) noexcept {
  switch (r) {
    case Resolution::completed: return "completed";
    case Resolution::failed: return "failed";
    case Resolution::abandoned: return "abandoned";
    case Resolution::reclaimed: return "reclaimed";
  }
  return "unknown_resolution";
}

/// One resolved load, as the scheduler drains it: the single event that unparks (or
/// forgets) the request. Every admission yields exactly one.
struct LoadResolution {
  LoadKey key;
  Resolution kind = Resolution::completed;
  bool state_missed = false;  ///< failed with a genuine state miss: the hash was retracted
  bool orphaned = false;      ///< the request was already torn down; its slot went back via the release callback
  bool dispatched = false;    ///< a LoadRequest was handed out (false: the ticket was abandoned or dropped)
  friend constexpr bool operator==(const LoadResolution&, const LoadResolution&) = default;
};

/// Construction options of OffloadIndex. See index_options_for() to derive them from a
/// Capability.
struct OffloadIndexOptions {
  /// Most state hashes indexed at once; the least recently used is evicted beyond it.
  /// Must be in [1, 2^31]; construction throws Error(invalid_argument) naming it otherwise.
  std::size_t hash_capacity = std::size_t{1} << 20;
  /// Size of the engine's state slot pool: a state leg's slot must be < slot_count.
  /// At most 2^24 (the index keeps one word per slot); 0 means no state legs at all.
  std::uint32_t slot_count = 0;
  /// False: this role never loads; every request_load is refused with role_cannot_load.
  bool can_load = true;
  /// False: there is no state tier; a load with a state leg is refused with no_state_tier.
  bool state_tier = true;
  /// Allocate the whole hash table at construction, so note_stored never allocates.
  bool preallocate_hashes = false;
  /// The last generation an earlier incarnation issued: generations continue after it.
  Generation last_issued{};
};

/// Options for an engine with the given capability and slot pool: loads only where the
/// role loads, state legs only where the state tier exists. Thread-safe.
inline OffloadIndexOptions index_options_for(const Capability& cap, std::uint32_t slot_count) {
  OffloadIndexOptions o;
  o.slot_count = slot_count;
  o.can_load = cap.kv_can_load;
  o.state_tier = cap.can_load;
  return o;
}

/// Returns a torn-down request's slot to the engine's allocator. OffloadIndex calls it
/// exactly once per orphaned state-leg load, on the scheduler thread, after its own state
/// is updated. It must not call back into the index. It should not throw: an exception is
/// caught, counted in IndexStats::slot_release_errors, and the slot counts as released.
using SlotRelease = std::function<void(SlotId)>;

/// One load reported by OffloadIndex::report_overdue: in flight for at least the threshold.
struct OverdueLoad {
  LoadKey key;
  std::chrono::nanoseconds age{};  ///< time since dispatch()
  bool orphaned = false;           ///< its request was torn down (reclaim will age it out)
};

/// Every counter of the index, read in O(1) by OffloadIndex::stats().
///
/// Identities audited on every read: dispatched == completed + failed + abandoned +
/// outstanding; reclaimed <= abandoned; outstanding == entries in the key table;
/// in_flight == length of the dispatch-ordered list; indexed == hashes in the buckets ==
/// LRU length; orphaned == orphan list length; saves_issued == saves_stored +
/// saves_failed + saves_abandoned + saves_outstanding.
struct IndexStats {
  std::uint64_t dispatched = 0;    ///< admissions (tickets issued), counted at request_load
  std::uint64_t in_flight = 0;     ///< outstanding loads whose ticket was dispatched
  std::uint64_t completed = 0;
  std::uint64_t failed = 0;
  std::uint64_t abandoned = 0;     ///< includes ticket drops and reclaims
  std::uint64_t reclaimed = 0;     ///< orphans reclaimed after the timeout (also in abandoned)
  std::uint64_t outstanding = 0;   ///< admitted, not yet resolved (ticket alive, or in flight)
  std::uint64_t orphaned = 0;      ///< outstanding loads whose request was torn down
  std::uint64_t late_reports = 0;  ///< settlements (load or save) for unknown/settled/reclaimed keys
  std::uint64_t refused = 0;       ///< request_load refusals
  std::uint64_t indexed = 0;       ///< state hashes currently indexed
  std::uint64_t hashes_evicted = 0;    ///< evicted by the LRU cap
  std::uint64_t hashes_retracted = 0;  ///< forgotten because a load reported a genuine miss
  std::uint64_t hashes_dropped = 0;    ///< not indexed for lack of memory
  std::uint64_t slots_released = 0;    ///< orphan slots returned through the release callback
  std::uint64_t slot_release_errors = 0;  ///< release callbacks that threw
  std::uint64_t invariant_violations = 0;  ///< stats() reads whose audit failed
  std::uint64_t overdue = 0;           ///< loads the last report_overdue() found in flight past its threshold
  std::uint64_t saves_issued = 0;      ///< save tickets issued by request_save
  std::uint64_t saves_released = 0;    ///< saves whose source every rank released (early block release)
  std::uint64_t saves_stored = 0;      ///< saves every rank stored
  std::uint64_t saves_failed = 0;      ///< saves some rank did not store
  std::uint64_t saves_abandoned = 0;   ///< save tickets dropped or abandoned undispatched
  std::uint64_t saves_outstanding = 0; ///< save tickets alive or saves in flight
  std::uint64_t saves_refused = 0;     ///< request_save refusals
  friend constexpr bool operator==(const IndexStats&, const IndexStats&) = default;
};

/// Result of OffloadIndex::check_consistency().
struct ConsistencyReport {
  bool ok = true;
  std::string problem;        ///< the first inconsistency found; empty when ok
  std::uint64_t visited = 0;  ///< entries, nodes and table slots the walk visited
};

template <class Clock>
class OffloadIndex;

namespace detail {
/// Test hook, declared and never defined here: a test specialises it for a tag type of its
/// own to reach OffloadIndex internals (to corrupt a counter and watch the audit catch it).
/// Engines have no use for it.
template <class Tag>
struct OffloadIndexAccess;

/// The index side of a ticket. Private to OffloadIndex; a ticket calls back through it.
class TicketSink {
 public:
  virtual std::optional<StateSpec> ticket_dispatch(std::uint32_t entry, LoadKey key) noexcept = 0;
  virtual void ticket_abandon(std::uint32_t entry, LoadKey key) noexcept = 0;
  virtual bool save_ticket_dispatch(StoreKey key) noexcept = 0;
  virtual void save_ticket_abandon(StoreKey key) noexcept = 0;

 protected:
  TicketSink() = default;
  TicketSink(const TicketSink&) = default;
  TicketSink& operator=(const TicketSink&) = default;
  ~TicketSink() = default;
};
}  // namespace detail

/// A move-only claim on one admitted load (R6). Consumed by exactly one of dispatch() or
/// abandon(); destroyed unconsumed, it abandons itself, so a path that forgot the load
/// still produces a resolution the scheduler drains. While a ticket is alive its load is
/// counted in `dispatched` and `outstanding`, so the R5 identity holds at every instant.
///
/// Not thread-safe: scheduler thread only. The OffloadIndex that issued it must outlive it.
class LoadTicket {
 public:
  /// An empty ticket (holds no load). noexcept.
  LoadTicket() noexcept = default;
  LoadTicket(const LoadTicket&) = delete;
  LoadTicket& operator=(const LoadTicket&) = delete;
  /// Moves the claim; `other` becomes empty. Scheduler thread only; noexcept.
  LoadTicket(LoadTicket&& other) noexcept
      : sink_(std::exchange(other.sink_, nullptr)), entry_(other.entry_), key_(other.key_), kv_(std::move(other.kv_)) {
    other.kv_.reset();
  }
  /// Abandons the load this ticket holds (if any), then takes `other`'s claim.
  /// Scheduler thread only; noexcept.
  LoadTicket& operator=(LoadTicket&& other) noexcept {
    if (this != &other) {
      abandon();
      sink_ = std::exchange(other.sink_, nullptr);
      entry_ = other.entry_;
      key_ = other.key_;
      kv_ = std::move(other.kv_);
      other.kv_.reset();
    }
    return *this;
  }
  /// Abandons the load if the ticket was never consumed (R6). Scheduler thread only.
  ~LoadTicket() { abandon(); }

  /// Whether the ticket still holds an unconsumed load. Scheduler thread only; noexcept.
  [[nodiscard]] bool valid() const noexcept { return sink_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  /// The key of the load this ticket was issued for; still readable after it is consumed.
  /// LoadKey{} for a default-constructed ticket. Scheduler thread only; noexcept.
  [[nodiscard]] LoadKey key() const noexcept { return key_; }

  /// Consumes the ticket: the load becomes in flight (the index now accepts reports for
  /// its key) and the plain-data LoadRequest to ship to every rank is returned. The KV
  /// spec is moved, never copied. On an empty ticket it returns a LoadRequest with no leg
  /// and an unissued key, which every rank refuses and the index treats as late.
  /// Scheduler thread only; noexcept; O(1), never allocates.
  [[nodiscard]] LoadRequest dispatch() noexcept {
    LoadRequest req;
    if (sink_ == nullptr) return req;
    req.key = key_;
    req.state = std::exchange(sink_, nullptr)->ticket_dispatch(entry_, key_);
    req.kv = std::move(kv_);
    kv_.reset();
    return req;
  }

  /// Consumes the ticket without dispatching: the load resolves as abandoned (never a
  /// miss, R7) and the resolution is queued for the scheduler. No-op on an empty ticket.
  /// Scheduler thread only; noexcept; O(1).
  void abandon() noexcept {
    if (sink_ == nullptr) return;
    kv_.reset();
    std::exchange(sink_, nullptr)->ticket_abandon(entry_, key_);
  }

 private:
  template <class Clock>
  friend class OffloadIndex;

  LoadTicket(detail::TicketSink* sink, std::uint32_t entry, LoadKey key, std::optional<KvSpec>&& kv) noexcept
      : sink_(sink), entry_(entry), key_(key), kv_(std::move(kv)) {}

  detail::TicketSink* sink_ = nullptr;
  std::uint32_t entry_ = detail::npos32;
  LoadKey key_{};
  std::optional<KvSpec> kv_;
};

/// A move-only claim on one admitted save (DESIGN section 5): the save a rank will run,
/// with the key the index issued. Consumed by exactly one of dispatch() (which yields the
/// save to ship to every rank; from then on the index accepts its records) or abandon();
/// destroyed unconsumed, it abandons itself. A save cannot reach a rank unannounced: its
/// key exists only through a ticket. `Save` is KvSave or StateStore.
///
/// Not thread-safe: scheduler thread only. The OffloadIndex that issued it must outlive it.
template <class Save>
class SaveTicket {
 public:
  /// An empty ticket. noexcept.
  SaveTicket() noexcept = default;
  SaveTicket(const SaveTicket&) = delete;
  SaveTicket& operator=(const SaveTicket&) = delete;
  /// Moves the claim; `other` becomes empty. noexcept.
  SaveTicket(SaveTicket&& other) noexcept : sink_(std::exchange(other.sink_, nullptr)), save_(std::move(other.save_)) {}
  /// Abandons the save this ticket holds (if any), then takes `other`'s claim. noexcept.
  SaveTicket& operator=(SaveTicket&& other) noexcept {
    if (this != &other) {
      abandon();
      sink_ = std::exchange(other.sink_, nullptr);
      save_ = std::move(other.save_);
    }
    return *this;
  }
  /// Abandons the save if it was never consumed. Scheduler thread only.
  ~SaveTicket() { abandon(); }

  /// Whether the ticket still holds an unconsumed save. noexcept.
  [[nodiscard]] bool valid() const noexcept { return sink_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  /// The key the index issued (readable after consumption); StoreKey{} when empty. noexcept.
  [[nodiscard]] StoreKey key() const noexcept { return save_.key; }

  /// Consumes the ticket: the save becomes in flight and is returned (moved) for every
  /// rank. On an empty ticket it returns a default Save whose key no index accepts.
  /// Scheduler thread only; noexcept; O(1).
  [[nodiscard]] Save dispatch() noexcept {
    if (sink_ == nullptr) return Save{};
    (void)std::exchange(sink_, nullptr)->save_ticket_dispatch(save_.key);
    return std::move(save_);
  }

  /// Consumes the ticket without dispatching: counted in saves_abandoned; nothing is
  /// indexed. No-op on an empty ticket. Scheduler thread only; noexcept; O(1).
  void abandon() noexcept {
    if (sink_ == nullptr) return;
    std::exchange(sink_, nullptr)->save_ticket_abandon(save_.key);
  }

 private:
  template <class Clock>
  friend class OffloadIndex;
  SaveTicket(detail::TicketSink* sink, Save&& save) noexcept : sink_(sink), save_(std::move(save)) {}

  detail::TicketSink* sink_ = nullptr;
  Save save_{};
};

/// What request_load / request_save return: a ticket, or the reason there is none.
/// Move-only. Dropping an admission whose ticket was not taken drops (and so abandons) the
/// ticket. Not thread-safe: scheduler thread only, like the ticket it holds.
template <class Ticket, class Refusal>
class [[nodiscard]] Admission {
 public:
  /// A refusal. noexcept.
  explicit Admission(Refusal refusal) noexcept : refusal_(refusal) {}
  /// An admission. noexcept.
  explicit Admission(Ticket&& ticket) noexcept : ticket_(std::move(ticket)) {}

  /// Whether a ticket was issued. noexcept.
  [[nodiscard]] bool admitted() const noexcept { return refusal_ == Refusal::none; }
  explicit operator bool() const noexcept { return admitted(); }
  /// The refusal reason; Refusal::none when admitted. noexcept.
  [[nodiscard]] Refusal refusal() const noexcept { return refusal_; }
  /// The ticket (empty when refused, or once taken). noexcept.
  [[nodiscard]] Ticket& ticket() noexcept { return ticket_; }
  /// Moves the ticket out. noexcept.
  [[nodiscard]] Ticket take_ticket() noexcept { return std::move(ticket_); }

 private:
  Ticket ticket_;
  Refusal refusal_ = Refusal::none;
};

/// What request_load returns.
using LoadAdmission = Admission<LoadTicket, LoadRefusal>;
/// What request_save returns.
template <class Save>
using SaveAdmission = Admission<SaveTicket<Save>, SaveRefusal>;

/// The engine side's one owner of offload state (R5). See the file comment.
///
/// NOT thread-safe: every member is called from the engine's scheduler thread only.
/// Neither copyable nor movable (tickets point at it); it must outlive every ticket it
/// issued. Every member is noexcept except construction, check_consistency() and the
/// visitor walks (for_each_indexed; drain_resolutions with a visitor that may throw).
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
/// fail_all/settle_all (O(keys)), drain_resolutions (O(drained)), for_each_indexed and
/// check_consistency (O(everything)). No path on a load, settle or stats() walks a structure.
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

  /// Builds an empty index. `release` returns orphans' slots to the engine's allocator.
  /// Throws Error(invalid_argument) naming the value when hash_capacity is 0 or above 2^31,
  /// slot_count is above 2^24, or `release` is empty. Any thread may construct it; from
  /// then on only the scheduler thread uses it. Destroying it releases no slot (the
  /// engine is going away) and requires every ticket it issued to be gone.
  OffloadIndex(OffloadIndexOptions options, SlotRelease release)
      : options_(validated(options)),
        release_(std::move(release)),
        hashes_(options_.hash_capacity, options_.preallocate_hashes),
        generations_(options_.last_issued),
        slot_owner_(options_.slot_count, detail::npos32) {
    if (!release_) throw Error(ErrorCode::invalid_argument, "OffloadIndex needs a slot-release callback, got an empty one");
  }

  OffloadIndex(const OffloadIndex&) = delete;
  OffloadIndex& operator=(const OffloadIndex&) = delete;
  OffloadIndex(OffloadIndex&&) = delete;
  OffloadIndex& operator=(OffloadIndex&&) = delete;
  ~OffloadIndex() = default;

  /// The options the index was built with. Scheduler thread only; noexcept.
  [[nodiscard]] const OffloadIndexOptions& options() const noexcept { return options_; }

  // ---------------------------------------------------------------- indexed hashes

  /// Indexes `hash` as most recently used (or touches it). At the cap the least recently
  /// used hash is evicted and counted in hashes_evicted. Call it only when every rank
  /// stored the entry (settle_store does). Scheduler thread only; noexcept; O(1) amortised.
  void note_stored(PrefixHash hash) noexcept {
    const auto r = hashes_.insert_or_touch(hash);
    if (r.evicted) {
      ++hashes_evicted_;
      --indexed_;
    }
    if (r.outcome == detail::LruHashSet::Outcome::inserted) ++indexed_;
    if (r.outcome == detail::LruHashSet::Outcome::dropped) ++hashes_dropped_;
  }

  /// Removes `hash` from the index; returns whether it was indexed. Outstanding loads of it
  /// are untouched. Scheduler thread only; noexcept; O(1).
  bool forget(PrefixHash hash) noexcept {
    if (!hashes_.erase(hash)) return false;
    --indexed_;
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

  /// Admits a load for `request`: KV-only (state empty), state-only (kv empty, R10) or
  /// joint. On admission, issues a fresh generation, counts the load in `dispatched` and
  /// `outstanding`, holds the slot against other loads, touches the state hash's LRU
  /// position, and returns a ticket that owns the KV spec (moved, not copied). On refusal
  /// (see LoadRefusal for the order of checks) only `refused` changes.
  /// Scheduler thread only; noexcept; O(1) amortised (allocates only when a table grows).
  [[nodiscard]] LoadAdmission request_load(RequestId request, std::optional<KvSpec> kv,
                                           std::optional<StateLeg> state) noexcept {
    const LoadRefusal why = admission_check(request, kv.has_value(), state);
    if (why != LoadRefusal::none) return refuse(why);
    std::uint32_t e = free_entry_;
    try {
      keys_.reserve(keys_.size() + 1);
      requests_.reserve(requests_.size() + 1);
      // Every outstanding load resolves at most once before the next admission, so this
      // reserve is what lets every settle path queue its resolution without allocating.
      const std::size_t need = resolutions_.size() + outstanding_ + 1;
      if (resolutions_.capacity() < need) resolutions_.reserve(std::max(need, 2 * resolutions_.capacity()));
      const std::size_t forget_need = forgotten_.size() + outstanding_ + 1;
      if (forgotten_.capacity() < forget_need) forgotten_.reserve(std::max(forget_need, 2 * forgotten_.capacity()));
      if (e == detail::npos32) {
        if (entries_.size() == entries_.capacity()) entries_.reserve(std::max<std::size_t>(64, 2 * entries_.size()));
        entries_.emplace_back();
        e = static_cast<std::uint32_t>(entries_.size() - 1);
        entries_[e].link_next = detail::npos32;
        free_entry_ = e;  // now on the free list, popped below
      }
    } catch (...) {
      return refuse(LoadRefusal::out_of_memory);
    }
    free_entry_ = entries_[e].link_next;

    const LoadKey key{request, generations_.next()};
    Entry& en = entries_[e];
    en = Entry{};
    en.key = key;
    en.status = Status::ticketed;
    if (state) {
      en.has_state = true;
      en.leg = *state;
      slot_owner_[state->slot.value] = e;
      hashes_.touch(state->hash);
    }
    keys_.insert(key.generation, e);
    requests_.insert(request, e);
    ++dispatched_;
    ++outstanding_;
    return LoadAdmission(LoadTicket(this, e, key, std::move(kv)));
  }

  /// Settles a load its ranks reported on (the completion path calls it with every
  /// merged settlement): ok ? completed : failed, retracting the state hash when
  /// state_missed (a genuine miss on some rank). The one way an orphan ends besides
  /// reclaim: its slot goes back through the callback. Returns false (and only counts a
  /// late report) if `key` is not in flight: unknown, never dispatched, already resolved,
  /// or reclaimed (R3). Scheduler thread only; noexcept; O(1).
  bool settle(const Settlement& s) noexcept {
    const std::uint32_t e = find_entry(s.key);
    if (e == detail::npos32 || entries_[e].status != Status::in_flight) {
      ++late_reports_;
      return false;
    }
    resolve(e, s.ok ? Resolution::completed : Resolution::failed, !s.ok && s.state_missed);
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
  /// release callback exactly once, when the load settles or is reclaimed. Returns false
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
    orphan_link_sorted(e);
    ++orphaned_;
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
    while (orphan_head_ != detail::npos32) {
      const std::uint32_t e = orphan_head_;
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
    for (std::uint32_t e = flight_head_; e != detail::npos32; e = entries_[e].flight_next) {
      const duration age = now - entries_[e].dispatched_at;
      if (age < threshold) break;  // dispatch-ordered: the rest are younger
      visit(OverdueLoad{entries_[e].key, std::chrono::duration_cast<std::chrono::nanoseconds>(age), entries_[e].orphaned});
      ++n;
    }
    overdue_ = n;
    return n;
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
  [[nodiscard]] bool is_outstanding(LoadKey key) const noexcept {
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
    return entries_[e].leg.hash;
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

  /// Admits a save: issues its key (the caller's `save.key.hash`, a fresh generation) and
  /// returns a ticket whose dispatch() yields the save for every rank. The index remembers
  /// what it holds: only a StateStore every rank stored indexes its hash (the indexed set
  /// answers "can a state leg be served"; a KV chunk hash is not a checkpoint). Refused,
  /// changing nothing but saves_refused, only when the save table cannot grow: the caller
  /// learns it and keeps its source. Scheduler thread only; noexcept; O(1) amortised.
  template <class Save>
    requires std::same_as<Save, KvSave> || std::same_as<Save, StateStore>
  [[nodiscard]] SaveAdmission<Save> request_save(Save save) noexcept {
    try {
      saves_.reserve(saves_.size() + 1);
    } catch (...) {
      ++saves_refused_;
      return SaveAdmission<Save>(SaveRefusal::out_of_memory);
    }
    save.key.generation = generations_.next();
    saves_.insert(save.key, save_value(std::same_as<Save, StateStore> ? SaveKind::state : SaveKind::kv, false));
    ++saves_issued_;
    return SaveAdmission<Save>(SaveTicket<Save>(this, std::move(save)));
  }

  /// Whether `key` is a dispatched save that has not settled its `stored` phase: the
  /// completion path accepts save records only for these (R3). Scheduler thread only;
  /// noexcept; O(1).
  [[nodiscard]] bool is_save_in_flight(StoreKey key) const noexcept {
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
      ++late_reports_;
      return false;
    }
    if (s.phase == SavePhase::released) {
      if (s.ok) ++saves_released_;
      return true;
    }
    (void)saves_.erase(s.key);
    if (s.ok) {
      ++saves_stored_;
      if ((v & save_state_bit) != 0) note_stored(s.key.hash);
    } else {
      ++saves_failed_;
    }
    return true;
  }

  // ---------------------------------------------------------------- observability

  /// Every counter, plus the audit (see IndexStats) run on this read. A failed audit adds
  /// one to invariant_violations (included in the result) and never throws. Visits no
  /// entry: O(1) at any size (R17). Scheduler thread only; noexcept.
  [[nodiscard]] IndexStats stats() const noexcept {
    IndexStats s;
    s.dispatched = dispatched_;
    s.in_flight = in_flight_;
    s.completed = completed_;
    s.failed = failed_;
    s.abandoned = abandoned_;
    s.reclaimed = reclaimed_;
    s.outstanding = outstanding_;
    s.orphaned = orphaned_;
    s.late_reports = late_reports_;
    s.refused = refused_;
    s.indexed = indexed_;
    s.hashes_evicted = hashes_evicted_;
    s.hashes_retracted = hashes_retracted_;
    s.hashes_dropped = hashes_dropped_;
    s.slots_released = slots_released_;
    s.slot_release_errors = slot_release_errors_;
    s.overdue = overdue_;
    s.saves_issued = saves_issued_;
    s.saves_released = saves_released_;
    s.saves_stored = saves_stored_;
    s.saves_failed = saves_failed_;
    s.saves_abandoned = saves_abandoned_;
    s.saves_outstanding = saves_.size();
    s.saves_refused = saves_refused_;
    const bool ok = s.dispatched == s.completed + s.failed + s.abandoned + s.outstanding &&
                    s.reclaimed <= s.abandoned && s.outstanding == keys_.size() && s.in_flight <= s.outstanding &&
                    s.in_flight == flight_count_ && s.orphaned == orphan_count_ && s.orphaned <= s.in_flight &&
                    s.indexed == hashes_.size() && hashes_.size() == hashes_.lru_length() &&
                    s.indexed <= options_.hash_capacity &&
                    s.saves_issued == s.saves_stored + s.saves_failed + s.saves_abandoned + s.saves_outstanding;
    if (!ok) ++invariant_violations_;
    s.invariant_violations = invariant_violations_;
    return s;
  }

  /// Walks every structure and checks it against the counters: the hash buckets and the
  /// LRU list agree, every outstanding entry is in the key table under its own key, every
  /// live load is the one its request maps to, no slot is held by two loads and every
  /// state-leg load (orphans included) holds its slot, the orphan list holds exactly the
  /// orphans in orphan-time order, and every counter matches the entries. For tests only:
  /// O(everything), allocates. Scheduler thread only.
  [[nodiscard]] ConsistencyReport check_consistency() const {
    const std::uint64_t before = walk_steps();
    ConsistencyReport rep;
    auto fail_with = [&](std::string what) {
      if (rep.ok) {
        rep.ok = false;
        rep.problem = std::move(what);
      }
    };
    if (std::string p = hashes_.check(); !p.empty()) fail_with("hash set: " + p);
    if (hashes_.size() != indexed_) fail_with("indexed counter disagrees with the hash set");

    std::uint64_t ticketed = 0, in_flight = 0, orphans = 0, live = 0, with_state = 0;
    for (std::uint32_t e = 0; e < entries_.size(); ++e) {
      ++own_walks_;
      const Entry& en = entries_[e];
      if (en.status == Status::free) continue;
      (en.status == Status::ticketed ? ticketed : in_flight) += 1;
      if (keys_.find(en.key.generation) != e) fail_with("an outstanding load is not in the key table: " + to_string(en.key));
      if (en.orphaned) {
        ++orphans;
        if (en.status != Status::in_flight) fail_with("an orphan that was never dispatched: " + to_string(en.key));
        if (requests_.find(en.key.request) == e) fail_with("an orphan still blocks its request: " + to_string(en.key));
      } else {
        ++live;
        if (requests_.find(en.key.request) != e) fail_with("a live load is not its request's load: " + to_string(en.key));
      }
      if (en.has_state) {
        ++with_state;
        if (en.leg.slot.value >= slot_owner_.size() || slot_owner_[en.leg.slot.value] != e)
          fail_with("a state-leg load does not hold its slot: " + to_string(en.key));
      }
    }
    std::uint64_t held_slots = 0;
    for (const std::uint32_t owner : slot_owner_) {
      ++own_walks_;
      if (owner == detail::npos32) continue;
      ++held_slots;
      if (owner >= entries_.size() || entries_[owner].status == Status::free || !entries_[owner].has_state)
        fail_with("a slot is held by no outstanding state-leg load");
    }
    // Each state-leg load points at its own slot and each held slot points back at one
    // load, so equal counts mean no slot is held twice.
    if (held_slots != with_state) fail_with("slots held twice or leaked: held slots != state-leg loads");
    keys_.for_each([&](Generation g, std::uint32_t e) {
      if (e >= entries_.size() || entries_[e].status == Status::free || entries_[e].key.generation != g)
        fail_with("the key table names a resolved load");
    });
    requests_.for_each([&](RequestId r, std::uint32_t e) {
      if (e >= entries_.size() || entries_[e].status == Status::free || entries_[e].orphaned || entries_[e].key.request != r)
        fail_with("the request table names a resolved or orphaned load");
    });
    std::uint64_t listed = 0;
    std::uint32_t prev = detail::npos32;
    for (std::uint32_t e = orphan_head_; e != detail::npos32; e = entries_[e].link_next) {
      ++own_walks_;
      if (!entries_[e].orphaned || entries_[e].status != Status::in_flight) fail_with("the orphan list holds a non-orphan");
      if (entries_[e].link_prev != prev) fail_with("orphan list links disagree");
      if (prev != detail::npos32 && entries_[e].orphaned_at < entries_[prev].orphaned_at)
        fail_with("the orphan list is not in orphan-time order");
      prev = e;
      if (++listed > entries_.size()) {
        fail_with("the orphan list has a cycle");
        break;
      }
    }
    if (prev != orphan_tail_) fail_with("orphan list tail is not the last orphan");
    std::uint64_t free_entries = 0;
    for (std::uint32_t e = free_entry_; e != detail::npos32 && free_entries <= entries_.size(); e = entries_[e].link_next) {
      ++own_walks_;
      ++free_entries;
      if (entries_[e].status != Status::free) fail_with("the free list holds an outstanding load");
    }
    if (free_entries + ticketed + in_flight != entries_.size()) fail_with("load entries leaked: neither outstanding nor free");
    if (ticketed + in_flight != outstanding_) fail_with("outstanding counter disagrees with the entries");
    if (in_flight != in_flight_) fail_with("in_flight counter disagrees with the entries");
    if (orphans != orphaned_ || listed != orphaned_ || orphan_count_ != orphaned_)
      fail_with("orphaned counter disagrees with the entries or the orphan list");
    if (keys_.size() != outstanding_) fail_with("key table size disagrees with outstanding");
    if (requests_.size() != live) fail_with("request table size disagrees with the live loads");
    if (dispatched_ != completed_ + failed_ + abandoned_ + outstanding_)
      fail_with("dispatched != completed + failed + abandoned + outstanding");
    if (reclaimed_ > abandoned_) fail_with("reclaimed > abandoned");
    if (saves_issued_ != saves_stored_ + saves_failed_ + saves_abandoned_ + saves_.size())
      fail_with("saves_issued != saves_stored + saves_failed + saves_abandoned + saves_outstanding");
    std::uint64_t flying = 0;
    prev = detail::npos32;
    for (std::uint32_t e = flight_head_; e != detail::npos32; e = entries_[e].flight_next) {
      ++own_walks_;
      if (entries_[e].status != Status::in_flight) fail_with("the in-flight list holds a load that is not in flight");
      if (entries_[e].flight_prev != prev) fail_with("in-flight list links disagree");
      if (prev != detail::npos32 && entries_[e].dispatched_at < entries_[prev].dispatched_at)
        fail_with("the in-flight list is not in dispatch order");
      prev = e;
      if (++flying > entries_.size()) {
        fail_with("the in-flight list has a cycle");
        break;
      }
    }
    if (prev != flight_tail_) fail_with("in-flight list tail is not the last dispatched load");
    if (flying != in_flight_ || flight_count_ != in_flight_) fail_with("in_flight counter disagrees with the in-flight list");
    if (resolutions_.capacity() < resolutions_.size() + outstanding_)
      fail_with("the resolution queue could need to allocate on a settle path");
    if (forgotten_.capacity() < forgotten_.size() + outstanding_)
      fail_with("the forget list could need to allocate on a resolve path");
    rep.visited = walk_steps() - before;
    return rep;
  }

  /// Test-visible count of per-entry visits made by any walk (check_consistency,
  /// for_each_indexed, table rehashes) since construction. stats() adds nothing to it;
  /// R17's test proves that by counting. Scheduler thread only; noexcept; O(1).
  [[nodiscard]] std::uint64_t walk_steps() const noexcept {
    return own_walks_ + hashes_.walks() + keys_.walks() + requests_.walks() + saves_.walks();
  }

 private:
  enum class Status : std::uint8_t { free, ticketed, in_flight };

  struct Entry {
    LoadKey key{};
    StateLeg leg{};
    time_point orphaned_at{};
    time_point dispatched_at{};
    std::uint32_t link_prev = detail::npos32;    // orphan list
    std::uint32_t link_next = detail::npos32;    // orphan list, or the free list
    std::uint32_t flight_prev = detail::npos32;  // in-flight list, in dispatch order
    std::uint32_t flight_next = detail::npos32;
    Status status = Status::free;
    bool has_state = false;
    bool orphaned = false;
  };

  static OffloadIndexOptions validated(OffloadIndexOptions o) {
    if (o.hash_capacity == 0 || o.hash_capacity > (std::size_t{1} << 31))
      throw Error(ErrorCode::invalid_argument,
                  "OffloadIndexOptions::hash_capacity must be in [1, 2^31], got " + std::to_string(o.hash_capacity));
    if (o.slot_count > (std::uint32_t{1} << 24))
      throw Error(ErrorCode::invalid_argument,
                  "OffloadIndexOptions::slot_count must be at most 2^24, got " + std::to_string(o.slot_count));
    return o;
  }

  [[nodiscard]] LoadRefusal admission_check(RequestId request, bool has_kv,
                                            const std::optional<StateLeg>& state) const noexcept {
    if (!has_kv && !state) return LoadRefusal::empty_load;
    if (!options_.can_load) return LoadRefusal::role_cannot_load;
    if (state) {
      if (!options_.state_tier) return LoadRefusal::no_state_tier;
      if (state->slot.value >= options_.slot_count) return LoadRefusal::invalid_slot;
      if (state->block_tokens == 0 || state->chunk_tokens == 0 || state->boundary_tokens % state->block_tokens != 0)
        return LoadRefusal::invalid_state_leg;
    }
    if (requests_.find(request) != detail::npos32) return LoadRefusal::load_in_flight;
    if (state) {
      if (slot_owner_[state->slot.value] != detail::npos32) return LoadRefusal::slot_in_use;
      if (!hashes_.contains(state->hash)) return LoadRefusal::hash_not_servable;
    }
    return LoadRefusal::none;
  }

  LoadAdmission refuse(LoadRefusal why) noexcept {
    ++refused_;
    return LoadAdmission(why);
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
      ++late_reports_;
      return false;
    }
    if (entries_[e].orphaned) return false;  // R8: ends only by settle() or reclaim
    forgotten_.push_back(key);  // capacity reserved at admission
    resolve(e, kind, missing);
    return true;
  }

  static constexpr std::uint32_t save_state_bit = 1, save_dispatched_bit = 2;
  static constexpr std::uint32_t save_value(SaveKind kind, bool dispatched) noexcept {
    return (kind == SaveKind::state ? save_state_bit : 0) | (dispatched ? save_dispatched_bit : 0);
  }

  // The one place a load ends: counters, tables, the hash (on a genuine miss), the
  // resolution queue, and, last, the orphan's slot.
  void resolve(std::uint32_t e, Resolution kind, bool missing) noexcept {
    Entry& en = entries_[e];
    const bool missed = missing && en.has_state;
    const bool release = en.orphaned && en.has_state;
    const SlotId slot = en.leg.slot;
    switch (kind) {
      case Resolution::completed: ++completed_; break;
      case Resolution::failed: ++failed_; break;
      case Resolution::abandoned: ++abandoned_; break;
      case Resolution::reclaimed: ++abandoned_; ++reclaimed_; break;
    }
    --outstanding_;
    if (en.status == Status::in_flight) {
      --in_flight_;
      flight_unlink(e);
    }
    if (en.orphaned) {
      orphan_unlink(e);
      --orphaned_;
    } else {
      requests_.erase(en.key.request);
    }
    keys_.erase(en.key.generation);
    if (en.has_state) slot_owner_[slot.value] = detail::npos32;
    if (missed && forget(en.leg.hash)) ++hashes_retracted_;
    resolutions_.push_back(LoadResolution{en.key, kind, missed, en.orphaned, en.status == Status::in_flight});
    en.status = Status::free;
    en.orphaned = false;
    en.link_prev = detail::npos32;
    en.link_next = free_entry_;
    free_entry_ = e;
    if (release) release_slot(slot);
  }

  void release_slot(SlotId slot) noexcept {
    ++slots_released_;
    try {
      release_(slot);
    } catch (...) {
      ++slot_release_errors_;
    }
  }

  // Keeps the orphan list sorted by orphan time, so reclaim can stop at the first young
  // orphan. With a monotonic clock every new orphan goes at the tail in O(1).
  void orphan_link_sorted(std::uint32_t e) noexcept {
    std::uint32_t after = orphan_tail_;
    while (after != detail::npos32 && entries_[e].orphaned_at < entries_[after].orphaned_at) {
      ++own_walks_;
      after = entries_[after].link_prev;
    }
    const std::uint32_t before = after == detail::npos32 ? orphan_head_ : entries_[after].link_next;
    entries_[e].link_prev = after;
    entries_[e].link_next = before;
    if (after == detail::npos32) orphan_head_ = e; else entries_[after].link_next = e;
    if (before == detail::npos32) orphan_tail_ = e; else entries_[before].link_prev = e;
    ++orphan_count_;
  }

  // The in-flight list, in dispatch order, for report_overdue. With a monotonic clock a
  // dispatch appends at the tail in O(1); a clock that went back walks back k entries.
  void flight_link_sorted(std::uint32_t e) noexcept {
    std::uint32_t after = flight_tail_;
    while (after != detail::npos32 && entries_[e].dispatched_at < entries_[after].dispatched_at) {
      ++own_walks_;
      after = entries_[after].flight_prev;
    }
    const std::uint32_t before = after == detail::npos32 ? flight_head_ : entries_[after].flight_next;
    entries_[e].flight_prev = after;
    entries_[e].flight_next = before;
    if (after == detail::npos32) flight_head_ = e; else entries_[after].flight_next = e;
    if (before == detail::npos32) flight_tail_ = e; else entries_[before].flight_prev = e;
    ++flight_count_;
  }

  void flight_unlink(std::uint32_t e) noexcept {
    Entry& en = entries_[e];
    if (en.flight_prev == detail::npos32) flight_head_ = en.flight_next; else entries_[en.flight_prev].flight_next = en.flight_next;
    if (en.flight_next == detail::npos32) flight_tail_ = en.flight_prev; else entries_[en.flight_next].flight_prev = en.flight_prev;
    en.flight_prev = en.flight_next = detail::npos32;
    --flight_count_;
  }

  void orphan_unlink(std::uint32_t e) noexcept {
    Entry& en = entries_[e];
    if (en.link_prev == detail::npos32) orphan_head_ = en.link_next; else entries_[en.link_prev].link_next = en.link_next;
    if (en.link_next == detail::npos32) orphan_tail_ = en.link_prev; else entries_[en.link_next].link_prev = en.link_prev;
    en.link_prev = en.link_next = detail::npos32;
    --orphan_count_;
  }

  // detail::TicketSink
  std::optional<StateSpec> ticket_dispatch(std::uint32_t e, LoadKey key) noexcept override {
    if (e >= entries_.size() || entries_[e].key != key || entries_[e].status != Status::ticketed) return std::nullopt;
    Entry& en = entries_[e];
    en.status = Status::in_flight;
    en.dispatched_at = Clock::now();
    flight_link_sorted(e);
    ++in_flight_;
    if (!en.has_state) return std::nullopt;
    return en.leg.spec();
  }

  void ticket_abandon(std::uint32_t e, LoadKey key) noexcept override {
    if (e >= entries_.size() || entries_[e].key != key || entries_[e].status != Status::ticketed) return;
    resolve(e, Resolution::abandoned, false);
  }

  bool save_ticket_dispatch(StoreKey key) noexcept override {
    const std::uint32_t v = saves_.find(key);
    if (v == detail::npos32 || (v & save_dispatched_bit) != 0) return false;
    // Same size before and after: the re-insert cannot allocate.
    (void)saves_.erase(key);
    saves_.insert(key, v | save_dispatched_bit);
    return true;
  }

  void save_ticket_abandon(StoreKey key) noexcept override {
    const std::uint32_t v = saves_.find(key);
    if (v == detail::npos32 || (v & save_dispatched_bit) != 0) return;
    (void)saves_.erase(key);
    ++saves_abandoned_;
  }

  OffloadIndexOptions options_;
  SlotRelease release_;
  detail::LruHashSet hashes_;
  GenerationSource generations_;

  std::vector<Entry> entries_;                      // pooled load entries, addressed by index
  std::uint32_t free_entry_ = detail::npos32;       // free list through Entry::link_next
  detail::FlatIndexMap<Generation> keys_;           // generation -> outstanding entry (R3: the key of truth)
  detail::FlatIndexMap<RequestId> requests_;        // request -> its live (non-orphaned) entry
  std::vector<std::uint32_t> slot_owner_;           // slot -> outstanding entry holding it
  detail::FlatIndexMap<StoreKey> saves_;            // outstanding saves -> kind and dispatched bits
  std::vector<LoadResolution> resolutions_;         // the settlement queue the scheduler drains
  std::vector<LoadKey> forgotten_;                  // in-flight keys resolved without their ranks
  std::uint32_t flight_head_ = detail::npos32;      // earliest dispatched load still in flight
  std::uint32_t flight_tail_ = detail::npos32;      // latest
  std::uint64_t flight_count_ = 0;                  // kept by the list code, audited against in_flight_
  std::uint32_t orphan_head_ = detail::npos32;      // oldest orphan
  std::uint32_t orphan_tail_ = detail::npos32;      // newest orphan
  std::uint64_t orphan_count_ = 0;                  // kept by the list code, audited against orphaned_

  std::uint64_t dispatched_ = 0, in_flight_ = 0, completed_ = 0, failed_ = 0, abandoned_ = 0, reclaimed_ = 0;
  std::uint64_t outstanding_ = 0, orphaned_ = 0, late_reports_ = 0, refused_ = 0;
  std::uint64_t indexed_ = 0, hashes_evicted_ = 0, hashes_retracted_ = 0, hashes_dropped_ = 0;
  std::uint64_t slots_released_ = 0, slot_release_errors_ = 0;
  std::uint64_t overdue_ = 0;
  std::uint64_t saves_issued_ = 0, saves_released_ = 0, saves_stored_ = 0, saves_failed_ = 0, saves_abandoned_ = 0;
  std::uint64_t saves_refused_ = 0;
  mutable std::uint64_t invariant_violations_ = 0;
  mutable std::uint64_t own_walks_ = 0;
};

}  // namespace kvfuse
