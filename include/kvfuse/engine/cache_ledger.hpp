// kvfuse/engine/cache_ledger.hpp — CacheLedger, the one owner of what a byte budget keeps
// (docs/reference.md#cache-ledger).
//
// A tier that evicts by its own LRU and an index that counts state in hashes do not talk:
// the index serves a hash the tier dropped, or keeps out one it still holds. The ledger is
// the engine side's account of every KV chunk and state checkpoint stored, in bytes: each
// store goes through it, it picks what goes by the cache policy (cache_policy.hpp) and hands
// each victim to the caller, who erases it from the tiers and the index. The tiers then hold
// at most what the ledger keeps; a tier that still drops an entry on its own (another engine
// sharing it, Redis maxmemory) is told back with forget(), and the ledger heals.
//
// Threading: not thread-safe. One thread (the scheduler) owns a ledger and calls every
// member; nothing in it blocks or waits. store() allocates (a node per kept entry; the
// save path, never the load path); use(), forget(), contains(), facts() and stats() never
// allocate and are noexcept (a use re-files its node by extract and insert, no new node).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/engine/detail/lru_hash_set.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Names one entry of the ledger: a KV chunk or a checkpoint, by its chained prefix hash.
struct CacheKey {
  PrefixHash hash;
  EntryKind kind = EntryKind::kv_chunk;
  friend constexpr bool operator==(const CacheKey&, const CacheKey&) noexcept = default;
};

/// One store, as the caller knows it.
struct CacheEntry {
  CacheKey key;
  std::optional<CacheKey> needs;   ///< the entry it is useless without (the chunk below; a checkpoint's last chunk), if any
  std::uint64_t bytes = 0;         ///< what it holds in the budget (> 0): one rank's slice, or all ranks', as the budget is
  std::uint64_t saved_tokens = 0;  ///< prefill a use spares (CacheFacts::saved_tokens)
  std::uint64_t stands_on = 0;     ///< bytes of the KV its saving needs kept too (a checkpoint's prefix); 0 for KV
  bool prompt_end = false;         ///< a checkpoint at its prompt's last chunk boundary (CacheAdmission::prompt_end)
};

/// What store() did.
enum class CacheVerdict : std::uint8_t {
  admitted,            ///< it is kept now (evicting what had to go)
  already_kept,        ///< it was kept: counted as a use
  refused_first_seen,  ///< `cost`: a heavy checkpoint never seen before, not at its prompt's end (or, kv_on_second_sight, a KV chunk never seen before), which fits only by evicting
  refused_too_large,   ///< larger than the whole budget
};

/// Stable name of a CacheVerdict. Thread-safe, noexcept.
constexpr std::string_view to_string(CacheVerdict v) noexcept {
  switch (v) {
    case CacheVerdict::admitted: return "admitted";
    case CacheVerdict::already_kept: return "already_kept";
    case CacheVerdict::refused_first_seen: return "refused_first_seen";
    case CacheVerdict::refused_too_large: return "refused_too_large";
  }
  return "unknown_cache_verdict";
}

/// Construction options of CacheLedger.
struct CacheLedgerOptions {
  CachePolicy policy = CachePolicy::lru;
  std::uint64_t budget_bytes = 0;           ///< what may be kept at once; must be > 0
  std::size_t seen_capacity = std::size_t{1} << 16;  ///< checkpoint keys remembered for admission (and as many KV keys with kv_on_second_sight), in [1, 2^31]
  /// `cost`: a first-seen checkpoint at most this large comes in under pressure (0: none
  /// does). The replay sets two KV chunks: a state that small is worth the gamble.
  std::uint64_t light_state_bytes = 0;
  /// `cost`: a KV chunk never seen before comes in only when it fits without an eviction
  /// (CacheAdmission::kv_on_second_sight); its key is remembered, in a set of seen_capacity
  /// KV keys of its own, for the second sight. For a dense model: off, a stateful model's
  /// checkpoints would lose the KV they stand on (docs/replay.md#cache-policy).
  bool kv_on_second_sight = false;
};

