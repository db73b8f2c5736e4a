// kvfuse/engine/index_options.hpp — what an OffloadIndex is built with: its clock policy,
// its options, and the slot-free callback; and what it reports: IndexStats.
//
// Threading: plain data and pure functions; thread-safe.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/capability.hpp>

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

/// Which indexed state hash goes when the index is at its cap.
enum class HashEviction : std::uint8_t {
  lru,            ///< the least recently used
  spared_tokens,  ///< the lightest of the 8 least recently used: the checkpoint that spares the fewest
                  ///< tokens of prefill (its boundary) goes first; every state entry of a model has the
                  ///< same size, so this is Marconi's tokens-spared-per-byte order (docs/reference.md)
};

/// Stable name of a HashEviction ("lru", "spared_tokens"). Thread-safe, noexcept.
constexpr std::string_view to_string(HashEviction e) noexcept {
  switch (e) {
    case HashEviction::lru: return "lru";
    case HashEviction::spared_tokens: return "spared_tokens";
  }
  return "unknown_hash_eviction";
}

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
  bool role_loads = true;
  /// False: there is no state tier; a load with a state leg is refused with no_state_tier.
  bool state_tier = true;
  /// Allocate the whole hash table at construction, so note_stored never allocates.
  bool preallocate_hashes = false;
  /// Which hash goes at the cap; an out-of-range value is refused at construction.
  HashEviction hash_eviction = HashEviction::lru;
  /// The last generation an earlier incarnation issued: generations continue after it.
  Generation last_issued{};
};

/// Options for an engine with the given capability and slot pool: loads only where the
/// role loads, state legs only where the state tier exists. Thread-safe.
inline OffloadIndexOptions index_options_for(const Capability& cap, std::uint32_t slot_count) {
  OffloadIndexOptions o;
  o.slot_count = slot_count;
  o.role_loads = cap.kv_can_load;
  o.state_tier = cap.state_can_load;
  return o;
}

/// Returns a torn-down request's slot to the engine's allocator. OffloadIndex calls it
/// exactly once per orphaned state-leg load, on the scheduler thread, after its own state
/// is updated. It must not call back into the index. It should not throw: an exception is
/// caught, counted in IndexStats::slot_free_errors, and the slot counts as released.
using SlotFree = std::function<void(SlotId)>;

/// One load reported by OffloadIndex::report_overdue: in flight for at least the threshold.
struct OverdueLoad {
  LoadKey key;
  std::chrono::nanoseconds age{};  ///< time since dispatch()
  bool orphaned = false;           ///< its request was torn down (reclaim will age it out)
};

/// Every counter of the index, read in O(1) by OffloadIndex::stats().
///
/// Identities audited on every read: issued == completed + failed + abandoned +
/// outstanding; reclaimed <= abandoned; outstanding == entries in the key table;
/// in_flight == length of the dispatch-ordered list; indexed == hashes in the buckets ==
/// LRU length; orphaned == orphan list length; saves_issued == saves_stored +
/// saves_failed + saves_abandoned + saves_outstanding.
struct IndexStats {
  std::uint64_t issued = 0;        ///< load tickets issued by request_load (admissions)
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
  std::uint64_t slots_freed = 0;    ///< orphan slots let go (through the slot-free callback, when the index has one)
  std::uint64_t slot_free_errors = 0;  ///< slot-free callbacks that threw
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

}  // namespace kvfuse