/// Every counter of a ledger, read in O(1).
///
/// Identities: bytes == kv_bytes + state_bytes <= budget_bytes; entries == admitted -
/// evicted_kv - evicted_state - forgotten.
struct CacheLedgerStats {
  std::uint64_t budget_bytes = 0;
  std::uint64_t entries = 0;        ///< kept now
  std::uint64_t bytes = 0;          ///< kept now
  std::uint64_t kv_bytes = 0;
  std::uint64_t state_bytes = 0;
  std::uint64_t admitted = 0;
  std::uint64_t already_kept = 0;
  std::uint64_t evicted_kv = 0;
  std::uint64_t evicted_state = 0;
  std::uint64_t refused_first_seen = 0;
  std::uint64_t refused_too_large = 0;
  std::uint64_t uses = 0;           ///< use() calls that found the entry
  std::uint64_t forgotten = 0;      ///< forget() calls that found the entry (a tier dropped it on its own)
  friend constexpr bool operator==(const CacheLedgerStats&, const CacheLedgerStats&) = default;
};

/// The owner of a byte budget over KV chunks and checkpoints (see the header comment).
/// Single-threaded: the owning thread calls every member.
class CacheLedger {
 public:
  /// Throws Error(invalid_argument) naming `budget_bytes` (zero), `policy` (out of range) or
  /// `seen_capacity` (outside [1, 2^31]).
  explicit CacheLedger(const CacheLedgerOptions& o)
      : o_(checked(o)),
        filing_(Order{o.policy}),
        seen_(o.seen_capacity, false),
        seen_kv_(second_sight() ? o.seen_capacity : 1, false) {
    stats_.budget_bytes = o.budget_bytes;
  }
  CacheLedger(const CacheLedger&) = delete;
  CacheLedger& operator=(const CacheLedger&) = delete;

  /// Stores `e` if the policy admits it, calling `on_evict(const CacheKey&)` once for each
  /// entry evicted to make room, before it returns (the caller erases those from its tiers
  /// and index; they are gone from the ledger when it is called). An entry already kept is
  /// a use. Throws only what allocation throws (std::bad_alloc), leaving the ledger as it
  /// was before the call but for the victims already handed out. O(log n) per victim.
  template <class OnEvict>
  CacheVerdict store(const CacheEntry& e, OnEvict&& on_evict) {
    if (use(e.key)) {
      ++stats_.already_kept;
      return CacheVerdict::already_kept;
    }
    const std::uint64_t bytes = e.bytes == 0 ? 1 : e.bytes;
    // First sightings: a checkpoint's always, a KV chunk's when it comes in on second sight.
    const bool state = e.key.kind == EntryKind::state;
    detail::LruHashSet* sightings = state ? &seen_ : second_sight() ? &seen_kv_ : nullptr;
    const bool seen = sightings != nullptr && sightings->contains(e.key.hash);
    if (sightings != nullptr) (void)sightings->insert_or_touch(e.key.hash);
    if (bytes > o_.budget_bytes) {
      ++stats_.refused_too_large;
      return CacheVerdict::refused_too_large;
    }
    const bool fits = stats_.bytes + bytes <= o_.budget_bytes;
    if (!cache_admits(o_.policy, CacheAdmission{e.key.kind, fits, seen, bytes <= o_.light_state_bytes, e.prompt_end,
                                                o_.kv_on_second_sight})) {
      ++stats_.refused_first_seen;
      return CacheVerdict::refused_first_seen;
    }
    // The entry it needs is not a victim of its own store: link first, then evict. The new
    // node is in the table (a victim it needs may unlink from it) but not yet filed.
    Node& n = nodes_.try_emplace(e.key).first->second;
    n.needs = e.needs;
    n.facts.kind = e.key.kind;
    n.facts.bytes = bytes;
    n.facts.saved_tokens = e.saved_tokens;
    n.facts.footprint = bytes + e.stands_on;
    if (e.needs) link(*e.needs, +1);
    while (stats_.bytes + bytes > o_.budget_bytes && evict_first(on_evict)) {
    }
    if (stats_.bytes + bytes > o_.budget_bytes) {
      // `cost` and everything left is what this entry stands on: it cannot be kept usefully.
      const std::optional<CacheKey> needs = n.needs;
      nodes_.erase(e.key);
      if (needs) unlink(*needs);
      ++stats_.refused_too_large;
      return CacheVerdict::refused_too_large;
    }
    n.facts.needed_by = needers_of(e.key);
    n.facts.hits = 0;
    n.facts.last_use = ++clock_;
    n.facts.priority = cache_priority(n.facts.kind, n.facts.saved_tokens, 0, n.facts.footprint, inflation_);
    filing_.insert(filed(e.key, n));
    account(n.facts, +1);
    ++stats_.admitted;
    return CacheVerdict::admitted;
  }

  /// A load read `k`: one more hit, most recent, a new priority. Returns whether it is kept.
  /// Noexcept, no allocation. O(log n).
  bool use(const CacheKey& k) noexcept {
    const auto it = nodes_.find(k);
    if (it == nodes_.end()) return false;
    Node& n = it->second;
    auto handle = filing_.extract(filed(k, n));
    ++n.facts.hits;
    n.facts.last_use = ++clock_;
    n.facts.priority = cache_priority(n.facts.kind, n.facts.saved_tokens, n.facts.hits, n.facts.footprint, inflation_);
    refile(k, n, std::move(handle));
    ++stats_.uses;
    return true;
  }

  /// A tier no longer holds `k` (it evicted it on its own, or a load found it missing): the
  /// ledger drops it without calling anyone. Returns whether it was kept. Noexcept, O(log n).
  bool forget(const CacheKey& k) noexcept {
    const auto it = nodes_.find(k);
    if (it == nodes_.end()) return false;
    drop(it);
    ++stats_.forgotten;
    return true;
  }

  /// Whether `k` is kept. Noexcept, O(1) expected.
  [[nodiscard]] bool contains(const CacheKey& k) const noexcept { return nodes_.find(k) != nodes_.end(); }

  /// The facts the policy weighs of `k`, if kept. Noexcept.
  [[nodiscard]] std::optional<CacheFacts> facts(const CacheKey& k) const noexcept {
    const auto it = nodes_.find(k);
    if (it == nodes_.end()) return std::nullopt;
    return it->second.facts;
  }

  /// Calls f(const CacheKey&, const CacheFacts&) for each kept entry, in no order. O(n).
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [k, n] : nodes_) f(k, n.facts);
  }

  /// The inflation value L: the highest priority `cost` evicted so far (0 before any).
  [[nodiscard]] double inflation() const noexcept { return inflation_; }
  [[nodiscard]] CachePolicy policy() const noexcept { return o_.policy; }
  /// Every counter, O(1), noexcept.
  [[nodiscard]] CacheLedgerStats stats() const noexcept { return stats_; }

 private:
  struct KeyHash {
    std::size_t operator()(const CacheKey& k) const noexcept {
      return std::hash<std::uint64_t>{}(k.hash.value * 2 + (k.kind == EntryKind::state ? 1 : 0));
    }
  };
  struct Node {
    CacheFacts facts;
    std::optional<CacheKey> needs;
  };
  // Every kept entry is filed, the ones the policy may not evict (pinned: `cost`, needed by
  // a kept entry) last, the others in the order the policy evicts them. Keeping the pinned
  // ones filed too means a change of facts is always extract, edit, insert of the same set
  // node: use(), forget() and the unlinking never allocate. last_use is unique among kept
  // entries (every store and use ticks the clock), so the order is total.
  struct Filed {
    bool pinned = false;
    double priority = 0;
    std::uint64_t last_use = 0;
    CacheKey key;
  };
  struct Order {
    CachePolicy policy;
    bool operator()(const Filed& a, const Filed& b) const noexcept {
      if (a.pinned != b.pinned) return b.pinned;
      if (policy == CachePolicy::cost && a.priority != b.priority) return a.priority < b.priority;
      return a.last_use < b.last_use;
    }
  };
  using Filing = std::set<Filed, Order>;
  using Table = std::unordered_map<CacheKey, Node, KeyHash>;

  static CacheLedgerOptions checked(const CacheLedgerOptions& o) {
    if (o.budget_bytes == 0) throw Error(ErrorCode::invalid_argument, "CacheLedgerOptions::budget_bytes is 0: a budget must hold something");
    if (o.policy != CachePolicy::lru && o.policy != CachePolicy::cost)
      throw Error(ErrorCode::invalid_argument,
                  "CacheLedgerOptions::policy " + std::to_string(static_cast<int>(o.policy)) + " is not a CachePolicy");
    if (o.seen_capacity == 0 || o.seen_capacity > (std::size_t{1} << 31))
      throw Error(ErrorCode::invalid_argument,
                  "CacheLedgerOptions::seen_capacity " + std::to_string(o.seen_capacity) + " is outside [1, 2^31]");
    return o;
  }

  [[nodiscard]] bool second_sight() const noexcept { return o_.policy == CachePolicy::cost && o_.kv_on_second_sight; }

  [[nodiscard]] Filed filed(const CacheKey& k, const Node& n) const noexcept {
    return Filed{!cache_evictable(o_.policy, n.facts), n.facts.priority, n.facts.last_use, k};
  }

  // Files a node again after its facts changed, in the set node extracted before the change
  // (empty only for the entry store() has not filed yet: it is filed at the end of store).
  void refile(const CacheKey& k, const Node& n, Filing::node_type handle) noexcept {
    if (handle.empty()) return;
    handle.value() = filed(k, n);
    filing_.insert(std::move(handle));
  }

  [[nodiscard]] std::uint32_t needers_of(const CacheKey& k) const noexcept {
    const auto it = needers_.find(k);
    return it == needers_.end() ? 0 : it->second;
  }

  // One more (+1, store only: the count may allocate) or one fewer (-1, never allocates)
  // kept entry needs `parent`, kept or not.
  void link(const CacheKey& parent, int delta) {
    if (delta > 0) {
      ++needers_[parent];
    } else if (const auto c = needers_.find(parent); c != needers_.end() && --c->second == 0) {
      needers_.erase(c);
    }
    const auto it = nodes_.find(parent);
    if (it == nodes_.end()) return;
    Node& p = it->second;
    auto handle = filing_.extract(filed(parent, p));
    p.facts.needed_by = needers_of(parent);
    refile(parent, p, std::move(handle));
  }

  // Evicts the first evictable entry and hands it to on_evict; false when none is.
  template <class OnEvict>
  bool evict_first(OnEvict& on_evict) {
    if (filing_.empty() || filing_.begin()->pinned) return false;
    const Filed victim = *filing_.begin();
    // Leaves only: an entry pinned for a while can come free below L, and L never falls.
    if (o_.policy == CachePolicy::cost && victim.priority > inflation_) inflation_ = victim.priority;
    if (victim.key.kind == EntryKind::state) ++stats_.evicted_state;
    else ++stats_.evicted_kv;
    drop(nodes_.find(victim.key));
    on_evict(victim.key);
    return true;
  }

  void drop(Table::iterator it) noexcept {
    const CacheKey k = it->first;
    Node& n = it->second;
    (void)filing_.extract(filed(k, n));  // the handle frees the set node
    account(n.facts, -1);
    const std::optional<CacheKey> needs = n.needs;
    nodes_.erase(it);
    if (needs) unlink(*needs);
  }
  void unlink(const CacheKey& parent) noexcept { link(parent, -1); }

  void account(const CacheFacts& f, int sign) noexcept {
    std::uint64_t& by_kind = f.kind == EntryKind::state ? stats_.state_bytes : stats_.kv_bytes;
    if (sign > 0) {
      by_kind += f.bytes;
      stats_.bytes += f.bytes;
      ++stats_.entries;
    } else {
      by_kind -= f.bytes;
      stats_.bytes -= f.bytes;
      --stats_.entries;
    }
  }

  CacheLedgerOptions o_;
  std::unordered_map<CacheKey, Node, KeyHash> nodes_;
  std::unordered_map<CacheKey, std::uint32_t, KeyHash> needers_;  // kept entries naming each key as `needs`, kept or not
  Filing filing_;
  detail::LruHashSet seen_;     // checkpoint keys stored, refused or evicted: `cost` admits them under pressure
  detail::LruHashSet seen_kv_;  // KV keys likewise, kv_on_second_sight only (one slot's worth otherwise)
  double inflation_ = 0;
  std::uint64_t clock_ = 0;
  CacheLedgerStats stats_{};
};

}  // namespace kvfuse
